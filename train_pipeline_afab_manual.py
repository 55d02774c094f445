"""Pretrain a Llama model with a pipeline written by hand over torch.distributed send/recv: AFAB and 1F1B.

    python prepare_data.py                                                     # once: the default data, into data/
    torchrun --nproc_per_node 3 train_pipeline_afab_manual.py                  # All-Forward-All-Backward
    torchrun --nproc_per_node 3 train_pipeline_afab_manual.py --schedule 1f1b  # one forward, one backward
    torchrun --nproc_per_node 4 train_pipeline_afab_manual.py --dp 2           # 2 stages x 2 replicas
    torchrun --nproc_per_node 4 train_pipeline_afab_manual.py --tp 2           # 2 stages x 2 tensor-parallel

What torch.distributed.pipelining does, by hand: each rank keeps a slice of the layers and passes activations
forward, gradients back. Needs model.py, checkpoint.py. The functions keep the calls of the torch-pipeline-
parallelism guide (users test them): partition_model(model, rank, world_size) with .layers, forward_stage(partition,
hidden_states), train_step_pipeline_afab, _1f1b, eval_step_pipeline(model, inputs, targets, device, dtype)."""

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tqdm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import record_function

import checkpoint
from checkpoint import Parser, ScheduleChoices, UsageError, collective_errors, number, whole
from model import (PRESETS, LlamaForPretraining, TiedEmbedding, VocabParallel, attention_mask, chunk_lengths,
                   chunked_loss, clip_grad_norm_, config_from_preset, cut_sequences, describe_layout, document_mask,
                   document_positions, estimated_costs, even, groups_of, layout, loss_chunks, materialize, parallelize,
                   synchronize)

# ----------------------------------------------------------------------------------------------------------
# Flags: the same names and meanings in every script of the collection

def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(PRESETS), help="model preset (default: tiny on CPU, small on GPU)")
    g.add_argument("--layers", type=whole(1), help="decoder layers (default: the preset's)")
    g.add_argument("--init-from", metavar="DIR", help="start a new run from a Hugging Face Llama directory or a "
                   "checkpoint of this project, its tokenizer the data's (default: none: new weights)")
    g = p.add_argument_group("training")
    g.add_argument("--data", default="data", help="data prepared by prepare_data.py")
    g.add_argument("--steps", type=whole(0), default=300, run=True, help="optimizer steps; 0: only evaluate")
    g.add_argument("--batch-size", type=whole(1), default=16, run=True,
                   help="sequences per optimizer step, all replicas")
    g.add_argument("--microbatches", type=whole(1), default=4, help="per replica and schedule step, of its rows")
    g.add_argument("--accumulate", type=whole(1), default=1, help="schedule steps per optimizer step, each of "
                   "--microbatches microbatches per replica: a bigger --batch-size in the same memory")
    g.add_argument("--seq-len", type=whole(1), default=128, run=True, help="tokens per sequence")
    g.add_argument("--document-masking", action="store_true", run=True, help="attention, positions per document")
    g.add_argument("--lr", type=number(positive=True), default=3e-3, run=True, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=whole(0), default=30, run=True, help="linear, then cosine to 10%% of --lr")
    g.add_argument("--weight-decay", type=number(positive=False), default=0.1, run=True, help="AdamW's, of matrices")
    g.add_argument("--grad-clip", type=number(positive=False), default=1.0, run=True, help="of the model; 0: none")
    g.add_argument("--seed", type=int, default=0, run=True, help="of the weights and the data order")
    g.add_argument("--eval-every", type=whole(0), default=100, help="held-out loss every N steps, at the end; 0: off")
    g.add_argument("--eval-batches", type=whole(1), help="held-out batches per evaluation (default: up to 4, as "
                   "many as --data holds)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--schedule", choices=ScheduleChoices(["afab", "1f1b"]), default="afab", help="pipeline schedule")
    g.add_argument("--split", default="balanced", help="layers per stage: balanced (by estimated compute), even, "
                   "or counts such as 5,1 or 0,3,3,0 (a first or last 0: the embedding, or the head, alone)")
    g.add_argument("--dp", type=whole(1), default=1, help="data-parallel replicas of the pipeline (FSDP2)")
    g.add_argument("--tp", type=whole(1), default=1, help="tensor-parallel ranks per stage (inside a node)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tp: the residual stream, the norms and what crosses stages sharded by sequence")
    g.add_argument("--loss-chunks", type=whole(0), default=0, help="pieces of the sequence the loss takes at a "
                   "time, recomputed in backward; 0: as few as keep a piece's fp32 logits within 256 MiB")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", type=checkpoint.checkpointing,
                   help="full (the bare flag), selective (all but matmuls, attention), none, or per stage: 4,2,0,0")
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    g.add_argument("--seq-chunks", type=whole(1), default=1, help="cut each sequence into this many chunks that flow "
                   "through the pipeline as microbatches (Seq1F1B: the first stage holds p + S - 1 chunks instead of "
                   "p sequences); 1: whole sequences")
    g.add_argument("--vocab-parallel", action="store_true", help="embedding, head, loss by vocabulary on all stages")
    g.add_argument("--chunk-split", choices=["even", "compute"], default="even", help="--seq-chunks' lengths: even, "
                   "or of equal compute (later chunks shorter: attention reads each token's whole prefix)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", default="checkpoints", help="saved to and resumed from")
    g.add_argument("--checkpoint-every", type=whole(0), default=0, help="save every N steps; 0: at the end only")
    g.add_argument("--keep-checkpoints", type=whole(1), default=3, help="the newest K complete ones are kept")
    g.add_argument("--async-checkpoint", action="store_true", help="periodic saves written while training goes on")
    g.add_argument("--fresh", action="store_true", help="start at step 0; move --checkpoint-dir's checkpoints aside")
    g.add_argument("--metrics", help="write one JSON line per step, and a summary, to this file (default: none)")
    g.add_argument("--trace", metavar="DIR", help="Chrome traces of the last 3 steps: DIR/rankN.json (default: none)")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL if there is a GPU, else the CPU with gloo")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on a GPU that "
                   "has it, else fp32; bf16: autocast, FSDP gathers bf16; weights, AdamW, loss, gradient sums fp32")
    g.add_argument("--timeout", type=checkpoint.seconds, default=600, help="seconds a rank waits for its peers")
    return p


