"""What each pipeline rank did and when: forward, backward, send and recv per microbatch.

Both training scripts use it to print the measured bubble next to the theoretical one and to write a Chrome
trace (open it in ui.perfetto.dev or chrome://tracing); benchmark.py draws its pictures from those traces.
"""

import json
import time

import torch
import torch.distributed as dist


class Timeline:
    """Events of one step on one rank, as (kind, microbatch, start, end) in seconds since `zero`."""

    def __init__(self, device: torch.device, zero: float = 0.0):
        self.device, self.zero, self.events = device, zero, []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the work, not its launch
        return time.perf_counter() - self.zero

    def add(self, kind: str, mb: int, start: float) -> None:
        self.events.append((kind, mb, start, self.now()))


def bubble_fraction(steps: list[tuple[list, float]]) -> float:
    """Mean share of a step that a rank spends not computing (waiting for its neighbours)."""
    idle = []
    for events, seconds in steps:
        busy = sum(end - start for kind, _, start, end in events if kind in ("forward", "backward", "loss"))
        idle.append(1 - busy / seconds)
    return sum(idle) / len(idle)


def comm_share(steps: list[tuple[list, float]]) -> float:
    """Mean share of a step spent posting sends and waiting on receives."""
    return sum(sum(end - start for kind, _, start, end in events if kind in ("send", "recv", "wait")) / seconds
               for events, seconds in steps) / len(steps)


def write_chrome_trace(path: str, per_rank: list[list]) -> None:
    trace = []
    for rank, events in enumerate(per_rank):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for kind, mb, start, end in events:
            name = f"{kind[0].upper()}{mb}" if kind in ("forward", "backward") else f"{kind} {mb}".removesuffix(" -1")
            trace.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e6,
                          "dur": (end - start) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def report(rank: int, world_size: int, stages: int, steps: list[tuple[list, float]], microbatches: int,
           trace_path: str | None) -> None:
    """Collectively gather every rank's recent steps; rank 0 prints the bubble (of the stages, p = the pipeline's
    ranks; averaged over every replica's) and writes the trace of every rank."""
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, steps)
    if rank != 0 or not steps:
        return
    p, m = stages, microbatches
    measured = sum(bubble_fraction(r) for r in per_rank) / world_size
    waiting = sum(comm_share(r) for r in per_rank) / world_size
    print(f"bubble: measured {measured:.1%} of each step idle per rank (last {len(steps)} steps), "
          f"theory (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}; {waiting:.1%} of each step in send/recv",
          flush=True)
    if trace_path:
        write_chrome_trace(trace_path, [[event for events, _ in r for event in events] for r in per_rank])
        print(f"trace of the last {len(steps)} steps written to {trace_path}", flush=True)


class Recorder:
    """Times what torch.distributed.pipelining actually runs, for the library script's --trace.

    It wraps the stage objects' own methods (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk)
    and the schedules' wait on point-to-point messages; module hooks are not involved. `current` is the
    Timeline of the step in progress (None: record nothing).
    """

    def __init__(self):
        self.current: Timeline | None = None

    def _timed(self, kind: str, method):
        def timed(chunk_id, *args, **kwargs):
            if self.current is None:
                return method(chunk_id, *args, **kwargs)
            start = self.current.now()
            result = method(chunk_id, *args, **kwargs)
            self.current.add(kind, chunk_id, start)
            return result
        return timed

    def timed_loss(self, loss_fn):
        """loss_fn, timed: the schedules compute the loss outside the stage's forward, but it is the last
        stage's work all the same (the hand-written pipeline counts it in its forward)."""
        def timed(*args, **kwargs):
            if self.current is None:
                return loss_fn(*args, **kwargs)
            start = self.current.now()
            result = loss_fn(*args, **kwargs)
            self.current.add("loss", -1, start)
            return result
        return timed

    def instrument(self, stages) -> None:
        import torch.distributed.pipelining.schedules as schedules

        for stage in stages:
            stage.forward_one_chunk = self._timed("forward", stage.forward_one_chunk)
            stage.backward_one_chunk = self._timed("backward", stage.backward_one_chunk)
            stage.backward_weight_one_chunk = self._timed("backward", stage.backward_weight_one_chunk)
        wait = schedules._wait_batch_p2p  # private in torch 2.13: every schedule waits on its sends/recvs here

        def timed_wait(work):
            start = self.current.now() if self.current is not None else 0.0
            result = wait(work)
            if self.current is not None:
                self.current.add("wait", -1, start)
            return result
        schedules._wait_batch_p2p = timed_wait
