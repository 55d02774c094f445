"""Every pipeline variant side by side on the same model, data and machine, in one run.

    OMP_NUM_THREADS=1 python benchmark.py                     # 2 ranks, 8 microbatches, tiny model
    python benchmark.py --ranks 3 --microbatches 6 --repeats 5 --out bench/
    python benchmark.py --sweep                               # GPipe step time for m = 1, 2, 4, 8, 16
    python benchmark.py --dp 2                                # 2 stages alone vs 2 stages x 2 replicas
    python benchmark.py --splits                              # split by layers vs by cost; checkpointing, compile

Variants: every schedule of torch.distributed.pipelining (train_pipeline_gpipe.py), the hand-written AFAB
and 1F1B (train_pipeline_afab_manual.py), and the tracer split (train_pipeline_tracer.py, when present). Each
is a real training run under torchrun. Runs alternate between variants, repeat after repeat, so drift of a
shared machine hits every variant alike; a variant's step time is the median over its runs of each run's
median step (first step excluded). The last run of each variant records a trace (--trace), from which come
the measured bubble, the share of time in send/recv, and a timeline picture; a separate short run with
--measure-activations gives the peak activation bytes per stage.

Writes OUT/results.md (Markdown table), OUT/results.json, OUT/<variant>.trace.json and, when matplotlib is
installed, OUT/<variant>.png (forward / backward / waiting per rank over time).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {  # name: (script, schedule)
    "gpipe": ("train_pipeline_gpipe.py", "gpipe"),
    "1f1b": ("train_pipeline_gpipe.py", "1f1b"),
    "interleaved1f1b": ("train_pipeline_gpipe.py", "interleaved1f1b"),
    "loopedbfs": ("train_pipeline_gpipe.py", "loopedbfs"),
    "interleavedzerobubble": ("train_pipeline_gpipe.py", "interleavedzerobubble"),
    "zbvzerobubble": ("train_pipeline_gpipe.py", "zbvzerobubble"),
    "dualpipev": ("train_pipeline_gpipe.py", "dualpipev"),
    "afab (by hand)": ("train_pipeline_afab_manual.py", "afab"),
    "1f1b (by hand)": ("train_pipeline_afab_manual.py", "1f1b"),
    "gpipe (tracer)": ("train_pipeline_tracer.py", "gpipe"),
}
BUBBLE = re.compile(r"bubble: measured ([\d.]+)% .*; ([\d.]+)% of each step in send/recv")


def run(args, script, schedule, steps, workdir, microbatches=None, extra=(), ranks=None) -> tuple[dict, str]:
    """One training run; returns its summary row and stdout."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks or args.ranks}",
           os.path.join(ROOT, script), "--schedule", schedule, "--steps", str(steps), "--warmup-steps", "2",
           "--batch-size", str(args.batch_size), "--microbatches", str(microbatches or args.microbatches),
           "--seq-len", str(args.seq_len), "--metrics", metrics, "--checkpoint-dir", os.path.join(workdir, "ckpt"),
           "--fresh", *args.script_args, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark: {script} --schedule {schedule} failed:\n{result.stderr[-3000:]}")
    with open(metrics) as f:
        return [json.loads(line)["summary"] for line in f if line.startswith('{"summary"')][-1], result.stdout


def spans(trace_path: str) -> dict[int, list[dict]]:
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    by_rank = {}
    for e in events:
        by_rank.setdefault(e["tid"], []).append(e)
    return by_rank


def forward_backward_times(trace_path: str) -> list[tuple[float, float]]:
    """Per rank: the median forward (with the loss, on the last stage) and the median backward of one
    microbatch, in seconds."""
    times = []
    for _, events in sorted(spans(trace_path).items()):
        losses = [e["dur"] for e in events if e["cat"] == "loss"]  # the last stage's, once per microbatch
        t_f = statistics.median(e["dur"] for e in events if e["cat"] == "forward") + (
            statistics.median(losses) if losses else 0)
        t_b = statistics.median(e["dur"] for e in events if e["cat"] == "backward")
        times.append((t_f / 1e6, t_b / 1e6))
    return times


