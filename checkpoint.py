"""Distributed checkpoints (DCP) of a pipeline run, and the run around them. A --checkpoint-dir holds step-N/
(DCP's shards and .metadata: each rank's stages under the full model's names, so it loads into any layout;
rng/rank*.pt, the data's tokenizer files, meta.json written last), step-N.tmp/ (a save in progress) and run.lock
(held by the run using it): docs/checkpoints.md.

The one-line errors first (UsageError, collective_errors). Part 1, the checkpoints, which uses no name of Part 2
(a copier can take it alone): finding, saving (save), loading (verify_files, load_state), --init-from
(load_weights), and a checkpoint as untrusted input: the checks of what it holds, the restricted reader of DCP's
index. Part 2, the run around them: Run and the resume rules (check_same_run), run() around main, stopping
(stop_requested), flags (Parser), the checks and the lock of what a run writes, the data and --metrics, this job.

A script's main calls, in order: checkpoint.run(main, args) around it all; run = Run(args, rank, world_size, say);
run.relayout(stages_per_rank); run.check(data); run.model_config(device_type); run.resume(model, optimizer, config);
Metrics(path, step); after every step stop_requested() and run.save_if_due(step, position, stop); at the end summary."""

import argparse
import atexit
import collections
import contextlib
import dataclasses
import datetime
import errno
import functools
import gc
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import re
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import (CheckpointException, DefaultLoadPlanner, FileSystemReader,
                                          HuggingFaceStorageReader, Metadata, metadata as dcp_metadata)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from model import (LlamaConfig, check_layout, checkpointing_plan, config_from_hf, config_from_preset, hf_name,
                   max_stages, mfu)

# ==========================================================================================================
# Errors: one line, on every rank (both parts raise them)

class UsageError(Exception):
    """A mistake in the command line or its inputs: one line, exit status 1 (on_every_rank: once a node)."""

    def __init__(self, message: str, on_every_rank: bool = False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


def max_over_ranks(value: int) -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


@contextlib.contextmanager
def collective_errors():
    """A UsageError in the block on any rank is raised on every rank, so none waits for a peer that stopped; the
    block must not start a collective that a failing rank would skip."""
    error = None
    try:
        yield
    except UsageError as e:
        error = e
    if not max_over_ranks(error is not None):
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    found = [rank for rank, message in enumerate(messages) if message is not None]
    message = messages[found[0]]
    if len(found) < len(messages):  # say where, when only some ranks (nodes) have the problem
        message += f" (found on rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))})"
    raise UsageError(message, on_every_rank=True) from None


# ==========================================================================================================
# Part 1. Checkpoints (DCP): finding, saving, loading, --init-from, and a checkpoint as untrusted input

# -- Finding checkpoints

def complete_checkpoints(checkpoint_dir: str) -> list[str]:
    """Paths of the complete checkpoints (step-N holding meta.json) in checkpoint_dir, oldest first."""
    names = sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else []
    return [os.path.join(checkpoint_dir, n) for n in names
            if re.fullmatch(r"step-\d{8}", n) and os.path.isfile(os.path.join(checkpoint_dir, n, "meta.json"))]


def latest(checkpoint_dir: str) -> str | None:
    return (complete_checkpoints(checkpoint_dir) or [None])[-1]


def resolve(path: str, flag: str = "checkpoint") -> str:
    """A checkpoint given either itself or a run's --checkpoint-dir (then its newest complete checkpoint)."""
    found = path if os.path.isfile(os.path.join(path, "meta.json")) else latest(path)
    if found is None:
        raise UsageError(f"{flag} {path}: no complete checkpoint there (a step-N directory with meta.json, or a "
                         "--checkpoint-dir holding some)")
    return found


def read_meta(path: str, flag: str = "--checkpoint-dir") -> dict:
    """The checkpoint's meta.json, each field read checked, or one line saying why not (flag: how path was given)."""
    try:
        meta = read_json(os.path.join(path, "meta.json"))
    except (OSError, ValueError) as e:
        raise bad_checkpoint(flag, path, f"not a complete checkpoint, its meta.json cannot be read ({e})") from None
    if isinstance(meta, dict) and {"dtype", "train", "val"} <= meta.keys():
        raise bad_checkpoint(flag, path, "not a complete checkpoint, it holds data prepared by prepare_data.py")
    if not isinstance(meta, dict) or not {"step", "config", "files", "world_size"} <= meta.keys():
        raise bad_checkpoint(flag, path, "not a complete checkpoint, its meta.json lacks step, config, files or "
                                         "world_size")
    for field, value, ok, what in _meta_checks(meta):
        if not ok:
            raise bad_checkpoint(flag, path, f"its meta.json's {field} is {shown(value)}, not {what}")
    try:  # every field as Hugging Face's config.json would have it: the same checks, naming the field
        config_from_hf({**meta["config"], "model_type": "llama"})
    except ValueError as e:
        raise bad_checkpoint(flag, path, f"its meta.json's {str(e).replace('config.json ', 'config.', 1)}") from None
    return meta


# -- Saving, and loading (verified first: verify_files; through the restricted readers below)

# AdamW's state keyed by parameter name ("optim.state.<fqn>.exp_avg"): keyed by group index (the default), every
# stage's group 0 would be one shared key, and DCP would keep only one rank's copy.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
EMBED, HEAD = "base_model.embed_tokens.weight", "lm_head.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save(checkpoint_dir: str, step: int, model, optimizer, meta: dict, rank: int, keep: int,
         tokenizer_dir: str, background: tuple | None = None) -> str | tuple:
    """Save this rank's stages, collectively: the checkpoint's path, or with background (background_group's) the
    save in flight, written by a thread (DCP's async_save): (its future, step-N.tmp, meta) for Run.finish_save."""
    tmp = os.path.join(checkpoint_dir, f"step-{step:08d}.tmp")
    with _saving(tmp, rank):
        if rank == 0:
            _remove(tmp)  # left over from a save that was killed
            os.makedirs(os.path.join(tmp, "rng"))
    state, _ = state_dicts(model, optimizer, LlamaConfig(**meta["config"]))
    meta = dict(meta, step=step, world_size=dist.get_world_size())
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    with _saving(tmp, rank):  # DCP itself raises on every rank if a rank failed
        torch.save(rng, os.path.join(tmp, "rng", f"rank{rank}.pt"))
        if background is None:
            dcp.save(state, checkpoint_id=tmp)  # writes and fsyncs this rank's shard
        else:  # the copy is taken before async_save returns, so the next step may change the state
            written = dcp.async_save(state, checkpoint_id=tmp, process_group=background[0], async_stager=background[1])
    return _complete(tmp, meta, rank, keep, tokenizer_dir) if background is None else (written, tmp, meta)


def _complete(tmp: str, meta: dict, rank: int, keep: int, tokenizer_dir: str) -> str:
    """Make a written save a checkpoint (meta.json last, then the rename); delete those beyond keep. Collective."""
    final = tmp.removesuffix(".tmp")
    with _saving(tmp, rank):
        if rank == 0:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
            files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                     for d, _, fs in os.walk(tmp) for f in fs}
            _write_synced(os.path.join(tmp, "meta.json"), json.dumps(dict(meta, files=files), indent=1))
            os.replace(tmp, final)
            fd = os.open(os.path.dirname(final), os.O_RDONLY)
            try:
                os.fsync(fd)  # make the rename itself durable
            finally:
                os.close(fd)
    if rank == 0:
        for old in complete_checkpoints(os.path.dirname(final))[:-keep] if keep > 0 else []:
            _remove(old)
    dist.barrier()
    return final


def background_group(timeout: float) -> tuple:
    """What every --async-checkpoint save uses, made collectively at the first: a gloo group of its own (the
    writing thread's collectives never meet the training's: KempnerForge #104's deadlock) and the CPU copy."""
    pinned = torch.cuda.is_available() and torch.cuda.is_initialized()  # faster copies from the GPU
    return (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout)),
            DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                         use_non_blocking_copy=False)))


@contextlib.contextmanager
def _saving(tmp: str, rank: int):
    """A block of a save: a failed write is one line on every rank, and the partial save is removed."""
    try:
        with collective_errors():
            try:
                yield
            except (OSError, RuntimeError, CheckpointException) as e:
                raise _save_failed(tmp, e) from None
    except UsageError:
        if rank == 0:
            _remove(tmp)  # frees what the failed save took; nothing else is touched
        raise


