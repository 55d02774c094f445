"""Which layout for my GPUs, and what a layout will hold in memory and how fast it will run: computed, not run.

    python plan.py --model llama-8b --vocab-size 128256 --seq-len 8192 --batch-size 256 \\
        --gpus 16 --gpus-per-node 8 --gpu-memory 80            # the fastest layouts that fit, with commands
    python plan.py --model path/to/config.json --gpus 64 ...    # a Hugging Face config's shape
    python plan.py --processes 8 --dp 2 --model llama-8b --seq-len 8192 --batch-size 64 --microbatches 8 \\
        --device cuda                             # one layout: 4 stages x 2 replicas of Llama 3 8B's shapes
    python plan.py --processes 4 --tp 2 --model llama-8b --vocab-size 128256 --seq-len 8192 --batch-size 16 \\
        --microbatches 16 --schedule 1f1b --activation-checkpointing --device cuda
    python plan.py --processes 2 --data data      # the tiny model on this machine, vocabulary of data/meta.json
    python plan.py --processes 3 --data data --trace DIR   # the --split that balances a traced run's own times

--gpus N searches the layouts of N GPUs: pp x dp x tp = N with tp inside a node and dividing the model's heads,
every schedule torch ships (the hand-written script's afab and 1f1b are GPipe's and 1F1B's orders), the most
microbatches the batch and schedule allow, with and without activation checkpointing, the balanced split, under
gpipe and 1f1b each sequence whole or in 2, 4, 8, 16 or 32 chunks (--seq-chunks) of 4096 tokens or more; and
--accumulate K > 1 only where memory forces it: for a pp x dp x tp and schedule that fits at no microbatch
count, with or without checkpointing, the smallest K that fits. It drops what the scripts would refuse or what
does not fit in --gpu-memory (less 10 % for CUDA itself), and prints the fastest few, each with its step time,
bubble, memory per GPU and the command that runs it. Its model of time: each stage's FLOPs at --efficiency x
--peak-tflops, plus tensor parallelism's all-reduces and the messages between stages at --intra-node-bandwidth
or --inter-node-bandwidth, K schedule steps one after the other (each with its fill and drain), plus FSDP's
gather and reduce-scatter of each stage once per optimizer step; nothing overlapped.

--processes N plans one layout. The flags are the training scripts' own (the same names, meanings and
defaults: --model, --layers, --init-from, --seq-len, --document-masking, --batch-size, --microbatches,
--accumulate, --schedule, --stages-per-rank, --split, --dp, --tp, --loss-chunks, --activation-checkpointing,
--device, --seq-chunks), and where the vocabulary comes from: --vocab-size (default 8192, prepare_data.py's default
tokenizer) or --data DIR (a prepared dataset's meta.json); --init-from brings its own. A plan is refused, with
the same one line, exactly when train_pipeline_gpipe.py would refuse the run (its check_args and stage_layout
do the checking); the hand-written script's afab is accepted too (GPipe's order).

--seq-chunks S plans each sequence cut into S chunks that run as microbatches (Seq1F1B), as the scripts run it
under gpipe, afab and 1f1b (model.chunk_order's order; the other schedules' rows: not possible here, the scripts'
reason): each chunk its own time (its FLOPs: the matrices' by its tokens, causal attention's by what it reads of
its prefix, so a later chunk costs more) and bytes (its tokens' share, plus the prefix's keys and values its
attention saves), a row beside GPipe's and 1F1B's (docs/long-sequences.md).

--accumulate K plans an optimizer step of K schedule steps of --microbatches m each (microbatches of batch /
(dp x m x K) rows): a step's activations, K times the replayed step's time (K fills and drains: 1F1B on 4 equal
stages idles 27 % of 4 x 8 microbatches, 8.6 % of 1 x 32), the bytes sent in all K; what FSDP holds through
the K steps (each stage's gathered parameters and gradients, between steps too) is in a step's total already.

Nothing is allocated and no process group or GPU is needed. For every rank of the pipeline it prints the bytes
of parameters, gradients and AdamW state it holds (fp32, 1/dp of its stages' with FSDP, 1/tp of the matrices,
as `benchmark.py measure-memory` measures them), the gathered parameters and gradients FSDP holds during a
step, the activations held for backward at the worst moment of the chosen schedule (what `benchmark.py
measure-memory` counts: for the zero-bubble schedules also the gradients kept from a backward's input half
to its weight half), with and without --activation-checkpointing, the loss's logits, and the peak of its
start-up (its shards and the largest whole tensor of its stages, which it draws whole and keeps its piece of:
model.materialize; benchmark.py measure-memory measures it too). Then, for every
schedule torch ships, the step time and bubble, found by replaying the schedule's own per-rank order of
forwards and backwards (torch's, built from placeholder stages) with each stage's cost from
model.estimated_costs: a stage's forward takes 1/3 of its forward + backward, a backward 2/3 (input and weight
gradient 1/3 each for the zero-bubble schedules, plus what torch recomputes in each: split_backward), and a
message takes no time (--message-time: its time).

Beside torch's seven, the Zero Bubble paper's orders (Qi et al., ICLR 2024), generated from the same stage times
and torch's memory (a microbatch's activations held until its W): zbh2 (handcrafted, 2p microbatches in flight),
zb1p and zb2p (its automatic heuristic, capped at p or 2p microbatches' activations per rank) and zbvauto (its
cost-aware V, capped at 1F1B's), each the one of the orders the paper's method tries, and of the fixed orders of
its placement (torch's V for zbvauto), whose step is least: torch's runtime synchronizes every step, where the
paper minimizes each rank's span; each row adds the paper's own measure of the bubble, the idle share of the
longest rank's span (docs/plan-vs-the-zero-bubble-paper.md). No script runs them by name: --write-schedule
FILE.csv writes --schedule's order (any of the eleven) as torch's _PipelineScheduleRuntime loads a custom
schedule (one row per pipeline rank: its compute actions in order, such as 0F1, 1I0, 1W0).

--vocab-parallel (with --schedule afab or 1f1b, the hand-written script's: it runs it) plans the embedding and the
head with its loss split by vocabulary rows over all pipeline ranks (Vocabulary Parallelism, Yeung et al., MLSys
2025): every rank 1/p of their work and rows, their collectives over the pipeline group at the node bandwidths,
the layers alone balanced, and what the script's variant holds (plainer than the paper's Vocab-1, which holds p + 2
microbatches' activations): the layers' as without the flag, on the first rank the step's m input embeddings and
their gradients, on every rank its slices, their gradients and AdamW state and, for a moment, one loss piece's logits
slice and the head's gradient (docs/pipeline-by-hand.md). The schedules list
prints both hand-written schedules with it beside the plain ones either way; --gpus proposes it where it is
faster (docs/layouts.md).

Measured times instead of the estimate: --layer-times F,B,W (a decoder layer's forward, input-gradient and
weight-gradient milliseconds), --embed-times, --head-times (the final norm, head and loss) and --message-time,
as the Zero Bubble paper plans (fed its profiled times, the replay gives its bubbles:
docs/plan-vs-the-zero-bubble-paper.md); or --trace DIR, the per-rank trace of a run (the scripts' --trace DIR):
the embedding's and the loss's own operators, each layer the rest of its stage, read on the traced run's own
layout, which the trace says (each rank's trace carries what its run measured: the model's shape, --seq-len, a
microbatch's rows, the split, schedule, processes, --dp, --tp, device and precision). A trace of another
microbatch (another model shape, --seq-len, rows, precision, device, --tp, sequence parallelism,
checkpointing, --loss-chunks or --document-masking) is refused in one line; another layout of the same
microbatch (another --layers, --processes, --dp, --schedule, --batch-size, --microbatches) takes its times,
which it says in one line. With measured times, balanced is balanced on them: plan.py prints the --split counts
and the step it replays, against the traced run's own. --stage-times F1,...,Fn/B1,...,Bn gives each stage's
whole forward and backward instead (a run's per-stage times, such as the Vocabulary Parallelism paper's artifact
measures), for one stage count.
"""

import argparse
import bisect
import collections
import contextlib
import copy
import csv
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import re
import signal
import statistics
import sys
import types
import unittest.mock
import warnings

import torch

import checkpoint
import train_pipeline_gpipe as gpipe
from checkpoint import Parser, UsageError, whole
from model import (PRESETS, LlamaConfig, balanced, check_positions, checkpointing_plan, chunk_order,
                   config_from_hf, config_from_preset, describe_layout, estimated_costs, from_sizes,
                   layer_checkpointing, loss_chunks, parameter_counts, stage_costs)
from train_pipeline_gpipe import SCHEDULES, SINGLE_STAGE, V_SHAPED, stage_ids

# The throughput the step times are given at: 40 % of an H100's dense bf16 peak, a typical sustained rate.
ASSUMED_FLOPS = 0.4 * 989e12
HEADROOM = 0.1  # of a GPU's memory, left to CUDA's context and the allocator's fragmentation
VOCAB_SIZE = 8192  # prepare_data.py's default tokenizer
# The flags plan.py shares with the training scripts: copied from train_pipeline_gpipe.py's parser, so their
# names, types, defaults and help are the script's (--schedule is declared here: it also takes afab).
SHARED = ("model", "layers", "init_from", "seq_len", "document_masking", "batch_size", "microbatches",
          "accumulate", "stages_per_rank", "split", "dp", "tp", "sequence_parallel", "loss_chunks",
          "activation_checkpointing", "device", "precision", "async_checkpoint", "seq_chunks")


# ----------------------------------------------------------------------------------------------------------
# Sizes

def plan_config(args) -> LlamaConfig:
    """The model the flags describe: --init-from's shape (a Hugging Face directory or a checkpoint of this
    project) or a config.json's given as --model, else the preset's with --layers and the vocabulary of --data or
    --vocab-size. Refuses what the training scripts refuse with --init-from (checkpoint.model_config): --model,
    --vocab-size or another --layers beside it, a dataset with more tokens than the model has embeddings."""
    data_vocab = read_vocab(args.data) if args.data is not None else None
    if args.init_from is None and not is_config_json(args):
        return config_from_preset(checkpoint.model_preset(args.model, device_type(args)),
                                  data_vocab or args.vocab_size or VOCAB_SIZE, args.layers)
    source = args.init_from or args.model
    flag = "--init-from" if args.init_from else "--model"
    if args.vocab_size is not None:
        raise UsageError(f"--vocab-size {args.vocab_size}: the vocabulary comes from {flag} {source}; "
                         "leave --vocab-size out")
    if args.init_from is None:  # a Hugging Face config.json (plan.py only): as --init-from reads one
        try:
            with open(args.model) as f:
                config = config_from_hf(json.load(f))
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {args.model}: cannot read it as a Hugging Face config.json ({e})") from None
        if args.layers is not None and args.layers != config.num_hidden_layers:
            raise UsageError(f"--layers {args.layers}: the model's shape comes from {args.model} "
                             f"({config.num_hidden_layers} layers); leave --layers out")
    else:
        config, _ = checkpoint.source_config(source, args)  # refuses --model or another --layers beside it
    if data_vocab is not None and data_vocab > config.vocab_size:
        raise UsageError(f"--data {args.data}: {data_vocab} tokens, but {source} has embeddings for "
                         f"{config.vocab_size}")
    return config


def is_config_json(args) -> bool:
    """Whether --model names a Hugging Face config.json rather than a preset."""
    return args.model is not None and args.model.endswith(".json")


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


def bf16(args) -> bool:
    """--precision as the scripts read it: auto is bf16 on GPUs, fp32 on the CPU."""
    return args.precision == "bf16" or (args.precision == "auto" and device_type(args) == "cuda")


def shards(args, tp: int) -> int:
    """The pieces of the sequence a stage's positions are cut into: tp with sequence parallelism, else 1."""
    return tp if args.sequence_parallel else 1


def sent_bytes(per_rank: list[list[int]], num_stages: int, m: int, tokens: float, hidden: int,
               bf16: bool = False) -> list[float]:
    """Bytes each pipeline rank (each of its tensor-parallel ranks) sends to other ranks in a step: each
    microbatch's hidden states of `tokens` positions to the next stage, and their gradient to the previous one,
    where that stage is on another rank; in fp32, or bf16 under --precision bf16."""
    rank_of = {s: r for r, stages in enumerate(per_rank) for s in stages}
    return [m * tokens * hidden * (2 if bf16 else 4) * sum(
        (s + 1 < num_stages and rank_of[s + 1] != r) + (s > 0 and rank_of[s - 1] != r) for s in stages)
        for r, stages in enumerate(per_rank)]


def stage_params(config: LlamaConfig, layout: list[range], tp: int = 1, vocab: int = 1) -> list[float]:
    """Parameters of each stage that one of its tensor-parallel ranks holds: its layers, the embedding on the
    first, the final norm and the head on the last (a tied head is a copy there, unless one stage holds both).
    Tensor parallelism splits every matrix tp ways; the norms' gains are held whole by each rank. vocab > 1
    (--vocab-parallel over that many stages): every stage holds its slice of the embedding's and of the head's rows
    (slice_rows; tied: one slice serves both), the last the final norm. With --dp the slices count as sharded over
    the replicas as FSDP2 shards the layers (rank_memory's 1/dp: what sharding them gives; replicated, a replica
    holds its rank's whole slice, its gradient and AdamW state)."""
    if vocab > 1:
        layer, h = parameter_counts(config, tp)["layer"], config.hidden_size
        return [len(layers) * layer + slice_rows(config, vocab, s) * h * (1 if config.tie_word_embeddings else 2)
                + (h if s == len(layout) - 1 else 0) for s, layers in enumerate(layout)]
    params = parameter_counts(config, tp)
    layer, embed, last = params["layer"], params["embed"], params["head"]
    if len(layout) == 1 and config.tie_word_embeddings:
        last -= embed
    return [len(layers) * layer + (embed if i == 0 else 0) + (last if i == len(layout) - 1 else 0)
            for i, layers in enumerate(layout)]


def startup_bytes(config: LlamaConfig, layout: list[range], stages: list[int], dp: int, tp: int,
                  vocab: int = 1) -> float:
    """The most bytes a rank holds at start-up (model.materialize): it allocates its stages' shards one stage after
    the other and, when sharded, draws each tensor of the stage whole, one at a time, to keep its piece: the
    shards so far and the largest whole tensor of the stage at hand (vocab > 1: stage_params' slices, each drawn from
    the whole matrix, a DTensor over the pipeline ranks, as a shard is)."""
    h, params = config.hidden_size, stage_params(config, layout, tp, vocab)
    held = peak = 0.0
    for s in stages:
        largest = max(h, *((config.num_attention_heads * config.head_dim * h, config.intermediate_size * h)
                           if len(layout[s]) else ()),  # q and o, gate, up and down (k and v are smaller)
                      *((config.vocab_size * h,) if vocab > 1 or s in (0, len(layout) - 1) else ()))  # embedding, head
        held += 4 * params[s] / dp
        peak = max(peak, held + (4 * largest if dp * tp * vocab > 1 else 0))  # unsharded: each drawn in place
    return peak


def activation_bytes(config: LlamaConfig, tokens: int, seq_len: int, bf16: bool, tp: int = 1,
                     chunks: int = 1, shards: int = 1, documents: bool = False, mask_bytes: float = 0.0
                     ) -> dict[str, float]:
    """Bytes one microbatch of `tokens` tokens leaves saved for backward on one tensor-parallel rank: per
    decoder layer (all of it, and only its input with activation checkpointing), for the head and loss, and
    for the embedding; and "loss", what the loss holds for a moment (fp32 logits and their softmax and
    gradient: of the whole microbatch with --loss-chunks 1, of one piece otherwise). fp32 on the CPU (what
    benchmark.py's ActivationMeter counts on this model); under bf16 autocast the projections' inputs and
    attention run in bf16, norms, residuals and the loss in fp32. Tensor parallelism splits what is per head
    or per MLP channel, and the logits; sequence parallelism (shards = tp) the norms' and residuals' values,
    which are whole on every rank without it; the projections' inputs are whole (gathered) either way.
    mask_bytes: the CPU's (chunk_costs), with documents the float copy of the dense mask each layer keeps."""
    h, heads, kv, d, inter = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size)
    e, vocab = 2 if bf16 else 4, config.vocab_size / tp
    # fp32: norms' inputs and normalized values (4h), their rstd (2), attention's logsumexp (heads);
    # compute dtype: the projections' inputs (2h), q, k, v and the attention output, the MLP's 4 intermediates.
    layer = tokens * (4 * ((4 * h + 2) / shards + heads / tp) + e * (2 * h + (2 * heads + 2 * kv) * d / tp
                                                                      + 4 * inter / tp))
    # The rotary cos/sin tables: one for all sequences (positions 0 .. seq - 1), or with --document-masking one
    # per sequence (positions per document). Its mask: a GPU's FlexAttention keeps a few bytes per 128 x 128 block.
    layer += 2 * (tokens if documents else seq_len) * d * e + (mask_bytes * tokens * seq_len if documents else 0)
    # The final norm's input, normalized values and rstd, and the targets; then the chunked loss keeps the fp32
    # hidden states it starts each piece from, the plain loss the head's input (compute dtype) and the fp32
    # log-softmax of the whole logits.
    head = tokens * (4 * (2 * h + 1) / shards + 8 + (e * h + 4 * vocab if chunks == 1 else 4 * h / shards)) + 4
    loss = 3 * 4 * tokens / chunks * vocab  # a piece's logits, their log-softmax, then their gradient
    # Between a stage's input gradient and its weight gradient (the zero-bubble schedules' I and W), torch keeps
    # the gradient of the output of each op that multiplies by a weight: per layer the two norms' (fp32) and the
    # seven projections' (compute dtype; o's and down's are whole under tensor parallelism, before their
    # all-reduce), on the last stage the final norm's and the head's: the whole logits' gradient, in pieces too.
    # The plain loss's log-softmax goes at I (torch detaches the loss then, freeing what only it reached).
    weight_grad = tokens * (2 * 4 * h / shards + e * (2 * h + (heads * d + 2 * kv * d + 2 * inter) / tp))
    head_grad = tokens * (4 * h / shards + e * vocab - (4 * vocab if chunks == 1 else 0))
    # With checkpointing, what W reads again of what I recomputed (model.checkpoint_once keeps it between them):
    # the inputs of the ops that multiply by a weight, the norms' normalized values (fp32) and the projections'
    # inputs (q/k/v's one, o's, gate/up's one, down's).
    weight_inputs = tokens * (4 * 2 * h / shards + e * (2 * h + heads * d / tp + inter / tp))
    # Selective checkpointing (model.SELECTIVE_SAVE): the layer's input and what its kept ops give out, in the
    # compute dtype: the seven projections' outputs (o's and down's whole under tensor parallelism, partial sums
    # before their reduction; with sequence parallelism also the reduce-scatters' pieces), attention's output and
    # its fp32 logsumexp.
    selective = tokens * (4 * h / shards + 4 * heads / tp + e * ((2 * heads + 2 * kv) * d / tp + 2 * inter / tp
                                                                 + 2 * h + (2 * h / tp if shards > 1 else 0)))
    return {"layer": layer, "layer_checkpointed": tokens * h * 4 / shards, "layer_selective": selective,
            "head": head, "embed": tokens * 8,
            "loss": loss,
            "weight_grad": weight_grad, "head_grad": head_grad, "weight_inputs": weight_inputs}


