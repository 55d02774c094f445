"""What each pipeline rank did and when: forward, backward, send and recv per microbatch.

Used by the hand-written pipeline to print the measured bubble next to the theoretical one and to write a
Chrome trace (open it in ui.perfetto.dev or chrome://tracing).
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
        busy = sum(end - start for kind, _, start, end in events if kind in ("forward", "backward"))
        idle.append(1 - busy / seconds)
    return sum(idle) / len(idle)


def write_chrome_trace(path: str, per_rank: list[list]) -> None:
    trace = []
    for rank, events in enumerate(per_rank):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for kind, mb, start, end in events:
            name = f"{kind[0].upper()}{mb}" if kind in ("forward", "backward") else f"{kind} {mb}"
            trace.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e6,
                          "dur": (end - start) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def report(rank: int, world_size: int, steps: list[tuple[list, float]], microbatches: int,
           trace_path: str | None) -> None:
    """Collectively gather every rank's recent steps; rank 0 prints the bubble and writes the trace."""
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, steps)
    if rank != 0 or not steps:
        return
    p, m = world_size, microbatches
    measured = sum(bubble_fraction(r) for r in per_rank) / p
    print(f"bubble: measured {measured:.1%} of each step idle per rank (last {len(steps)} steps), "
          f"theory (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}", flush=True)
    if trace_path:
        write_chrome_trace(trace_path, [[event for events, _ in r for event in events] for r in per_rank])
        print(f"trace of the last {len(steps)} steps written to {trace_path}", flush=True)