def _save_failed(tmp: str, e: BaseException) -> "UsageError":
    directory, final = os.path.dirname(tmp) or ".", tmp.removesuffix(".tmp")
    cause, fix = root_cause(e), "free space (or choose another --checkpoint-dir)"
    with contextlib.suppress(OSError):  # torch.save reports a full disk as "unexpected pos ...": say what it means
        usage = shutil.disk_usage(directory)
        if usage.free < max(64 * 2**20, usage.total // 100):
            cause = f"the disk is full: {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB"
        elif isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            cause, fix = f"{final} exists already, not this run's", f"move {final} away"
    newest = latest(directory)
    kept = f"the newest complete one, {newest}, is untouched" if newest else "there is no complete one yet"
    return UsageError(f"--checkpoint-dir: saving {tmp} failed ({cause}); the partial save is removed and {kept}; "
                      f"{fix} and rerun the same command to resume")


def root_cause(e: BaseException) -> str:
    """An exception in a few words: DCP's first failure, a full disk, torch.load's refusal without its advice."""
    if isinstance(e, CheckpointException):
        first = next(iter(e.failures.values()), None)
        e = first[0] if isinstance(first, tuple) else (first or e)
    if isinstance(e, OSError):
        return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    if str(e).startswith("Weights only load failed"):
        found = re.search(r"GLOBAL (\S+)", str(e))
        return f"it asks for {found[1]}, which a checkpoint never contains" if found else \
            "bytes that torch.load cannot read as saved data"
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a directory, if there."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _write_synced(path: str, text: str, exclusive: bool = False) -> None:
    with open(path, "x" if exclusive else "w") as f:  # exclusive: FileExistsError if path exists
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def state_dicts(model, optimizer, config: LlamaConfig) -> tuple[dict, dict]:
    """This rank's state under its saved names, and each key's saved name: a tied head is saved once, as the
    embedding, so the checkpoint loads into any layout."""
    state = {"model": get_model_state_dict(model, options=_OPTIONS)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    saved_as = {part: {key: _tied_name(key) if config.tie_word_embeddings else key for key in values}
                for part, values in state.items()}
    return {part: {saved_as[part][key]: value for key, value in values.items()}
            for part, values in state.items()}, saved_as


def _tied_name(key: str) -> str:
    """lm_head.weight -> base_model.embed_tokens.weight, also inside AdamW's flattened keys."""
    for prefix in ("", "state.", "param_groups."):
        if key == prefix + HEAD or key.startswith(prefix + HEAD + "."):
            return prefix + EMBED + key[len(prefix + HEAD):]
    return key


def load_state(path: str, model, optimizer, config: LlamaConfig, flag: str = "--checkpoint-dir") -> None:
    """This rank's model (and AdamW) state from the checkpoint at path, verified. Collective."""
    state, saved_as = state_dicts(model, optimizer, config)
    load_dcp(state, path, flag)
    restored = {part: {key: state[part][name] for key, name in names.items()} for part, names in saved_as.items()}
    set_model_state_dict(model, restored["model"], options=_OPTIONS)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, restored["optim"], options=_OPTIONS)


def load_dcp(state: dict, path: str, flag: str, no_dist: bool = False) -> None:
    """DCP's load of state from the checkpoint at path (no_dist: on one process), through the safe readers."""
    try:
        with warnings.catch_warnings():  # no_dist: DCP warns that it loads on one process, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP gathers read errors from all ranks, raises on each
        raise bad_checkpoint(flag, path, f"cannot read its tensors ({root_cause(e)})") from None


# -- --init-from: the model's shape and tokenizer, then only its weights, each rank its own stage's

def source_config(source: str, args) -> tuple[LlamaConfig, str]:
    """The model of --init-from (Hugging Face, a checkpoint, or a run's newest) and the path read."""
    if not os.path.isdir(source):
        raise UsageError(f"--init-from {source}: not a directory; give a Hugging Face model directory "
                         "(config.json + *.safetensors) or a checkpoint of this project")
    path = source if is_hf_dir(source) else resolve(source, "--init-from")
    config = read_hf_config(path) if is_hf_dir(source) else LlamaConfig(**read_meta(path, "--init-from")["config"])
    for flag, value in (("--model", args.model), ("--layers", args.layers)):
        if value is not None and (flag == "--model" or value != config.num_hidden_layers):
            raise UsageError(f"{flag} {value}: the model's shape comes from {path} "
                             f"({config.num_hidden_layers} layers); leave {flag} out")
    return config, path


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(path))


def read_hf_config(path: str) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face directory; what model.py does not compute is refused in one line."""
    try:
        return config_from_hf(read_json(os.path.join(path, "config.json")))
    except (OSError, ValueError) as e:
        raise UsageError(f"--init-from {path}: {e}") from None


def same_tokenizer(a: str, b: str, flags: tuple[str, str] = ("--init-from", "--data")) -> bool:
    """Whether the tokenizer.json in a and b (given by flags) have the same vocabulary, merges, specials."""
    def essence(directory, flag):
        tokenizer = read_tokenizer(directory, flag)
        model = tokenizer.get("model") or {}
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
        return (model.get("type"), model.get("vocab"), merges,
                [(t["id"], t["content"]) for t in tokenizer.get("added_tokens") or []])
    return essence(a, flags[0]) == essence(b, flags[1])


def load_weights(source: str, model, config: LlamaConfig) -> str:
    """Collective: this rank's weights (FSDP: its shard) from a Hugging Face directory or a checkpoint; the path."""
    if not is_hf_dir(source):
        with collective_errors():
            path = resolve(source, "--init-from")
            verify_files(path, read_meta(path, "--init-from"), "--init-from")
        load_state(path, model, None, config, "--init-from")
        return path
    # HuggingFaceStorageReader reads only the tensors (FSDP: slices) asked for, cast to the model's dtype.
    state = get_model_state_dict(model, options=_OPTIONS)
    with collective_errors():
        request = _hf_request(source, state, config)  # their name for each of this stage's tensors
    targets = {}  # their name -> our tensors; two when a rank holds a tied embedding and its head's copy
    for name, tensor in state.items():
        targets.setdefault(request[name], []).append(tensor)
    try:
        dcp.load({key: ours[0] for key, ours in targets.items()}, storage_reader=HuggingFaceStorageReader(source))
    except (Exception, CheckpointException) as e:  # DCP raises its CheckpointException on every rank
        raise bad_checkpoint("--init-from", source, f"cannot read its tensors ({root_cause(e)})") from None
    for tensors in targets.values():
        for copy in tensors[1:]:
            copy.copy_(tensors[0])
    set_model_state_dict(model, state, options=_OPTIONS)
    return source


def _hf_request(path: str, state: dict, config: LlamaConfig) -> dict[str, str]:
    """Their name for each of a stage's tensors, of its shape; a tied checkpoint stores the head as the embedding."""
    available = {}  # their name -> its shape
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        try:  # reads the header only; a file cut short (an interrupted download) fails here
            with safe_open(os.path.join(path, name), framework="pt") as f:
                available.update((key, f.get_slice(key).get_shape()) for key in f.keys())
        except Exception as e:  # safetensors' own error type, whatever the damage
            raise UsageError(f"--init-from {path}: {name} is not a complete safetensors file ({root_cause(e)}); "
                             "copy or download it again") from None
    request = {}
    for name in state:
        key = hf_name(name)
        if key not in available and name == HEAD and config.tie_word_embeddings:
            key = hf_name(EMBED)
        if available.get(key) != list(state[name].shape):  # else DCP would fail on every rank, in a traceback
            found = (f"its tensor {key} is {available[key]}, config.json makes it {list(state[name].shape)}"
                     if key in available else f"no tensor {key} in its safetensors files")
            raise UsageError(f"--init-from {path}: {found}; is it the Llama checkpoint that config.json describes?")
        request[name] = key
    return request


# -- Untrusted input: a checkpoint (or --init-from) is read running nothing it names, in bounded memory, each field
# and file checked before use (read_meta, verify_files, read_tokenizer), DCP's index by a restricted reader

# The largest files read whole: a JSON file (a large vocabulary's tokenizer.json runs to tens of MB) and DCP's
# index (~150 bytes a tensor chunk: llama-8b's model and AdamW state saved by 64 ranks, 8 MB, measured).
MAX_JSON_BYTES, MAX_INDEX_BYTES = 64 * 2**20, 2**30


def bad_checkpoint(flag: str, path: str, problem: str) -> "UsageError":
    """One line naming the checkpoint as given (flag) and the fix; raised on every rank (all read the same files)."""
    fix = "delete it to resume from an older one" if flag == "--checkpoint-dir" else \
        f"give {'export.py' if flag == 'checkpoint' else flag} another checkpoint"
    return UsageError(f"{flag} {path}: {problem}; {fix}", on_every_rank=True)


