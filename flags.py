"""The command line every training script shares: the same flags, and every mistake that can be seen from the
flags alone, checked identically on every rank before any work."""

import argparse
import math
import os

import data
import split
from model import PRESETS
from runtime import FlagError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage block; --help has the rest
        self.exit(2, f"error: {message} (see --help)\n")


def _positive(text: str) -> int:
    """A whole number of at least 1 (argparse type: a bad value is one line, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser(doc: str, schedules: list[str], stages_per_rank: bool = False) -> argparse.ArgumentParser:
    p = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="model preset (default: tiny on CPU, small on GPU)")
    g.add_argument("--layers", type=int, default=None, help="override the preset's number of decoder layers")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start a new run from a model's weights: a Hugging Face Llama directory (config.json, "
                        "safetensors, usually tokenizer.json) or a checkpoint of this project (a step-N directory, "
                        "or a --checkpoint-dir: its newest). The model's shape and tokenizer come from it; "
                        "optimizer, LR schedule and data order start afresh. Ignored once --checkpoint-dir holds "
                        "checkpoints of this run (they are resumed)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300,
                   help="optimizer steps to train for; 0: only evaluate, e.g. --init-from's weights "
                        "(default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=16,
                   help="sequences per step, over all data-parallel replicas (default: %(default)s)")
    g.add_argument("--microbatches", type=int, default=4,
                   help="microbatches each replica's share of the batch is split into (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=30,
                   help="linear warmup steps, then cosine decay to 10%% of --lr (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this; 0 turns clipping off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed for weights and data order (default: %(default)s)")
    g.add_argument("--eval-every", type=int, default=0,
                   help="after every N steps and at the end, the loss and perplexity on --eval-batches held-out "
                        "batches, forward only through the pipeline; 0: never (--steps 0: once, only that) "
                        "(default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=4,
                   help="batches of --batch-size sequences per evaluation (default: %(default)s)")
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
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary of a tokenizer trained on --data (default: {data.VOCAB_SIZE}; a --tokenizer or "
                        "--init-from brings its own)")
    g.add_argument("--eval-data", default=None,
                   help="held-out data for --eval-every, in --data's syntax (default: with --data builtin, its "
                        "last documents, which are never trained on; other data needs this flag)")
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
    g = p.add_argument_group("parallelism, speed and memory")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the pipeline, each stage sharded over them with FSDP2; the "
                        "processes must be a multiple: pipeline stages = processes / dp (default: %(default)s)")
    g.add_argument("--split", default="balanced",
                   help="how the layers are cut into stages: balanced (by estimated compute, counting the head "
                        "and the loss on the last stage), even (equal layer counts), or layers per stage such as "
                        "5,1 (default: %(default)s)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each decoder layer's input for backward and recompute the rest: less "
                        "activation memory, about one more forward of compute")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (faster on GPUs; the first steps pay the compilation)")
    g.add_argument("--plan", type=_positive, default=None, metavar="PROCESSES",
                   help="print, for this many processes (stages x --dp) and the other flags, each stage's share "
                        "of the compute and bytes of parameters, gradients, AdamW state and activations, and each "
                        "schedule's step time and bubble, then exit; allocates nothing, needs no GPU or torchrun")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL and bf16 when a GPU is present, else CPU, gloo, fp32")
    g.add_argument("--timeout", type=float, default=600,
                   help="seconds a rank waits for its peers in any communication before the job stops with an "
                        "error instead of hanging (default: %(default)s)")
    return p


def model_preset(args, device_type: str) -> str:
    return args.model or ("small" if device_type == "cuda" else "tiny")


def num_layers(args, device_type: str) -> int | None:
    """The model's decoder layers: --layers, else the preset's; None while --init-from's is not read yet
    (preflight sets --layers from it)."""
    if args.layers is not None or args.init_from is not None:
        return args.layers
    return PRESETS[model_preset(args, device_type)].get("num_hidden_layers", 12)


def check_args(args, world_size: int, device_type: str) -> None:
    """Every mistake that can be seen from the flags alone, checked identically on every rank before any work.
    (What needs the files the flags name, preflight.py checks next, on every rank.)"""
    positive = {"--batch-size": args.batch_size, "--microbatches": args.microbatches, "--seq-len": args.seq_len,
                "--vocab-size": data.VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
                "--eval-batches": args.eval_batches}
    for flag, value in positive.items():
        if value < 1:
            raise FlagError(f"{flag} must be at least 1, got {value}")
    if args.keep_checkpoints < 1:
        raise FlagError(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise FlagError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    for flag, value in {"--steps": args.steps, "--warmup-steps": args.warmup_steps,
                        "--checkpoint-every": args.checkpoint_every, "--eval-every": args.eval_every}.items():
        if value < 0:
            raise FlagError(f"{flag} must be 0 or more, got {value}")
    for flag, value in {"--lr": args.lr, "--weight-decay": args.weight_decay, "--grad-clip": args.grad_clip}.items():
        if not math.isfinite(value) or value < 0 or (flag == "--lr" and value == 0):
            raise FlagError(f"{flag} must be a finite {'positive' if flag == '--lr' else 'non-negative'} "
                            f"number, got {value}")
    if args.dp < 1:
        raise FlagError(f"--dp must be at least 1, got {args.dp}")
    if world_size % args.dp:
        raise FlagError(f"--dp {args.dp}: {world_size} processes cannot be split into {args.dp} replicas; start a "
                        f"multiple of {args.dp} processes (stages x replicas) or change --dp")
    if args.batch_size % (args.dp * args.microbatches):
        raise FlagError(f"--batch-size {args.batch_size} is not divisible by --dp {args.dp} x --microbatches "
                        f"{args.microbatches}; each replica splits its equal share of the batch into the microbatches")
    split.check_split(args.split)
    if args.layers is not None and args.layers < 1:
        raise FlagError(f"--layers must be at least 1, got {args.layers}")
    if args.init_from is None:  # else the model's shape comes from there, and preflight checks it
        check_model(num_layers(args, device_type),
                    PRESETS[model_preset(args, device_type)].get("max_position_embeddings", 2048),
                    world_size // args.dp, args.seq_len)
        split.check_split(args.split, num_layers(args, device_type),
                          world_size // args.dp * split.stages_per_rank(args))
    data.check_data_spec(args.data)
    if args.eval_data is not None:
        data.check_data_spec(args.eval_data, "--eval-data")
    elif (args.eval_every or args.steps == 0) and args.data != "builtin":
        raise FlagError(f"--eval-data: needed to evaluate with --data {args.data} (a held-out part is set aside "
                        "only from builtin); give held-out files or hf: data in --data's syntax")


def check_model(num_layers: int, max_positions: int, stages: int, seq_len: int) -> None:
    """What the model's shape allows: a layer per pipeline stage, and --seq-len within its positions."""
    if stages > num_layers:
        raise FlagError(f"{stages} pipeline stages (processes / --dp) but the model has {num_layers} layers: each "
                        f"stage needs a layer; run at most {num_layers} stages, raise --dp or raise --layers")
    if seq_len > max_positions:
        raise FlagError(f"--seq-len {seq_len} exceeds the model's {max_positions} positions; "
                        f"use --seq-len {max_positions} or less")
