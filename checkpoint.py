"""Distributed checkpoints for pipeline-split models: atomic, exact to resume, loadable by any stage layout.

Each rank saves only what its stage holds, with `torch.distributed.checkpoint` (DCP), under the *full* model's
parameter names; no rank ever gathers the whole model. Because names do not depend on the split, a checkpoint
written with p stages loads into any other number of stages: each stage asks DCP for exactly its own keys.

Layout of a --checkpoint-dir:

    step-00000100/         a complete checkpoint
        __0_0.distcp ...   DCP shards: model and AdamW state of every stage, keyed by parameter name
        .metadata          DCP's index of the shards
        rng/rank0.pt ...   each rank's RNG states (restored when the stage layout is unchanged)
        tokenizer.json     the tokenizer the run used, so an export is self-contained
        meta.json          step, data position, model config, run arguments, stage layout, file sizes
    step-00000200.tmp/     a save in progress

A save writes everything into step-N.tmp, waits for every rank, writes meta.json last and renames the directory.
So a directory without .tmp is complete, a run killed mid-save leaves the previous checkpoints untouched, and
older checkpoints are deleted (beyond --keep-checkpoints) only after a newer one is complete.

Loading never unpickles arbitrary objects: DCP's index is read with an unpickler that accepts only DCP's own
metadata classes, and every torch.load uses weights_only=True.

    python checkpoint.py export CHECKPOINT_DIR OUTPUT_FILE

writes the full model's state dict to OUTPUT_FILE (plus OUTPUT_FILE.config.json and .tokenizer.json), for use
on one process without any process group.
"""

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

import data
import flags
import hf
from model import LlamaConfig, LlamaForPretraining, config_from_preset
from runtime import UsageError, collective_errors

