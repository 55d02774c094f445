"""What a layout will hold in memory and how fast each schedule will run, computed without running it.

    python plan.py --processes 8 --dp 2 --model llama-8b --seq-len 8192 --batch-size 64 --microbatches 8 \\
        --device cuda                             # 4 stages x 2 replicas of Llama 3 8B's shapes, on a laptop
    python plan.py --processes 4 --model llama-8b --vocab-size 128256 --seq-len 8192 --batch-size 16 \\
        --microbatches 16 --schedule 1f1b --activation-checkpointing --device cuda
    python plan.py --processes 2 --data data      # the tiny model on this machine, vocabulary of data/meta.json
    python plan.py --processes 4 --init-from path/to/Llama-3.2-1B --device cuda   # a Hugging Face model's shape

The flags are the training scripts' own (the same names, meanings and defaults: --model, --layers,
--init-from, --seq-len, --batch-size, --microbatches, --schedule, --stages-per-rank, --split, --dp,
--activation-checkpointing, --device), plus --processes, the number of processes the run would start
(pipeline ranks x --dp), and where the vocabulary comes from: --vocab-size (default 8192, prepare_data.py's
default tokenizer) or --data DIR (a prepared dataset's meta.json); --init-from brings its own. A plan is
refused, with the same one line, exactly when train_pipeline_gpipe.py would refuse the run (its check_args
and stage_layout do the checking); the hand-written script's afab is accepted too (GPipe's order).

Nothing is allocated and no process group or GPU is needed. For every rank of the pipeline it prints the bytes
of parameters, gradients and AdamW state it holds (fp32, 1/dp of its stages' with FSDP, as the end-of-run
summary measures them), the gathered parameters and gradients FSDP holds during a step, and the activations
held for backward at the worst moment of the chosen schedule (what `benchmark.py measure-activations` counts),
with and without --activation-checkpointing. Then, for every schedule torch ships, the step time and bubble,
found by replaying the schedule's own per-rank order of forwards and backwards (torch's, built from
placeholder stages) with each stage's cost from model.estimated_costs: a stage's forward takes 1/3 of its
forward + backward, a backward 2/3 (input and weight gradient 1/3 each for the zero-bubble schedules), and a
message takes no time.
"""

import argparse
import copy
import functools
import json
import os
import sys
import types
import warnings

import torch

import checkpoint
import train_pipeline_gpipe as gpipe
from checkpoint import Parser, UsageError, whole
from model import LlamaConfig, config_from_preset, describe_layout, estimated_costs, stage_costs
from train_pipeline_gpipe import SCHEDULES, V_SHAPED, stage_ids

# The throughput the step times are given at: 40 % of an H100's dense bf16 peak, a typical sustained rate.
ASSUMED_FLOPS = 0.4 * 989e12
VOCAB_SIZE = 8192  # prepare_data.py's default tokenizer
# The flags plan.py shares with the training scripts: copied from train_pipeline_gpipe.py's parser, so their
# names, types, defaults and help are the script's (--schedule is declared here: it also takes afab).
SHARED = ("model", "layers", "init_from", "seq_len", "batch_size", "microbatches", "stages_per_rank", "split",
          "dp", "tp", "loss_chunks", "activation_checkpointing", "device")


# ----------------------------------------------------------------------------------------------------------
# Sizes

def plan_config(args) -> LlamaConfig:
    """The model the flags describe: --init-from's shape (a Hugging Face directory or a checkpoint of this
    project), else the preset's with --layers and the vocabulary of --data or --vocab-size. Refuses what the
    training scripts refuse (checkpoint.model_config): --model or another --layers with --init-from, a dataset
    with more tokens than the model has embeddings."""
    data_vocab = read_vocab(args.data) if args.data is not None else None
    if args.init_from is None:
        preset = args.model or ("small" if device_type(args) == "cuda" else "tiny")
        return config_from_preset(preset, data_vocab or args.vocab_size or VOCAB_SIZE, args.layers)
    source = args.init_from
    if args.vocab_size is not None:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary comes from --init-from {source}; "
                         "leave --vocab-size out")
    if checkpoint.is_hf_dir(source):
        config = checkpoint.read_hf_config(source)
    elif os.path.isdir(source):
        config = LlamaConfig(**checkpoint.read_meta(checkpoint.resolve(source, "--init-from"))["config"])
    else:
        raise UsageError(f"--init-from {source}: not a directory; give a Hugging Face model directory "
                         "(config.json + *.safetensors) or a checkpoint of this project")
    for flag, value in (("--model", args.model), ("--layers", args.layers)):
        if value is not None and (flag == "--model" or value != config.num_hidden_layers):
            raise UsageError(f"{flag} {value}: the model's shape comes from {source} "
                             f"({config.num_hidden_layers} layers); leave {flag} out")
    if data_vocab is not None and data_vocab > config.vocab_size:
        raise UsageError(f"--data {args.data}: {data_vocab} tokens, but {source} has embeddings for "
                         f"{config.vocab_size}")
    return config


