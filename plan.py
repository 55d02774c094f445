"""--plan: what a layout will hold in memory and how fast each schedule will run, computed without running it.

    python train_pipeline_gpipe.py --plan 8 --dp 2 --model llama-8b --seq-len 8192 --batch-size 64 \\
        --microbatches 8 --device cuda                     # 4 stages x 2 replicas, on a laptop

Nothing is allocated and no process group or GPU is needed. For every rank of the pipeline it prints the bytes
of parameters, gradients and AdamW state it holds (fp32, 1/dp of its stages' with FSDP, as the end-of-run
summary measures them), the gathered parameters and gradients FSDP holds during a step, and the activations
held for backward at the worst moment of the chosen schedule (what --measure-activations counts), with and
without --activation-checkpointing. Then, for every schedule torch ships, the step time and bubble, found by
replaying the schedule's own per-rank order of forwards and backwards (torch's, built from placeholder stages)
with each stage's cost from split.py: a stage's forward takes 1/3 of its forward + backward, a backward 2/3
(input and weight gradient 1/3 each for the zero-bubble schedules), and a message takes no time.
"""

import functools
import types
import warnings

import torch

import data
import hf
import split
import flags
from model import LlamaConfig, config_from_preset
from runtime import FlagError
from split import SCHEDULES, V_SHAPED, stage_ids

# The throughput the step times are given at: 40 % of an H100's dense bf16 peak, a typical sustained rate.
ASSUMED_FLOPS = 0.4 * 989e12


# ----------------------------------------------------------------------------------------------------------
# Sizes

def plan_config(args) -> LlamaConfig:
    """The model the flags describe, without reading or training a tokenizer beyond its JSON."""
    if args.init_from is not None:
        if hf.is_hf_dir(args.init_from):
            return hf.read_config(args.init_from)
        import checkpoint
        return LlamaConfig(**checkpoint.read_meta(checkpoint.resolve(args.init_from, "--init-from"))["config"])
    vocab = data.load_tokenizer(args.tokenizer).vocab_size() if args.tokenizer else (
        args.vocab_size or data.VOCAB_SIZE)
    preset = args.model or ("small" if args.device == "cuda" else "tiny")
    return config_from_preset(preset, vocab, args.layers)


