"""The training loss, and the held-out loss where a run evaluated it, of one or more runs, read from the files
the training scripts write with --metrics FILE, drawn into one picture: several runs overlaid, each labelled with
its file's name (as given).

    python plot.py m.jsonl                                      # loss.png
    python plot.py gpipe.jsonl 1f1b.jsonl --out compare.png     # two runs, overlaid
    watch -n 60 python plot.py m.jsonl                          # a run in progress: its file so far

Needs matplotlib (pip install matplotlib). A tool: no training script imports it.
"""

import argparse
import json
import math
import os
import sys


class UsageError(Exception):
    """A mistake of the command line or its files: one line, exit status 1."""


def read_run(path: str) -> tuple[list, list]:
    """A --metrics file's training losses [(step, loss)] and held-out losses [(step, loss)]. Its rows:
    {"step": N, "loss": L, ...} a step, {"eval": {"step": N, "loss": L, ...}} an evaluation, {"summary": ...}."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; give the files that a training script's --metrics FILE wrote") \
            from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e}); give a --metrics file") \
            from None
    lines = text.split("\n")[:-1]  # the last line is whole once it ends in a newline (a run writing it: not yet)
    train, held_out = [], []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}, line {number}: not JSON ({e.msg}); give a file that --metrics wrote") from None
        if isinstance(row, dict) and isinstance(row.get("eval"), dict):
            row, rows = row["eval"], held_out
        else:
            rows = train
        if isinstance(row, dict) and _number(row.get("step")) and _number(row.get("loss")):
            rows.append((row["step"], row["loss"]))
    if not train and not held_out:
        raise UsageError(f"{path}: no loss in it (no row {{\"step\": N, \"loss\": L}}); give a file that --metrics "
                         "wrote, of a run that trained or evaluated")
    return train, held_out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isinf(value)


def draw(runs: dict, out: str) -> list[str]:
    """Every run's training loss (a line) and held-out loss (points joined by a dashed line), in one colour per
    run, into out. Returns the legend's labels."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    kind = os.path.splitext(out)[1].lstrip(".").lower()
    if kind not in fig.canvas.get_supported_filetypes():
        plt.close(fig)
        raise UsageError(f"--out {out}: matplotlib cannot write a {kind or 'suffix-less'} file; end it in .png "
                         "(or .svg, .pdf)")
    for i, (label, (train, held_out)) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        if train:
            ax.plot(*zip(*train), color=colour, linewidth=1, label=f"{label}: training")
        if held_out:
            ax.plot(*zip(*held_out), "o--", color=colour, markersize=4, label=f"{label}: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write it ({e.strerror or e}); give another --out") from None
    finally:
        plt.close(fig)
    return [text.get_text() for text in ax.get_legend().get_texts()]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage block; --help has the rest
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE", help="--metrics files of training runs")
    p.add_argument("--out", default="loss.png", help="the picture to write (default: %(default)s)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if len(set(args.files)) < len(args.files):
            raise UsageError("a FILE is given twice; give each run once")
        if os.path.abspath(args.out) in map(os.path.abspath, args.files):
            raise UsageError(f"--out {args.out} is one of the files to read; give another --out")
        runs = {path: read_run(path) for path in args.files}
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("plot.py draws with matplotlib, which is not installed: pip install matplotlib") from None
        draw(runs, args.out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"plotted {len(runs)} run(s) into {args.out}")


if __name__ == "__main__":
    main()
