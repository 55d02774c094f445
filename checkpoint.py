"""What is about files of weights and runs, for every training script: distributed checkpoints (DCP) that are
atomic, exact to resume and loadable by any layout; --init-from (this project's checkpoints and Hugging Face
directories, each rank reading only its own stage's tensors); export to one file or a Hugging Face directory;
the checks of the paths a run writes; one run per checkpoint directory; and which flags a resumed run must
keep; and how a run ends: an error a user can cause is a UsageError, one line, the same on every rank
(collective_errors, run).

Each rank saves only what its stage holds, under the *full* model's parameter names; no rank ever gathers the
whole model. Because names do not depend on the split, a checkpoint written with p stages (and any --dp)
loads into any other layout: each rank asks DCP for exactly its own keys. A --checkpoint-dir holds:

    step-00000100/         a complete checkpoint
        __0_0.distcp ...   DCP shards: model and AdamW state of every stage, keyed by parameter name
        .metadata          DCP's index of the shards
        rng/rank0.pt ...   each rank's RNG states (restored when the number of processes is unchanged)
        tokenizer.json     the tokenizer the data was prepared with (and tokenizer_config.json), so an export
                           is self-contained
        meta.json          step, data position, model config, run flags, layout, file sizes
    step-00000200.tmp/     a save in progress
    run.lock               held by the run using the directory

A save writes into step-N.tmp, waits for every rank, writes meta.json last and renames the directory: a
directory without .tmp is complete, a run killed mid-save leaves the previous checkpoints untouched, and older
checkpoints are deleted (beyond --keep-checkpoints) only after a newer one is complete. Loading never unpickles
arbitrary objects: DCP's index is read with an unpickler that accepts only DCP's own metadata classes, and
every torch.load uses weights_only=True.

    python checkpoint.py export CHECKPOINT OUT.pt              # the full model for one process
    python checkpoint.py export CHECKPOINT OUT_DIR --format hf  # for transformers' from_pretrained
"""

import argparse
import atexit
import collections
import contextlib
import dataclasses
import errno
import gc
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from model import LlamaConfig, LlamaForPretraining, config_from_hf, config_from_preset, hf_config, hf_name