def stage_params(config: LlamaConfig, layout: list[range]) -> list[int]:
    """Parameters of each stage: its layers, the embedding on the first, the final norm and the head on the last
    (a tied head is a copy there, unless one stage holds both)."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads
    layer = h * (2 * q + 2 * kv * config.head_dim) + 3 * h * config.intermediate_size + 2 * h
    embed, last = config.vocab_size * h, config.vocab_size * h + h
    if len(layout) == 1 and config.tie_word_embeddings:
        last -= config.vocab_size * h
    return [len(layers) * layer + (embed if i == 0 else 0) + (last if i == len(layout) - 1 else 0)
            for i, layers in enumerate(layout)]


def activation_bytes(config: LlamaConfig, tokens: int, seq_len: int, bf16: bool) -> dict[str, float]:
    """Bytes one microbatch of `tokens` tokens leaves saved for backward: per decoder layer (all of it, and
    only its input with activation checkpointing), for the head and loss, and for the embedding. fp32 on the
    CPU (exact: what --measure-activations counts on this model); under bf16 autocast the projections' inputs
    and attention run in bf16, norms, residuals and the loss in fp32."""
    h, heads, kv, d, inter = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size)
    e = 2 if bf16 else 4
    # fp32: norms' inputs and normalized values (4h), their rstd (2), attention's logsumexp (heads);
    # compute dtype: the projections' inputs (2h), q, k, v and the attention output, the MLP's 4 intermediates.
    layer = tokens * (4 * (4 * h + 2 + heads) + e * (2 * h + (2 * heads + 2 * kv) * d + 4 * inter))
    layer += 2 * seq_len * d * e  # the rotary cos/sin tables
    head = tokens * (4 * (2 * h + 1) + e * h + 4 * config.vocab_size + 8) + 4  # logits as fp32 for the loss
    return {"layer": layer, "layer_checkpointed": tokens * h * 4, "head": head, "embed": tokens * 8}


# ----------------------------------------------------------------------------------------------------------
# Replaying a schedule

@functools.lru_cache  # the same orders are replayed with and without checkpointing (not modified)
def schedule_orders(name: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[list[tuple]]]:
    """Each pipeline rank's compute actions in the order the schedule runs them: lists of (kind, stage,
    microbatch), kind F (forward), B (full backward), I / W (input / weight gradient); an element with two
    actions is DualPipeV's overlapped forward and backward. GPipe and 1F1B as their step() runs them (torch's
    own table for 1F1B is only a picture); the multi-stage schedules from torch's pipeline_order, which is
    what their runtime executes."""
    m = microbatches
    if name == "gpipe":
        return {r: [[("F", r, i)] for i in range(m)] + [[("B", r, i)] for i in range(m)] for r in range(pp)}
    if name == "1f1b":
        orders = {}
        for r in range(pp):
            warmup = min(m, pp - r)  # torch's Schedule1F1B: then backward and forward alternate
            acts = [[("F", r, i)] for i in range(warmup)]
            for i in range(m - warmup):
                acts += [[("B", r, i)], [("F", r, warmup + i)]]
            acts += [[("B", r, i)] for i in range(m - warmup, m)]
            orders[r] = acts
        return orders
    num_stages = pp * (2 if name in V_SHAPED else stages_per_rank)
    # Rank 0's schedule object computes every rank's order (pipeline_order holds them all): build it once.
    placeholders = [types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=s,
                                          is_first=s == 0, is_last=s == num_stages - 1, submod=torch.nn.Module())
                    for s in stage_ids(name, 0, pp, stages_per_rank)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = SCHEDULES[name](placeholders, n_microbatches=m).pipeline_order
    return {r: [_actions(a) for a in table[r] if a is not None and _actions(a)] for r in range(pp)}


def _actions(action) -> list[tuple]:
    if action.sub_actions:  # DualPipeV's overlapped forward and backward: run here one after the other
        return [a for sub in action.sub_actions for a in _actions(sub)]
    kind = str(action.computation_type.value)
    return [(kind, action.stage_index, action.microbatch_index)] if kind in ("F", "B", "I", "W") else []


def replay(orders: dict[int, list[list[tuple]]], forward: list[float], backward: list[float],
           held: list[float]) -> dict:
    """Run the orders against the dependencies: stage s's forward of microbatch i after stage s - 1's, its
    backward (B, or I for the input gradient alone) after its forward and after stage s + 1's backward, a
    weight gradient (W) after its I. forward/backward: each stage's times (I and W take half a backward each);
    held: each stage's activation bytes per microbatch, kept from its forward to its B or W. Returns the step
    time, each rank's busy time, its peak bytes held, and the bubble (the idle share of all ranks' time)."""
    last = len(forward) - 1
    finished: dict[tuple, float] = {}  # ("F" or "G" (input gradient ready) or "W", stage, microbatch) -> time
    clock, position = {r: 0.0 for r in orders}, {r: 0 for r in orders}
    holding, peak, busy = ({r: 0.0 for r in orders} for _ in range(3))

    def needs(kind, s, i) -> list[tuple]:
        if kind == "F":
            return [("F", s - 1, i)] if s > 0 else []
        if kind == "W":
            return [("G", s, i)]
        return [("F", s, i)] + ([("G", s + 1, i)] if s < last else [])

    def ready(group) -> float | None:
        """When every input of a group of actions (one, or an overlapped pair) is there; None: not yet."""
        times = [finished.get(n) for kind, s, i in group for n in needs(kind, s, i)]
        return None if None in times else max(times, default=0.0)

    # Each rank runs its order in sequence; an action starts when the rank is free and its inputs are there.
    # Those times do not depend on which rank is advanced first, so advance each as far as it can, in turns.
    progressed = True
    while progressed:
        progressed = False
        for r, acts in orders.items():
            while position[r] < len(acts) and (start := ready(acts[position[r]])) is not None:
                time = max(clock[r], start)
                for kind, s, i in acts[position[r]]:  # an overlapped pair: one after the other here
                    cost = {"F": forward[s], "B": backward[s], "I": backward[s] / 2, "W": backward[s] / 2}[kind]
                    time += cost
                    finished[("G" if kind in ("B", "I") else kind, s, i)] = time
                    busy[r] += cost
                    if kind == "F":
                        holding[r] += held[s]
                        peak[r] = max(peak[r], holding[r])
                    elif kind in ("B", "W"):
                        holding[r] -= held[s]
                clock[r], position[r], progressed = time, position[r] + 1, True
    if any(position[r] < len(acts) for r, acts in orders.items()):
        raise RuntimeError("the schedule's order cannot proceed: an action waits for one that never comes")
    step = max(clock.values())
    return {"step": step, "busy": busy, "peak": peak, "bubble": 1 - sum(busy.values()) / (len(busy) * step)}


# ----------------------------------------------------------------------------------------------------------
# The report

def run(args, processes: int) -> None:
    """Print the plan for `processes` processes and the other flags (see the module's docstring)."""
    flags.check_args(args, processes, "cuda" if args.device == "cuda" else "cpu")
    config = plan_config(args)
    pp, dp, m = processes // args.dp, args.dp, args.microbatches
    # The hand-written script's afab is GPipe's order; its parser has no --stages-per-rank (the table below
    # shows the library's multi-stage schedules with 2 stages per rank then).
    args = types.SimpleNamespace(**{**vars(args), "schedule": {"afab": "gpipe"}.get(args.schedule, args.schedule),
                                    "stages_per_rank": getattr(args, "stages_per_rank", 2)})
    split.check_schedule(args, pp, config.num_hidden_layers)
    bf16 = args.device == "cuda"
    tokens = args.batch_size // (dp * m) * args.seq_len  # one microbatch of one replica
    costs = split.estimated_costs(config, args.seq_len, args.activation_checkpointing)
    sizes = activation_bytes(config, tokens, args.seq_len, bf16)
    print(f"plan: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{processes} processes = {pp} pipeline ranks x {dp} replicas, --schedule {args.schedule}, "
          f"{m} microbatches of {tokens // args.seq_len} x {args.seq_len} tokens per replica, "
          f"{'bf16 autocast (GPU)' if bf16 else 'fp32 (CPU)'}")

    # Memory of the chosen schedule, per pipeline rank (each replica of a rank holds the same).
    stages_of = {r: stage_ids(args.schedule, r, pp, args.stages_per_rank) for r in range(pp)}
    num_stages = pp * len(stages_of[0])
    layout = split.layout_for(args.split, config.num_hidden_layers, num_stages, config, args.seq_len,
                              args.activation_checkpointing)
    print(f"layout (--split {args.split}): {split.describe(layout, costs)}")
    params = stage_params(config, layout)
    result = {}
    for checkpointing in (False, True):
        held = [len(layers) * sizes["layer_checkpointed" if checkpointing else "layer"]
                + (sizes["embed"] if s == 0 else 0) + (sizes["head"] if s == num_stages - 1 else 0)
                for s, layers in enumerate(layout)]
        result[checkpointing] = schedule_result(args.schedule, pp, m, args.stages_per_rank, layout, costs, held)
    report = {"ranks": [], "schedules": {}}
    unit, unit_name = (2 ** 30, "GiB") if 16 * sum(params) >= 2 ** 30 else (2 ** 20, "MiB")  # MiB for small models
    print(f"\nper pipeline rank, {unit_name} (each of its replicas holds the same) | param | grad | AdamW | gathered "
          "during a step (dp > 1) | activations held | with --activation-checkpointing | total, as flagged")
    for r in range(pp):
        p = sum(params[s] for s in stages_of[r])
        row = {"param": 4 * p / dp, "grad": 4 * p / dp, "optimizer": 8 * p / dp, "gathered": 8 * p if dp > 1 else 0,
               "activations": result[False]["peak"][r], "activations_checkpointed": result[True]["peak"][r]}
        # Recomputing a checkpointed layer holds one layer's full activations for a moment.
        row["total"] = row["param"] + row["grad"] + row["optimizer"] + row["gathered"] + (
            row["activations_checkpointed"] + sizes["layer"] if args.activation_checkpointing else row["activations"])
        report["ranks"].append(row)
        print(f"  rank {r} (stages {', '.join(map(str, stages_of[r]))}): " + " | ".join(
            f"{v / unit:.2f}" for v in row.values()))
    share = split.stage_costs(layout, costs)
    report["compute_share"] = [c / sum(share) for c in share]
    print("compute per stage: " + ", ".join(f"{c:.0%}" for c in report["compute_share"]))

    # Every schedule, on the layout it would use.
    print(f"\nschedules ({pp} ranks, {m} microbatches; step time at {ASSUMED_FLOPS / 1e12:.0f} TFLOP/s per GPU"
          f"{', each layer recomputed in backward' if args.activation_checkpointing else ''}; "
          f"activations of the fullest rank, {unit_name}, without / with checkpointing):")
    for name in SCHEDULES:
        probe = types.SimpleNamespace(**{**vars(args), "schedule": name})
        try:
            split.check_schedule(probe, pp, config.num_hidden_layers)
        except FlagError as e:
            print(f"  {name:22s} not possible here: {str(e).split(';')[0]}")
            continue
        n = pp * len(stage_ids(name, 0, pp, args.stages_per_rank))
        lay = split.layout_for(args.split if args.split in ("even", "balanced") else "balanced",
                               config.num_hidden_layers, n, config, args.seq_len, args.activation_checkpointing)
        out = [schedule_result(name, pp, m, args.stages_per_rank, lay, costs, [
            len(layers) * sizes["layer_checkpointed" if ac else "layer"] + (sizes["embed"] if s == 0 else 0)
            + (sizes["head"] if s == n - 1 else 0) for s, layers in enumerate(lay)]) for ac in (False, True)]
        seconds = out[0]["step"] * tokens / ASSUMED_FLOPS
        ideal = sum(split.stage_costs(lay, costs)) * m / pp * tokens / ASSUMED_FLOPS  # all work, no bubble
        report["schedules"][name] = {"step": seconds, "bubble": out[0]["bubble"],
                                     "activations": max(out[0]["peak"].values()),
                                     "activations_checkpointed": max(out[1]["peak"].values())}
        print(f"  {name:22s} step {seconds * 1e3:10.4g} ms ({seconds / ideal:.2f} x no bubble)  bubble "
              f"{out[0]['bubble']:6.1%}  activations {max(out[0]['peak'].values()) / unit:.2f} / "
              f"{max(out[1]['peak'].values()) / unit:.2f}")
    return report


def schedule_result(name, pp, m, stages_per_rank, layout, costs, held) -> dict:
    """The replay of one schedule on a layout, with per-token stage costs (FLOPs) and bytes held per stage."""
    # A forward is a third of a stage's forward + backward; the backward is the rest, with any recomputation.
    again = [len(layers) * costs.get("recompute", 0.0) for layers in layout]
    work = [w - r for w, r in zip(split.stage_costs(layout, costs), again)]
    return replay(schedule_orders(name, pp, m, stages_per_rank), [w / 3 for w in work],
                  [2 * w / 3 + r for w, r in zip(work, again)], held)
