"""Processes, devices and errors: what torchrun set, the one place that picks device/backend/dtype, process-group
setup and teardown, the mesh of pipeline stages x data-parallel replicas, and how a mistake or a lost peer ends
every rank with one line."""

import contextlib
import dataclasses
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 1, no traceback (status 2
    is argparse's, for a command line that does not parse).

    on_every_rank: every rank raises this same error, so one line per node is enough (see collective_errors)."""

    def __init__(self, message: str, on_every_rank: bool = False):
        super().__init__(message)
        self.on_every_rank = on_every_rank


class FlagError(UsageError):
    """A mistake seen in the flags alone. Every rank got the same command line, so every rank raises it."""

    def __init__(self, message: str):
        super().__init__(message, on_every_rank=True)


@contextlib.contextmanager
def collective_errors(group=None):
    """Run a block on every rank; if it raises a UsageError on any rank, raise that error on every rank.

    A problem that one rank finds (a file its node cannot read, a tokenizer only the rank that builds the
    caches opens, a checkpoint directory that one node cannot write) would otherwise end that rank alone: the
    others would wait for it until --timeout and report a lost peer, and torchrun would name a rank that did
    nothing wrong. The block itself must not start a collective that a failing rank would skip. Costs one
    all-reduce of one number when nothing failed.
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


# ----------------------------------------------------------------------------------------------------------
# Processes, devices, dtypes

@dataclasses.dataclass
class Env:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    dtype: torch.dtype  # compute dtype: bf16 autocast on GPU, plain fp32 on CPU
    restart: int = 0  # how often torchrun --max-restarts has restarted this job
    mesh: "Mesh | None" = None  # this process's place among the others; set by init_process_group


def launch_env(device_flag: str) -> Env:
    """Read what torchrun set (or a single process when run with plain python) and choose device, backend, dtype.

    This is the only place that looks at the environment or at CUDA.
    """
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    use_cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no GPU is visible; use --device cpu")
        if local_world > torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU, so say so now instead of failing at the first send.
            raise UsageError(f"--device cuda: {local_world} processes on this node but {torch.cuda.device_count()} "
                             "GPUs; start one process per GPU (--nproc_per_node) or use --device cpu")
        return Env(rank, world_size, local_rank, local_world, torch.device("cuda", local_rank), "nccl",
                   torch.bfloat16, restart)
    return Env(rank, world_size, local_rank, local_world, torch.device("cpu"), "gloo", torch.float32, restart)


def init_process_group(env: Env, timeout_s: float, dp: int = 1) -> None:
    """Join the other processes, then arrange them in a mesh of pipeline stages x dp replicas (env.mesh)."""
    # The timeout bounds every collective and send/recv: a peer that died or hangs stops the job with an
    # error after timeout_s instead of leaving the other ranks waiting forever.
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if "MASTER_ADDR" in os.environ:  # started by torchrun (or a user-set rendezvous)
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        # After torchrun --max-restarts restarts the job, the new processes meet in the same store as the dead
        # ones, whose addresses are still in it: gloo would connect to those and fail. A key prefix per restart
        # keeps each attempt to itself.
        store = dist.PrefixStore(f"attempt{env.restart}", store)
        kwargs = {"device_id": env.device} if env.device.type == "cuda" else {}
        dist.init_process_group(env.backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **kwargs)
    else:  # plain `python script.py`: a group of one, no network rendezvous needed
        dist.init_process_group(env.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    env.mesh = Mesh.build(env, {"pp": env.world_size // dp, "dp": dp})


# ----------------------------------------------------------------------------------------------------------
# The mesh: pipeline stages x data-parallel replicas

@dataclasses.dataclass
class Mesh:
    """The processes as a grid, "pp" (pipeline stages) outermost, then "dp" (data-parallel replicas).

    Ranks fill the grid row by row: rank = pp_rank * dp + dp_rank. So the dp replicas of one stage are
    neighbouring ranks, on the same node when dp divides the GPUs per node: FSDP's all-gathers and
    reduce-scatters, which move a stage's whole parameters and gradients every step, stay on the node's fast
    links, and only the pipeline's activations (one microbatch's hidden states at a time) cross nodes. A tensor
    parallel dim would go innermost, ("pp", "dp", "tp"), as its collectives run inside every layer: add it to
    the sizes given to build() and take its group with group("tp").
    """
    device_mesh: DeviceMesh

    @classmethod
    def build(cls, env: Env, sizes: dict[str, int]) -> "Mesh":
        # On the device type in use, so FSDP never picks one itself (gloo with CUDA tensors crashes).
        return cls(init_device_mesh(env.device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes)))

    def size(self, dim: str) -> int:
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(dim))

    def rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str):
        return self.device_mesh.get_group(dim)

    def global_rank(self, dim: str, rank: int) -> int:
        """The global rank of the process at `rank` along dim, with this process's place along the others."""
        return dist.get_global_rank(self.group(dim), rank)

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def pp_rank(self) -> int:
        return self.rank("pp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")


def autocast(env: Env):
    """bf16 autocast on GPU (weights and optimizer stay fp32), nothing on CPU where everything is fp32."""
    if env.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=env.dtype)


def run(main, args) -> None:
    """Call main(args); turn a UsageError into one line on stderr and exit status 1; always tear down."""
    try:
        main(args)
    except UsageError as e:
        # An error every rank raised is printed once per node (by its first process), any other by its rank.
        if not e.on_every_rank or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistError, RuntimeError) as e:
        if not _lost_peer(e):
            raise  # a bug, not a dead peer: keep the traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        # This rank cannot tell why: a peer that died (a node lost, killed) or one that stopped on an error of
        # its own. Say both, so that a bug another rank printed is not answered by rerunning into it again.
        print(f"error: lost contact with another rank ({first}); if another rank printed an error above, that "
              "is the cause; otherwise rerun the same command, or launch with torchrun --max-restarts N, to resume "
              "from the newest checkpoint", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _lost_peer(e: Exception) -> bool:
    # gloo reports a timeout or a dead peer as a plain RuntimeError from its transport; NCCL as a DistError.
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        marker in text for marker in ("gloo/transport", "Timed out", "Connection closed by peer",
                                      "Connection reset by peer"))
