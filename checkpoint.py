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
import dataclasses
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

from model import LlamaConfig, LlamaForPretraining
from runtime import UsageError

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


def resolve(path: str) -> str:
    """A checkpoint given either itself or a run's --checkpoint-dir (then its newest complete checkpoint)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = latest(path)
    if found is None:
        raise UsageError(f"{path}: no complete checkpoint here (a step-N directory with meta.json)")
    return found


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a complete checkpoint ({e}); delete it to resume from an older one") from None


def set_aside(checkpoint_dir: str) -> str | None:
    """Rename an existing checkpoint directory out of the way (for --fresh); nothing is deleted."""
    if not os.path.isdir(checkpoint_dir) or not os.listdir(checkpoint_dir):
        return None
    aside = f"{checkpoint_dir.rstrip(os.sep)}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(checkpoint_dir, aside)
    return aside


# ----------------------------------------------------------------------------------------------------------
# Saving

def save(checkpoint_dir: str, step: int, model, optimizer, meta: dict, rank: int, keep: int,
         tokenizer=None) -> str:
    """Save this rank's stage, collectively with every rank; return the finished checkpoint's path.

    meta (JSON-able) must hold at least "config"; rank 0's copy is the one written.
    """
    final = step_dir(checkpoint_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was killed
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    state = _state(model, optimizer)
    # The layout: which layers each rank held (a rank may hold several stages), for the record in meta.json.
    layers = sorted({int(k.split(".")[2]) for k in state["model"] if k.startswith("base_model.layers.")})
    layout = [None] * dist.get_world_size()
    dist.all_gather_object(layout, layers)
    dcp.save(state, checkpoint_id=tmp)  # writes and fsyncs this rank's shard
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    dist.barrier()  # every shard is on disk before the checkpoint can become visible
    if rank == 0:
        if tokenizer is not None:
            tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                 for d, _, fs in os.walk(tmp) for f in fs}
        meta = dict(meta, step=step, world_size=len(layout), layers_per_rank=layout, files=files)
        _write_synced(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        os.replace(tmp, final)
        _fsync_dir(checkpoint_dir)
        for old in complete_checkpoints(checkpoint_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


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


def _state(model, optimizer) -> dict:
    return {"model": get_model_state_dict(model, options=_OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIONS)}


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# ----------------------------------------------------------------------------------------------------------
# Loading

def check_compatible(path: str, meta: dict, config: LlamaConfig) -> None:
    saved = meta.get("config", {})
    current = dataclasses.asdict(config)
    diff = [f"{k}={saved.get(k)!r} (now {v!r})" for k, v in current.items() if saved.get(k) != v]
    if diff:
        raise UsageError(f"--checkpoint-dir: {path} holds another model: {', '.join(diff)}; use the flags it was "
                         "trained with (--model, --layers, --tokenizer/--vocab-size), another --checkpoint-dir, "
                         "or --fresh")


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
    """Load this rank's stage from the checkpoint at path, collectively. Returns its meta.json."""
    meta = read_meta(path)
    check_compatible(path, meta, config)
    verify_files(path, meta)
    state = _state(model, optimizer)
    _dcp_load(state, path)
    set_model_state_dict(model, state["model"], options=_OPTIONS)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIONS)
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

def resume(args, env, model, optimizer, config, loader, say=print) -> int:
    """Continue from the newest complete checkpoint (or move old ones aside with --fresh). Returns the step."""
    if args.fresh:
        if env.rank == 0 and (aside := set_aside(args.checkpoint_dir)):
            say(f"--fresh: moved the previous checkpoints to {aside}", flush=True)
        dist.barrier()
        return 0
    path = latest(args.checkpoint_dir)
    if path is None:
        return 0
    meta = load(path, model, optimizer, config, env.rank, env.world_size)
    if loader is not None:
        loader.load_state_dict(meta["data"])
    say(f"resumed from {path} at step {meta['step']} (saved by {meta['world_size']} process(es))", flush=True)
    if meta["step"] >= args.steps:
        say(f"already trained {meta['step']} steps (--steps {args.steps}): nothing to do", flush=True)
    return meta["step"]


def save_if_due(args, env, step: int, model, optimizer, config, loader, tokenizer) -> str | None:
    """Save after every --checkpoint-every steps and at the end of the run; return the path if it saved."""
    if step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0):
        return save_run(args, env, step, model, optimizer, config, loader, tokenizer)
    return None


def save_run(args, env, step: int, model, optimizer, config, loader, tokenizer) -> str:
    meta = {"config": dataclasses.asdict(config),
            "data": loader.state_dict() if loader is not None else None,  # rank 0 (first stage) always has one
            "args": vars(args), "torch": torch.__version__}
    return save(args.checkpoint_dir, step, model, optimizer, meta, env.rank, args.keep_checkpoints, tokenizer)


# ----------------------------------------------------------------------------------------------------------
# Export: one file with the full model, for one process

def export(checkpoint: str, output_file: str) -> str:
    path = resolve(checkpoint)
    meta = read_meta(path)
    verify_files(path, meta)
    config = LlamaConfig(**meta["config"])
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.to_empty(device="cpu")  # every saved tensor is loaded below; buffers are not part of the export
    state = {"model": model.state_dict()}
    _dcp_load(state, path, no_dist=True)
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    torch.save(state["model"], output_file + ".tmp")
    os.replace(output_file + ".tmp", output_file)
    with open(output_file + ".config.json", "w") as f:
        json.dump(meta["config"], f, indent=1)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        shutil.copyfile(os.path.join(path, "tokenizer.json"), output_file + ".tokenizer.json")
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Checkpoint tools for the pipeline training scripts.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write the full model's state dict to one file (torch.save)")
    e.add_argument("checkpoint", help="a run's --checkpoint-dir (its newest checkpoint) or one step-N directory")
    e.add_argument("output_file")
    args = p.parse_args(argv)
    try:
        source = export(args.checkpoint, args.output_file)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {source} -> {args.output_file} (+ .config.json, .tokenizer.json)")


if __name__ == "__main__":
    main()