def read_vocab(directory: str) -> int:
    """The vocabulary of data prepared by prepare_data.py (its meta.json)."""
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--data {directory}: no data prepared there; run python prepare_data.py"
                         f"{'' if directory == 'data' else ' --out ' + directory} first (see its --help)") from None


def device_type(args) -> str:
    """--device as the scripts read it: auto is this machine's GPU if it has one (plan for a GPU cluster from a
    laptop with --device cuda)."""
    return "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"


def stage_params(config: LlamaConfig, layout: list[range], tp: int = 1) -> list[float]:
    """Parameters of each stage that one of its tensor-parallel ranks holds: its layers, the embedding on the
    first, the final norm and the head on the last (a tied head is a copy there, unless one stage holds both).
    Tensor parallelism splits every matrix tp ways; the norms' gains are held whole by each rank."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads
    layer = (h * (2 * q + 2 * kv * config.head_dim) + 3 * h * config.intermediate_size) / tp + 2 * h
    embed, last = config.vocab_size * h / tp, config.vocab_size * h / tp + h
    if len(layout) == 1 and config.tie_word_embeddings:
        last -= config.vocab_size * h / tp
    return [len(layers) * layer + (embed if i == 0 else 0) + (last if i == len(layout) - 1 else 0)
            for i, layers in enumerate(layout)]


def activation_bytes(config: LlamaConfig, tokens: int, seq_len: int, bf16: bool, tp: int = 1,
                     loss_chunks: int = 1) -> dict[str, float]:
    """Bytes one microbatch of `tokens` tokens leaves saved for backward on one tensor-parallel rank: per
    decoder layer (all of it, and only its input with activation checkpointing), for the head and loss, and
    for the embedding; and "loss", what the loss holds for a moment (fp32 logits and their softmax and
    gradient: of the whole microbatch with --loss-chunks 1, of one piece otherwise). fp32 on the CPU (what
    benchmark.py's ActivationMeter counts on this model); under bf16 autocast the projections' inputs and
    attention run in bf16, norms, residuals and the loss in fp32. Tensor parallelism splits what is per head
    or per MLP channel, and the logits; the norms and the projections' inputs are whole on every rank."""
    h, heads, kv, d, inter = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size)
    e, vocab = 2 if bf16 else 4, config.vocab_size / tp
    # fp32: norms' inputs and normalized values (4h), their rstd (2), attention's logsumexp (heads);
    # compute dtype: the projections' inputs (2h), q, k, v and the attention output, the MLP's 4 intermediates.
    layer = tokens * (4 * (4 * h + 2 + heads / tp) + e * (2 * h + (2 * heads + 2 * kv) * d / tp + 4 * inter / tp))
    layer += 2 * seq_len * d * e  # the rotary cos/sin tables
    # The final norm's input, normalized values and rstd, and the targets; then the chunked loss keeps the fp32
    # hidden states it starts each piece from, the plain loss the head's input (compute dtype) and the fp32
    # log-softmax of the whole logits.
    head = tokens * (4 * (2 * h + 1) + 8 + (e * h + 4 * vocab if loss_chunks == 1 else 4 * h)) + 4
    loss = 3 * 4 * tokens / loss_chunks * vocab  # a piece's logits, their log-softmax, then their gradient
    return {"layer": layer, "layer_checkpointed": tokens * h * 4, "head": head, "embed": tokens * 8, "loss": loss}


# ----------------------------------------------------------------------------------------------------------
# Replaying a schedule

@functools.lru_cache  # the same orders are replayed with and without checkpointing (not modified)
def schedule_orders(name: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[list[tuple]]]:
    """Each pipeline rank's compute actions in the order the schedule runs them: lists of (kind, stage,
    microbatch), kind F (forward), B (full backward), I / W (input / weight gradient); an element with two
    actions is DualPipeV's overlapped forward and backward. GPipe (and the hand-written afab) and 1F1B as their
    step() runs them (torch's own table for 1F1B is only a picture); the multi-stage schedules from torch's
    pipeline_order, which is what their runtime executes."""
    m = microbatches
    if name in ("gpipe", "afab"):
        return {r: [[("F", r, i)] for i in range(m)] + [[("B", r, i)] for i in range(m)] for r in range(pp)}
    if name == "1f1b":
        orders = {}
        for r in range(pp):
            warmup = min(m, pp - r)  # torch's Schedule1F1B (and the hand-written one): then B and F alternate
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


