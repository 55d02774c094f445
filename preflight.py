"""Checks before a run does any work, and the lock that keeps one run per checkpoint directory.

Before the model is built, every rank checks what the run will write and read: the checkpoint directory can be
created and a file in it written, fsynced and renamed (each rank writes its own shard there); the --metrics and
--trace files can be created; the data files and the tokenizer exist and are what they claim to be. A problem
on any rank stops every rank with the same one line (runtime.collective_errors), exit status 1, and nothing
written: a run that cannot save its first checkpoint fails in seconds instead of after hours of training.

The lock: DIR/run.lock, created by the run's rank 0 (one per run, however many nodes share DIR) and removed
when the run ends. It holds the holder's host, pid and start time. A second run on DIR stops at once and names
the holder. A lock left behind by a run that was killed (kill -9, a node that died) is taken over:
  * at once, when its holder was on this host and that process is gone, or when it was an earlier attempt of
    this same torchrun job (same run id, lower restart count: torchrun --max-restarts);
  * otherwise once it is older than STALE_SECONDS: the holder touches the file every HEARTBEAT_SECONDS while it
    runs, so only a holder that stopped (or a node that died) lets it age. Hosts sharing DIR need clocks that
    agree to a few seconds (NTP).
"""

import atexit
import errno
import json
import os
import socket
import threading
import time
import uuid

import torch.distributed as dist

import checkpoint
import data
import flags
import hf
import runtime
import split
from model import LlamaConfig
from runtime import UsageError

LOCK_NAME = "run.lock"
HEARTBEAT_SECONDS = 10
STALE_SECONDS = 60


def check(args, env: runtime.Env) -> None:
    """Every check, on every rank, collectively; takes the lock on rank 0. Call it right after the process group
    exists and before anything else: each phase writes only once the previous one passed on every rank."""
    with runtime.collective_errors():  # 1. nothing written yet: is every path usable?
        check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
            if path:
                check_output_file(flag, path)
        check_inputs(args, env.mesh.pp)
    token = [None]
    with runtime.collective_errors():  # 2. one run per checkpoint directory
        if env.rank == 0:
            token[0] = RunLock.acquire(args.checkpoint_dir, env.restart).holder["token"]
    dist.broadcast_object_list(token, src=0)
    with runtime.collective_errors():  # 3. every rank sees that directory and can write its shard there
        probe_directory("--checkpoint-dir", args.checkpoint_dir, token[0])
        if not args.fresh and (newest := checkpoint.latest(args.checkpoint_dir)):
            checkpoint.check_same_run(args, newest)  # the flags now; model and tokenizer once they are known
    with runtime.collective_errors():  # 4. the contents of the data files, once per node and file version
        if env.local_rank == 0:
            data.validate_files(args.data, args.cache_dir)
            if args.eval_data is not None:
                data.validate_files(args.eval_data, args.cache_dir, "--eval-data")


# ----------------------------------------------------------------------------------------------------------
# Outputs

def _describe(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on the device"
    return e.strerror or str(e)


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _check_creatable(flag: str, path: str) -> None:
    """path does not exist yet: its nearest existing ancestor must be a directory we may create entries in."""
    ancestor = _nearest_existing(path)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag} {path}: cannot be created, {ancestor} is a file, not a directory; "
                         f"choose another {flag}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(ancestor) else "permission denied"
        raise UsageError(f"{flag} {path}: cannot be created in {ancestor} ({reason}); choose another {flag}")


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


# ----------------------------------------------------------------------------------------------------------
# Inputs

def check_inputs(args, stages: int) -> None:
    """Data, tokenizer and --init-from exist and are readable; --init-from (a Hugging Face directory or one of
    this project's checkpoints) fills in the model's shape and the tokenizer (its own, unless --tokenizer).

    Resuming, --init-from is ignored: the run's checkpoints hold its weights, and a run that was started from
    other weights takes its model's shape and tokenizer from its newest checkpoint (checkpoint.model_source),
    so the directory it was started from may have moved or gone. args.init_from becomes the one the run was
    started with, which new checkpoints record."""
    data.check_files(args.data)
    if args.eval_data is not None:
        data.check_files(args.eval_data, "--eval-data")
    if (resume := checkpoint.resuming(args)) is not None:
        args.init_from = checkpoint.read_meta(resume).get("run", {}).get("init_from")
    source = checkpoint.model_source(args)
    if source is not None:
        flag = "--init-from" if resume is None else "--checkpoint-dir"
        if hf.is_hf_dir(source):
            config = hf.read_config(source)  # refuses what model.py lacks
        elif os.path.isdir(source):
            source = checkpoint.resolve(source, flag)
            config = LlamaConfig(**checkpoint.read_meta(source)["config"])
        else:
            raise UsageError(f"--init-from {source}: not a directory; give a Hugging Face model directory "
                             "(config.json + *.safetensors) or a checkpoint of this project")
        if args.layers is not None and args.layers != config.num_hidden_layers:
            raise UsageError(f"--layers {args.layers}: the model of {source} has {config.num_hidden_layers} layers; "
                             f"leave --layers out (the model's shape comes from {flag})")
        if args.model is not None:
            raise UsageError(f"--model {args.model}: the model's shape comes from {source}; leave --model out")
        if args.vocab_size is not None:
            raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary comes from {source} (its embeddings "
                             "and tokenizer); leave --vocab-size out")
        args.layers = config.num_hidden_layers
        flags.check_model(config.num_hidden_layers, config.max_position_embeddings, stages, args.seq_len)
        split.check_split(args.split, config.num_hidden_layers, stages * split.stages_per_rank(args))
        if args.tokenizer is None:
            if not os.path.isfile(os.path.join(source, "tokenizer.json")):
                raise UsageError(f"{flag} {source}: no tokenizer.json there; give its tokenizer with --tokenizer")
            args.tokenizer = os.path.join(source, "tokenizer.json")
    if args.tokenizer is not None:
        if args.vocab_size is not None:
            raise UsageError(f"--vocab-size {args.vocab_size}: only for a tokenizer trained on --data; --tokenizer "
                             f"{args.tokenizer} brings its own vocabulary, leave --vocab-size out")
        data.load_tokenizer(args.tokenizer)  # exists, parses, knows how to frame a document


# ----------------------------------------------------------------------------------------------------------
# One run per checkpoint directory

class RunLock:
    """DIR/run.lock, held by one run's rank 0 from before its first write until it exits (see the module doc)."""

    def __init__(self, path: str, holder: dict, created_dir: bool):
        self.path, self.holder, self.created_dir = path, holder, created_dir
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True)

    @classmethod
    def acquire(cls, directory: str, restart: int = 0) -> "RunLock":
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
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
