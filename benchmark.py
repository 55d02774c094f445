"""Side-by-side benchmark of the pipeline variants on the same model, data and machine, in one run.

    OMP_NUM_THREADS=1 python benchmark.py                    # 2 ranks, 8 microbatches, tiny model
    python benchmark.py --ranks 3 --microbatches 4 --repeats 5 --out bench/

Each variant is a real training run (torchrun, CPU or GPU as the scripts choose). Runs alternate between
variants, repeat after repeat, so that drift of a shared machine hits every variant alike; the median step
time of each variant is the median over its runs of each run's median step time (first step excluded). A
separate short run per variant with --measure-activations gives the peak activation bytes per stage.
Writes a Markdown table to stdout and to OUT/results.md, and the raw numbers to OUT/results.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {  # name: (script, schedule)
    "gpipe (library)": ("train_pipeline_gpipe.py", "gpipe"),
    "afab (by hand)": ("train_pipeline_afab_manual.py", "afab"),
    "1f1b (by hand)": ("train_pipeline_afab_manual.py", "1f1b"),
}


def run_variant(args, script: str, schedule: str, steps: int, workdir: str, extra=()) -> dict:
    """One training run; returns its summary row."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           os.path.join(ROOT, script), "--schedule", schedule, "--steps", str(steps), "--warmup-steps", "2",
           "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches),
           "--seq-len", str(args.seq_len), "--metrics", metrics, "--checkpoint-dir", os.path.join(workdir, "ckpt"),
           "--fresh", *args.script_args, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark: {script} --schedule {schedule} failed:\n{result.stderr[-3000:]}")
    with open(metrics) as f:
        return [json.loads(line)["summary"] for line in f if line.startswith('{"summary"')][-1]


def main(args):
    results = {name: {"step_times": []} for name in VARIANTS}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for name, (script, schedule) in VARIANTS.items():
                summary = run_variant(args, script, schedule, args.steps, workdir)
                results[name]["step_times"].append(summary["median_step_time"])
                print(f"repeat {repeat + 1}/{args.repeats} {name}: median step "
                      f"{summary['median_step_time'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        for name, (script, schedule) in VARIANTS.items():
            summary = run_variant(args, script, schedule, 3, workdir, ["--measure-activations"])
            results[name]["activation_bytes_per_stage"] = summary["activation_bytes_per_stage"]

    p, m = args.ranks, args.microbatches
    base = statistics.median(results["gpipe (library)"]["step_times"])
    afab_activations = results["afab (by hand)"]["activation_bytes_per_stage"]
    lines = [f"{p} ranks, {m} microbatches, batch {args.batch_size} x {args.seq_len} tokens, "
             f"{args.repeats} alternating runs of {args.steps} steps per variant "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}); theoretical bubble (p-1)/(m+p-1) = "
             f"{(p - 1) / (m + p - 1):.1%}", "",
             "| variant | median step (ms) | vs library GPipe | peak activations per stage (MiB) | vs AFAB, stage 0 |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        median = statistics.median(r["step_times"])
        r["median_step_time"] = median
        mib = ", ".join(f"{b / 2**20:.2f}" for b in r["activation_bytes_per_stage"])
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.3f} | {mib} | "
                     f"{r['activation_bytes_per_stage'][0] / afab_activations[0]:.3f} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="processes (stages) per run (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (default: %(default)s)")
    parser.add_argument("--out", default="bench", help="output folder (default: %(default)s)")
    parser.add_argument("script_args", nargs="*", help="more flags for every run, after --")
    main(parser.parse_args())
