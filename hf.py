"""Hugging Face Llama checkpoints in and out: config.json <-> LlamaConfig, tensor names, each rank reading only
its own stage's tensors from the safetensors files, and writing a directory that transformers loads.

model.py computes what transformers' LlamaForCausalLM computes, with the same tensor names but for one prefix
("model." there, "base_model." here) and the same RoPE layout (rotate-half), so weights need no permutation:
reading and writing go through torch.distributed.checkpoint's Hugging Face storage, which reads only the
requested tensors (slices of them, for FSDP's shards) and casts them to the model's dtype.
"""

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from model import LlamaConfig
from runtime import UsageError

OURS, THEIRS = "base_model.", "model."
# transformers' LlamaConfig defaults, for fields a config.json leaves out (configuration_llama.py).
DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "initializer_range": 0.02}


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(path))


def to_hf(name: str) -> str:
    return THEIRS + name[len(OURS):] if name.startswith(OURS) else name


# ----------------------------------------------------------------------------------------------------------
# config.json

def read_config(path: str, flag: str = "--init-from") -> LlamaConfig:
    """The LlamaConfig of a Hugging Face directory; what model.py does not compute is refused in one line."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {path}: cannot read config.json ({e})") from None
    return llama_config(hf, f"{flag} {path}")


def llama_config(hf: dict, source: str) -> LlamaConfig:
    def refuse(field, why):
        raise UsageError(f"{source}: config.json {field} = {json.dumps(hf.get(field))}: {why}; this project trains "
                         "Llama models (model.py) only")

    if hf.get("model_type") != "llama":
        refuse("model_type", "not llama")
    for field, supported in {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}.items():
        if hf.get(field, supported) != supported:
            refuse(field, f"only {json.dumps(supported)} is implemented")
    if hf.get("attention_dropout", 0.0):
        refuse("attention_dropout", "dropout is not implemented")
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 writes both into rope_parameters.
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    theta = hf.get("rope_theta", rope.pop("rope_theta", DEFAULTS["rope_theta"]))
    rope.pop("rope_theta", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(field, "partial rotary embeddings are not implemented")
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(key not in rope for key in keys):
            refuse(field, f"llama3 scaling needs {', '.join(keys)}")
        scaling = {"rope_type": "llama3", **{key: rope[key] for key in keys}}
    else:
        refuse(field, f"rope_type {rope_type} is not implemented (only default and llama3)")
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"), rope_theta=float(theta), rope_scaling=scaling,
            **{key: hf.get(key, default) for key, default in DEFAULTS.items() if key != "rope_theta"})
    except KeyError as e:
        raise UsageError(f"{source}: config.json has no {e.args[0]}") from None
    except ValueError as e:
        raise UsageError(f"{source}: config.json: {e}") from None


def hf_config(config: LlamaConfig, tokenizer, dtype: torch.dtype) -> dict:
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
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }


# ----------------------------------------------------------------------------------------------------------
# Tensors

def checkpoint_keys(path: str) -> set[str]:
    """The tensor names in a Hugging Face directory (its index, or the headers of its safetensors files)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    from safetensors import safe_open

    keys = set()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                keys |= set(f.keys())
    return keys


def stage_request(path: str, state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, str]:
    """Their name for each of a stage's tensors (this project's names). A tied checkpoint stores the head's
    matrix once, as the embedding: a stage holding only the head reads it from there."""
    available = checkpoint_keys(path)
    request = {}
    for name in state:
        key = to_hf(name)
        if key not in available and name == "lm_head.weight" and config.tie_word_embeddings:
            key = to_hf("base_model.embed_tokens.weight")
        if key not in available:
            raise UsageError(f"--init-from {path}: no tensor {key} in its safetensors files; is it the Llama "
                             "checkpoint that config.json describes?")
        request[name] = key
    return request


def load(path: str, request: dict[str, str], state: dict[str, torch.Tensor], no_dist: bool = False) -> None:
    """Fill a stage's tensors (plain tensors or FSDP's DTensor shards) in place from the Hugging Face directory
    at path, reading only those (stage_request names them). Collective over the ranks, like any DCP load."""
    targets = {}  # their name -> our tensors; two when a rank holds a tied embedding and its head's copy
    for name, tensor in state.items():
        targets.setdefault(request[name], []).append(tensor)
    dcp.load({key: tensors[0] for key, tensors in targets.items()}, storage_reader=HuggingFaceStorageReader(path),
             no_dist=no_dist)
    for tensors in targets.values():
        for copy in tensors[1:]:
            copy.copy_(tensors[0])


def save(path: str, state: dict[str, torch.Tensor], config: LlamaConfig, tokenizer, dtype: torch.dtype,
         max_shard_bytes: int) -> list[str]:
    """Write the full model's state dict (this project's names) as a Hugging Face directory: safetensors files
    of at most max_shard_bytes each (DCP's Hugging Face writer, which also writes the index), config.json,
    tokenizer.json and tokenizer_config.json. One process. Returns the files written."""
    tensors = {to_hf(name): t.to(dtype) for name, t in state.items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}  # tied: stored once
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
        json.dump(hf_config(config, tokenizer, dtype), f, indent=1)
    tokenizer.save(path, add_bos=True, model_max_length=config.max_position_embeddings)
    return sorted(os.listdir(path))
