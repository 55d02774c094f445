"""How the model is cut into pipeline stages: the cost of each piece, and contiguous layouts of the layers.

A pipeline runs at the pace of its slowest stage: every other stage waits for it, each microbatch. Cutting the
layers evenly ignores that the last stage also computes the head and the loss over the whole vocabulary (on the
tiny model about 4.6 decoder layers of work; on llama-8b with a 128k vocabulary about 1.8) and the first stage
the embedding. The balanced layout (the default, --split balanced) chooses the contiguous boundaries that
minimize the slowest stage's forward + backward cost:

    layer  6 N_layer + 12 H Q T   FLOPs per token: every weight multiplies twice in backward, once in forward
                                  (N_layer: the layer's parameters), plus attention over T positions (PaLM)
    head   6 h V                  the projection to the vocabulary (the loss itself is a few ops per logit)
    embed  6 h                    a lookup forward, a scatter-add backward

With --activation-checkpointing a layer runs its forward again in backward: 4/3 of its cost (the head is not
checkpointed, so the balance moves a little towards fewer layers on the last stage).

--split even keeps equal layer counts; --split 5,1 gives the layer count of each stage. (Balancing on times
measured on the machine instead was tried: on the tiny model it chose the layout the estimate chooses, so it
could not run faster, and was left out.)
"""

from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS, ScheduleZBVZeroBubble)

from runtime import FlagError


# ----------------------------------------------------------------------------------------------------------
# What each piece costs

def estimated_costs(config, seq_len: int, recompute: bool = False) -> dict[str, float]:
    """Forward + backward FLOPs per token of one decoder layer (with its recomputed forward, when activation
    checkpointing: "recompute" says how much of "layer" that is), the head with the loss, and the embedding."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads
    layer_params = h * (2 * q + 2 * kv * config.head_dim) + 3 * h * config.intermediate_size + 2 * h
    layer = 6 * layer_params + 12 * q * seq_len
    again = layer / 3 if recompute else 0.0  # the forward is a third of forward + backward
    return {"layer": layer + again, "recompute": again, "head": 6 * h * config.vocab_size + 6 * h, "embed": 6 * h}


def stage_costs(layout: list[range], costs: dict[str, float]) -> list[float]:
    """Each stage's cost: its layers, the embedding on the first, the head on the last."""
    return [len(layers) * costs["layer"] + (costs["embed"] if i == 0 else 0)
            + (costs["head"] if i == len(layout) - 1 else 0) for i, layers in enumerate(layout)]


# ----------------------------------------------------------------------------------------------------------
# Layouts: one contiguous range of layers per stage, every stage at least one layer

def even(num_layers: int, num_stages: int) -> list[range]:
    """Sizes differing by at most one (earlier stages get the extra)."""
    base, extra = divmod(num_layers, num_stages)
    return from_sizes([base + (1 if stage < extra else 0) for stage in range(num_stages)])


def from_sizes(sizes: list[int]) -> list[range]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(bounds[i], bounds[i + 1]) for i in range(len(sizes))]


def balanced(num_layers: int, num_stages: int, costs: dict[str, float]) -> list[range]:
    """The contiguous layout whose slowest stage costs least (stage_costs), by dynamic programming over the
    boundaries (O(stages x layers^2), instant for any real model)."""
    layer, first, last = costs["layer"], costs["embed"], costs["head"]
    # best[s][n]: the smallest possible slowest-stage cost of putting the first n layers into stages 0..s-1
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for n in range(s, num_layers - (num_stages - s) + 1):
            for k in range(s - 1, n):  # stage s - 1 holds layers k .. n - 1
                cost = (n - k) * layer + (first if s == 1 else 0) + (last if s == num_stages else 0)
                slowest = max(best[s - 1][k], cost)
                if slowest < best[s][n]:  # on a tie the first found stays: more layers on the later stage
                    best[s][n], cut[s][n] = slowest, k
    sizes, n = [], num_layers
    for s in range(num_stages, 0, -1):
        sizes.append(n - cut[s][n])
        n = cut[s][n]
    return from_sizes(sizes[::-1])


def layout_for(spec: str, num_layers: int, num_stages: int, config, seq_len: int,
               recompute: bool = False) -> list[range]:
    """The layout --split asks for: even, balanced (by estimated_costs), or layers per stage (N,N,...)."""
    if spec == "even":
        return even(num_layers, num_stages)
    if spec == "balanced":
        return balanced(num_layers, num_stages, estimated_costs(config, seq_len, recompute))
    check_split(spec, num_layers, num_stages)
    return from_sizes([int(size) for size in spec.split(",")])


