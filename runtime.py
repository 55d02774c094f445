"""What every training script in this collection does the same way, so the scripts can keep to their pipeline.

Flags, argument checks, the one place that picks device/backend/dtype, process-group setup and teardown, the
LR schedule, gradient clipping across stages, metrics and the end-of-run summary.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from model import PRESETS


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2, no traceback."""


# ----------------------------------------------------------------------------------------------------------
# Flags: the same in every script

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage block; --help has the rest
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser(doc: str, schedules: list[str], stages_per_rank: bool = False) -> argparse.ArgumentParser:
    p = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="model preset (default: tiny on CPU, small on GPU)")
    g.add_argument("--layers", type=int, default=None, help="override the preset's number of decoder layers")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps to train for (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: %(default)s)")
    g.add_argument("--microbatches", type=int, default=4,
                   help="microbatches each step's batch is split into (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=30,
                   help="linear warmup steps, then cosine decay to 10%% of --lr (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this; 0 turns clipping off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default: %(default)s)")
    g.add_argument("--schedule", choices=schedules, default=schedules[0],
                   help="pipeline schedule (default: %(default)s)")
    if stages_per_rank:  # only where the library's multi-stage schedules are offered
        g.add_argument("--stages-per-rank", type=int, default=2,
                       help="stages each rank holds with the interleaved, looped and V-shaped schedules "
                            "(default: %(default)s; gpipe and 1f1b hold one)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="builtin",
                   help="builtin | PATH[,PATH...] (.txt/.jsonl/.parquet) | hf:NAME[:CONFIG[:SPLIT]] "
                        "(default: %(default)s, the Python standard library's source)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizers JSON file with [BOT] and [EOT] (default: train one on --data and cache it)")
    g.add_argument("--vocab-size", type=int, default=8192,
                   help="vocabulary of a tokenizer trained on --data (default: %(default)s)")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pipeline-llama"),
                   help="where trained tokenizers and tokenized data are kept (default: %(default)s)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", default="checkpoints",
                   help="where checkpoints are written and resumed from (default: %(default)s)")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="save after every N steps; 0: only at the end (default: %(default)s)")
    g.add_argument("--keep-checkpoints", type=int, default=3,
                   help="keep the newest K complete checkpoints, delete older ones (default: %(default)s)")
    g.add_argument("--fresh", action="store_true",
                   help="start at step 0 even if --checkpoint-dir holds checkpoints (they are moved aside to "
                        "DIR.previous-TIME, not deleted)")
    g.add_argument("--metrics", default=None, help="write one JSON line per step (and a summary) to this file")
    g.add_argument("--trace", default=None,
                   help="write a Chrome trace (JSON) of the last 10 steps: every forward, backward and "
                        "send/recv per rank (open it in ui.perfetto.dev); also prints the measured bubble")
    g.add_argument("--measure-activations", action="store_true",
                   help="count the bytes of activations held for backward (saved-tensor hooks) and report "
                        "each stage's peak in the summary")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL and bf16 when a GPU is present, else CPU, gloo, fp32")
    g.add_argument("--timeout", type=float, default=600,
                   help="seconds a rank waits for its peers in any communication before the job stops with an "
                        "error instead of hanging (default: %(default)s)")
    return p


def model_preset(args, device_type: str) -> str:
    return args.model or ("small" if device_type == "cuda" else "tiny")


def check_args(args, world_size: int, device_type: str) -> None:
    """Every mistake that can be seen from the flags alone, checked identically on every rank before any work."""
    import data  # late: data imports UsageError from here

    positive = {"--steps": args.steps, "--batch-size": args.batch_size, "--microbatches": args.microbatches,
                "--seq-len": args.seq_len, "--vocab-size": args.vocab_size}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    for flag, value in {"--warmup-steps": args.warmup_steps, "--checkpoint-every": args.checkpoint_every}.items():
        if value < 0:
            raise UsageError(f"{flag} must be 0 or more, got {value}")
    for flag, value in {"--lr": args.lr, "--weight-decay": args.weight_decay, "--grad-clip": args.grad_clip}.items():
        if not math.isfinite(value) or value < 0 or (flag == "--lr" and value == 0):
            raise UsageError(f"{flag} must be a finite {'positive' if flag == '--lr' else 'non-negative'} "
                             f"number, got {value}")
    if args.batch_size % args.microbatches:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}; "
                         "make the batch a multiple of the microbatch count")
    preset = PRESETS[model_preset(args, device_type)]
    num_layers = args.layers if args.layers is not None else preset.get("num_hidden_layers", 12)
    if num_layers < 1:
        raise UsageError(f"--layers must be at least 1, got {num_layers}")
    if world_size > num_layers:
        raise UsageError(f"{world_size} processes but the model has {num_layers} layers: each stage needs a layer; "
                         f"run at most {num_layers} processes or raise --layers")
    max_positions = preset.get("max_position_embeddings", 2048)
    if args.seq_len > max_positions:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {max_positions} positions; "
                         f"use --seq-len {max_positions} or less")
    data.check_data_spec(args.data)
    if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
        raise UsageError(f"--tokenizer: no such file {args.tokenizer!r}; give a tokenizers JSON file or leave the "
                         "flag out to train one on --data")


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