KEPT = {"none": "layer", "selective": "layer_selective", "full": "layer_checkpointed"}  # a layer's, per mode


def layer_modes(layout: list[range], checkpointing) -> list[list[str]]:
    """Each stage's layers' checkpointing (none, selective, full): checkpointing is --activation-checkpointing's
    SPEC, a bool (full or none), or model.checkpointing_plan's entries, one per stage."""
    entries = checkpointing if isinstance(checkpointing, list) else checkpointing_plan(checkpointing, len(layout))
    return [layer_checkpointing(entry, len(layers)) for entry, layers in zip(entries, layout)]


def stage_held(layout: list[range], sizes: dict, checkpointing) -> list[float]:
    """Activation bytes each stage holds per microbatch, from its forward to its backward (checkpointing: as
    layer_modes reads it)."""
    return [sum(sizes[KEPT[mode]] for mode in modes)
            + (sizes["embed"] if s == 0 else 0) + (sizes["head"] if s == len(layout) - 1 else 0)
            for s, modes in enumerate(layer_modes(layout, checkpointing))]


def stage_between(layout: list[range], sizes: dict, checkpointing: bool = False) -> list[float]:
    """Bytes a stage adds from a microbatch's input gradient to its weight gradient: the output gradients its W
    starts from, less what its I frees (on the last stage with the plain loss: fewer). None on the first stage,
    which torch runs whole at W. With checkpointing also what W reads of each layer's recomputation, kept from
    I's (model.checkpoint_once): the inputs of its weights' ops (selective too: none of them is a kept op's
    output, or each is recomputed from one)."""
    return [0.0 if s == 0 else sum(sizes["weight_grad"] + (sizes["weight_inputs"] if mode != "none" else 0.0)
                                   for mode in modes) + (sizes["head_grad"] if s == len(layout) - 1 else 0.0)
            for s, modes in enumerate(layer_modes(layout, checkpointing))]


def recomputing(layout: list[range], sizes: dict, checkpointing, stages) -> float:
    """What a rank's recomputation adds for a moment (the rest of one layer's activations, while it recomputes
    it): a layer's whole with full checkpointing on any of `stages`, what selective does not keep with
    selective, else nothing."""
    modes = {mode for s, stage_modes in enumerate(layer_modes(layout, checkpointing)) if s in stages
             for mode in stage_modes}
    return sizes["layer"] if "full" in modes else sizes["layer"] - sizes["layer_selective"] if "selective" in modes \
        else 0.0


def split_backward(backward: list[float], again: list[float], head_again: float) -> tuple[list, list]:
    """Each stage's I and W time from its full backward B (which includes one recomputation, `again`) and the
    chunked loss's recomputed head forward (`head_again`, on the last stage): I and W each take half of the
    rest. torch 2.13's split backward: the first stage's I does nothing and its W is the whole backward (stage 0
    has no input gradient to hurry); another stage's I recomputes its checkpointed layers, once, and its W reads
    what I recomputed (model.checkpoint_once; torch.utils.checkpoint alone recomputes once per autograd call, and
    W makes one per weight: 9 a layer, measured 2 in I and 18 in W on 2 layers). The chunked loss's pieces, torch's
    checkpoint (their recomputed logits are not kept from I to W), run the head once more at W."""
    last = len(backward) - 1
    half = [(b - r) / 2 for b, r in zip(backward, again)]
    return ([0.0] + [h + r for h, r in zip(half[1:], again[1:])],
            [backward[0]] + [h + (head_again if s == last else 0.0) for s, h in enumerate(half) if s > 0])


def rank_memory(params: float, dp: int, peak: float, peak_checkpointed: float, loss: float, layer: float,
                checkpointing: bool, bf16: bool = False, startup: float = 0.0,
                flagged: tuple[float, float] | None = None) -> dict[str, float]:
    """Bytes one GPU of a pipeline rank holds: its parameters (fp32), gradients and AdamW state, 1/dp of them
    with FSDP, and the whole stage's parameters (bf16 under --precision bf16) and gradients (fp32, as reduced)
    gathered during a step when dp > 1; activations
    at the schedule's worst moment, without and with checkpointing (which holds one layer's full activations
    for a moment while it recomputes it); the loss's logits on the last stage; the peak of its start-up
    (startup_bytes). "total": the most of a step, as flagged, or of the start-up. flagged: the activations' peak
    under another --activation-checkpointing (selective, per stage) and what its recomputation adds for a moment
    (recomputing): "activations_flagged", counted in the total instead."""
    row = {"param": 4 * params / dp, "grad": 4 * params / dp, "optimizer": 8 * params / dp,
           "gathered": (6 if bf16 else 8) * params if dp > 1 else 0, "activations": peak,
           "activations_checkpointed": peak_checkpointed} | (
        {"activations_flagged": flagged[0]} if flagged is not None else {}) | {"loss": loss}
    row["startup"] = startup
    row["total"] = max(row["startup"], row["param"] + row["grad"] + row["optimizer"] + row["gathered"] + loss + (
        sum(flagged) if flagged is not None else peak_checkpointed + layer if checkpointing else peak))
    return row


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
    if name in ("zbh1", "zbh2"):  # the Zero Bubble paper's handcrafted orders, fixed as torch's are
        return zbh_orders(pp, m, int(name[-1]))
    num_stages = pp * (2 if name in V_SHAPED else stages_per_rank)
    # Rank 0's schedule object computes every rank's order (pipeline_order holds them all): build it once.
    placeholders = [types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=s,
                                          is_first=s == 0, is_last=s == num_stages - 1, submod=torch.nn.Module())
                    for s in stage_ids(name, 0, pp, stages_per_rank)]
    # Only the order is wanted: skip the lowering to a runtime schedule with communication (a private step of
    # torch's multi-stage schedules, most of their construction time; it leaves pipeline_order as it is).
    runtime = torch.distributed.pipelining.schedules._PipelineScheduleRuntime
    with warnings.catch_warnings(), unittest.mock.patch.object(runtime, "_prepare_schedule_with_comms",
                                                               lambda *args, **kwargs: None):
        warnings.simplefilter("ignore")
        table = SCHEDULES[name](placeholders, n_microbatches=m).pipeline_order
    return {r: [acts for acts in map(_actions, filter(None, table[r])) if acts] for r in range(pp)}


def zbh_orders(pp: int, m: int, warmup: int) -> dict[int, list[list[tuple]]]:
    """ZB-H1 (warmup 1) and ZB-H2 (warmup 2), the Zero Bubble paper's handcrafted orders: 1F1B with each
    backward split into its input gradient (I, on the critical path) and its weight gradient (W). Rank r runs
    warmup x (pp - 1 - r) forwards ahead of 1F1B's one (ZB-H2: up to 2p microbatches in flight on rank 0), then
    F, I and, from its (warmup x r)-th I on, the oldest W; the W's left over close the step (the paper's, as its
    repository times them). A fixed order: the times do not change it. With fewer microbatches than the warm-up
    takes, the warm-up is cut to them (its repository asks for at least 2p)."""
    orders = {}
    for r in range(pp):
        ahead, lag = min(warmup * (pp - 1 - r), m - 1), min(warmup * r, m)
        acts = [[("F", r, i)] for i in range(ahead)]
        for i in range(m):
            acts += [[("F", r, ahead + i)]] if ahead + i < m else []
            acts += [[("I", r, i)]] + ([[("W", r, i - lag)]] if i >= lag else [])
        orders[r] = acts + [[("W", r, i)] for i in range(m - lag, m)]
    return orders


_KINDS = {kind: kind for kind in "FBIW"}  # torch's computation types are str enums: "F" finds FORWARD


def _actions(action) -> list[tuple]:
    if action.sub_actions:  # DualPipeV's overlapped forward and backward: run here one after the other
        return [a for sub in action.sub_actions for a in _actions(sub)]
    kind = _KINDS.get(action.computation_type)
    return [(kind, action.stage_index, action.microbatch_index)] if kind else []


_INPUTS: dict[tuple, tuple] = {}


def merged(acts: list[list[tuple]], rank: int, rank_of: dict) -> list[list[tuple]]:
    """Rank `rank`'s order as the scripts run it (model.merge_backwards): an I that its own W (the same stage and
    microbatch) follows next made one B where its gradient goes to no other rank (stage 0, or stage s - 1 on this
    rank: rank_of, stage -> rank); elsewhere a B would send it W's time later. Overlapped pairs stay."""
    out = []
    for group in acts:
        (kind, s, i), before = group[0], out[-1] if out else None
        if kind == "W" and len(group) == 1 and before == [("I", s, i)] and (s == 0 or rank_of[s - 1] == rank):
            out[-1] = [("B", s, i)]
        else:
            out.append(group)
    return out


def replay(orders: dict[int, list[list[tuple]]], forward: list[float], backward: list[float],
           held: list[float], between: list[float] | None = None, split: tuple | None = None,
           message: float = 0.0, merge: bool = True, chunks: tuple | None = None) -> dict:
    """Run the orders against the dependencies: stage s's forward of microbatch i after stage s - 1's, its
    backward (B, or I for the input gradient alone) after its forward and after stage s + 1's backward, a
    weight gradient (W) after its I. forward/backward: each stage's times; split: each stage's I and W times
    (split_backward; by default half a backward each); held: each stage's activation bytes per microbatch, kept
    from its forward to its B or W; between: the bytes an I adds until its W (the gradients the weight gradient
    needs); message: the time an output or its gradient takes to reach a stage on another rank (in flight while
    both ranks compute other things: the Zero Bubble paper's model); merge: an I followed on its rank by its own
    W runs as one B where its gradient stays on the rank, as the gpipe and tracer scripts run every order
    (merged, model.merge_backwards): a B's time, no gradients held between (with B = I + W the same times);
    chunks: --seq-chunks S's (S, share, bytes): microbatch i is chunk i % S of a sequence, its actions share[s][j]
    of stage s's times and holding bytes[s][j] from its forward to its backward (chunk_costs). Returns
    the step time, each rank's busy time, its peak bytes held, and the bubble (the idle share of all ranks'
    time)."""
    last = len(forward) - 1
    finished: dict[tuple, float] = {}  # ("F" or "G" (input gradient ready) or "W", stage, microbatch) -> time
    between = between or [0.0] * len(held)
    input_grad, weight_grad = split or ([b / 2 for b in backward], [b / 2 for b in backward])
    # Each kind of action: its time and what it changes in the bytes held, per stage.
    cost = {"F": forward, "B": backward, "I": input_grad, "W": weight_grad}
    change = {"F": held, "B": [-h for h in held], "I": between, "W": [-h - b for h, b in zip(held, between)]}
    if chunks:  # per (stage, chunk): each kind's time and change as above, of the chunk's own share and bytes
        S, share, kept = chunks
        cost = {k: [[t * f for f in share[s]] for s, t in enumerate(v)] for k, v in cost.items()}
        change = {"F": kept, "B": [[-h for h in row] for row in kept],
                  "I": [[b * f for f in share[s]] for s, b in enumerate(between)],
                  "W": [[-h - b * f for h, f in zip(kept[s], share[s])] for s, b in enumerate(between)]}

    def duration(kind, s, i) -> float:
        return cost[kind][s][i % S] if chunks else cost[kind][s]

    def needs(kind, s, i) -> tuple:
        if kind == "F":
            return (("F", s - 1, i),) if s > 0 else ()
        if kind == "W":
            return (("G", s, i),)
        return (("F", s, i), ("G", s + 1, i)) if s < last else (("F", s, i),)

    # Per rank, each element of its order as (what it waits for, each with whether it comes from another rank,
    # and its actions as (kind, stage, what they produce)): computed once per order (schedule_orders caches them:
    # replayed many times).
    if (id(orders), merge) not in _INPUTS or _INPUTS[id(orders), merge][0] is not orders:
        rank_of = {s: r for r, acts in orders.items() for group in acts for _, s, _ in group}
        steps = []
        for r, acts in orders.items():
            steps.append([])
            for group in merged(acts, r, rank_of) if merge else acts:
                needed, actions = [], []
                for kind, s, i in group:
                    needed += [(n, rank_of[n[1]] != r) for n in needs(kind, s, i)]
                    actions.append((kind, s, ("G" if kind in "BI" else kind, s, i)))
                steps[-1].append((needed, actions))
        _INPUTS[id(orders), merge] = orders, steps
    steps = _INPUTS[id(orders), merge][1]

    # Each rank runs its order in sequence; an action starts when the rank is free and its inputs are there.
    # Those times do not depend on which rank is advanced first: advance a rank until an input is missing, park
    # it on that input, and wake it when the input is produced.
    ranks = list(orders)
    position = [0] * len(ranks)
    clock, holding, peak, busy = ([0.0] * len(ranks) for _ in range(4))
    waiting: dict[tuple, list[int]] = {}
    awake = list(range(len(ranks)))
    while awake:
        index = awake.pop()
        order, at, time, now_held, most, spent = (steps[index], position[index], clock[index], holding[index],
                                                  peak[index], busy[index])
        while at < len(order):
            needed, actions = order[at]
            missing = None
            for n, sent in needed:
                t = finished.get(n)
                if t is None:
                    missing = n
                    break
                if sent:
                    t += message
                if t > time:
                    time = t
            if missing is not None:
                waiting.setdefault(missing, []).append(index)
                break
            for kind, s, key in actions:  # an overlapped pair: one after the other here
                took = cost[kind][s] if not chunks else cost[kind][s][key[2] % S]
                time += took
                spent += took
                finished[key] = time
                if key in waiting:
                    awake += waiting.pop(key)
                now_held += change[kind][s] if not chunks else change[kind][s][key[2] % S]
                if now_held > most:
                    most = now_held
            at += 1
        position[index], clock[index], holding[index], peak[index], busy[index] = at, time, now_held, most, spent
    position, clock, peak, busy = (dict(zip(ranks, v)) for v in (position, clock, peak, busy))
    if any(position[r] < len(steps[index]) for index, r in enumerate(ranks)):
        raise RuntimeError("the schedule's order cannot proceed: an action waits for one that never comes")
    step = max(clock.values())
    # Each rank's span, from its first action's start to its last's end: where ranks start and end apart (the
    # zero-bubble orders), what a step would take if the next one's forwards could start as each rank ends.
    span = {r: clock[r] - min(finished[key] - duration(kind, s, key[2]) for kind, s, key in steps[index][0][1])
            for index, r in enumerate(ranks) if steps[index]}
    return {"step": step, "busy": busy, "peak": peak, "bubble": 1 - sum(busy.values()) / (len(busy) * step),
            "span": span}


def span_bubble(result: dict) -> float:
    """The Zero Bubble paper's bubble rate of a replay: the idle share of the ranks' time with the longest rank
    span (a rank's time from its first action's start to its last's end) in place of the step, as if each rank
    began the next step as it ended this one (the paper's runs do: they bypass the optimizer's
    synchronization). The replay's bubble where the first rank spans the step (1F1B, ZB-H1); less where the
    ranks start and end apart (ZB-H2, ZB-2p)."""
    return 1 - sum(result["busy"].values()) / (len(result["busy"]) * max(result["span"].values()))


def flop_times(layout: list[range], costs: dict, scale: float = 1.0, recomputed: list[int] | None = None
               ) -> tuple[list, list, tuple]:
    """Each stage's forward and backward, and its I and W (split_backward), from per-token costs (FLOPs) times
    scale: a forward is a third of a stage's forward + backward, the backward the rest, with any recomputation:
    costs' own, or (recomputed, costs of none) that many layers' forward again on each stage."""
    again = [len(layers) * costs.get("recompute", 0.0) * scale for layers in layout] if recomputed is None else \
        [n * costs["layer"] / 3 * scale for n in recomputed]
    work = [w * scale - (r if recomputed is None else 0.0) for w, r in zip(stage_costs(layout, costs), again)]
    backward = [2 * w / 3 + r for w, r in zip(work, again)]
    return [w / 3 for w in work], backward, split_backward(backward, again, costs.get("head_recompute", 0.0) * scale)


def schedule_result(name, pp, m, stages_per_rank, times: tuple, held, between=None, message: float = 0.0,
                    orders: dict | None = None) -> dict:
    """The replay of one schedule (torch's order, or the orders given) with each stage's times (flop_times or
    measured_times) and bytes held."""
    forward, backward, split = times
    orders = orders or schedule_orders(name, pp, m, stages_per_rank)
    return replay(orders, forward, backward, held, between, split, message)


def chunk_refusal(name: str, chunks: int) -> str | None:
    """--seq-chunks S under schedule `name`: the scripts' one line where no chunk order is made for it (all but
    gpipe, afab and 1f1b: model.chunk_order's check), else None."""
    try:
        chunk_order("gpipe" if name == "afab" else name, 1, 1, [1] * chunks)
    except ValueError as e:
        return str(e)
    return None


@functools.lru_cache
def chunk_orders(name: str, pp: int, microbatches: int, chunks: int) -> dict[int, list[list[tuple]]]:
    """The order the scripts run for --seq-chunks S (model.chunk_order: microbatch s S + j is sequence s's chunk
    j; GPipe's forwards first, or Seq1F1B's), in schedule_orders' form."""
    order = chunk_order("gpipe" if name == "afab" else name, pp, microbatches, [1] * chunks)
    return {r: [acts for acts in map(_actions, filter(None, order.actions[r])) if acts] for r in range(pp)}


def chunk_costs(layout: list[range], lengths: list[int], attention: list[float], held: list[float], modes,
                kv_bytes: float, mask_bytes: float = 0.0, documents: bool = False
                ) -> tuple[int, list[list[float]], list[list[float]]]:
    """replay()'s chunks: each stage's share of a microbatch's time per chunk, and the bytes a chunk holds.
    Time: a chunk's FLOPs, the matrices' (6N a token) by its length, causal attention's (attention: its share of
    the stage's FLOPs) by length x (offset + length / 2), as each query reads its prefix: a later chunk costs more.
    Bytes: its tokens' share of a microbatch's (held), plus per layer the keys and values its attention keeps of
    other chunks (kv_bytes a token and layer): where the layer keeps its activations, the copy of the prefix's
    that attention saves (the chunk's own are in its activations already); where it recomputes (full or
    selective), its own in the layer's cache until its backward (model.py's kv_chunks; the last chunk's: none).
    mask_bytes (the CPU's: 4 a query and key and sequence; a GPU's FlexAttention keeps a few bytes a block): a chunk
    that attends with a mask (all but the first, every one with documents) keeps, per layer that keeps its
    activations, the float copy [length, offset + length] SDPA makes of the dense boolean mask (in place of the
    whole sequence's, which held counts with documents: activation_bytes)."""
    total, S = sum(lengths), len(lengths)
    offsets = [sum(lengths[:j]) for j in range(S)]
    share = [[(1 - a) * n / total + a * n * (o + n / 2) / (total * total / 2) for o, n in zip(offsets, lengths)]
             for a in attention]
    whole = [mask_bytes * total * total * documents * stage_modes.count("none") for stage_modes in modes]
    kept = [[(h - w) * n / total + kv_bytes * sum(o if mode == "none" else n * (j < S - 1) for mode in stage_modes)
             + mask_bytes * n * (o + n) * (j > 0 or documents) * stage_modes.count("none")
             for j, (o, n) in enumerate(zip(offsets, lengths))] for h, w, stage_modes in zip(held, whole, modes)]
    return S, share, kept