_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Optimizer state and hyperparameters keyed by parameter name ("optim.state.<fqn>.exp_avg",
# "optim.param_groups.<fqn>.lr"). The default keys param groups by their index; every stage has a group 0 with
# different parameters in it, DCP keeps only one rank's copy of such a shared key, and the others lose theirs.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# ----------------------------------------------------------------------------------------------------------
# Finding checkpoints

def step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step-{step:08d}")


def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """Paths of the complete checkpoints in checkpoint_dir, oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    names = [n for n in os.listdir(checkpoint_dir)
             if _STEP_DIR.match(n) and os.path.isfile(os.path.join(checkpoint_dir, n, "meta.json"))]
    return [os.path.join(checkpoint_dir, n) for n in sorted(names)]


def latest(checkpoint_dir: str) -> str | None:
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def resolve(path: str, flag: str = "checkpoint") -> str:
    """A checkpoint given either itself or a run's --checkpoint-dir (then its newest complete checkpoint)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = latest(path)
    if found is None:
        raise UsageError(f"{flag} {path}: no complete checkpoint there (a step-N directory with meta.json, or a "
                         "--checkpoint-dir holding some)")
    return found


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not {"step", "config", "files"} <= meta.keys():
            raise ValueError("meta.json lacks step, config or files")
        return meta
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a complete checkpoint ({e}); delete it to resume from an older one") from None


def set_aside(checkpoint_dir: str) -> str | None:
    """Move what checkpoint_dir holds into DIR.previous-TIME (for --fresh); nothing is deleted. The run's lock
    (preflight.LOCK_NAME) stays where it is."""
    entries = [n for n in os.listdir(checkpoint_dir) if n != "run.lock"] if os.path.isdir(checkpoint_dir) else []
    if not entries:
        return None
    aside = f"{checkpoint_dir.rstrip(os.sep)}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(aside)
    for name in entries:
        os.replace(os.path.join(checkpoint_dir, name), os.path.join(aside, name))
    return aside


# ----------------------------------------------------------------------------------------------------------
# Saving

def save(checkpoint_dir: str, step: int, model, optimizer, meta: dict, rank: int, keep: int,
         tokenizer=None) -> str:
    """Save this rank's stage, collectively with every rank; return the finished checkpoint's path.

    meta (JSON-able) must hold at least "config"; rank 0's copy is the one written. A save that fails on any
    rank (a full disk, a permission) raises the same UsageError on every rank, after the partial step-N.tmp is
    removed; the complete checkpoints are never touched before the new one is complete.
    """
    final = step_dir(checkpoint_dir, step)
    tmp = final + ".tmp"
    try:
        with collective_errors(), _save_errors(tmp):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was killed
                os.makedirs(os.path.join(tmp, "rng"))
        state, _ = _state(model, optimizer, LlamaConfig(**meta["config"]))
        # The layout: which layers each rank held (a rank may hold several stages), for the record in meta.json.
        layers = sorted({int(k.split(".")[2]) for k in state["model"] if k.startswith("base_model.layers.")})
        layout = [None] * dist.get_world_size()
        dist.all_gather_object(layout, layers)
        with collective_errors(), _save_errors(tmp):  # DCP itself raises on every rank if a rank failed
            dcp.save(state, checkpoint_id=tmp)  # writes and fsyncs this rank's shard
            torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
        # Every shard is on disk before the checkpoint can become visible.
        with collective_errors(), _save_errors(tmp):
            if rank == 0:
                if tokenizer is not None:
                    tokenizer.save(tmp)
                files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                         for d, _, fs in os.walk(tmp) for f in fs}
                meta = dict(meta, step=step, world_size=len(layout), layers_per_rank=layout, files=files)
                _write_synced(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
                os.replace(tmp, final)
                _fsync_dir(checkpoint_dir)
    except UsageError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed save took; nothing else is touched
        raise
    if rank == 0:
        for old in complete_checkpoints(checkpoint_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


@contextlib.contextmanager
def _save_errors(tmp: str):
    """Turn a failed write into one line: the cause, and what state the checkpoint directory is left in."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as e:
        directory = os.path.dirname(tmp) or "."
        cause = _root_cause(e)
        try:  # torch.save reports a full disk as "unexpected pos ...": say what it means
            usage = shutil.disk_usage(directory)
            if usage.free < max(64 * 2**20, usage.total // 100):
                cause = f"the disk is full: {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB"
        except OSError:
            pass
        newest = latest(directory)
        kept = f"the newest complete one, {newest}, is untouched" if newest else "there is no complete one yet"
        raise UsageError(f"--checkpoint-dir: saving {tmp} failed ({cause}); the partial save is removed and {kept}; "
                         "free space (or choose another --checkpoint-dir) and rerun the same command to resume") \
            from None


def _root_cause(e: BaseException) -> str:
    if isinstance(e, CheckpointException):  # DCP collects each failed rank's exception
        first = next(iter(e.failures.values()), None)
        e = first[0] if isinstance(first, tuple) else (first or e)
    if isinstance(e, OSError):
        return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


_EMBED, _HEAD = "base_model.embed_tokens.weight", "lm_head.weight"


def _state(model, optimizer, config: LlamaConfig) -> tuple[dict, dict]:
    """This rank's model (and AdamW) state by full-model name, as saved; and, per name the model and optimizer
    use, the name it is saved under.

    A tied head (tie_word_embeddings) is saved once, as the embedding: a stage that holds only the head saves
    and loads its copy under the embedding's name (the copies are equal: training.TiedEmbedding), so the
    checkpoint loads into any layout, with the two in one stage (one tensor) or in two."""
    state = {"model": get_model_state_dict(model, options=_OPTIONS)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    saved_as = {part: {key: _tied_name(key) if config.tie_word_embeddings else key for key in values}
                for part, values in state.items()}
    return {part: {saved_as[part][key]: value for key, value in values.items()}
            for part, values in state.items()}, saved_as


def _tied_name(key: str) -> str:
    """lm_head.weight -> base_model.embed_tokens.weight, also inside AdamW's flattened keys
    (state.lm_head.weight.exp_avg, param_groups.lm_head.weight.lr)."""
    for prefix in ("", "state.", "param_groups."):
        if key == prefix + _HEAD or key.startswith(prefix + _HEAD + "."):
            return prefix + _EMBED + key[len(prefix + _HEAD):]
    return key


def _set_state(model, optimizer, state: dict, saved_as: dict) -> None:
    """Hand a loaded state back to the model and optimizer under their own names."""
    restored = {part: {key: state[part][name] for key, name in names.items()} for part, names in saved_as.items()}
    set_model_state_dict(model, restored["model"], options=_OPTIONS)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, restored["optim"], options=_OPTIONS)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# ----------------------------------------------------------------------------------------------------------
# Loading

def verify_files(path: str, meta: dict) -> None:
    """Every file the save wrote is there with its size, and the index holds only DCP's own classes.

    Checked before DCP reads anything, so a truncated copy or a tampered index fails here with one clear line,
    on every rank alike.
    """
    for name, size in meta.get("files", {}).items():
        full = os.path.join(path, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != size:
            raise UsageError(f"--checkpoint-dir: {path} is damaged: {name} has {actual} bytes, expected {size}; "
                             "delete that checkpoint to resume from an older one")
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise UsageError(f"--checkpoint-dir: refusing {path}/.metadata: {e}") from None


def load(path: str, model, optimizer, config: LlamaConfig, rank: int, world_size: int) -> dict:
    """Load this rank's stage, AdamW state and RNG from the checkpoint at path, collectively. Returns its meta.json.
    The caller has checked that the checkpoint is of this run (resume)."""
    meta = read_meta(path)
    state, saved_as = _state(model, optimizer, config)
    _dcp_load(state, path)
    _set_state(model, optimizer, state, saved_as)
    if meta.get("world_size") == world_size:  # RNG streams belong to ranks; another layout starts new ones
        rng = torch.load(os.path.join(path, "rng", f"rank{rank}.pt"), weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def _dcp_load(state: dict, path: str, no_dist: bool = False) -> None:
    try:
        with warnings.catch_warnings():  # no_dist: DCP warns that it loads on one process, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP gathers read errors from all ranks, raises on each
        first = [line for line in str(e).splitlines() if line and not line[0].isspace()][-1]
        raise UsageError(f"{path}: cannot read the checkpoint ({first}); delete it to resume from an older "
                         "one") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts only what DCP writes into .metadata: its dataclasses, torch.Size, dtypes and layouts."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module, name):
        if ((module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata"
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f".metadata asks for {module}.{name}, which a checkpoint never contains")


class _SafeReader(FileSystemReader):
    # FileSystemReader.read_metadata with the restricted unpickler instead of pickle.load (torch 2.13 internals).
    def read_metadata(self, *args, **kwargs) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    # Non-tensor entries (LR, betas, ...) are torch.save'd by DCP; read them back as plain data only.
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ----------------------------------------------------------------------------------------------------------
# What the training scripts call

# The flags that define what a run computes, besides the model itself (meta.json's "config"). A rerun on the same
# --checkpoint-dir must have the checkpoint's values, or it would continue another run with this one's weights,
# AdamW state and data position. --steps is among them because the LR schedule is a function of it: a cosine
# recomputed for a longer run would jump the LR back up. The other flags (--microbatches, the number of
# processes, --schedule, --trace, --metrics, ...) change how the same numbers are computed, and are free.
# --init-from is recorded but not compared: once a run has checkpoints they are its weights, and where it started
# from may have moved; the model it names is compared all the same (meta.json's config).
RUN_FLAGS = ("seed", "data", "seq_len", "batch_size", "steps", "lr", "warmup_steps", "weight_decay", "grad_clip")


def resuming(args) -> str | None:
    """The checkpoint this run continues: the newest complete one in --checkpoint-dir (None with --fresh)."""
    return None if args.fresh else latest(args.checkpoint_dir)


def model_source(args) -> str | None:
    """Where the model's shape and tokenizer come from, when not from --model: --init-from for a new run; for a
    run that was started from other weights and is resumed, its newest checkpoint."""
    if (resume := resuming(args)) is not None:
        return resume if read_meta(resume).get("run", {}).get("init_from") is not None else None
    return args.init_from


def run_identity(args, tokenizer=None) -> dict:
    """What a checkpoint records of its run, to compare on resume: RUN_FLAGS, the data files' sizes and (when
    given) the tokenizer; and --init-from, where its weights started."""
    identity = {**{flag: getattr(args, flag) for flag in RUN_FLAGS}, "init_from": args.init_from,
                "data_files": {path: os.path.getsize(path) for path in data.local_files(args.data)}}
    if tokenizer is not None:
        identity["tokenizer"] = tokenizer.fingerprint()
    return identity


def check_same_run(args, path: str, config: LlamaConfig | None = None, tokenizer=None) -> dict:
    """Raise a one-line UsageError naming each flag (old → new) in which this run differs from the checkpoint
    at path; compares the model and the tokenizer too when given. Returns the checkpoint's meta.json."""
    meta = read_meta(path)
    identity = run_identity(args, tokenizer)
    saved = meta.get("run", identity)  # checkpoints from before this record existed are compared by model only
    found = []
    if config is not None:
        found += [f"model {field} {meta['config'].get(field)} → {value} (--model, --layers, --init-from)"
                  for field, value in dataclasses.asdict(config).items() if meta["config"].get(field) != value]
    for flag in RUN_FLAGS:
        old, new = saved.get(flag), identity[flag]
        if old != new and not (flag == "steps" and new <= meta["step"]):  # fewer steps than done: nothing to run
            found.append(f"--{flag.replace('_', '-')} {old} → {new}")
    if tokenizer is not None and saved.get("tokenizer", identity["tokenizer"]) != identity["tokenizer"]:
        found.append("--tokenizer/--vocab-size: another tokenizer")
    for file, size in identity["data_files"].items():
        if saved.get("data_files", {}).get(file, size) != size:
            found.append(f"--data {file}: {saved['data_files'][file]} → {size} bytes (the file changed)")
    if found:
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: {os.path.basename(path)} is another run: "
                         f"{'; '.join(found)}. Rerun with its flags to continue it, add --fresh to start over "
                         f"(its checkpoints are moved aside), or start a new run from its weights with "
                         f"--init-from {path} --checkpoint-dir NEW_DIR")
    return meta


