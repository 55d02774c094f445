"""The machinery of test_small.py's tests, which pytest reads before it (its conftest.py): the environment, running
things (real processes, or ranks forked from a server that imported everything once), comparing numbers and
files, small configs and the scripts' pieces; the fixtures: the data prepared once, and the runs that several
tests share; and the groups those tests form under `pytest -n 2 --dist loadgroup`. test_small.py imports the
helpers it calls by name.
"""

import atexit
import contextlib
import copy
import functools
import json
import math
import multiprocessing.forkserver
import os
import random
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest.mock
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import filelock  # torch's own dependency
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

import benchmark
import model as model_module
import nccl_rules
import plan
import prepare_data as prep
import train_pipeline_afab_manual as manual
import train_pipeline_gpipe as gpipe
import train_pipeline_tracer as tracer
from model import LlamaConfig, LlamaForPretraining, even

ROOT = Path(__file__).resolve().parent
# One step from the same weights: a split computes the unsplit model's numbers with fp32 sums taken in another
# order, ~1e-7 apart; 1e-5 leaves room for other machines' kernels and still sees one wrong element of a gradient.
# Trajectories over several steps drift further apart: drift_rtol.
RTOL = 1e-5
SCRIPTS = ("train_pipeline_gpipe.py", "train_pipeline_afab_manual.py", "train_pipeline_tracer.py")
# A suite started in the background (`pytest ... &` in a script, nohup) inherits SIGINT or SIGHUP ignored, passes
# that on to what it starts, and a shell cannot trap a signal ignored when it started: run.sh would not hear the
# Ctrl-C and the closed terminal the tests send it. Caught here, they start at their defaults in every process.
for _signal, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_signal) == signal.SIG_IGN:
        signal.signal(_signal, _handler)


# ----------------------------------------------------------------------------------------------------------
# Helpers: the environment, launching processes, comparing numbers, small configs, shared runs

def script_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("RANK", None)  # a test run from inside torchrun must not make the scripts think they are ranks
    return env


def made_once(tmp_path_factory, name: str, make) -> tuple[Path, object]:
    """make(folder) once in the session, and what it returned (JSON): under pytest-xdist by the first worker that
    asks, in a folder of the session's (each worker's own is inside it); the others wait for it, then read it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        return folder, make(folder)
    root = tmp_path_factory.getbasetemp().parent
    folder, made = root / name, root / f"{name}.json"
    with filelock.FileLock(root / f"{name}.lock"):
        if not made.exists():  # not made, or the worker making it failed (then this one fails alike)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            made.write_text(json.dumps(make(folder)))
    return folder, json.loads(made.read_text())


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The builtin corpus prepared once, as `python prepare_data.py` does with no arguments: (folder, result)."""
    def prepare(cwd: Path) -> list:
        result = launch(0, "prepare_data.py", cwd=cwd, timeout=600)
        assert result.returncode == 0, result.stderr
        return [result.args, result.stdout, result.stderr]
    cwd, (args, out, err) = made_once(tmp_path_factory, "prepared", prepare)
    return cwd / "data", subprocess.CompletedProcess(args, 0, out, err)


@pytest.fixture(scope="session")
def data_dir(prepared):
    """--data for every script run: the builtin corpus, tokenized once."""
    return str(prepared[0])


# -- Running things: as a real process (start, launch, launch_ranks, run_sh), or a main() in this process (run_main)

def start(cmd: list, *, cwd, env=None, timeout=240, wait=True, log=None):
    """Any command as a real process, in a session of its own so that it can be stopped without touching pytest:
    its CompletedProcess, or (wait=False) the Popen to finish() later. The others below are made of it. log: a
    path; the output goes to LOG.out and LOG.err instead, to be read while it runs (finish() reads them too)."""
    out, err = (open(f"{log}.{kind}", "w") if log else subprocess.PIPE for kind in ("out", "err"))
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or script_env(), stdout=out, stderr=err,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    proc.log = log
    if log:  # the process has its own copies
        out.close(), err.close()
    return finish(proc, timeout) if wait else proc