def schedule_result(name, pp, m, stages_per_rank, layout, costs, held) -> dict:
    """The replay of one schedule on a layout, with per-token stage costs (FLOPs) and bytes held per stage."""
    # A forward is a third of a stage's forward + backward; the backward is the rest, with any recomputation.
    again = [len(layers) * costs.get("recompute", 0.0) for layers in layout]
    work = [w - r for w, r in zip(stage_costs(layout, costs), again)]
    return replay(schedule_orders(name, pp, m, stages_per_rank), [w / 3 for w in work],
                  [2 * w / 3 + r for w, r in zip(work, again)], held)


# ----------------------------------------------------------------------------------------------------------
# Checking the flags: the training script's own checks

def script_args(args, schedule: str, split: str | None = None) -> argparse.Namespace:
    """The Namespace train_pipeline_gpipe.py would run with: its defaults, and the flags plan.py shares."""
    ns = gpipe.build_parser().parse_args([])
    for name in SHARED:
        setattr(ns, name, getattr(args, name))
    ns.schedule = schedule
    ns.split = args.split if split is None else split
    # check_args leaves the model's shape unchecked when --checkpoint-dir holds checkpoints (a resumed run):
    # a path that cannot exist keeps the plan from depending on the directory it is run in.
    ns.checkpoint_dir = os.path.join(os.devnull, "no-checkpoints")
    return ns


def check(args, config: LlamaConfig, schedule: str, split: str | None = None) -> tuple[argparse.Namespace,
                                                                                      list[range]]:
    """What train_pipeline_gpipe.py checks before it runs: the flags (check_args), then the layout on the
    model's shape (stage_layout: a layer per stage, --seq-len within its positions, --split). UsageError."""
    ns = script_args(args, schedule, split)
    gpipe.check_args(ns, args.processes, device_type(args))
    pp = args.processes // (args.dp * args.tp)
    return ns, gpipe.stage_layout(config, pp * len(stage_ids(schedule, 0, pp, ns.stages_per_rank)), ns)


# ----------------------------------------------------------------------------------------------------------
# The report

