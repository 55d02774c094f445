"""Pretrain a Llama model split across processes with torch.distributed.pipelining: GPipe, and every other
schedule torch ships.

    python prepare_data.py                                          # once: tokenize the default data into data/
    torchrun --nproc_per_node 3 train_pipeline_gpipe.py             # 3 stages; tiny model on CPU, small on GPUs
    python train_pipeline_gpipe.py --steps 20                       # one process holds the whole model
    torchrun --nproc_per_node 2 train_pipeline_gpipe.py --schedule interleaved1f1b --stages-per-rank 2
    torchrun --nproc_per_node 4 train_pipeline_gpipe.py --dp 2      # 2 stages x 2 data-parallel replicas
    torchrun --nproc_per_node 4 train_pipeline_gpipe.py --tp 2      # 2 stages x 2 tensor-parallel ranks

How the model is split: every rank builds the *full* model on the meta device (shapes only, no memory),
deletes the parts other stages own, and only then allocates and initializes what is left. Stage 0 keeps the
embedding and the first layers, the last stage the last layers, the final norm and the head; the layers are
cut so that the stages cost about the same (--split). Each stage is wrapped in a PipelineStage, and
ScheduleGPipe runs every microbatch forward through the pipeline, then every microbatch backward, exchanging
activations and their gradients between neighbouring ranks.

Schedules with several stages per rank cut the model into p * V stages. Looped ones (interleaved1f1b,
loopedbfs, interleavedzerobubble) give rank r the stages r, r + p, r + 2p, ...; the V-shaped ones
(zbvzerobubble, dualpipev) give it stages r and 2p - 1 - r, so rank 0 holds both the first and the last.
A rank's stages share one trimmed model, so its optimizer and checkpoint see one set of full-model names.
With --tp, each stage's layers, embedding and head are split over neighbouring ranks (model.tensor_parallel);
the last stage hands out hidden states, and the loss applies the head a piece of the sequence at a time.

A template: this file, model.py and checkpoint.py are all it needs, with data from prepare_data.py. It reads
top to bottom: flags, processes and mesh, data, this rank's stages, the schedule, training, the main loop.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import tqdm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import checkpoint
from checkpoint import Parser, UsageError, collective_errors, number, whole
from model import (PRESETS, LlamaForPretraining, TiedEmbedding, check_layout, checkpoint_layers, chunked_loss,
                   compile_layers, config_from_preset, decoder_layers, describe_layout, estimated_costs,
                   flops_per_token, layout, loss_chunks, tensor_parallel)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
             "loopedbfs": ScheduleLoopedBFS, "interleavedzerobubble": ScheduleInterleavedZeroBubble,
             "zbvzerobubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SINGLE_STAGE = {"gpipe", "1f1b"}  # one stage per rank; the others take a list of stages
V_SHAPED = {"zbvzerobubble", "dualpipev"}

# ----------------------------------------------------------------------------------------------------------
# Flags: the same names and meanings in every script of the collection

def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(PRESETS), help="model preset (default: tiny on CPU, small on GPU)")
    g.add_argument("--layers", type=whole(1), help="another number of decoder layers than the preset's")
    g.add_argument("--init-from", metavar="DIR",
                   help="start a new run from a model's weights: a Hugging Face Llama directory (config.json, "
                        "safetensors, tokenizer.json) or a checkpoint of this project (a step-N directory or a "
                        "--checkpoint-dir: its newest). Its shape comes from there, its tokenizer must be the "
                        "data's. Ignored once --checkpoint-dir holds checkpoints: they are resumed")
    g = p.add_argument_group("training")
    g.add_argument("--data", default="data", help="data prepared by prepare_data.py")
    g.add_argument("--steps", type=whole(0), default=300, help="optimizer steps; 0: only evaluate")
    g.add_argument("--batch-size", type=whole(1), default=16, help="sequences per step, over all replicas")
    g.add_argument("--microbatches", type=whole(1), default=4, help="per replica, of its share of the batch")
    g.add_argument("--seq-len", type=whole(1), default=128, help="tokens per sequence")
    g.add_argument("--lr", type=number(positive=True), default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=whole(0), default=30, help="linear, then cosine decay to 10%% of --lr")
    g.add_argument("--weight-decay", type=number(positive=False), default=0.1, help="AdamW's, of matrices")
    g.add_argument("--grad-clip", type=number(positive=False), default=1.0,
                   help="clip the whole model's gradient norm to this; 0: no clipping")
    g.add_argument("--seed", type=int, default=0, help="of the weights and the data order")
    g.add_argument("--eval-every", type=whole(0), default=0,
                   help="after every N steps and at the end, the held-out loss, forward only; 0: never")
    g.add_argument("--eval-batches", type=whole(1), default=4, help="held-out batches per evaluation")
    g = p.add_argument_group("pipeline")
    g.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe", help="the pipeline schedule")
    g.add_argument("--stages-per-rank", type=whole(1),
                   help="stages per rank of the looped schedules (default 2); gpipe and 1f1b hold 1, V-shaped 2")
    g.add_argument("--split", default="balanced",
                   help="the layers of each stage: balanced (by estimated compute, the head and loss counted on "
                        "the last stage), even (equal counts), or layers per stage such as 5,1")
    g.add_argument("--dp", type=whole(1), default=1,
                   help="data-parallel replicas of the pipeline (FSDP2); pipeline ranks = processes / (dp x tp)")
    g.add_argument("--tp", type=whole(1), default=1,
                   help="tensor-parallel ranks per stage: each layer's heads and MLP, the embedding and the head "
                        "split over them (neighbouring ranks: inside a node)")
    g.add_argument("--loss-chunks", type=whole(0), default=0,
                   help="the loss applies the head to this many pieces of the sequence, each recomputed in "
                        "backward, so the whole logits never exist; 1: the plain loss; 0: as few as keep a "
                        "piece's fp32 logits within 256 MiB (1 for small models)")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", default="checkpoints", help="saved to and resumed from")
    g.add_argument("--checkpoint-every", type=whole(0), default=0, help="save every N steps; 0: at the end only")
    g.add_argument("--keep-checkpoints", type=whole(1), default=3, help="the newest K complete ones are kept")
    g.add_argument("--fresh", action="store_true",
                   help="start at step 0 even if --checkpoint-dir holds checkpoints (moved to DIR.previous-TIME)")
    g.add_argument("--metrics", help="write one JSON line per step, and a summary, to this file")
    g.add_argument("--trace", metavar="DIR",
                   help="write each rank's Chrome trace of the last 3 steps (torch.profiler) to DIR/rankN.json")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL and bf16 autocast when a GPU is present, else CPU, gloo, "
                        "fp32")
    g.add_argument("--timeout", type=number(positive=True), default=600,
                   help="seconds a rank waits for its peers before the job stops with an error, not a hang")
    return p


def check_args(args, world_size: int, device_type: str) -> None:
    """What the flags alone show to be impossible, checked identically on every rank before any work."""
    def need(ok: bool, message: str):
        if not ok:
            raise UsageError(message, on_every_rank=True)
    group = args.dp * args.tp  # the processes of one pipeline stage: its replicas x its tensor-parallel ranks
    need(world_size % group == 0, f"--dp {args.dp}{f' x --tp {args.tp}' if args.tp > 1 else ''}: {world_size} "
                                  f"processes cannot be split into {group} {'replicas' if args.tp == 1 else 'ranks'} "
                                  f"per stage; start a multiple of {group} processes (pipeline ranks x dp x tp)")
    # Tried: torch 2.13's compiled layers fail in backward on the tensor-parallel layers' DTensors.
    need(not (args.compile and args.tp > 1), f"--compile with --tp {args.tp}: compiled tensor-parallel layers "
                                             "fail in torch 2.13's backward; leave --compile out with --tp")
    need(args.batch_size % (args.dp * args.microbatches) == 0,
         f"--batch-size {args.batch_size} is not divisible by --dp {args.dp} x --microbatches {args.microbatches}; "
         "each replica splits its equal share of the batch into the microbatches")
    pp, m = world_size // group, args.microbatches
    # Left out, --stages-per-rank is the schedule's own count; given, it must be one the schedule can hold.
    need(args.schedule not in SINGLE_STAGE or args.stages_per_rank in (None, 1),
         f"--stages-per-rank {args.stages_per_rank}: {args.schedule} holds one stage per rank; leave the flag out, "
         "or pick a multi-stage --schedule (interleaved1f1b, ...)")
    default = 1 if args.schedule in SINGLE_STAGE else 2
    per_rank = args.stages_per_rank = default if args.stages_per_rank is None else args.stages_per_rank
    need(args.schedule not in V_SHAPED or per_rank == 2,
         f"--stages-per-rank {per_rank}: {args.schedule} places exactly 2 stages on each rank; use 2")
    need(args.schedule not in ("1f1b", "dualpipev") or m >= pp * per_rank,
         f"--microbatches {m}: {args.schedule} needs at least as many microbatches as stages ({pp * per_rank})")
    need(args.schedule not in ("interleaved1f1b", "interleavedzerobubble") or m % max(1, m // pp) == 0,
         f"--microbatches {m}: {args.schedule} needs a multiple of max(1, microbatches // pipeline ranks); use "
         f"a multiple of {pp}")
    preset = config_from_preset(args.model or ("small" if device_type == "cuda" else "tiny"), 0, args.layers)
    # The preset's shape (its vocabulary comes with the data); --init-from's, or a resumed run's, once known.
    stage_layout(preset if checkpoint.preset_model(args) else None, pp * per_rank, args)


def stage_layout(config, num_stages: int, args) -> list[range]:
    """The layers of each stage (--split), after what the model's shape allows: a layer per stage, --seq-len
    within its positions. config None: only --split's spelling."""
    if config is not None and num_stages > config.num_hidden_layers:
        stages = "processes / (--dp x --tp)" + (" x --stages-per-rank" if "stages_per_rank" in vars(args) else "")
        raise UsageError(f"{num_stages} pipeline stages ({stages}) but the model has {config.num_hidden_layers} "
                         "layers: each stage needs one; use fewer stages or more --layers", on_every_rank=True)
    if config is not None and args.seq_len > config.max_position_embeddings:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {config.max_position_embeddings} positions",
                         on_every_rank=True)
    for what, count in (("attention heads", config.num_attention_heads), ("KV heads", config.num_key_value_heads),
                        ("MLP width", config.intermediate_size), ("vocabulary", config.vocab_size)) if config else ():
        if count % args.tp:  # tensor parallelism gives each rank an equal share of these
            raise UsageError(f"--tp {args.tp}: the model's {what} ({count}) do not divide by it; use a --tp that "
                             f"divides {count}", on_every_rank=True)
    try:
        if config is None:
            return check_layout(args.split)
        microbatch = (args.batch_size // (args.dp * args.microbatches), args.seq_len)
        return layout(args.split, config, num_stages, args.seq_len, args.activation_checkpointing,
                      loss_chunks(args.loss_chunks, config, microbatch, args.tp))
    except ValueError as e:
        raise UsageError(f"--split {args.split}: {e}", on_every_rank=True) from None


# ----------------------------------------------------------------------------------------------------------
# Processes, devices and the mesh

@dataclasses.dataclass
class Env:
    rank: int
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    dtype: torch.dtype  # compute dtype: bf16 autocast on GPU (weights and AdamW stay fp32), fp32 on CPU
    restart: int  # how often torchrun --max-restarts has restarted this job


def launch_env(device_flag: str) -> Env:
    """What torchrun set (or one process, under plain python), and the one place that picks device and dtype."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: no GPU is visible; use --device cpu")
    if cuda and local_world > torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
        raise UsageError(f"--device cuda: {local_world} processes on this node but {torch.cuda.device_count()} "
                         "GPUs; start one process per GPU (--nproc_per_node) or use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    return Env(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), device,
               torch.bfloat16 if cuda else torch.float32, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))


def init_distributed(env: Env, timeout_s: float, dp: int, tp: int):
    """Join the other processes and arrange them in a mesh: "pp" (pipeline ranks) outermost, then "dp"
    (replicas of the pipeline), then "tp" (the tensor-parallel ranks of one stage) innermost.

    Ranks fill the mesh row by row, rank = (pp_rank * dp + dp_rank) * tp + tp_rank. tp innermost: a layer's
    tensor-parallel ranks, which all-reduce inside every layer, are neighbouring ranks, on one node when tp
    divides its GPUs; then a stage's replicas, whose FSDP all-gathers and reduce-scatters (a stage's whole
    parameters and gradients, every step) stay on the node's links as far as they fit; and only one
    microbatch's activations at a time cross nodes, between pipeline stages. The timeout bounds every
    collective and send/recv: a peer that died or hangs stops the job with an error instead of leaving the
    others waiting forever."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if "MASTER_ADDR" in os.environ:  # started by torchrun
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        # After torchrun --max-restarts restarts the job, the new processes meet in the same store as the dead
        # ones, whose addresses are still in it: a key prefix per attempt keeps each to itself.
        store = dist.PrefixStore(f"attempt{env.restart}", store)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                **({"device_id": env.device} if env.device.type == "cuda" else {}))
    else:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return init_device_mesh(env.device.type, (env.world_size // (dp * tp), dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def compute(env: Env, tp: int):
    """The context of every forward and backward: bf16 autocast on GPU; with tensor parallelism, loss_parallel,
    so that the cross-entropy works on the head's vocabulary-sharded logits without gathering them."""
    stack = contextlib.ExitStack()
    if env.dtype != torch.float32:
        stack.enter_context(torch.autocast(env.device.type, env.dtype))
    if tp > 1:
        stack.enter_context(loss_parallel())
    return stack


# ----------------------------------------------------------------------------------------------------------
# Data: windows of the token files prepare_data.py wrote, in a seeded order that a checkpoint can resume

class Batches:
    """Windows of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]) from the token files of a
    split ("train" or "val"), batch_size windows per batch. Consecutive windows share one token, so every token
    is a target once per epoch. shuffle: a permutation of the windows drawn from (seed, epoch) for each epoch;
    else in order. Every rank reads the whole global batch, so the position is the run's whatever the layout,
    and each data-parallel replica trains on its own rows of it."""

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
    prepare = f"python prepare_data.py{'' if args.data == 'data' else ' --out ' + args.data}"
    try:
        with open(os.path.join(args.data, "meta.json")) as f:
            meta = json.load(f)
    except OSError:
        raise UsageError(f"--data {args.data}: no data prepared there; run {prepare} first (see its --help)") from None
    except ValueError as e:
        raise UsageError(f"--data {args.data}: its meta.json is damaged ({e}); prepare it again: {prepare}") from None
    try:  # a token file cut short would silently train on less, or fail mid-run
        for name, tokens in (pair for split in ("train", "val") for pair in zip(meta[split]["files"],
                                                                                meta[split]["tokens"], strict=True)):
            path, expected = os.path.join(args.data, name), tokens * np.dtype(meta["dtype"]).itemsize
            if not os.path.isfile(path) or os.path.getsize(path) != expected:
                found = f"has {os.path.getsize(path):,} bytes" if os.path.isfile(path) else "is missing"
                raise UsageError(f"--data {args.data}: {name} {found}, meta.json says {expected:,}; the data is "
                                 f"incomplete or damaged, prepare it again: {prepare}")
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"--data {args.data}: its meta.json is damaged ({type(e).__name__}: {e}); prepare it "
                         f"again: {prepare}") from None
    train = Batches(args.data, meta, "train", args.seq_len, args.batch_size, args.seed)
    held_out = Batches(args.data, meta, "val", args.seq_len, args.batch_size, 0, shuffle=False)
    if train.num_windows < 1:
        raise UsageError(f"--seq-len {args.seq_len}: --data {args.data} holds {sum(meta['train']['tokens'])} "
                         "training tokens, less than one window of --seq-len + 1; use a shorter --seq-len")
    if (args.eval_every or args.steps == 0) and held_out.num_windows < args.eval_batches * args.batch_size:
        raise UsageError(f"--eval-batches {args.eval_batches}: --data {args.data} holds {held_out.num_windows} "
                         "held-out windows of --seq-len + 1, fewer than --eval-batches x --batch-size")
    return meta, train, held_out


# ----------------------------------------------------------------------------------------------------------
# The split: this rank's stages of the model, built without ever allocating the rest

def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The global indices of the stages a pipeline rank holds."""
    if schedule in SINGLE_STAGE:
        return [pp_rank]
    if schedule in V_SHAPED:  # down the ranks and back up: the first and the last stage meet on rank 0
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank)]  # looped


def build_stages(config, stages: list[int], layers: list[range], device: torch.device,
                 seed: int) -> LlamaForPretraining:
    """This rank's part of the model: the layers of its stages, the embedding if it holds the first stage, the
    norm and head if it holds the last. Built on meta, trimmed, then allocated and initialized, so the weights
    are the full model's for the seed whatever the split."""
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    model.keep_only({i for s in stages for i in layers[s]}, 0 in stages, len(layers) - 1 in stages)
    model.to_empty(device=device)  # allocates, uninitialized: init_weights sets every parameter and buffer
    if len(layers) == 1:  # embedding and head in one stage: one tensor if tied (else TiedEmbedding below)
        model.tie_weights()
    model.init_weights(seed)
    model.head_in_loss = True  # the last stage gives out hidden states; the loss applies the head, in chunks
    return model


def stage_views(model: LlamaForPretraining, stages: list[int], layers: list[range]) -> list[LlamaForPretraining]:
    """One module per stage of this rank, sharing the parameters of `model` (the rank's whole part)."""
    if len(stages) == 1:
        return [model]
    views = []
    for s in stages:
        with torch.device("meta"):  # only a skeleton: every part kept is replaced by the real one
            view = LlamaForPretraining(model.config).keep_only(layers[s], s == 0, s == len(layers) - 1)
        view.head_in_loss = model.head_in_loss
        for i in layers[s]:
            view.base_model.layers[str(i)] = model.base_model.layers[str(i)]
        if s == 0:
            view.base_model.embed_tokens = model.base_model.embed_tokens
        if s == len(layers) - 1:
            view.base_model.norm, view.lm_head = model.base_model.norm, model.lm_head
        views.append(view)
    return views


def make_pipeline_stages(model, stages: list[int], layers: list[range], mesh, microbatch: tuple[int, int],
                         env: Env) -> list[PipelineStage]:
    """This rank's PipelineStages: a module per stage sharing model's parameters, sharded over the stage's dp
    replicas (FSDP2: PipelineStage then syncs the gradients once per step, not per microbatch). group: the
    pipeline's ranks; a stage lives on a rank of it as the schedule places it, and PipelineStage turns that
    into the global rank it sends to and receives from."""
    views = stage_views(model, stages, layers)
    shard_replicas(views, mesh)
    return [PipelineStage(view, s, len(layers), env.device, group=mesh.get_group("pp"),
                          **stage_io(model.config, s, microbatch))
            for view, s in zip(views, stages)]


def stage_io(config, stage: int, microbatch: tuple[int, int]) -> dict:
    """What a stage takes in and gives out for one microbatch, as meta tensors (shape and dtype, no memory).

    Declared up front, PipelineStage need not find it out itself: otherwise torch 2.13 runs a real microbatch
    through each stage before the first step, and on the first stage it never frees that forward's
    activations (0.8 of a microbatch's, held for the whole run). Token ids come in; hidden states go out of
    every stage, the last one's too (the loss applies the head, chunk by chunk), in the weights' dtype under
    autocast (fp32 embedding, fp32 residual additions, fp32 final norm)."""
    hidden = torch.empty(*microbatch, config.hidden_size, device="meta", requires_grad=True)
    return {"input_args": torch.empty(microbatch, dtype=torch.long, device="meta") if stage == 0 else hidden,
            "output_args": hidden}


# ----------------------------------------------------------------------------------------------------------
# The schedule

def make_loss(pipeline_stages: list, chunks: int):
    """The last stage's loss: the mean cross-entropy over a microbatch's targets, with the head of the stage
    that holds it, chunk by chunk (model.chunked_loss). The schedule divides gradients by the number of
    microbatches, so a step's gradient is that of the mean of the microbatch losses, as on one process.
    Labelled for --trace: the schedules compute it outside the stage's forward, but it is the last stage's
    work all the same."""
    heads = [stage.submod.lm_head for stage in pipeline_stages if stage.is_last]

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("loss"):
            return chunked_loss(heads[0], hidden, targets, chunks)
    return loss_fn


def make_schedule(name: str, pipeline_stages: list, microbatches: int, loss_fn):
    """The schedule driving this rank's PipelineStages: one stage for gpipe and 1f1b, a list for the others."""
    try:
        stages = pipeline_stages[0] if name in SINGLE_STAGE else pipeline_stages
        return SCHEDULES[name](stages, n_microbatches=microbatches, loss_fn=loss_fn)
    except ValueError as e:  # a requirement check_args does not know of (a newer torch, say)
        raise UsageError(f"--schedule {name} with --microbatches {microbatches}: {e}", on_every_rank=True) from None


def train_step(schedule, inputs, targets, env: Env, tp: int = 1) -> torch.Tensor | None:
    """Forward and backward of one batch through the pipeline. inputs: on the rank holding the first stage,
    else None; targets: on the rank holding the last stage. Returns the mean microbatch loss there."""
    losses: list[torch.Tensor] = []
    with compute(env, tp):
        # return_outputs=False: the last stage's outputs are not needed after the loss: do not keep them.
        schedule.step(*([inputs] if inputs is not None else []), return_outputs=False,
                      **({"target": targets, "losses": losses} if targets is not None else {}))
    return torch.stack(losses).mean().detach() if targets is not None else None


@torch.no_grad()
def eval_step(schedule, pipeline_stages: list, inputs, targets, env: Env, microbatches: int, hidden_shape: tuple,
              loss_fn, tp: int = 1) -> torch.Tensor | None:
    """Forward only: the schedule's eval(); for the V-shaped schedules, whose eval() fails in torch 2.13 ("can't
    steal_bwd_input if this stage doesn't have backward"), forward_only() over the same stages."""
    losses: list[torch.Tensor] = []
    with compute(env, tp):
        if isinstance(schedule, (ScheduleZBVZeroBubble, ScheduleDualPipeV)):
            forward_only(pipeline_stages, inputs, targets, microbatches, hidden_shape, loss_fn, losses)
        else:
            schedule.eval(*([inputs] if inputs is not None else []), return_outputs=False,
                          **({"target": targets, "losses": losses} if targets is not None else {}))
    for stage in pipeline_stages:  # FSDP gathered the parameters for the forwards; no backward frees them
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return torch.stack(losses).mean() if targets is not None else None


def forward_only(pipeline_stages: list, inputs, targets, microbatches: int, hidden_shape: tuple, loss_fn,
                 losses: list) -> None:
    """Every microbatch forward through this rank's stages, the last stage's losses appended to `losses`.

    Each rank runs its stages in the order of their index, each on all microbatches: an input comes from the
    stage before (in memory when this rank holds it too, else received from its rank), an output goes to the
    stage after the same way. Sends do not wait, so no rank waits for one that waits for it: stage s only ever
    waits for stage s - 1, which every rank runs earlier in the same order."""
    first = pipeline_stages[0]
    group = first.group if first.group is not None else dist.group.WORLD
    peer = lambda s: dist.get_global_rank(group, first.stage_index_to_group_rank[s])  # noqa: E731
    held, sends = {}, []  # (stage, microbatch) -> an output kept for a stage on this rank; pending sends
    xs = inputs.chunk(microbatches) if inputs is not None else None
    ys = targets.chunk(microbatches) if targets is not None else None
    for stage in sorted(pipeline_stages, key=lambda st: st.stage_index):
        s = stage.stage_index
        for i in range(microbatches):
            if s == 0:
                x = xs[i]
            elif (s - 1, i) in held:
                x = held.pop((s - 1, i))
            else:  # hidden states in fp32, as stage_io declares them to the schedule
                x = torch.empty(hidden_shape, device=stage.device)
                dist.recv(x, peer(s - 1))
            out = stage.submod(x)
            if s == stage.num_stages - 1:
                losses.append(loss_fn(out, ys[i]))
            elif peer(s + 1) == dist.get_rank():
                held[s, i] = out
            else:
                sends.append(dist.isend(out.contiguous(), peer(s + 1)))
    for work in sends:
        work.wait()


# ----------------------------------------------------------------------------------------------------------
# Training: data parallelism, the optimizer and its schedule, clipping across stages, tied embeddings, metrics

def shard_replicas(stage_modules: list, mesh) -> None:
    """Data parallelism beside the pipeline: shard each stage over its dp replicas with FSDP2, in place.

    fully_shard on every decoder layer, then on the stage's root (embedding, final norm, head): each layer is
    all-gathered and its gradient reduce-scattered as one unit, and each rank keeps 1/dp of its stage's
    parameters, gradients and AdamW state. reshard_after_forward=False: a pipeline runs every stage forward
    once per microbatch, and re-gathering the parameters for each would multiply the all-gathers by the number
    of microbatches (torchtitan's choice with pipelining too). PipelineStage reduces gradients once per step."""
    if mesh["dp"].size() == 1:
        return
    for module in decoder_layers(stage_modules) + stage_modules:
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    # Decay matrices only; norm gains stay undecayed. Grouping is per parameter, so it is the same on any split.
    # fused: one kernel over all of a group's tensors, on CUDA and on CPU (FSDP's DTensors too).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_at(step: int, args) -> float:
    """The LR of 1-based step `step`: linear warmup, then cosine down to 10 % of --lr. A function of the step
    alone, so resuming needs no scheduler state."""
    if step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def clip_grad_norm_(params, max_norm: float, copies=(), tp: int = 1) -> torch.Tensor:
    """Clip by the norm of the *whole model's* gradient and return it (the same on every rank).

    Each rank holds part of the gradient: its stages', and with FSDP only its shard of that. The parts are
    disjoint, so the whole's squared norm is the sum over all ranks of each part's; clipping each part by its
    own norm would change the update. copies: a tied head's copy of the embedding, clipped but counted once.
    A tensor each tensor-parallel rank holds whole (a norm's gain: not split by the plan) is counted once, not
    tp times. Summed in float64 over rows of 4096: torch's float32 norm on the CPU adds a whole tensor in one
    running sum (2e-5 relative error on the tiny model's embedding gradient, more than the layouts may differ
    by)."""
    def tp_copies(p) -> int:
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        return tp if "tp" not in names or p.placements[names.index("tp")].is_replicate() else 1

    params, skip, squares = [p for p in params if p.grad is not None], {id(p) for p in copies}, []
    for p in (p for p in params if id(p) not in skip):
        flat = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).flatten()
        whole = flat.numel() // 4096 * 4096  # rows as views of the gradient (no copy), then the rest
        norms = torch.cat([torch.linalg.vector_norm(flat[:whole].view(-1, 4096), dim=1),
                           torch.linalg.vector_norm(flat[whole:])[None]])
        squares.append((norms.double() ** 2).sum() / tp_copies(p))
    total = torch.stack(squares).sum()
    dist.all_reduce(total)
    total = total.sqrt().float()
    if max_norm > 0:  # as torch.nn.utils.clip_grads_with_norm_, on the local tensors (DTensor or not: mixed)
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params], scale)
    return total


