"""Pretrain a Llama model split across processes by the pipeline tracer: pipeline() + SplitPoint + build_stage.

    python prepare_data.py                                          # once: tokenize the default data into data/
    torchrun --nproc_per_node 3 train_pipeline_tracer.py            # 3 stages; tiny model on CPU, small on GPUs
    python train_pipeline_tracer.py --steps 20                      # one process, one stage
    torchrun --nproc_per_node 2 train_pipeline_tracer.py --schedule interleaved1f1b   # 2 stages per rank
    torchrun --nproc_per_node 4 train_pipeline_tracer.py --dp 2     # 2 stages x 2 data-parallel replicas

Each rank traces the full model on the meta device (torch.export: shapes only), pipeline() cuts the graph before
each stage's first layer, and the rank allocates only its own stages, under the full model's names: the losses
and checkpoints of train_pipeline_gpipe.py. Needs model.py and checkpoint.py beside it.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import tqdm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS, ScheduleZBVZeroBubble, SplitPoint, pipeline)
from torch.distributed.tensor.parallel import loss_parallel

import checkpoint
from checkpoint import Parser, ScheduleChoices, UsageError, collective_errors, number, whole
from model import (PRESETS, LlamaForPretraining, TiedEmbedding, accumulate_into, chunk_lengths, chunk_order,
                   chunked_loss, clip_grad_norm_, config_from_preset, describe_layout, document_positions,
                   estimated_costs, forward_only, groups_of, layout, loss_chunks, materialize, merge_backwards,
                   merged_stages, parallelize, read_order, step_chunks, synchronize)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
             "loopedbfs": ScheduleLoopedBFS, "interleavedzerobubble": ScheduleInterleavedZeroBubble,
             "zbvzerobubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SINGLE_STAGE = {"gpipe", "1f1b"}  # one stage per rank; the others take a list of stages
V_SHAPED = {"zbvzerobubble", "dualpipev"}  # two stages per rank: r and 2p - 1 - r

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
    g.add_argument("--schedule", choices=ScheduleChoices([*SCHEDULES, "FILE.csv"]), default="gpipe", help="the "
                   "pipeline schedule, or an order in torch's CSV form (docs/schedules-and-benchmark.md)")
    g.add_argument("--stages-per-rank", type=whole(1), help="of a looped schedule (default: 2; the others' is fixed)")
    g.add_argument("--split", default="balanced", help="layers per stage: balanced (by estimated compute), even, "
                   "or counts such as 5,1 or 0,3,3,0 (a first or last 0: the embedding, or the head, alone)")
    g.add_argument("--dp", type=whole(1), default=1, help="data-parallel replicas of the pipeline (FSDP2)")
    g.add_argument("--seq-chunks", type=whole(1), default=1, help="cut each sequence into this many chunks that flow "
                   "through the pipeline as microbatches (Seq1F1B: the first stage holds p + S - 1 chunks instead of "
                   "p sequences); 1: whole sequences")
    g.add_argument("--chunk-split", choices=["even", "compute"], default="even", help="--seq-chunks' lengths: even, "
                   "or of equal compute (later chunks shorter: attention reads each token's whole prefix)")
    g.add_argument("--tp", type=whole(1), default=1, help="tensor-parallel ranks per stage (inside a node)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tp: the residual stream, the norms and what crosses stages sharded by sequence")
    g.add_argument("--loss-chunks", type=whole(0), default=0, help="pieces of the sequence the loss takes at a "
                   "time, recomputed in backward; 0: as few as keep a piece's fp32 logits within 256 MiB")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", type=checkpoint.checkpointing,
                   help="full (the bare flag), selective (all but matmuls, attention), none, or per stage: 4,2,0,0")
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
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
    try:  # --schedule FILE.csv: the order, read and checked on every rank (model.py); its stages per rank the run's
        order = read_order(args.schedule, env.world_size, args.dp, args.tp, args.microbatches, args.stages_per_rank,
                           args.compile)
    except ValueError as e:
        raise UsageError(str(e), on_every_rank=True) from None
    args.stages_per_rank = order.per_rank if order else args.stages_per_rank or 2 - (args.schedule in SINGLE_STAGE)
    say = print if env.rank == 0 else (lambda *a, **k: None)
    run = checkpoint.Run(args, env.rank, env.world_size, say)  # this job, the checkpoint it continues, saves
    args.dp, args.split = run.relayout(args.stages_per_rank)  # torchrun restarted the job on other processes?
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
    stages = order.stages(pp_rank) if order else stage_ids(args.schedule, pp_rank, pp, args.stages_per_rank)
    num_stages, has_first, has_last = pp * len(stages), 0 in stages, pp * len(stages) - 1 in stages
    with collective_errors():
        config, name = run.model_config(env.device.type)
        layers = stage_layout(config, num_stages, args)
    microbatch = (args.batch_size // (dp * args.microbatches * args.accumulate), args.seq_len)  # of a replica
    chunks = loss_chunks(args.loss_chunks, config, (microbatch[0], args.seq_len // args.seq_chunks), tp)  # a chunk's
    shards = tp if args.sequence_parallel else 1  # sequence parallelism: each tp rank holds seq_len / tp positions
    lengths = chunk_lengths(args.seq_len, args.seq_chunks, config)  # --seq-chunks: even, checked

    # --- the split: the whole model traced, this rank's stages on meta, checkpointing, compile, FSDP2; its shards
    started = time.perf_counter()
    modules, pipe = traced_modules(config, stages, layers, microbatch, args.document_masking, args.seq_chunks)
    parallelize(modules, mesh, env.dtype, args.sequence_parallel, args.activation_checkpointing, args.compile, stages)
    materialize(modules, config, env.device, args.seed)  # a shard at a time: the full model's weights, any layout
    model = merged_stages(modules)  # the rank's parameters, for the optimizer and checkpoints

    # --- the schedule: a traced stage per stage, talking to the other pipeline ranks of this replica
    pipeline_stages = [pipeline_stage(pipe, s, env.device, mesh.get_group("pp"), env.dtype) for s in stages]
    trace_seconds = [None] * env.world_size  # the one-time cost of tracing and building, every rank's
    dist.all_gather_object(trace_seconds, time.perf_counter() - started)
    schedule, loss_fn = make_schedule(args.schedule, pipeline_stages, args.microbatches, chunks, shards,
                                      order or chunk_order(args.schedule, pp, args.microbatches, lengths))
    run_train = functools.partial(train_step, schedule, env=env, tp=tp)
    run_eval = functools.partial(eval_step, schedule, pipeline_stages, env=env, tp=tp, loss_fn=loss_fn,
                                 microbatches=args.microbatches,
                                 hidden_shape=(microbatch[0], microbatch[1] // shards, config.hidden_size))
    window = f", {args.accumulate} x {args.microbatches} microbatches an optimizer step" if args.accumulate > 1 else ""
    window += f", each sequence in {args.seq_chunks} chunks" if args.seq_chunks > 1 else ""
    say(f"model {name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size} | "
        f"{num_stages} stage(s) on {env.world_size} process(es) = {pp} pipeline x {dp} data x {tp} tensor: "
        f"{describe_layout(layers, estimated_costs(config, args.seq_len, args.activation_checkpointing, chunks))}"
        f" | {args.schedule}{window}, split by the tracer | {env.device.type} {str(env.dtype).removeprefix('torch.')}\n"
        f"traced and built the stages in {', '.join(f'{t:.2f}' for t in trace_seconds)} s (per rank)", flush=True)

    # --- optimizer, tied embedding, resume: from here on the same in every script
    optimizer = make_optimizer(model, args)
    tied = TiedEmbedding(model, config, mesh, has_first, has_last)
    step, position = run.resume(model, optimizer, config)
    if position is not None:
        batches.load_state_dict(position)
    reports = has_last and dp_rank == tp_rank == 0  # one last-stage rank prints the loss and writes --metrics
    # Resumed, --metrics drops the rows after the checkpoint; with nothing left to train it stays as it was.
    metrics = checkpoint.Metrics(args.metrics, step) if reports and (step < args.steps or not args.steps) else None

    def through_pipeline(run_step, inputs, targets, part=0, parts=1):  # this replica's rows (their part-th of
        share = args.batch_size // (dp * parts)  # parts) in; the mean loss over the replicas out
        rows = slice((dp_rank * parts + part) * share, (dp_rank * parts + part + 1) * share)
        inputs = inputs[rows].to(env.device) if has_first or args.document_masking else None  # copied where used
        documents = {"positions": document_positions(inputs, meta["bos_id"])} if args.document_masking else {}
        if args.seq_chunks > 1 and not documents:  # a traced chunk takes its sequence's positions: one stream's
            documents = {"positions": torch.arange(args.seq_len, device=env.device).expand(share, -1)}
        loss = run_step(inputs if has_first else None, targets[rows].to(env.device) if has_last else None, **documents)
        if has_last and dp > 1:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= dp
        return loss

    def evaluate(at_step: int) -> None:
        held_out.load_state_dict({"epoch": 0, "index": 0})  # the same held-out batches every time
        evaluated = [held_out.next() for _ in range(args.eval_batches)]  # each in --accumulate parts, as in training:
        losses = [through_pipeline(run_eval, *batch, part, args.accumulate)  # the microbatches the stages expect
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
    with tqdm.tqdm(total=args.steps, initial=step, disable=not reports, unit="step", mininterval=1.0) as bar, \
            profiler:
        while step < args.steps:
            step += 1
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            synchronize(env.device)  # time the step's work, not its launch
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batch, k = batches.next(), args.accumulate  # an optimizer step's rows: k schedule steps, a part each
            losses = [through_pipeline(functools.partial(run_train, window=(i, k)), *batch, i, k) for i in range(k)]
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
    fixed = 1 if args.schedule in SINGLE_STAGE else 2 if args.schedule in V_SHAPED else None  # stages per rank
    if world_size % group:
        raise UsageError(f"--dp {args.dp} x --tp {args.tp}: {world_size} processes do not divide into stages of "
                         f"{group}; start a multiple of {group} (pipeline ranks x dp x tp)", on_every_rank=True)
    if args.batch_size % (args.dp * args.microbatches * args.accumulate):
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --dp {args.dp} x --microbatches "
                         f"{args.microbatches} x --accumulate {args.accumulate}; give a multiple of "
                         f"{args.dp * args.microbatches * args.accumulate}", on_every_rank=True)
    if args.tp > 1:
        raise UsageError(f"--tp {args.tp}: the traced stages cannot be split by tensor parallelism (a flat graph of "
                         "ops, head counts in shapes); use train_pipeline_gpipe.py for --tp", on_every_rank=True)
    try:  # --seq-chunks: even chunks, under a schedule that can order them
        chunk_order(args.schedule, 1, args.microbatches, chunk_lengths(args.seq_len, args.seq_chunks, None))
    except ValueError as e:
        raise UsageError(str(e), on_every_rank=True) from None
    if args.chunk_split == "compute" and args.seq_chunks > 1:  # torch's PipelineStage: one shape per stage (#159942)
        raise UsageError("--chunk-split compute: the traced stages receive one shape of message each; use "
                         "train_pipeline_afab_manual.py for chunks of equal compute", on_every_rank=True)
    if fixed and args.stages_per_rank != fixed:
        raise UsageError(f"--stages-per-rank {args.stages_per_rank}: {args.schedule} holds {fixed} stage(s) per "
                         "rank; leave the flag out", on_every_rank=True)
    if preset:  # the model's shape is --model's (not a checkpoint's): its layout can be checked already
        preset = config_from_preset(checkpoint.model_preset(args.model, device_type), 0, args.layers)
        stage_layout(preset, world_size // group * args.stages_per_rank, args)


def stage_layout(config, num_stages: int, args) -> list[range]:
    """The layers of each stage (--split), once the model's shape is known; model.layout says what it rules out."""
    microbatch = (args.batch_size // (args.dp * args.microbatches * args.accumulate), args.seq_len)
    try:
        return layout(args.split, config, num_stages, args.seq_len, args.activation_checkpointing,
                      loss_chunks(args.loss_chunks, config, microbatch, args.tp), args.tp)
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
# The split: this rank's stages of the model, built without ever allocating the rest

def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a pipeline rank holds: looped schedules r, r + p, ...; V-shaped r and 2p - 1 - r."""
    if schedule in SINGLE_STAGE:
        return [pp_rank]
    if schedule in V_SHAPED:  # down the ranks and back up: the first and the last stage meet on rank 0
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def traced_modules(config, stages: list[int], layers: list[range], microbatch: tuple[int, int], documents=False,
                   seq_chunks=1):
    """This rank's stage modules, traced from the full model, on meta under their full-model names (materialize
    gives them the other scripts' weights); and the traced pipeline, to build their stages."""
    with torch.device("meta"):  # shapes only: neither the model nor the trace allocates or computes anything
        # Traced untied (pipeline() would copy a tied embedding into the head's stage, and nothing would keep the
        # copies equal: TiedEmbedding does, as in the hand split), and without the head: the loss applies it.
        model = LlamaForPretraining(dataclasses.replace(config, tie_word_embeddings=False))
        model.lm_head = None
        model.base_model.mask_in_each_layer = True  # --document-masking: not once a stage, see model.py
        example = torch.zeros(microbatch, dtype=torch.long)  # positions: a clone (export merges one passed twice)
        kwargs = {"positions": example.clone()} if documents else None
        if seq_chunks > 1:  # traced on a chunk's tokens, with its SeqChunk's fields and its sequence's positions,
            kwargs = {"chunk": torch.zeros(5, dtype=torch.long), "positions": example.clone()}  # in step_chunks'
            example = torch.zeros(microbatch[0], microbatch[1] // seq_chunks, dtype=torch.long)  # order: torch 2.13's
            # first stage flattens keywords in the order they come, not by name (model.traced_chunk_kv)
    not_persistent = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    pipe = traced_pipeline(model, example, split_spec(layers), kwargs)
    modules = [pipe.get_stage_module(stage) for stage in stages]
    for stage, module in zip(stages, modules):
        # The tracer makes every buffer persistent; inv_freq is derived from the config and the other scripts
        # do not save it: restore the flag, or the checkpoints would differ by those keys.
        for prefix, _, buffer in (name.rpartition(".") for name, _ in module.named_buffers() if name in not_persistent):
            module.get_submodule(prefix)._non_persistent_buffers_set.add(buffer)
        if stage == len(layers) - 1:
            module.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        if len(layers) == 1 and config.tie_word_embeddings:
            module.get_submodule("lm_head").weight = module.get_submodule("base_model.embed_tokens").weight
    return modules, pipe


def split_spec(layers: list[range]) -> dict[str, SplitPoint]:
    """A cut before each later stage's first layer (a last stage of no layer: before the final norm), as by hand."""
    return {f"base_model.layers.{s.start}" if s else "base_model.norm": SplitPoint.BEGINNING for s in layers[1:]}


def traced_pipeline(model: torch.nn.Module, example: torch.Tensor, split_points: dict[str, SplitPoint], kwargs=None):
    """pipeline() of a (meta) model, each stage taking every keyword input; its tensors checked: each the model's
    own, under one of its names, held by one stage (tied weights across stages would train as two unequal copies)."""
    full_name = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    canonical = {name: full_name[id(t)] for name, t in [*model.named_parameters(remove_duplicate=False),
                                                        *model.named_buffers(remove_duplicate=False)]}
    with warnings.catch_warnings():  # torch.export's own use of a deprecated pytree class, not ours to fix
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        pipe = pipeline(model, mb_args=(example,), mb_kwargs=kwargs, split_spec=split_points)
    graph, holders = pipe.split_gm.graph, {}  # the stages hold the model's own (meta) tensors: identity names each
    for i, call in enumerate(graph.find_nodes(op="call_module")):
        module = pipe.get_stage_module(i)
        # A schedule gives every stage the step's keyword inputs (positions), pipeline() a stage only the model inputs
        # its ops use (none to the embedding or the head alone): each takes all, in its graph and in the pipe's call.
        for keyword in [k for k in graph.find_nodes(op="placeholder")[1:] if k not in call.args]:  # after the tokens
            with module.graph.inserting_after(module.graph.find_nodes(op="placeholder")[-1]):
                module.graph.placeholder(keyword.name).meta["val"] = keyword.meta["val"]
            call.args += (keyword,)
            module.recompile()
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name not in canonical:  # a lifted constant, or a renamed tensor: no initializer, no checkpoint key
                raise RuntimeError(f"stage {i} holds {name}, which is not a tensor of the model by that name")
            holders.setdefault(full_name.get(id(t), canonical[name]), set()).add((i, id(t)))  # a copy: by name
    for name, held in holders.items():
        if len(held) > 1:
            raise RuntimeError(f"{name} is held as {len(held)} tensors by stages {sorted({i for i, _ in held})}"
                               " (tied?): each would train on its own; untie it or keep its uses in one stage")
    if missing := set(full_name.values()) - holders.keys():
        raise RuntimeError(f"no stage holds {sorted(missing)}")
    return pipe


def pipeline_stage(pipe, stage: int, device: torch.device, group, dtype: torch.dtype):
    """A traced stage's PipelineStage, ready to run: build_stage also rights the device the trace put into ops."""
    built = pipe.build_stage(stage, device, group=group)
    for node in built.submod.graph.nodes:  # its buffers: the trace's fp32, but what crosses stages is dtype's
        crosses = node.op == "placeholder" or stage < pipe.num_stages - 1 and "output" in {u.op for u in node.users}
        if crosses and (value := node.meta["val"]).is_floating_point():
            node.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=dtype, device="meta")
    # torch 2.13: warming up its links, the traced stage sends to a neighbour on its own rank (V-shaped), and
    # gloo cannot ("Pair is not connected"); the schedules pass those tensors in memory anyway. A later stage would
    # wait for positions from the stage before ("expected non-root _RecvInfo"); the schedule passes them as kwargs.
    links, inputs, me = built._get_init_p2p_neighbors_ops, built._create_act_recv_info, dist.get_rank()
    built._get_init_p2p_neighbors_ops = lambda: [op for op in links() if op.peer != me]
    built._create_act_recv_info = lambda: tuple(i for i in inputs() if built.is_first or not i.is_root_arg)
    # torch 2.13 runs the traced graphs op by op through torch.fx.Interpreter (5 ms a step on the tiny model);
    # their generated code is the same graph at eager speed.
    for sub in (m for m in built.submod.modules() if hasattr(m, "_run_with_interpreter")):
        sub._run_with_interpreter = False
    return built


# ----------------------------------------------------------------------------------------------------------
# The schedule

def make_schedule(name: str, pipeline_stages: list, microbatches: int, chunks: int, shards: int, order=None):
    """This rank's schedule (order: a file's, run by torch's runtime) and its loss: a microbatch's mean cross-entropy,
    the head applied a chunk at a time. The schedule divides gradients by the microbatches: the batch's mean loss's."""
    heads = [stage.submod.lm_head for stage in pipeline_stages if stage.is_last]

    def loss_fn(hidden: torch.Tensor, targets) -> torch.Tensor:  # targets: a chunk's (targets, divisor) tuple too
        targets, tokens = targets if isinstance(targets, tuple) else (targets, None)
        with torch.profiler.record_function("loss"):  # for --trace: the last stage's work, outside its forward
            return chunked_loss(heads[0], hidden, targets, chunks, shards, tokens)
    try:
        given = pipeline_stages[0] if name in SINGLE_STAGE and not order else pipeline_stages  # one, or the list
        return (order.schedule(given, loss_fn) if order else  # (an I and its own W back to back run as one B)
                merge_backwards(SCHEDULES[name](given, n_microbatches=microbatches, loss_fn=loss_fn))), loss_fn
    except ValueError as e:  # what the schedule needs of the microbatches: torch says it
        raise UsageError(f"--schedule {name} with --microbatches {microbatches}: {e}", on_every_rank=True) from None


def train_step(schedule, inputs, targets, env: Env, tp: int, window=(0, 1), **documents) -> torch.Tensor | None:
    """Forward and backward of a batch, schedule step window[0] of the window[1] of an optimizer step (--accumulate);
    the mean microbatch loss on the last stage's rank, else None."""
    accumulate_into(schedule, *window)  # the gradients' reduction and scaling once, at the last step (model.py)
    losses, args = [], [inputs] if inputs is not None else []  # token ids: into the first stage, on its rank
    kwargs = {"target": targets, "losses": losses} if targets is not None else {}  # for the last stage's loss
    with compute(env, tp):  # return_outputs=False: the last stage's outputs are not kept after the loss
        if getattr(schedule, "seq_chunks", None):  # --seq-chunks: the sequences cut into chunks (model.py)
            step_chunks(schedule, inputs, targets, documents.get("positions"), losses, traced=True)
        else:
            schedule.step(*args, return_outputs=False, **kwargs, **documents)  # positions: cut as the tokens
    return torch.stack(losses).mean().detach() if targets is not None else None


@torch.no_grad()
def eval_step(schedule, pipeline_stages: list, inputs, targets, env: Env, tp: int, loss_fn, microbatches: int,
              hidden_shape: tuple, **documents) -> torch.Tensor | None:
    """Forward only, the mean microbatch loss on the last stage's rank."""
    losses, args = [], [inputs] if inputs is not None else []  # as in train_step
    kwargs = {"target": targets, "losses": losses} if targets is not None else {}
    with compute(env, tp):
        ranks = pipeline_stages[0].stage_index_to_group_rank  # the whole pipeline's map: every rank decides alike
        if getattr(schedule, "seq_chunks", None):  # forward only, the chunks in the order's forward order
            step_chunks(schedule, inputs, targets, documents.get("positions"), losses, train=False, traced=True)
        elif any(ranks[s] == ranks[s + 1] for s in range(len(ranks) - 1)):  # a rank holds two stages in a row (a V,
            # one process): torch 2.13's eval() asserts there ("can't steal_bwd_input if this stage doesn't have ...")
            forward_only(pipeline_stages, inputs, targets, microbatches, hidden_shape, env.dtype, loss_fn, losses,
                         documents)
        else:
            schedule.eval(*args, return_outputs=False, **kwargs, **documents)
    for module in (m for stage in pipeline_stages for m in stage.submod.modules() if isinstance(m, FSDPModule)):
        module.reshard()  # gathered for the forwards; no backward frees them
    return torch.stack(losses).mean() if targets is not None else None


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