# ----------------------------------------------------------------------------------------------------------
# Errors: one line, on every rank


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line, exit status 1, no traceback.

    on_every_rank: every rank raises this same error, so one line per node is enough."""

    def __init__(self, message: str, on_every_rank: bool = False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


@contextlib.contextmanager
def collective_errors(group=None):
    """Run a block on every rank; if it raises a UsageError on any rank, raise that error on every rank.

    A problem that one rank finds (a file its node cannot read, a checkpoint directory that one node cannot
    write) would otherwise end that rank alone: the others would wait for it until --timeout and report a lost
    peer, and torchrun would name a rank that did nothing wrong. The block itself must not start a collective
    that a failing rank would skip. Costs one all-reduce of one number when nothing failed.
    """
    error = None
    try:
        yield
    except UsageError as e:
        error = e
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    messages = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else str(error), group=group)
    found = [rank for rank, message in enumerate(messages) if message is not None]
    message = messages[found[0]]
    if len(found) < len(messages):  # say where, when only some ranks (nodes) have the problem
        message += f" (found on rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))})"
    raise UsageError(message, on_every_rank=True) from None


def run(main, args) -> None:
    """main(args), an error a user can cause as one line on stderr (exit status 1), always torn down."""
    status = 0
    try:
        main(args)
    except UsageError as e:  # an error every rank raised is printed once per node
        if not e.on_every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        status = 1
    except (dist.DistError, RuntimeError) as e:
        # gloo reports a dead or hung peer as a RuntimeError of its transport, NCCL as a DistError. This rank
        # cannot tell whether the peer died or stopped on an error of its own, so say both.
        if not isinstance(e, dist.DistError) and not any(marker in str(e) for marker in (
                "gloo/transport", "Timed out", "Connection closed by peer", "Connection reset by peer")):
            raise  # a bug, not a lost peer: keep the traceback
        print(f"error: lost contact with another rank ({(str(e).strip() or type(e).__name__).splitlines()[0][:300]}"
              "); if another rank printed an error above, that is the cause; otherwise rerun the same command, or "
              "launch with torchrun --max-restarts N, to resume from the newest checkpoint", file=sys.stderr)
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The failed main's frames (held by the exception until now) hold the device mesh, and its process groups
    # own gloo's threads: freed here, not while the interpreter shuts down, where torch 2.13 can abort the
    # process ("terminate called without an active exception", exit -6) instead of exiting 1.
    gc.collect()
    sys.exit(status)


# ----------------------------------------------------------------------------------------------------------
# The command line: argparse with one-line errors, for the training scripts and the export below

class Parser(argparse.ArgumentParser):
    """argparse with each mistake in one line (the usage is in --help), every flag's default in --help, and the
    flags that moved out of the training scripts named where they went."""
    MOVED = {"--tokenizer": "prepare_data.py --tokenizer", "--vocab-size": "prepare_data.py --vocab-size",
             "--eval-data": "prepare_data.py --eval-data", "--cache-dir": "prepare_data.py --out (data is prepared "
             "once, then read with --data)", "--plan": "plan.py (python plan.py --processes N ...)"}

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # no "(default: None)" for a flag that is off unless given
            return action.help if action.default in (None, False) else super()._get_help_string(action)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": self.Formatter, **kwargs})

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        for flag in (a.split("=")[0] for a in (sys.argv[1:] if args is None else args)):
            if flag in self.MOVED:
                self.error(f"{flag} moved to {self.MOVED[flag]}")
        return super().parse_args(args, namespace)


def whole(minimum: int):  # argparse type: a whole number >= minimum
    def parse(text):
        if not text.lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {minimum}, got {text}")
        return int(text)
    return parse


def number(positive: bool):  # argparse type: a finite number > 0 (positive) or >= 0
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite {'positive' if positive else 'non-negative'} "
                                             f"number, got {text}")
        return value
    return parse


# ----------------------------------------------------------------------------------------------------------
# Before a run writes anything: its paths, its lock, and whether it continues the run in --checkpoint-dir

def check_run(args, rank: int, restart: int, data_id: str) -> None:
    """Every check of what the run will write, on every rank, collectively; takes the lock on rank 0. Call it
    right after the process group exists: each phase writes only once the previous one passed on every rank.

    A run that cannot save its first checkpoint fails in seconds instead of after hours of training. Resuming,
    --init-from is ignored (the run's checkpoints hold its weights, and where it started may have moved):
    args.init_from becomes the one the run recorded."""
    with collective_errors():  # 1. nothing written yet: is every path usable?
        check_apart(args)
        check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
            if path:
                (check_output_dir if flag == "--trace" else check_output_file)(flag, path)
    token = [None]
    with collective_errors():  # 2. one run per checkpoint directory
        if rank == 0:
            token[0] = RunLock.acquire(args.checkpoint_dir, restart).holder["token"]
    dist.broadcast_object_list(token, src=0)
    with collective_errors():  # 3. every rank sees that directory and can write its shard there; same run?
        probe_directory("--checkpoint-dir", args.checkpoint_dir, token[0])
        if (resume := resuming(args)) is not None:
            args.init_from = read_meta(resume).get("run", {}).get("init_from")
            check_same_run(args, resume, data_id)  # the flags now; the model once it is known


def check_apart(args) -> None:
    """No output of the run lies inside the data it reads, and --checkpoint-dir does not hold it either: --fresh
    and --keep-checkpoints move and delete what a --checkpoint-dir holds."""
    data = os.path.realpath(args.data)
    for flag, path in (("--checkpoint-dir", args.checkpoint_dir), ("--metrics", args.metrics), ("--trace", args.trace)):
        common = os.path.commonpath([os.path.realpath(path), data]) if path else None
        if common == data or (flag == "--checkpoint-dir" and common == os.path.realpath(path)):
            raise UsageError(f"{flag} {path}: {'is or lies inside' if common == data else 'holds'} --data "
                             f"{args.data}; choose a {flag} apart from the data")


def _describe(e: OSError) -> str:
    return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def _check_creatable(flag: str, path: str) -> None:
    """path does not exist yet: its nearest existing ancestor must be a directory we may create entries in."""
    ancestor = os.path.abspath(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag} {path}: cannot be created, {ancestor} is a file, not a directory; "
                         f"choose another {flag}")
    try:  # the only sure test (permissions, a read-only or special filesystem such as /proc): create, remove
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=ancestor))
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be created in {ancestor} ({_describe(e)}); choose another "
                         f"{flag}") from None


def _read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def check_output_dir(flag: str, path: str) -> None:
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            reason = "read-only file system" if _read_only(path) else "permission denied"
            raise UsageError(f"{flag} {path}: cannot write there ({reason}); choose another {flag}")
    elif os.path.lexists(path):
        raise UsageError(f"{flag} {path}: is a file, not a directory; choose another {flag}")
    else:
        _check_creatable(flag, path)


def check_output_file(flag: str, path: str) -> None:
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if os.path.lexists(path):
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: cannot be written (permission denied); choose another {flag}")
    else:
        _check_creatable(flag, path)


def probe_directory(flag: str, path: str, lock_token: str) -> None:
    """path is the directory rank 0 locked (one shared filesystem for every node), and a file can be written,
    fsynced and renamed in it, then removed: what a checkpoint save does."""
    held = _read_lock(os.path.join(path, LOCK_NAME)) if os.path.isdir(path) else None
    if held is None or held.get("token") != lock_token:
        raise UsageError(f"{flag} {path}: this node does not see the directory rank 0 locked; with several nodes "
                         f"{flag} must be on a filesystem they all share")
    name = os.path.join(path, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(name + ".tmp", "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        os.replace(name + ".tmp", name)
        os.remove(name)
    except OSError as e:
        for leftover in (name + ".tmp", name):
            if os.path.exists(leftover):
                os.remove(leftover)
        raise UsageError(f"{flag} {path}: cannot write a file there ({_describe(e)}); choose another {flag}")


# The lock: DIR/run.lock, created by the run's rank 0 (one per run, however many nodes share DIR) and removed when
# the run ends. It holds the holder's host, pid and start time. A second run on DIR stops at once and names the
# holder. A lock left behind by a run that was killed (kill -9, a node that died) is taken over:
#   * at once, when its holder was on this host and that process is gone, or when it was an earlier attempt of
#     this same torchrun job (same run id, lower restart count: torchrun --max-restarts);
#   * otherwise once it is older than STALE_SECONDS: the holder touches the file every HEARTBEAT_SECONDS while
#     it runs, so only a holder that stopped (or a node that died) lets it age. Hosts sharing DIR need clocks
#     that agree to a few seconds (NTP).
LOCK_NAME = "run.lock"
HEARTBEAT_SECONDS = 10
STALE_SECONDS = 60


class RunLock:
    """DIR/run.lock, held by one run's rank 0 from before its first write until it exits (see above)."""

    def __init__(self, path: str, holder: dict, created_dir: bool):
        self.path, self.holder, self.created_dir = path, holder, created_dir
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True)

    @classmethod
    def acquire(cls, directory: str, restart: int = 0) -> "RunLock":
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
            raise UsageError(f"--checkpoint-dir {directory}: {path} is not a run lock (a link or a directory); "
                             "move it away, or choose another --checkpoint-dir")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
              "restart": restart, "token": uuid.uuid4().hex}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(path)
                if not _stale(holder, me, path):
                    who = (f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
                           if holder else "a run that is starting")
                    raise UsageError(f"--checkpoint-dir {directory}: another run is using it ({who}); wait for "
                                     f"it to finish or choose another --checkpoint-dir (if that run is gone, "
                                     f"delete {path})") from None
                # Move the stale lock away atomically: of two runs taking it over, only one rename succeeds.
                try:
                    os.rename(path, f"{path}.stale-{me['token']}")
                    os.remove(f"{path}.stale-{me['token']}")
                except FileNotFoundError:
                    pass  # another run took it over first; the next attempt finds its lock
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            lock = cls(path, me, created)
            lock._heartbeat.start()
            atexit.register(lock.release)
            return lock
        raise UsageError(f"--checkpoint-dir {directory}: another run took {path} just now")

    def _mine(self) -> bool:
        held = _read_lock(self.path)
        return held is not None and held.get("token") == self.holder["token"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                if not self._mine():
                    return  # taken over (this run was stopped for longer than STALE_SECONDS): leave it alone
                os.utime(self.path)
            except OSError:
                pass  # a full or flaky disk: the run's own saves report it

    def release(self) -> None:
        """Remove the lock, and the checkpoint directory too if this run created it and wrote nothing else."""
        self._stop.set()
        try:
            if self._mine():
                os.remove(self.path)
            if self.created_dir and not os.listdir(os.path.dirname(self.path)):
                os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass


def _read_lock(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
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
    if holder.get("run_id") and holder.get("run_id") == me["run_id"] and holder.get("restart", 0) < me["restart"]:
        return True  # an earlier attempt of this torchrun job, which torchrun stopped before restarting it
    if holder["host"] == me["host"]:
        return not _alive(holder["pid"], holder.get("pid_started"))
    return age > STALE_SECONDS


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), so a reused pid is not mistaken for the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    return started is None or _process_start(pid) in (None, started)


# ----------------------------------------------------------------------------------------------------------
# Which model a run trains: a preset, --init-from's, or (resuming a run started from weights) its checkpoint's

def resuming(args) -> str | None:
    """The checkpoint this run continues: the newest complete one in --checkpoint-dir (None with --fresh)."""
    return None if args.fresh else latest(args.checkpoint_dir)


def preset_model(args) -> bool:
    """Whether the model's shape is --model's (no --init-from, and no resumed run that started from other
    weights); False while that cannot be told yet (a damaged checkpoint, reported once the ranks have met)."""
    try:
        return model_source(args) is None
    except UsageError:
        return False


def model_source(args) -> str | None:
    """Where the model's shape comes from, when not from --model: --init-from for a new run; for a resumed run
    that was started from other weights, its newest checkpoint (so those weights need not exist anymore)."""
    if (resume := resuming(args)) is not None:
        return resume if read_meta(resume).get("run", {}).get("init_from") is not None else None
    return args.init_from


def model_config(args, data: dict, device_type: str) -> tuple[LlamaConfig, str]:
    """The model to train and a name for it: --init-from's (a Hugging Face directory or a checkpoint of this
    project, whose tokenizer must be the one the data was prepared with), else the preset's with the data's
    vocabulary and --layers. data: the prepared data's meta.json. Call it inside collective_errors."""
    source = model_source(args)
    if source is None:
        preset = args.model or ("small" if device_type == "cuda" else "tiny")
        return config_from_preset(preset, data["vocab_size"], args.layers), preset
    config, path = source_config(source, args)
    if not same_tokenizer(path, args.data):
        raise UsageError(f"--init-from {path}: its tokenizer is not the one --data {args.data} was prepared "
                         f"with; prepare the data with it: python prepare_data.py --tokenizer {path} --out DIR")
    if data["vocab_size"] > config.vocab_size:  # a Hugging Face model may have more rows than tokens
        raise UsageError(f"--data {args.data}: {data['vocab_size']} tokens, but {path} has embeddings for "
                         f"{config.vocab_size}")
    return config, f"from {path if source == args.init_from else args.init_from}"  # resumed: where it started


def source_config(source: str, args) -> tuple[LlamaConfig, str]:
    """The model of --init-from (a Hugging Face directory, a checkpoint of this project, or a --checkpoint-dir:
    its newest) and the path read. --model, or another --layers, beside it is refused."""
    path = source
    if is_hf_dir(source):
        config = read_hf_config(source)
    elif os.path.isdir(source):
        path = resolve(source, "--init-from")
        config = LlamaConfig(**read_meta(path, "--init-from")["config"])
    else:
        raise UsageError(f"--init-from {source}: not a directory; give a Hugging Face model directory "
                         "(config.json + *.safetensors) or a checkpoint of this project")
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
        with open(os.path.join(path, "config.json")) as f:
            return config_from_hf(json.load(f))
    except (OSError, ValueError) as e:
        raise UsageError(f"--init-from {path}: {e}") from None


def same_tokenizer(a: str, b: str) -> bool:
    """Whether the tokenizer.json files in directories a and b have the same vocabulary, merges and special
    tokens. What else may differ: the post-processor (prepare_data.py adds one that puts bos first), settings a
    newer tokenizers writes out, and the spelling of merges ("a b", or ["a", "b"] since tokenizers 0.20)."""
    def essence(directory):
        with open(os.path.join(directory, "tokenizer.json")) as f:
            tokenizer = json.load(f)
        model = tokenizer.get("model") or {}
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
        return (model.get("type"), model.get("vocab"), merges,
                [(t["id"], t["content"]) for t in tokenizer.get("added_tokens", [])])
    try:
        return essence(a) == essence(b)
    except (OSError, ValueError) as e:
        raise UsageError(f"--init-from {a}: cannot read its tokenizer.json ({e})") from None


# ----------------------------------------------------------------------------------------------------------
# Finding checkpoints

_STEP_DIR = re.compile(r"^step-(\d{8})$")


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


def read_meta(path: str, flag: str = "--checkpoint-dir") -> dict:
    """The meta.json of the checkpoint at path, or one line saying why it is not one (flag: how path was given;
    only a run's own damaged checkpoint is worth deleting)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        problem = f"its meta.json cannot be read ({e})"
    else:
        if isinstance(meta, dict) and {"step", "config", "files"} <= meta.keys():
            return meta
        problem = "it holds data prepared by prepare_data.py" if isinstance(meta, dict) and {
            "dtype", "train", "val"} <= meta.keys() else "its meta.json lacks step, config or files"
    fix = "delete it to resume from an older one" if flag == "--checkpoint-dir" else \
        f"give {flag} a checkpoint of this project"
    raise UsageError(f"{flag} {path}: not a complete checkpoint, {problem}; {fix}")


def set_aside(checkpoint_dir: str) -> str | None:
    """Move what checkpoint_dir holds into DIR.previous-TIME (for --fresh); nothing is deleted. The run's lock
    stays where it is."""
    entries = [n for n in os.listdir(checkpoint_dir) if n != LOCK_NAME] if os.path.isdir(checkpoint_dir) else []
    if not entries:
        return None
    aside = f"{checkpoint_dir.rstrip(os.sep)}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(aside)
    for name in entries:
        os.replace(os.path.join(checkpoint_dir, name), os.path.join(aside, name))
    return aside


# ----------------------------------------------------------------------------------------------------------
# Saving

# Optimizer state and hyperparameters keyed by parameter name ("optim.state.<fqn>.exp_avg",
# "optim.param_groups.<fqn>.lr"). The default keys param groups by their index; every stage has a group 0 with
# different parameters in it, DCP keeps only one rank's copy of such a shared key, and the others lose theirs.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_EMBED, _HEAD = "base_model.embed_tokens.weight", "lm_head.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save(checkpoint_dir: str, step: int, model, optimizer, meta: dict, rank: int, keep: int,
         tokenizer_dir: str | None = None) -> str:
    """Save this rank's stage, collectively with every rank; return the finished checkpoint's path.

    meta (JSON-able) must hold at least "config"; rank 0's copy is the one written. tokenizer_dir: where the
    tokenizer files to copy in are. A save that fails on any rank (a full disk, a permission) raises the same
    UsageError on every rank, after the partial step-N.tmp is removed; the complete checkpoints are never
    touched before the new one is complete.
    """
    final = step_dir(checkpoint_dir, step)
    tmp = final + ".tmp"
    try:
        with collective_errors(), _save_errors(tmp):
            if rank == 0:
                _remove(tmp)  # left over from a save that was killed
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
                for name in TOKENIZER_FILES if tokenizer_dir else ():
                    if os.path.isfile(os.path.join(tokenizer_dir, name)):
                        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
                files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                         for d, _, fs in os.walk(tmp) for f in fs}
                meta = dict(meta, step=step, world_size=len(layout), layers_per_rank=layout, files=files)
                _write_synced(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
                os.replace(tmp, final)
                _fsync_dir(checkpoint_dir)
    except UsageError:
        if rank == 0:
            _remove(tmp)  # frees what the failed save took; nothing else is touched
        raise
    if rank == 0:
        for old in complete_checkpoints(checkpoint_dir)[:-keep] if keep > 0 else []:
            _remove(old)
    dist.barrier()
    return final


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a directory, if there."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


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


def _state(model, optimizer, config: LlamaConfig) -> tuple[dict, dict]:
    """This rank's model (and AdamW) state by full-model name, as saved; and, per name the model and optimizer
    use, the name it is saved under.

    A tied head (tie_word_embeddings) is saved once, as the embedding: a stage that holds only the head saves
    and loads its copy under the embedding's name (the scripts keep the copies equal), so the checkpoint loads
    into any layout, with the two in one stage (one tensor) or in two."""
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
    """Every file the save wrote is there with its size, and the index is DCP's, naming only those files.

    Checked before DCP reads anything, so a truncated copy or a tampered index fails here with one clear line,
    on every rank alike.
    """
    for name, size in meta.get("files", {}).items():
        full = os.path.join(path, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != size:
            raise UsageError(f"--checkpoint-dir: {path} is damaged: {name} has {actual} bytes, expected {size}; "
                             "delete that checkpoint to resume from an older one")
    with open_untrusted(path, ".metadata"):
        metadata = read_index(os.path.join(path, ".metadata"))
        for info in metadata.storage_data.values():  # a shard outside the checkpoint would be read too
            if info.relative_path not in meta.get("files", {}):
                raise ValueError(f"it points to {info.relative_path!r}, which the checkpoint does not hold")


@contextlib.contextmanager
def open_untrusted(path: str, name: str):
    """A file of a checkpoint that cannot be read as what this project writes: one line, naming it."""
    try:
        yield
    except Exception as e:  # the restricted readers run nothing, whatever the file holds: any failure is its content
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"{os.path.join(path, name)}: damaged, or not a checkpoint of this project ({reason}); "
                         "refusing to read it") from None


def load(path: str, model, optimizer, config: LlamaConfig, rank: int, world_size: int) -> dict:
    """Load this rank's stage, AdamW state and RNG from the checkpoint at path, collectively. Returns its meta.json.
    The caller has checked that the checkpoint is of this run (resume)."""
    meta = read_meta(path)
    state, saved_as = _state(model, optimizer, config)
    _dcp_load(state, path)
    _set_state(model, optimizer, state, saved_as)
    if meta.get("world_size") == world_size:  # RNG streams belong to ranks; another layout starts new ones
        with collective_errors(), open_untrusted(path, f"rng/rank{rank}.pt"):
            rng = torch.load(os.path.join(path, "rng", f"rank{rank}.pt"), weights_only=True)  # data, never code
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


def read_index(file: str) -> Metadata:
    """DCP's index (.metadata) of a checkpoint, a pickle, read without running anything it asks for.

    A checkpoint is untrusted input: pickle.load would call whatever it names. _MetadataUnpickler hands out only
    the exact (module, name) pairs DCP writes, as objects looked up here once: never a dotted name, never a
    whole module, never getattr on anything but the one enum DCP pickles."""
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _enum_member(cls, name: str):
    # getattr(cls, name), as Python 3.11.2 pickles an enum member, for DCP's memory-format enum only.
    if cls is _MEM_FORMAT and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"it asks for getattr({cls!r}, {name!r}), which a checkpoint never contains")


_MEM_FORMAT = dcp_metadata._MEM_FORMAT_ENCODING
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
    ("builtins", "getattr"): _enum_member,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return _INDEX_GLOBALS[module, name]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a checkpoint never contains") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it asks for a persistent object, which a checkpoint never contains")


class _SafeReader(FileSystemReader):
    # FileSystemReader.read_metadata with the restricted unpickler instead of pickle.load (torch 2.13 internals).
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_index(self._get_metadata_path(kwargs.get("rank")))
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
# Resume: continue the same run exactly, or refuse

# The flags that define what a run computes, besides the model itself (meta.json's "config") and the data (the
# prepared data's identity). A rerun on the same --checkpoint-dir must have the checkpoint's values, or it would
# continue another run with this one's weights, AdamW state and data position. --steps is among them because
# the LR schedule is a function of it: a cosine recomputed for a longer run would jump the LR back up. The other
# flags (--microbatches, the number of processes, --schedule, --trace, --metrics, ...) change how the same
# numbers are computed, and are free. --init-from is recorded but not compared: once a run has checkpoints they
# are its weights, and where it started may have moved; the model is compared all the same.
RUN_FLAGS = ("seed", "seq_len", "batch_size", "steps", "lr", "warmup_steps", "weight_decay", "grad_clip")


def data_identity(directory: str) -> str:
    """The prepared data at directory, as a short hash of its meta.json (token counts, sources, tokenizer)."""
    with open(os.path.join(directory, "meta.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def run_identity(args, data_id: str) -> dict:
    """What a checkpoint records of its run, to compare on resume."""
    return {**{flag: getattr(args, flag) for flag in RUN_FLAGS}, "data": args.data, "data_id": data_id,
            "init_from": args.init_from}


def check_same_run(args, path: str, data_id: str, config: LlamaConfig | None = None) -> dict:
    """Raise a one-line UsageError naming each flag (old → new) in which this run differs from the checkpoint
    at path; compares the model too when given. Returns the checkpoint's meta.json."""
    meta = read_meta(path)
    identity = run_identity(args, data_id)
    saved, found = meta.get("run", {}), []
    if config is not None:
        found += [f"model {field} {meta['config'].get(field)} → {value} (--model, --layers, --init-from)"
                  for field, value in dataclasses.asdict(config).items() if meta["config"].get(field) != value]
    for flag in RUN_FLAGS:
        old, new = saved.get(flag), identity[flag]
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


def resume(args, rank: int, world_size: int, model, optimizer, config: LlamaConfig, data_id: str,
           say=print) -> tuple[int, dict | None]:
    """Continue the run in --checkpoint-dir from its newest complete checkpoint, exactly, or refuse in one line
    naming each changed flag. With --fresh, move its checkpoints aside first; with nothing to resume and
    --init-from, start from those weights. Collective. Returns the step done (>= --steps: nothing left to do)
    and the data loader's position to continue from (None: from the start)."""
    if args.fresh:
        with collective_errors():
            if rank == 0:
                try:
                    aside = set_aside(args.checkpoint_dir)
                except OSError as e:
                    raise UsageError(f"--fresh: cannot move the checkpoints in {args.checkpoint_dir} aside "
                                     f"({e.strerror})") from None
                if aside:
                    say(f"--fresh: moved the previous checkpoints to {aside}", flush=True)
    path = resuming(args)
    if path is None:
        if args.init_from is not None:
            source = load_weights(args.init_from, model, config)
            say(f"initialized from the weights of {source} (a new run: new AdamW state, LR schedule and data "
                "order)", flush=True)
        return 0, None
    with collective_errors():
        meta = check_same_run(args, path, data_id, config)
        verify_files(path, meta)
    if meta["step"] >= args.steps > 0:
        say(f"{path} is step {meta['step']}: --steps {args.steps} are done, nothing to train", flush=True)
        return meta["step"], None
    load(path, model, optimizer, config, rank, world_size)
    say(f"resumed from {path} at step {meta['step']} (saved by {meta['world_size']} process(es))"
        if args.steps else f"evaluating {path} (step {meta['step']})", flush=True)
    return meta["step"], meta["data"]


def save_if_due(args, rank: int, step: int, model, optimizer, config: LlamaConfig, data_id: str,
                data_position: dict) -> str | None:
    """Save after every --checkpoint-every steps and at the end of the run; return the path if it saved."""
    if step != args.steps and not (args.checkpoint_every and step % args.checkpoint_every == 0):
        return None
    meta = {"config": dataclasses.asdict(config), "run": run_identity(args, data_id), "data": data_position,
            "tokens": special_tokens(args.data), "args": vars(args), "torch": torch.__version__}
    return save(args.checkpoint_dir, step, model, optimizer, meta, rank, args.keep_checkpoints, args.data)


def open_metrics(path: str, resume_step: int):
    """--metrics FILE opened for this run's rows. Resumed at resume_step, the rows after it (a run killed after
    its checkpoint) are dropped, so the file reads as one uninterrupted run."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kept = []
    if resume_step and os.path.isfile(path):
        with open(path) as f:
            rows = [(line, json.loads(line)) for line in f]
        kept = [line for line, row in rows if row.get("step", row.get("eval", {}).get("step", math.inf))
                <= resume_step]
    metrics = open(path, "w")
    metrics.writelines(kept)
    return metrics


def special_tokens(directory: str) -> dict:
    """{"bos_id", "eos_id", "pad_id"} of the tokenizer in directory (tokenizer.json and the names in
    tokenizer_config.json), for an export's config.json."""
    try:
        with open(os.path.join(directory, "tokenizer.json")) as f:
            tokenizer = json.load(f)
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            named = json.load(f)
    except (OSError, ValueError):
        return {}
    ids = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    ids.update((tokenizer.get("model") or {}).get("vocab") or {})

    def id_of(key):
        token = named.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return ids.get(token)
    return {f"{kind}_id": id_of(f"{kind}_token") for kind in ("bos", "eos", "pad")}


# ----------------------------------------------------------------------------------------------------------
# --init-from: only the model's weights, each rank its own stage's

def load_weights(source: str, model, config: LlamaConfig) -> str:
    """Only the model's weights, each rank its own stage's (with FSDP, its shard of them), from a Hugging Face
    directory or one of this project's checkpoints. Collective. Returns the path read."""
    with collective_errors():
        path = source if is_hf_dir(source) else resolve(source, "--init-from")
        if not is_hf_dir(path):
            verify_files(path, read_meta(path, "--init-from"))
    if not is_hf_dir(path):
        state, saved_as = _state(model, None, config)
        _dcp_load(state, path)
        _set_state(model, None, state, saved_as)
        return path
    # torch's HuggingFaceStorageReader reads only the requested tensors (slices of them, for FSDP's shards) from
    # the memory-mapped safetensors files and casts them to the model's dtype.
    state = get_model_state_dict(model, options=_OPTIONS)
    with collective_errors():
        request = _hf_request(path, state, config)  # their name for each of this stage's tensors
    targets = {}  # their name -> our tensors; two when a rank holds a tied embedding and its head's copy
    for name, tensor in state.items():
        targets.setdefault(request[name], []).append(tensor)
    try:
        dcp.load({key: tensors[0] for key, tensors in targets.items()}, storage_reader=HuggingFaceStorageReader(path))
    except Exception as e:  # a damaged file: DCP's CheckpointException, or the reader's own errors
        raise UsageError(f"--init-from {path}: cannot read its tensors ({_root_cause(e)})") from None
    for tensors in targets.values():
        for copy in tensors[1:]:
            copy.copy_(tensors[0])
    set_model_state_dict(model, state, options=_OPTIONS)
    return path


def _hf_request(path: str, state: dict, config: LlamaConfig) -> dict[str, str]:
    """Their name for each of a stage's tensors. A tied checkpoint stores the head's matrix once, as the
    embedding: a stage holding only the head reads it from there."""
    available = set()
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        try:  # reads the header only; a file cut short (an interrupted download) fails here
            with safe_open(os.path.join(path, name), framework="pt") as f:
                available |= set(f.keys())
        except Exception as e:  # safetensors' own error type, whatever the damage
            raise UsageError(f"--init-from {path}: {name} is not a complete safetensors file ({_root_cause(e)}); "
                             "copy or download it again") from None
    request = {}
    for name in state:
        key = hf_name(name)
        if key not in available and name == _HEAD and config.tie_word_embeddings:
            key = hf_name(_EMBED)
        if key not in available:
            raise UsageError(f"--init-from {path}: no tensor {key} in its safetensors files; is it the Llama "
                             "checkpoint that config.json describes?")
        request[name] = key
    return request


# ----------------------------------------------------------------------------------------------------------
# Export: the full model for one process, as one torch.save file or as a Hugging Face directory

def full_model_state(path: str) -> tuple[dict, LlamaConfig]:
    """The whole model's weights from the checkpoint at path, on this one process (no process group)."""
    meta = read_meta(path, "checkpoint")
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

    An output inside the checkpoint (or holding it) is refused; one that exists too, unless force and it is an
    earlier export. Everything is written under temporary names, then renamed into place: a refused or failed
    export leaves what was there untouched."""
    outputs = [output] if format == "hf" else [output, output + ".config.json", output + ".tokenizer.json"]
    source = os.path.realpath(checkpoint)
    for written in outputs:  # never over what is read, whatever the flags
        target = os.path.realpath(written)
        if os.path.commonpath([target, source]) in (target, source):
            raise UsageError(f"{written}: it is, holds or lies inside the checkpoint {checkpoint} that is exported; "
                             "give an output outside it")
    if existing := [p for p in outputs if os.path.lexists(p)]:
        what = "directory" if format == "hf" else "file name"
        if not force:
            raise UsageError(f"{existing[0]} exists; give a new {what}, or add --force to replace an earlier export")
        if not _exported(output, format):
            raise UsageError(f"{existing[0]} exists and is not an earlier export (--force replaces only those); "
                             f"give a new {what}")
    path = resolve(checkpoint)
    state, config = full_model_state(path)
    tmp = {p: f"{p}.tmp{os.getpid()}" for p in outputs}
    try:
        if format == "hf":
            save_hf(tmp[output], state, config, path, dtype, max_shard_bytes)
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


def _exported(output: str, format: str) -> bool:
    """Whether output is what an earlier export wrote, recognised by its config: the fields this project writes,
    no more and no fewer (pt: OUTPUT.config.json beside it; hf: config.json among only an export's files)."""
    config = output + ".config.json" if format == "pt" else os.path.join(output, "config.json")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)} if format == "pt" else \
        set(hf_config(LlamaConfig(), 0, 0, None, torch.float32))
    try:
        with open(config) as f:
            if set(json.load(f)) != fields:
                return False
    except (OSError, ValueError, TypeError):
        return False
    if format == "pt":
        return not os.path.isdir(output)
    return os.path.isdir(output) and not os.path.islink(output) and all(
        re.fullmatch(r"config\.json|tokenizer(_config)?\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", n)
        for n in os.listdir(output))