def stage_times(trace_path: str) -> list[float]:
    """Per rank: the median forward plus the median backward of one microbatch, in seconds."""
    return [t_f + t_b for t_f, t_b in forward_backward_times(trace_path)]


def replayed(trace_path: str, schedule: str, m: int) -> dict:
    """plan.py's replay of a single-stage schedule with the stage times measured in a traced run."""
    import plan  # imports torch: only when a trace is replayed

    times = forward_backward_times(trace_path)
    orders = plan.schedule_orders(schedule, len(times), m, 1)
    return plan.replay(orders, [t for t, _ in times], [t for _, t in times], [0.0] * len(times))


def ideal_gpipe_step(trace_path: str, p: int, m: int) -> float:
    """(m + p - 1) x (t_forward + t_backward) of the slowest stage: the bubble-limited GPipe step."""
    return (m + p - 1) * max(stage_times(trace_path))


def unequal_stages_bound(trace_path: str, m: int) -> float:
    """The same bound for stages of unequal cost: the first microbatch passes every stage once, the other
    m - 1 follow at the pace of the slowest. Equals the one above when the stages are equal."""
    times = stage_times(trace_path)
    return sum(times) + (m - 1) * max(times)


def draw(trace_path: str, png_path: str, title: str, step_seconds: float) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_rank = spans(trace_path)
    end = max(e["ts"] + e["dur"] for events in by_rank.values() for e in events)
    start = end - 2 * step_seconds * 1e6  # the last two steps
    colors = {"forward": "#4c72b0", "loss": "#4c72b0", "backward": "#55a868"}  # the rest: send/recv, grey
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(by_rank)))
    for rank, events in sorted(by_rank.items()):
        for e in events:
            if e["ts"] >= start:
                ax.broken_barh([((e["ts"] - start) / 1e3, e["dur"] / 1e3)], (rank - 0.4, 0.8),
                               facecolors=colors.get(e["cat"], "#c0c0c0"))
    ax.set_yticks(sorted(by_rank), [f"rank {r}" for r in sorted(by_rank)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue: forward, green: backward, grey: send/recv, white: idle)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return True


def chosen(variants: dict, reference: str, asked: str | None) -> dict:
    """The variants --variants names, and the reference every ratio is taken against (it always runs)."""
    if not asked:
        return variants
    unknown = set(asked.split(",")) - set(variants)
    if unknown:
        sys.exit(f"benchmark: error: --variants: unknown {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(variants)}")
    return {k: v for k, v in variants.items() if k in {reference, *asked.split(",")}}


def main(args):
    os.makedirs(args.out, exist_ok=True)
    p, m = args.ranks, args.microbatches
    with tempfile.TemporaryDirectory() as workdir:
        if args.sweep:
            return sweep(args, workdir)
        if args.dp > 1:
            return data_parallel(args, workdir)
        if args.splits:
            return splits(args, workdir)
        variants = chosen({k: v for k, v in VARIANTS.items() if os.path.isfile(os.path.join(ROOT, v[0]))}, "gpipe",
                          args.variants)
        results = {name: {"step_times": []} for name in variants}
        for repeat in range(args.repeats):
            for name, (script, schedule) in variants.items():
                last = repeat == args.repeats - 1
                trace = os.path.join(args.out, re.sub(r"[^\w]+", "_", name).strip("_") + ".trace.json")
                summary, stdout = run(args, script, schedule, args.steps, workdir,
                                      extra=["--trace", os.path.abspath(trace)] if last else [])
                r = results[name]
                r["step_times"].append(summary["median_step_time"])
                r["tokens_per_s"] = summary["tokens_per_s"]
                if last and (found := BUBBLE.search(stdout)):
                    r["bubble"], r["comm_share"] = float(found.group(1)) / 100, float(found.group(2)) / 100
                    r["trace"], r["traced_step_time"] = trace, summary["median_step_time"]
                print(f"repeat {repeat + 1}/{args.repeats} {name}: median step "
                      f"{summary['median_step_time'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        for name, (script, schedule) in variants.items():
            summary, _ = run(args, script, schedule, 3, workdir, extra=["--measure-activations"])
            results[name]["activation_bytes_per_rank"] = summary["activation_bytes_per_rank"]

    base = statistics.median(results["gpipe"]["step_times"])
    gpipe_act = results["gpipe"]["activation_bytes_per_rank"][0]
    lines = [f"{p} ranks, {m} microbatches, batch {args.batch_size} x {args.seq_len} tokens, {args.repeats} "
             f"alternating runs of {args.steps} steps per variant (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', '1')}). GPipe's theoretical bubble (p-1)/(m+p-1) = "
             f"{(p - 1) / (m + p - 1):.1%}.", "",
             "| variant | median step (ms) | vs gpipe | tokens/s | bubble (measured) | in send/recv "
             "| peak activations per stage (MiB) | stage 0 vs gpipe |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes_per_rank"])
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('bubble', float('nan')):.1%} | {r.get('comm_share', float('nan')):.1%} | {mib} | "
                     f"{r['activation_bytes_per_rank'][0] / gpipe_act:.2f} |")
        if "trace" in r and draw(r["trace"], r["trace"].replace(".trace.json", ".png"), name, median):
            r["picture"] = r["trace"].replace(".trace.json", ".png")
    if "trace" in results["gpipe"]:  # step, t_f and t_b all from the one traced run
        ideal = ideal_gpipe_step(results["gpipe"]["trace"], p, m)
        step = results["gpipe"]["traced_step_time"]
        lines += ["", f"GPipe step vs the bubble-limited ideal (m + p - 1) x (t_f + t_b) of the slowest stage, "
                      f"timed in the same run: {step * 1e3:.1f} ms / {ideal * 1e3:.1f} ms = {step / ideal:.2f}"]
        bound = unequal_stages_bound(results["gpipe"]["trace"], m)
        lines.append(f"Against the tighter bound for unequal stages, sum of t_f + t_b + (m - 1) x the slowest's: "
                     f"{step * 1e3:.1f} ms / {bound * 1e3:.1f} ms = {step / bound:.2f}")
    for name in ("gpipe", "1f1b"):  # --plan's replay, fed the stage times of the same traced run
        if "trace" in results.get(name, {}):
            replay = replayed(results[name]["trace"], name, m)
            results[name]["replay"] = replay
            lines.append(f"{name}: plan.py's replay of its order with this run's stage times: step "
                         f"{replay['step'] * 1e3:.1f} ms (traced {results[name]['traced_step_time'] * 1e3:.1f} ms, "
                         f"{results[name]['traced_step_time'] / replay['step']:.2f} x), bubble {replay['bubble']:.1%} "
                         f"(measured {results[name]['bubble']:.1%})")
    if "1f1b" in results:
        ratio = results["1f1b"]["activation_bytes_per_rank"][0] / gpipe_act
        lines.append(f"Stage-0 activations, 1F1B / GPipe = {ratio:.3f}; p/m = {p / m:.3f} "
                     f"({(ratio / (p / m) - 1):+.0%})")
    finish(args, "\n".join(lines), results)