def read_bytes(file: str, most: int) -> bytes:
    """A regular file of at most `most` bytes, or ValueError saying why not; OSError if missing."""
    if os.path.exists(file) and not os.path.isfile(file):  # a FIFO would block open(), a device never end
        raise ValueError("not a regular file")
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size > most:
            raise ValueError(f"larger than {most // 2**20} MiB")
        return f.read()


def read_json(file: str):
    """A JSON file, or ValueError saying why not (not a regular file, too large or deep, not JSON)."""
    try:
        return json.loads(read_bytes(file, MAX_JSON_BYTES))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def shown(value, most: int = 40) -> str:
    """A value read from an input, in a few characters (a name: up to 120)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # not JSON's, or nested deeper than json.dumps goes
        text = type(value).__name__
    return text if len(text) <= most else text[:most - 3] + "..."


def _whole(value, least: int, most: int = 2**32) -> bool:
    return type(value) is int and least <= value < most


def _meta_checks(meta: dict):
    """(field, value, ok, what it must be) for each field read of a meta.json; a field once its container passed."""
    yield "step", meta["step"], _whole(meta["step"], 0), "a whole number >= 0"
    yield "world_size", meta["world_size"], _whole(meta["world_size"], 1), "a whole number >= 1"
    data = meta.get("data")  # the data loader's position: null (or none), or where the next batch starts
    yield "data", data, data is None or isinstance(data, dict) and data.keys() == {"epoch", "index"}, \
        'null or {"epoch": E, "index": I}'
    for key in ("epoch", "index") if data else ():
        yield f"data.{key}", data[key], _whole(data[key], 0), "a whole number >= 0"
    run, args = meta.get("run", {}), meta.get("args", {})
    yield "run", run, isinstance(run, dict), "an object"
    for key, value in run.items():  # compared with the flags, and printed
        yield f"run.{key}", value, isinstance(value, (str, type(None))) if key == "init_from" else isinstance(
            value, (str, int, float, type(None))), "a path or null" if key == "init_from" else "a number or a string"
    yield "args", args, isinstance(args, dict), "an object"
    for key in sorted({"dp", "tp"} & args.keys()):
        yield f"args.{key}", args[key], _whole(args[key], 1), "a whole number >= 1"
    yield "args.precision", args.get("precision"), isinstance(args.get("precision"), (str, type(None))), "a string"
    job = meta.get("job")  # the launch ids of the job that saved it (older checkpoints: a string, another job)
    yield "job", job, job is None or isinstance(job, str) or isinstance(job, list) and all(
        isinstance(i, str) for i in job), "a list of launch ids"
    yield "files", meta["files"], isinstance(meta["files"], dict), "an object of file names and sizes"
    for name, size in meta["files"].items():  # DCP and resume read them: never a path outside the checkpoint
        yield "file name", name, not os.path.isabs(name) and os.path.normpath(name) == name and \
            name.split(os.sep)[0] != "..", "a path inside the checkpoint"
        yield f"files[{shown(name)}]", size, _whole(size, 0, 2**63), "a size in bytes"
    config, fields = meta["config"], {f.name for f in dataclasses.fields(LlamaConfig)}
    yield "config", config, isinstance(config, dict) and config.keys() == fields, "the fields of a LlamaConfig"


def verify_files(path: str, meta: dict, flag: str = "--checkpoint-dir") -> None:
    """Every file the save wrote is there, inside (no link), of its size, and the index is DCP's: checked before
    DCP reads anything, so a truncated copy or a tampered index fails in one line."""
    for name in (".metadata", *TOKENIZER_FILES):  # read here, by DCP, or copied into an export
        if name not in meta["files"] and (name == ".metadata" or os.path.lexists(os.path.join(path, name))):
            raise bad_checkpoint(flag, path, f"damaged, its meta.json does not list {name}")
    inside = os.path.realpath(path)
    for name, size in meta["files"].items():
        full = os.path.join(path, name)
        if os.path.realpath(full) != os.path.join(inside, name):
            raise bad_checkpoint(flag, path, f"{name} is a link to {os.path.realpath(full)}; a checkpoint holds "
                                             "its own files")
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != size:
            raise bad_checkpoint(flag, path, f"damaged, {name} has {actual} bytes, its meta.json says {size}")
    with open_untrusted(path, ".metadata", flag):
        check_index(read_index(os.path.join(path, ".metadata")), meta["files"])


def check_index(metadata: Metadata, sizes: dict[str, int]) -> None:
    """What DCP takes on trust in an index (ValueError if not so): each chunk's bytes inside a file it holds
    (sizes), each tensor's chunks inside it, covering it once (else a part stays as initialized, silently)."""
    for index, info in metadata.storage_data.items():
        if info.relative_path not in sizes:  # a shard outside the checkpoint would be read too
            raise ValueError(f"it points to {info.relative_path!r}, which the checkpoint does not hold")
        if not (_whole(info.offset, 0, 2**63) and _whole(info.length, 0, 2**63)) or \
                info.offset + info.length > sizes[info.relative_path]:
            raise ValueError(f"it places the bytes of {shown(index.fqn, 120)} at {shown(info.offset)} + "
                             f"{shown(info.length)}, past the end of {info.relative_path}")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            if dcp_metadata.MetadataIndex(fqn) not in metadata.storage_data:
                raise ValueError(f"it holds no bytes for {shown(fqn, 120)}")
            continue
        shape, boxes = entry.size, []
        if not (type(shape) is torch.Size and all(_whole(n, 0, 2**63) for n in shape)):
            raise ValueError(f"it gives {shown(fqn, 120)} the shape {shown(shape)}")
        for chunk in entry.chunks:
            offsets, lengths = chunk.offsets, chunk.sizes
            if not (len(offsets) == len(lengths) == len(shape) and all(
                    _whole(o, 0, 2**63) and _whole(n, 0, 2**63) and o + n <= end
                    for o, n, end in zip(offsets, lengths, shape))):
                raise ValueError(f"it places a chunk of {shown(fqn, 120)} at {shown(list(offsets))}, of "
                                 f"{shown(list(lengths))}, outside its shape {list(shape)}")
            if dcp_metadata.MetadataIndex(fqn, offsets) not in metadata.storage_data:
                raise ValueError(f"it holds no bytes for the chunk of {shown(fqn, 120)} at {list(offsets)}")
            boxes.append((tuple(offsets), tuple(lengths)))
        if sum(math.prod(n) for _, n in boxes) != math.prod(shape) or _overlap(boxes):
            raise ValueError(f"its chunks of {shown(fqn, 120)} do not cover its shape {list(shape)} exactly once")


def _overlap(boxes: list[tuple[tuple, tuple]]) -> bool:
    """Whether two (offsets, lengths) boxes overlap, swept along dim 0: FSDP's shards meet only their neighbours."""
    active = []
    for start, length in sorted(boxes):
        active = [(s, n) for s, n in active if not start or s[0] + n[0] > start[0]]
        if any(all(a < b + m and b < a + n for a, n, b, m in zip(s, n_, start, length)) for s, n_ in active):
            return True
        active.append((start, length))
    return False


@contextlib.contextmanager
def open_untrusted(path: str, name: str, flag: str = "--checkpoint-dir"):
    """A file of a checkpoint that cannot be read as what this project writes: one line, naming it."""
    try:
        yield
    except Exception as e:  # the restricted readers run nothing, whatever the file holds: any failure is its content
        raise bad_checkpoint(flag, path, f"{name}: damaged, or not a checkpoint of this project "
                                         f"({root_cause(e)})") from None


def read_tokenizer(directory: str, flag: str) -> dict:
    """The tokenizer.json in directory, each field read checked, or one line naming the field."""
    def wrong(field, value, what):
        raise UsageError(f"{flag} {directory}: its tokenizer.json's {field} is {shown(value)}, not {what}")
    try:
        tokenizer = read_json(os.path.join(directory, "tokenizer.json"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {directory}: cannot read its tokenizer.json ({e})") from None
    if not isinstance(tokenizer, dict):
        raise UsageError(f"{flag} {directory}: its tokenizer.json is {shown(tokenizer)}, not an object of fields")
    model = tokenizer.get("model") or {}
    if not isinstance(model, dict):
        wrong("model", model, "an object")
    vocab, merges, added = model.get("vocab") or {}, model.get("merges") or [], tokenizer.get("added_tokens") or []
    if not isinstance(model.get("type"), (str, type(None))):
        wrong("model.type", model.get("type"), "a string")
    if not (isinstance(vocab, dict) and all(type(i) is int for i in vocab.values()) or isinstance(vocab, list) and
            all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) in (int, float)
                for p in vocab)):  # a Unigram model's vocab: [token, score] pairs
        wrong("model.vocab", vocab, "tokens and their ids")
    if not (isinstance(merges, list) and all(isinstance(m, str) or isinstance(m, list) and len(m) == 2 and all(
            isinstance(part, str) for part in m) for m in merges)):
        wrong("model.merges", merges, 'a list of "a b" or ["a", "b"]')
    if not (isinstance(added, list) and all(isinstance(t, dict) and type(t.get("id")) is int and
                                            isinstance(t.get("content"), str) for t in added)):
        wrong("added_tokens", added, 'a list of {"id": N, "content": TEXT}')
    return tokenizer