def init_process_group(env: Env, timeout_s: float) -> None:
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


def autocast(env: Env):
    """bf16 autocast on GPU (weights and optimizer stay fp32), nothing on CPU where everything is fp32."""
    if env.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=env.dtype)


def run(main, args) -> None:
    """Call main(args); turn a UsageError into one line on stderr and exit status 2; always tear down."""
    try:
        main(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except (dist.DistError, RuntimeError) as e:
        if not _lost_peer(e):
            raise  # a bug, not a dead peer: keep the traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(f"error: lost contact with another rank ({first}); rerun the same command, or launch with "
              "torchrun --max-restarts N, to resume from the newest checkpoint", file=sys.stderr)
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


def describe_run(preset: str, config, env: Env, how: str, num_stages: int | None = None) -> str:
    """One line: the model, how it is split over the stages, and where it runs."""
    num_stages = num_stages or env.world_size
    stages = []
    for stage, layers in enumerate(layer_split(config.num_hidden_layers, num_stages)):
        text = f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"
        text = ("embed + " if stage == 0 else "") + text + (" + norm + head" if stage == num_stages - 1 else "")
        stages.append(f"[{text}]")
    return (f"model {preset}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size} | {num_stages} stage(s) on {env.world_size} process(es): {' '.join(stages)} | "
            f"{how} | {env.device.type} {str(env.dtype).removeprefix('torch.')} {env.backend}")