def save_hf(path: str, state: dict[str, torch.Tensor], config: LlamaConfig, checkpoint_path: str,
            dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Write the full model's state dict (this project's names) as a Hugging Face directory: safetensors files
    of at most max_shard_bytes each (DCP's Hugging Face writer, which also writes the index), config.json, and
    the checkpoint's tokenizer files. One process."""
    tensors = {hf_name(name): t.to(dtype) for name, t in state.items()
               if not (config.tie_word_embeddings and name == _HEAD)}  # tied: stored once
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
    tokens = read_meta(checkpoint_path).get("tokens") or special_tokens(checkpoint_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config, tokens.get("bos_id"), tokens.get("eos_id"), tokens.get("pad_id"), dtype), f,
                  indent=1)
    for name in TOKENIZER_FILES:  # prepare_data.py wrote them to put bos first, as in training
        if os.path.isfile(os.path.join(checkpoint_path, name)):
            shutil.copyfile(os.path.join(checkpoint_path, name), os.path.join(path, name))
    _set_max_length(os.path.join(path, "tokenizer_config.json"), config.max_position_embeddings)


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


def main(argv=None) -> None:
    p = Parser(description="Checkpoint tools for the pipeline training scripts.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
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
    e.add_argument("--force", action="store_true", help="replace an earlier export at OUTPUT (and its .config.json, "
                                                       ".tokenizer.json); anything else there is never replaced")
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