def resume(args, env, model, optimizer, config, tokenizer, loader, say=print) -> int:
    """Continue the run in --checkpoint-dir from its newest complete checkpoint, exactly, or refuse one line
    naming each changed flag. With --fresh, move its checkpoints aside first; with nothing to resume and
    --init-from, start from those weights. Collective. Returns the step done (>= --steps: nothing left to do)."""
    if args.fresh:
        with collective_errors():
            if env.rank == 0:
                try:
                    aside = set_aside(args.checkpoint_dir)
                except OSError as e:
                    raise UsageError(f"--fresh: cannot move the checkpoints in {args.checkpoint_dir} aside "
                                     f"({e.strerror})") from None
                if aside:
                    say(f"--fresh: moved the previous checkpoints to {aside}", flush=True)
    path = None if args.fresh else latest(args.checkpoint_dir)
    if path is None:
        if args.init_from is not None:
            source = load_weights(args.init_from, model, config)
            say(f"initialized from the weights of {source} (a new run: new AdamW state, LR schedule and data "
                "order)", flush=True)
        return 0
    with collective_errors():
        meta = check_same_run(args, path, config, tokenizer)
        verify_files(path, meta)
    if meta["step"] >= args.steps > 0:
        say(f"{path} is step {meta['step']}: --steps {args.steps} are done, nothing to train", flush=True)
        return meta["step"]
    load(path, model, optimizer, config, env.rank, env.world_size)
    if loader is not None:
        loader.load_state_dict(meta["data"])
    say(f"resumed from {path} at step {meta['step']} (saved by {meta['world_size']} process(es))"
        if args.steps else f"evaluating {path} (step {meta['step']})", flush=True)
    return meta["step"]