def layer_split(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one (earlier stages get the extra)."""
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


# ----------------------------------------------------------------------------------------------------------
# Optimizer, LR schedule, clipping

def make_optimizer(module: torch.nn.Module, args) -> torch.optim.Optimizer:
    # Decay matrices only; norm gains stay undecayed. Grouping is per parameter, so it is the same on any split.
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of --lr for 1-based optimizer step `step`: linear warmup, then cosine down to min_ratio."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer, step: int, args) -> float:
    """Set and return the LR of 1-based step `step`. A pure function of the step: resuming needs no LR state."""
    lr = args.lr * lr_factor(step, args.warmup_steps, args.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip by the norm of the *whole model's* gradient and return that norm.

    Each stage holds only part of the gradient; clipping each part by its own norm would change the update.
    The squared local norms are summed across stages first, as one process holding the full model would.
    """
    params = [p for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    squared = local.float() ** 2
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ----------------------------------------------------------------------------------------------------------
# Metrics and summary

class Metrics:
    """JSON lines: one row per optimizer step, then one summary row. Only the rank holding the loss writes."""

    def __init__(self, path: str | None, enabled: bool, resume_step: int | None = None, tokens_seen: int = 0):
        """resume_step: continuing a run from that step; rows after it (steps done after the checkpoint by a
        run that was then killed) are dropped, so the file reads as one uninterrupted run. tokens_seen: tokens
        trained on before this run."""
        self.file = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept = []
            if resume_step is not None and os.path.isfile(path):
                with open(path) as f:
                    kept = [line for line in f if json.loads(line).get("step", math.inf) <= resume_step]
            self.file = open(path, "w")
            self.file.writelines(kept)
        self.step_times: list[float] = []
        self.tokens = 0  # real (not ignored) targets trained on in this run
        self.tokens_seen = tokens_seen

    def log(self, step: int, loss: torch.Tensor, lr: float, targets: torch.Tensor, seconds: float,
            grad_norm: torch.Tensor, ignore_index: int = -100) -> dict:
        """Record one optimizer step (on the rank holding the loss) and return its row."""
        tokens = int((targets != ignore_index).sum())
        self.tokens_seen += tokens
        self.tokens += tokens
        self.step_times.append(seconds)
        row = {"step": step, "loss": loss.item(), "lr": lr, "tokens": self.tokens_seen, "step_time": seconds,
               "tokens_per_s": tokens / seconds, "grad_norm": grad_norm.item()}
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        return row

    def finish(self, env: Env, positions_per_step: int, meter: "ActivationMeter | None" = None,
               flops_per_token: float | None = None) -> None:
        """Collectively gather every stage's peak memory; the rank holding the loss prints and writes a summary.
        flops_per_token (see model_flops_per_token) adds the MFU on GPUs whose peak is known."""
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, (peak_memory_bytes(env.device), meter.peak_bytes if meter else None))
        peaks = [memory for memory, _ in gathered]
        if self.step_times:
            # The first step includes one-time costs (shape inference, allocator warmup): leave it out if we can.
            steady = self.step_times[1:] or self.step_times
            tokens_per_step = self.tokens / len(self.step_times)
            summary = {
                "steps": len(self.step_times),
                "median_step_time": sorted(steady)[len(steady) // 2],
                "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
                "useful_token_share": tokens_per_step / positions_per_step,
                "peak_memory_bytes_per_stage": peaks,
                "memory_kind": "cuda max allocated" if env.device.type == "cuda" else "process peak RSS",
            }
            if meter is not None:
                summary["activation_bytes_per_stage"] = [activations for _, activations in gathered]
            peak_flops = gpu_peak_flops(env.device)
            if flops_per_token and peak_flops:  # every rank of the pipeline is one GPU of that kind
                summary["mfu"] = summary["tokens_per_s"] * flops_per_token / (peak_flops * env.world_size)
            if self.file:
                self.file.write(json.dumps({"summary": summary}) + "\n")
            print(f"done: {summary['steps']} steps, median step {summary['median_step_time'] * 1e3:.0f} ms, "
                  f"{summary['tokens_per_s']:.0f} tokens/s, {summary['useful_token_share']:.0%} of positions are "
                  f"text; peak memory per stage ({summary['memory_kind']}, MiB): "
                  + ", ".join(f"{b / 2**20:.0f}" for b in peaks), flush=True)
            if "mfu" in summary:
                print(f"MFU {summary['mfu']:.1%} ({flops_per_token / 1e9:.2f} GFLOP per token, bf16 dense peak "
                      f"{gpu_peak_flops(env.device) / 1e12:.0f} TFLOP/s per GPU)", flush=True)
            if meter is not None:
                print("peak activations held per stage (MiB): " + ", ".join(
                    f"{b / 2**20:.2f}" for b in summary["activation_bytes_per_stage"]), flush=True)
        if self.file:
            self.file.close()


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM, appendix B): N the parameters outside the embedding
    lookup (it does no multiply), L layers, H query heads, Q head size, T sequence length (attention)."""
    per_layer = (2 * config.hidden_size * config.num_attention_heads * config.head_dim  # q and o
                 + 2 * config.hidden_size * config.num_key_value_heads * config.head_dim  # k and v
                 + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size)  # mlp, norms
    n = config.num_hidden_layers * per_layer + config.hidden_size * (config.vocab_size + 1)  # + head, final norm
    return 6 * n + 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len


# Dense bf16 peak per GPU, from the vendors' data sheets (without sparsity). Unknown GPUs get no MFU.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB: peak resident memory


class Timer:
    """Wall time of one step; on GPU it waits for queued kernels so the time is the step's, not its launch's."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class ActivationMeter:
    """Peak bytes of activations saved for backward while active, counted through autograd's saved-tensor hooks.

    Parameters (which autograd also saves, e.g. a linear's weight) are not activations and are not counted;
    a storage saved by several ops counts once.

        meter = ActivationMeter(model.parameters())
        with meter:
            train_step(...)
        meter.peak_bytes
    """

    def __init__(self, params):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list] = {}  # storage pointer -> [bytes, number of saves still alive]
        self.current = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or tensor.device.type == "meta":
            return tensor
        entry = self._live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current)
        entry[1] += 1
        return _Saved(self, ptr, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr):
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Saved:
    # Autograd drops this object when it frees the graph node that saved the tensor; that is when the
    # activation stops being held for backward.
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter, ptr, tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter._release(self.ptr)