# ----------------------------------------------------------------------------------------------------------
# The run, in order: the sections below follow it

def main(args):
    env = launch_env(args.device, args.precision)
    init_distributed(env, args.timeout)
    say = print if env.rank == 0 else (lambda *a, **k: None)
    run = checkpoint.Run(args, env.rank, env.world_size, say)  # this job, the checkpoint it continues, saves
    args.dp, args.split = run.relayout(1)  # one stage per rank; torchrun restarted the job on other processes?
    check_args(args, env.world_size, env.device.type, run.preset_model())
    mesh = init_device_mesh(env.device.type, (env.world_size // (args.dp * args.tp), args.dp, args.tp),
                            mesh_dim_names=("pp", "dp", "tp"))  # tp innermost: a layer's all-reduces in a node
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()  # this rank's place along the pipeline,
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()  # among its stage's replicas,
    tp_rank, tp = mesh["tp"].get_local_rank(), mesh["tp"].size()  # and in its stage's tensor-parallel group

    # --- the data, what the run will write (paths, the lock, the same run as its checkpoints?), the model
    with collective_errors():
        meta, batches, held_out = open_data(args)
    run.check(meta)
    num_stages, has_first, has_last = pp, pp_rank == 0, pp_rank == pp - 1
    with collective_errors():
        config, name = run.model_config(env.device.type)
        layers, lengths = stage_layout(config, num_stages, args)
    microbatch = (args.batch_size // (dp * args.microbatches * args.accumulate), args.seq_len)  # of a replica
    chunks = loss_chunks(args.loss_chunks, config, microbatch, tp)

    # --- the split: this rank's slice trimmed on meta; tensor parallelism, checkpointing, compile, FSDP2; its shards
    with torch.device("meta"):
        model = LlamaForPretraining(config)  # with one stage, a tied head is the embedding's (else TiedEmbedding)
    partition = partition_model(model, pp_rank, pp, mesh.get_group("pp"), layers, True, args.vocab_parallel and mesh)
    parallelize([model], mesh, env.dtype, args.sequence_parallel, args.activation_checkpointing, args.compile,
                [pp_rank])  # its stage: checkpointed as --activation-checkpointing's entry for it says
    materialize([model], config, env.device, args.seed)  # a shard at a time: the full model's weights, any layout
    partition.sequence_shards = tp if args.sequence_parallel else 1  # each tp rank: seq_len / tp positions

    # --- the schedule: AFAB or 1F1B by hand, over send/recv between the pipeline ranks of this replica
    window = f", {args.accumulate} x {args.microbatches} microbatches an optimizer step" if args.accumulate > 1 else ""
    costs = estimated_costs(config, args.seq_len, args.activation_checkpointing, chunks)
    say(f"model {name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size} | "
        f"{num_stages} stage(s) on {env.world_size} process(es) = {pp} pipeline x {dp} data x {tp} tensor: "
        f"{describe_layout(layers, costs, config.vocab_size * args.vocab_parallel)}"
        f" | {args.schedule}{window} by hand | {env.device.type} {str(env.dtype).removeprefix('torch.')}", flush=True)

    # --- optimizer, tied embedding, resume: from here on the same in every script
    optimizer = make_optimizer(model, args)
    tied = TiedEmbedding(model, config, mesh, has_first, has_last)
    step, position = run.resume(model, optimizer, config)
    if position is not None:
        batches.load_state_dict(position)
    reports = has_last and dp_rank == tp_rank == 0  # one last-stage rank prints the loss and writes --metrics
    # Resumed, --metrics drops the rows after the checkpoint; with nothing left to train it stays as it was.
    metrics = checkpoint.Metrics(args.metrics, step) if reports and (step < args.steps or not args.steps) else None

    def through_pipeline(schedule, inputs, targets, part=0, parts=1, **window):  # this replica's rows (their
        share, m = args.batch_size // (dp * parts), args.microbatches  # part-th of parts) in, as m microbatches
        rows = slice((dp_rank * parts + part) * share, (dp_rank * parts + part + 1) * share)  # each sequence in
        inputs = inputs[rows].to(env.device) if has_first or partition.vocab or args.document_masking else None
        positions = document_positions(inputs, meta["bos_id"]) if args.document_masking else None  # chunks of
        targets = targets[rows].to(env.device) if has_last or partition.vocab else None  # lengths; the loss, the
        mbs = [x.chunk(m) if x is not None else [None] * m for x in (inputs, targets, positions)]  # replicas' mean, out
        with compute(env, tp):  # in the computation's dtype between stages (model.cast_between_stages casts to it)
            loss = schedule(partition, *mbs[:2], env.device, env.dtype, loss_chunks=chunks, positions=mbs[2],
                            shape=microbatch, lengths=lengths, **window)
        if has_last and dp > 1:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= dp
        return loss

    def evaluate(at_step: int) -> None:
        held_out.load_state_dict({"epoch": 0, "index": 0})  # the same held-out batches every time
        evaluated = [held_out.next() for _ in range(args.eval_batches)]  # each in --accumulate parts, as in training:
        losses = [through_pipeline(eval_step_pipeline, *batch, part, args.accumulate)  # the microbatches expected
                  for batch in evaluated for part in range(args.accumulate)]
        if metrics is not None:
            loss = torch.stack(losses).mean().item()
            metrics.write({"eval": {"step": at_step, "loss": loss, "perplexity": math.exp(min(loss, 700)),
                                    "batches": args.eval_batches}})
            tqdm.tqdm.write(f"eval at step {at_step}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f}")

    if not args.steps or (args.eval_every and 0 < step < args.steps and step % args.eval_every == 0):
        evaluate(step)  # --steps 0: only this; resumed where one was due: the stopped (or killed) run saved first
    if step >= args.steps:
        return

    # --- the training loop; --trace: each rank's torch.profiler trace of the last 3 steps (see benchmark.py)
    profiler = checkpoint.profiler(args, env, step, config, layers, chunks)  # with what it measured: plan.py --trace
    tokens_per_step, step_times = args.batch_size * args.seq_len, []
    dist.barrier()
    with tqdm.tqdm(total=args.steps, initial=step, disable=not reports, unit="step", mininterval=1.0) as bar, profiler:
        while step < args.steps:
            step += 1
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            synchronize(env.device)  # time the step's work, not its launch
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batch, k = batches.next(), args.accumulate  # an optimizer step's rows: k schedule steps, a part each
            losses = [through_pipeline(SCHEDULES[args.schedule], *batch, i, k, window=(i, k)) for i in range(k)]
            loss = sum(losses) / k if has_last else None  # the mean over all k x m microbatches, as at k = 1
            tied.sync_grads()
            grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip, tied.copies, tp)
            optimizer.step()
            synchronize(env.device)
            step_times.append(time.perf_counter() - started)
            if args.trace:
                profiler.step()
            if metrics is not None:
                metrics.write({"step": step, "loss": loss.item(), "lr": lr, "tokens": step * tokens_per_step,
                               "step_time": step_times[-1], "tokens_per_s": tokens_per_step / step_times[-1],
                               "grad_norm": grad_norm.item()})
                bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens_per_step / step_times[-1]:.0f}",
                                refresh=False)
                bar.update()
            # Saved before evaluating: whatever happens in an evaluation, this step's work is kept (and a resumed
            # run evaluates it). A stop asked of any rank, before the last step: every rank saves this step and stops.
            stop = checkpoint.stop_requested() if step < args.steps else None
            saved = run.save_if_due(step, batches.state_dict(), stop)
            if saved and reports:  # one rank prints the loop's lines: two ranks' lines never mix
                bar.write(saved)
            if stop:
                break
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                evaluate(step)
    checkpoint.summary(env, step_times, tokens_per_step, config, args, metrics)


