"""Export the whole model of a training run's checkpoint for use on one process, without this project: one
torch.save file for model.py (with OUT.pt.config.json and OUT.pt.tokenizer.json beside it), or a Hugging Face
directory that transformers' from_pretrained loads. CHECKPOINT is a step-N directory, or a run's
--checkpoint-dir (its newest checkpoint).

    python export.py CHECKPOINT OUT.pt              # for model.py
    python export.py CHECKPOINT OUT_DIR --format hf  # for transformers
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

import checkpoint
from checkpoint import Parser, UsageError
from model import LlamaConfig, LlamaForPretraining, hf_name


def full_model_state(path: str) -> tuple[dict, LlamaConfig]:
    """The whole model's weights from the checkpoint at path, on this one process (no process group)."""
    meta = checkpoint.read_meta(path, "checkpoint")
    checkpoint.verify_files(path, meta, "checkpoint")
    config = LlamaConfig(**meta["config"])
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device="cpu")  # every saved tensor is loaded below; buffers are not part of the export
    model.tie_weights()
    state, saved_as = checkpoint.state_dicts(model, None, config)
    checkpoint.load_dcp(state, path, no_dist=True, flag="checkpoint")
    return {key: state["model"][name] for key, name in saved_as["model"].items()}, config


def export(source: str, output: str, format: str = "pt", dtype: torch.dtype = torch.float32,
           max_shard_bytes: int = 5 * 2**30, force: bool = False) -> str:
    """Write the full model of a checkpoint (or of a --checkpoint-dir's newest) as format "pt" or "hf"; returns
    the checkpoint's path. Never into, over or around the checkpoint; over an existing output only with force and
    if it is an earlier export. Written under temporary names, then renamed: a failure leaves what was there."""
    outputs = [output] if format == "hf" else [output, output + ".config.json", output + ".tokenizer.json"]
    read = os.path.realpath(source)
    for written in outputs:  # never over what is read, whatever the flags
        target = os.path.realpath(written)
        if os.path.commonpath([target, read]) in (target, read):
            raise UsageError(f"{written}: it is, holds or lies inside the checkpoint {source} that is exported; "
                             "give an output outside it")
    if existing := [p for p in outputs if os.path.lexists(p)]:
        what = "directory" if format == "hf" else "file name"
        if not force:
            raise UsageError(f"{existing[0]} exists; give a new {what}, or add --force to replace an earlier export")
        if not _exported(outputs, format):
            raise UsageError(f"{existing[0]} exists and is not an earlier export (--force replaces only those); "
                             f"give a new {what}")
    path = checkpoint.resolve(source)
    state, config = full_model_state(path)
    tokens = special_tokens(path)  # its tokenizer files checked before anything is written
    tmp = {p: f"{p}.tmp{os.getpid()}" for p in outputs}
    try:
        if format == "hf":
            save_hf(tmp[output], state, config, path, dtype, max_shard_bytes, tokens)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            torch.save({key: t.to(dtype) for key, t in state.items()}, tmp[output])
            with open(tmp[output + ".config.json"], "w") as f:
                json.dump(dataclasses.asdict(config), f, indent=1)
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                shutil.copyfile(os.path.join(path, "tokenizer.json"), tmp[output + ".tokenizer.json"])
        for final, written in tmp.items():  # --force: over an earlier export (_exported), all of it
            if format == "hf" and os.path.isdir(final):
                shutil.rmtree(final)
            if os.path.lexists(written):
                os.replace(written, final)
            elif os.path.lexists(final):  # an earlier export's tokenizer, of a checkpoint that had one
                os.remove(final)
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a full disk as a RuntimeError
        raise UsageError(f"cannot write {output} ({checkpoint.root_cause(e)}); choose another output") from None
    finally:  # a failed export leaves nothing of its own behind
        for written in tmp.values():
            if os.path.isdir(written):
                shutil.rmtree(written, ignore_errors=True)
            elif os.path.lexists(written):
                os.remove(written)
    return path


def _exported(outputs: list[str], format: str) -> bool:
    """Whether outputs are an earlier export, recognised by its config: exactly the fields an export writes (pt:
    OUTPUT.config.json beside it, each output a file or absent; hf: config.json, among only the files an export
    writes)."""
    output = outputs[0]
    config = output + ".config.json" if format == "pt" else os.path.join(output, "config.json")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)} if format == "pt" else \
        set(hf_config(LlamaConfig(), 0, 0, None, torch.float32))
    try:
        if set(checkpoint.read_json(config)) != fields:
            return False
    except (OSError, ValueError, TypeError):
        return False
    if format == "pt":  # never a directory or a link: --force would replace it, or what it points to
        return all(os.path.isfile(p) and not os.path.islink(p) for p in outputs if os.path.lexists(p))
    return os.path.isdir(output) and not os.path.islink(output) and all(
        re.fullmatch(r"config\.json|tokenizer(_config)?\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", n)
        for n in os.listdir(output))