def plan(args) -> dict:
    """Print the plan (see the module's docstring) and return it: {"ranks": [per pipeline rank {"param", "grad",
    "optimizer", "gathered", "activations", "activations_checkpointed", "total"}, bytes], "schedules": {name:
    {"step" (seconds), "bubble", "activations", "activations_checkpointed"}}, "compute_share": [per stage]}.
    A flag the scripts would refuse is a UsageError."""
    # The hand-written script's afab is GPipe's order; its 1f1b is the library's.
    schedule = "gpipe" if args.schedule == "afab" else args.schedule
    gpipe.check_args(script_args(args, schedule), args.processes, device_type(args))  # before reading files
    config = plan_config(args)
    ns, layout = check(args, config, schedule)
    processes, dp, tp, m, per_rank = args.processes, args.dp, args.tp, args.microbatches, ns.stages_per_rank
    pp = processes // (dp * tp)
    bf16 = device_type(args) == "cuda"
    tokens = args.batch_size // (dp * m) * args.seq_len  # one microbatch of one replica
    # The FLOPs of a stage are split over its tensor-parallel ranks (their all-reduces are not counted).
    costs = {k: v / tp for k, v in estimated_costs(config, args.seq_len, args.activation_checkpointing,
                                                   args.loss_chunks).items()}
    sizes = activation_bytes(config, tokens, args.seq_len, bf16, tp, args.loss_chunks)
    print(f"plan: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{processes} processes = {pp} pipeline x {dp} data x {tp} tensor, --schedule {args.schedule}, "
          f"{m} microbatches of {tokens // args.seq_len} x {args.seq_len} tokens per replica, "
          f"{'bf16 autocast (GPU)' if bf16 else 'fp32 (CPU)'}")

    def held(lay: list[range], checkpointing: bool) -> list[float]:
        return [len(layers) * sizes["layer_checkpointed" if checkpointing else "layer"]
                + (sizes["embed"] if s == 0 else 0) + (sizes["head"] if s == len(lay) - 1 else 0)
                for s, layers in enumerate(lay)]

    # Memory of the chosen schedule, per pipeline rank (each replica of a rank holds the same).
    stages_of = {r: stage_ids(schedule, r, pp, per_rank) for r in range(pp)}
    print(f"layout (--split {args.split}): {describe_layout(layout, costs)}")
    params = stage_params(config, layout, tp)
    result = {ac: schedule_result(schedule, pp, m, per_rank, layout, costs, held(layout, ac)) for ac in (False, True)}
    report = {"ranks": [], "schedules": {}}
    unit, unit_name = (2 ** 30, "GiB") if 16 * sum(params) >= 2 ** 30 else (2 ** 20, "MiB")  # MiB for small models
    print(f"\nper pipeline rank, {unit_name} (each of its replicas and tensor-parallel ranks holds the same) | param "
          "| grad | AdamW | gathered during a step (dp > 1) | activations held | with --activation-checkpointing | "
          f"the loss's logits (--loss-chunks {args.loss_chunks}) | total, as flagged")
    last_rank = next(r for r in range(pp) if len(layout) - 1 in stages_of[r])
    for r in range(pp):
        p = sum(params[s] for s in stages_of[r])
        row = {"param": 4 * p / dp, "grad": 4 * p / dp, "optimizer": 8 * p / dp, "gathered": 8 * p if dp > 1 else 0,
               "activations": result[False]["peak"][r], "activations_checkpointed": result[True]["peak"][r],
               "loss": sizes["loss"] if r == last_rank else 0}
        # Recomputing a checkpointed layer holds one layer's full activations for a moment.
        row["total"] = row["param"] + row["grad"] + row["optimizer"] + row["gathered"] + row["loss"] + (
            row["activations_checkpointed"] + sizes["layer"] if args.activation_checkpointing else row["activations"])
        report["ranks"].append(row)
        print(f"  rank {r} (stages {', '.join(map(str, stages_of[r]))}): " + " | ".join(
            f"{v / unit:.2f}" for v in row.values()))
    share = stage_costs(layout, costs)
    report["compute_share"] = [c / sum(share) for c in share]
    print("compute per stage: " + ", ".join(f"{c:.0%}" for c in report["compute_share"]))

    # Every schedule, on the layout it would use (a --split of layer counts fits one stage count only: the
    # others are shown balanced).
    print(f"\nschedules ({pp} ranks, {m} microbatches; step time at {ASSUMED_FLOPS / 1e12:.0f} TFLOP/s per GPU"
          f"{', tensor-parallel all-reduces not counted' if tp > 1 else ''}"
          f"{', each layer recomputed in backward' if args.activation_checkpointing else ''}; "
          f"activations of the fullest rank, {unit_name}, without / with checkpointing):")
    for name in SCHEDULES:
        try:
            _, lay = (ns, layout) if name == schedule else check(
                args, config, name, args.split if args.split in ("even", "balanced") else "balanced")
        except UsageError as e:
            print(f"  {name:22s} not possible here: {str(e).split(';')[0]}")
            continue
        out = [schedule_result(name, pp, m, per_rank, lay, costs, held(lay, ac)) for ac in (False, True)]
        seconds = out[0]["step"] * tokens / ASSUMED_FLOPS
        ideal = sum(stage_costs(lay, costs)) * m / pp * tokens / ASSUMED_FLOPS  # all work, no bubble
        report["schedules"][name] = {"step": seconds, "bubble": out[0]["bubble"],
                                     "activations": max(out[0]["peak"].values()),
                                     "activations_checkpointed": max(out[1]["peak"].values())}
        print(f"  {name:22s} step {seconds * 1e3:10.4g} ms ({seconds / ideal:.2f} x no bubble)  bubble "
              f"{out[0]['bubble']:6.1%}  activations {max(out[0]['peak'].values()) / unit:.2f} / "
              f"{max(out[1]['peak'].values()) / unit:.2f}")
    return report


class _Parser(Parser):
    MOVED = {flag: where for flag, where in Parser.MOVED.items() if flag != "--vocab-size"}  # plan.py's own


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan.py", description=__doc__)
    p.add_argument("--processes", type=whole(1), required=True,
                   help="processes the run would start: pipeline ranks x --dp x --tp")
    script = {action.dest: action for action in gpipe.build_parser()._actions}
    g = p.add_argument_group("the training scripts' flags (same meaning)")
    for name in SHARED:
        g._add_action(copy.copy(script[name]))
    g.add_argument("--schedule", choices=[*SCHEDULES, "afab"], default="gpipe",
                   help="the library schedules, and the hand-written script's afab (GPipe's order)")
    g = p.add_argument_group("vocabulary (without --init-from)").add_mutually_exclusive_group()
    g.add_argument("--vocab-size", type=whole(1),
                   help=f"tokens in the vocabulary (default: {VOCAB_SIZE}, prepare_data.py's default tokenizer)")
    g.add_argument("--data", metavar="DIR", help="take the vocabulary from data prepared by prepare_data.py")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return plan(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