def check_split(spec: str, num_layers: int | None = None, num_stages: int | None = None) -> None:
    """--split's syntax, before any work; with the model's layers and the stage count, an explicit layout's."""
    if spec in ("even", "balanced"):
        return
    try:
        sizes = [int(size) for size in spec.split(",")]
    except ValueError:
        raise FlagError(f"--split {spec}: use balanced, even, or layers per stage such as 5,1") from None
    if num_layers is not None and (len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1):
        raise FlagError(f"--split {spec}: give {num_stages} layer counts (one per stage), each at least 1, adding "
                        f"up to the model's {num_layers} layers (or balanced, even)")


def stages_per_rank(args) -> int:
    """How many stages each pipeline rank holds with --schedule (the hand-written schedules: one)."""
    if args.schedule not in SCHEDULES or args.schedule in SINGLE_STAGE:
        return 1
    return 2 if args.schedule in V_SHAPED else args.stages_per_rank


def run_layout(args, config, num_stages: int) -> tuple[list[range], dict[str, float]]:
    """This run's layout (--split) and the estimated costs it shows each stage's share of."""
    costs = estimated_costs(config, args.seq_len, args.activation_checkpointing)
    return layout_for(args.split, config.num_hidden_layers, num_stages, config, args.seq_len,
                      args.activation_checkpointing), costs


def describe_run(name: str, config, env, how: str, layout: list[range], costs: dict[str, float]) -> str:
    """One line: the model, how it is split over the stages (with each one's share of the cost), and where it
    runs."""
    pp, dp = env.mesh.pp, env.mesh.dp
    where = f"{env.world_size} process(es)" if dp == 1 else \
        f"{env.world_size} processes = {pp} pipeline rank(s) x {dp} data-parallel replicas (FSDP2)"
    return (f"model {name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size} | {len(layout)} stage(s) on {where}: {describe(layout, costs)} | {how} | "
            f"{env.device.type} {str(env.dtype).removeprefix('torch.')} {env.backend}")


def describe(layout: list[range], costs: dict[str, float]) -> str:
    """[embed + layers 0-3 (41%)] [layers 4-5 + norm + head (59%)]: each stage and its share of the cost."""
    shares = stage_costs(layout, costs)
    total, parts = sum(shares), []
    for stage, layers in enumerate(layout):
        text = f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"
        text = ("embed + " if stage == 0 else "") + text + (" + norm + head" if stage == len(layout) - 1 else "")
        parts.append(f"[{text} ({shares[stage] / total:.0%})]")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------------------
# Which stages each pipeline rank holds, per schedule

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
             "loopedbfs": ScheduleLoopedBFS, "interleavedzerobubble": ScheduleInterleavedZeroBubble,
             "zbvzerobubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SINGLE_STAGE = {"gpipe", "1f1b"}  # one stage per rank; the others take a list of stages
V_SHAPED = {"zbvzerobubble", "dualpipev"}


def stage_ids(schedule: str, rank: int, world_size: int, stages_per_rank: int) -> list[int]:
    """The global indices of the stages this rank holds."""
    if schedule in SINGLE_STAGE:
        return [rank]
    if schedule in V_SHAPED:  # down the ranks and back up: the first and last stage meet on rank 0
        return [rank, 2 * world_size - 1 - rank]
    return [rank + v * world_size for v in range(stages_per_rank)]  # looped


def check_schedule(args, world_size: int, num_layers: int | None = None) -> None:
    """What each schedule requires of the flags, for world_size pipeline ranks, checked before any work (torch
    2.13's own checks); the stage count against the layers too, once num_layers is known (--init-from: after
    preflight)."""
    name, m = args.schedule, args.microbatches
    if name in SINGLE_STAGE:
        per_rank = 1
    elif name in V_SHAPED:
        if args.stages_per_rank != 2:
            raise FlagError(f"--stages-per-rank {args.stages_per_rank}: {name} places exactly 2 stages "
                                    "on each rank in a V; use --stages-per-rank 2")
        per_rank = 2
    else:
        per_rank = args.stages_per_rank
        if per_rank < 1:
            raise FlagError(f"--stages-per-rank must be at least 1, got {per_rank}")
    stages = world_size * per_rank
    if num_layers is not None and stages > num_layers:
        raise FlagError(f"{world_size} processes x {per_rank} stages per rank = {stages} stages, but the "
                                f"model has {num_layers} layers; lower --stages-per-rank or raise --layers")
    if name in ("1f1b", "dualpipev") and m < stages:
        raise FlagError(f"--microbatches {m}: {name} needs at least as many microbatches as stages "
                                f"({stages}); use --microbatches {stages} or more")
    rounds = max(1, m // world_size)
    if name in ("interleaved1f1b", "interleavedzerobubble") and m % rounds:
        raise FlagError(f"--microbatches {m}: {name} needs a multiple of max(1, microbatches // "
                                f"processes) = {rounds}; use a multiple of {world_size}")