def summary(env: Env, model, optimizer, step_times: list[float], tokens_per_step: int, config, args, reports: bool,
            metrics) -> None:
    """Collective: every rank's peak memory and the bytes it holds (params, gradients, AdamW state: with FSDP its
    shards); the rank reporting the loss prints them with the step time and MFU, and writes them to --metrics."""
    size = lambda ts: sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in ts if torch.is_tensor(t))
    held = {"param": size(model.parameters()), "grad": size(p.grad for p in model.parameters()),
            "optimizer": size(v for state in optimizer.state.values() for v in state.values())}
    peak = (torch.cuda.max_memory_allocated(env.device) if env.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB of peak RSS
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, (peak, held))
    if not (reports and step_times):
        return
    steady = step_times[1:] or step_times  # the first step pays one-time costs
    row = {"steps": len(step_times), "median_step_time": sorted(steady)[len(steady) // 2],
           "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
           "peak_memory_bytes_per_rank": [p for p, _ in gathered],
           **{f"{kind}_bytes_per_rank": [h[kind] for _, h in gathered] for kind in held}}
    # MFU: model FLOPs over the GPUs' dense bf16 peak (vendors' data sheets; other GPUs get none).
    peak_flops = next((f for gpu, f in {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                                        "L4": 121e12}.items() if env.device.type == "cuda"
                       and gpu in torch.cuda.get_device_name(env.device)), None)
    if peak_flops:
        row["mfu"] = row["tokens_per_s"] * flops_per_token(config, args.seq_len) / (peak_flops * env.world_size)
    if metrics:
        metrics.write(json.dumps({"summary": row}) + "\n")
    mib = lambda values: ", ".join(f"{b / 2**20:.1f}" for b in values)  # noqa: E731
    mfu = f", MFU {row['mfu']:.1%}" if peak_flops else ""
    print(f"done: {row['steps']} steps, median step {row['median_step_time'] * 1e3:.0f} ms, "
          f"{row['tokens_per_s']:.0f} tokens/s{mfu}; peak memory per rank ({env.device.type}, MiB): "
          f"{mib(row['peak_memory_bytes_per_rank'])}; held per rank (MiB): "
          + "; ".join(f"{kind} {mib(row[f'{kind}_bytes_per_rank'])}" for kind in held), flush=True)


# ----------------------------------------------------------------------------------------------------------

def main(args):
    env = launch_env(args.device)
    check_args(args, env.world_size, env.device.type)
    mesh = init_distributed(env, args.timeout, args.dp, args.tp)
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()  # this rank's place along the pipeline,
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()  # among its stage's replicas,
    tp_rank, tp = mesh["tp"].get_local_rank(), mesh["tp"].size()  # and in its stage's tensor-parallel group
    say = print if env.rank == 0 else (lambda *a, **k: None)

    # --- data, then what the run will write (paths, the lock, the same run as the checkpoints?)
    with collective_errors():
        data, batches, held_out = open_data(args)
    data_id = checkpoint.data_identity(args.data)
    checkpoint.check_run(args, env.rank, env.restart, data_id)

    # --- this rank's stages of the model, sharded over its replicas, and the schedule
    stages = stage_ids(args.schedule, pp_rank, pp, args.stages_per_rank)
    num_stages, has_first, has_last = pp * len(stages), 0 in stages, pp * len(stages) - 1 in stages
    with collective_errors():
        config, name = checkpoint.model_config(args, data, env.device.type)
        layers = stage_layout(config, num_stages, args)
    model = build_stages(config, stages, layers, env.device, args.seed)
    tensor_parallel(model, mesh["tp"])  # before activation checkpointing, compile and FSDP2
    if args.activation_checkpointing:
        checkpoint_layers([model])
    if args.compile:
        compile_layers([model])
    model.train()
    microbatch = (args.batch_size // (dp * args.microbatches), args.seq_len)
    pipeline_stages = make_pipeline_stages(model, stages, layers, mesh, microbatch, env)
    chunks = loss_chunks(args.loss_chunks, config, microbatch, tp)
    loss_fn = make_loss(pipeline_stages, chunks)
    schedule = make_schedule(args.schedule, pipeline_stages, args.microbatches, loss_fn)
    costs = estimated_costs(config, args.seq_len, args.activation_checkpointing, chunks)
    say(f"model {name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size} | "
        f"{num_stages} stage(s) on {env.world_size} process(es) = {pp} pipeline x {dp} data x {tp} tensor: "
        f"{describe_layout(layers, costs)} | "
        f"{args.schedule} | {env.device.type} {str(env.dtype).removeprefix('torch.')}", flush=True)

    def step_fn(inputs, targets):
        return train_step(schedule, inputs, targets, env, tp)

    def eval_fn(inputs, targets):
        return eval_step(schedule, pipeline_stages, inputs, targets, env, args.microbatches,
                         (*microbatch, config.hidden_size), loss_fn, tp)

    # --- optimizer, tied embedding, resume: everything below is the same in every script
    optimizer = make_optimizer(model, args)
    tied = TiedEmbedding(model, config, mesh, has_first, has_last)
    step, position = checkpoint.resume(args, env.rank, env.world_size, model, optimizer, config, data_id, say)
    if position is not None:
        batches.load_state_dict(position)
    reports = has_last and dp_rank == tp_rank == 0  # the loss and the progress bar: one last-stage rank
    # --metrics: one JSON line per step and evaluation, then a summary; resumed, the rows after the checkpoint
    # (of a run killed after it) are dropped first. Nothing to do (step >= --steps): the file stays as it was.
    metrics = checkpoint.open_metrics(args.metrics, step) if reports and args.metrics and (
        step < args.steps or args.steps == 0) else None
    record = lambda row: metrics and (metrics.write(json.dumps(row) + "\n"), metrics.flush())  # noqa: E731
    rows = slice(dp_rank * args.batch_size // dp, (dp_rank + 1) * args.batch_size // dp)  # this replica's

    def pipeline(fn, inputs, targets):
        """fn on this replica's rows (inputs to the first stage, targets to the last); the mean loss over the
        replicas on the last stage."""
        loss = fn(inputs[rows].to(env.device) if has_first else None,
                  targets[rows].to(env.device) if has_last else None)
        if has_last and dp > 1:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= dp
        return loss

    def evaluate(at_step: int) -> None:
        held_out.load_state_dict({"epoch": 0, "index": 0})  # the same held-out batches every time
        losses = [pipeline(eval_fn, *held_out.next()) for _ in range(args.eval_batches)]
        if reports:
            loss = torch.stack(losses).mean().item()
            record({"eval": {"step": at_step, "loss": loss, "perplexity": math.exp(min(loss, 700)),
                             "batches": args.eval_batches}})
            tqdm.tqdm.write(f"eval at step {at_step}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f}")

    tokens_per_step, step_times = args.batch_size * args.seq_len, []
    if args.steps == 0:  # only evaluate: --init-from's weights, or this run's newest checkpoint
        evaluate(step)
        return summary(env, model, optimizer, step_times, tokens_per_step, config, args, reports, metrics)
    if step >= args.steps:
        return

    # --- training loop
    # --trace: each rank's Chrome trace of the last 3 steps, from torch.profiler. The schedules label their
    # forwards and backwards in it (torch 2.13's 1F1B apart: benchmark.py adds those labels when it runs the
    # scripts), and benchmark.py reads each stage's times and the bubble off them.
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(0, args.steps - step - 4), warmup=1, active=3),
        on_trace_ready=lambda p: (os.makedirs(args.trace, exist_ok=True),
                                  p.export_chrome_trace(os.path.join(args.trace, f"rank{env.rank}.json"))),
    ) if args.trace else contextlib.nullcontext()
    dist.barrier()
    with tqdm.tqdm(total=args.steps, initial=step, disable=not reports, unit="step", mininterval=1.0) as bar, \
            profiler:
        while step < args.steps:
            step += 1
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)  # time the step's work, not its launch
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = pipeline(step_fn, *batches.next())
            tied.sync_grads()
            grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip, tied.copies, tp)
            optimizer.step()
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            step_times.append(time.perf_counter() - started)
            if args.trace:
                profiler.step()
            if reports:
                record({"step": step, "loss": loss.item(), "lr": lr, "tokens": step * tokens_per_step,
                        "step_time": step_times[-1], "tokens_per_s": tokens_per_step / step_times[-1],
                        "grad_norm": grad_norm.item()})
                bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens_per_step / step_times[-1]:.0f}",
                                refresh=False)
                bar.update()
            # Save before evaluating: whatever happens in an evaluation, this step's work is kept.
            path = checkpoint.save_if_due(args, env.rank, step, model, optimizer, config, data_id,
                                          batches.state_dict())
            if path and reports:
                bar.write(f"saved {path}")
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                evaluate(step)
    summary(env, model, optimizer, step_times, tokens_per_step, config, args, reports, metrics)


if __name__ == "__main__":
    checkpoint.run(main, build_parser().parse_args())