def sweep(args, workdir):
    """GPipe step time against the microbatch count, next to the bubble model (m + p - 1) / m, and next to
    the bound that the stage times measured in the same run give."""
    p, times, bounds = args.ranks, {}, {}
    for repeat in range(args.repeats):
        last = repeat == args.repeats - 1
        for m in args.sweep_microbatches:
            trace = os.path.join(os.path.abspath(args.out), f"sweep_m{m}.trace.json")
            summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, microbatches=m,
                             extra=["--trace", trace] if last else [])
            times.setdefault(m, []).append(summary["median_step_time"])
            if last:
                bounds[m] = (summary["median_step_time"], unequal_stages_bound(trace, m))
            print(f"repeat {repeat + 1}/{args.repeats} m={m}: {summary['median_step_time'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
    top = max(times)
    ref = statistics.median(times[top]) / ((top + p - 1) / top)
    lines = [f"GPipe, {p} ranks, batch {args.batch_size} x {args.seq_len}: step time vs microbatches m. Model: "
             f"T(m) = T_work x (m + p - 1) / m (bubble (p-1)/(m+p-1)), T_work fitted at m = {top}. Bound: "
             f"sum of the stages' t_f + t_b + (m - 1) x the slowest's, timed in the last run at each m.", "",
             "| m | bubble (p-1)/(m+p-1) | measured step (ms) | model (ms) | measured / model "
             "| traced step (ms) | bound (ms) | traced / bound |", "|---|---|---|---|---|---|---|---|"]
    for m, t in times.items():
        measured, predicted = statistics.median(t), ref * (m + p - 1) / m
        traced, bound = bounds[m]
        lines.append(f"| {m} | {(p - 1) / (m + p - 1):.1%} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
                     f"{measured / predicted:.2f} | {traced * 1e3:.1f} | {bound * 1e3:.1f} | {traced / bound:.2f} |")
    finish(args, "\n".join(lines), {str(m): t for m, t in times.items()}, name="sweep")


def data_parallel(args, workdir):
    """--ranks pipeline stages alone, then the same stages x --dp replicas (FSDP2), at the same global batch,
    alternating: step time, and the bytes of parameters, gradients and AdamW state each rank holds."""
    p, dp = args.ranks, args.dp
    layouts = {f"{p} stages": (p, []), f"{p} stages x {dp} replicas": (p * dp, ["--dp", str(dp)])}
    results = {name: {"step_times": []} for name in layouts}
    for repeat in range(args.repeats):
        for name, (ranks, extra) in layouts.items():
            summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, extra=extra, ranks=ranks)
            results[name]["step_times"].append(summary["median_step_time"])
            results[name]["summary"] = summary
            print(f"repeat {repeat + 1}/{args.repeats} {name}: median step {summary['median_step_time'] * 1e3:.1f} "
                  "ms", file=sys.stderr, flush=True)
    base = statistics.median(results[f"{p} stages"]["step_times"])
    lines = [f"GPipe, {p} stages, batch {args.batch_size} x {args.seq_len} (global), {args.microbatches} microbatches "
             f"per replica, {args.repeats} alternating runs of {args.steps} steps; {os.cpu_count()} CPU cores shared "
             "by all processes.", "",
             "| layout | processes | median step (ms) | vs no replicas | tokens/s | params per rank (MiB) "
             "| grads per rank (MiB) | AdamW state per rank (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        held = [", ".join(f"{b / 2**20:.2f}" for b in r["summary"][f"{kind}_bytes_per_rank"])
                for kind in ("param", "grad", "optimizer")]
        lines.append(f"| {name} | {layouts[name][0]} | {median * 1e3:.1f} | {median / base:.2f} | "
                     f"{r['summary']['tokens_per_s']:.0f} | {' | '.join(held)} |")
    finish(args, "\n".join(lines), results, name="data_parallel")