# ----------------------------------------------------------------------------------------------------------
# Checks of the flags, before any work

def check_args(args, world_size: int, device_type: str, preset: bool) -> None:
    """What the flags alone rule out, checked alike on every rank before any work."""
    group = args.dp * args.tp  # the processes of one stage: its replicas x its tensor-parallel ranks
    if world_size % group:
        raise UsageError(f"--dp {args.dp} x --tp {args.tp}: {world_size} processes do not divide into stages of "
                         f"{group}; start a multiple of {group} (pipeline ranks x dp x tp)", on_every_rank=True)
    if args.batch_size % (args.dp * args.microbatches * args.accumulate):
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --dp {args.dp} x --microbatches "
                         f"{args.microbatches} x --accumulate {args.accumulate}; give a multiple of "
                         f"{args.dp * args.microbatches * args.accumulate}", on_every_rank=True)
    if args.tp > 1 and args.sequence_parallel and args.seq_len % args.tp:
        raise UsageError(f"--seq-len {args.seq_len} is not divisible by --tp {args.tp}: with sequence parallelism each "
                         f"tensor-parallel rank holds seq_len / tp positions; use a multiple of {args.tp}, or add "
                         "--no-sequence-parallel", on_every_rank=True)
    if args.compile and args.tp > 1:  # tried
        raise UsageError("--compile with --tp: torch 2.13's compiled tensor-parallel layers fail in backward; "
                         "leave --compile out", on_every_rank=True)
    if preset:  # the model's shape is --model's (not a checkpoint's): its layout can be checked already
        preset = config_from_preset(checkpoint.model_preset(args.model, device_type), 0, args.layers)
        stage_layout(preset, world_size // group, args)


def stage_layout(config, num_stages: int, args) -> tuple[list[range], list[int]]:
    """The layers of each stage (--split) and the lengths of a sequence's chunks, once the model's shape is known."""
    microbatch = (args.batch_size // (args.dp * args.microbatches * args.accumulate), args.seq_len)
    try:
        return (layout(args.split, config, num_stages, args.seq_len, args.activation_checkpointing,
                       loss_chunks(args.loss_chunks, config, microbatch, args.tp), args.tp, args.vocab_parallel),
                chunk_lengths(args.seq_len, args.seq_chunks, config, args.chunk_split,
                              args.tp if args.sequence_parallel else 1))  # a chunk's positions shard tp ways
    except ValueError as e:
        raise UsageError(str(e), on_every_rank=True) from None


# ----------------------------------------------------------------------------------------------------------
# Processes, devices and the mesh

@dataclasses.dataclass
class Env:
    rank: int
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    dtype: torch.dtype  # of the computation (--precision): bf16 autocast, or fp32; weights and AdamW stay fp32
    restart: int  # how often torchrun --max-restarts has restarted this job


def launch_env(device_flag: str, precision: str) -> Env:
    """What torchrun set (or one process); the one place that picks the device and the dtype."""
    cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: no GPU is visible; use --device cpu")
    if cuda and (local_world := int(os.environ.get("LOCAL_WORLD_SIZE", 1))) > torch.cuda.device_count():
        raise UsageError(f"--device cuda: {local_world} processes on this node but {torch.cuda.device_count()} "
                         "GPUs (NCCL takes one per process); start one per GPU or use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # first: a CUDA call makes a context on the current GPU, else on GPU 0 (in every rank)
        torch.cuda.set_device(device)
    bf16 = precision == "bf16" or (precision == "auto" and cuda and torch.cuda.is_bf16_supported(False))
    if bf16 and cuda and not torch.cuda.is_bf16_supported(False):  # False: Ampere or newer, not emulated
        raise UsageError(f"--precision bf16: {torch.cuda.get_device_name(device)} lacks bf16; use --precision fp32")
    return Env(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), device,
               torch.bfloat16 if bf16 else torch.float32, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))


def init_distributed(env: Env, timeout_s: float) -> None:
    """Join the other processes (torchrun's, or a group of one): the world that main's mesh divides."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    bind = {"device_id": env.device} if env.device.type == "cuda" else {}  # NCCL's communicators made at once
    if "MASTER_ADDR" in os.environ:  # started by torchrun
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's store, kept across restarts:
            store = dist.PrefixStore(f"attempt{env.restart}", store)  # the dead processes' addresses are in it
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **bind)
    else:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bind)


def compute(env: Env, tp: int):
    """Every forward and backward's context: bf16 autocast on GPU; loss_parallel with tp (sharded logits)."""
    stack = contextlib.ExitStack()
    if env.dtype != torch.float32:
        stack.enter_context(torch.autocast(env.device.type, env.dtype))
    if tp > 1:
        stack.enter_context(loss_parallel())
    return stack


# ----------------------------------------------------------------------------------------------------------
# Data: windows of the token files prepare_data.py wrote, in a seeded order that a checkpoint can resume

class Batches:
    """Batches of windows of seq_len + 1 tokens from a split's token files, in an order drawn from (seed, epoch).
    Every rank reads the whole global batch: the position is the run's on any layout."""

    def __init__(self, directory: str, meta: dict, split: str, seq_len: int, batch_size: int, seed: int,
                 shuffle: bool = True):
        self.files = [np.memmap(os.path.join(directory, f), dtype=meta["dtype"], mode="r")
                      for f in meta[split]["files"]]
        self.starts = np.cumsum([0] + [(len(tokens) - 1) // seq_len for tokens in self.files])  # windows before
        self.num_windows = int(self.starts[-1])
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.load_state_dict({"epoch": 0, "index": 0})

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = []
        for _ in range(self.batch_size):
            if self.index == self.num_windows:
                self.load_state_dict({"epoch": self.epoch + 1, "index": 0})
            window = int(self.order[self.index])
            self.index += 1
            file = int(np.searchsorted(self.starts, window, side="right")) - 1
            start = (window - int(self.starts[file])) * self.seq_len
            windows.append(torch.from_numpy(self.files[file][start:start + self.seq_len + 1].astype(np.int64)))
        batch = torch.stack(windows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.order = (torch.randperm(self.num_windows, generator=generator) if self.shuffle
                      else torch.arange(self.num_windows))


def open_data(args) -> tuple[dict, Batches, Batches]:
    """The prepared data's meta.json, the training batches, and the held-out ones (the same each evaluation)."""
    meta = checkpoint.read_data_meta(args.data)
    train = Batches(args.data, meta, "train", args.seq_len, args.batch_size, args.seed)
    held_out = Batches(args.data, meta, "val", args.seq_len, args.batch_size, 0, shuffle=False)
    if train.num_windows < 1:
        raise UsageError(f"--seq-len {args.seq_len}: --data {args.data} holds {sum(meta['train']['tokens'])} "
                         "training tokens, less than one window of --seq-len + 1; use a shorter --seq-len")
    args.eval_batches = checkpoint.eval_batches(args, held_out.num_windows)
    return meta, train, held_out


# ----------------------------------------------------------------------------------------------------------
# The split: this rank's slice of the model, and how to run it

@dataclasses.dataclass
class Partition:
    """One pipeline rank's part of a model, a view of its modules: the model stays whole unless trimmed to it."""
    model: nn.Module  # model.py's LlamaForPretraining, or a Hugging Face LlamaForCausalLM
    rank: int  # this stage, counted along the pipeline
    world_size: int  # the pipeline's stages
    layers: nn.ModuleDict  # this rank's decoder layers by global index ("4" is layer 4 on any stage, in checkpoints)
    group: dist.ProcessGroup | None = None  # the pipeline's ranks; None: the default group is the pipeline
    trimmed: bool = False  # the model holds this part alone: its own forward runs it
    sequence_shards: int = 1  # sequence parallelism: the stage holds 1/shards of the positions (tensor_parallel)
    vocab: VocabParallel | None = None  # --vocab-parallel: the embedding, head and loss over all the pipeline ranks


def partition_model(model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None,
                    layout: list[range] | None = None, trim: bool = False, vocab=None) -> Partition:
    """This pipeline rank's part of model.py's LlamaForPretraining or a Hugging Face LlamaForCausalLM: its layers
    (layout's, default even), the embedding on the first rank, the final norm and head on the last. The model stays
    whole, any rank's part may be taken of it, unless trim (model.py's): then it is cut down to the part in place."""
    base = getattr(model, "base_model", None)  # the decoder stack under the head (Hugging Face's model.model)
    if not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise TypeError(f"partition_model: unsupported model {type(model).__name__}")
    keep = (layout or even(model.config.num_hidden_layers, world_size))[rank]
    layers = base.layers.items() if isinstance(base.layers, nn.ModuleDict) else enumerate(base.layers)  # HF: a list
    layers = nn.ModuleDict({str(i): layer for i, layer in layers if int(i) in keep})
    if len(layers) != len(keep):
        raise ValueError("partition_model: the model was already trimmed to another part")
    if trim:  # main's, on the meta device: only the stage is allocated, the optimizer and checkpoints take it so
        model.keep_only(keep, rank == 0, rank == world_size - 1, vocab["pp"] if vocab else None)  # vocab: the mesh
        model.head_in_loss = True  # its forward stops at the final norm, the loss applies the head (Step.forward)
    return Partition(model, rank, world_size, layers, group, trim, vocab=VocabParallel(model, vocab) if vocab else None)


def forward_stage(partition: Partition, hidden_states: torch.Tensor, positions: torch.Tensor | None = None, chunk=None):
    """This rank's part on token ids (embedded on the first rank) or hidden states; hidden states out, the head left
    to the loss. Only hidden states travel: each stage rebuilds positions and rotary tables, or takes positions."""
    model, base, rank = partition.model, partition.model.base_model, partition.rank
    if partition.trimmed:  # model.py's Llama cut down to the stage: its own forward runs FSDP2's hooks and chunks
        return model(hidden_states, positions, chunk=chunk)
    if chunk is not None:
        raise ValueError("forward_stage: sequence chunks run on a partition trimmed to its stage (trim=True)")
    h = base.embed_tokens(hidden_states) if rank == 0 and not hidden_states.is_floating_point() else hidden_states
    if isinstance(model, LlamaForPretraining):  # ours: positions and their mask, built once for all the layers
        kwargs = {"positions": positions, "mask": attention_mask(positions)} if positions is not None else {}
    else:  # Hugging Face's: the rotary (cos, sin) and an additive mask, also built once
        index = torch.arange(h.shape[1], device=h.device)[None] if positions is None else positions
        kwargs = {"position_embeddings": base.rotary_emb(h, index)}  # its eager attention masks nothing unless told
        if positions is not None or getattr(model.config, "_attn_implementation", "eager") == "eager":
            kwargs["attention_mask"] = torch.where(document_mask(index), 0.0, -torch.inf).to(h.dtype)  # -inf: unseen
    for layer in partition.layers.values():  # older transformers' layers return (hidden_states, ...)
        h = out[0] if isinstance(out := layer(h, **kwargs), tuple) else out
    return base.norm(h) if rank == partition.world_size - 1 else h


# ----------------------------------------------------------------------------------------------------------
# The schedule: point-to-point messages, and AFAB and 1F1B over them

class Step:
    """One step of AFAB or 1F1B on this rank, each forward, backward, send and receive labelled for --trace."""

    def __init__(self, model, inputs, targets, device, dtype, loss_chunks=1, positions=None, shape=None, window=(0, 1),
                 lengths=None):
        part = model if isinstance(model, Partition) else partition_model(model, dist.get_rank(), dist.get_world_size())
        self.partition, self.device, self.dtype, self.chunks, self.window = part, device, dtype, loss_chunks, window
        self.rank, self.first, self.last = part.rank, part.rank == 0, part.rank == part.world_size - 1
        # saved: microbatch -> (input, output or loss); held: sends for the next receive; sends: the last ones alone
        self.saved, self.loss, self.held, self.sends, self.passed = {}, torch.zeros((), device=device), [], [], 0
        # Sequence s of m in S chunks of lengths (model.cut_sequences) runs as microbatches s * S + j, forward in
        # order, backward last chunk first (Seq1F1B: it gives the earlier chunks' K/V their gradient); shapes: lengths'.
        m, S, sizes = len(inputs), len(lengths or [0]), [shape or x.shape for x in inputs]  # sizes: (batch, seq)
        self.items = [c for s, (x, y, p) in enumerate(zip(inputs, targets, positions or [None] * m))
                      for c in cut_sequences(x, y, p, lengths or [sizes[s][1]], s)]
        self.shapes, self.lead = [(b, n // part.sequence_shards, part.model.config.hidden_size) for b, seq in sizes
                                  for n in lengths or [seq]], (part.world_size - 1 - part.rank) * (S == 1)  # outputs
        self.microbatches, self.backwards = len(self.items), [s * S + j for s in range(m) for j in reversed(range(S))]
        self.vocab, self.items = part.vocab, part.vocab.embed_all(self.items) if part.vocab else self.items

    def message(self, op, tensor, stage: int, label, hold: bool = False) -> torch.Tensor:
        """Send (dist.isend) tensor to a stage, or receive (dist.irecv) one of that shape. NCCL does not buffer a send
        and runs a rank's calls on a communicator in issue order: a send that the rank's next receive crosses (1F1B's
        steady state) is held and goes with it in one batch_isend_irecv, which NCCL starts together, as torch's 1F1B.
        A receiving batch is waited for (wait() orders NCCL's stream, not the host); sends, once the next are issued."""
        tensor = torch.empty(tensor, dtype=self.dtype, device=self.device) if isinstance(tensor, tuple) else tensor
        self.held.append(dist.P2POp(op, tensor.contiguous(), group=self.partition.group, group_peer=stage))
        if hold:
            return tensor
        ops, self.held, alone = self.held, [], op is dist.isend
        with record_function(f"{'send' if alone else 'recv'} {label}"):
            works = dist.batch_isend_irecv(ops)
        for work in [w for w, _ in self.sends] if alone else works:  # (the sends before, once these are issued)
            work.wait()
        self.sends = [(work, ops) for work in works] if alone else self.sends
        return tensor

    def forward(self, i: int, hold: bool) -> None:  # x: a leaf that requires grad, d(loss)/d(x) left in x.grad
        c, part = self.items[i], self.partition
        x = c.inputs.to(self.device) if self.first else self.message(dist.irecv, self.shapes[i], self.rank - 1, i)
        x.requires_grad_(x.is_floating_point())  # (--vocab-parallel: the first stage's inputs embedded already)
        with record_function(f"forward {i}"):
            out = forward_stage(part, x, c.positions, c.chunk)
            if self.last and not self.vocab:  # the mean cross-entropy, chunks pieces at a time (tokens: a chunk's
                out = chunked_loss(part.model.lm_head, out, c.targets.to(self.device), self.chunks,  # divisor; pad:
                                   part.sequence_shards, c.tokens, getattr(part.model.config, "pad_token_id", None))
                self.loss += (out := out / self.microbatches).detach()  # HF's); over microbatches x steps: the mean's
                out = out / self.window[1] if self.window[1] > 1 else out  # (k = 1: nothing more, bit for bit)
        if not self.last:  # values only travel; the graph stays here in `out` for this stage's backward
            self.message(dist.isend, out.detach().to(self.dtype), self.rank + 1, i, hold)
        self.saved[i] = (x, out)

    def outputs(self, upto: int) -> None:  # --vocab-parallel: the passes before upto in order (the last stage's
        # out: a scalar to backward from), each where all ranks' messages agree (NCCL runs a rank's collectives and
        # batches on a communicator in issue order), earliest: 1F1B's pass i d = lead stages up after backward i - d
        for j in range(self.passed, min(upto, self.microbatches) if self.vocab else 0):
            ce, out = self.vocab.output(self.saved[j][1], self.items[j], self.chunks, len(self.items) * self.window[1])
            self.saved[j], self.loss, self.passed = (self.saved[j][0], out), self.loss + ce / self.microbatches, j + 1

    def backward(self, i: int, hold: bool) -> None:
        self.outputs(i + max(self.lead, 1))  # --vocab-parallel: before the receive (pass i: AFAB, Seq1F1B)
        x, out = self.saved.pop(i)  # dropping it frees this microbatch's activations after the backward
        grad = None if self.last else self.message(dist.irecv, self.shapes[i], self.rank + 1, i).to(out.dtype)
        if isinstance(model := self.partition.model, FSDPModule):
            # With replicas each backward adds into the unsharded gradient; the optimizer step's last (microbatch
            # m - 1's, chunk 0 with chunks, AFAB and 1F1B alike) alone reduce-scatters: not m (x --accumulate) times.
            for f in (model.set_requires_gradient_sync, model.set_reshard_after_backward, model.set_is_last_backward):
                f(i == self.backwards[-1] and self.window[0] == self.window[1] - 1)
        with record_function(f"backward {i}"):
            out.backward(grad)  # the last stage from its scaled loss, the others from the received gradient
        self.outputs(i + 1 + self.lead)  # --vocab-parallel: 1F1B's pass i + d, before the send (outputs)
        if not self.first:
            self.message(dist.isend, x.grad.to(self.dtype), self.rank - 1, i, hold)

    def finish(self) -> torch.Tensor | None:
        for work in [w for w, _ in self.sends] + (self.vocab.works if self.vocab else []):  # none is held: a send
            work.wait()  # is held only for a receive that follows; --vocab-parallel: a last pass's call in flight
        if self.vocab and torch.is_grad_enabled():  # the embeddings' gradients; at an optimizer step's end, averaged
            self.vocab.embed_backward(self.items, self.window[0] == self.window[1] - 1)  # over the replicas
        return self.loss if self.last else None


def train_step_pipeline_afab(model, inputs, targets, device, dtype, *, loss_chunks=1, positions=None, shape=None,
                             window=(0, 1), lengths=None):
    """All forwards, then all backwards. model: the whole model, on every rank, or a Partition; inputs, targets: lists
    of microbatches' token ids (None where unread; then shape: their (batch, seq)); dtype: of what is sent; window:
    (k, K), schedule step k of K of an optimizer step (--accumulate); lengths: of each sequence's chunks (None: whole).
    The last rank's mean microbatch loss, else None; gradients only in this rank's part, added to what they hold."""
    step = Step(model, inputs, targets, device, dtype, loss_chunks, positions, shape, window, lengths)
    for i in range(step.microbatches):
        step.forward(i, hold=False)
    step.outputs(step.microbatches)  # --vocab-parallel: every pass, between the phases (all ranks wait there)
    for i in step.backwards:
        step.backward(i, hold=False)
    return step.finish()


def train_step_pipeline_1f1b(model, inputs, targets, device, dtype, *, loss_chunks=1, positions=None, shape=None,
                             window=(0, 1), lengths=None):
    """One training step with 1F1B (PipeDream-flush; with S chunks a sequence, Seq1F1B): AFAB's arguments, result
    and gradients, but a rank holds the activations of at most world_size - rank + S - 1 (chunk) microbatches."""
    step = Step(model, inputs, targets, device, dtype, loss_chunks, positions, shape, window, lengths)
    n, backwards = step.microbatches, step.backwards  # fill the pipeline below; the last rank: a sequence's
    warmup = min(step.partition.world_size - step.rank - 1 + n // len(inputs) - 1, n)  # chunks but its last
    for i in range(warmup):
        step.forward(i, hold=False)
    for i in range(n - warmup):  # steady state: each forward followed by the next backward in order. Rank r
        step.forward(warmup + i, hold=True)  # sends activations to r + 1, then receives a gradient from it; r + 1
        step.backward(backwards[i], hold=warmup + i + 1 < n)  # sends that gradient, receives those: a batch a side
    for i in backwards[n - warmup:]:  # cooldown: drain what is still held
        step.backward(i, hold=False)
    return step.finish()


@torch.no_grad()
def eval_step_pipeline(model, inputs, targets, device, dtype, *, loss_chunks=1, positions=None, shape=None,
                       lengths=None):
    """Forward only, AFAB's arguments: the mean loss on the last rank; no activation is kept."""
    step = Step(model, inputs, targets, device, dtype, loss_chunks, positions, shape, lengths=lengths)
    for i in range(step.microbatches):
        step.forward(i, hold=False)
        step.outputs(i + 1)  # --vocab-parallel
        step.saved.pop(i)
    for module in (m for m in step.partition.model.modules() if isinstance(m, FSDPModule)):
        module.reshard()  # gathered for the forwards; no backward frees them
    return step.finish()


SCHEDULES = {"afab": train_step_pipeline_afab, "1f1b": train_step_pipeline_1f1b}


# ----------------------------------------------------------------------------------------------------------
# Training: the optimizer and its learning rate (the run's summary: checkpoint.summary)

def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    # Decay matrices only, not norm gains (the same on any split); fused: one kernel per group, CUDA or CPU.
    return torch.optim.AdamW(groups_of(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine down to 10 % of --lr: a function of the step alone, nothing to resume."""
    if step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


if __name__ == "__main__":
    checkpoint.run(main, build_parser().parse_args())