def read_index(file: str) -> Metadata:
    """DCP's index, a pickle, read by pickle's pure-Python unpickler restricted to what DCP writes, its memo
    a dict (the C one allocates up to the slot a file names: 9 bytes took 2 GiB). Why: docs/checkpoints.md."""
    data = read_bytes(file, MAX_INDEX_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception:  # damaged pickle data: an empty stack, a missing memo slot, a cut-off file
        raise pickle.UnpicklingError("its bytes are not an index as DCP writes it") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict) or \
            not isinstance(metadata.storage_meta, (dcp_metadata.StorageMeta, type(None))):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in metadata.storage_data.values():
        if type(info) is not _StorageInfo or type(info.relative_path) is not str:
            raise pickle.UnpicklingError(f"it locates a tensor by {shown(info)}, not by DCP's _StorageInfo")
        if info.transform_descriptors:  # e.g. zstd: a small shard could decompress to any size
            raise pickle.UnpicklingError(f"it asks for {shown(info.transform_descriptors)}, a transform this "
                                         "project's checkpoints never use")
    return metadata


def _enum_member(cls, name: str):
    # getattr(cls, name), as Python 3.11.2 pickles an enum member, for DCP's memory-format enum only.
    if cls is dcp_metadata._MEM_FORMAT_ENCODING and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"it asks for getattr({cls!r}, {name!r}), which a checkpoint never contains")


_INDEX_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    ("collections", "OrderedDict"): collections.OrderedDict,
    # checkpoint_id, when DCP was given a path; Python 3.13 pickles it from pathlib._local.
    **{(module, name): getattr(pathlib, name) for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "PurePosixPath")},
    ("builtins", "getattr"): _enum_member}
# BUILD's state for each dataclass: the names of its fields (TensorProperties: the 5-tuple of its __setstate__).
_BUILDS = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (
    Metadata, dcp_metadata.StorageMeta, dcp_metadata.MetadataIndex, dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, _StorageInfo)}
# Opcodes an index never holds: persistent ids, the extension registry, sets (~200 bytes of memory per byte),
# out-of-band buffers, protocol 0/1 instances and NEWOBJ_EX's keyword arguments.
_NOT_IN_AN_INDEX = b"PQ\x82\x83\x84\x8f\x90\x91\x97\x98io\x92"


class _Opcodes(dict):
    def __missing__(self, code):
        raise pickle.UnpicklingError(f"it holds pickle opcode {bytes([code])!r}, which an index never contains")


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be replaced, its memo is a dict
    def find_class(self, module, name):
        try:
            return _INDEX_GLOBALS[module, name]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a checkpoint never contains") from None

    def load_build(self):
        inst, state = self.stack[-2], self.stack[-1]
        ok = (type(state) is tuple and len(state) == 5) if type(inst) is dcp_metadata.TensorProperties else (
            type(state) is dict and all(type(k) is str and k in _BUILDS.get(type(inst), ()) for k in state))
        if not ok:  # type(), not isinstance: a class is never an instance of the classes above
            target = f"the class {inst.__name__}" if isinstance(inst, type) else f"a {type(inst).__name__}"
            raise pickle.UnpicklingError(f"it sets {shown(state)} on {target}, which a checkpoint never does")
        pickle._Unpickler.load_build(self)

    def load_mark(self):
        if len(self.metastack) >= 64:  # an index nests a few levels; a MARK a byte would hold a list a byte
            raise pickle.UnpicklingError("it nests more than 64 levels deep, which an index never does")
        pickle._Unpickler.load_mark(self)

    dispatch = _Opcodes({code: load for code, load in pickle._Unpickler.dispatch.items()
                         if code not in _NOT_IN_AN_INDEX})
    dispatch.update({pickle.BUILD[0]: load_build, pickle.MARK[0]: load_mark})


class _SafeReader(FileSystemReader):
    # FileSystemReader.read_metadata with the restricted unpickler instead of pickle.load (torch 2.13 internals).
    # No **kwargs: DCP would then fall back to a rank's own __N.metadata, which no checkpoint here holds.
    def read_metadata(self) -> Metadata:
        metadata = read_index(self._get_metadata_path())
        metadata.storage_meta = metadata.storage_meta or dcp_metadata.StorageMeta()  # read_index: one, or None
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


# ==========================================================================================================
# Part 2. The run around the checkpoints: Run and the resume rules, run(), stopping, flags, the lock, data, metrics

# -- The run's checkpoints: continued exactly, or refused