def splits(args, workdir):
    """One process holding the whole model, then --ranks stages cut evenly and balanced by estimated cost; then
    the balanced split with activation checkpointing and with --compile; all GPipe, alternating run after run.
    Speedup over one process, as a fraction of the ideal p m / (m + p - 1)."""
    p, m = args.ranks, args.microbatches
    variants = {"one process": (1, []), "even": (p, ["--split", "even"]), "balanced": (p, ["--split", "balanced"]),
                "balanced + activation checkpointing": (p, ["--activation-checkpointing"]),
                "balanced + compile": (p, ["--compile"])}
    variants = chosen(variants, "one process", args.variants)
    results = {name: {"step_times": []} for name in variants}
    for repeat in range(args.repeats):
        for name, (ranks, extra) in variants.items():
            trace = os.path.abspath(os.path.join(args.out, re.sub(r"[^\w]+", "_", name).strip("_") + ".trace.json"))
            traced = repeat == args.repeats - 1 and ranks > 1  # the last run: each stage's own times
            summary, stdout = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, ranks=ranks,
                                  extra=[*extra, *(["--trace", trace] if traced else [])])
            results[name]["step_times"].append(summary["median_step_time"])
            if traced:
                results[name]["trace"], results[name]["traced_step_time"] = trace, summary["median_step_time"]
            results[name]["layout"] = next((line.split(": ", 2)[-1].split(" | ")[0] for line in stdout.splitlines()
                                            if line.startswith("model ")), "")
            print(f"repeat {repeat + 1}/{args.repeats} {name}: median step {summary['median_step_time'] * 1e3:.1f} "
                  "ms", file=sys.stderr, flush=True)
    for name, (ranks, extra) in variants.items():  # untimed: the saved-tensor hooks slow a step down
        summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", 3, workdir, extra=[*extra, "--measure-activations"],
                         ranks=ranks)
        results[name]["activation_bytes_per_rank"] = summary["activation_bytes_per_rank"]
    one = statistics.median(results["one process"]["step_times"])
    ideal = p * m / (m + p - 1)
    lines = [f"GPipe, {m} microbatches, batch {args.batch_size} x {args.seq_len}, {args.repeats} alternating runs of "
             f"{args.steps} steps (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}); ideal speedup of "
             f"{p} stages over one process p m / (m + p - 1) = {ideal:.2f}.", "",
             "| variant | median step (ms) | speedup over one process | fraction of the ideal | stage t_f + t_b per "
             "microbatch (ms, traced) | peak activations per stage (MiB) | layout |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        speedup = one / median
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes_per_rank"])
        stage_ms = ", ".join(f"{t * 1e3:.1f}" for t in stage_times(r["trace"])) if "trace" in r else "-"
        lines.append(f"| {name} | {median * 1e3:.1f} | {speedup:.2f} | "
                     f"{speedup / ideal if name != 'one process' else 1 / ideal:.2f} | {stage_ms} | {mib} | "
                     f"{r['layout']} |")
    lines.append("")
    for name, r in results.items():  # --plan's replay of GPipe's order, fed the stage times of the traced run
        if "trace" in r:
            replay, traced = replayed(r["trace"], "gpipe", m)["step"], r["traced_step_time"]
            lines.append(f"{name}: plan.py's replay with the traced run's stage times: step {replay * 1e3:.1f} ms "
                         f"(traced {traced * 1e3:.1f} ms, {traced / replay:.2f} x)")
    finish(args, "\n".join(lines), results, name="splits")


def finish(args, table: str, results: dict, name: str = "results") -> None:
    print(table)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="processes per run (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="steps per timed run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (default: %(default)s)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of (gpipe always runs): " + ", ".join(VARIANTS))
    parser.add_argument("--sweep", action="store_true", help="time GPipe against the microbatch count instead")
    parser.add_argument("--sweep-microbatches", default="1,2,4,8,16",
                        help="the microbatch counts --sweep runs (default: %(default)s)")
    parser.add_argument("--splits", action="store_true",
                        help="compare one process with --ranks stages split evenly and balanced by cost, and the "
                             "cost of activation checkpointing and --compile, instead")
    parser.add_argument("--dp", type=int, default=1,
                        help="compare --ranks stages alone with --ranks stages x DP data-parallel replicas "
                             "(FSDP2) at the same global batch instead")
    parser.add_argument("--out", default="bench", help="output folder (default: %(default)s)")
    parser.add_argument("script_args", nargs="*", help="more flags for every run, after --")
    args = parser.parse_args()
    # Every run's first step is left out of its median and of its trace: a run needs a second step.
    if args.repeats < 1 or args.steps < 2 or args.dp < 1:
        parser.error("--repeats and --dp must be at least 1 and --steps at least 2")
    try:
        args.sweep_microbatches = [int(m) for m in args.sweep_microbatches.split(",")]
    except ValueError:
        parser.error(f"--sweep-microbatches: {args.sweep_microbatches!r} is not a comma-separated list of counts")
    main(args)