# ----------------------------------------------------------------------------------------------------------
# Zero-bubble orders generated from the pass times (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)

@contextlib.contextmanager
def _no_collector():
    """The generators make hundreds of thousands of small tuples and no cycles: the cyclic garbage collector,
    scanning them again and again, would take three quarters of their time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Stuck(Exception):
    """A generator's choice that cannot go on: an input not yet computed, or no W left to free memory."""


class _Timeline:
    """The orders the generators build, one action at a time, each timed as replay() times it: as early as its
    rank is free and its input has arrived (a message's time later from another rank). Also each rank's memory
    (cost and memory: {kind: per stage}; cap: per rank) and its idle time since its first action; approved: a
    previous attempt's idle time per rank, which the V scheduler's second and later attempts may spend."""

    def __init__(self, rank_of: list[int], m: int, cost: dict, memory: dict, cap: list, message: float,
                 approved: list | None = None):
        pp = max(rank_of) + 1
        self.rank_of, self.m, self.cost, self.memory, self.cap, self.message = rank_of, m, cost, memory, cap, message
        self.approved = approved or [0.0] * pp
        self.most, self.most_approved = 0.0, max(self.approved)  # the largest idle time, approved idle time
        self.end: dict[tuple, float] = {}  # (kind, stage, microbatch) -> when it ends
        self.done = collections.defaultdict(int)  # (kind, stage) -> how many
        self.free, self.used, self.idle, self.first = [0.0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp
        self.weights = [collections.deque() for _ in range(pp)]  # (stage, microbatch) with I done, W to do
        self.orders: dict[int, list[list[tuple]]] = {r: [] for r in range(pp)}

    def source(self, kind: str, s: int, i: int) -> tuple | None:
        last = len(self.rank_of) - 1
        if kind == "F":
            return ("F", s - 1, i) if s > 0 else None
        return ("I", s, i) if kind == "W" else ("I", s + 1, i) if s < last else ("F", s, i)

    def incoming(self, kind: str, s: int) -> float | None:
        """When the input of stage s's next action of this kind arrives from another rank (None: it comes from
        this rank, or is not computed yet)."""
        need = self.source(kind, s, self.done[kind, s])
        if need is None or self.rank_of[need[1]] == self.rank_of[s] or need not in self.end:
            return None
        return self.end[need] + self.message

    def can(self, kind: str, s: int, room: bool = False) -> bool:
        """Whether stage s has another action of this kind (F or I) to run, its input computed (and, with
        room, the memory for it under the cap)."""
        i, r = self.done[kind, s], self.rank_of[s]
        need = self.source(kind, s, i)
        return i < self.m and (need is None or need in self.end) and (
            not room or self.used[r] + self.memory[kind][s] <= self.cap[r] * (1 + 1e-12))

    def slack(self, r: int) -> float:
        """How much more rank r may idle without raising the most any rank idles (or was approved to)."""
        return max(self.most, self.most_approved - self.approved[r]) - self.idle[r]

    def put(self, kind: str, s: int) -> None:
        r = self.rank_of[s]
        if kind == "W":
            s, i = self.weights[r].popleft()
        else:
            i = self.done[kind, s]
        need, held = self.source(kind, s, i), self.used[r] + self.memory[kind][s]
        if i >= self.m or held > self.cap[r] * (1 + 1e-12):
            raise _Stuck
        start = self.free[r]
        if need is not None:
            ready = self.end.get(need)
            if ready is None:
                raise _Stuck
            if self.rank_of[need[1]] != r:
                ready += self.message
            if ready > start:
                start = ready
        if self.orders[r]:
            self.idle[r] += start - self.free[r]
            self.most = max(self.most, self.idle[r])
        else:
            self.first[r] = start
        self.free[r] = self.end[kind, s, i] = start + self.cost[kind][s]
        self.used[r] = held
        self.done[kind, s] = i + 1
        self.orders[r].append([(kind, s, i)])
        if kind == "I":
            self.weights[r].append((s, i))

    def room(self, r: int, need: float) -> None:
        """W's until rank r has `need` more bytes free under its cap."""
        while self.used[r] + need > self.cap[r] * (1 + 1e-12):
            if not self.weights[r]:
                raise _Stuck
            self.put("W", self.weights[r][0][0])

    def fill(self, r: int, ready: float | None, over: bool, under: bool) -> None:
        """W's into rank r's wait for an input that arrives at `ready`: each that ends by then; then one more
        that runs past it where the wait left would raise the most idle time (over) or would not (under)."""
        if ready is None:
            return
        while self.weights[r] and self.free[r] + self.cost["W"][self.weights[r][0][0]] <= ready:
            self.put("W", self.weights[r][0][0])
        if self.weights[r] and ready > self.free[r] and (over if ready - self.free[r] > self.slack(r) else under):
            self.put("W", self.weights[r][0][0])

    def flush(self, *ranks: int) -> None:
        """Every W still to do, of these ranks (all by default)."""
        for r in ranks or range(len(self.weights)):
            while self.weights[r]:
                self.put("W", self.weights[r][0][0])

    def longest(self) -> float:
        """The longest of the ranks' spans, from its first action's start to its last's end."""
        return max(free - first for free, first in zip(self.free, self.first))


@_no_collector()
def zb_orders(cost: dict, memory: dict, cap: list, m: int, message: float, by: str = "span",
              seeds: tuple = ()) -> dict[int, list[list[tuple]]]:
    """ZB-1p and ZB-2p (cap: p or 2p microbatches' activations per rank), the Zero Bubble paper's automatic
    heuristic, one stage per rank, from each stage's F, I and W times and a message's. As the paper: warm-up
    forwards as the cap allows before the first input gradient can arrive, each rank at least one ahead of the
    next; then F and I alternate, W's filling each wait (every W that ends in time, and one more where the wait
    would raise the largest idle time of any rank) and freeing memory for the cap; a rank two forwards ahead of
    the next may skip one. Three binary choices (a warm-up forward that delays the first I or not; the skip; a
    W into a wait that raises no maximum) are grid-searched, keeping the order with the shortest longest rank
    span (by="span", the paper's) or the shortest step (by="step": _least_step, with the seeds; by a tuple of
    both: both orders, from one generation). Unlike the paper: no ILP refinement after it (its repository, tag
    zero-bubble-v0.1.0, has it disabled and its Table 5 is the heuristic's alone); a rank never gets more warm-up
    forwards than the one before (where the repository's would fail). None: no order fits the cap."""
    pp, lines = len(cap), []
    F, I = cost["F"], cost["I"]
    last = pp - 1
    for early, skip, greedy in itertools.product((True, False), repeat=3):
        line = _Timeline(list(range(pp)), m, cost, memory, cap, message)
        try:
            for s in range(pp):
                line.put("F", s)
            # Warm-up: forwards until the first input gradient could reach the rank (`reach`, estimated).
            extra, reach = [0] * pp, line.end["F", last, 0] + I[last]
            for s in range(last - 1, -1, -1):
                held, clock = line.used[s], line.free[s]
                while 1 + extra[s] < m and held + memory["F"][s] <= cap[s] and (
                        clock + F[s] <= reach + message if early else clock < reach + message):
                    held, clock, extra[s] = held + memory["F"][s], clock + F[s], extra[s] + 1
                reach = max(clock, reach + message) + I[s]
            for s in range(1, pp):  # each rank fewer than the one before (unless both run all), never more
                while 0 < extra[s] and (extra[s] > extra[s - 1] or extra[s] == extra[s - 1] and 1 + extra[s] < m):
                    extra[s] -= 1
            for s in range(pp):
                for _ in range(extra[s]):
                    line.put("F", s)
            for s in range(last, -1, -1):
                line.put("I", s)
            for i in range(1, m):
                want = [line.done["F", s] < m for s in range(pp)]
                for s in range(last):
                    if not (want[s] and skip and line.done["F", s] >= line.done["F", s + 1] + 2):
                        continue
                    # When this rank's next input gradient could come: skip a forward that would delay it.
                    comes = line.free[s + 1] + F[s + 1] + I[s + 1] + message
                    freeing, held = 0.0, line.used[s] + memory["F"][s]
                    for t, _ in line.weights[s]:
                        if held <= cap[s]:
                            break
                        freeing, held = freeing + cost["W"][t], held + memory["W"][t]
                    if line.free[s] >= comes or line.free[s] + F[s] + freeing > comes and \
                            comes - line.free[s] <= line.slack(s):
                        want[s] = False
                for s in range(last - 1, -1, -1):  # a rank runs a forward only where the next one does
                    want[s] = want[s] and want[s + 1]
                for s in range(pp):
                    if want[s] and line.can("F", s):
                        line.room(s, memory["F"][s])
                        line.fill(s, line.incoming("F", s), True, greedy)
                        line.put("F", s)
                for s in range(last, -1, -1):
                    line.room(s, memory["I"][s])
                    line.fill(s, line.incoming("I", s), True, greedy)
                    if s == 0 and line.done["F", 0] == m:
                        line.flush(0)
                    line.put("I", s)
            line.flush()
        except _Stuck:
            continue
        lines.append(line)
    picks = {"span": lambda: min(lines, key=_Timeline.longest).orders if lines else None,
             "step": lambda: _least_step(lines, seeds, cost, memory, cap, message)}
    return picks[by]() if isinstance(by, str) else tuple(picks[b]() for b in by)


@_no_collector()
def zbv_orders(cost: dict, memory: dict, cap: list, m: int, message: float, by: str = "span",
               seeds: tuple = ()) -> dict[int, list[list[tuple]]]:
    """ZB-V, the Zero Bubble paper's V: rank r holds stage r (down) and 2p - 1 - r (up), so the last stage and
    the first input gradient are on rank 0, ordered under a memory cap per rank by the paper's cost-aware greedy
    scheduler (its Table 8 comes from it; its repository's v_schedule.py, tag zero-bubble-v0.1.0, re-implemented).
    A warm-up down the V and back up, more down-forwards where they fit the cap and end before the rank's first
    up-forward could start; then forwards alternate until each rank is ahead of the one above; then 2m rounds of
    an input gradient and a forward per rank, each stage chosen by which input is there, W's filling the waits
    (as zb_orders: two binary choices, before an up-stage I and before an F) and freeing memory. Each attempt is
    repeated allowing each rank the idle time the last one left it, while that lowers the largest; the best of
    the four choices is kept. Unlike the repository's: where it would stop on an assertion (an input not yet
    computed, a forward over the cap: few microbatches, stages of unlike sizes), this one leaves that action to
    a later round. None: no order fits the cap."""
    pp = len(cap)
    down, up = range(pp), [2 * pp - 1 - r for r in range(pp)]
    rank_of = [*down, *reversed(range(pp))]

    def attempt(fill_i: bool, fill_f: bool, approved: list | None) -> _Timeline:
        line = _Timeline(rank_of, m, cost, memory, cap, message, approved)
        for r in range(pp):
            line.put("F", down[r])
        for r in range(pp - 1, -1, -1):  # each rank's first up-forward, from the bottom of the V
            if r < pp - 1:
                comes = line.end["F", up[r + 1], 0] + message
                while line.used[r] + memory["F"][r] * (2 + 2 * r) <= cap[r] and line.free[r] + cost["F"][r] <= \
                        comes and line.done["F", r] < m - r:
                    for j in range(r + 1):
                        if line.can("F", down[j], room=True):
                            line.put("F", down[j])
            line.put("F", up[r])
        stages = [down, up]
        forwards = lambda r: line.done["F", down[r]] + line.done["F", up[r]]  # noqa: E731
        for r in range(1, pp):
            empty = 0  # passes in a row that ran no forward (the cap, on stages of unlike sizes: the rounds go on)
            while forwards(r) < forwards(r - 1) or line.done["F", up[r]] <= line.done["F", up[r - 1]] < m:
                ran = [line.put("F", s) for s in (stages[0][j] for j in range(pp - 1, r - 1, -1))
                       if line.can("F", s, room=True)]
                empty = 0 if ran else empty + 1
                if empty == 2:
                    break
                stages.reverse()
        while sum(line.done["I", s] for s in rank_of) < 2 * pp * m:  # 2m rounds, where each rank can go on
            # Each rank's next input gradient: the down stage's where it has caught up with the up stage's
            # and its input is there (or the up stage has none left), else the up stage's.
            first = [r for r in range(pp) if line.done["I", down[r]] < line.done["I", up[r]] and (
                r == pp - 1 or ("I", down[r + 1], line.done["I", down[r]]) in line.end or line.done["I", up[r]] >= m)]
            before = len(line.end)
            for r, s in [(r, down[r]) for r in reversed(first)] + [(r, up[r]) for r in range(pp) if r not in first]:
                if not line.can("I", s):
                    continue
                line.room(r, memory["I"][s])
                line.fill(r, line.incoming("I", s), s == down[r] or fill_i, False)
                line.put("I", s)
            for r in range(pp):
                f_down, f_up = line.done["F", down[r]], line.done["F", up[r]]
                if f_up >= m:
                    continue
                if f_up >= f_down:
                    if not line.can("F", down[r]):
                        continue
                    s = down[r]
                elif r == pp - 1 or ("F", up[r + 1], f_up) in line.end:
                    s = up[r]
                elif f_down < m and (r == 0 or ("F", down[r - 1], f_down) in line.end):
                    s = down[r]
                else:
                    continue
                line.room(r, memory["F"][s])
                line.fill(r, line.incoming("F", s), fill_f, False)
                line.put("F", s)
            if len(line.end) == before:
                raise _Stuck
        line.flush()
        return line

    best, tried = None, []
    for fill_i, fill_f in itertools.product((True, False), repeat=2):
        try:
            line = attempt(fill_i, fill_f, None)
        except _Stuck:
            continue
        tried.append(line)
        while True:  # again, each rank allowed the idle time the last attempt left it, while that helps
            try:
                again = attempt(fill_i, fill_f, line.idle)
            except _Stuck:
                break
            tried.append(again)
            if max(again.idle) >= max(line.idle):
                break
            line = again
        if best is None or max(line.idle) < max(best.idle):
            best = line
    picks = {"span": lambda: best and best.orders,
             "step": lambda: _least_step(tried, seeds, cost, memory, cap, message)}
    return picks[by]() if isinstance(by, str) else tuple(picks[b]() for b in by)


def _least_step(lines: list, seeds: tuple, cost: dict, memory: dict, cap: list,
                message: float) -> dict[int, list[list[tuple]]] | None:
    """Of a generator's orders (its timelines) and the seeds (other orders, such as torch's fixed one for the same
    placement: the caller gives those it admits), the one whose step is least; of those within STEP_TIE of it,
    the one whose fullest rank holds least. The paper's schedulers minimize each rank's span, the time from its
    first action to its last, as if each rank started the next step when it ended this one (its runs bypass the
    optimizer's synchronization); torch's runtime and the scripts' clipping synchronize every step, so the step
    from one start to the last rank's end is what a step costs there. (A timeline's step is replay()'s.)"""
    split, whole = (cost["I"], cost["W"]), [i + w for i, w in zip(cost["I"], cost["W"])]
    run = lambda orders: replay(orders, cost["F"], whole, memory["F"], memory["I"], split, message)  # noqa: E731
    steps = [(line.orders, max(line.free)) for line in lines] + [(orders, run(orders)["step"]) for orders in seeds]
    if not steps:
        return None
    least = min(step for _, step in steps)
    tied = [orders for orders, step in steps if step <= least * (1 + STEP_TIE)]
    return tied[0] if len(tied) == 1 else min(tied, key=lambda orders: max(run(orders)["peak"].values()))


# Steps this close are a tie (replayed, they differ by less than a run's steps do from each other, several %):
# the order that holds less is taken (the paper's V at 28.3B: torch's V's step within 0.01 %, two thirds its memory).
STEP_TIE = 1e-3


# The generated orders, by name: the torch schedule whose stage placement each has (one stage per rank, or the
# V), whose checks it takes; the memory cap of the automatic ones, in p microbatches of a rank's activations.
GENERATED = {"zbh2": "1f1b", "zb1p": "1f1b", "zb2p": "1f1b", "zbvauto": "zbvzerobubble"}
CAPS = {"zb1p": 1, "zb2p": 2, "zbvauto": 1}
# The fixed orders each automatic one starts from (schedule_orders' arguments): kept where its step is least.
SEEDS = {"zb1p": lambda pp, m: [("zbh1", pp, m, 1)], "zb2p": lambda pp, m: [("zbh1", pp, m, 1), ("zbh2", pp, m, 1)],
         "zbvauto": lambda pp, m: [("zbvzerobubble", pp, m, 2)]}


def placement(name: str) -> str:
    """The torch schedule a schedule's stages are placed as (itself, for torch's)."""
    return GENERATED.get(name, name)


def generated_orders(name: str, pp: int, m: int, times: tuple, held: list, between: list,
                     message: float) -> dict[int, list[list[tuple]]]:
    """A generated schedule's order for these stage times (flop_times or measured_times: torch's split
    backward, stage 0's all W) and bytes (stage_held, stage_between: torch holds a microbatch's activations
    until its W, and the output gradients from its I on). The cap of zb1p, zb2p and zbvauto: CAPS x p
    microbatches of the rank's stage's activations (1F1B's first rank holds p), and one microbatch's gradients
    between an I and its W. (On the V, 2p microbatches of the rank's larger stage: the paper's 2p chunks.)
    UsageError where no order fits it."""
    if name == "zbh2":
        return schedule_orders(name, pp, m, 1)
    forward, _, (input_grad, weight_grad) = times
    cost = {"F": forward, "I": input_grad, "W": weight_grad}
    memory = {"F": held, "I": between, "W": [-h - b for h, b in zip(held, between)]}
    stages = [stage_ids(placement(name), r, pp, 1) for r in range(pp)]
    cap = [CAPS[name] * pp * len(own) * max(held[s] for s in own) + max(between[s] for s in own) for own in stages]
    # Chosen by the step, which torch's runtime synchronizes (the paper's span is the table's extra column), among
    # the paper's attempts and the fixed orders of SEEDS that fit the cap: never predicted slower than those. The
    # V also takes torch's V, which it is to replace, whatever it holds (as much as torch's by name: on a rank
    # up to a microbatch's output gradients more than the cap); the attempts keep the cap.
    seeds = []
    for seed in SEEDS[name](pp, m):
        try:
            orders = schedule_orders(*seed)
        except ValueError:  # (torch's V refuses too few microbatches: no seed then)
            continue
        peak = replay(orders, forward, [i + w for i, w in zip(input_grad, weight_grad)], held, between)["peak"]
        if name == "zbvauto" or all(peak[r] <= cap[r] * (1 + 1e-12) for r in peak):
            seeds.append(orders)
    orders = (zbv_orders if name == "zbvauto" else zb_orders)(cost, memory, cap, m, message, "step", tuple(seeds))
    if orders is None:
        raise UsageError(f"--schedule {name}: no order of {m} microbatches on {pp} ranks fits its memory cap "
                         f"({CAPS[name]}p microbatches' activations); try another schedule or more microbatches")
    return orders


def write_schedule(path: str, orders: dict[int, list[list[tuple]]]) -> None:
    """The orders as torch 2.13 reads a custom schedule (_PipelineScheduleRuntime._load_csv(path,
    format="compute_only"), which lowers it with _add_send_recv): row r is pipeline rank r's compute actions
    in the order it runs them, a cell each, {stage}{F|I|W|B}{microbatch} (2I1: stage 2's input gradient of
    microbatch 1; B a whole backward), DualPipeV's overlapped pair as (0F1;3B0)OVERLAP_F_B; no empty cells (a
    rank waits where an input has not arrived). torch infers each stage's rank from the row it is in."""
    cell = lambda acts: "".join(f"{s}{kind}{i}" for kind, s, i in acts) if len(acts) == 1 else (  # noqa: E731
        "(" + ";".join(f"{s}{kind}{i}" for kind, s, i in acts) + ")OVERLAP_F_B")
    try:
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([cell(acts) for acts in orders[r]] for r in sorted(orders))
    except OSError as e:
        raise UsageError(f"--write-schedule {path}: {e.strerror}; give a file in a writable directory") from None


# ----------------------------------------------------------------------------------------------------------
# Reading the scripts' traces (--trace DIR: DIR/rank{R}.json, torch.profiler's Chrome trace of the last steps)
#
# Each profiled step is a "ProfilerStep#N" span. Compute is labelled by the scripts and the schedules:
#   "Forward i" / "Backward i"   torch's GPipe (one stage per rank): its blocking receives ("gloo:recv") are
#                                nested inside; the loss ("loss") follows the forward. torch 2.13's 1F1B
#                                labels nothing: under `benchmark.py run` (labelled_1f1b) the same labels
#                                surround its compute alone, its receives waited for before them
#   "PP:<action>"                torch's multi-stage schedules: "0F3", "1B0", "2I1", "2W1", "(0F1;3B0)OVERLAP_F_B"
#                                (and "PP:1SEND_F0", "PP:0RECV_B2", "PP:UNSHARD"..., which are not compute);
#                                a receive is posted in a RECV action and waited for in the compute action that
#                                needs it; the loss is inside the last stage's forward
#   "forward i" / "backward i"   the hand-written script (its loss inside the forward); its receives ("recv i")
#                                are outside them
# A "gloo:recv" span runs from posting the receive to the return of its wait. The rank is blocked from when it
# stops running operators to that return: from the end of the last operator (cpu_op) it ran before then, or
# from the post or the start of the compute action that waits (which holds the return) if later. Busy time
# is the compute labels and the loss minus those blocked intervals; a step's time is its ProfilerStep span.
#
# A GPU's trace (kineto's: events of cat "kernel", "gpu_memcpy", "gpu_memset" on a stream's tid, pid the
# device) is read from its kernels: on the CPU the labelled spans only launch them, the GPU runs them later.
# Each kernel belongs to the label (or operator, or autograd node: those of the backward run on autograd's own
# thread) whose span holds its launch, the cuda_runtime or cuda_driver event of the same "correlation"
# (cudaLaunchKernel, cuLaunchKernel: a compiled layer's Triton kernels, NCCL's). A part's time is its kernels'
# time on the GPU, overlaps counted once. NCCL's point-to-point kernels ("ncclDevKernel_SendRecv...", which
# run from their launch until the peer's data is through: one kernel for a batch of sends and receives, the
# CPU's "nccl:send 0->1" / "nccl:recv 0<-1" / "nccl:coalesced" spans only launch them) are the waiting, where
# no other kernel runs; NCCL's collectives (tensor parallelism's all-reduces, FSDP's) count as the work of the
# span that launched them, as gloo's do on the CPU. The steps synchronize the GPU before they end, so a step's
# kernels run within its ProfilerStep span. Gaps where the GPU runs nothing (its launches too slow, on a small
# model) count as neither busy nor waiting.

_SINGLE = re.compile(r"^(Forward|Backward|forward|backward) (\d+)$")
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def compute_actions(name: str) -> list[tuple] | None:
    """The compute a trace label stands for: [(kind F/B/I/W, stage or None (the rank's one stage), microbatch)],
    two for an overlapped forward and backward; None: not compute."""
    if found := _SINGLE.match(name):
        return [(found.group(1)[0].upper(), None, int(found.group(2)))]
    if not name.startswith("PP:"):
        return None
    action = name[3:]
    parts = action[1:action.index(")")].split(";") if action.startswith("(") and action.endswith(
        ")OVERLAP_F_B") else [action]
    actions = [(m.group(2), int(m.group(1)), int(m.group(3))) for m in map(_ACTION.match, parts) if m]
    return actions if actions and len(actions) == len(parts) else None


def _union(intervals) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _minus(a: list, b: list) -> list[tuple[float, float]]:
    """Merged intervals a without merged intervals b."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _clip(intervals: list, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # what kineto records of a GPU's streams
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the CPU's calls that launch it: cudaLaunchKernel, cuLaunchKernel...


def _gpu_kernels(events: list, path: str) -> list[tuple] | None:
    """A GPU trace's kernels (and copies) as (the time the CPU launched it, or None where the trace has no launch
    of it, its start and end on the GPU, whether it is NCCL's point-to-point kernel), the launched ones first, by
    launch time; None for a trace without any, a CPU run's."""
    work = [e for e in events if e.get("cat") in GPU_WORK]
    if not work:
        if any(e.get("cat") in LAUNCHES for e in events):
            raise ValueError(f"{path}: CUDA launches but no GPU kernel: its spans time the launches, not the "
                             "kernels; trace with torch.profiler's CUDA activity (the scripts' --trace does)")
        return None
    launched = {e["args"]["correlation"]: e["ts"] / 1e6 for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    kernels = [(launched.get(e.get("args", {}).get("correlation")), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                e["name"].startswith("nccl") and "SendRecv" in e["name"]) for e in work]
    if all(launch is None for launch, _, _, _ in kernels):
        raise ValueError(f"{path}: GPU kernels, but no launch of any (a cuda_runtime or cuda_driver event of the "
                         "same \"correlation\"): which labelled span ran them cannot be told; trace with "
                         "torch.profiler's CPU and CUDA activities together (the scripts' --trace does)")
    return sorted(kernels, key=lambda k: (k[0] is None, k[0] or 0.0))


def read_rank(path: str) -> dict:
    """One rank's trace (read once; again only when the file changed): see _read_rank."""
    stat = os.stat(path)
    return _read_rank(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)  # the tables ask the same traces many questions
def _read_rank(path: str, mtime_ns: int, size: int) -> dict:
    """One rank's trace, a CPU's or a GPU's: per profiled step (one with compute in it) its "time", "busy" and
    "waiting" (blocked in receives) seconds; per stage (None: the rank's only one) the median "forward" (with
    the loss) and "backward" (B, or I + W) seconds of one microbatch, from the actions that were not
    overlapped; "embed" and "head" (None where the rank has no embedding lookup or no "loss" span), the median
    "forward" and "backward" of one microbatch's embedding lookup and of its loss with the head in it;
    "segments" (start, end, "forward" | "backward" | "overlapped" | "waiting") and "spans" (start, end) of the
    steps, for pictures; "run", what the run measured (checkpoint.traced_run; None in a trace from before the
    scripts wrote it). Times in seconds on the trace's clock."""
    with open(path) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no ProfilerStep spans; not a trace written by the scripts' --trace")
    thread = steps[0].get("pid"), steps[0]["tid"]  # the main thread: the labels, the waits; on a CPU the backward
    compute, losses, recvs, op_ends, collectives, vocab = [], [], [], [], [], []
    lookups, made, nodes, ops = [], [], [], []  # embedding ops; (start, sequence number) of ops; autograd's backward nodes
    for e in events:
        start, end, name = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["name"]
        if e.get("cat") == "cpu_op" and name.startswith("autograd::engine::evaluate_function: "):
            nodes.append((start, end, e.get("args", {}).get("Sequence number")))  # on a GPU: autograd's thread
        if name in ("gloo:broadcast", "gloo:reduce", "gloo:all_reduce"):  # --vocab-parallel's, on gloo's own thread
            collectives.append((start, end))
        if (e.get("pid"), e["tid"]) != thread:
            continue
        if e.get("cat") == "cpu_op":
            op_ends.append(end), ops.append((start, end))
            number = e.get("args", {}).get("Sequence number")
            if number is not None and not name.startswith("autograd::engine::evaluate_function: "):
                made.append((start, number))
                if name == "aten::embedding":
                    lookups.append((start, end, number))
        elif name == "loss":
            losses.append((start, end))
        elif name.startswith("vocab "):  # --vocab-parallel's passes (model.VocabParallel): work, less their waits
            vocab.append((start, end))
        elif name == "gloo:recv":
            recvs.append((start, end))
        elif (actions := compute_actions(name)) is not None:
            compute.append((start, end, actions))
    kernels = _gpu_kernels(events, path)
    if kernels is None:  # the CPU's: the spans' own times, less the blocked intervals
        op_ends.sort()
        blocked = []
        for start, end in recvs:  # blocked from the post, the last operator before the wait returned, or the
            i = bisect.bisect_right(op_ends, end) - 1  # start of the compute action waiting: whichever is latest
            waiting_in = [s for s, e, _ in compute if s <= end <= e]
            blocked.append((max(start, op_ends[i] if i >= 0 else start, max(waiting_in, default=start)), end))
        running = _union(ops)  # a vocabulary pass's collective: blocked from the main thread's last operator before
        for start, end in collectives:  # its end, unless one runs then (a call left in flight: the rank computes)
            i, j = bisect.bisect_right(op_ends, end) - 1, bisect.bisect_right(running, (end, math.inf)) - 1
            if any(lo <= start and end <= hi for lo, hi in vocab) and not (j >= 0 and running[j][1] >= end):
                blocked.append((max(start, op_ends[i] if i >= 0 else start), end))
        blocked = _union(blocked)
        busy_in = lambda spans: _minus(_union(spans), blocked)  # noqa: E731
    else:  # a GPU's: the kernels launched in the spans; waiting where only point-to-point kernels run
        launches = [launch for launch, _, _, _ in kernels if launch is not None]
        ran = _union([(s, e) for _, s, e, p2p in kernels if not p2p])
        blocked = _minus(_union([(s, e) for _, s, e, p2p in kernels if p2p]), ran)

        def busy_in(spans):
            return _union([(s, e) for lo, hi in spans for _, s, e, p2p in kernels[bisect.bisect_left(
                launches, lo):bisect.bisect_right(launches, hi)] if not p2p])
    work = _union([(s, e) for s, e, _ in compute] + losses + vocab)
    rank = {"steps": [], "stages": {}, "segments": [], "spans": [], "run": trace.get("run")}
    for e in steps:
        lo, hi = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        done = _clip(work, lo, hi)
        if not done:  # after the last step: the profiler's tail
            continue
        waiting = _clip(blocked, lo, hi)
        rank["steps"].append({"time": hi - lo, "busy": _length(busy_in(done)), "waiting": _length(waiting)})
        rank["spans"].append((lo, hi))
        rank["segments"] += [(s, t, "waiting") for s, t in waiting]
    if not rank["steps"]:
        raise ValueError(f"{path}: no forward or backward labelled in any profiled step (torch 2.13's 1F1B labels "
                         "none: run the script under benchmark.py run, which labels it)")
    # Per microbatch: (step, stage, microbatch) -> seconds of forward (with a loss outside it) and backward.
    forward, backward, overlapped, step_of = {}, {}, set(), lambda t: bisect.bisect_right(
        [lo for lo, _ in rank["spans"]], t)
    for start, end, actions in compute:
        busy = busy_in([(start, end)])
        kind = "overlapped" if len(actions) > 1 else "forward" if actions[0][0] == "F" else "backward"
        rank["segments"] += [(s, t, kind) for s, t in busy]
        for k, stage, mb in actions:
            key = (step_of(start), stage, mb)
            if len(actions) > 1:
                overlapped.add(("F" if k == "F" else "B", key))
            else:
                table = forward if k == "F" else backward
                table[key] = table.get(key, 0.0) + _length(busy)
    labelled = _union([(s, e) for s, e, _ in compute])
    for start, end in losses:
        outside = busy_in(_minus([(start, end)], labelled))
        if outside:  # GPipe's and 1F1B's loss follows the forward of its microbatch
            before = [(s, a[0]) for s, e, a in compute if s <= start and len(a) == 1 and a[0][0] == "F"]
            if before:
                _, (_, stage, mb) = max(before, key=lambda found: found[0])
                key = (step_of(start), stage, mb)
                forward[key] = forward.get(key, 0.0) + _length(outside)
            rank["segments"] += [(s, t, "forward") for s, t in outside]
    for stage in sorted({key[1] for key in [*forward, *backward]}, key=lambda s: -1 if s is None else s):
        times = {name: [v for key, v in table.items()
                        if key[1] == stage and (name[0].upper(), key) not in overlapped]
                 for name, table in (("forward", forward), ("backward", backward))}
        rank["stages"][stage] = {name: statistics.median(v) if v else 0.0 for name, v in times.items()}
    # The embedding's and the loss's own share (the loss's span holds the head: the scripts apply it there): per
    # lookup or loss, its forward, and the backward of the autograd nodes its ops made (autograd numbers each
    # node as the op that makes it, and its backward's span carries the number).
    made.sort()
    starts, node_time = [t for t, _ in made], {}
    for start, end, number in nodes:
        node_time[number] = node_time.get(number, 0.0) + _length(busy_in([(start, end)]))

    def backward_of(lo: float, hi: float) -> float:
        return sum(node_time.get(n, 0.0) for n in {n for _, n in made[bisect.bisect_left(starts, lo):
                                                                       bisect.bisect_left(starts, hi)]})
    for part, spans in (("embed", [(s, e) for s, e, _ in lookups]), ("head", losses)):
        # (an evaluation's have no backward)
        pairs = [(_length(busy_in([(s, e)])), b) for s, e in spans if (b := backward_of(s, e)) > 0]
        rank[part] = {"forward": statistics.median(f for f, _ in pairs),
                      "backward": statistics.median(b for _, b in pairs)} if pairs else None
    return rank


def read_trace(trace_dir: str) -> dict[int, dict]:
    """Every rank's read_rank, by rank (the files rank{R}.json of a --trace DIR)."""
    files = {int(m.group(1)): name for name in os.listdir(trace_dir) if (m := re.fullmatch(r"rank(\d+)\.json", name))}
    if not files:
        raise ValueError(f"{trace_dir}: no rank{{R}}.json; not a directory written by the scripts' --trace")
    return {rank: read_rank(os.path.join(trace_dir, files[rank])) for rank in sorted(files)}


def traced_step_time(trace_dir: str) -> float:
    """The median profiled step, each step as long as its slowest rank's."""
    ranks = list(read_trace(trace_dir).values())
    return statistics.median(max(r["steps"][i]["time"] for r in ranks)
                             for i in range(min(len(r["steps"]) for r in ranks)))



# ----------------------------------------------------------------------------------------------------------
# Measured pass times, instead of the FLOP estimate: given (--layer-times, ...) or from a traced run (--trace)
#
# As the Zero Bubble paper (Qi et al., ICLR 2024) plans: a decoder layer's forward (F), input gradient (B) and
# weight gradient (W), the embedding's and the head's (with the final norm and the loss), and the time a message
# takes to another rank, each measured once; a stage's times are its parts' sums. Given its profiled times
# (docs/plan-vs-the-zero-bubble-paper.md), the replay gives its published bubbles.

PARTS = ("layer", "embed", "head")


MOST_MS = 3.6e6  # an hour: a pass of one microbatch, or a message, that takes longer is a slip, not a measurement


def pass_times(layer: bool):
    """argparse type: F,B,W, three numbers of milliseconds from 0 to MOST_MS (more: a step's sums overflow to
    inf); a layer's not all 0 (the split is balanced on it, and the embedding's and head's not given are scaled
    from it: all 0, no step takes any time)."""
    def parse(text: str) -> tuple[float, float, float]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 3 or not all(0 <= v <= MOST_MS for v in values) or (layer and not any(values)):
            raise argparse.ArgumentTypeError(
                f"must be three non-negative numbers of milliseconds up to an hour ({MOST_MS:,.0f}), forward, input "
                f"gradient and weight gradient{', not all 0' if layer else ''}, such as 5.2,5.1,3.9; got {text}")
        return values
    return parse


def stage_times(text: str) -> tuple[tuple[float, ...], ...]:
    """argparse type of --stage-times: F1,...,Fn/B1,...,Bn or F1,...,Fn/I1,...,In/W1,...,Wn, each stage's forward
    and backward (or input-gradient and weight-gradient) milliseconds of one microbatch, as many of each, from 0
    to MOST_MS, not all 0 (then no step takes any time)."""
    try:
        groups = tuple(tuple(float(v) for v in group.split(",")) for group in text.split("/"))
    except ValueError:
        groups = ()
    if len(groups) not in (2, 3) or len({len(g) for g in groups}) != 1 or not all(
            0 <= v <= MOST_MS for g in groups for v in g) or not any(v for g in groups for v in g):
        raise argparse.ArgumentTypeError(
            "must be each stage's forward milliseconds, a slash, their backward (or input gradient, a slash, weight "
            f"gradient), as many of each, numbers from 0 to an hour ({MOST_MS:,.0f}), not all 0, such as "
            f"10.5,10.6,36.8/25.2,21.1,52.4; got {text}")
    return groups


def given_stage_times(times: tuple, num_stages: int) -> tuple[list, list, tuple]:
    """--stage-times in seconds as measured_times gives them: each stage's forward, backward (I + W) and (I, W);
    without I and W given, a backward's halves, and the first stage's all W (torch's, as measured_times). A count
    other than the layout's stages is a UsageError."""
    if len(times[0]) != num_stages:
        raise UsageError(f"--stage-times: {len(times[0])} stages' times for a layout of {num_stages} stages; give "
                         "one per stage")
    forward, *backward = ([t / 1e3 for t in group] for group in times)
    whole = [sum(parts) for parts in zip(*backward)]
    grad, weight = backward if len(backward) == 2 else ([b / 2 for b in whole], [b / 2 for b in whole])
    return forward, whole, ([0.0] + grad[1:], [whole[0]] + weight[1:])


def given_passes(args, config: LlamaConfig) -> dict | None:
    """--layer-times, --embed-times and --head-times in seconds: {part: (F, B, W)}; an embedding's or head's not
    given is the layer's scaled by the FLOP estimate. None: not given."""
    if args.layer_times is None:
        return None
    costs = estimated_costs(config, args.seq_len)
    ms = lambda times: tuple(t / 1e3 for t in times)  # noqa: E731
    scaled = lambda part: tuple(t * costs[part] / costs["layer"] for t in args.layer_times)  # noqa: E731
    return {"layer": ms(args.layer_times), "embed": ms(args.embed_times or scaled("embed")),
            "head": ms(args.head_times or scaled("head"))}


# What a traced run must share with the plan for its parts' times to carry over: what one microbatch costs on a
# rank (each as the flags say it). The rest may differ (LAYOUT_FLAGS: the layer count, the processes, the
# replicas, the schedule, the microbatches): the times are per layer and per microbatch, read on the traced run's
# own layout (a stage's FSDP gather and reduce-scatter, once a step, fall in one microbatch's span, which the
# median leaves out).
SAME_WORK = {
    "model": lambda m: (f"a model of hidden {m['hidden']}, {m['heads']} heads ({m['kv_heads']} KV) of "
                        f"{m['head_dim']}, MLP {m['ffn']}, vocab {m['vocab']}"),
    "seq_len": "--seq-len {}".format,
    "rows": "microbatches of {} rows".format,  # of a replica: --batch-size / (--dp x --microbatches x --accumulate)
    "device": "--device {}".format,
    "dtype": lambda dtype: f"--precision {'bf16' if dtype == 'bfloat16' else 'fp32'}",
    "tp": "--tp {}".format,
    "sequence_parallel": lambda on: f"{'' if on else 'no '}sequence parallelism",
    "activation_checkpointing": lambda spec: "no --activation-checkpointing" if spec == "none" else
    f"--activation-checkpointing{'' if spec == 'full' else ' ' + spec}",
    "loss_chunks": "--loss-chunks {}".format,
    "document_masking": lambda on: f"{'' if on else 'no '}--document-masking",
}
LAYOUT_FLAGS = {"layers": "--layers", "processes": "--processes", "dp": "--dp", "schedule": "--schedule",
                "stages_per_rank": "--stages-per-rank", "batch_size": "--batch-size", "microbatches": "--microbatches",
                "accumulate": "--accumulate"}


def run_field(run: dict, key: str):
    """A field of a traced run (checkpoint.traced_run): the model's shape without its layer count, which is
    LAYOUT_FLAGS' "layers"."""
    if key in ("model", "layers"):
        return run["model"]["layers"] if key == "layers" else {k: v for k, v in run["model"].items() if k != "layers"}
    if key == "activation_checkpointing" and isinstance(run[key], bool):  # traced before the flag took a SPEC
        return "full" if run[key] else "none"
    return run[key]


def traced_run(args, ranks: dict[int, dict], planned: dict) -> dict:
    """The run the traces in --trace DIR measured (what each rank's trace says: checkpoint.traced_run), checked
    against the plan's (planned): refused in one line where a microbatch costs another time (SAME_WORK), where a
    --split given is not the traced one, where the files are not one run's, or where the trace does not say."""
    first = min(ranks)
    run = ranks[first]["run"]
    if not isinstance(run, dict) or not set(planned) <= set(run) or not isinstance(run["model"], dict) or not set(
            planned["model"]) <= set(run["model"]):
        raise UsageError(f"--trace {args.trace}: rank{first}.json does not say what run it measured (traced before "
                         "the scripts wrote that into the trace); trace the run again with the scripts' --trace")
    if run.get("vocab_parallel"):  # its embedding and head ran on every rank, outside the stages' passes
        raise UsageError(f"--trace {args.trace}: traced with --vocab-parallel, whose vocabulary passes run on every "
                         "rank; give its stage times (--vocab-parallel --stage-times), or trace a run without it")
    if run["seq_chunks"] > 1:  # its microbatches were chunks: a part's time there is a chunk's, not a sequence's
        raise UsageError(f"--trace {args.trace}: traced with --seq-chunks {run['seq_chunks']}, whose microbatches are "
                         "chunks of a sequence; trace a run of whole sequences (--seq-chunks 1)")
    other = next((r for r in ranks if ranks[r]["run"] != run), None)
    if other is not None or sorted(ranks) != list(range(run["processes"])):
        raise UsageError(f"--trace {args.trace}: holds {len(ranks)} rank files, not the {run['processes']} of one "
                         f"run{f' (rank{other}.json traced another)' if other is not None else ''}; trace the run "
                         "again into an empty folder")
    split = ",".join(map(str, run["split"]))
    if args.split != "balanced" and args.split != split:
        raise UsageError(f"--split {args.split}: the traced run's split, {split}, comes from --trace {args.trace}, "
                         "and the plan balances the layers on its times; leave --split out")
    differ = [key for key in SAME_WORK if run_field(run, key) != run_field(planned, key)]
    if differ:
        raise UsageError(f"--trace {args.trace}: traced " + ", ".join(
            f"{SAME_WORK[k](run_field(run, k))} (this plan: {SAME_WORK[k](run_field(planned, k))})" for k in differ)
            + ": a part's time does not carry over to another microbatch; give the traced run's, or trace a run "
            "of these flags")
    return run


def traced_passes(args, run: dict, ranks: dict[int, dict]) -> dict:
    """The parts' times (seconds, one microbatch) in the traced run (traced_run), read on its own layout: the
    embedding's and the loss's with the head from their own operators (read_rank), a decoder layer's the rest of
    its stages' time over their layers. The hand-written script labels no loss: there the layer's time comes from
    the stages before the last, and the head's is the last stage's rest. A backward is cut into its input and
    weight gradient halves, as the FLOP estimate cuts it (the embedding's is all weight gradient)."""
    layout, dp, tp = from_sizes(run["split"]), run["dp"], run["tp"]
    pp = run["processes"] // (dp * tp)
    times, found = {}, {"embed": [], "head": []}
    for r in range(pp):
        traced, stages = ranks[r * dp * tp], stage_ids(run["schedule"], r, pp, run["stages_per_rank"])
        for s in stages:  # (the first replica's first tensor-parallel rank of pipeline rank r)
            key = None if list(traced["stages"]) == [None] and len(stages) == 1 else s
            if key not in traced["stages"]:
                raise UsageError(f"--trace {args.trace}: rank {r * dp * tp} traced no forward or backward of stage "
                                 f"{s}, which its run's {run['schedule']} gives it; trace the run again")
            times[s] = traced["stages"][key]
        for part, seen in found.items():
            seen += [traced[part]] if traced[part] else []
    last, zero = len(layout) - 1, {"forward": 0.0, "backward": 0.0}
    embed, head = (found["embed"] or [zero])[0], (found["head"] or [None])[0]
    # A layer's time, from stages whose other parts are known.
    known = [s for s in range(len(layout)) if head is not None or s != last]
    held = sum(len(layout[s]) for s in known)
    if not held:
        raise UsageError(f"--trace {args.trace}: the traced run labels no loss (the library and tracer scripts "
                         "do) and no stage before the last holds a layer: a layer's time cannot be told from the "
                         "head's; trace the hand-written script on 3 or more stages, or another script")
    layer = {k: max(0.0, sum(times[s][k] for s in known) - embed[k] - (head[k] if head else 0.0)) / held
             for k in ("forward", "backward")}
    head = head or {k: max(0.0, times[last][k] - len(layout[last]) * layer[k]) for k in ("forward", "backward")}
    halves = lambda t: (t["forward"], t["backward"] / 2, t["backward"] / 2)  # noqa: E731
    return {"layer": halves(layer), "embed": (embed["forward"], 0.0, embed["backward"]), "head": halves(head)}


def measured_times(layout: list[range], passes: dict) -> tuple[list, list, tuple]:
    """Each stage's forward, backward (B + W) and its (B, W) from the parts' measured times. torch runs the first
    stage's backward whole at W (it has no input gradient to hurry): its B takes no time, its W all of it."""
    last = len(layout) - 1
    sums = [[len(layers) * t + (e if s == 0 else 0.0) + (h if s == last else 0.0)
             for t, e, h in zip(*(passes[part] for part in PARTS))] for s, layers in enumerate(layout)]
    backward = [b + w for _, b, w in sums]
    return ([f for f, _, _ in sums], backward,
            ([0.0] + [b for _, b, _ in sums[1:]], [backward[0]] + [w for _, _, w in sums[1:]]))


def counts(layout: list[range]) -> str:
    """A layout as --split writes it: 3,3,0."""
    return ",".join(str(len(layers)) for layers in layout)


def pass_costs(passes: dict) -> dict[str, float]:
    """Each part's forward + backward time, as balanced and describe_layout weigh costs."""
    return {part: sum(passes[part]) for part in PARTS}


# ----------------------------------------------------------------------------------------------------------
# Vocabulary parallelism (issue 54; Yeung et al., MLSys 2025, arXiv 2411.05288): the embedding and the head with its
# loss split by vocabulary rows over all pipeline ranks, in the hand-written script's schedules

VOCAB_SCHEDULES = {"afab": "gpipe", "1f1b": "1f1b"}  # the hand-written script's, and the order each replays


def vocab_rows(config: LlamaConfig, pp: int) -> int:
    """Rows of the embedding and of the head each pipeline rank holds: the vocabulary over pp, the last slice
    padded to the others' size."""
    return -(-config.vocab_size // pp)


def without_vocab(parts: dict) -> dict:
    """Per-token costs (estimated_costs) or measured passes (given_passes) with the embedding and the head taking
    nothing: the layers alone, which a split balances under --vocab-parallel."""
    return {k: (tuple(0.0 for _ in v) if isinstance(v, tuple) else 0.0) if k.startswith(("embed", "head")) else v
            for k, v in parts.items()}


def vocab_bytes(config: LlamaConfig, tokens: int, pp: int, half: bool) -> float:
    """Bytes each rank sends per microbatch in the collectives over the pipeline group: the last stage's hidden
    states broadcast to every rank, their gradient summed back to it, the embedding's output slices summed to
    stage 0 and their gradient broadcast back (each pipelined: its bytes once over a GPU's link; bf16, or fp32
    under --precision fp32), and three all-reduces of one fp32 number per token (the softmax's maximum and sum,
    the target's logit; a ring: 2 (p - 1) / p of the bytes)."""
    return 4 * tokens * config.hidden_size * (2 if half else 4) + 3 * 2 * (pp - 1) / pp * 4 * tokens


def vocab_collectives(config: LlamaConfig, tokens: int, pp: int, dp: int, tp: int, half: bool, args) -> float:
    """Seconds per microbatch of the collectives (vocab_bytes), nothing overlapped: at --intra-node-bandwidth
    where the pipeline group is inside a node (tp, then dp, innermost), else --inter-node-bandwidth."""
    nodes = {r * dp * tp // args.gpus_per_node for r in range(pp)}
    bandwidth = (args.intra_node_bandwidth if len(nodes) == 1 else args.inter_node_bandwidth) * 1e9
    return vocab_bytes(config, tokens, pp, half) / bandwidth


def with_vocab(times: tuple, added: float) -> tuple[list, list, tuple]:
    """Stage times (flop_times, measured_times) of the layers alone, plus on every rank its share of the
    vocabulary layers and their collectives (added, seconds), counted in its backward: where the paper's Vocab-1
    runs its S and T passes between 1F1B's (the artifact's vocab-1 runs replay to their measured bubbles within 0.9
    points so)."""
    forward, backward, (grad, weight) = times
    return (forward, [b + added for b in backward],
            ([g + added / 2 for g in grad], [w + added / 2 for w in weight]))


def slice_rows(config: LlamaConfig, pp: int, rank: int) -> int:
    """The rows pipeline rank `rank` holds: torch.chunk's (model.keep_only's Shard(0)), vocab_rows on each rank but
    the last, which holds what is left."""
    return max(0, min(vocab_rows(config, pp), config.vocab_size - rank * vocab_rows(config, pp)))


def vocab_held(layout: list[range], sizes: dict, checkpointing, tokens: int, hidden: int) -> list[float]:
    """stage_held under --vocab-parallel, per microbatch from its forward to its backward, as the script holds it
    (model.VocabParallel): each stage's layers, the final norm's on the last stage; the head and the loss keep
    nothing for a backward (the output pass computes the head's gradient at once). Less, on the first stage, its
    input, which its first layer saves (held apart, all m at once: vocab_peaks), if it has a layer."""
    first = 4.0 * tokens * hidden if len(layout[0]) else 0.0  # fp32: embed_all's sum of the rows' lookups
    return [h + (tokens * 4 * (2 * hidden + 1) if s == len(layout) - 1 else 0.0) - (first if s == 0 else 0.0)
            for s, h in enumerate(stage_held(layout, without_vocab(sizes), checkpointing))]


def vocab_peaks(result: dict, held: list[float], schedule: str, m: int, tokens: int, hidden: int) -> dict:
    """A replay's peaks (of vocab_held's bytes) as the script's --vocab-parallel holds them, its plainer variant
    than the paper's Vocab-1 (p + 2 microbatches' activations): the layers' as without the flag; on the first rank
    the step's m input embeddings from its start (embed_all embeds them all at once) and each one's gradient from
    its backward to the step's end (embed_backward), in AFAB's order or 1F1B's (p in flight); on the last rank the
    hidden states' gradient of each microbatch from its output pass to its backward: 1F1B's one at a time (its
    backward follows), AFAB's all m (every pass between the phases); a pass's logits slice is gone before the
    next (rank_memory's loss column, vocab_transient)."""
    embedding, last = 4.0 * tokens * hidden, len(result["peak"]) - 1  # fp32, each: the embedding's dtype
    cap = m if schedule == "gpipe" else last + 1  # microbatches in flight on the first rank at the j-th backward
    first = max([min(cap, m - j) * held[0] + (m + j) * embedding for j in range(m)] + [2 * m * embedding])
    return {**result, "peak": {r: first if r == 0 else p + (embedding * (m if schedule == "gpipe" else 1)
                                                             if r == last else 0.0)
                               for r, p in result["peak"].items()}}


def vocab_transient(config: LlamaConfig, tokens: int, pp: int, chunks: int, half: bool) -> float:
    """What a rank's output pass holds for a moment (rank_memory's loss column), every rank alike: one loss piece's
    fp32 logits slice (V / p rows), their exponentials and their gradient (3 x 4 bytes each); the head's gradient
    summed over the pieces and each piece's product (2 slices' worth, fp32); the hidden states broadcast (compute
    dtype) and their gradient's pieces and sum (fp32)."""
    rows, h = vocab_rows(config, pp), config.hidden_size
    return 3 * 4 * tokens / chunks * rows + 2 * 4 * rows * h + tokens * h * ((2 if half else 4) + 2 * 4)


def check_vocab_parallel(args, pp: int) -> None:
    """What --vocab-parallel needs (UsageError): a hand-written schedule, two or more pipeline ranks, no --tp."""
    if args.schedule not in VOCAB_SCHEDULES:
        raise UsageError(f"--vocab-parallel: the hand-written script's schedules only (--schedule afab or 1f1b), "
                         f"not {args.schedule}")
    if pp < 2:
        raise UsageError("--vocab-parallel: splits the vocabulary over the pipeline ranks; give 2 or more "
                         "(--processes / (--dp x --tp))")
    if args.tp > 1:
        raise UsageError(f"--tp {args.tp}: --vocab-parallel is planned over the pipeline group alone; leave --tp "
                         "out")


# ----------------------------------------------------------------------------------------------------------
# Checking the flags: the training script's own checks

def script_args(args, schedule: str, split: str | None = None) -> argparse.Namespace:
    """The Namespace train_pipeline_gpipe.py would run with: its defaults, and the flags plan.py shares."""
    ns = gpipe.build_parser().parse_args([])
    for name in SHARED:
        setattr(ns, name, getattr(args, name))
    ns.schedule = schedule = placement(schedule)  # a generated order: checked as the torch schedule placed alike
    ns.split = args.split if split is None else split
    ns.stages_per_rank = ns.stages_per_rank or (1 if schedule in SINGLE_STAGE else 2)  # as the script's main does
    if is_config_json(args):
        # The scripts take a config.json's shape from --init-from (its directory: the command plan.py prints),
        # and check_args leaves a shape it does not know yet to stage_layout, which plan.py calls with it.
        ns.model, ns.init_from = None, args.init_from or os.path.dirname(args.model) or "."
    # check_args leaves the model's shape unchecked when --checkpoint-dir holds checkpoints (a resumed run):
    # a path that cannot exist keeps the plan from depending on the directory it is run in.
    ns.checkpoint_dir = os.path.join(os.devnull, "no-checkpoints")
    return ns


def script_check(ns: argparse.Namespace, args, schedule: str) -> None:
    """train_pipeline_gpipe.py's check_args; a generated order's refusal names it, not the schedule it is
    checked as."""
    try:
        gpipe.check_args(ns, args.processes, device_type(args), ns.init_from is None)
    except UsageError as e:
        raise UsageError(str(e).replace(f": {ns.schedule} ", f": {schedule} ")) from None


def check(args, config: LlamaConfig, schedule: str, split: str | None = None) -> tuple[argparse.Namespace,
                                                                                      list[range]]:
    """What train_pipeline_gpipe.py checks before it runs: the flags (check_args), then the layout on the
    model's shape (stage_layout: a layer per stage, --seq-len within its positions, --split). UsageError."""
    ns = script_args(args, schedule, split)
    script_check(ns, args, schedule)
    pp = args.processes // (args.dp * args.tp)
    num_stages = pp * len(stage_ids(ns.schedule, 0, pp, ns.stages_per_rank))
    layout = gpipe.stage_layout(config, num_stages, ns)
    if schedule not in GENERATED:  # (the generated orders take any number)
        check_microbatches(schedule, pp, args.microbatches, num_stages)
    return ns, layout


def check_microbatches(schedule: str, pp: int, m: int, num_stages: int) -> None:
    """What torch 2.13's schedules require of the microbatch count: the script gets it from the schedule's
    constructor, once its stages are built; plan.py builds none, so it says it here, the same requirement."""
    if schedule in ("1f1b", "dualpipev") and m < num_stages:
        raise UsageError(f"--microbatches {m}: {schedule} needs at least as many microbatches as stages "
                         f"({num_stages})")
    if schedule in ("interleaved1f1b", "interleavedzerobubble") and m % max(1, m // pp):
        raise UsageError(f"--microbatches {m}: {schedule} needs a multiple of max(1, microbatches // pipeline "
                         f"ranks); use a multiple of {pp}")


# ----------------------------------------------------------------------------------------------------------
# The report

def least_checkpointing(args, config, layout: list[range], sizes: dict, stages_of: dict, params: list, dp: int,
                        half: bool, peaks) -> str:
    """--activation-checkpointing auto (plan.py): on each pipeline rank the least recomputation whose total fits
    --gpu-memory (less HEADROOM, as the search leaves): its stages' layers none, then selective (no matmul
    recomputed), then the first 1, 2, ... of each stage's layers whole, up to all. A rank holding more microbatches
    (1F1B's and the interleaved schedules' first ranks) gets more. peaks(entries): each rank's activations at
    their peak under model.checkpointing_plan's entries (a replay). Printed, and returned as a SPEC; a rank that
    does not fit with every layer recomputed is a UsageError."""
    budget, pp, last = args.gpu_memory * 1e9 * (1 - HEADROOM), len(stages_of), len(layout) - 1
    level = lambda k, n: "none" if k == 0 else "selective" if k == 1 else min(k - 1, n)  # noqa: E731
    chosen, totals = {}, {}
    for k in range(max(len(layers) for layers in layout) + 2):
        entries = [level(k, len(layers)) for layers in layout]
        peak = peaks(entries)
        for r in (r for r in range(pp) if r not in chosen):
            totals[r] = rank_memory(sum(params[s] for s in stages_of[r]), dp, 0, 0,
                                    sizes["loss"] if last in stages_of[r] else 0, sizes["layer"], False, half,
                                    startup_bytes(config, layout, stages_of[r], dp, args.tp),
                                    (peak[r], recomputing(layout, sizes, entries, stages_of[r])))["total"]
            if totals[r] <= budget:
                chosen[r] = entries
    if len(chosen) < pp:
        r = min(set(range(pp)) - set(chosen))
        need = f"{totals[r] / (1 - HEADROOM) / 1e9:.3g} GB"
        raise UsageError(f"--gpu-memory {args.gpu_memory:g}: pipeline rank {r} needs {need} per GPU with every layer "
                         "recomputed (--activation-checkpointing full); give more --processes, --microbatches, or a "
                         "larger --gpu-memory")
    entries = [next(chosen[r][s] for r in chosen if s in stages_of[r]) for s in range(len(layout))]
    full = all(e == len(layers) for e, layers in zip(entries, layout))
    spec = "full" if full else entries[0] if len(set(entries)) == 1 and isinstance(entries[0], str) else ",".join(
        "0" if e == "none" else str(e) for e in entries)
    print(f"fits --gpu-memory {args.gpu_memory:g} with --activation-checkpointing {spec}: on each rank the least "
          f"recomputation that fits ({budget / 1e9:.3g} of {args.gpu_memory:g} GB, {HEADROOM:.0%} left to CUDA)")
    return spec


def plan(args) -> dict:
    """Print the plan (see the module's docstring) and return it: {"ranks": [per pipeline rank {"param", "grad",
    "optimizer", "gathered", "activations", "activations_checkpointed", "total"}, bytes], "schedules": {name:
    {"step" (seconds), "bubble", "activations", "activations_checkpointed", "split"}}, "compute_share": [per
    stage]; the hand-written schedules also as "afab --vocab-parallel" and "1f1b --vocab-parallel" (2 or more
    pipeline ranks, no --tp); with --trace also "passes" ({part: (F, B, W) seconds}), "split" (the counts balanced
    on them) and "traced" ({"split", "step", "replayed"}: the traced run's). A flag the scripts would refuse is a
    UsageError."""
    # The hand-written script's afab is GPipe's order; its 1f1b is the library's.
    schedule = "gpipe" if args.schedule == "afab" else args.schedule
    auto = args.activation_checkpointing == "auto"  # chosen below, once the layout is known
    args = argparse.Namespace(**{**vars(args), "activation_checkpointing": "none" if auto else
                                 args.activation_checkpointing})
    ns = script_args(args, schedule)
    script_check(ns, args, schedule)  # before reading files
    config = plan_config(args)
    ns, layout = check(args, config, schedule)
    processes, dp, tp, m, per_rank = args.processes, args.dp, args.tp, args.microbatches, ns.stages_per_rank
    pp, steps = processes // (dp * tp), args.accumulate  # K schedule steps of m microbatches: one optimizer step
    vp = args.vocab_parallel  # the memory table is its split's; the schedules show it beside the plain one
    S = args.seq_chunks  # --seq-chunks: each sequence in S chunks, the chunks run as microbatches
    if S > 1 and (why := chunk_refusal(args.schedule, S)):  # (the generated orders: placed as 1f1b, refused too)
        raise UsageError(why)
    if S > 1 and (vp or auto):
        other = "--vocab-parallel" if vp else "--activation-checkpointing auto"
        raise UsageError(f"--seq-chunks {S}: not planned with {other} yet; leave one out")
    if vp:
        check_vocab_parallel(args, pp)
        if auto:
            raise UsageError("--activation-checkpointing auto: not with --vocab-parallel yet; give none, selective, "
                             "full or one per stage")
    half = bf16(args)
    tokens = args.batch_size // (dp * m * steps) * args.seq_len  # one microbatch of one replica
    mask_bytes = (2 if half else 4) if device_type(args) == "cpu" else 0.0  # SDPA's copy of a dense mask, a pair
    chunks = loss_chunks(args.loss_chunks, config, (tokens // args.seq_len, args.seq_len), tp)
    sizes = activation_bytes(config, tokens, args.seq_len, half, tp, chunks, shards(args, tp), args.document_masking,
                             mask_bytes)
    stages_of = {r: stage_ids(placement(schedule), r, pp, per_rank) for r in range(pp)}
    report = {"ranks": [], "schedules": {}}
    print(f"plan: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{processes} processes = {pp} pipeline x {dp} data x {tp} tensor, --schedule {args.schedule}, "
          f"{m} microbatches of {tokens // args.seq_len} x {args.seq_len} tokens per replica"
          f"{f', each sequence in {S} chunks of {args.seq_len // S} tokens (--seq-chunks)' if S > 1 else ''}"
          f"{f' in each of {steps} schedule steps per optimizer step (--accumulate)' if steps > 1 else ''}, "
          f"{'bf16 autocast' if half else 'fp32'}{', sequence parallel' if shards(args, tp) > 1 else ''}")
    passes = given_passes(args, config)
    if args.trace:  # the traced run's times, if a microbatch there costs what it does here
        try:
            ranks = read_trace(args.trace)
        except (OSError, ValueError) as e:
            raise UsageError(f"--trace {args.trace}: {e}") from None
        env = types.SimpleNamespace(world_size=processes, device=torch.device(device_type(args)),
                                    dtype=torch.bfloat16 if half else torch.float32)
        planned = checkpoint.traced_run(ns, env, config, layout, chunks) | {"schedule": args.schedule,
                                                                           "rows": tokens // args.seq_len}
        run = traced_run(args, ranks, planned)
        passes = traced_passes(args, run, ranks)
        carried = [key for key in LAYOUT_FLAGS if run_field(run, key) != run_field(planned, key)]
        if carried:
            flags = lambda r: " ".join(f"{LAYOUT_FLAGS[k]} {run_field(r, k)}" for k in carried)  # noqa: E731
            print(f"--trace {args.trace}: traced at {flags(run)}, this plan at {flags(planned)}: the same "
                  f"microbatch ({run['rows']} x {run['seq_len']} tokens, the same layers, precision and --tp), "
                  "so its per-layer times carry over")
    if passes is None:  # the FLOP estimate: split over a stage's tensor-parallel ranks (their all-reduces not counted)
        costs = {k: v / tp for k, v in estimated_costs(config, args.seq_len, args.activation_checkpointing,
                                                       chunks).items()}
        # (costs recompute every layer where the flag says full; a SPEC per stage, or auto's, counts its own)
        timed = lambda lay: flop_times(lay, costs, tokens / ASSUMED_FLOPS, recomputed(lay))  # noqa: E731
    else:
        costs = pass_costs(passes)
        timed = lambda lay: measured_times(lay, passes)  # noqa: E731
    if args.stage_times:  # each stage's own, whatever its layers (a layout of another stage count: refused)
        timed = lambda lay: given_stage_times(args.stage_times, len(lay))  # noqa: E731
    message = args.message_time / 1e3

    def balance(spec: str, lay: list[range]) -> list[range]:  # measured: balanced on the measured times
        return balanced(config.num_hidden_layers, len(lay), costs) if passes and spec == "balanced" else lay

    def held(lay: list[range], checkpointing) -> tuple[list[float], list[float]]:
        return stage_held(lay, sizes, checkpointing), stage_between(lay, sizes, checkpointing)

    full_costs = args.activation_checkpointing == "full"

    def recomputed(lay: list[range]) -> list[int] | None:  # the layers each stage recomputes, where costs do not say
        spec = args.activation_checkpointing
        if spec in ("none", "full") and (spec == "full") == full_costs:
            return None
        return [modes.count("full") for modes in layer_modes(lay, flagged(lay))]

    def flagged(lay: list[range]) -> list:  # --activation-checkpointing on lay: one entry per stage fits its count
        entries = args.activation_checkpointing.split(",")
        return checkpointing_plan(args.activation_checkpointing if len(entries) in (1, len(lay)) else "none",
                                  len(lay))

    if args.trace:  # the traced run's own layout, replayed on its times, against its traced step
        own = from_sizes(run["split"])
        traced = schedule_result(run["schedule"], run["processes"] // (run["dp"] * run["tp"]), run["microbatches"],
                                 run["stages_per_rank"], timed(own), [0.0] * len(own), message=message)
        report["traced"] = {"split": counts(own), "step": traced_step_time(args.trace),  # a profiled step: an
                            "replayed": traced["step"] * run["accumulate"], "run": run}  # optimizer step's K
        layout = balanced(config.num_hidden_layers, len(layout), costs)
        report |= {"passes": passes, "split": counts(layout)}
        ms = lambda part: f"{passes[part][0] * 1e3:.3g} / {sum(passes[part][1:]) * 1e3:.3g} ms"  # noqa: E731
        flops = estimated_costs(config, args.seq_len)
        print(f"measured in --trace {args.trace}, one microbatch's forward / backward: a decoder layer "
              f"{ms('layer')}, the embedding {ms('embed')}, the final norm, head and loss {ms('head')} "
              f"({costs['head'] / costs['layer']:.2g} layers; by the FLOP estimate "
              f"{flops['head'] / flops['layer']:.2g})")
        print(f"the traced run, --split {report['traced']['split']}: step {report['traced']['step'] * 1e3:.4g} ms "
              f"traced, {traced['step'] * 1e3:.4g} ms replayed with these times (which leave out the optimizer and "
              "the gradient clipping)")
    else:
        layout = balance(args.split, layout)

    # --vocab-parallel: the split of the layers alone (balanced: on their costs), each rank's share of the
    # vocabulary layers' work and their collectives in its backward (with_vocab), its slice's activations.
    vocab_work = (costs["head"] + costs["embed"]) * (tokens / ASSUMED_FLOPS if passes is None else 1.0) / pp
    vocab_spec = "balanced" if args.trace else args.split
    layout_v = balanced(config.num_hidden_layers, len(layout), without_vocab(costs)) if vocab_spec == "balanced" \
        else layout

    def timed_vocab(lay: list[range]) -> tuple:
        if args.stage_times:  # a vocabulary-parallel run's own times
            return given_stage_times(args.stage_times, len(lay))
        plain = flop_times(lay, without_vocab(costs), tokens / ASSUMED_FLOPS, recomputed(lay)) if passes is None \
            else measured_times(lay, without_vocab(passes))
        return with_vocab(plain, vocab_work + vocab_collectives(config, tokens, pp, dp, tp, half, args))

    def held_vocab(lay: list[range], checkpointing) -> tuple[list[float], list[float]]:
        return vocab_held(lay, sizes, checkpointing, tokens, config.hidden_size), stage_between(lay, sizes,
                                                                                                checkpointing)

    def orders_of(name: str, lay: list[range], stages_per_rank: int) -> dict:  # torch's, or generated for lay
        if name in GENERATED:
            return generated_orders(name, pp, m, timed(lay), *held(lay, flagged(lay)), message)
        return schedule_orders(name, pp, m, stages_per_rank)

    def least(name: str, lay: list[range], stages_per_rank: int) -> str:  # auto: the least recomputation that
        stages = {r: stage_ids(placement(name), r, pp, stages_per_rank) for r in range(pp)}  # fits, rank by rank
        torchs = None if name in GENERATED else orders_of(name, lay, stages_per_rank)  # (a generated order
        # depends on what the stages hold: generated again for each SPEC tried)
        return least_checkpointing(
            args, config, lay, sizes, stages, stage_params(config, lay, tp), dp, half, lambda spec: schedule_result(
                name, pp, m, stages_per_rank, timed(lay), *held(lay, spec), message, torchs or generated_orders(
                    name, pp, m, timed(lay), *held(lay, spec), message))["peak"])

    lengths = [args.seq_len // S] * S  # (even: checked as the scripts check it)
    kv_bytes = 2 * config.num_key_value_heads * config.head_dim / tp * (2 if half else 4) * (tokens // args.seq_len)

    def attention(lay: list[range]) -> list[float]:  # each stage's causal attention share of its time
        if args.stage_times:  # (a stage's whole time says nothing of it: chunks share it by their tokens)
            return [0.0] * len(lay)
        share = 12 * config.num_attention_heads * config.head_dim * args.seq_len / estimated_costs(
            config, args.seq_len)["layer"]  # of a layer's FLOPs (its recomputation: alike)
        return [len(layers) * costs["layer"] * share / c for layers, c in zip(lay, stage_costs(lay, costs))]

    def chunk_result(name: str, lay: list[range], checkpointing) -> dict:  # --seq-chunks S's order and costs
        forward, backward, split = timed(lay)
        kept, between = held(lay, checkpointing)
        return replay(chunk_orders(name, pp, m, S), forward, backward, kept, between, split, message,
                      chunks=chunk_costs(lay, lengths, attention(lay), kept, layer_modes(lay, checkpointing),
                                         kv_bytes, mask_bytes * (tokens // args.seq_len), args.document_masking))

    plain = layout, timed, held  # (the schedules' rows below; the memory table: --vocab-parallel's where given)
    if vp:
        layout, timed, held = layout_v, timed_vocab, held_vocab
    params = stage_params(config, layout, tp, pp if vp else 1)
    if auto:
        args.activation_checkpointing = least(schedule, layout, per_rank)
    # Memory of the chosen schedule, per pipeline rank (each replica of a rank holds the same).
    chosen = orders_of(schedule, layout, per_rank)
    spec = flagged(layout)
    result = {ac: schedule_result(schedule, pp, m, per_rank, timed(layout), *held(layout, spec if ac == "flagged"
                                                                                    else ac), message, chosen)
              for ac in (False, True, "flagged")}  # none, full, and as flagged
    written = chunk_orders(schedule, pp, m, S) if S > 1 else chosen  # (--write-schedule's)
    if S > 1:  # the chunks' order, each chunk its own time and bytes
        result = {ac: chunk_result(schedule, layout, spec if ac == "flagged" else ac) for ac in result}
    if vp:  # the first rank's embeddings and their gradients, the last's hidden states' gradient
        result = {ac: vocab_peaks(r, held(layout, spec if ac == "flagged" else ac)[0], schedule, m, tokens,
                                  config.hidden_size) for ac, r in result.items()}
    if args.trace:  # (as fast as the traced split: where the rest of the layout is the traced run's)
        print(f"balanced on these times: --split {report['split']}, step {result[False]['step'] * 1e3:.4g} ms "
              "replayed" + ("" if carried else f" ({traced['step'] / result[False]['step']:.2f} x as fast as the "
                                               "traced run's split)"))
    print(f"layout (--split {report.get('split', counts(layout) if vp else args.split)}): "
          + (f"{describe_layout(layout, without_vocab(costs)).replace('embed + ', '').replace(' + norm + head', '')}"
             "; --vocab-parallel: the embedding and the head with "
             f"its loss split by vocabulary over all {pp} ranks, {vocab_rows(config, pp)} rows each"
             if vp else describe_layout(layout, costs)))
    unit, unit_name = (2 ** 30, "GiB") if 16 * sum(params) >= 2 ** 30 else (2 ** 20, "MiB")  # MiB for small models
    other = args.activation_checkpointing not in ("none", "full")  # selective, or per stage: a column of its own
    print(f"\nper pipeline rank, {unit_name} (each of its replicas and tensor-parallel ranks holds the same) | param "
          "| grad | AdamW | gathered during a step (dp > 1) | activations held | with --activation-checkpointing | "
          + (f"with --activation-checkpointing {args.activation_checkpointing} | " if other else "")
          + ("the output pass's logits slice and head gradient" if vp else "the loss's logits")
          + f" ({chunks} piece{'s' if chunks > 1 else ''}) | start-up: shards + the largest whole "
          "tensor | total, as flagged | sent to other "
          "stages a step" + (" | CPU memory: the checkpoint staged for --async-checkpoint" if args.async_checkpoint
                             else ""))
    last_rank = next(r for r in range(pp) if len(layout) - 1 in stages_of[r])
    sent = sent_bytes(list(stages_of.values()), len(layout), m * steps, tokens / shards(args, tp), config.hidden_size,
                      half)
    if vp:  # and every microbatch's collectives over the pipeline group
        sent = [s + m * steps * vocab_bytes(config, tokens, pp, half) for s in sent]
    for r in range(pp):
        row = rank_memory(sum(params[s] for s in stages_of[r]), dp, result[False]["peak"][r],
                          result[True]["peak"][r], vocab_transient(config, tokens, pp, chunks, half) if vp
                          else sizes["loss"] if r == last_rank else 0,
                          sizes["layer"], False, half, startup_bytes(config, layout, stages_of[r], dp, tp,
                                                                     pp if vp else 1),
                          (result["flagged"]["peak"][r], recomputing(layout, sizes, spec, stages_of[r]))
                          ) | {"sent": sent[r]}
        if args.async_checkpoint:  # in CPU memory: the copy of the weights and AdamW state a save writes from
            row["staged"] = row["param"] + row["optimizer"]
        report["ranks"].append(row)
        print(f"  rank {r} (stages {', '.join(map(str, stages_of[r]))}): " + " | ".join(
            f"{v / unit:.2f}" for k, v in row.items() if other or k != "activations_flagged"))
    if steps > 1:  # what the window holds between its steps is what a step holds, less the activations
        print(f"--accumulate {steps}: each step's activations are those of its {m} microbatches; the gradients "
              "add up in place over the steps" + (", FSDP keeping each stage's gathered parameters and gradients "
                                                   "from the first step to the last one's reduce-scatter (the "
                                                   "gathered column, in the total)" if dp > 1 else ""))
    share = [f + b for f, b in zip(*timed(layout)[:2])] if args.stage_times or vp else stage_costs(layout, costs)
    report["compute_share"] = [c / sum(share) for c in share]
    print(f"{'compute' if passes is None and not args.stage_times else 'measured time'} per stage"
          + (" (with its vocabulary slice's and the collectives' time)" if vp else "") + ": "
          + ", ".join(f"{c:.0%}" for c in report["compute_share"]))
    layout, timed, held = plain

    # Every schedule, on the layout it would use (a --split of layer counts fits one stage count only: the
    # others are shown balanced; --stages-per-rank is the looped schedules' alone).
    print(f"\nschedules ({pp} ranks, {m} microbatches"
          + (f"; an optimizer step: {steps} schedule steps, each with its fill and drain" if steps > 1 else "")
          + "; step time "
          + ("from --stage-times" if args.stage_times else f"at {ASSUMED_FLOPS / 1e12:.0f} TFLOP/s per GPU"
             if passes is None else "from the measured times")
          + (f", {args.message_time:g} ms a message" if message else "")
          + f"{', tensor-parallel all-reduces not counted' if tp > 1 and passes is None else ''}"
          + ("" if passes else ", each layer recomputed in backward" if args.activation_checkpointing == "full" else
             f", --activation-checkpointing {args.activation_checkpointing}" if other else "") + "; "
          + f"activations of the fullest rank, {unit_name}, without / with checkpointing):")
    spec, flag = args.split if args.split in ("even", "balanced") else "balanced", args.activation_checkpointing
    for name in [*SCHEDULES, *GENERATED]:
        args.activation_checkpointing = flag  # (auto: the schedule before's own choice undone)
        if S > 1 and (why := chunk_refusal(name, S)):
            print(f"  {name:22s} not possible here: {why.split(';')[0]}")
            continue
        own = argparse.Namespace(**{**vars(args), "stages_per_rank": None}) if placement(name) in SINGLE_STAGE or \
            placement(name) in V_SHAPED else args
        own = argparse.Namespace(**{**vars(own), "activation_checkpointing": "none"}) if auto else own
        try:
            each, lay = (ns, layout) if name == schedule else check(own, config, name, spec)
            lay = lay if name == schedule else balance(spec, lay)
            if auto and name != schedule:  # its own least recomputation that fits, on its own stages
                args.activation_checkpointing = "none"  # (what timed() and flagged() read meanwhile)
                with contextlib.redirect_stdout(None):  # (the line it prints: --schedule's alone)
                    args.activation_checkpointing = least(name, lay, each.stages_per_rank)
            orders = chosen if name == schedule else orders_of(name, lay, each.stages_per_rank)
            timed(lay)  # (--stage-times fit one stage count)
        except UsageError as e:
            print(f"  {name:22s} not possible here: {str(e).split(';')[0]}")
            continue
        # The hand-written schedules' orders also with --vocab-parallel (its split; 2 or more ranks, no --tp).
        vocab = [(f"{'afab' if name == 'gpipe' else name} --vocab-parallel", layout_v, timed_vocab, held_vocab)] \
            if name in VOCAB_SCHEDULES.values() and pp > 1 and tp == 1 and S == 1 else []
        # --seq-chunks S: its row beside the whole sequences' (with chunks: no row of another schedule).
        cut = [(f"{name} --seq-chunks {S}", lay, timed, held)] if S > 1 else []
        for key, lay, times, holds in [(name, lay, timed, held), *vocab, *cut]:
            out = [chunk_result(name, lay, ac) if key.endswith(f"--seq-chunks {S}") else schedule_result(
                name, pp, m, each.stages_per_rank, times(lay), *holds(lay, ac), message, orders)
                   for ac in (False, True)]
            if key.endswith("--vocab-parallel"):
                out = [vocab_peaks(o, holds(lay, ac)[0], name, m, tokens, config.hidden_size)
                       for o, ac in zip(out, (False, True))]
            seconds = steps * out[0]["step"]  # K schedule steps one after the other: K fills and drains
            ideal = sum(f + b for f, b in zip(*times(lay)[:2])) * m * steps / pp  # all work, no bubble
            report["schedules"][key] = {"step": seconds, "bubble": out[0]["bubble"],
                                        "span_bubble": span_bubble(out[0]),
                                        "activations": max(out[0]["peak"].values()),
                                        "activations_checkpointed": max(out[1]["peak"].values()),
                                        "split": counts(lay), "checkpointing": args.activation_checkpointing}
            print(f"  {key:22s} step {seconds * 1e3:10.4g} ms ({seconds / ideal:.2f} x no bubble)  bubble "
                  f"{out[0]['bubble']:6.1%}  activations {max(out[0]['peak'].values()) / unit:.2f} / "
                  f"{max(out[1]['peak'].values()) / unit:.2f}" + (
                      f"  (generated; {span_bubble(out[0]):.1%} by the paper's measure)" if name in GENERATED
                      else "") + (f"  (auto: --activation-checkpointing {args.activation_checkpointing})"
                                  if auto and name != schedule else ""))
    args.activation_checkpointing = flag
    if args.write_schedule:
        write_schedule(args.write_schedule, written)
        print(f"\nwrote {args.write_schedule}: {args.schedule}'s order on {pp} pipeline ranks, {m * S} microbatches, "
              "as torch 2.13's _PipelineScheduleRuntime._load_csv reads it (row r: pipeline rank r's actions, in "
              "order)" + (f"; with --seq-chunks {S}, microbatch s x {S} + j is sequence s's chunk j (the scripts make "
                          "this order themselves from --seq-chunks)" if S > 1 else ""))
    return report


# ----------------------------------------------------------------------------------------------------------
# Which layout: every (pp, dp, tp, schedule, microbatches, checkpointing) for a cluster, ranked

MAX_MICROBATCHES = 256
SEARCHED_CHUNKS = (2, 4, 8, 16, 32)  # --seq-chunks the search tries beside whole sequences (gpipe and 1f1b),
MIN_SEARCHED_CHUNK = 4096  # of chunks this long at least: "gains show when chunks are 4k or longer" (Seq1F1B's
# authors, thunlp/Seq1F1B #4); shorter ones run below the GPU's rate, which the model of time does not know.
MAX_ACCUMULATE = 256  # schedule steps per optimizer step the search tries (a replica: up to 65,536 microbatches)


def divisors(n: int) -> list[int]:
    """n's divisors, ascending: by trial up to its square root (n may be any size a flag allows)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def stage_seconds(config: LlamaConfig, layout: list[range], costs: dict, tokens: int, pp: int, dp: int, tp: int,
                  checkpointing: bool, per_rank: list[list[int]], args) -> tuple[list, list, tuple]:
    """Each stage's forward and backward time for one microbatch (seconds), and its I and W times
    (split_backward): its FLOPs at the assumed rate, plus
    tensor parallelism's all-reduces (a ring: 2 (tp - 1) / tp of the bytes over the node's links; two per layer
    forward, two backward, two more when the layer is recomputed; one for the embedding) and the hidden states
    (bf16, or fp32 under --precision fp32) sent to the next or previous stage, over the node's links or, when that
    stage's ranks are on another node, across nodes. Nothing overlaps: an upper bound."""
    rate = args.peak_tflops * 1e12 * args.efficiency
    intra, inter = args.intra_node_bandwidth * 1e9, args.inter_node_bandwidth * 1e9
    activation = tokens * config.hidden_size * 2  # bf16, what tp all-reduces
    reduce = 2 * (tp - 1) / tp * activation / intra if tp > 1 else 0.0
    rank_of = {s: r for r, stages in enumerate(per_rank) for s in stages}

    def send(a: int, b: int) -> float:  # stage a's output to stage b (the same GPU: no message)
        if rank_of[a] == rank_of[b]:
            return 0.0
        node = lambda s: rank_of[s] * dp * tp // args.gpus_per_node  # noqa: E731  (tp innermost, pp outermost)
        size = tokens / shards(args, tp) * config.hidden_size * (2 if bf16(args) else 4)
        return size / (intra if node(a) == node(b) else inter)

    work = stage_costs(layout, costs)
    again = [len(layers) * costs.get("recompute", 0.0) for layers in layout]
    forward, backward = [], []
    for s, layers in enumerate(layout):
        flops = work[s] - again[s]
        embed = reduce if s == 0 else 0.0
        forward.append(flops / 3 * tokens / rate + 2 * len(layers) * reduce + embed
                       + (send(s, s + 1) if s + 1 < len(layout) else 0.0))
        backward.append((2 * flops / 3 + again[s]) * tokens / rate + (4 if checkpointing else 2) * len(layers) * reduce
                        + embed + (send(s, s - 1) if s > 0 else 0.0))
    recompute = [r * tokens / rate + (2 * len(layers) * reduce if checkpointing else 0.0)
                 for r, layers in zip(again, layout)]
    return forward, backward, split_backward(backward, recompute, costs.get("head_recompute", 0.0) * tokens / rate)


def evaluate(args, config: LlamaConfig, pp: int, dp: int, tp: int, schedule: str, m: int,
             checkpointing: bool, budget: float | None = None, accumulate: int = 1) -> dict | None:
    """One layout's step time, bubble and memory per GPU, or None where the scripts would refuse it. Over a
    budget (bytes) by its parameters, gradients and AdamW state alone: that memory, no step time (no replay).
    With accumulate K: an optimizer step of K schedule steps of m microbatches, each step a fill and a drain.
    schedule "afab --vocab-parallel" or "1f1b --vocab-parallel": the hand-written script's, the vocabulary split
    over the pipeline ranks (the plan's --vocab-parallel; the row says "vocab_parallel")."""
    vocab = schedule.endswith(" --vocab-parallel")
    S = int(schedule.split()[-1]) if " --seq-chunks " in schedule else 1  # each sequence in S chunks
    schedule = VOCAB_SCHEDULES[schedule.split()[0]] if vocab else schedule.split()[0]
    trial = argparse.Namespace(**{**vars(args), "processes": pp * dp * tp, "dp": dp, "tp": tp, "microbatches": m,
                                  "seq_chunks": S,
                                  "accumulate": accumulate, "activation_checkpointing": checkpointing,
                                  "split": "balanced", "device": "cuda"})
    try:
        ns = script_args(trial, schedule)
        gpipe.check_args(ns, trial.processes, "cuda", ns.init_from is None)
        num_stages = pp * len(stage_ids(schedule, 0, pp, ns.stages_per_rank))
        layout = gpipe.stage_layout(config, num_stages, ns)
        check_microbatches(schedule, pp, m, num_stages)
    except UsageError:
        return None
    row = {"pp": pp, "dp": dp, "tp": tp, "schedule": schedule, "microbatches": m, "accumulate": accumulate,
           "checkpointing": checkpointing, "stages_per_rank": ns.stages_per_rank} | (
        {"vocab_parallel": True} if vocab else {}) | ({"seq_chunks": S} if S > 1 else {})
    per_rank = [stage_ids(schedule, r, pp, ns.stages_per_rank) for r in range(pp)]
    if vocab:  # the layers alone balanced (their costs: the same per layer whatever the microbatch)
        layout = balanced(config.num_hidden_layers, pp, without_vocab(estimated_costs(config, args.seq_len)))
    params = stage_params(config, layout, tp, pp if vocab else 1)
    held = [sum(params[s] for s in stages) for stages in per_rank]
    weights = rank_memory(max(held), dp, 0.0, 0.0, 0.0, 0.0, False)["total"]
    if budget is not None and weights > budget:
        return {**row, "step": math.inf, "bubble": math.nan, "memory": weights}
    tokens = args.batch_size // (dp * m * accumulate) * args.seq_len
    chunks = loss_chunks(args.loss_chunks, config, (tokens // args.seq_len, args.seq_len), tp)
    costs = {k: v / tp for k, v in estimated_costs(config, args.seq_len, checkpointing, chunks).items()}
    sizes = activation_bytes(config, tokens, args.seq_len, bf16(trial), tp, chunks, shards(args, tp),
                             args.document_masking)
    times = stage_seconds(config, layout, without_vocab(costs) if vocab else costs, tokens, pp, dp, tp,
                          checkpointing, per_rank, trial)
    stages = stage_held(layout, sizes, checkpointing)
    if vocab:  # each rank's share of the vocabulary layers and the collectives, its slice's activations
        rate = args.peak_tflops * 1e12 * args.efficiency
        times = with_vocab(times, (costs["head"] + costs["embed"]) * tokens / rate / pp
                           + vocab_collectives(config, tokens, pp, dp, tp, bf16(trial), trial))
        stages = vocab_held(layout, sizes, checkpointing, tokens, config.hidden_size)
    forward, backward, split = times
    if S > 1:  # the chunks' order, each chunk its own time and bytes (plan()'s --seq-chunks)
        share = 12 * config.num_attention_heads * config.head_dim * args.seq_len / estimated_costs(
            config, args.seq_len)["layer"]
        attention = [len(layers) * costs["layer"] * share / c for layers, c in zip(layout, stage_costs(layout, costs))]
        kv_bytes = 2 * config.num_key_value_heads * config.head_dim / tp * (2 if bf16(trial) else 4) * (
            tokens // args.seq_len)
        result = replay(chunk_orders(schedule, pp, m, S), forward, backward, stages,
                        stage_between(layout, sizes, checkpointing), split, chunks=chunk_costs(
                            layout, [args.seq_len // S] * S, attention, stages, layer_modes(layout, checkpointing),
                            kv_bytes))
    else:
        result = replay(schedule_orders(schedule, pp, m, ns.stages_per_rank), forward, backward,
                        stages, stage_between(layout, sizes, checkpointing), split)
    if vocab:
        result = vocab_peaks(result, stages, schedule, m, tokens, config.hidden_size)
    memory = max(rank_memory(held[r], dp, result["peak"][r], result["peak"][r],
                             vocab_transient(config, tokens, pp, chunks, bf16(trial)) if vocab
                             else sizes["loss"] if len(layout) - 1 in per_rank[r] else 0,
                             sizes["layer"], checkpointing, bf16(trial),
                             startup_bytes(config, layout, per_rank[r], dp, tp, pp if vocab else 1)
                             )["total"] for r in range(pp))
    # FSDP2 gathers each stage's parameters once per optimizer step (bf16) and reduce-scatters its gradients once
    # (fp32), over the node's links when a stage's replicas share a node, else across nodes: under --accumulate K
    # both stay unsharded from the first schedule step to the last, which alone reduce-scatters.
    bandwidth = args.intra_node_bandwidth if dp * tp <= args.gpus_per_node else args.inter_node_bandwidth
    sync = (2 + 4) * max(held) * (dp - 1) / dp / (bandwidth * 1e9) if dp > 1 else 0.0
    return {**row, "step": accumulate * result["step"] + sync, "bubble": result["bubble"], "memory": memory}


def layouts(args, config: LlamaConfig, schedules=tuple(SCHEDULES), checkpointing=(False, True),
            budget: float | None = None) -> list[dict]:
    """Every layout of --gpus that the scripts accept, evaluated: tp dividing a node's GPUs and the model's
    heads, KV heads, MLP width and vocabulary; dp dividing the batch; pp at most the layers and two layerless
    end stages; every schedule torch ships (the hand-written afab and 1f1b run GPipe's and 1F1B's orders: the
    same figures); with and
    without activation checkpointing; and the most microbatches the schedule accepts, up to MAX_MICROBATCHES,
    dividing a replica's batch. (The model of time has no cost per microbatch, so more microbatches, smaller,
    never plan slower or bigger; in a real run, microbatches too small to keep a GPU busy do run slower.)
    --accumulate K > 1 only where memory forces it: a pp x dp x tp, schedule and checkpointing choice that fits
    the budget at no microbatch count, but whose weights do, is tried at the smallest K
    (dividing a replica's batch, up to MAX_ACCUMULATE) that fits, K schedule steps each paying its fill and
    drain (found by bisection: the memory of the most microbatches a K allows falls as K grows); without a
    budget (the least memory any layout needs), at the largest K the scripts accept (the smallest microbatches:
    the least activation memory). An --accumulate given is kept instead.
    budget: see evaluate()."""
    found = []
    for (pp, dp, tp, schedule), group in itertools.groupby(candidates(args, config, schedules, checkpointing),
                                                           key=lambda candidate: candidate[:4]):
        group = list(group)
        choices = range(len(group) - 1, -1, -1)  # checkpointing (when searched) first: the likelier to fit

        @functools.cache
        def row_at(k: int, choice: int) -> dict | None:  # at the most microbatches the scripts accept, if any
            *_, counts, ac = group[choice]
            tried = (evaluate(args, config, pp, dp, tp, schedule, m, ac, budget, k)
                     for m in sorted(counts, reverse=True) if args.batch_size // dp // k % m == 0)
            return next((row for row in tried if row is not None), None)

        def rows_at(k: int) -> list[dict]:
            return [row for choice in range(len(group)) if (row := row_at(k, choice)) is not None]

        def fits(k: int, choice: int) -> bool:  # (evaluates what it needs only: a replay each)
            return (row := row_at(k, choice)) is not None and row["memory"] <= budget

        # More schedule steps, each of smaller microbatches: less activation memory, and another fill and drain.
        more = [k for k in range(2, MAX_ACCUMULATE + 1) if args.batch_size // dp % k == 0] \
            if args.accumulate == 1 else []  # (an --accumulate given is kept)
        if budget is None:  # the least memory: at the largest K the scripts accept, its activations the smallest
            found += next((at for at in map(rows_at, [*reversed(more), args.accumulate]) if at), [])
            continue
        for choice in choices:  # with checkpointing and without, each at the fewest steps that fit
            row = row_at(args.accumulate, choice)
            # K shrinks the activations only: not tried where K = 1 fits or the weights alone do not (not replayed).
            if row is not None and more and not fits(args.accumulate, choice) and math.isfinite(row["step"]):
                # The largest K the scripts accept first: where even it does not fit, none does. Else the smallest
                # K that fits, halving the range (a larger K: fewer or smaller microbatches a step, never more).
                top = next((i for i in reversed(range(len(more))) if row_at(more[i], choice)), None)
                if top is not None and fits(more[top], choice):
                    row = row_at(more[bisect.bisect_left(range(top), True, key=lambda i: fits(more[i], choice))],
                                 choice)
            found += [row] if row is not None else []
    return found


def candidates(args, config: LlamaConfig, schedules, checkpointing):
    """(pp, dp, tp, schedule, microbatch counts, checkpointing) to evaluate: see layouts()."""
    shapes = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size)
    # Each loop is bounded by the model (its heads, its layers) or MAX_MICROBATCHES, never by the size of
    # --gpus or --batch-size, which may be any whole number.
    for tp in divisors(config.num_key_value_heads):  # dividing the KV heads, it divides the heads too
        # A tensor-parallel group inside one node: tp divides the GPUs of a node (or of all, when fewer).
        if min(args.gpus, args.gpus_per_node) % tp or any(n % tp for n in shapes) or args.tp > 1 and tp != args.tp:
            continue
        for pp in range(min(config.num_hidden_layers + 2, args.gpus // tp), 0, -1):  # dp ascending
            dp = args.gpus // (tp * pp)
            if (args.gpus // tp) % pp or args.dp > 1 and dp != args.dp or args.batch_size % dp:
                continue
            # Every count the batch allows: check_args says which each schedule takes (GPipe's, fewer than
            # the stages too).
            counts = [m for m in range(1, MAX_MICROBATCHES + 1) if (args.batch_size // dp) % m == 0]
            # The hand-written script's schedules with the vocabulary split over the pipeline ranks too (no --tp).
            vocab = [f"{name} --vocab-parallel" for name, order in VOCAB_SCHEDULES.items()
                     if order in schedules and pp > 1 and tp == 1]
            # Each sequence in S chunks (--seq-chunks), under the schedules that order them (the scripts' checks
            # say which S cut --seq-len).
            cut = [f"{name} --seq-chunks {S}" for name in ("gpipe", "1f1b") if name in schedules and pp > 1
                   for S in SEARCHED_CHUNKS if args.seq_len % S == 0 and args.seq_len // S >= MIN_SEARCHED_CHUNK]
            for schedule in (*schedules, *vocab, *cut):
                if pp == 1 and schedule != schedules[0]:
                    continue  # one stage: every schedule is the same loop over microbatches
                for ac in checkpointing:
                    yield pp, dp, tp, schedule, counts, ac


def command(args, row: dict) -> str:
    """The command line that runs a layout: torchrun on one node, run.sh (one line per node) on several."""
    script = "train_pipeline_afab_manual.py" if row.get("by_hand") else "train_pipeline_gpipe.py"
    if args.init_from or is_config_json(args):  # the weights: beside a config.json
        model = f"--init-from {args.init_from or os.path.dirname(args.model) or '.'}"
    else:
        model = f"--model {checkpoint.model_preset(args.model, device_type(args))}"
    flags = (f"{model} --seq-len {args.seq_len} --batch-size {args.batch_size} --microbatches {row['microbatches']} "
             + (f"--accumulate {row['accumulate']} " if row["accumulate"] > 1 else "")
             + f"--schedule {row['schedule']}" + (f" --dp {row['dp']}" if row["dp"] > 1 else "")
             + (f" --tp {row['tp']}" if row["tp"] > 1 else "")
             + (" --no-sequence-parallel" if row["tp"] > 1 and not args.sequence_parallel else "")
             + (" --activation-checkpointing" if row["checkpointing"] else "")
             + (" --document-masking" if args.document_masking else "")
             + (f" --loss-chunks {args.loss_chunks}" if args.loss_chunks else "")
             + (f" --seq-chunks {row['seq_chunks']}" if row.get("seq_chunks") else ""))
    nodes = args.gpus // args.gpus_per_node if args.gpus > args.gpus_per_node else 1
    if nodes == 1:
        return f"torchrun --nproc_per_node {args.gpus} {script} {flags}"
    return (f"NNODES={nodes} NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<first node> NPROC_PER_NODE={args.gpus_per_node} "
            f"./run.sh {script} {flags}")


def show_seconds(t: float) -> str:
    """A step time: seconds, or milliseconds under one (a small model's steps take microseconds)."""
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def show_bytes(n: float) -> str:
    """Bytes in GiB, MiB or KiB, the largest unit that keeps the figure at 1 or more."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2 ** 10:.1f} KiB"


def show_gb(n: float) -> str:
    """Bytes in --gpu-memory's unit, GB, from one GB up; less, as show_bytes."""
    return f"{n / 1e9:.0f} GB" if n >= 1e9 else show_bytes(n)


def paying(rows: list[dict]) -> list[dict]:
    """The rows less the --vocab-parallel ones that do not pay: slower than, or as fast as, the same layout (pp,
    dp, tp, schedule, microbatches, steps, checkpointing) with the vocabulary layers on the end stages."""
    key = lambda row: tuple(row[k] for k in ("pp", "dp", "tp", "schedule", "microbatches", "accumulate",  # noqa: E731
                                             "checkpointing"))
    plain = {key(row): row["step"] for row in rows if not row.get("vocab_parallel")}
    return [row for row in rows if not row.get("vocab_parallel") or row["step"] < plain.get(key(row), math.inf)]


def search(args) -> list[dict]:
    """Print the best layouts for --gpus and return them, fastest first; a UsageError when none fits."""
    if args.vocab_parallel:
        raise UsageError("--vocab-parallel: plans one layout (--processes); --gpus tries it on every afab and 1f1b "
                         "layout and proposes it where it is faster; leave it out")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UsageError(f"--gpus {args.gpus}: not whole nodes of --gpus-per-node {args.gpus_per_node}; give a "
                         f"multiple of {args.gpus_per_node}")
    if args.tp > args.gpus_per_node:
        raise UsageError(f"--tp {args.tp}: larger than a node (--gpus-per-node {args.gpus_per_node}); tensor "
                         "parallelism's all-reduces, two per layer each way, stay inside a node: use --tp "
                         f"{args.gpus_per_node} or less, or leave --tp out to search it")
    if args.gpus % (args.dp * args.tp):
        raise UsageError(f"--dp {args.dp} x --tp {args.tp}: does not divide --gpus {args.gpus}; leave them out to "
                         "search them")
    if args.batch_size % args.accumulate:  # (then no layout would pass the scripts' checks)
        raise UsageError(f"--accumulate {args.accumulate}: does not divide --batch-size {args.batch_size}; leave it "
                         "out to search it")
    args.device = "cuda"  # a plan for GPUs (the default model is the scripts' on a GPU)
    config = plan_config(args)
    try:  # (no layout would pass the scripts' checks: say which flag)
        check_positions(config, args.seq_len)
    except ValueError as e:
        raise UsageError(str(e)) from None
    budget = args.gpu_memory * 1e9 * (1 - HEADROOM)
    # The replays make millions of small tuples and no reference cycles: the cyclic garbage collector would
    # only scan them again and again (a third of the search's time).
    gc.disable()
    try:
        found = layouts(args, config, budget=budget)  # the layouts whose weights alone do not fit: not replayed
        fits = sorted((row for row in found if row["memory"] <= budget), key=lambda row: row["step"])
        fits = paying(fits)
        if found and not fits:  # then the least memory any layout needs, replayed
            found = layouts(args, config)
    finally:
        gc.enable()
    if not found:
        raise UsageError(f"--gpus {args.gpus}: no layout of {config.num_hidden_layers} layers, a batch of "
                         f"{args.batch_size} and {args.gpus_per_node} GPUs per node passes the scripts' checks; "
                         "try another --batch-size or --gpus")
    if not fits:
        least = min(found, key=lambda row: row["memory"])
        # More GPUs: checked with the layouts that hold the least (1F1B, checkpointing), for speed.
        more = next((g for g in (2 * args.gpus, 4 * args.gpus, 8 * args.gpus) if any(
            row["memory"] <= budget for row in layouts(argparse.Namespace(**{**vars(args), "gpus": g}), config,
                                                       ("1f1b",), (True,), budget))), None)
        flags = [*(["--activation-checkpointing"] if least["checkpointing"] else []),
                 *([f"--accumulate {least['accumulate']}"] if least["accumulate"] > 1 else []),
                 *(["--vocab-parallel"] if least.get("vocab_parallel") else [])]
        raise UsageError(f"--gpu-memory {args.gpu_memory:g}: no layout fits; the smallest, pp {least['pp']} x dp "
                         f"{least['dp']} x tp {least['tp']}{' with ' + ' and '.join(flags) if flags else ''}, needs "
                         f"{show_gb(least['memory'] / (1 - HEADROOM))} per GPU"
                         + (f"; --gpus {more} would fit" if more else "; more GPUs would not fit it either: a "
                            "smaller --seq-len or --batch-size, or GPUs with more memory, might"))
    rate = args.peak_tflops * args.efficiency
    print(f"{len(found)} layouts of {config.num_hidden_layers} layers (hidden {config.hidden_size}, vocab "
          f"{config.vocab_size}) on {args.gpus} GPUs ({args.gpus_per_node} per node, {args.gpu_memory:g} GB), "
          f"batch {args.batch_size} x {args.seq_len}; {len(fits)} fit in {show_gb(budget)} (the rest is kept "
          f"for CUDA and fragmentation). Fastest {min(args.top, len(fits))}:")
    print(f"assumed: {rate:.0f} TFLOP/s per GPU ({args.efficiency:.0%} of {args.peak_tflops:g}), "
          f"{args.intra_node_bandwidth:g} GB/s inside a node, {args.inter_node_bandwidth:g} GB/s across nodes, no "
          "communication overlapped with compute.")
    print("uncertainty: the step times are good to about +-30 % (the efficiency varies with shapes and kernels); "
          "layouts within 15 % of each other are a tie, try both. Memory: within 10 % of what CPU runs measure, "
          "every schedule.")
    tokens = args.batch_size * args.seq_len
    for i, row in enumerate(fits[:args.top], 1):
        vocab = row.get("vocab_parallel")
        name = f"{'afab' if row['schedule'] == 'gpipe' else row['schedule']} --vocab-parallel" if vocab else \
            row["schedule"] + (f" --seq-chunks {row['seq_chunks']}" if row.get("seq_chunks") else "")
        print(f"\n{i}. pp {row['pp']} x dp {row['dp']} x tp {row['tp']}, {name}, {row['microbatches']} "
              f"microbatch{'es' if row['microbatches'] > 1 else ''}"
              + (f" x {row['accumulate']} schedule steps (--accumulate: each its fill and drain)"
                 if row["accumulate"] > 1 else "") +
              f"{', activation checkpointing' if row['checkpointing'] else ''}: step {show_seconds(row['step'])} "
              f"({tokens / row['step']:,.0f} tokens/s), bubble {row['bubble']:.0%}, {show_bytes(row['memory'])} "
              "per GPU")
        if vocab:  # the hand-written script's flag
            row["command"] = command(args, {**row, "schedule": name.split()[0], "by_hand": True}) + " --vocab-parallel"
            print(f"   {row['command']}")
            continue
        row["command"] = command(args, row)
        print(f"   {row['command']}")
        if row["schedule"] in ("gpipe", "1f1b"):  # the hand-written script runs the same order
            row["by_hand"] = command(args, {**row, "schedule": "afab" if row["schedule"] == "gpipe" else "1f1b",
                                            "by_hand": True})
            print(f"   or by hand: {row['by_hand']}")
    return fits[:args.top]


def within(least: float, most: float, unit: str):
    """argparse type: a number from least to most (unit). Outside it a figure is a slip: past most (or near 0,
    for a rate) the step's sums overflow to inf or run to astronomic lengths, at 0 they divide by zero."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not least <= value <= most:  # (nan is neither)
            raise argparse.ArgumentTypeError(f"must be a number from {least:,.10g} to {most:,.10g} {unit}, got {text}")
        return value
    return parse


def vocabulary(text: str) -> int:
    """argparse type of --vocab-size: a whole number up to 2**32 (prepare_data.py's largest token type, uint32)."""
    value = whole(1)(text)
    if value > 2**32:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {2**32} (uint32 token ids), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="plan.py", description=__doc__)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--processes", type=whole(1),
                      help="plan this layout: processes the run would start, pipeline ranks x --dp x --tp")
    what.add_argument("--gpus", type=whole(1), help="find the layouts for this many GPUs (pp, dp, tp, schedule, "
                                                    "microbatches, checkpointing searched, --accumulate where "
                                                    "memory forces it; a --dp, --tp or --accumulate given is "
                                                    "kept), fastest first")
    script = {action.dest: action for action in gpipe.build_parser()._actions}
    g = p.add_argument_group("the training scripts' flags (same meaning)")
    for name in SHARED:
        action = copy.copy(script[name])
        if name == "model":  # a preset, or for plan.py also a Hugging Face config.json
            action.choices, action.metavar = None, "{" + ",".join(PRESETS) + "} or config.json"
        if name == "activation_checkpointing":  # for plan.py also auto: chosen for --gpu-memory
            action.type = lambda text: text if text == "auto" else checkpoint.checkpointing(text)
            action.help += "; auto (plan.py, with --processes): on each rank the least that fits --gpu-memory"
        g._add_action(action)
    g.add_argument("--schedule", choices=[*SCHEDULES, "afab", *GENERATED], default="gpipe",
                   help="the library schedules, the hand-written script's afab (GPipe's order), and the Zero "
                        "Bubble paper's orders generated here from the stage times: zbh2 (handcrafted, 2p "
                        "microbatches' activations), zb1p and zb2p (its heuristic, capped at p or 2p microbatches' "
                        "activations), zbvauto (its V, capped at 1F1B's); --write-schedule writes one out to run")
    g.add_argument("--vocab-parallel", action="store_true",
                   help="(the hand-written script's, with afab or 1f1b) the embedding and "
                        "the head with its loss split by vocabulary over all pipeline ranks: plan the memory table "
                        "for it (the schedules list it beside the plain split either way)")
    g.add_argument("--write-schedule", metavar="FILE.csv",
                   help="write --schedule's order for this layout (with --processes) as torch 2.13's "
                        "_PipelineScheduleRuntime._load_csv(FILE, format='compute_only') reads it: row r is "
                        "pipeline rank r's compute actions in the order it runs them, each {stage}{F|I|W|B}"
                        "{microbatch} (2I1: stage 2's input gradient of microbatch 1), no empty cells; the same "
                        "file for every replica and tensor-parallel rank (default: none)")
    g = p.add_argument_group("vocabulary (without --init-from)").add_mutually_exclusive_group()
    g.add_argument("--vocab-size", type=vocabulary,
                   help=f"tokens in the vocabulary (default: {VOCAB_SIZE}, prepare_data.py's default tokenizer)")
    g.add_argument("--data", metavar="DIR", help="take the vocabulary from data prepared by prepare_data.py "
                   "(default: none: --vocab-size)")
    g = p.add_argument_group("the cluster, with --gpus (the search's model of time: see its output)")
    g.add_argument("--gpus-per-node", type=whole(1), default=8, help="tensor parallelism stays inside a node")
    g.add_argument("--gpu-memory", type=within(0.001, 1e5, "GB"), default=80.0, help="GB per GPU")
    g.add_argument("--peak-tflops", type=within(0.001, 1e5, "TFLOP/s"), default=989.0,
                   help="dense bf16 peak per GPU (H100 SXM: 989)")
    g.add_argument("--efficiency", type=within(0.001, 1, "(a share of the peak)"), default=0.4,
                   help="the share of the peak a stage's matmuls reach")
    g.add_argument("--intra-node-bandwidth", type=within(0.001, 1e5, "GB/s"), default=300.0,
                   help="GB/s per GPU inside a node (NVLink), for tp's all-reduces and messages between stages")
    g.add_argument("--inter-node-bandwidth", type=within(0.001, 1e5, "GB/s"), default=25.0,
                   help="GB/s per GPU across nodes (InfiniBand), for pp's messages and dp's gradients")
    g.add_argument("--top", type=whole(1), default=5, help="how many layouts to print")
    g = p.add_argument_group("measured times instead of the FLOP estimate, with --processes (milliseconds, one "
                             "microbatch; docs/plan-vs-the-zero-bubble-paper.md)")
    g.add_argument("--layer-times", type=pass_times(layer=True), metavar="F,B,W",
                   help="a decoder layer's forward, input-gradient and weight-gradient time (default: the FLOP "
                        "estimate at 40%% of an H100)")
    g.add_argument("--embed-times", type=pass_times(layer=False), metavar="F,B,W",
                   help="the embedding's (default: the layer's, scaled by the FLOP estimate)")
    g.add_argument("--head-times", type=pass_times(layer=False), metavar="F,B,W",
                   help="the final norm's, head's and loss's (default: the layer's, scaled by the FLOP estimate)")
    g.add_argument("--stage-times", type=stage_times, metavar="F1,...,Fn/B1,...,Bn",
                   help="each stage's forward and backward time (or F/I/W: its input and weight gradient), which "
                        "replace the estimated or measured parts' in the replay: one per stage of the layout (default: "
                        "the estimate, or --trace's times)")
    g.add_argument("--message-time", type=within(0, MOST_MS, "ms"), default=0.0, metavar="MS",
                   help="one microbatch's hidden states, or their gradient, on their way to another rank, while "
                        "both compute on")
    g.add_argument("--trace", metavar="DIR",
                   help="take the layer's, embedding's and head's times from a traced run of the same microbatch "
                        "(the scripts' --trace DIR: the model's shape, --seq-len, rows, precision, --tp; its "
                        "layout may differ), and print the --split that balances them (default: none: the FLOP "
                        "estimate, or the times given)")
    return p


def check_measured(args) -> None:
    """What the measured-time flags and --write-schedule rule out (UsageError), before any work."""
    if args.gpus and args.seq_chunks > 1:
        raise UsageError(f"--seq-chunks {args.seq_chunks}: --gpus searches it (whole sequences and "
                         f"{', '.join(map(str, SEARCHED_CHUNKS))} chunks of {MIN_SEARCHED_CHUNK} tokens or more under "
                         "gpipe and 1f1b); leave it out")
    if args.write_schedule and args.gpus:
        raise UsageError(f"--write-schedule {args.write_schedule}: writes one layout's order; give --processes "
                         "instead of --gpus")
    folder = os.path.dirname(args.write_schedule or "") or "."
    if args.write_schedule and (not os.path.isdir(folder) or os.path.isdir(args.write_schedule)):
        raise UsageError(f"--write-schedule {args.write_schedule}: " + (
            "is a directory" if os.path.isdir(args.write_schedule) else f"no directory {folder}")
            + "; give a file in an existing directory")
    given = [flag for flag in ("layer_times", "embed_times", "head_times", "trace", "stage_times")
             if getattr(args, flag)]
    if args.gpus and (given or args.message_time):
        flag = "--" + (given or ["message_time"])[0].replace("_", "-")
        raise UsageError(f"{flag}: measured times plan one layout (--processes); --gpus searches by the FLOP "
                         "estimate")
    if args.stage_times and len(given) > 1:
        raise UsageError(f"--{given[0].replace('_', '-')}: --stage-times gives each stage's whole time; give one "
                         "or the other")
    if args.trace and len(given) > 1:
        raise UsageError(f"--{given[0].replace('_', '-')}: --trace {args.trace} measures the times; give one or "
                         "the other")
    if args.layer_times is None and (args.embed_times or args.head_times):
        raise UsageError(f"--{'embed' if args.embed_times else 'head'}-times: give --layer-times too (and the "
                         "times of the part not given are the layer's, scaled by the FLOP estimate)")


def main(argv=None) -> dict | list:
    args = build_parser().parse_args(argv)
    try:
        if args.model is not None and args.model not in PRESETS and not args.model.endswith(".json"):
            raise UsageError(f"--model {args.model}: give a preset ({', '.join(PRESETS)}) or a Hugging Face "
                             "config.json")
        check_measured(args)
        return search(args) if args.gpus else plan(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `python plan.py ... | head` ends quietly, as other tools do
    try:
        main()
    finally:
        # The search's caches (millions of small tuples) live until exit: left to the collector, the exit's
        # last collection scans them all again (4.6 s of a 10 s search for llama-70b on 64 GPUs).
        gc.freeze()