class Run:
    """A run's checkpoints, made once in main after the process groups (collective unless given job, its launch
    ids): the checkpoint it continues, the data, what it trains, the save in flight; main calls each in order."""
    current = None  # this process's: run() waits for its save in flight when the run fails

    def __init__(self, args, rank: int, world_size: int, say, job: list[str] | None = None):
        self.args, self.rank, self.world_size, self.say = args, rank, world_size, say
        self.job = job_ids() if job is None else job  # shared by every attempt: relayout fits a restart on others
        self.data, self.in_flight, self.background = None, None, None  # in flight: (DCP's future, step-N.tmp, meta)
        self.trained = None  # resume's (model, optimizer, config): what save_if_due saves
        self.path, self._meta = latest(args.checkpoint_dir), None
        Run.current = self

    def saved(self) -> dict:
        """The meta.json of the checkpoint this run continues (read once; {} if none)."""
        if self._meta is None:
            self._meta = read_meta(self.path) if self.path else {}
        return self._meta

    def source(self) -> str | None:
        """Where the model's shape comes from if not --model: --init-from, or a resumed run's checkpoint if it
        started from other weights (those need not exist anymore)."""
        if self.path is not None:
            return self.path if self.saved().get("run", {}).get("init_from") is not None else None
        return self.args.init_from

    def preset_model(self) -> bool:
        """Whether the model's shape is --model's; False while a damaged checkpoint hides it (reported later)."""
        with contextlib.suppress(UsageError):
            return self.source() is None
        return False

    def relayout(self, stages_per_rank: int) -> tuple[int, str]:
        """The --dp and --split this attempt runs at: the flags', or a layout of the same run that fits the processes
        when this job saved the newest checkpoint on another number (docs/launching.md); the same on every rank."""
        args, world_size, path, meta = self.args, self.world_size, self.path, self.saved()
        saved, old_world = meta.get("args", {}), meta.get("world_size", world_size)
        if not same_job(meta.get("job"), self.job) or old_world == world_size or not {"dp", "tp"} <= saved.keys():
            return args.dp, args.split  # a new launch takes its flags as given, as does a restart on as many
        old_pp, layers, tp = old_world // (saved["dp"] * saved["tp"]), meta["config"]["num_hidden_layers"], args.tp

        def fits(pp: int, dp: int) -> bool:
            return pp * stages_per_rank <= max_stages(layers) and not args.batch_size % (dp * args.microbatches *
                                                                                          args.accumulate)

        found = [pp for pp in range(1, world_size // tp + 1) if world_size % (pp * tp) == 0
                 and fits(pp, world_size // (pp * tp))]
        if not found:
            counts = sorted({pp * dp * tp for pp in range(1, max_stages(layers) // stages_per_rank + 1)
                             for dp in range(1, max(old_world, world_size) // (pp * tp) + 1) if fits(pp, dp)})
            raise UsageError(f"{world_size} process(es) cannot hold this run ({os.path.basename(path)}, saved by "
                             f"{old_world}): with --tp {tp}, --batch-size {args.batch_size}, --microbatches "
                             f"{args.microbatches} and {layers} layers in {stages_per_rank} stage(s) per pipeline "
                             f"rank it needs {', '.join(map(str, counts)) or 'more layers'} process(es); start that "
                             "many", on_every_rank=True)
        pp = max([pp for pp in found if pp <= old_pp], default=min(found))
        dp, split, note = world_size // (pp * tp), args.split, ""
        try:
            check_layout(split, layers, pp * stages_per_rank)
        except ValueError:
            split, note = "balanced", f" (--split {args.split} is for {args.split.count(',') + 1} stages: balanced)"
        self.say(f"{old_world} processes -> {world_size}: pp {old_pp} x dp {saved['dp']} x tp {saved['tp']} -> pp "
                 f"{pp} x dp {dp} x tp {tp}{note}; resuming {path} at step {meta['step']}", flush=True)
        return dp, split

    def check(self, data: dict) -> None:
        """check_run, then whether the run continues its checkpoint's (args.init_from: the one it recorded)."""
        self.data = data  # read_data_meta's: for model_config, resume and the checkpoints
        check_run(self.args, self.rank, self.job)
        if self.args.fresh:
            self.path, self._meta = latest(self.args.checkpoint_dir), None  # left: one this job saved, a restart
        with collective_errors():
            if self.path is not None:
                self.args.init_from = self.saved().get("run", {}).get("init_from")
                check_same_run(self.args, self.path, data["data_id"], self.saved())  # the model once it is known

    def model_config(self, device_type: str) -> tuple[LlamaConfig, str]:
        """The model to train and its name: source()'s (its tokenizer must be the data's), else the preset's with
        the data's vocabulary and --layers. Call it inside collective_errors."""
        args, vocab, source = self.args, self.data["vocab_size"], self.source()
        if source is None:
            preset = model_preset(args.model, device_type)
            return config_from_preset(preset, vocab, args.layers), preset
        config, path = source_config(source, args)
        if not same_tokenizer(path, args.data, ("--init-from" if source == args.init_from else "--checkpoint-dir",
                                                "--data")):
            raise UsageError(f"--init-from {path}: its tokenizer is not the one --data {args.data} was prepared "
                             f"with; prepare the data with it: python prepare_data.py --tokenizer {path} --out DIR")
        if vocab > config.vocab_size:  # a Hugging Face model may have more rows than tokens
            raise UsageError(f"--data {args.data}: {vocab} tokens, but {path} has embeddings for {config.vocab_size}")
        return config, f"from {path if source == args.init_from else args.init_from}"  # resumed: where it started

    def resume(self, model, optimizer, config: LlamaConfig) -> tuple[int, dict | None]:
        """Continue the run exactly (none: from --init-from's weights), or refuse in one line. Collective.
        Returns the step done and the data loader's position (None: from the start)."""
        args, path, say = self.args, self.path, self.say
        self.trained = model, optimizer, config
        if path is None:
            if args.init_from is not None:
                source = load_weights(args.init_from, model, config)
                say(f"initialized from the weights of {source} (a new run: new AdamW state, LR schedule and data "
                    "order)", flush=True)
            return 0, None
        with collective_errors():
            meta = check_same_run(args, path, self.data["data_id"], self.saved(), config)
            verify_files(path, meta)
            windows = sum((tokens - 1) // args.seq_len for tokens in self.data["train"]["tokens"])  # as Batches counts
            if meta.get("data") is not None and meta["data"]["index"] > windows:
                raise bad_checkpoint("--checkpoint-dir", path, f"its meta.json's data index {meta['data']['index']}"
                                                               f" is past the {windows} windows of --data")
        if meta["step"] >= args.steps > 0:
            say(f"{path} is step {meta['step']}: --steps {args.steps} are done, nothing to train", flush=True)
            return meta["step"], None
        load_state(path, model, optimizer, config)
        name = f"rng/rank{self.rank}.pt"
        if meta["world_size"] == self.world_size:  # RNG streams belong to ranks; another layout starts new ones
            with collective_errors(), open_untrusted(path, name):
                if name not in meta["files"]:  # those listed are verified: inside, no link
                    raise ValueError("its meta.json does not list it")
                rng = torch.load(os.path.join(path, name), weights_only=True)  # plain data only
                torch.set_rng_state(rng["cpu"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
        precision = meta.get("args", {}).get("precision", args.precision)  # free to change: said, not refused
        say((f"resumed from {path} at step {meta['step']} (saved by {meta['world_size']} process(es))"
             if args.steps else f"evaluating {path} (step {meta['step']})") +
            (f"; --precision {precision} → {args.precision} (free to change: weights and AdamW stay fp32, only "
             "the computation's rounding can differ)" if precision != args.precision else ""), flush=True)
        return meta["step"], meta.get("data")

    def save_if_due(self, step: int, position: dict, stop: str | None) -> str | None:
        """Save what resume took every --checkpoint-every steps, at the end and on a stop (the signal that asked), with
        the data loader's position (--async-checkpoint: docs/checkpoints.md); what to say of those saved. Collective."""
        args, (model, optimizer, config) = self.args, self.trained
        last = step == args.steps or stop is not None
        due = last or (args.checkpoint_every and step % args.checkpoint_every == 0)
        said = [f"saved {path}"] if (path := self.finish_save(wait=due)) else []
        if due:
            meta = {"config": dataclasses.asdict(config), "run": run_identity(args, self.data["data_id"]),
                    "data": position, "args": vars(args), "torch": torch.__version__, "job": self.job}
            background = None
            if args.async_checkpoint and not last:  # written by a thread, completed by a later call
                background = self.background = self.background or background_group(args.timeout)
            path = save(args.checkpoint_dir, step, model, optimizer, meta, self.rank, args.keep_checkpoints,
                        args.data, background)
            if background is not None:
                self.in_flight = path
            else:
                said.append(f"stopped by {stop} after step {step}, saved in {path}; the same command continues "
                            "the run" if stop else f"saved {path}")
        return "\n".join(said) or None

    def finish_save(self, wait: bool) -> str | None:
        """Complete the save in flight once every rank wrote its files (not wait: only if they have). Collective."""
        if self.in_flight is None or (not wait and max_over_ranks(not self.in_flight[0].done())):
            return None
        written, tmp, meta = self.in_flight
        self.in_flight = None
        with _saving(tmp, self.rank):
            written.result()  # DCP raises a rank's failure on every rank
        return _complete(tmp, meta, self.rank, self.args.keep_checkpoints, self.args.data)


def run_identity(args, data_id: str) -> dict:
    """What a checkpoint records of its run, to compare on resume: the flags declared with run=True, the data."""
    return {**{flag: getattr(args, flag) for flag in args.run_flags}, "data": args.data, "data_id": data_id,
            "init_from": args.init_from}


def check_same_run(args, path: str, data_id: str, meta: dict, config: LlamaConfig | None = None) -> dict:
    """One line naming each flag (old → new) in which this run differs from its checkpoint (meta), and
    the model (config, or what --model and --layers say); --init-from is recorded, not compared."""
    identity, saved, found = run_identity(args, data_id), meta.get("run", {}), []
    if config is not None:
        model = dataclasses.asdict(config)
    elif saved.get("init_from") is None and args.model:
        model = dataclasses.asdict(config_from_preset(args.model, meta["config"].get("vocab_size"), args.layers))
    else:  # from other weights: nothing known yet; without --model the preset is the device's, known later
        model = {"num_hidden_layers": args.layers} if args.layers and saved.get("init_from") is None else {}
    found += [f"model {field} {meta['config'].get(field)} → {value} (--model, --layers, --init-from)"
              for field, value in model.items() if meta["config"].get(field) != value]
    for flag in args.run_flags:  # a flag newer than the checkpoint: it ran at the flag's default of off
        old, new = saved.get(flag, False if isinstance(identity[flag], bool) else None), identity[flag]
        if old != new and not (flag == "steps" and new <= meta["step"]):  # fewer steps than done: nothing to run
            found.append(f"--{flag.replace('_', '-')} {old} → {new}")
    if saved.get("data_id") != data_id:
        found.append(f"--data {saved.get('data')} → {args.data} (other data, or prepared again differently)")
    if found:
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: {os.path.basename(path)} is another run: "
                         f"{'; '.join(found)}. Rerun with its flags to continue it, add --fresh to start over "
                         f"(its checkpoints are moved aside), or start a new run from its weights with "
                         f"--init-from {path} --checkpoint-dir NEW_DIR")
    return meta


def _set_aside(checkpoint_dir: str, job: list[str], say=print) -> None:
    """--fresh: move what checkpoint_dir holds to DIR.previous-TIME but the lock and this job's checkpoints."""
    def saved_by_this_job(name: str) -> bool:
        with contextlib.suppress(UsageError):  # damaged: nothing to resume
            return same_job(read_meta(os.path.join(checkpoint_dir, name)).get("job"), job)
        return False
    complete = {os.path.basename(path) for path in complete_checkpoints(checkpoint_dir)}
    entries = [name for name in os.listdir(checkpoint_dir)
               if name != LOCK_NAME and not (name in complete and saved_by_this_job(name))]
    if not entries:
        return
    stamp = f"{checkpoint_dir.rstrip(os.sep)}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
    aside = next(path for path in (stamp, *(f"{stamp}-{n}" for n in range(2, 10**6))) if not os.path.lexists(path))
    try:
        os.makedirs(aside)
        for name in entries:
            os.replace(os.path.join(checkpoint_dir, name), os.path.join(aside, name))
    except OSError as e:
        raise UsageError(f"--fresh: cannot move the checkpoints in {checkpoint_dir} aside ({e.strerror})") from None
    say(f"--fresh: moved the previous checkpoints to {aside}", flush=True)


# -- Around main: a mistake as one line, a lost peer said as such, always torn down

def run(main, args) -> None:
    """main(args): a UsageError as one line (status 1), a lost peer said as such, always torn down; SIGTERM,
    Ctrl-C and SIGHUP stop it after its step (stop_requested), a second one at once."""
    _listen_for_stops()
    flight_recorder(args.checkpoint_dir)  # before main starts NCCL, which reads it
    status, done = 1, False
    try:
        main(args)
        status, done = 0, True
    except UsageError as e:  # an error every rank raised is printed once per node, and no restart mends it
        if e.on_every_rank and dist.is_initialized():  # after every rank closed its progress bar: on a line of its own
            with contextlib.suppress(Exception):
                dist.barrier()
        if not e.on_every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = final_status(1) if e.on_every_rank else 1
    except (dist.DistError, RuntimeError) as e:
        # gloo reports a dead or hung peer as a RuntimeError of its transport, NCCL as a DistError. This rank
        # cannot tell whether the peer died or stopped on an error of its own, so say both.
        if not isinstance(e, dist.DistError) and not any(marker in str(e) for marker in (
                "gloo/transport", "Timed out", "Connection closed by peer", "Connection reset by peer")):
            raise  # a bug, not a lost peer: keep the traceback
        print(f"error: lost contact with another rank ({(str(e).strip() or type(e).__name__).splitlines()[0][:300]}"
              "); if another rank printed an error above, that is the cause; otherwise rerun the same command, or "
              "launch with torchrun --max-restarts N, to resume from the newest checkpoint", file=sys.stderr)
    finally:
        if Run.current is not None and Run.current.in_flight is not None:  # stopped by an error: its thread may
            Run.current.in_flight[0].exception()  # be in a collective of its group; waited for, never completed
        Run.current = None
        if dist.is_initialized() and done:
            dist.destroy_process_group()
        elif dist.is_initialized():  # stopped on an error: destroying would flush the calls still pending (NCCL's
            with contextlib.suppress(Exception):  # wait for a peer that stopped, until the watchdog kills the rank);
                dist.distributed_c10d._abort_process_group()  # an abort NCCL cannot finish raises after --timeout
    gc.collect()  # torch 2.13: process groups freed at interpreter exit (held by main's frames) can abort (-6)
    sys.exit(status)


def flight_recorder(checkpoint_dir: str, environ=os.environ) -> None:
    """NCCL's flight recorder on, dumped on a timeout to DIR/nccl-trace-rankN; a user's settings win."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:  # the older name of TORCH_FR_BUFFER_SIZE
        environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the process's last 2000 calls, of all its groups
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in environ:  # the older name of TORCH_FR_DUMP_TEMP_FILE
        environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(os.path.abspath(checkpoint_dir), "nccl-trace-rank"))


# -- Stopping: SIGTERM, SIGINT (Ctrl-C) and SIGHUP stop the run after its step, with a checkpoint; another one more
# than 2 s later (not a copy of the same request) ends it at once (docs/launching.md, "Stopped, preempted").
# A watcher thread hears each signal at once: Python runs handlers in the main thread only, which may wait in a
# collective until --timeout, but its C-level handler writes the signal to set_wakeup_fd's pipe even then. run.sh
# records the requests it gets in PIPELINE_STOP_FILE, which the ranks read when they start and after every step.

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_STOP = {"signal": None, "at": None, "said": False}  # the request this rank knows of: its signal's name, when
_IMPORTED = time.time()  # where a process's start cannot be read: about when it started


def _listen_for_stops() -> None:
    read, write = os.pipe()
    os.set_blocking(write, False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: None)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch():
        while True:
            for signum in os.read(read, 64):
                if signum in STOP_SIGNALS:
                    _asked_to_stop(signal.Signals(signum))
    threading.Thread(target=watch, daemon=True).start()
    _launcher_request()  # made before this process listened


def _asked_to_stop(signum: signal.Signals) -> None:
    """In the watcher thread: the first request asks for a stop after the step; a signal 2 s later ends it."""
    if signum == signal.SIGHUP:
        _quiet_if_hung_up()
    _launcher_request()
    if _STOP["at"] is None:
        _STOP.update(signal=signum.name, at=time.time())
        _say_request()
    elif time.time() - _STOP["at"] > 2:
        if _STOP["said"] and not os.path.exists(os.environ.get("PIPELINE_STOP_FILE", "")):  # else run.sh says it
            _say(f"{signum.name} again: stopped at once, without saving this step; the same command resumes from "
                 "the newest checkpoint")
        os._exit(128 + signum)  # no teardown: the main thread may be inside a collective that never returns


def _launcher_request() -> None:
    """Take on run.sh's recorded request ("SIGNAL RUN_SH_PID") if this rank has none: its launch's,
    or one made since this process started (an older one is another run's)."""
    try:
        with open(os.environ["PIPELINE_STOP_FILE"]) as f:
            (name, *launcher), at = f.read().split() or [""], os.fstat(f.fileno()).st_mtime
    except (KeyError, OSError):
        return
    if _STOP["at"] is None and name in {s.name for s in STOP_SIGNALS} and (
            _launched_by(launcher[:1]) or at >= _started_at()):
        if name == "SIGHUP":
            _quiet_if_hung_up()
        _STOP.update(signal=name, at=at)
        _say_request()


def _launched_by(pid: list) -> bool:
    """Whether [pid] is the process that started this one's launcher (run.sh, which started torchrun); Linux."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            return [f.read().rsplit(")", 1)[1].split()[1]] == pid
    except (OSError, IndexError):
        return False


@functools.cache
def _started_at() -> float:
    """When this process started, in seconds since the epoch (Linux; elsewhere: when it imported this module)."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(_process_start(os.getpid())) / os.sysconf("SC_CLK_TCK")  # btime is whole: up to 1 s early
    except (OSError, StopIteration, TypeError, ValueError):
        return _IMPORTED


def _say_request() -> None:
    """Say the request, if this is the first rank of its torchrun attempt on this node to hear one."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # the node's ranks: the torchrun agent's children, of one attempt
        agent = " ".join((os.environ["TORCHELASTIC_RUN_ID"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                          str(os.getppid()), str(_process_start(os.getppid()))))
        said = os.path.join(os.path.dirname(os.environ.get("PIPELINE_STOP_FILE", "")) or tempfile.gettempdir(),
                            f"stop-said-{hashlib.sha256(agent.encode()).hexdigest()[:16]}")
        try:
            os.close(os.open(said, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            if "PIPELINE_STOP_FILE" not in os.environ:  # run.sh removes its folder
                atexit.register(_remove, said)
        except FileExistsError:
            return  # said by another rank
        except OSError:
            pass  # cannot tell: say it
    _STOP["said"] = True
    _say(f"{_STOP['signal']}: stopping after this step, with a checkpoint; again to stop at once")


def _quiet_if_hung_up() -> None:
    """After a terminal closed, writing to it fails (EIO), which would end the run before its checkpoint."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # on a line of its own, in one write: never mixed with another process's
        os.write(2, f"\n{line}\n".encode())


def final_status(status: int) -> int:
    """The status of a mistake every rank found, which no torchrun restart mends: under run.sh it goes to
    RUN_SH_STATUS_FILE's second line and the process exits 0, so torchrun ends the job."""
    with contextlib.suppress(KeyError, OSError), open(os.environ["RUN_SH_STATUS_FILE"], "r+") as f:
        if _launched_by(f.readline().split()):
            f.seek(0, os.SEEK_CUR)  # from reading to writing, after the pid's line
            f.write(f"{status}\n")
            f.truncate()
            return 0
    return status


def stop_requested() -> str | None:
    """Collective, once a step: the signal that asked any rank to stop, or None, the same on every rank."""
    _launcher_request()
    signum = max_over_ranks(signal.Signals[_STOP["signal"]] if _STOP["signal"] else 0)
    if signum == signal.SIGHUP:  # heard first by another rank (this one's watcher may not have run): same terminal
        _quiet_if_hung_up()
    return signal.Signals(signum).name if signum else None


# -- The command line

class Parser(argparse.ArgumentParser):
    """argparse with each mistake in one line and every default in --help. A flag declared with run=True defines
    what the run computes: a resumed run must keep it (check_same_run). Their names: args.run_flags."""

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # no "(default: None)" for a flag that is off unless given
            off = action.default is None or action.default is False  # `is`: a default of 0 (== False) is shown
            return action.help if off else super()._get_help_string(action)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": self.Formatter, **kwargs})
        self.set_defaults(run_flags=[])

    def add_argument_group(self, *args, **kwargs):
        group, declare = super().add_argument_group(*args, **kwargs), None

        def add_argument(*names, run: bool = False, **options):
            action = declare(*names, **options)
            if run:
                self.get_default("run_flags").append(action.dest)
            return action
        group.add_argument, declare = add_argument, group.add_argument
        return group

    def error(self, message):
        self.exit(final_status(2), f"error: {message} (see --help)\n")


def whole(minimum: int):  # argparse type: a whole number >= minimum
    def parse(text):
        if not text.lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, got {text}")
        return int(text)
    return parse


def number(positive: bool, maximum: float = math.inf, unit: str = ""):  # argparse type: a finite number > 0
    def parse(text):  # (positive) or >= 0, up to maximum
        value = math.nan  # not a number: refused below
        with contextlib.suppress(ValueError):
            value = float(text)
        if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > maximum:
            raise argparse.ArgumentTypeError(f"must be a finite {'positive' if positive else 'non-negative'} "
                                             f"number{f' up to {maximum:g}{unit}' * (maximum < math.inf)}, got {text}")
        return value
    return parse


seconds = number(True, 7 * 24 * 3600, " (a week)")  # --timeout's: torch's stores fail at once from 2**63 ns (9.2e9 s)


def checkpointing(text):  # argparse type of --activation-checkpointing: a SPEC (model.checkpointing_plan)
    try:
        checkpointing_plan(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return text


class ScheduleChoices(list):
    """--schedule's choices for argparse: those listed, and any FILE.csv (an order: read_order) where FILE.csv is; an
    order plan.py generates (GENERATED_ORDERS), or a FILE.csv where none is read: one line pointing to plan.py."""

    def __contains__(self, value) -> bool:
        name, files = str(value).lower(), super().__contains__("FILE.csv")
        if super().__contains__(value) or (name.endswith(".csv") and files):
            return True
        if name not in GENERATED_ORDERS and not name.endswith(".csv"):
            return False
        why = (f"{value} is an order plan.py generates: write it with plan.py --schedule {name} --write-schedule "
               f"{name}.csv (and the run's flags), then give --schedule {name}.csv" if name in GENERATED_ORDERS else
               f"{value}: this script runs {' or '.join(self)}; give an order from a file (plan.py --write-schedule)")
        elsewhere = "" if files else " to train_pipeline_gpipe.py or train_pipeline_tracer.py"
        raise argparse.ArgumentError(None, f"argument --schedule: {why}{elsewhere}")  # argparse reports it as it is


GENERATED_ORDERS = ("zbh2", "zb1p", "zb2p", "zbvauto")  # plan.GENERATED's names (a test keeps them the same)


def model_preset(model: str | None, device_type: str) -> str:  # --model's, by default tiny on CPU, small on GPU
    return model or ("small" if device_type == "cuda" else "tiny")


# -- Before a run writes anything: its paths and its lock

def check_run(args, rank: int, job: list[str]) -> None:
    """Every check of what the run writes, collectively, before it writes: paths, rank 0's lock, --fresh."""
    data = os.path.realpath(args.data)
    with collective_errors():  # 1. nothing written yet: is every path usable, and apart from the data?
        if args.async_checkpoint and torch.__version__ < "2.13":  # measured: torch 2.11's DefaultStager fails
            raise UsageError(f"--async-checkpoint: torch {torch.__version__} cannot stage a checkpoint (its copy "
                             "of the state fails: KeyError <class 'type'>); use torch 2.13 or leave the flag out")
        for flag, path, directory in (("--checkpoint-dir", args.checkpoint_dir, True),
                                      ("--metrics", args.metrics, False), ("--trace", args.trace, True)):
            # Never written into the data, nor holding it: --fresh moves what --checkpoint-dir holds.
            common = os.path.commonpath([os.path.realpath(path), data]) if path else None
            if common == data or (flag == "--checkpoint-dir" and common == os.path.realpath(path)):
                raise UsageError(f"{flag} {path}: {'is or lies inside' if common == data else 'holds'} --data "
                                 f"{args.data}; choose a {flag} apart from the data")
            if path:
                check_output(flag, path, directory)
    token = [None]
    with collective_errors():  # 2. one run per checkpoint directory
        if rank == 0:
            token[0] = RunLock.acquire(args.checkpoint_dir, job).holder["token"]
    dist.broadcast_object_list(token, src=0)
    with collective_errors():  # 3. every rank sees that directory and can write its shard there
        check_output("--checkpoint-dir", args.checkpoint_dir, True, token[0])
    with collective_errors():  # 4. --fresh, once per job: a restart keeps (and resumes) what this job saved
        if args.fresh and rank == 0:
            _set_aside(args.checkpoint_dir, job)


def check_output(flag: str, path: str, directory: bool, lock_token: str | None = None) -> None:
    """path (a directory, or a file) can be written: a file is written, fsynced, renamed and removed in it or
    its nearest ancestor (the only sure test); lock_token: every node sees the directory rank 0 locked."""
    if lock_token is not None and (_read_lock(os.path.join(path, LOCK_NAME)) or {}).get("token") != lock_token:
        raise UsageError(f"{flag} {path}: this node does not see the directory rank 0 locked; with several nodes "
                         f"{flag} must be on a filesystem they all share")
    where, problem = os.path.abspath(path), "cannot write there"
    if os.path.lexists(path) and directory != os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a file, not a directory; choose another {flag}" if directory else
                         f"{flag} {path}: is a directory; give a file name")
    if not os.path.lexists(path):
        while not os.path.lexists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            raise UsageError(f"{flag} {path}: cannot be created, {where} is a file, not a directory; "
                             f"choose another {flag}")
        problem = f"cannot be created in {where}"
    probe = os.path.join(where, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        if not os.path.isdir(where):  # an existing file, which --metrics rewrites in place: opened, not changed
            open(where, "a").close()
        else:
            _write_synced(probe + ".tmp", "probe")
            os.replace(probe + ".tmp", probe)
            os.remove(probe)
    except OSError as e:
        for leftover in (probe + ".tmp", probe):
            _remove(leftover)
        raise UsageError(f"{flag} {path}: {problem} ({root_cause(e)}); choose another {flag}") from None


# The lock: one run per checkpoint directory; when a killed run's lock is taken over (its holder gone, an earlier
# attempt of this job, or silent for STALE_SECONDS): docs/checkpoints.md#one-run-per-checkpoint-directory.
LOCK_NAME, HEARTBEAT_SECONDS, STALE_SECONDS = "run.lock", 10, 60


class RunLock:
    """DIR/run.lock, held by one run's rank 0 from before its first write until it exits."""

    def __init__(self, path: str, holder: dict, created_dir: bool):
        self.path, self.holder, self.created_dir = path, holder, created_dir
        self._stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()
        atexit.register(self.release)

    @classmethod
    def acquire(cls, directory: str, job: list[str] = ()) -> "RunLock":
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
            raise UsageError(f"--checkpoint-dir {directory}: {path} is not a run lock (a link or a directory); "
                             "move it away, or choose another --checkpoint-dir")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "job": list(job), "token": os.urandom(16).hex()}
        for _ in range(3):
            try:
                _write_synced(path, json.dumps(me), exclusive=True)
                return cls(path, me, created)
            except FileExistsError:
                holder = _read_lock(path)
            if not _stale(holder, me, path):
                who = (f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
                       if holder else "a run that is starting")
                raise UsageError(f"--checkpoint-dir {directory}: another run is using it ({who}); wait for it to "
                                 f"finish or choose another --checkpoint-dir (if that run is gone, delete {path})")
            with contextlib.suppress(FileNotFoundError):  # of two runs taking it over, one renames it (atomic)
                os.rename(path, f"{path}.stale-{me['token']}")
                os.remove(f"{path}.stale-{me['token']}")
        raise UsageError(f"--checkpoint-dir {directory}: another run took {path} just now")

    def _mine(self) -> bool:
        return (_read_lock(self.path) or {}).get("token") == self.holder["token"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):  # a full or flaky disk: the run's own saves report it
                if not self._mine():
                    return  # taken over (this run was stopped for longer than STALE_SECONDS): leave it alone
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock, and the checkpoint directory too if this run created it and wrote nothing else."""
        self._stop.set()
        with contextlib.suppress(OSError):
            if self._mine():
                os.remove(self.path)
            if self.created_dir and not os.listdir(os.path.dirname(self.path)):
                os.rmdir(os.path.dirname(self.path))


def _read_lock(path: str) -> dict | None:
    try:
        holder = read_json(path)
        return holder if isinstance(holder, dict) and {"host", "pid", "started"} <= holder.keys() else None
    except (OSError, ValueError):
        return None  # gone, or being written by a run that is starting


def _stale(holder: dict | None, me: dict, path: str) -> bool:
    """Whether the run that holds the lock is gone, as far as this host can tell."""
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return True
    if holder is None:  # unreadable: a run between creating the file and writing it, unless it died there
        return age > STALE_SECONDS
    if holder["host"] != me["host"]:  # an earlier attempt of this job is gone; another job's run, once silent
        return same_job(holder.get("job"), me["job"]) or age > STALE_SECONDS
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, another user's
    started = holder.get("pid_started")  # a reused pid is another process: its start time differs
    return started is not None and _process_start(holder["pid"]) not in (None, started)


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), so a reused pid is not mistaken for the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (ended, not yet waited for; os.kill finds it): "ended"
            return "ended" if (fields := f.read().rsplit(")", 1)[1].split())[0] == "Z" else fields[19]
    except (OSError, IndexError):
        return None


# -- The data a run reads, and the --metrics and --trace it writes

def read_data_meta(directory: str) -> dict:
    """The data's meta.json, checked (every token file there, of its size), with data_id: the hash checkpoints keep."""
    prepare = f"python prepare_data.py{'' if directory == 'data' else ' --out ' + directory}"
    try:
        raw = read_bytes(os.path.join(directory, "meta.json"), MAX_JSON_BYTES)
        meta = {**json.loads(raw), "data_id": hashlib.sha256(raw).hexdigest()[:16]}
        for split in ("train", "val"):
            for name, tokens in zip(meta[split]["files"], meta[split]["tokens"], strict=True):
                path, expected = os.path.join(directory, name), tokens * np.dtype(meta["dtype"]).itemsize
                if not os.path.isfile(path) or os.path.getsize(path) != expected:
                    found = f"has {os.path.getsize(path):,} bytes" if os.path.isfile(path) else "is missing"
                    raise UsageError(f"--data {directory}: {name} {found}, meta.json says {expected:,}; the data "
                                     f"is incomplete or damaged, prepare it again: {prepare}")
    except OSError:
        raise UsageError(f"--data {directory}: no data prepared there; run {prepare} first (see its --help)") from None
    except (KeyError, TypeError, ValueError, RecursionError) as e:  # not JSON, or not prepare_data.py's JSON
        raise UsageError(f"--data {directory}: its meta.json is damaged ({type(e).__name__}: {e}); prepare it "
                         f"again: {prepare}") from None
    return meta


def eval_batches(args, windows: int) -> int:
    """--eval-batches, or by default up to 4, as many as the held-out windows fill (at least one)."""
    if not args.eval_every and args.steps:  # no evaluation
        return args.eval_batches or 0
    if args.eval_batches is None and windows:
        return max(1, min(4, windows // args.batch_size))
    if not windows:
        raise UsageError(f"--seq-len {args.seq_len}: --data {args.data} holds no held-out window of --seq-len + 1 "
                         "tokens; use a shorter --seq-len, prepare more held-out data (prepare_data.py --eval-data), "
                         "or train without evaluating (--eval-every 0)")
    if windows < args.eval_batches * args.batch_size:
        raise UsageError(f"--eval-batches {args.eval_batches}: --data {args.data} holds {windows} held-out windows of "
                         f"--seq-len + 1, fewer than --eval-batches x --batch-size; ask fewer, or leave the flag out "
                         "(up to 4 batches, as many as there are)")
    return args.eval_batches


class Metrics:
    """--metrics FILE, a JSON line per row (None: not written); resumed, rows after resume_step are dropped
    and that step's evaluation (done again), so it reads as one run."""

    def __init__(self, path: str | None, resume_step: int):
        self.file, self.loss, self.held_out = None, None, None  # the last step's loss and evaluation: the done line
        if path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step and os.path.isfile(path):
            with open(path) as f:
                kept = [row for row in map(json.loads, f) if (row["step"] <= resume_step if "step" in row else
                        row.get("eval", {}).get("step", math.inf) < resume_step)]  # its evaluation is done again
        self.file = open(path, "w")
        for row in kept:
            self.write(row)

    def write(self, row: dict) -> None:
        self.loss, self.held_out = row.get("loss", self.loss), row.get("eval", self.held_out)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def final_losses(self) -> str:
        """For the run's last line: the last step's training loss, and the last held-out loss (at its step)."""
        held_out = f" (held-out {self.held_out['loss']:.4f} at step {self.held_out['step']})" if self.held_out else ""
        return f"loss {self.loss:.4f}{held_out}" if self.loss is not None else "no step trained"


def summary(env, step_times: list[float], tokens_per_step: int, config, args, metrics) -> None:
    """The run's last line, collective: every rank's peak memory, printed with the step time, tokens/s and MFU (per
    optimizer step), and written to --metrics by the rank that writes them."""
    peaks = [None] * env.world_size
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(env.device) if env.device.type == "cuda" else
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    if metrics is None or not step_times:
        return
    steady = sorted(step_times[1:] or step_times)  # the first step pays one-time costs
    row = {"steps": len(step_times), "median_step_time": steady[len(steady) // 2],
           "tokens_per_s": tokens_per_step * len(steady) / sum(steady), "peak_memory_bytes_per_rank": peaks}
    row["mfu"] = mfu(row["tokens_per_s"], config, args.seq_len, env.device, env.dtype, env.world_size)
    metrics.write({"summary": row})
    utilization = f", MFU {row['mfu']:.1%}" if row["mfu"] else ""
    print(f"done: {row['steps']} steps, {metrics.final_losses()}, median step {row['median_step_time'] * 1e3:.0f} ms, "
          f"{row['tokens_per_s']:.0f} tokens/s{utilization}; per rank, peak memory ({env.device.type}, MiB): "
          f"{', '.join(f'{b / 2**20:.3g}' for b in peaks)}", flush=True)


def traced_run(args, env, config: LlamaConfig, layers: list[range], chunks: int) -> dict:
    """What a --trace measured ("run" in each rank's trace), for plan.py --trace to check against its plan."""
    return {"model": {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
                      "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                      "head_dim": config.head_dim, "ffn": config.intermediate_size, "vocab": config.vocab_size},
            "seq_len": args.seq_len, "rows": args.batch_size // (args.dp * args.microbatches * args.accumulate),
            "batch_size": args.batch_size, "microbatches": args.microbatches, "accumulate": args.accumulate,
            "dp": args.dp, "tp": args.tp, "split": [len(stage) for stage in layers], "schedule": args.schedule,
            "stages_per_rank": getattr(args, "stages_per_rank", 1),  # the hand-written script's: one
            "device": env.device.type, "dtype": str(env.dtype).removeprefix("torch."),
            "processes": env.world_size, "sequence_parallel": args.sequence_parallel and args.tp > 1,
            "activation_checkpointing": args.activation_checkpointing, "loss_chunks": chunks,
            "document_masking": args.document_masking, "seq_chunks": args.seq_chunks,
            "vocab_parallel": getattr(args, "vocab_parallel", False)}  # the hand-written script's


def profiler(args, env, step: int, config: LlamaConfig, layers: list[range], chunks: int):
    """--trace DIR: torch.profiler over the last 3 steps, each rank's trace in DIR/rankN.json; else a null context."""
    if not args.trace:
        return contextlib.nullcontext()
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(0, args.steps - step - 4), warmup=1, active=3),
        on_trace_ready=lambda p: (os.makedirs(args.trace, exist_ok=True),
                                  p.export_chrome_trace(os.path.join(args.trace, f"rank{env.rank}.json"))))
    # torch 2.13 exports only the metadata its session was given (add_metadata_json in on_trace_ready is too late).
    profiler.preset_metadata_json("run", json.dumps(traced_run(args, env, config, layers, chunks)))
    return profiler


# -- This job: its attempts (torchrun restarts; a node lost or back) continue one run, on the processes there are

def job_ids() -> list[str]:
    """This job as its nodes' launch ids (collective; docs/launching.md): an attempt shares one with the earlier
    ones, another job none. torchrun's default id, "none", names no job: then it is torchrun's agent (the parent)."""
    launch = os.environ.get("RUN_SH_LAUNCH_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    if not (launch and launch.strip() and launch != "none"):
        pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
        launch = f"{socket.gethostname()}-{pid}-{_process_start(pid)}"  # no other launch, here or elsewhere
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, launch)
    return sorted(set(ids))


def same_job(recorded, job: list[str]) -> bool:
    """Whether the job ids a lock or a checkpoint recorded (any JSON: the files are untrusted) share one with job."""
    return isinstance(recorded, list) and not set(job).isdisjoint(i for i in recorded if isinstance(i, str))