def hf_config(config: LlamaConfig, bos_id: int, eos_id: int, pad_id: int | None, dtype: torch.dtype) -> dict:
    """config.json for transformers 4 and 5 alike: every field written out (a missing one would silently take
    transformers' default, e.g. rms_norm_eps 1e-6), RoPE in the rope_theta + rope_scaling form both read."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings, "initializer_range": config.initializer_range,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }


def save_hf(path: str, state: dict[str, torch.Tensor], config: LlamaConfig, checkpoint_path: str,
            dtype: torch.dtype, max_shard_bytes: int, tokens: dict) -> None:
    """The full model's state dict as a Hugging Face directory: safetensors files of at most max_shard_bytes
    (DCP's Hugging Face writer, which writes the index too), config.json and the checkpoint's tokenizer files."""
    tensors = {hf_name(name): t.to(dtype) for name, t in state.items()
               if not (config.tie_word_embeddings and name == checkpoint.HEAD)}  # tied: stored once
    files, size, mapping = 1, 0, {}
    for key, tensor in tensors.items():  # fill files in order, a new one when the next tensor would overflow
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            files, size = files + 1, 0
        mapping[key], size = files, size + nbytes
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():  # DCP warns that it saves from one process, which is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(path, fqn_to_index_mapping=mapping), no_dist=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config, tokens.get("bos_id"), tokens.get("eos_id"), tokens.get("pad_id"), dtype), f,
                  indent=1)
    for name in checkpoint.TOKENIZER_FILES:  # prepare_data.py wrote them to put bos first, as in training
        if os.path.isfile(os.path.join(checkpoint_path, name)):
            shutil.copyfile(os.path.join(checkpoint_path, name), os.path.join(path, name))
    _set_max_length(os.path.join(path, "tokenizer_config.json"), config.max_position_embeddings)


def special_tokens(directory: str, flag: str = "checkpoint") -> dict:
    """{"bos_id", "eos_id", "pad_id"} of the tokenizer files in directory (the names in tokenizer_config.json,
    their ids in tokenizer.json); {} without both files. A field of another type: one line naming it."""
    if not all(os.path.isfile(os.path.join(directory, name)) for name in checkpoint.TOKENIZER_FILES):
        return {}
    tokenizer = checkpoint.read_tokenizer(directory, flag)
    try:
        named = checkpoint.read_json(os.path.join(directory, "tokenizer_config.json"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {directory}: cannot read its tokenizer_config.json ({e})") from None
    if not isinstance(named, dict):
        raise UsageError(f"{flag} {directory}: its tokenizer_config.json is {checkpoint.shown(named)}, not an "
                         "object of fields")
    for key in ("bos_token", "eos_token", "pad_token"):
        token = named.get(key)
        if not (token is None or isinstance(token, str) or isinstance(token, dict) and isinstance(
                token.get("content"), str)):
            raise UsageError(f"{flag} {directory}: its tokenizer_config.json's {key} is {checkpoint.shown(token)}, "
                             "not a token")
    ids = {t["content"]: t["id"] for t in tokenizer.get("added_tokens") or []}
    ids.update((tokenizer.get("model") or {}).get("vocab") or {})

    def id_of(key):
        token = named.get(key)
        return ids.get(token.get("content") if isinstance(token, dict) else token)
    return {f"{kind}_id": id_of(f"{kind}_token") for kind in ("bos", "eos", "pad")}


def _set_max_length(path: str, length: int) -> None:
    if os.path.isfile(path):
        with open(path) as f:
            fields = json.load(f)
        with open(path, "w") as f:
            json.dump({**fields, "model_max_length": length}, f, indent=1)


def _size(text: str) -> int:
    """'5GB', '500MB', '2000000' -> bytes."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    unit = text[-2:].upper() if text[-2:].upper() in units else ""
    try:
        value = float(text[:-2] if unit else text) * units.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB or 500MB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="export.py", description=__doc__)
    p.add_argument("checkpoint", help="a run's --checkpoint-dir (its newest checkpoint) or one step-N directory")
    p.add_argument("output", help="pt: the file to write; hf: a new directory")
    p.add_argument("--format", choices=["pt", "hf"], default="pt",
                   help="pt: a torch.save state dict for model.py (+ OUTPUT.config.json, OUTPUT.tokenizer.json); "
                        "hf: a Hugging Face directory (config.json, safetensors, tokenizer) that "
                        "transformers.LlamaForCausalLM.from_pretrained loads")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written weights (training keeps float32)")
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="hf: the largest safetensors file")
    p.add_argument("--force", action="store_true", help="replace an earlier export at OUTPUT (and its .config.json, "
                                                       ".tokenizer.json); anything else there is never replaced")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        source = export(args.checkpoint, args.output, args.format, getattr(torch, args.dtype), args.max_shard_size,
                        args.force)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    extra = "" if args.format == "hf" else " (+ .config.json, .tokenizer.json)"
    print(f"exported {source} -> {args.output}{extra}")


if __name__ == "__main__":
    main()