def load_weights(source: str, model, config: LlamaConfig) -> str:
    """Only the model's weights, each rank its own stage's, from --init-from: a Hugging Face directory or one of
    this project's checkpoints. Collective. Returns the path read."""
    with collective_errors():
        if hf.is_hf_dir(source):
            path = source
        else:
            path = resolve(source, "--init-from")
            verify_files(path, read_meta(path))
    if hf.is_hf_dir(path):
        state = get_model_state_dict(model, options=_OPTIONS)
        with collective_errors():
            keys = hf.stage_request(path, state, config)  # their name for each of this stage's tensors
        try:
            hf.load(path, keys, state)
        except CheckpointException as e:
            raise UsageError(f"--init-from {path}: cannot read its tensors ({_root_cause(e)})") from None
        set_model_state_dict(model, state, options=_OPTIONS)
        return path
    state, saved_as = _state(model, None, config)
    _dcp_load(state, path)
    _set_state(model, None, state, saved_as)
    return path


def model_config(args, vocab_size: int, device_type: str) -> tuple[LlamaConfig, str]:
    """The model to train, and a name for it: --init-from's model, else the preset's with the tokenizer's
    vocabulary and --layers."""
    source = model_source(args)
    if source is None:
        preset = flags.model_preset(args, device_type)
        return config_from_preset(preset, vocab_size, args.layers), preset
    if hf.is_hf_dir(source):
        path, config = source, hf.read_config(source)
    else:
        path = resolve(source, "--init-from")
        config = LlamaConfig(**read_meta(path)["config"])
    if vocab_size > config.vocab_size:  # a Hugging Face model may have more rows than its tokenizer has tokens
        raise UsageError(f"--tokenizer: {vocab_size} tokens, but --init-from {source} has embeddings for "
                         f"{config.vocab_size}; leave --tokenizer out to use its own tokenizer")
    return config, f"from {path if source == args.init_from else args.init_from}"


def save_if_due(args, env, step: int, model, optimizer, config, loader, tokenizer) -> str | None:
    """Save after every --checkpoint-every steps and at the end of the run; return the path if it saved."""
    if step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0):
        return save_run(args, env, step, model, optimizer, config, loader, tokenizer)
    return None