def launch(nproc: int, script: str, *args, cwd, timeout=240, wait=True, torchrun_args=(), env=None):
    """A script of this folder (or at an absolute path) with plain python (nproc=0) or under torchrun with nproc
    processes: what exit statuses, signals, stderr and torchrun show. Quicker, each rank forked: run_script;
    in-process checks: run_main."""
    if nproc == 0:
        cmd = [sys.executable, str(ROOT / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *torchrun_args, str(ROOT / script), *args]
    return start(cmd, cwd=cwd, env=env, timeout=timeout, wait=wait)


def finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out, err = proc.communicate()
        if proc.log:
            out, err = (Path(f"{proc.log}.{kind}").read_text() for kind in ("out", "err"))
        pytest.fail(f"timed out (a hang?)\n{out[-3000:]}\n{err[-3000:]}")
    if proc.log:
        out, err = (Path(f"{proc.log}.{kind}").read_text() for kind in ("out", "err"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def errors(stderr: str, most: int = 3000) -> str:
    """The end of a failed run's stderr for an assertion's message, without the C++ frames that torch appends to
    its errors (a few of them fill the message and hide which rank said what)."""
    return "\n".join(line for line in stderr.splitlines()
                     if not re.match(r"\s*(frame #\d+:|Exception raised from )", line))[-most:]


# -- The scripts' runs where torchrun itself is not what is tested: forked from a server that imported them once

# Each process of a real launch spends ~2 s of CPU (measured here; more on slower machines) importing torch,
# DTensor, FSDP and the pipelining package before the script's first line runs, and torchrun's agent ~1 s: most
# of the suite's time. run_script() forks each rank from a server process that imported them once (multiprocessing's
# forkserver, preloaded with this file, test_small.py and what they import) and runs the script's file as
# `python SCRIPT ARGS` would, as __main__ (its own argument parsing, checkpoint.run, sys.exit), with what torchrun
# gives each rank: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 hosting the
# store), and the TORCHELASTIC_* variables of a --standalone launch (a new run id each). A forked rank starts as a
# new process would: a string-hash seed other than its neighbours' (two servers, for even and odd ranks, each with
# a seed of its own), torch's, Python's and numpy's random state from the OS
# (test_a_forked_rank_starts_as_a_torchrun_rank_does).
# The server's warning filters are a rank's after its imports, and it shows no warning while importing (measured).
# What a fork cannot give: the interpreter's shutdown (the rank runs its exit handlers, then multiprocessing's
# os._exit), and no more imports than the script's (transformers is loaded; of the server's exit handlers, only
# filelock's and huggingface_hub's are not a script's, measured). So each error path, and what is about torchrun,
# signals, the command as a user types it and copies in other folders, also runs under launch().

# What a rank runs is unpickled by name in the server's fork: _run_as_main and the fixtures' workers are here, the
# tests' own workers in test_small (which imports this file as conftest, as pytest does).
PRELOAD = ["conftest", "test_small", "transformers"]
ODD_RANKS = multiprocessing.forkserver.ForkServer()  # the second server


@functools.cache
def forkserver():
    """The context ranks start from: multiprocessing's forkserver, started once, single-threaded, with this file and
    test_small.py (so torch, the scripts and the tools) imported under OMP_NUM_THREADS=1 (OpenMP reads it when torch
    loads); and ODD_RANKS, the same with another string-hash seed."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    ODD_RANKS.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # Python 3.11's forkserver ignores sys.path
    try:
        for server, seed in zip((multiprocessing.forkserver, ODD_RANKS), random.sample(range(1, 2**32), 2)):
            os.environ["PYTHONHASHSEED"] = str(seed)
            server.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # Before multiprocessing's own exit handler, which would wait for ranks a failed test left running.
    atexit.register(lambda: [job.kill() for job in Forked.started if job.poll() is None])
    return context


def _run_as_main(script: str, argv: list, env: dict, cwd: str, log: str) -> None:
    """In a forked rank: what `python SCRIPT ARGV` runs, in cwd with env, its output (unbuffered) to LOG.out and
    LOG.err; the interpreter's exit handlers run at the end as they would (the run lock is released there)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, kind in ((1, "out"), (2, "err")):
        file = os.open(f"{log}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    sys.argv, sys.path[0] = [script, *argv], os.path.dirname(script)
    torch.seed(), random.seed(), np.random.seed()  # from the OS, as torch 2.13 seeds a new process (measured)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # CPython's own, as at interpreter exit: multiprocessing ends a rank with os._exit


class Forked:
    """The ranks of run_script(), read as a launch()ed process is (poll, finish, kill_job): the exit status is the
    rank's with plain python, torchrun's with ranks (1 when one failed, -9 when killed); the output every rank's,
    in rank order. When a rank fails, the others get 10 s to stop on their own, then are killed, as torchrun
    stops the rest of a failed job."""
    started: list = []

    def __init__(self, nproc: int, script, argv: list, cwd, env: dict):
        self.nproc, self.args, self.log, self.killed = nproc, [str(script), *argv], None, False
        self.dir = tempfile.mkdtemp(prefix="ranks-")
        port, self.ranks = str(free_port()), []
        context = forkserver()
        # env may set the job's TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT: another attempt of one job. No
        # agent hosts a store here (torchrun's, for USE_AGENT_STORE True): rank 0 does, as under run.sh's nodes.
        job = dict(TORCHELASTIC_RUN_ID=uuid.uuid4().hex, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_USE_AGENT_STORE="False", GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default")
        for rank in range(max(nproc, 1)):
            torchrun = {**job, **env, **dict(
                RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)}
            self.ranks.append(context.Process(target=_run_as_main, daemon=True, args=(
                str(script), argv, torchrun if nproc else env, str(cwd), os.path.join(self.dir, str(rank)))))
            with unittest.mock.patch.object(multiprocessing.forkserver, "connect_to_new_process",
                                            ODD_RANKS.connect_to_new_process) if rank % 2 else contextlib.nullcontext():
                self.ranks[-1].start()  # odd ranks from the other server (multiprocessing asks its module for one)
        self.pid = self.ranks[0].pid
        Forked.started.append(self)

    def poll(self) -> int | None:
        codes = [p.exitcode for p in self.ranks]
        if None in codes:
            return None
        return codes[0] if not self.nproc else -signal.SIGKILL if self.killed else int(any(codes))

    returncode = property(poll)

    def communicate(self, timeout=None):
        deadline, failed_at = time.monotonic() + (timeout or math.inf), None
        while self.poll() is None:
            if failed_at is None and any(p.exitcode for p in self.ranks):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 10:
                for p in self.ranks:
                    p.kill()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        if not hasattr(self, "output"):  # read once: the files are removed
            files = [[Path(self.dir, f"{rank}.{kind}") for rank in range(len(self.ranks))] for kind in ("out", "err")]
            self.output = tuple("".join(f.read_text() if f.exists() else f"({f.name}: the rank never started)\n"
                                        for f in kind) for kind in files)
            shutil.rmtree(self.dir, ignore_errors=True)
        return self.output

    def kill(self) -> None:
        self.killed = True
        for p in self.ranks:
            p.kill()


def run_workers(worker, world_size: int, args: tuple) -> None:
    """worker(rank, *args) on world_size ranks forked from the server (forkserver), as the parity tests run."""
    forkserver()
    mp.start_processes(worker, nprocs=world_size, args=args, start_method="forkserver", join=True)


def run_script(nproc: int, script: str, *args, cwd, timeout=240, wait=True, env=None):
    """A script of this folder as launch() runs it (nproc 0: plain python), each rank forked (Forked)."""
    proc = Forked(nproc, ROOT / script, [str(a) for a in args], cwd, env or script_env())
    return finish(proc, timeout) if wait else proc


def worker_pids(parent: int) -> list[int]:
    """Child processes of a torchrun agent, read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every process started by pid, and by those, read from /proc."""
    found = worker_pids(pid)
    return found + [d for child in found for d in descendants(child)]


def kill_job(proc) -> None:
    """SIGKILL a launched job (torchrun, or run.sh and its torchrun) and every worker at once, like a machine that
    lost power. torchrun starts each worker in a session of its own, so killing torchrun's process group would
    leave the workers running: find them first, then kill them all (forked ranks: each one)."""
    if isinstance(proc, Forked):
        return proc.kill()
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_PORTS = iter(range(1 << 30))


def free_port() -> int:
    """A port no test of this worker had, free now, from below the kernel's ephemeral range. A port bound to 0 came
    from that range, where every connection (gloo's many) takes its own end: one was taken before a job's store
    bound it ("address already in use", seen in the suite). Each xdist worker has its own part of the ports."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    workers, worker = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)), os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    share = (low - 10000) // workers
    for n in _PORTS:
        port = 10000 + int(worker.removeprefix("gw") or 0) * share + n % share
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:  # a port something else holds
                continue


def launch_ranks(world_size: int, script: str, *args, cwd) -> list:
    """Start every rank by hand, as torchrun would, so each one's exit status and output can be seen. cwd: one
    folder for all, or one per rank."""
    port, cwds = str(free_port()), cwd if isinstance(cwd, list) else [cwd] * world_size
    return [run_script(0, script, *args, cwd=cwds[rank], wait=False,
                       env=dict(script_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for rank in range(world_size)]


RUN_SH = str(ROOT / "run.sh")
LAUNCHER_VARS = ["NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "MAX_RESTARTS", "LOG_DIR",
                 "RDZV_ID", "RDZV_CONF", "DRY_RUN", "PYTHON", "SHUTDOWN_TIMEOUT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                 "RUN_SH_LAUNCH_ID", "RUN_SH_STATUS_FILE"]


def launcher_env(**overrides) -> dict:
    """The scripts' test environment without anything run.sh would pick up from the machine running pytest."""
    env = script_env()
    for name in [*LAUNCHER_VARS, *(k for k in env if k.startswith("SLURM_"))]:
        env.pop(name, None)
    env["PYTHON"] = sys.executable  # this venv's torch, whatever python3 is on PATH
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def run_sh(*args, cwd, wait=True, timeout=240, log=None, **env):
    """run.sh ARGS, its variables given as keywords (NNODES=2) and nothing else of the machine's."""
    return start([RUN_SH, *args], cwd=cwd, env=launcher_env(**env), timeout=timeout, wait=wait, log=log)


def run_main(capsys, main, *argv) -> tuple[int, str, str]:
    """A tool's main(argv) in this process (prepare_data, export, plan, benchmark's parse_args, a script's parser):
    (exit status, stdout, stderr), quicker than a process where no signal, import or torchrun is checked."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- Their output: one line that names what is wrong

def one_line_error(result, *expected, status=1):
    """A real process (launch) that stopped with one line on stderr that names what is wrong (status 1; argparse:
    2)."""
    assert result.returncode == status, (result.returncode, errors(result.stderr))
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for text in expected:
        assert text in result.stderr, (text, result.stderr)


def refused(capsys, main, *argv, status: int = 1) -> str:
    """The same for a main(argv) in this process (run_main) that must exit with `status`: its one error line."""
    code, _, err = run_main(capsys, main, *argv)
    assert code == status and err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n"), \
        (argv, code, err)
    return err.rstrip("\n")


def error_lines(text: str) -> list[str]:
    """stderr without torch's own noise (the profiler's USDT lines, torchrun's warnings)."""
    return [line for line in text.splitlines() if line.startswith("error:")]


# -- Comparing numbers and files

def read_metrics(path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in rows if "step" in r], [r["summary"] for r in rows if "summary" in r]


def assert_close_rel(a, b, rtol=RTOL, what=""):
    assert abs(a - b) <= rtol * abs(b), f"{what}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"


def drift_rtol(steps: int, what: str) -> float | None:
    """How far two correct fp32 runs may have drifted apart after `steps` steps (1: the first step, both from the
    same weights) at the tests' lr 1e-2: the loss, or the gradient norm (None: not comparable any more).

    Two correct runs differ only in the order fp32 sums are taken (another layout, another microbatch count,
    another machine's kernels). Their first step agrees to round-off (~1e-7). From then on AdamW divides each
    gradient by its own running size, so round-off in a near-zero gradient becomes a different update of its
    weight, and the runs drift apart, faster the more steps. Measured on the tests' model and flags, largest
    relative difference to one process over 8 seeds x 3 microbatch counts, and 4 seeds each of pp2 x dp2 and
    pp2 x tp2: the loss 3e-7 up to step 3, 4e-6 up to step 9, 7e-5 up to step 16; the gradient norm 0 at step 1,
    2e-5 up to step 8 (2.6e-5 at step 3 seen on another machine), up to 2e-2 beyond. The tolerances are ~10x
    those. A real mistake is far above them, at the first step already (each tried, 2 stages or 2 x 2): one of
    4 microbatches' gradient dropped (grad norm 9e-2 off), gradients summed over replicas instead of averaged
    (1.0), a clipping norm without the other stage's part (0.5), replicas training on the same rows (loss 8e-4);
    and the AdamW state not restored on resume: the loss 1.4e-2 off at the second step after it."""
    if what == "loss":
        return 1e-5 if steps <= 3 else 1e-4 if steps <= 9 else 1e-3
    return 1e-5 if steps == 1 else 3e-4 if steps <= 8 else None


def assert_same_trajectory(rows: list[dict], reference: list[dict], what: str, since: int = 0, floor: float = 0):
    """Each row's loss (and gradient norm) equals the reference row's within what fp32 drift allows (drift_rtol).
    since: the step at which both runs held the same weights (a resumed run: its checkpoint's); floor: a larger
    tolerance of the run's own (compiled kernels round differently)."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference][:len(rows)], what
    for got, want in zip(rows, reference):
        steps = got["step"] - since
        assert_close_rel(got["loss"], want["loss"], max(drift_rtol(steps, "loss"), floor),
                         what=f"{what}, step {got['step']} loss")
        if "grad_norm" in got and drift_rtol(steps, "grad_norm") is not None:
            assert_close_rel(got["grad_norm"], want["grad_norm"], max(drift_rtol(steps, "grad_norm"), floor),
                             what=f"{what}, step {got['step']} grad norm")


def snapshot(path: Path, folder_times: bool = False) -> dict:
    """Every file and folder under path (with hidden ones), each file's size and modification time: equal snapshots,
    nothing touched. folder_times: folders' times too, which change when an entry is created and removed again."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() or folder_times
            else "folder" for p in [path, *path.rglob("*")]}


def mount_tmpfs(path: Path, options: str):
    """A tmpfs at path (root only: permissions do not stop root, a read-only or full filesystem does)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small or read-only tmpfs")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                            text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


# -- Small configs and the scripts' pieces, in this process or in spawned workers

def small_config(vocab=97, layers=4) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, max_position_embeddings=64, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


SCRIPT_MODULES = {"train_pipeline_gpipe.py": gpipe, "train_pipeline_afab_manual.py": manual,
                  "train_pipeline_tracer.py": tracer}


def checked_args(module, argv: list[str], world_size: int, device_type: str = "cuda"):
    """A script's flags as its main resolves them (--stages-per-rank: the schedule's default), then its
    check_args, which leaves them as they are."""
    ns = module.build_parser().parse_args(argv)
    if "stages_per_rank" in ns:
        ns.stages_per_rank = ns.stages_per_rank or (1 if ns.schedule in gpipe.SINGLE_STAGE else 2)
    resolved = vars(ns).copy()
    module.check_args(ns, world_size, device_type, ns.init_from is None)  # no checkpoint to continue here
    assert vars(ns) == resolved
    return ns


def cpu_env(rank: int, world_size: int, dtype=torch.float32) -> "gpipe.Env":
    return gpipe.Env(rank, world_size, torch.device("cpu"), dtype, 0)


def recorder() -> nccl_rules.Recorder:
    """This worker's calls of torch.distributed, recorded while on (nccl_rules.Recorder: a context manager), to be
    replayed under NCCL's rules. Made before the group starts: gloo's flight recorder, which checks the recording
    for gaps, must be on by then."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = "1000000"
    return nccl_rules.Recorder()


def start_group(rank: int, world_size: int, store_path: str, pp: int | None = None, dp: int = 1, tp: int = 1):
    """A worker's gloo process group, and the scripts' (pp, dp, tp) mesh over it."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    return init_device_mesh("cpu", (pp or world_size // (dp * tp), dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def library_pipeline(config, name: str, stages: list, layers: list, mesh, shape: tuple, microbatches: int,
                     documents: bool = False, chunks: int = 8, seed: int = 11, order=None,
                     checkpointing: bool | str = False, seq_chunks: int = 1):
    """The GPipe script's split and schedule of these stages, as its main builds them: (the rank's model, its
    PipelineStages, the schedule, the loss). documents: the same stages (positions are a keyword argument);
    order: a file's (model.read_order), run in place of the schedule by name; checkpointing:
    --activation-checkpointing (True: full, or its SPEC); seq_chunks: --seq-chunks (its order: model.chunk_order)."""
    modules = [gpipe.stage_module(config, s, layers) for s in stages]
    model_module.parallelize(modules, mesh, torch.float32, activation_checkpointing=checkpointing, stages=stages)
    model_module.materialize(modules, config, torch.device("cpu"), seed)
    shards = mesh["tp"].size()  # sequence parallelism, as the scripts' default: each tp rank 1/tp of the positions
    lengths = model_module.chunk_lengths(shape[1], seq_chunks, config, multiple=shards)
    built = [PipelineStage(module, s, len(layers), torch.device("cpu"), group=mesh.get_group("pp"),
                           **gpipe.stage_io(config, s, len(layers), (shape[0], lengths[0]), shards, torch.float32))
             for module, s in zip(modules, stages)]
    order = order or model_module.chunk_order(name, mesh["pp"].size(), microbatches, lengths)
    schedule, loss_fn = gpipe.make_schedule(name, built, microbatches, chunks, shards, order)
    return model_module.merged_stages(modules), built, schedule, loss_fn


_TRACES, _trace = {}, tracer.traced_pipeline


def _traced_once(model, example, split_points, kwargs=None):
    """tracer.traced_pipeline of a meta model, each (config, split, input shapes) traced once a process: a copy of that
    trace for each later variant (a trace is ~2 s of CPU, most of a parity launch's; a copy 0.1 s). The trace of the
    same meta model, points and inputs is the same graph; each variant's stages, built from its own copy, are its own."""
    key = (repr(model.config), model.lm_head is None, model.base_model.mask_in_each_layer, example.shape,
           example.dtype, tuple(split_points.items()), tuple((k, v.shape, v.dtype) for k, v in (kwargs or {}).items()))
    if key not in _TRACES:
        _TRACES[key] = _trace(model, example, split_points, kwargs)
    with warnings.catch_warnings():  # torch.export's own use of a deprecated pytree class, as the tracer's
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        return copy.deepcopy(_TRACES[key])


def traced_pipeline(config, name: str, stages: list, layers: list, mesh, shape: tuple, microbatches: int,
                    documents: bool = False, chunks: int = 8, seed: int = 11, order=None,
                    checkpointing: bool | str = False, seq_chunks: int = 1):
    """The same, as the tracer script builds it (documents: traced with --document-masking's positions); a trace this
    process made before for the same shape, split and inputs, copied (_traced_once)."""
    with unittest.mock.patch.object(tracer, "traced_pipeline", _traced_once):
        modules, pipe = tracer.traced_modules(config, stages, layers, shape, documents, seq_chunks)
    model_module.parallelize(modules, mesh, torch.float32, activation_checkpointing=checkpointing, stages=stages)
    model_module.materialize(modules, config, torch.device("cpu"), seed)
    built = [tracer.pipeline_stage(pipe, s, torch.device("cpu"), mesh.get_group("pp"), torch.float32) for s in stages]
    order = order or model_module.chunk_order(name, mesh["pp"].size(), microbatches,
                                              model_module.chunk_lengths(shape[1], seq_chunks, config))
    schedule, loss_fn = tracer.make_schedule(name, built, microbatches, chunks, 1, order)
    return model_module.merged_stages(modules), built, schedule, loss_fn


def cpu_stage(config, stage: int, layers: list, seed: int = 0):
    """The GPipe script's stage module, allocated on the CPU and initialized as its main does (no parallelism)."""
    module = gpipe.stage_module(config, stage, layers)
    model_module.materialize([module], config, torch.device("cpu"), seed)
    return module


def cpu_traced(config, stages: list, layers: list, shape: tuple, seed: int = 0):
    """The tracer script's stage modules and pipe, allocated on the CPU and initialized as its main does."""
    modules, pipe = tracer.traced_modules(config, stages, layers, shape)
    model_module.materialize(modules, config, torch.device("cpu"), seed)
    return modules, pipe


def plain_loss(logits, targets):
    """The loss of the unsplit model: the mean cross-entropy of the whole logits, computed at once."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


BOS = 1  # the tests' bos: a document starts where it stands


def documents_batch(inputs: torch.Tensor, starts: dict[int, list[int]]) -> torch.Tensor:
    """inputs with a bos at each of starts[row]'s positions and nowhere else: documents packed as the data's are."""
    inputs = inputs.masked_fill(inputs == BOS, BOS + 1)
    for row, columns in starts.items():
        inputs[row, columns] = BOS
    return inputs


def random_batch(config, batch=8, seq=16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    targets[0, :3] = -100  # ignored targets must stay ignored through the pipeline
    return inputs, targets


@pytest.fixture
def one_process_group():
    """build_stage asks the process group for its rank: a group of one, in this process, for in-process tests.
    Each test's own: one left over would meet a later test that checks no process group was started."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# -- Runs and files that several sections use, made once

# The tests' run of the scripts (the lr drift_rtol was measured at): 5 steps at every layout (LAYOUT_RUNS), 16 for
# the reference run and what resumes from it; argparse keeps the last --steps (and --eval-every) given. No held-out
# evaluation unless a test asks for one (the default's, at the end, would cost each run 4 forward batches): what
# evaluates is tested where it is asked for, and in the README's command (the defaults).
TRAIN_ARGS = ["--layers", "4", "--steps", "5", "--batch-size", "8", "--microbatches", "4", "--seq-len", "32",
              "--warmup-steps", "2", "--lr", "1e-2", "--eval-every", "0"]
RESUME_ARGS = [*TRAIN_ARGS, "--steps", "16"]


def recorded(directory: Path, script: str) -> list[str]:
    """A script's command line, run with its calls of torch.distributed recorded into directory (nccl_rules.py)."""
    return ["nccl_rules.py", "record", str(directory), str(ROOT / script)]


def replayed(directory: Path, processes: int, steps: int | None = None) -> None:
    """A whole run's recording (recorded): a file per rank, each with calls, and given steps, the host's
    synchronize at both ends of each training step (model.synchronize); replayed under NCCL's rules."""
    recordings = nccl_rules.load(directory)
    assert [r["rank"] for r in recordings] == list(range(processes)), directory
    for recording in recordings:
        assert any("op" in e for e in recording["events"]), (directory, recording["rank"])
        synced = sum(e.get("sync") == "device" for e in recording["events"])
        assert steps is None or synced == 2 * steps, (directory, recording["rank"], synced)
    nccl_rules.check(recordings)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
    """2 stages x 2 replicas, 16 steps, never interrupted; checkpoints after steps 4, 8, 12 written in the
    background (--async-checkpoint: what resumes from them checks them too), and 16; its calls recorded (calls/).
    Made once for both workers (made_once): the tests only read it, and copy what they resume."""
    def train(directory: Path) -> None:
        result = run_script(4, *recorded(directory / "calls", "train_pipeline_gpipe.py"), *RESUME_ARGS, "--dp", "2",
                            "--checkpoint-every", "4", "--keep-checkpoints", "4", "--async-checkpoint", "--data",
                            data_dir, "--metrics", "m.jsonl", cwd=directory)
        assert result.returncode == 0, errors(result.stderr)
    directory, _ = made_once(tmp_path_factory, "reference", train)
    rows, _ = read_metrics(directory / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    return directory, rows


HF_MODELS = {  # name: the transformers.LlamaConfig fields that differ
    "untied": {"num_hidden_layers": 3},  # grouped-query attention, plain RoPE
    "tied": {"num_hidden_layers": 4, "tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
    "tied_bf16": {"num_hidden_layers": 4, "tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, data_dir):
    """Random LlamaForCausalLMs, written by save_pretrained with the builtin data's tokenizer: what --init-from
    reads."""
    transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    root = tmp_path_factory.mktemp("hf")
    for name, fields in HF_MODELS.items():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=8192, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
            **{key: dict(value) if isinstance(value, dict) else value for key, value in fields.items()}))
        if name.endswith("bf16"):
            model = model.to(torch.bfloat16)
        model.save_pretrained(root / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(data_dir) / file, root / name)
    return root


# ----------------------------------------------------------------------------------------------------------
# Each section's own fixtures: the runs its tests share, made once per test module (those tests form a group:
# below), and folders

# -- model.py: start-up on sharded layouts. Each script's stage built on meta, parallelized there, then its shards
# allocated and initialized a whole tensor at a time (model.materialize). Tied, on one stage: the head is the
# embedding's tensor, sharded alike by tensor parallelism and FSDP2.

STARTUP_CONFIG = LlamaConfig(vocab_size=96, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True)
STARTUP_LAYOUTS = [(1, 2), (2, 1), (2, 2)]  # (dp, tp) of one pipeline stage: FSDP2 over tp gives _StridedShard


def _startup_worker(rank, world_size, store_path, out_dir, dp, tp):
    """Each script's start-up of the one stage at (pp 1, dp, tp), as its main builds it, under the allocator's count
    (benchmark.allocated_bytes; the tracer's trace before it: shapes only, on meta, and 10 s under the profiler).
    Saves, per script: the peak bytes and those left allocated, the rank's shards, the largest whole tensor, the
    whole stage, the longest side of a tensor, whether the tie held, and the weights gathered whole."""
    mesh = start_group(rank, world_size, store_path, 1, dp, tp)
    try:
        config, layers, results = STARTUP_CONFIG, even(STARTUP_CONFIG.num_hidden_layers, 1), {}
        for kind in ("library", "manual", "tracer") if tp == 1 else ("library", "manual"):  # the tracer: no --tp
            traced = tracer.traced_modules(config, [0], layers, (2, 16))[0] if kind == "tracer" else None

            def start():
                if kind == "library":
                    modules = [gpipe.stage_module(config, 0, layers)]
                elif kind == "manual":
                    with torch.device("meta"):
                        modules = [LlamaForPretraining(config)]
                    manual.partition_model(modules[0], 0, 1, mesh.get_group("pp"), layers, trim=True)
                else:
                    modules = traced
                model_module.parallelize(modules, mesh, torch.float32)
                model_module.materialize(modules, config, torch.device("cpu"), 5)
                return modules[0]
            module, peak, left = benchmark.allocated_bytes(start)
            tensors = list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())
            results[kind] = {
                "peak": peak, "left": left,
                "shards": sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors),
                "largest": max(t.numel() * t.element_size() for t in tensors),
                "stage": sum(t.numel() * t.element_size() for t in tensors), "rows": max(max(t.shape) for t in tensors),
                "tied": module.get_submodule("lm_head").weight is
                module.get_submodule("base_model.embed_tokens").weight,
                "initial": {n: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
                            for n, t in [*module.named_parameters(), *module.named_buffers()]}}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def startup_runs(tmp_path_factory):
    """Every script's start-up at each of STARTUP_LAYOUTS: {(dp, tp): each rank's {script kind: results}}."""
    runs = {}
    for dp, tp in STARTUP_LAYOUTS:
        tmp_path = tmp_path_factory.mktemp("startup")
        run_workers(_startup_worker, dp * tp, args=(dp * tp, str(tmp_path / "store"), str(tmp_path), dp, tp))
        runs[dp, tp] = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(dp * tp)]
    return runs


class _StartedUp(Exception):
    """Raised where a script's main makes its optimizer: its stages are built, sharded and allocated."""


def main_start_up(module, argv: list[str]):
    """A script's main, run on this worker's process group (RANK, WORLD_SIZE set) up to its optimizer's creation,
    under the allocator's count: ((the rank's model, the bytes of the data's window orders), the most bytes
    allocated at once from main's start, the bytes left allocated), by benchmark.allocated_bytes."""
    args, built, open_data = module.build_parser().parse_args(argv), [], module.open_data

    def made(model, _):
        built.append(model)
        raise _StartedUp

    def start():
        with unittest.mock.patch.object(module, "init_distributed", lambda *a: None), \
                unittest.mock.patch.object(module, "open_data", lambda a: built.append(open_data(a)) or built[-1]), \
                unittest.mock.patch.object(module, "make_optimizer", made), contextlib.suppress(_StartedUp):
            module.main(args)
        (_, *batches), model = built
        return model, sum(b.order.nbytes for b in batches if isinstance(getattr(b, "order", None), torch.Tensor))
    return benchmark.allocated_bytes(start)


MAIN_STARTUPS = [(script, flags) for script in ("train_pipeline_gpipe.py", "train_pipeline_afab_manual.py")
                 for flags in (["--dp", "2"], ["--tp", "2"])]  # one stage on 2 processes (the tracer: no --tp)


def _main_startup_worker(rank, world_size, store_path, out_dir, data):
    """Each of MAIN_STARTUPS' mains up to its optimizer (main_start_up), 8 layers of the tiny model: per run, the
    peak, the rank's shards, the largest whole tensor, the whole stage, its longest side, the data's orders."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        results = {}
        for i, (script, flags) in enumerate(MAIN_STARTUPS):
            argv = [*flags, "--layers", "8", "--seq-len", "16", "--batch-size", "4", "--microbatches", "2",
                    "--data", data, "--checkpoint-dir", os.path.join(out_dir, f"ckpt{i}")]
            (module, ordered), peak, _ = main_start_up(SCRIPT_MODULES[script], argv)
            tensors = list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())
            results[script, tuple(flags)] = {
                "peak": peak, "data": ordered,
                "shards": sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors),
                "largest": max(t.numel() * t.element_size() for t in tensors),
                "stage": sum(t.numel() * t.element_size() for t in tensors), "rows": max(max(t.shape) for t in tensors)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# -- Data: the test corpus and a tokenizer trained on it

WORDS = ("the pipeline stage sends activations forward and gradients backward while each microbatch waits for its "
         "turn été café 中文 tokens 42 (x) = y;").split()


def corpus(n: int = 250, seed: int = 0) -> list[str]:
    """n documents of 1-3 lines each, no blank lines inside (so a .txt holds them one per paragraph)."""
    rng = random.Random(seed)
    return [f"doc {i}: " + "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 25)))
                                     for _ in range(rng.randint(1, 3))) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A small BPE tokenizer with [PAD]/[BOT]/[EOT], trained on the test corpus (fast, unlike the builtin one)."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    prep.train_tokenizer(corpus(), 400).backend.save(str(path))
    return path


# -- Parity: one step of every split and schedule at each layout, on real gloo ranks

def parity_config(layers: int, tied: bool = False) -> LlamaConfig:
    """The parity tests' model: a vocabulary of 98, which 2 tensor-parallel ranks take in halves; tied: its head the
    embedding's matrix (the "tied" variants: --vocab-parallel's one slice of it serves both)."""
    config = small_config(vocab=98, layers=layers)
    config.tie_word_embeddings = tied
    return config


def split_layers(split: int | tuple, num_stages: int) -> list[range]:
    """A parity variant's layers per stage: an even split of that many layers, or the counts given."""
    return even(split, num_stages) if isinstance(split, int) else model_module.from_sizes(list(split))


def layer_count(split: int | tuple) -> int:
    return split if isinstance(split, int) else sum(split)


def _layout_worker(rank, world_size, store_path, out_dir, variants, batch, pp, dp, tp, microbatches, accumulate=1):
    """One training step, then an evaluation of the same batch, of each (split, schedule, layers, documents) in
    variants at (pp, dp, tp), as the scripts build them, on real gloo ranks: the split by the library (the GPipe
    script's), traced (the tracer script's) or by hand (the AFAB script's); documents: with --document-masking's
    positions, every rank's from its rows of the batch. Saves, per variant, the full gradients, the global loss,
    the evaluated loss, the activations held, the stages' initial tensors and state_dict keys, the dense document
    masks built (from building the stages to the evaluation's end), and the step's and the evaluation's calls of
    torch.distributed (to replay under NCCL's rules). accumulate: the step in that many schedule steps of
    microbatches / accumulate each (--accumulate), with the FSDP units of the rank (each reduce-scatters once)."""
    calls = recorder()
    mesh = start_group(rank, world_size, store_path, pp, dp, tp)
    masks, dense = [], model_module.document_mask  # this process's: each mask a stage (or the tracer) builds
    model_module.document_mask = lambda *args: masks.append(1) or dense(*args)
    try:
        env = cpu_env(rank, world_size)
        pp_rank, dp_rank, tp_rank = (mesh[dim].get_local_rank() for dim in ("pp", "dp", "tp"))
        inputs, targets = batch
        share = len(inputs) // dp  # this replica's rows of the global batch
        x, y = (t[dp_rank * share:(dp_rank + 1) * share] for t in (inputs, targets))
        shape, m, k = (share // microbatches, inputs.shape[1]), microbatches // accumulate, accumulate
        reports = dp_rank == tp_rank == 0  # the others hold the same (gathered) tensors and losses
        results = {}
        for variant in variants:
            kind, name, split, documents = variant
            base, _, cut = name.partition(":")  # "1f1b:2": --seq-chunks 2 ("afab:3:compute": of equal compute)
            positions = model_module.document_positions(x, BOS) if documents else None  # as the scripts do
            masks.clear()
            order = variant_order(base, out_dir, world_size, dp, tp, m)  # "zbh1.csv": a file's (schedule_file)
            stages = [pp_rank] if kind in BY_HAND else order.stages(pp_rank) if order else \
                gpipe.stage_ids(base, pp_rank, pp, 2)
            num_stages = pp * len(stages)
            first, last = 0 in stages, num_stages - 1 in stages
            layers = split_layers(split, num_stages)
            config, vocab = parity_config(layer_count(split), kind == "tied"), kind in ("vocab", "tied")
            if kind in ("library", "tracer"):
                build, script = (library_pipeline, gpipe) if kind == "library" else (traced_pipeline, tracer)
                model, built, schedule, loss_fn = build(config, base, stages, layers, mesh, shape, m, documents,
                                                        order=order, **({"seq_chunks": int(cut)} if cut else {}))
                modules = [stage.submod for stage in built]
            else:
                with torch.device("meta"):
                    model = LlamaForPretraining(config)
                partition = manual.partition_model(model, pp_rank, pp, mesh.get_group("pp"), layers, trim=True,
                                                   vocab=mesh if vocab else None)
                model_module.parallelize([model], mesh, torch.float32)
                model_module.materialize([model], config, env.device, 11)
                partition.sequence_shards = tp  # sequence parallelism with tp > 1, as the scripts' default
                modules = [model]
            initial = {n: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
                       for module in modules for n, t in [*module.named_parameters(), *module.named_buffers()]}
            with calls:  # the step and the evaluation
                meter = benchmark.ActivationMeter()
                with meter, warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    parts = [[t.chunk(k)[i] if t is not None else None for t in (x, y, positions)] for i in range(k)]
                    losses = []  # of each schedule step: their mean is the optimizer step's
                    for i, (xi, yi, pi) in enumerate(parts):
                        if kind in BY_HAND:  # --vocab-parallel: every rank reads the tokens and the targets
                            with manual.compute(env, tp):
                                losses.append(manual.SCHEDULES[name.split(":")[0]](
                                    partition, xi.chunk(m) if first or vocab else [None] * m,
                                    yi.chunk(m) if last or vocab else [None] * m, env.device, torch.float32,
                                    loss_chunks=8,  # as the library's loss above
                                    positions=pi.chunk(m) if documents else None, shape=shape, window=(i, k),
                                    **seq_chunks(name, shape[1], config, tp)))
                        else:
                            losses.append(script.train_step(schedule, xi if first else None, yi if last else None,
                                                            env, tp, window=(i, k), **stream(kind, name, pi, xi)))
                    loss = sum(losses) / k if last else None
                # Copied: a replicated DTensor's full_tensor() is its local tensor, and torch 2.13's eval() below
                # divides the gradients it finds by the microbatches once more.
                grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                         for n, p in model.named_parameters()}
                # The evaluation of the same batch (the weights are unchanged: no optimizer step), forward only: the
                # schedule's eval(), or the script's own forward pass where torch's cannot serve (V-shaped).
                evaluations = []  # a schedule step's microbatches at a time, as the scripts evaluate
                for xi, yi, pi in parts:
                    if kind in BY_HAND:
                        with manual.compute(env, tp):
                            evaluations.append(manual.eval_step_pipeline(
                                partition, xi.chunk(m) if first or vocab else [None] * m,
                                yi.chunk(m) if last or vocab else [None] * m,
                                env.device, torch.float32, loss_chunks=8,
                                positions=pi.chunk(m) if documents else None, shape=shape,
                                **seq_chunks(name, shape[1], config, tp)))
                    else:
                        evaluations.append(script.eval_step(
                            schedule, built, xi if first else None, yi if last else None, env, tp, loss_fn, m,
                            (shape[0], shape[1] // tp, config.hidden_size), **stream(kind, name, pi, xi)))
                evaluated = sum(evaluations) / k if last else None
            if last and dp > 1:
                for value in (loss, evaluated):
                    dist.all_reduce(value, group=mesh.get_group("dp"))
                    value /= dp
            results[variant] = {
                "grads": grads if reports else {}, "initial": initial if reports else {},
                "state_keys": list(model.state_dict()) if reports else [],
                "loss": loss if last and reports else None, "eval": evaluated if last and reports else None,
                "activations": meter.peak_bytes, "masks": len(masks), "calls": calls.recording(), "stages": stages,
                "views": sum("returned a view tensor" in str(w.message) for w in caught),
                "fsdp_units": fsdp_groups(modules),  # and --vocab-parallel's slices, each a replica's rows' shape:
                "slices": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()  # reduce-scattered once
                           if isinstance(p, DTensor) and "pp" in p.device_mesh.mesh_dim_names},
                "dp_group": mesh.get_group("dp").group_name}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def stream(kind: str, name: str, positions, inputs) -> dict:
    """The documents' positions a variant's step takes, if any; a traced chunk (the tracer's "1f1b:2") takes its
    sequence's, of one stream without documents (0, 1, ... each row), as the tracer script gives them."""
    if positions is None and kind == "tracer" and ":" in name:
        positions = torch.arange(inputs.shape[1]).expand(len(inputs), -1)
    return {"positions": positions} if positions is not None else {}


def seq_chunks(name: str, seq_len: int, config, tp: int) -> dict:
    """A hand-written variant's chunks, as its schedule takes them: "1f1b:4" cuts each sequence into 4 even chunks
    (--seq-chunks 4), "afab:3:compute" into 3 of equal compute (--chunk-split compute); "1f1b": whole."""
    _, *cut = name.split(":")
    return {"lengths": model_module.chunk_lengths(seq_len, int(cut[0]), config, *cut[1:], multiple=tp)} if cut else {}


def fsdp_groups(modules: list) -> int:
    """The FSDP2 units among modules that hold parameters of their own (a stage's root over its layers alone holds
    none; --vocab-parallel's slices, DTensors over the pipeline ranks and the replicas, are not FSDP2's): each
    reduce-scatters its gradients once a step."""
    units = [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]
    inner = {u: {p for v in u.modules() if v is not u and isinstance(v, FSDPModule) for p in v.parameters()}
             | {p for p in u.parameters() if isinstance(p, DTensor) and "pp" in p.device_mesh.mesh_dim_names}
             for u in units}
    return sum(bool(set(u.parameters()) - inner[u]) for u in units)


def variant_order(name: str, directory, world_size: int, dp: int, tp: int, microbatches: int):
    """A parity variant's order, read as the scripts read --schedule FILE.csv: for a name such as "zbh1.csv", the
    order schedule_file wrote into directory (parity_run does, before the ranks start); None for a schedule."""
    if not name.endswith(".csv"):
        return None
    path = schedule_path(name.removesuffix(".csv"), world_size // (dp * tp), microbatches, directory)
    return model_module.read_order(str(path), world_size, dp, tp, microbatches, None, False)


def schedule_path(order: str, pp: int, microbatches: int, directory) -> Path:
    return Path(directory) / f"{order}-{pp}x{microbatches}.csv"


def schedule_file(order: str, pp: int, microbatches: int, directory: Path) -> Path:
    """A pipeline order for --schedule FILE.csv, in torch's compute-only CSV form, written into directory: the
    pipeline_order of torch's multi-stage schedule by that name, as it runs it; or, made here, "1f1b" (rank r:
    pp - r forwards, then a backward and a forward in turn) and "zbh1", which torch does not ship: the same with
    each backward split into I, where the B ran, and W, which rank r puts off by pp - 1 - r of its I's (W needs
    nothing from another rank: it fills the waits at 1F1B's end). (torch's own table of Schedule1F1B is no order:
    its last rank runs microbatch 0's backward without its forward.) The one place the tests' orders come
    from; and plan.py's generated ones (zbh2, zb1p, zb2p, zbvauto), as `plan.py --write-schedule` writes them."""
    m, rows, path = microbatches, {}, schedule_path(order, pp, microbatches, directory)
    if order in plan.GENERATED:
        with contextlib.redirect_stdout(None):  # its plan's table
            plan.main(["--processes", str(pp), "--batch-size", str(m), "--microbatches", str(m), "--schedule", order,
                       "--device", "cpu", "--write-schedule", str(path)])
        return path
    if order in ("1f1b", "zbh1"):
        split = order == "zbh1"
        for r in range(pp):
            warmup, late = min(m, pp - r), (pp - 1 - r) * split  # late: how many I's a W waits behind
            back = [f"{r}I{i}" if split else f"{r}B{i}" for i in range(m)]
            rows[r] = [f"{r}F{i}" for i in range(warmup)]
            for i in range(m):
                rows[r] += [back[i], *([f"{r}W{i - late}"] if split and i >= late else []),
                            *([f"{r}F{warmup + i}"] if warmup + i < m else [])]
            rows[r] += [f"{r}W{i}" for i in range(m - late, m)] if split else []
    else:
        stages = pp * 2
        placeholders = [SimpleNamespace(num_stages=stages, group_size=pp, group_rank=0, stage_index=s,
                                        is_first=s == 0, is_last=s == stages - 1, submod=torch.nn.Module())
                        for s in gpipe.stage_ids(order, 0, pp, 2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = gpipe.SCHEDULES[order](placeholders, n_microbatches=m).pipeline_order  # every rank's
        rows = {r: ["" if a is None else str(a) for a in table[r]] for r in range(pp)}
    path.write_text("".join(",".join(rows[r]) + "\n" for r in range(pp)))
    return path


def _recompute_worker(rank, world_size, store_path, out_dir, variants, batch, microbatches):
    """One training step of each (kind: "library" or "tracer", schedule, --activation-checkpointing: full or
    selective) in variants, every decoder layer checkpointed, pp = world_size, on real gloo ranks: each parameter's
    gradient, how many times each of the rank's layers ran its forward (the forward itself and each
    recomputation), and the (stage, microbatch) of each backward the rank's stages ran, by kind: B (whole), I, W."""
    mesh = start_group(rank, world_size, store_path)
    runs, checkpoint_layers, ran = {}, model_module.checkpoint_layers, {"B": [], "I": [], "W": []}
    base = torch.distributed.pipelining.stage._PipelineStageBase
    backward, weight = base.backward_one_chunk, base.backward_weight_one_chunk

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        ran["B" if full_backward else "I"].append((self.stage_index, chunk))
        return backward(self, chunk, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        ran["W"].append((self.stage_index, chunk))
        return weight(self, chunk, last_backward=last_backward)

    def counted(layer, forward):  # what checkpointing runs, at the forward and at each recomputation
        def run(*args, **kwargs):
            runs[layer] = runs.get(layer, 0) + 1
            return forward(*args, **kwargs)
        return run

    def counted_layers(modules, how):  # each layer's own forward (a traced stage's layer: its graph), checkpointed
        for layer in model_module.decoder_layers(modules):
            layer.forward = counted(layer, layer.forward)
        checkpoint_layers(modules, how)
    try:
        results, (inputs, targets) = {}, batch
        shape, config = (len(inputs) // microbatches, inputs.shape[1]), parity_config(4)
        with unittest.mock.patch.object(model_module, "checkpoint_layers", counted_layers), \
                unittest.mock.patch.object(base, "backward_one_chunk", backward_one_chunk), \
                unittest.mock.patch.object(base, "backward_weight_one_chunk", backward_weight_one_chunk):
            for kind, name, how in variants:
                stages = gpipe.stage_ids(name, rank, world_size, 2)
                first, last = 0 in stages, world_size * len(stages) - 1 in stages
                build, script = (library_pipeline, gpipe) if kind == "library" else (traced_pipeline, tracer)
                model, built, schedule, _ = build(config, name, stages, even(4, world_size * len(stages)), mesh,
                                                  shape, microbatches, checkpointing=how)
                runs.clear()
                for kinds in ran.values():
                    kinds.clear()
                script.train_step(schedule, inputs if first else None, targets if last else None,
                                  cpu_env(rank, world_size), 1)
                layers = model_module.decoder_layers([stage.submod for stage in built])
                results[kind, name, how] = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                                            "runs": [runs.get(layer, 0) for layer in layers],
                                            "backwards": {k: sorted(v) for k, v in ran.items()}}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _chunks_tp_worker(rank, world_size, store_path, out_dir, batch, variants):
    """One step of a whole model, tensor parallel over world_size ranks with sequence parallelism, documents kept
    apart, its sequences whole (the reference) and then cut into each variant's chunk lengths, with each
    --activation-checkpointing: each variant's loss, the parameters' whole gradients and the chunks left cached."""
    from torch.distributed.tensor.parallel import loss_parallel
    mesh, (inputs, targets) = start_group(rank, world_size, store_path, pp=1, tp=world_size), batch
    positions, config, results = model_module.document_positions(inputs, BOS), small_config(layers=2), {}
    for how, lengths in [("none", [inputs.shape[1]]), *variants]:
        with torch.device("meta"):
            model = LlamaForPretraining(config)
        model.head_in_loss = True
        model_module.tensor_parallel(model, mesh["tp"])
        model_module.checkpoint_layers([model], how)
        model_module.materialize([model], config, torch.device("cpu"), 5)
        with loss_parallel():
            chunks = model_module.cut_sequences(inputs, targets, positions, lengths)
            losses = [model_module.chunked_loss(model.lm_head, model(c.inputs, c.positions, chunk=c.chunk),
                                                c.targets, 1, world_size, tokens=c.tokens) for c in chunks]
            for loss in reversed(losses):
                (loss / len(losses)).backward()
        results[how, tuple(lengths)] = (sum(loss.detach() for loss in losses) / len(losses),
                                        {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                                        sum(len(m.kv_chunks) for m in model.modules()
                                            if isinstance(m, model_module.LlamaAttention)))
    if rank == 0:
        torch.save(results, Path(out_dir) / "chunks.pt")
    dist.destroy_process_group()


BY_HAND = ("manual", "vocab", "tied")  # the hand-written script's pipeline; "vocab", "tied": with --vocab-parallel
EVERY_SPLIT_AND_SCHEDULE = [*(("library", s) for s in gpipe.SCHEDULES), *(("tracer", s) for s in tracer.SCHEDULES),
                            *(("manual", s) for s in manual.SCHEDULES)]
# Per schedule, a split of 4 layers over 2 pipeline ranks whose end stages hold no decoder layer (the embedding
# alone first; the norm, the head and the loss alone last): in each kind a layerless first stage, a layerless last
# one, and both (the hand-written script's at 3 stages). V-shaped, (0, 2, 2, 0): rank 0 holds the embedding and
# the head and no layer.
LAYERLESS = {"gpipe": (0, 4), "afab": (0, 4), "1f1b": (4, 0), "interleaved1f1b": (0, 2, 2, 0),
             "loopedbfs": (0, 1, 2, 1), "interleavedzerobubble": (1, 2, 1, 0), "zbvzerobubble": (0, 2, 2, 0),
             "dualpipev": (1, 2, 1, 0)}
PARITY_LAYOUTS = {  # (pp, dp, tp) -> the (kind, schedule, layers: even over that many or per stage, --document-masking)
    # 4 layers: 2 stages, or 4 with the multi-stage schedules (looped or V-shaped); with layerless ends below; and
    # with documents kept apart (their boundaries reach every stage of every microbatch, through every schedule's
    # backward): every schedule; traced (each traces the model again) with layerless ends, whose stages take
    # positions that none of their ops uses: the embedding alone first (GPipe), the head alone last (1F1B), a rank
    # holding a stage with layers and one without (looped), both ends and no layer (ZBV's rank 0). (Traced evenly
    # at 3 stages and with replicas.)
    (2, 1, 1): [(kind, name, 4, False) for kind, name in EVERY_SPLIT_AND_SCHEDULE]
               + [(kind, name, 4, True) for kind, name in EVERY_SPLIT_AND_SCHEDULE if kind != "tracer"]
               + [("tracer", name, LAYERLESS[name], True)
                  for name in ("gpipe", "1f1b", "interleavedzerobubble", "zbvzerobubble")],
    # The tracer's split is the hand split's (checked at dp 1): one of each kind with replicas; most with
    # layerless ends (a stage whose FSDP unit is the embedding, or the norm and the head, alone).
    (2, 2, 1): [(kind, name, LAYERLESS[name] if name in ("afab", "1f1b", "loopedbfs", "zbvzerobubble", "dualpipev")
                 else 4, False) for kind, name in EVERY_SPLIT_AND_SCHEDULE
                if kind != "tracer" or name in ("1f1b", "interleaved1f1b", "dualpipev")]
               + [("library", "interleavedzerobubble", 4, True), ("tracer", "dualpipev", 4, True),
                  ("manual", "1f1b", 4, True)],
    # tp 2: each layer's heads, MLP, the embedding and the head split over 2 ranks (2 of 4 heads, 1 of 2 KV heads
    # each; the vocabulary, 98, in halves). One of each kind: single-stage, looped, V-shaped, by hand (the tracer
    # refuses --tp); evenly and with layerless ends.
    # With sequence parallelism (the default): the norms, the residual stream and what crosses stages are each
    # rank's half of the positions (attention, on the gathered sequence, masks by the whole sequence's documents).
    (2, 1, 2): [("library", "gpipe", 4, False), ("library", "1f1b", (4, 0), False),
                ("library", "interleaved1f1b", (0, 2, 2, 0), False), ("library", "zbvzerobubble", 4, False),
                ("manual", "afab", (0, 4), False), ("manual", "1f1b", 4, False),
                ("library", "zbvzerobubble", 4, True), ("manual", "afab", 4, True)],
    (2, 2, 2): [("library", "gpipe", 4, False), ("library", "dualpipev", (0, 2, 2, 0), False),
                ("manual", "1f1b", (0, 4), False), ("library", "1f1b", 4, True)],
    # 3 stages: 4 layers split unevenly (2, 1, 1), and 6; and all 4 on the middle stage, (0, 4, 0).
    (3, 1, 1): [(kind, "gpipe", layers, documents) for layers in (4, 6) for kind in ("library", "tracer")
                for documents in ((False, True) if layers == 4 else (False,))]
               + [(kind, "1f1b", (0, 4, 0), False) for kind in ("library", "tracer", "manual")]
               # Every other schedule at 3 pipeline ranks too, for NCCL's rules (their messages cross otherwise than
               # at 2): 6 layers, one a stage where there are 6; traced, a looped and a V-shaped one.
               + [("library", name, 6, False) for name in gpipe.SCHEDULES if name not in ("gpipe", "1f1b")]
               + [("tracer", "interleavedzerobubble", 6, False), ("tracer", "dualpipev", 6, False),
                  ("manual", "afab", 6, False)],
}
# One process: every schedule of the two library kinds, its stages all on the one rank (a loop's or a V's stage
# hands its output to the next in the same process, in training and in the evaluation).
PARITY_LAYOUTS[1, 1, 1] = [(kind, name, 4, False) for kind, name in EVERY_SPLIT_AND_SCHEDULE if kind != "manual"]
# Layerless ends at dp 1 too, for each schedule of each kind that the launches above do not run so (without documents).
PARITY_LAYOUTS[2, 1, 1] += [(kind, name, LAYERLESS[name], False) for kind, name in EVERY_SPLIT_AND_SCHEDULE
                            if not any(v[:2] == (kind, name) and not isinstance(v[2], int) and not v[3]
                                       for variants in PARITY_LAYOUTS.values() for v in variants)]
# Orders from files (--schedule FILE.csv; schedule_file), run by torch's runtime, in both scripts that take them:
# ZB-H1 (torch ships no such order: I and W, a stage a rank), torch's zero-bubble V (I and W; a V rank 0 holding the
# embedding and the head alone) and looped, its looped 1F1B (idle cells) with documents, DualPipeV (overlapped
# forward and backward in a cell); 3 stages, replicas (FSDP2 unshards, reshards and reduces in the order's steps), tp.
PARITY_LAYOUTS[2, 1, 1] += [("library", "zbh1.csv", 4, False), ("library", "zbvzerobubble.csv", (0, 2, 2, 0), False),
                            ("tracer", "interleavedzerobubble.csv", 4, False),
                            ("library", "interleaved1f1b.csv", 4, True), ("tracer", "dualpipev.csv", 4, False)]
PARITY_LAYOUTS[3, 1, 1] += [("library", "zbh1.csv", 6, False), ("tracer", "zbvzerobubble.csv", 6, False),
                            ("library", "1f1b.csv", 6, False)]
PARITY_LAYOUTS[2, 2, 1] += [("library", "zbvzerobubble.csv", 4, False), ("tracer", "zbh1.csv", 4, False)]
PARITY_LAYOUTS[2, 1, 2] += [("library", "zbh1.csv", 4, False)]  # the library script's: the tracer takes no --tp
# Orders plan.py generates (--write-schedule): the Zero Bubble paper's heuristic at 1p and 2p memory, its
# handcrafted ZB-H2, its cost-aware V; at 2 and 3 stages and with replicas.
PARITY_LAYOUTS[2, 1, 1] += [("library", "zb2p.csv", 4, False), ("tracer", "zbvauto.csv", (0, 2, 2, 0), False)]
PARITY_LAYOUTS[3, 1, 1] += [("library", "zb1p.csv", 6, False), ("library", "zbvauto.csv", 6, False)]
PARITY_LAYOUTS[2, 2, 1] += [("library", "zbh2.csv", 4, False)]
# Sequence chunks by hand (--seq-chunks S; seq_chunks): each microbatch's sequences in S chunks that run as
# microbatches, AFAB and Seq1F1B, on documents that span chunks; of equal compute (--chunk-split compute: 16 tokens
# in 6, 5, 5, or 6, 4, 6 at tp 2): messages of varying shape, each rank knowing every chunk's from the lengths; at 3
# stages, with replicas (FSDP2 reduce-scatters after the last backward in order: the last sequence's chunk 0), tp 2.
PARITY_LAYOUTS[2, 1, 1] += [("manual", f"{name}:{s}", 4, True) for name in manual.SCHEDULES for s in (2, 4)]
PARITY_LAYOUTS[2, 1, 1] += [("manual", "1f1b:3:compute", 4, True)]
PARITY_LAYOUTS[3, 1, 1] += [("manual", "1f1b:4", 6, True), ("manual", "afab:3:compute", (0, 4, 0), False)]
PARITY_LAYOUTS[2, 2, 1] += [("manual", "1f1b:2", (0, 4), True)]
PARITY_LAYOUTS[2, 1, 2] += [("manual", "1f1b:3:compute", 4, True)]
# --vocab-parallel by hand ("vocab"): the embedding, the head and the loss over every pipeline rank by vocabulary
# rows (98: 49 each at 2 ranks; 33, 33, 32 at 3), AFAB and 1F1B, with documents, layerless ends, sequence chunks
# (their output passes in forward order), with replicas (the slices outside FSDP2, sharded over the replicas too:
# 25 and 24 of a rank's 49 rows at 2 x 2).
PARITY_LAYOUTS[2, 1, 1] += [("vocab", "afab", 4, False), ("vocab", "1f1b", (4, 0), True), ("vocab", "afab:2", 4, True),
                            ("vocab", "1f1b:2", (0, 4), False)]
PARITY_LAYOUTS[3, 1, 1] += [("vocab", "afab", (0, 4, 0), False), ("vocab", "1f1b", 6, False),
                            ("vocab", "1f1b:2", 4, True)]
PARITY_LAYOUTS[2, 2, 1] += [("vocab", "1f1b", 4, True), ("vocab", "afab:2", (0, 4), False)]
# Tied ("tied"): one slice of the matrix on each rank serves the embedding and the head, its gradients added there.
PARITY_LAYOUTS[2, 1, 1] += [("tied", "1f1b:2", 4, True)]
PARITY_LAYOUTS[3, 1, 1] += [("tied", "afab", 6, False)]
PARITY_LAYOUTS[2, 2, 1] += [("tied", "1f1b", (0, 4), False)]
PARITY_LAYOUTS[4, 1, 1] = [("vocab", "1f1b", 4, True), ("vocab", "afab", (0, 2, 2, 0), False)]  # 25, 25, 25, 23 rows
# Sequences cut into chunks (--seq-chunks S; "1f1b:2": S 2), run by torch's runtime in an order made for them
# (model.chunk_order): GPipe's and Seq1F1B's at S 2 and 4, with documents across the chunks (16 tokens: at S 4 the
# documents at 5 and 11 span chunk boundaries); under FSDP2 and tensor (sequence) parallelism too; at 3 stages.
PARITY_LAYOUTS[2, 1, 1] += [("library", f"{name}:{chunks}", 4, True) for name in ("gpipe", "1f1b") for chunks in (2, 4)]
PARITY_LAYOUTS[2, 2, 1] += [("library", "1f1b:2", (0, 4), True)]
PARITY_LAYOUTS[2, 1, 2] += [("library", "gpipe:4", 4, True)]
PARITY_LAYOUTS[3, 1, 1] += [("library", "1f1b:4", 6, False)]  # a middle stage: no tokens, targets or positions
# The same through traced stages (the tracer: model.traced_chunk_kv), each chunk's keys and values padded to the
# sequence's: both orders at S 2 and 4, with documents and as one stream, at 3 stages, with replicas.
PARITY_LAYOUTS[2, 1, 1] += [("tracer", "gpipe:2", 4, True), ("tracer", "1f1b:4", (4, 0), True),
                            ("tracer", "1f1b:2", 4, False)]
PARITY_LAYOUTS[2, 2, 1] += [("tracer", "1f1b:2", (0, 4), True), ("tracer", "gpipe:4", 4, False)]
PARITY_LAYOUTS[3, 1, 1] += [("tracer", "1f1b:4", 6, True)]


# --accumulate 2: each optimizer step's 8 microbatches a replica (a row each) in 2 schedule steps of 4 (DualPipeV's
# V takes at least its 4 stages' worth): every schedule, split by the library and by hand (the traced stages run
# the same train_step: a few of them); replicas (FSDP2 reduce-scatters once an optimizer step, not once a schedule
# step), tensor parallelism, documents kept apart, an order from a file.
ACCUMULATED_LAYOUTS = {
    (2, 1, 1): [(kind, name, 4, False) for kind, name in EVERY_SPLIT_AND_SCHEDULE if kind != "tracer"]
               + [("tracer", "gpipe", 4, False), ("library", "1f1b", 4, True), ("manual", "afab", 4, True),
                  ("tracer", "zbvzerobubble", 4, True)],
    (2, 2, 1): [("library", "gpipe", 4, False), ("library", "zbvzerobubble", (0, 2, 2, 0), False),
                ("library", "interleavedzerobubble", 4, True), ("tracer", "dualpipev", 4, False),
                ("manual", "afab", (0, 4), True), ("library", "zbh1.csv", 4, False),
                ("manual", "1f1b:2", 4, True),  # Seq1F1B by hand: reduce-scattered after the last chunk 0
                ("library", "1f1b:4", 4, True)],  # --seq-chunks 4: 16 chunks a replica, 8 a schedule step
    (2, 1, 2): [("library", "1f1b", 4, False), ("library", "dualpipev", 4, True), ("manual", "afab", 4, False)],
}
# --vocab-parallel: the embeddings' gradients each schedule step, the slices' reduce-scattered over the replicas
# (averaged) once an optimizer step (after its last schedule step's)
ACCUMULATED_LAYOUTS[2, 1, 1] += [("vocab", "afab", 4, True)]
ACCUMULATED_LAYOUTS[2, 2, 1] += [("vocab", "1f1b:2", (0, 4), False)]
ACCUMULATE, ACCUMULATED_MICROBATCHES = 2, 8  # schedule steps an optimizer step; microbatches a replica, in all


@pytest.fixture(scope="module", params=list(ACCUMULATED_LAYOUTS), ids=lambda layout: "-".join(map(str, layout)))
def accumulated_run(request, tmp_path_factory):
    """One optimizer step of every variant of a layout in ACCUMULATED_LAYOUTS, in ACCUMULATE schedule steps, as
    parity_run runs one: ((pp, dp, tp), variants, the batch, each rank's saved results)."""
    (pp, dp, tp), tmp_path = request.param, tmp_path_factory.mktemp("accumulated")
    variants, world_size = ACCUMULATED_LAYOUTS[pp, dp, tp], pp * dp * tp
    inputs, targets = random_batch(parity_config(4), batch=ACCUMULATED_MICROBATCHES * dp)
    inputs = documents_batch(inputs, {2: [5, 11], 3: [0, 9]})  # (as parity_run's)
    for order in {name.removesuffix(".csv") for _, name, _, _ in variants if name.endswith(".csv")}:
        schedule_file(order, pp, ACCUMULATED_MICROBATCHES // ACCUMULATE, tmp_path)
    run_workers(_layout_worker, world_size, args=(world_size, str(tmp_path / "store"), str(tmp_path), variants,
                                                  (inputs, targets), pp, dp, tp, ACCUMULATED_MICROBATCHES,
                                                  ACCUMULATE))
    return (pp, dp, tp), variants, (inputs, targets), [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                                                       for r in range(world_size)]


def parity_step(layout: tuple) -> tuple[int, int]:
    """(microbatches per replica, rows of the batch) of a layout's launch: 4 of 8, and at 3 pipeline ranks 6 of 12
    (DualPipeV takes as many microbatches as stages, 6 in its V)."""
    return (6, 12) if layout == (3, 1, 1) else (4, 8)


@pytest.fixture(scope="module", params=list(PARITY_LAYOUTS), ids=lambda layout: "-".join(map(str, layout)))
def parity_run(request, tmp_path_factory):
    """One step of every variant of a layout in PARITY_LAYOUTS, in one launch, parity_step's microbatches per
    replica: ((pp, dp, tp), variants, the batch, each rank's saved results)."""
    (pp, dp, tp), tmp_path = request.param, tmp_path_factory.mktemp("parity")
    variants, world_size = PARITY_LAYOUTS[pp, dp, tp], pp * dp * tp
    microbatches, rows = parity_step((pp, dp, tp))
    inputs, targets = random_batch(parity_config(4), batch=rows)
    # Documents start in rows 2 and 3 alone (microbatch 1 of 4 at dp 1, microbatches 2 and 3 of the first replica
    # at dp 2): a pipeline that gave every microbatch the first one's boundaries, or none to a later stage,
    # computes those rows causally (torchtitan #1723, KempnerForge #204); the other rows are one document each.
    inputs = documents_batch(inputs, {2: [5, 11], 3: [0, 9]})
    for order in {name.removesuffix(".csv") for _, name, _, _ in variants if name.endswith(".csv")}:
        schedule_file(order, pp, microbatches, tmp_path)  # read by each rank: variant_order
    run_workers(_layout_worker, world_size, args=(world_size, str(tmp_path / "store"), str(tmp_path), variants,
                                                  (inputs, targets), pp, dp, tp, microbatches))
    return (pp, dp, tp), variants, (inputs, targets), [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
                                                       for r in range(world_size)]


# -- The scripts themselves at every layout, and on documents kept apart

LAYOUT_RUNS = {
    # name: (processes (0: plain python), script, extra flags); the stages are balanced by cost unless --split
    "gpipe1": (0, "train_pipeline_gpipe.py", []),
    "compiled1": (0, "train_pipeline_gpipe.py", ["--compile"]),
    "gpipe2": (2, "train_pipeline_gpipe.py", ["--trace", "gpipe_trace"]),
    "checkpointed2": (2, "train_pipeline_gpipe.py", ["--activation-checkpointing"]),
    "afab3": (3, "train_pipeline_afab_manual.py", ["--trace", "afab_trace", "--split", "2,1,1"]),
    # 2 stages x 2 data-parallel replicas (FSDP2): each replica trains on half of every batch.
    # Its checkpoints written in the background, one a step: each waits for the one before, training goes on.
    "gpipe2x2": (4, "train_pipeline_gpipe.py", ["--dp", "2", "--async-checkpoint", "--checkpoint-every", "1"]),
    # Selective checkpointing on traced stages, 2 a rank, under FSDP2; per stage by hand (the first selective, the
    # second's layer whole).
    "tracer2x2": (4, "train_pipeline_tracer.py", ["--dp", "2", "--schedule", "interleaved1f1b",
                                                  "--activation-checkpointing", "selective", "--loss-chunks", "4"]),
    "perstage2": (2, "train_pipeline_afab_manual.py", ["--schedule", "1f1b", "--split", "3,1",
                                                       "--activation-checkpointing", "selective,1"]),
    "1f1b2x2": (4, "train_pipeline_afab_manual.py", ["--dp", "2", "--schedule", "1f1b", "--split", "even",
                                                     "--activation-checkpointing"]),
    # x 2 tensor-parallel ranks: each holds half of every layer's heads and MLP, of the embedding and the head
    # (the library's 2 stages x tp 2 alone: test_tensor_parallel_resumes_exactly..., 16 steps).
    # With sequence parallelism (the default with --tp) and without it: each tp rank holds and sends half of the
    # positions, or all of them.
    "afab2xtp2": (4, "train_pipeline_afab_manual.py", ["--tp", "2", "--loss-chunks", "1"]),
    "afab2xtp2nosp": (4, "train_pipeline_afab_manual.py", ["--tp", "2", "--loss-chunks", "1",
                                                           "--no-sequence-parallel"]),
    "gpipe2x2xtp2": (8, "train_pipeline_gpipe.py", ["--dp", "2", "--tp", "2", "--loss-chunks", "8"]),
    "1f1b2x2xtp2": (8, "train_pipeline_afab_manual.py", ["--dp", "2", "--tp", "2", "--schedule", "1f1b",
                                                         "--activation-checkpointing"]),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, data_dir):
    """5 steps of every layout in LAYOUT_RUNS, at once, each under benchmark.py measure-memory (the bytes each rank
    holds: activations at their peak, parameters, gradients, AdamW state), those of several processes with their
    calls recorded (NAME/calls: recorded): {name: (rows, summary, stdout, memory, stderr)}, and the folder they
    ran in."""
    tmp_path, procs, runs = tmp_path_factory.mktemp("layouts"), {}, {}
    for name, (nproc, script, extra) in LAYOUT_RUNS.items():
        args = [*TRAIN_ARGS, *extra, "--data", data_dir, "--metrics", str(tmp_path / name / "m.jsonl"),
                "--checkpoint-dir", str(tmp_path / name / "ckpt")]
        tool = recorded(tmp_path / name / "calls", "benchmark.py") if nproc else ["benchmark.py"]
        procs[name] = run_script(nproc, *tool, "measure-memory", str(tmp_path / f"{name}.json"),
                                 str(ROOT / script), *args, cwd=tmp_path, wait=False)
    for name, proc in procs.items():
        result = finish(proc, timeout=900)  # a hang's limit; all these runs share the CPUs at once
        assert result.returncode == 0, (name, errors(result.stderr))
        rows, (summary,) = read_metrics(tmp_path / name / "m.jsonl")
        runs[name] = rows, summary, result.stdout, json.loads((tmp_path / f"{name}.json").read_text()), result.stderr
    return runs, tmp_path


DOCUMENTS = ["--document-masking"]
DOCUMENT_RUNS = {  # name: (processes (0: plain python), script, flags), on short documents (document_runs)
    "one": (0, "train_pipeline_gpipe.py", DOCUMENTS),
    "causal": (0, "train_pipeline_gpipe.py", []),  # the same without the flag
    "pp2 x dp2, interleaved zero bubble": (4, "train_pipeline_gpipe.py", [*DOCUMENTS, "--dp", "2", "--schedule",
                                                                          "interleavedzerobubble"]),
    # The evaluation of a V: the script's own forward pass. Rank 0 holds the embedding and the head and no layer:
    # its stages take positions that none of their ops uses.
    "traced V, checkpointed": (2, "train_pipeline_tracer.py", [*DOCUMENTS, "--schedule", "zbvzerobubble",
                                                               "--split", "0,2,2,0", "--activation-checkpointing"]),
    "by hand 1f1b, pp2 x tp2 without sequence parallelism": (4, "train_pipeline_afab_manual.py", [
        *DOCUMENTS, "--schedule", "1f1b", "--tp", "2", "--no-sequence-parallel"]),
    # Seq1F1B by hand: each sequence in 3 chunks of equal compute (11, 10, 11 tokens), with replicas, checkpointed
    # layers (a recomputed chunk keeps its keys and values once) and 2 schedule steps an optimizer step.
    "by hand Seq1F1B, 3 chunks of equal compute, pp2 x dp2, checkpointed, accumulated": (
        4, "train_pipeline_afab_manual.py", [*DOCUMENTS, "--schedule", "1f1b", "--seq-chunks", "3", "--chunk-split",
                                             "compute", "--dp", "2", "--microbatches", "2", "--accumulate", "2",
                                             "--activation-checkpointing"]),
}


@pytest.fixture(scope="module")
def document_runs(tmp_path_factory):
    """5 steps and an evaluation of every run in DOCUMENT_RUNS, at once, on documents of about 35 tokens (a window
    of 33 holds one or two boundaries), those of several processes with their calls recorded (in NAME.calls):
    {name: (rows, evaluations)}, and the folder they ran in."""
    tmp_path, procs, runs = tmp_path_factory.mktemp("documents"), {}, {}
    data = prepare_small(tmp_path / "data")
    for name, (nproc, script, extra) in DOCUMENT_RUNS.items():
        tool = recorded(tmp_path / f"{name}.calls", script) if nproc else [script]
        procs[name] = run_script(nproc, *tool, *TRAIN_ARGS, *extra, "--eval-every", "5",
                                 "--eval-batches", "1", "--data", data, "--metrics", f"{name}.jsonl",
                                 "--checkpoint-dir", name, cwd=tmp_path, wait=False)
    for name, proc in procs.items():
        result = finish(proc, timeout=900)  # a hang's limit; all these runs share the CPUs at once
        assert result.returncode == 0, (name, errors(result.stderr))
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        runs[name] = [r for r in lines if "loss" in r], [r["eval"] for r in lines if "eval" in r]
    return runs, tmp_path


def prepare_small(out: Path, documents: int = 600, tokenizer=None, seed: int = 0, vocab_size: int = 300) -> Path:
    """A small dataset prepared from generated documents (a trained 300-token vocabulary, or the tokenizer given)."""
    rng = random.Random(seed)
    source = out.parent / f"{out.name}.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}: " + " ".join(
        f"word{rng.randrange(50)}" for _ in range(5 + i % 17))}) + "\n" for i in range(documents)))
    vocab = ["--tokenizer", str(tokenizer)] if tokenizer else ["--vocab-size", str(vocab_size)]
    result = launch(0, "prepare_data.py", "--data", source, "--out", out, "--force", *vocab, cwd=out.parent,
                    timeout=120)
    assert result.returncode == 0, result.stderr
    return out


# -- Folders for the tools' and the bad-input tests

@pytest.fixture
def fake_data(tmp_path) -> str:
    """--data that passes benchmark.py's check (a meta.json); nothing here runs a script."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    return str(tmp_path / "data")


@pytest.fixture
def read_only_dir(tmp_path):
    path = tmp_path / "read-only"
    if os.geteuid() != 0:  # an ordinary user is stopped by permissions
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mount_tmpfs(path, "ro,size=1m")
    yield path
    subprocess.run(["umount", str(path)])


# -- Two workers, `pytest -n 2 --dist loadgroup` (pytest-xdist: requirements-dev.txt): the tests that share a
# module fixture (the parity launches, the layout runs, ...) are one group, run by one worker that computes it once.
# Not reference_run's 21 tests, a third of the suite's time: the first worker that needs that 16-step run (25 s)
# makes it for both (made_once), as the data.
SHARED_FIXTURES = ("parity_run", "layout_runs", "document_runs", "hf_models", "tokenizer_file", "startup_runs")


def pytest_configure(config):
    """xdist_group known without xdist too (`pytest -p no:xdist`, or xdist not installed): no warning."""
    config.addinivalue_line("markers", "xdist_group(name): tests that one xdist worker runs (--dist loadgroup)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which adds the group to the test's id (after it: none)
def pytest_collection_modifyitems(items):
    """A test that takes one of SHARED_FIXTURES (the first of them, in that order) is marked xdist_group(its name)."""
    for item in items:
        shared = [name for name in SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
