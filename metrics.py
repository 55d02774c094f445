"""What a run measures and reports: one JSON line per step, the end-of-run summary, step timing, the
activation bytes held for backward, peak memory and the MFU."""

import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import runtime


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
                    kept = [line for line in f if _row_step(json.loads(line)) <= resume_step]
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

    def log_eval(self, step: int, loss: float, batches: int) -> dict:
        """Record an evaluation (the rank holding the loss): {"eval": {"step", "loss", "perplexity", "batches"}}."""
        row = {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "batches": batches}
        if self.file:
            self.file.write(json.dumps({"eval": row}) + "\n")
            self.file.flush()
        return row

    def finish(self, env: "runtime.Env", positions_per_step: int, meter: "ActivationMeter | None" = None,
               flops_per_token: float | None = None, state_bytes: dict | None = None) -> None:
        """Collectively gather every rank's peak memory (and what it holds: state_bytes); the rank holding the loss
        prints and writes a summary. flops_per_token (see model_flops_per_token) adds the MFU on GPUs whose peak
        is known. Lists "..._per_rank" are in rank order (rank = stage * dp + replica)."""
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, (peak_memory_bytes(env.device), meter.peak_bytes if meter else None,
                                          state_bytes))
        peaks = [memory for memory, _, _ in gathered]
        if self.step_times:
            # The first step includes one-time costs (shape inference, allocator warmup): leave it out if we can.
            steady = self.step_times[1:] or self.step_times
            tokens_per_step = self.tokens / len(self.step_times)
            summary = {
                "steps": len(self.step_times),
                "median_step_time": sorted(steady)[len(steady) // 2],
                "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
                "useful_token_share": tokens_per_step / positions_per_step,
                "peak_memory_bytes_per_rank": peaks,
                "memory_kind": "cuda max allocated" if env.device.type == "cuda" else "process peak RSS",
            }
            if meter is not None:
                summary["activation_bytes_per_rank"] = [activations for _, activations, _ in gathered]
            if state_bytes is not None:
                for kind in state_bytes:
                    summary[f"{kind}_bytes_per_rank"] = [held[kind] for _, _, held in gathered]
            peak_flops = gpu_peak_flops(env.device)
            if flops_per_token and peak_flops:  # every rank of the pipeline is one GPU of that kind
                summary["mfu"] = summary["tokens_per_s"] * flops_per_token / (peak_flops * env.world_size)
            if self.file:
                self.file.write(json.dumps({"summary": summary}) + "\n")
            mib = lambda values: ", ".join(f"{b / 2**20:.1f}" for b in values)  # noqa: E731
            print(f"done: {summary['steps']} steps, median step {summary['median_step_time'] * 1e3:.0f} ms, "
                  f"{summary['tokens_per_s']:.0f} tokens/s, {summary['useful_token_share']:.0%} of positions are "
                  f"text; peak memory per rank ({summary['memory_kind']}, MiB): {mib(peaks)}", flush=True)
            if state_bytes is not None:
                print("held per rank (MiB): " + "; ".join(f"{kind} {mib(summary[f'{kind}_bytes_per_rank'])}"
                                                          for kind in state_bytes), flush=True)
            if "mfu" in summary:
                print(f"MFU {summary['mfu']:.1%} ({flops_per_token / 1e9:.2f} GFLOP per token, bf16 dense peak "
                      f"{gpu_peak_flops(env.device) / 1e12:.0f} TFLOP/s per GPU)", flush=True)
            if meter is not None:
                print(f"peak activations held per rank (MiB): {mib(summary['activation_bytes_per_rank'])}",
                      flush=True)
        if self.file:
            self.file.close()


def _row_step(row: dict) -> float:
    """The step a metrics line belongs to (the summary: none, it is rewritten at the end)."""
    return row.get("step", row.get("eval", {}).get("step", math.inf))


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds: with FSDP, its shards only."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def size(tensors):
        return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))

    params = list(model.parameters())
    return {"param": size(params), "grad": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(v for state in optimizer.state.values() for v in state.values())}


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

    Parameters (which autograd also saves, e.g. a linear's weight) are not activations and are not counted,
    nor are the unsharded parameters FSDP gathers for the step; a storage saved by several ops counts once.

        meter = ActivationMeter(model.parameters())
        with meter:
            train_step(...)
        meter.peak_bytes
    """

    def __init__(self, params):
        self._params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list] = {}  # storage pointer -> [bytes, number of saves still alive]
        self.current = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        if tensor.device.type == "meta" or isinstance(tensor, torch.nn.Parameter) or \
                isinstance(tensor._base, torch.nn.Parameter):  # FSDP's gathered parameters (or a view of one)
            return tensor
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params:
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