def save_run(args, env, step: int, model, optimizer, config, loader, tokenizer) -> str:
    meta = {"config": dataclasses.asdict(config), "run": run_identity(args, tokenizer),
            "data": loader.state_dict() if loader is not None else None,  # rank 0 (first stage) always has one
            "args": vars(args), "torch": torch.__version__}
    return save(args.checkpoint_dir, step, model, optimizer, meta, env.rank, args.keep_checkpoints, tokenizer)


# ----------------------------------------------------------------------------------------------------------
# Export: the full model for one process, as one torch.save file or as a Hugging Face directory

def full_model_state(path: str) -> tuple[dict, LlamaConfig]:
    """The whole model's weights from the checkpoint at path, on this one process (no process group)."""
    meta = read_meta(path)
    verify_files(path, meta)
    config = LlamaConfig(**meta["config"])
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device="cpu")  # every saved tensor is loaded below; buffers are not part of the export
    model.tie_weights()
    state, saved_as = _state(model, None, config)
    _dcp_load(state, path, no_dist=True)
    return {key: state["model"][name] for key, name in saved_as["model"].items()}, config


def export(checkpoint: str, output: str, format: str = "pt", dtype: torch.dtype = torch.float32,
           max_shard_bytes: int = 5 * 2**30, force: bool = False) -> str:
    """Write the full model of a checkpoint (or of a --checkpoint-dir's newest) for use without this project:
    format "pt", OUTPUT and OUTPUT.config.json, OUTPUT.tokenizer.json; format "hf", a directory that
    transformers' from_pretrained loads. Returns the checkpoint's path.

    What exists at OUTPUT is refused unless force; everything is written under temporary names first and only
    then renamed into place, so a refused or failed export leaves what was there untouched."""
    outputs = [output] if format == "hf" else [output, output + ".config.json", output + ".tokenizer.json"]
    if not force and (existing := [p for p in outputs if os.path.lexists(p)]):
        raise UsageError(f"{existing[0]} exists; give a new {'directory' if format == 'hf' else 'file name'}, or "
                         "add --force to replace it")
    path = resolve(checkpoint)
    state, config = full_model_state(path)
    tmp = {p: f"{p}.tmp{os.getpid()}" for p in outputs}
    try:
        if format == "hf":
            tokenizer = data.load_tokenizer(os.path.join(path, "tokenizer.json"), flag="checkpoint")
            hf.save(tmp[output], state, config, tokenizer, dtype, max_shard_bytes)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            torch.save({key: t.to(dtype) for key, t in state.items()}, tmp[output])
            with open(tmp[output + ".config.json"], "w") as f:
                json.dump(dataclasses.asdict(config), f, indent=1)
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                shutil.copyfile(os.path.join(path, "tokenizer.json"), tmp[output + ".tokenizer.json"])
        for final, written in tmp.items():
            if os.path.isdir(final) and not os.path.islink(final):  # --force over a directory: replace it whole
                shutil.rmtree(final)
            if os.path.lexists(written):
                os.replace(written, final)
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a full disk as a RuntimeError
        raise UsageError(f"cannot write {output} ({_root_cause(e)}); choose another output") from None
    finally:  # a failed export leaves nothing of its own behind
        for written in tmp.values():
            if os.path.isdir(written):
                shutil.rmtree(written, ignore_errors=True)
            elif os.path.lexists(written):
                os.remove(written)
    return path


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Checkpoint tools for the pipeline training scripts.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write the full model, for use on one process without this project")
    e.add_argument("checkpoint", help="a run's --checkpoint-dir (its newest checkpoint) or one step-N directory")
    e.add_argument("output", help="pt: the file to write; hf: a new directory")
    e.add_argument("--format", choices=["pt", "hf"], default="pt",
                   help="pt: a torch.save state dict for model.py (+ OUTPUT.config.json, OUTPUT.tokenizer.json); "
                        "hf: a Hugging Face directory (config.json, safetensors, tokenizer) that "
                        "transformers.LlamaForCausalLM.from_pretrained loads (default: %(default)s)")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written weights (training keeps float32) (default: %(default)s)")
    e.add_argument("--max-shard-size", type=_size, default="5GB",
                   help="hf: the largest safetensors file (default: %(default)s)")
    e.add_argument("--force", action="store_true", help="replace OUTPUT (and its .config.json, .tokenizer.json) if "
                                                       "it exists; without it an existing output is refused")
    args = p.parse_args(argv)
    try:
        source = export(args.checkpoint, args.output, args.format, getattr(torch, args.dtype), args.max_shard_size,
                        args.force)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    extra = "" if args.format == "hf" else " (+ .config.json, .tokenizer.json)"
    print(f"exported {source} -> {args.output}{extra}")


if __name__ == "__main__":
    main()
