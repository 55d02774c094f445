"""The Llama model the training scripts train, and what they and the tools use around it.

First the model (config, rotary embedding, packed documents' masks, sequence chunks' keys and values, decoder layers,
initial weights, the loss) in Hugging Face Llama's math and tensor names (``base_model.`` for its ``model.``: weights
move between the two by renaming one prefix). After a divider: presets and Hugging Face configs, costs, sequence chunks,
pipeline layouts, parallelizing a stage, tied embeddings across stages, clipping; after another, torch's schedules
extended (orders from a file or for sequence chunks, gradient accumulation, forward-only evaluation).

A pipeline stage is the model trimmed (keep_only): layers in a ModuleDict keyed by global index, forward skips what a
stage lacks, no module passed into another's forward (the tracer needs that), and every tensor's initial value drawn
from its full-model name alone (init_tensor_), so that any split starts from the same weights."""

import collections
import csv
import dataclasses
import functools
import hashlib
import json
import math
import re
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _ComputationType,
                                                    _PipelineScheduleRuntime, _validate_schedule)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 50000
    max_position_embeddings: int = 2048
    hidden_size: int = 768
    intermediate_size: int = 4 * 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 3  # grouped-query attention: fewer K/V heads than query heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    head_dim: int | None = None  # size of each attention head; None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = False  # the head is the embedding matrix (Llama 3.2 1B and 3B, SmolLM)
    rope_scaling: dict | None = None  # Llama 3.1+ long-context RoPE (config_from_hf's llama3 keys); None: plain RoPE

    def __post_init__(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads (or give head_dim)")
        self.head_dim = self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"rope_scaling: only rope_type llama3 is implemented, got {self.rope_scaling}")


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding (the "rotate half" convention of Hugging Face Llama)

def rope_inv_freq(config: LlamaConfig, device=None) -> Tensor:
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is None:
        return inv_freq
    # Llama 3.1's long-context scaling (as transformers computes it): wavelengths under original_max / high_freq_factor
    # stay, those over original_max / low_freq_factor slow by `factor`, those between are interpolated smoothly.
    factor, low, high, context = (config.rope_scaling[key] for key in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)  # in the medium band, between the two:
    return torch.where(~(wavelength < context / high) * ~(wavelength > context / low),
                       (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_tables(inv_freq: Tensor, seq_len: int, dtype: torch.dtype,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # Positions from 0: each stage (whole sequences) rebuilds the tables from the length alone, so only hidden states
    # travel. Document positions: tables [batch, 1, seq, head_dim], the same products a row per sequence. fp32, then
    # cast (as HF): bf16 rotates alike.
    angles = (torch.outer(torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32), inv_freq.float())
              if positions is None else positions[:, None, :, None].float() * inv_freq.float())
    angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim], or [batch, 1, seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x of shape [batch, heads, seq, head_dim] by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ----------------------------------------------------------------------------------------------------------
# Packed documents kept apart (--document-masking)
#
# Token files hold documents back to back (bos, ids, eos); a window cuts across them. Kept apart, a token attends only
# to its document's earlier tokens, its rotary position from the document's start: as if alone. Boundaries travel as
# positions in documents, [batch, seq] integers a schedule cuts with the tokens; each stage builds the mask once
# (attention_mask): no mask object crosses a stage or goes through the schedules' autograd (torchtitan #1723, #3584).

def document_positions(input_ids: Tensor, bos_id: int) -> Tensor:
    """Each token's position in its document [batch, seq], from 0 at every bos and at the window's start (a tail)."""
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    return index - torch.where(input_ids == bos_id, index, 0).cummax(-1).values  # minus where the document began


def document_mask_mod(positions: Tensor, offset: int = 0):
    """FlexAttention's mask_mod of packed documents: query q sees key k at or before it, not before its document's
    start; on index grids, document_mask. offset: the queries are a chunk from token `offset` on (SeqChunk), the keys
    the sequence's from 0: query q is token offset + q, its document maybe begun in an earlier chunk."""
    starts = offset + torch.arange(positions.shape[-1], device=positions.device) - positions  # each document start
    return lambda b, h, q, k: (k <= q + offset) & (k >= starts[b, q])


def document_mask(positions: Tensor, offset: int = 0) -> Tensor:
    """The dense mask [batch, 1, seq, offset + seq] of document_mask_mod: True where a query (row) sees a key."""
    index = torch.arange(offset + positions.shape[-1], device=positions.device)
    batches = torch.arange(positions.shape[0], device=positions.device)[:, None, None, None]
    return document_mask_mod(positions, offset)(batches, None, index[:positions.shape[-1], None], index)


@functools.cache
def _compiled_flex():  # compiled on first use (torch.compile costs seconds to set up, even unused)
    return torch.compile(create_block_mask), torch.compile(flex_attention)


def attention_mask(positions: Tensor, offset: int = 0) -> Tensor | BlockMask:
    """A stage's mask for all its layers (built once by LlamaModel.forward, not in recomputes) from positions: on a GPU
    FlexAttention's BlockMask (which key blocks each query block sees), else the dense mask. offset: a chunk's."""
    if positions.is_cuda:
        (batch, seq), mask_mod = positions.shape, document_mask_mod(positions, offset)
        return _compiled_flex()[0](mask_mod, batch, None, seq, offset + seq, device=positions.device)
    return document_mask(positions, offset)


def document_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask) -> Tensor:
    """Attention of q [batch, heads, seq, head_dim] within documents (mask: attention_mask's). On a GPU, compiled
    FlexAttention: one fused kernel skipping key blocks no query there may see (several documents a window: fewer FLOPs
    than causal). Elsewhere (torch 2.13's FlexAttention has no CPU backward) SDPA, dense mask: masked scores weigh 0."""
    if isinstance(mask, BlockMask):  # a compiled layer takes it as an input: one graph for every microbatch's
        return _compiled_flex()[1](q, k, v, block_mask=mask, enable_gqa=True)
    if not q.is_cpu:  # traced on meta (the tracer), run on a GPU: CUDA's fused kernels take a mask, but with it
        # not grouped K/V heads (torch 2.13 would fall back to its unfused math kernel), so the heads are copied
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.is_cpu)


# ----------------------------------------------------------------------------------------------------------
# Sequence chunks (--seq-chunks, Seq1F1B): the keys and values of a sequence's earlier chunks
#
# A sequence cut into S chunks runs as S forward calls in order, S backward calls last chunk first (Seq1F1B, Sun et al.,
# arXiv 2406.03488): a pipeline holds chunks in flight, not sequences. Exact: chunk j's queries attend to chunks 0..j's
# keys and values, kept per (sequence, chunk) in each attention layer's kv_chunks, outside autograd, so chunk j's
# backward runs no earlier chunk's (their own calls do, later): its gradient for them is summed in their entry, which
# chunk i's backward adds to its own (_ChunkKV): no gradient stops at a chunk boundary. On the output-to-input path,
# that node runs in an input-only backward (zero-bubble's I) too. Held: an entry until its chunk's backward; chunk j's
# attention saves its whole prefix (a copy: SDPA takes it whole) unless its layer is checkpointed.
#
# The chunk travels as a keyword, chunk=SeqChunk(...), to every layer's attention, as positions do (through torch's
# PipelineStage, the hand-written schedule and activation checkpointing's recompute; a context around the stage's call
# would need a per-microbatch hook torch's runtime lacks). torch 2.13's step() hands a non-tensor keyword to every
# microbatch alike: chunks go in pre-cut (step_chunks). Under tp entries hold the rank's heads, the whole chunk.

@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """Chunk `index` of `count` of the sequences in slot `sequence` (those in flight: a step's microbatch index), its
    `length` tokens from token `offset` on (the whole chunk's, whatever sequence parallelism shards)."""
    sequence: int
    index: int
    count: int
    offset: int
    length: int


class _ChunkEntry:
    """A chunk's keys and values (after RoPE), for its sequence's later chunks, the gradient their backwards give
    them, summed in fp32, and how many of those backwards are still to come (readers)."""
    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v, self.grads, self.readers = k, v, None, 0

    def add(self, dk: Tensor, dv: Tensor) -> None:  # the first a copy: a view would hold the later chunk's whole
        self.grads = ([d.to(torch.float32, copy=True) for d in (dk, dv)] if self.grads is None  # gradient
                      else [g.add_(d) for g, d in zip(self.grads, (dk, dv))])


class _ChunkKV(torch.autograd.Function):
    """A chunk's k, v [batch, kv_heads, length, head_dim] -> its sequence's up to it. Forward keeps them for later
    chunks (the last chunk has no reader), not in a checkpointed layer's recompute (in a backward the entry is there or
    freed). Backward gives earlier chunks' entries their gradient, adds later ones' to its own, frees it."""
    @staticmethod
    def forward(ctx, k, v, cache: dict, chunk: SeqChunk, tracked: bool):
        prefix = [cache[chunk.sequence, i] for i in range(chunk.index)]
        ctx.prefix, ctx.cache, ctx.key, ctx.own = prefix, cache, (chunk.sequence, chunk.index), None
        if torch._C._current_graph_task_id() == -1:  # -1: not in a backward (a recompute is)
            for entry in prefix if tracked else ():
                entry.readers += 1
            if chunk.index < chunk.count - 1:
                ctx.own = cache[ctx.key] = _ChunkEntry(k.detach(), v.detach())
        if not prefix:
            return k, v
        return torch.cat([e.k for e in prefix] + [k], 2), torch.cat([e.v for e in prefix] + [v], 2)

    @staticmethod
    def backward(ctx, dk, dv):
        lengths = [e.k.shape[2] for e in ctx.prefix] + [dk.shape[2] - sum(e.k.shape[2] for e in ctx.prefix)]
        (*dks, dk), (*dvs, dv) = dk.split(lengths, 2), dv.split(lengths, 2)
        for entry, dk_i, dv_i in zip(ctx.prefix, dks, dvs):
            entry.add(dk_i, dv_i)
            entry.readers -= 1
        own, ctx.prefix = ctx.own, None
        if own is not None and own.readers:  # else its gradient would miss what they give, silently
            raise RuntimeError(f"chunk {ctx.key[1]} of sequence {ctx.key[0]}: its backward ran before its later "
                               "chunks' backwards; run a sequence's chunks' backwards last chunk first")
        if own is not None and own.grads is not None:
            dk, dv = (own.grads[0] + dk).to(dk.dtype), (own.grads[1] + dv).to(dv.dtype)
        if own is not None and ctx.cache.get(ctx.key) is own:
            del ctx.cache[ctx.key]
        return dk, dv, None, None, None


@torch.compiler.disable  # --compile: run as it is, between a compiled layer's graphs (it keeps state in a dict)
def chunk_keys_values(cache: dict, chunk: SeqChunk, k: Tensor, v: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
    """The keys and values chunk's queries attend to (_ChunkKV; ctx: its forward alone, run on ctx); without a
    backward to come (evaluation), its sequence's entries are dropped after its last chunk."""
    if missing := [i for i in range(chunk.index) if (chunk.sequence, i) not in cache]:
        raise RuntimeError(f"chunk {chunk.index} of sequence {chunk.sequence}: no keys and values of its chunk "
                           f"{missing[0]}; run a sequence's chunks forward in order")
    tracked = (ctx is not None or torch.is_grad_enabled()) and (k.requires_grad or v.requires_grad)
    k, v = _ChunkKV.forward(ctx, k, v, cache, chunk, tracked) if ctx else _ChunkKV.apply(k, v, cache, chunk, tracked)
    for i in range(chunk.index) if not tracked and chunk.index == chunk.count - 1 else ():
        cache.pop((chunk.sequence, i), None)
    return k, v


@torch.library.custom_op("llama::chunk_kv", mutates_args=())
def traced_chunk_kv(k: Tensor, v: Tensor, chunk: Tensor, layer: int, keys: int) -> tuple[Tensor, Tensor]:
    """chunk_keys_values in a graph traced whole (the tracer's: torch.export keeps the op whole, passes no SeqChunk
    or dict): chunk, a SeqChunk's fields; layer, a kv_key. k, v come zero-padded to `keys`, the sequence's length:
    one shape for all chunks (the mask hides the pad). Autograd: _ChunkKV's (forward here; setup_context takes ctx)."""
    ctx = traced_chunk_kv.pending = torch.autograd.function.FunctionCtx()
    k, v = chunk_keys_values(LlamaAttention.kv_caches[layer], SeqChunk(*chunk.tolist()), k, v, ctx)
    ctx.length = k.shape[2]  # the prefix's and the chunk's keys: what the backward splits
    return F.pad(k, (0, 0, 0, keys - k.shape[2])), F.pad(v, (0, 0, 0, keys - v.shape[2]))


traced_chunk_kv.register_fake(lambda k, v, c, l, n: tuple(t.new_empty(*t.shape[:2], n, t.shape[3]) for t in (k, v)))
traced_chunk_kv.register_autograd(lambda ctx, dk, dv: (*_ChunkKV.backward(ctx.kv, dk[:, :, :ctx.kv.length], dv[
    :, :, :ctx.kv.length])[:2], None, None, None), setup_context=lambda ctx, inputs, output: setattr(
    ctx, "kv", getattr(traced_chunk_kv, "pending", None)))  # (None: torch.export's fake run)


# ----------------------------------------------------------------------------------------------------------
# Transformer blocks and the model

class LlamaAttention(nn.Module):
    kv_caches: list[dict] = []  # every attention layer's kv_chunks, at its kv_key: where traced_chunk_kv finds them
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # Each layer's own copy (head_dim / 2 floats): no module shared across layers. Not persistent (HF's neither).
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.kv_key, self.kv_chunks = len(self.kv_caches), {}  # (sequence, chunk) -> _ChunkEntry: keys and values
        self.kv_caches.append(self.kv_chunks)  # of the chunks in flight

    def forward(self, x: Tensor, positions: Tensor | None = None, mask: Tensor | BlockMask | None = None,
                chunk: SeqChunk | Tensor | None = None) -> Tensor:
        """x [batch, seq, hidden]; positions [batch, seq]: token places in their documents (None: causal), mask: the
        stage's attention_mask(positions). chunk: x is that chunk, attending to its sequence's earlier chunks too."""
        batch, seq_len, _ = x.shape
        if traced := isinstance(chunk, Tensor):  # traced_chunk_kv's: positions the whole sequence's [batch, seq]
            keys = torch.arange(positions.shape[1], device=x.device)  # every key: one shape for every chunk
            positions = positions.index_select(1, chunk[3] + keys[:seq_len])  # the chunk's own, from its offset
        # -1 heads: all of them, or this rank's share when tensor parallelism splits the projections by head.
        q, k, v = (proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_tables(self.inv_freq, seq_len, q.dtype, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if traced:  # its mask (document_mask's, by a tensor offset) hides the keys past the chunk, zeros, too
            k, v = traced_chunk_kv(k, v, chunk, self.kv_key, len(keys))
            rows = torch.arange(positions.shape[0], device=x.device)[:, None, None, None]
            mask = document_mask_mod(positions, chunk[3])(rows, None, keys[:seq_len, None], keys)
        elif chunk is not None:
            k, v = chunk_keys_values(self.kv_chunks, chunk, k, v)
        if positions is not None:  # (a caller that gives no mask gets one built here, for this layer alone)
            out = document_attention(q, k, v, mask if mask is not None else attention_mask(positions, chunk.offset
                                                                                        if chunk else 0))
        else:  # the causal mask, which SDPA builds itself; enable_gqa: K/V heads serve several query heads uncopied
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, positions: Tensor | None = None, mask: Tensor | BlockMask | None = None,
                chunk: SeqChunk | None = None) -> Tensor:
        # positions, mask and chunk by keyword: tensor parallelism's input hooks take (and gather) x alone
        x = x + self.self_attn(self.input_layernorm(x), positions=positions, mask=mask, chunk=chunk)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; any of them may be missing on a pipeline stage."""
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # True (the tracer, traced whole then split): each layer builds its own mask. Built before a stage's first
        # layer, it would fall in the stage before (pipeline() cuts there) and cross; cut after the one before, the
        # graph would take positions first, yet torch 2.13 hands a later stage activations first (positions by keyword).
        self.mask_in_each_layer = False

    def forward(self, x: Tensor, positions: Tensor | None = None, chunk: SeqChunk | None = None) -> Tensor:
        # The first stage gets token ids [batch, seq], later ones hidden states [batch, seq, hidden]. Every stage gets
        # the same positions (--document-masking), the whole sequence's whatever tp shards, and builds their mask once
        # for all its layers (a block mask on a GPU; none on a stage of no layer). chunk: x is that chunk of its
        # sequences (positions the chunk's; a later chunk of one stream's, its places, so its mask is built once too).
        h = self.embed_tokens(x) if self.embed_tokens is not None and not x.is_floating_point() else x  # embed_all's
        if positions is None and chunk is not None and chunk.index > 0:
            positions = torch.arange(chunk.offset, chunk.offset + chunk.length, device=x.device).expand(len(x), -1)
        once = positions is not None and len(self.layers) > 0 and not self.mask_in_each_layer
        mask = attention_mask(positions, chunk.offset if chunk is not None else 0) if once else None
        for layer in self.layers.values():  # insertion order == global layer order
            h = layer(h, positions=positions, mask=mask, chunk=chunk)
        return self.norm(h) if self.norm is not None else h


class LlamaForPretraining(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.base_model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # True: forward stops at the final norm; the loss applies the head a piece of the sequence at a time
        # (chunked_loss), never making the whole [batch, seq, vocab] logits. The head is still trained, sharded, saved.
        self.head_in_loss = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tie_word_embeddings, the head uses the embedding's matrix where this module holds both (a stage of one
        keeps its copy, kept equal by TiedEmbedding). to_empty() unties shared parameters: call this again after it."""
        if self.config.tie_word_embeddings and self.base_model.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.base_model.embed_tokens.weight

    def keep_only(self, layers, embed: bool, head: bool, vocab=None) -> "LlamaForPretraining":
        """Trim the model in place to one pipeline stage: the decoder layers given (by global index), the embedding
        if embed, the final norm and the head if head; with vocab (the pipeline ranks' 1-D mesh, --vocab-parallel)
        this rank's rows of both, DTensors (VocabParallel). Names stay the full model's ("layers.4" is layer 4 on
        any stage): checkpoints line up whatever the split. On the meta device, before anything is allocated."""
        for key in list(self.base_model.layers.keys()):
            if int(key) not in layers:
                del self.base_model.layers[key]
        if not embed and vocab is None:
            self.base_model.embed_tokens = None
        if not head:
            self.base_model.norm = None
            self.lm_head = None if vocab is None else self.lm_head
        for module in (self.base_model.embed_tokens, self.lm_head) if vocab is not None else ():
            module.weight = nn.Parameter(distribute_tensor(module.weight, vocab, [Shard(0)], src_data_rank=None))
        self.tie_weights()
        return self

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, chunk: SeqChunk | None = None) -> Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab] (hidden states without the head, or with head_in_loss);
        positions (document_positions; None: one causal stream) and chunk (cut_sequences) go to LlamaModel."""
        h = self.base_model(input_ids, positions, chunk=chunk)
        return self.lm_head(h) if self.lm_head is not None and not self.head_in_loss else h

    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer, the same for a seed at any layout (init_tensor_; after to_empty)."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            init_tensor_(name, tensor, seed, self.config)


@torch.no_grad()
def init_tensor_(name: str, tensor: Tensor, seed: int, config: LlamaConfig) -> None:
    """Initialize one parameter or buffer in place from its full-model name alone, as HF Llama does. Each draws from its
    own generator, seeded by (seed, module name), whatever else this process holds, in any order: any split, by hand or
    traced, starts alike. A DTensor (a tp and/or FSDP2 shard) gets its block of the whole tensor, drawn then freed."""
    if isinstance(tensor, DTensor):
        whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        init_tensor_(name, whole, seed, config)
        # The block of the whole tensor this rank holds, where DCP reads and writes it too: FSDP2 over a
        # tensor-parallel shard places it _StridedShard (tp's block first, then dp's piece of it), still a block.
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        tensor.to_local().copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
        return
    if name.endswith("inv_freq"):
        tensor.copy_(rope_inv_freq(config, device=tensor.device))
    elif name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, base_model.norm
        tensor.fill_(1.0)
    elif name.endswith(".weight"):  # every Linear and the embedding
        module_name = name.removesuffix(".weight")
        if config.tie_word_embeddings and module_name == "lm_head":  # one matrix: the embedding's values
            module_name = "base_model.embed_tokens"
        digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()  # the tensor's own generator
        generator = torch.Generator(device=tensor.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        tensor.normal_(0.0, config.initializer_range, generator=generator)
    else:
        raise ValueError(f"no initializer for {name!r}")


# ----------------------------------------------------------------------------------------------------------
# The loss

def chunked_loss(head, hidden: Tensor, targets: Tensor, chunks: int, sequence_shards: int = 1,
                 tokens: Tensor | None = None, pad: int | None = None) -> Tensor:
    """The mean cross-entropy of head(hidden) [batch, seq, vocab] against targets [batch, seq] (-100, and pad: a Hugging
    Face model's padding, ignored), without the whole logits: the sequence is cut into `chunks` pieces, each one's
    logits computed in fp32, turned into its summed loss and freed; backward computes them again, a piece at a time
    (activation checkpointing of the head and the loss). So the loss holds at most one piece's logits and their
    gradient, 1/chunks of the plain loss's, for one more forward of the head. chunks 1: the plain loss, nothing
    recomputed. Gradients equal the plain loss's to rounding (tested to 1e-6). head: a callable (the head module): with
    tensor parallelism a vocabulary-parallel head returns logits sharded over the vocabulary (a DTensor), and the loss
    runs inside loss_parallel(), forward and backward. sequence_shards: with sequence parallelism, hidden is this rank's
    piece [batch, seq / n, hidden] of the sequence and the head gathers each chunk of it from the n ranks, in rank
    order: the targets of chunk i are then every rank's chunk i. tokens: what the sum is divided by instead of the
    targets' own count: for a chunk of sequences (--seq-chunks), their count over the chunks (cut_sequences' tokens), so
    that every token weighs as in the whole sequences' loss, and the mean over the chunks, as a schedule takes it over
    microbatches, is theirs."""
    def piece(h, y):
        return F.cross_entropy(head(h).flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum")

    targets = targets.masked_fill(targets == pad, -100) if pad is not None else targets
    ys = targets.view(targets.shape[0], sequence_shards, -1).chunk(chunks, -1)  # [batch, ranks, positions]
    plain = chunks == 1 or not torch.is_grad_enabled()
    total = sum(piece(h, y) if plain else torch.utils.checkpoint.checkpoint(piece, h, y, use_reentrant=False)
                for h, y in zip(hidden.chunk(chunks, 1), ys))
    total = total.to_local() if isinstance(total, DTensor) else total  # loss_parallel's sum, replicated over tp
    return total / ((targets != -100).sum().clamp(min=1) if tokens is None else tokens)


# ----------------------------------------------------------------------------------------------------------
# Around the model, for the scripts and tools (the opening docstring lists what)
#
# --model's shapes: `small`: LlamaConfig's defaults (GPT-2 small); llama-* the Llama 3 family's layers (plain RoPE, no
# long-context scaling, untied head; real checkpoints bring theirs: --init-from). The vocabulary: the tokenizer's.
_LLAMA3 = dict(num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)  # every llama-* preset's
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
    "small": dict(),
    "llama-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    "llama-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24),
    "llama-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


def config_from_preset(name: str, vocab_size: int, num_layers: int | None = None) -> LlamaConfig:
    """The preset's config with the tokenizer's vocabulary and, optionally, another number of layers."""
    layers = {"num_hidden_layers": num_layers} if num_layers is not None else {}
    return LlamaConfig(**dict(PRESETS[name], vocab_size=vocab_size) | layers)


# ----------------------------------------------------------------------------------------------------------
# Hugging Face Llama: config.json -> LlamaConfig (export.hf_config writes one), and tensor names
#
# Same math, names (but one prefix) and RoPE layout (rotate-half) as transformers' LlamaForCausalLM: no permutation.
OURS, THEIRS = "base_model.", "model."
# transformers' LlamaConfig defaults, for fields a config.json leaves out (configuration_llama.py).
HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "initializer_range": 0.02}


def hf_name(name: str) -> str:
    """This model's tensor name -> Hugging Face's: base_model.layers.0... -> model.layers.0..."""
    return THEIRS + name[len(OURS):] if name.startswith(OURS) else name


# config_from_hf's limits: sizes within torch's 32-bit indexing (plan.py's sums of bytes and FLOPs stay finite);
# layers: twice the deepest Llama's 126 (a balanced split tries layers^2 layouts: 0.14 s a stage count and cost).
MAX_SIZE, MAX_LAYERS = 2 ** 31 - 1, 256


def config_from_hf(hf: dict) -> LlamaConfig:
    """A config.json's LlamaConfig; ValueError, naming the field, for what model.py does not compute or no model has."""
    if not isinstance(hf, dict):
        shown = json.dumps(hf)
        raise ValueError(f"config.json is {shown if len(shown) <= 40 else shown[:37] + '...'}, not an object of fields")

    def refuse(field, why):
        raise ValueError(f"config.json {field} = {json.dumps(hf.get(field))}: {why}; this project trains Llama "
                         "models (model.py) only")

    def wrong(field, value, why):
        shown = json.dumps(value)
        raise ValueError(f"config.json {field} = {shown if len(shown) <= 40 else shown[:37] + '...'}: {why}")

    def size(field, value, most=MAX_SIZE):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            wrong(field, value, f"must be a whole number from 1 to {most}")
        return value

    def positive(field, value, zero=False):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                value < 0 or (value == 0 and not zero):
            wrong(field, value, f"must be a finite {'non-negative' if zero else 'positive'} number")
        return value

    if hf.get("model_type") != "llama":
        refuse("model_type", "not llama")
    for field, supported in {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}.items():
        if hf.get(field, supported) != supported:
            refuse(field, f"only {json.dumps(supported)} is implemented")
    if hf.get("attention_dropout", 0.0):
        refuse("attention_dropout", "dropout is not implemented")
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 writes both into rope_parameters.
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if not isinstance(hf.get(field) or {}, dict):
        wrong(field, hf[field], "must be an object of RoPE settings (or null)")
    rope = dict(hf.get(field) or {})
    theta = hf.get("rope_theta", rope.pop("rope_theta", HF_DEFAULTS["rope_theta"]))  # (popped either way)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(field, "partial rotary embeddings are not implemented")
    scaling = None  # rope_type default: plain RoPE
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(key not in rope for key in keys):
            refuse(field, f"llama3 scaling needs {', '.join(keys)}")
        scaling = {"rope_type": "llama3", **{key: rope[key] for key in keys}}
        for key in keys[:3]:
            positive(f"{field} {key}", rope[key])
        size(f"{field} original_max_position_embeddings", rope["original_max_position_embeddings"])
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:  # the smooth band divides by their difference
            wrong(f"{field} high_freq_factor", rope["high_freq_factor"], "must exceed low_freq_factor")
    elif rope_type != "default":
        refuse(field, f"rope_type {rope_type} is not implemented (only default and llama3)")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if missing := [key for key in required if key not in hf]:
        raise ValueError(f"config.json has no {missing[0]}")
    sizes = {key: size(key, hf[key], MAX_LAYERS if key == "num_hidden_layers" else MAX_SIZE) for key in required}
    heads = sizes["num_attention_heads"]
    # Absent or null: transformers' defaults (as many KV heads as heads; hidden_size / heads per head).
    kv_heads = heads if hf.get(kv := "num_key_value_heads") is None else size(kv, hf[kv])
    head_dim = None if hf.get("head_dim") is None else size("head_dim", hf["head_dim"])
    if heads % kv_heads:
        wrong("num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")
    if head_dim is None and sizes["hidden_size"] % heads:
        wrong("num_attention_heads", heads, f"must divide hidden_size ({sizes['hidden_size']}), or give head_dim")
    rest = {key: hf.get(key, default) for key, default in HF_DEFAULTS.items() if key != "rope_theta"}
    size("max_position_embeddings", rest["max_position_embeddings"])
    positive("rms_norm_eps", rest["rms_norm_eps"], zero=True)
    positive("initializer_range", rest["initializer_range"], zero=True)
    if not isinstance(rest["tie_word_embeddings"], bool):
        wrong("tie_word_embeddings", rest["tie_word_embeddings"], "must be true or false")
    return LlamaConfig(**sizes, num_key_value_heads=kv_heads, head_dim=head_dim,
                       rope_theta=float(positive("rope_theta", theta)), rope_scaling=scaling, **rest)


# ----------------------------------------------------------------------------------------------------------
# What the model costs: parameters, FLOPs, MFU, and how many pieces the loss is cut into

def parameter_counts(config: LlamaConfig, tp: int = 1) -> dict[str, float]:
    """Parameters of a decoder layer ("layer"), the embedding, and the head with the final norm on one of tp ranks
    (matrices split tp ways, norms' gains whole): the one count FLOPs, layout costs and plan.py's memory come from."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads
    matrices = h * (2 * q + 2 * kv * config.head_dim) + 3 * h * config.intermediate_size  # q, o, k, v; the MLP's 3
    return {"layer": matrices / tp + 2 * h, "embed": config.vocab_size * h / tp, "head": config.vocab_size * h / tp + h}


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM, appendix B): N the parameters but the embedding lookup's (no
    multiply), L layers, H query heads, Q head size, T sequence length (attention)."""
    params, q = parameter_counts(config), config.num_attention_heads * config.head_dim
    n = config.num_hidden_layers * params["layer"] + params["head"]
    return 6 * n + 12 * config.num_hidden_layers * q * seq_len


# NVIDIA's data sheets, dense FLOP/s per GPU: (bf16 on tensor cores, fp32; TF32 is off, torch's default for matmuls).
PEAK_FLOPS = {"H100": (989.5e12, 67e12), "H100 PCIe": (756.5e12, 51e12), "H100 NVL": (835.5e12, 60e12),
              "H200": (989.5e12, 67e12), "H200 NVL": (835.5e12, 60e12), "GH200": (989.5e12, 67e12),
              "A100": (312e12, 19.5e12), "L40S": (362e12, 91.6e12), "L4": (121e12, 30.3e12)}  # H100, H200: SXM


def peak_flops(gpu: str, dtype: torch.dtype) -> float | None:
    """The dense peak for dtype of a GPU named as torch.cuda.get_device_name does ("NVIDIA H100 80GB HBM3": an SXM,
    "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB"); None for one not in PEAK_FLOPS."""
    words = set(gpu.replace("-", " ").split())
    found = [name for name in PEAK_FLOPS if set(name.split()) <= words]  # all its words: "H100 NVL", not "L4"
    return PEAK_FLOPS[max(found, key=len)][dtype == torch.float32] if found else None  # the most specific


def mfu(tokens_per_s: float, config: LlamaConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
        gpus: int) -> float | None:
    """Model FLOPs utilization over the GPUs' dense peak in dtype; None if unknown (CPU, other GPUs)."""
    peak = peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    return tokens_per_s * flops_per_token(config, seq_len) / (peak * gpus) if peak else None


LOSS_PIECE_BYTES = 256 * 2**20  # the fp32 logits of one piece of the loss, when their count is left to loss_chunks


def loss_chunks(requested: int, config: LlamaConfig, microbatch: tuple[int, int], tp: int = 1) -> int:
    """How many pieces chunked_loss cuts a microbatch of (sequences, positions) into: `requested` (--loss-chunks),
    or for 0 as few as keep a piece's fp32 logits on one tensor-parallel rank within LOSS_PIECE_BYTES (at least
    a position each). So 1, the plain loss with nothing recomputed, where the logits are small (the tiny
    model's, 16 MiB: pieces would only add the head's recomputation), and 8 for llama-8b's 128k vocabulary at
    8192 tokens with tp 2 (2 GiB)."""
    logits = microbatch[0] * microbatch[1] * config.vocab_size / tp * 4
    return requested or max(1, min(microbatch[1], math.ceil(logits / LOSS_PIECE_BYTES)))

# ----------------------------------------------------------------------------------------------------------
# Cutting sequences into chunks (--seq-chunks S, --chunk-split): their lengths, and the chunks of a microbatch

def chunk_lengths(seq_len: int, chunks: int, config: LlamaConfig, how: str = "even", multiple: int = 1) -> list[int]:
    """The lengths of `chunks` consecutive chunks of seq_len tokens, each a multiple of `multiple` (sequence
    parallelism's tp): "even", all alike; "compute", of equal FLOPs (the authors' uniform_comp): causal attention reads
    a token's whole prefix, so later chunks cost more per token and are cut shorter. A layer's training FLOPs up to
    token x: 6 N x for its matrices plus 12 H Q per key read (flops_per_token's count), 6 H Q x (x + 1) over the
    prefix; boundaries solve the quadratic for equal shares, rounded. Misfits: a one-line ValueError naming the flag."""
    if not 1 <= chunks <= seq_len // multiple:
        raise ValueError(f"--seq-chunks {chunks}: give 1 to {seq_len // multiple} chunks for --seq-len {seq_len}"
                         + (f" ({multiple} tokens a chunk at least, one per tensor-parallel rank)" * (multiple > 1)))
    if how == "even":
        if seq_len % (chunks * multiple):
            valid = [s for s in range(1, seq_len // multiple + 1) if seq_len % (s * multiple) == 0]
            nearest = min(valid, key=lambda s: (abs(s - chunks), s))
            raise ValueError(f"--seq-chunks {chunks} does not cut --seq-len {seq_len} into even chunks"
                             + (f" of a multiple of {multiple} tokens (--tp)" if multiple > 1 else "")
                             + f"; the nearest that does: --seq-chunks {nearest}")
        return [seq_len // chunks] * chunks
    if how != "compute":
        raise ValueError(f"--chunk-split {how}: give even or compute")
    linear, attention = 6 * parameter_counts(config)["layer"], 6 * config.num_attention_heads * config.head_dim
    total, ends, b = linear * seq_len + attention * seq_len * (seq_len + 1), [], linear + attention
    for j in range(1, chunks):  # attention x^2 + b x = j/chunks of the total
        x = round((-b + math.sqrt(b * b + 4 * attention * total * j / chunks)) / (2 * attention) / multiple) * multiple
        ends.append(min(max(x, (ends[-1] if ends else 0) + multiple), seq_len - (chunks - j) * multiple))
    return [end - start for start, end in zip([0] + ends, ends + [seq_len])]


class Chunk(NamedTuple):
    """A chunk of a microbatch's sequences, run by a schedule as a microbatch: the model's input and keywords
    (positions, chunk), the loss's targets and divisor (chunked_loss's tokens)."""
    inputs: Tensor
    targets: Tensor
    positions: Tensor | None
    chunk: SeqChunk | None
    tokens: Tensor | None


def cut_sequences(inputs: Tensor, targets: Tensor, positions: Tensor | None, lengths: list[int],
                  sequence: int = 0) -> list[Chunk]:
    """A microbatch's inputs, targets and positions ([batch, seq] each; positions: document_positions of the whole
    sequences, or None) cut into chunks of `lengths` (chunk_lengths), in order, in slot `sequence` (must differ between
    microbatches whose chunks interleave), with chunked_loss's tokens. One chunk: the microbatch as it is, bit for bit.
    None (what a stage does not read: inputs after the first, targets before the last): None pieces."""
    if len(lengths) == 1:
        return [Chunk(inputs, targets, positions, None, None)]
    tokens = (targets != -100).sum().clamp(min=1) / len(lengths) if targets is not None else None
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    pieces = [x.split(lengths, 1) if x is not None else [None] * len(lengths) for x in (inputs, targets, positions)]
    return [Chunk(x, y, p, SeqChunk(sequence, j, len(lengths), offsets[j], lengths[j]), tokens)
            for j, (x, y, p) in enumerate(zip(*pieces))]


# ----------------------------------------------------------------------------------------------------------
# Cutting the layers into pipeline stages
#
# A pipeline runs at its slowest stage's pace: the others wait for it each microbatch. Even cuts ignore the last stage's
# head and loss over the whole vocabulary (4.6 layers' work on tiny, 1.8 on llama-8b's 128k vocabulary) and the first's
# embedding. The balanced layout's contiguous boundaries minimize the slowest stage's forward + backward cost per token:
#
#     layer  6 N_layer + 12 H Q T   N_layer weights, 3 multiplies each (2 in backward), attention over T (PaLM)
#     head   6 h V                  the projection to the vocabulary (the loss itself is a few ops per logit)
#     embed  6 h                    a lookup forward, a scatter-add backward
#
# Checkpointing runs a layer's forward again in backward: 4/3 of its cost (not the head's: a little fewer layers go to
# the last stage). A head heavier than a layer cannot be balanced by whole layers: the first and the last stage may then
# hold no layer (the embedding alone; the norm, head and loss alone), as Megatron's and torchtitan's layouts allow (tiny
# model, 3 stages: the slowest stage from 53 % of the work to 43 %). (plan.py --trace: on measured times.)

def estimated_costs(config: LlamaConfig, seq_len: int, recompute: bool | str = False,
                    loss_chunks: int = 1) -> dict[str, float]:
    """Forward + backward FLOPs per token of a decoder layer (with its recomputed forward under checkpointing:
    "recompute", that part of "layer"), the head with the loss (its forward twice with a chunked loss:
    "head_recompute"), and the embedding. recompute: True or "full" (the SPEC) for every layer; selective recomputes no
    matmul (no FLOPs counted); a SPEC per stage is balanced as none (its counts depend on the split)."""
    params, q = parameter_counts(config), config.num_attention_heads * config.head_dim
    layer = 6 * params["layer"] + 12 * q * seq_len
    again = layer / 3 if recompute in (True, "full") else 0.0  # the forward is a third of forward + backward
    head, head_again = 6 * params["head"], 2.0 * params["head"] * (loss_chunks > 1)  # (again: its forward, a third)
    return {"layer": layer + again, "recompute": again, "head": head + head_again, "head_recompute": head_again,
            "embed": 6 * config.hidden_size}


def stage_costs(layout: list[range], costs: dict[str, float]) -> list[float]:
    """Each stage's cost: its layers (maybe none), the embedding on the first, the head on the last."""
    return [len(layers) * costs["layer"] + (costs["embed"] if i == 0 else 0)
            + (costs["head"] if i == len(layout) - 1 else 0) for i, layers in enumerate(layout)]


def even(num_layers: int, num_stages: int) -> list[range]:
    """One contiguous range of layers per stage, sizes differing by at most one (earlier stages get the extra)."""
    base, extra = divmod(num_layers, num_stages)
    return from_sizes([base + (1 if stage < extra else 0) for stage in range(num_stages)])


def from_sizes(sizes: list[int]) -> list[range]:
    return [range(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]


def balanced(num_layers: int, num_stages: int, costs: dict[str, float]) -> list[range]:
    """The contiguous layout whose slowest stage costs least (stage_costs): inner stages hold layers, the ends none only
    where that is faster. Of those as fast, the most even: the second slowest cheapest, then the third..."""
    return from_sizes(_balanced_sizes(num_layers, num_stages, costs["layer"], costs["embed"], costs["head"]))


@functools.lru_cache(maxsize=4096)  # a layout search (plan.py --gpus) asks for the same split hundreds of times
def _balanced_sizes(num_layers: int, num_stages: int, layer: float, first: float, last: float) -> tuple[int, ...]:
    if num_stages == 1:
        return (num_layers,)
    # Layers cost alike: a layout is its end stages' layer counts a, b, the stages between sharing the rest as evenly
    # as whole layers allow (later ones the extras), each as cheap as can be. Every (a, b) is tried: O(layers^2).
    inner, best, found = num_stages - 2, None, None
    for a in range(num_layers + 1):
        for b in range(num_layers - a + 1):
            rest = num_layers - a - b
            if rest < inner or (inner == 0 and rest):  # a stage between the ends without a layer; layers left over
                continue
            few, extra = divmod(rest, inner) if inner else (0, 0)
            counts: dict[float, int] = {}
            for cost, n in ((a * layer + first, 1), (b * layer + last, 1), (few * layer, inner - extra),
                            ((few + 1) * layer, extra)):
                if n:
                    counts[cost] = counts.get(cost, 0) + n
            # Slowest first, then fewer layerless end stages, then the stages' costs from the slowest down (how
            # many at each): a tuple that compares as the whole sorted list of stage costs would.
            ranked = sorted(counts.items(), reverse=True)
            key = (ranked[0][0], (a == 0) + (b == 0), ranked)
            if best is None or key < best:  # on a tie the first found stays
                best, found = key, (a, b, few, extra)
    a, b, few, extra = found
    return (a, *[few] * (inner - extra), *[few + 1] * extra, b)


def max_stages(num_layers: int) -> int:
    """The most pipeline stages num_layers make: one a layer, and the embedding alone first, the head alone last."""
    return num_layers + 2


def layout(spec: str, config: LlamaConfig, num_stages: int, seq_len: int, recompute: bool | str = False,
           loss_chunks: int = 1, tp: int = 1, vocab: bool = False) -> list[range]:
    """The layers of each stage: spec "balanced" (by estimated_costs; vocab, --vocab-parallel: of the layers
    alone), "even", or layers per stage ("5,1"; the first and the last may be 0). What the model's shape rules
    out (more stages than it has layers but for two layerless ends, --seq-len, --tp, --split,
    --activation-checkpointing's entries, --vocab-parallel's) is a ValueError."""
    if vocab and tp > 1:
        raise ValueError("--vocab-parallel with --tp: the vocabulary is split over the pipeline ranks alone; leave "
                         "out one of --vocab-parallel and --tp")
    if vocab and 0 < config.vocab_size <= (num_stages - 1) * -(-config.vocab_size // num_stages):  # 0: unknown
        raise ValueError(f"--vocab-parallel: a vocabulary of {config.vocab_size} leaves pipeline rank {num_stages - 1}"
                         f" of {num_stages} no rows (torch.chunk's); leave --vocab-parallel out or use fewer ranks")
    if num_stages > max_stages(config.num_hidden_layers):
        raise ValueError(f"{num_stages} pipeline stages but the model has {config.num_hidden_layers} layers: each "
                         "stage needs one, but for a first stage of the embedding alone and a last one of the head "
                         "alone; use fewer stages or more --layers")
    check_positions(config, seq_len)
    for what, count in (("attention heads", config.num_attention_heads), ("KV heads", config.num_key_value_heads),
                        ("MLP width", config.intermediate_size), ("vocabulary", config.vocab_size)):
        if count % tp:  # tensor parallelism gives each rank an equal share of these
            raise ValueError(f"--tp {tp}: the model's {what} ({count}) do not divide by it; use a --tp that "
                             f"divides {count}")
    check_layout(spec, config.num_hidden_layers, num_stages)
    entries = checkpointing_plan(recompute, num_stages)  # --activation-checkpointing: one entry, or one a stage
    if spec == "even":
        stages = even(config.num_hidden_layers, num_stages)
    elif spec == "balanced":
        costs = estimated_costs(config, seq_len, recompute, loss_chunks) | ({"embed": 0, "head": 0} if vocab else {})
        stages = balanced(config.num_hidden_layers, num_stages, costs)
    else:
        stages = from_sizes([int(size) for size in spec.split(",")])
    one, most = isinstance(recompute, str) and "," not in recompute, max(map(len, stages))  # one: every stage's
    for s, (entry, layers) in enumerate(zip(entries, stages)):  # a count beyond the layers: a mistake, not "full"
        if isinstance(entry, int) and entry > (limit := most if one else len(layers)):
            raise ValueError(f"--activation-checkpointing {recompute}: {entry} layer(s) recomputed whole, but "
                             f"{'the largest stage' if one else f'stage {s}'} holds {limit} (--split {spec}: "
                             f"{[len(layers) for layers in stages]} layers); give at most {limit}, or full")
    return stages


def check_positions(config: LlamaConfig, seq_len: int) -> None:
    """--seq-len within the model's positions (max_position_embeddings), else a ValueError of one line."""
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {config.max_position_embeddings} positions; give "
                         f"at most {config.max_position_embeddings}, or a model with more (a config.json's "
                         "max_position_embeddings and rope_scaling: docs/layouts.md)")


def check_layout(spec: str, num_layers: int | None = None, num_stages: int | None = None) -> None:
    """A --split spec's syntax; with the model's layers and the stage count, whether it fits them. ValueError."""
    if spec == "even" and num_layers is not None and num_stages > num_layers:
        raise ValueError(f"--split even: {num_stages} stages but {num_layers} layers; use balanced, or layer counts "
                         "with a 0 for a first stage of the embedding alone or a last one of the head alone")
    if spec in ("even", "balanced"):
        return
    try:
        sizes = [int(size) for size in spec.split(",")]
    except ValueError:
        raise ValueError(f"--split {spec}: use balanced, even, or layers per stage such as 5,1 (or 0,3,3,0: the "
                         "first and the last stage may hold the embedding or the head alone)") from None
    if min(sizes) < 0 or min(sizes[1:-1], default=1) < 1:  # a stage between the ends with 0: nothing to compute
        raise ValueError(f"--split {spec}: a stage between the first and the last needs at least 1 layer; only the "
                         "first (the embedding alone) and the last (the norm and the head alone) may have 0")
    if num_layers is not None and (len(sizes) != num_stages or sum(sizes) != num_layers):
        raise ValueError(f"--split {spec}: give {num_stages} layer counts (one per stage) adding up to the model's "
                         f"{num_layers} layers, each at least 1 but the first and the last, which may be 0 (or "
                         "balanced, even)")


def describe_layout(layout: list[range], costs: dict[str, float], vocab: int = 0) -> str:
    """[embed + layers 0-3 (41%)] [layers 4-5 (30%)] [norm + head (29%)]: each stage and its share of the cost.
    vocab (--vocab-parallel, the vocabulary's size): each stage's rows of both, their cost spread alike."""
    n, rows, spread = len(layout), -(-vocab // len(layout)), (costs["embed"] + costs["head"]) / len(layout)
    shares = [len(r) * costs["layer"] + spread for r in layout] if vocab else stage_costs(layout, costs)
    total, parts = sum(shares), []
    for stage, layers in enumerate(layout):
        pieces = (["embed"] if stage == 0 and not vocab else []) + (
            [f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"]
            if len(layers) else []) + ([["norm + head"], ["norm"]][bool(vocab)] if stage == n - 1 else []) + (
            [f"vocab {stage * rows}-{min(vocab, stage * rows + rows) - 1}"] if vocab else [])
        parts.append(f"[{' + '.join(pieces)} ({shares[stage] / total:.0%})]")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------------------
# Per decoder layer: activation checkpointing and compile (hand-split, traced or FSDP stages); tensor parallelism

def merged_stages(modules: list[nn.Module]) -> nn.Module:
    """One module holding the parameters of a rank's stage modules under their full-model names (shared, not
    copied), for the optimizer and checkpoints; a single stage is itself."""
    if len(modules) == 1:
        return modules[0]
    root = nn.Module()
    for module in modules:
        for name, param in module.named_parameters():
            *path, leaf = name.split(".")
            node = root
            for part in path:  # (setdefault: a ModuleDict of no entries is falsy)
                node = node._modules.setdefault(part, nn.Module())
            node.register_parameter(leaf, param)
    return root


def decoder_layers(modules) -> list[nn.Module]:
    """The decoder layers (base_model.layers.K) of stage modules, each once, in layer order (K; traced: the same)."""
    layers = {id(m): (int(name.rsplit(".", 1)[-1]), m) for module in modules for name, m in module.named_modules()
              if name.rsplit(".", 1)[0].endswith("layers") and name.rsplit(".", 1)[-1].isdigit()}
    return [m for _, m in sorted(layers.values(), key=lambda pair: pair[0])]


def checkpointing_plan(spec: str | bool, num_stages: int | None = None, stages=None) -> list[str | int]:
    """--activation-checkpointing SPEC, an entry per stage: "none"; "selective" (SELECTIVE_SAVE's outputs kept, the rest
    recomputed); "full" (a layer's input kept, its forward rerun); or a count N (a stage's first N layers full, the rest
    none; at most its layers: layout()). One entry for all stages, or one per stage, comma-separated (num_stages; None:
    unchecked); of `stages` alone if given (a rank's). True/False: full/none (the old flag). ValueError, one line."""
    if isinstance(spec, bool):
        spec = "full" if spec else "none"
    entries = [int(e) if e.isdigit() else e for e in spec.split(",")]
    if "auto" in entries:  # plan.py's choice, for a layout and a memory
        raise ValueError(f"--activation-checkpointing {spec}: auto is plan.py's: plan.py --processes N "
                         "--activation-checkpointing auto (and the run's flags) prints the SPEC that fits "
                         "--gpu-memory; give that")
    if any(e not in CHECKPOINTING and not isinstance(e, int) for e in entries):
        raise ValueError(f"--activation-checkpointing {spec}: give full, selective, none, or one per stage "
                         "separated by commas, each full, selective, none or a count of the stage's layers "
                         "recomputed whole (4,2,0,0)")
    if len(entries) > 1 and num_stages is not None and len(entries) != num_stages:
        raise ValueError(f"--activation-checkpointing {spec}: {len(entries)} entries for {num_stages} "
                         f"stage{'s' * (num_stages != 1)}; give one per stage ({num_stages}), or one for all")
    entries = entries * (num_stages or 1) if len(entries) == 1 else entries
    return entries if stages is None else [entries[s] for s in stages]


def layer_checkpointing(entry: str | int, layers: int) -> list[str]:
    """Each of a stage's `layers` layers' mode by its checkpointing_plan entry (a count: the first that many full)."""
    return [("full" if i < entry else "none") if isinstance(entry, int) else entry for i in range(layers)]


def checkpoint_layers(modules, how: str | int | list = "full") -> None:
    """Checkpoint each decoder layer as `how` says (a checkpointing_plan entry for all modules, or a list of one each)
    with checkpoint_once: FSDP's hooks and autocast work inside; same ops, same numbers, bit for bit."""
    seen = set()
    for module, entry in zip(modules, how if isinstance(how, list) else [how] * len(modules)):
        layers = [layer for layer in decoder_layers([module]) if id(layer) not in seen]
        for layer, mode in zip(layers, layer_checkpointing(entry, len(layers))):
            seen.add(id(layer))
            if mode != "none":
                layer.forward = _checkpointed(layer.forward, mode == "selective")


def _checkpointed(forward, selective: bool = False):
    def run(*args, **kwargs):  # forward only (evaluation, no grad): nothing to keep either way
        return (checkpoint_once(forward, *args, context_fn=_selective_contexts if selective else None, **kwargs)
                if torch.is_grad_enabled() else forward(*args, **kwargs))
    return run


def _saved_ops() -> frozenset:
    """SELECTIVE_SAVE: torchtitan's selective policy (op level). Kept: matmul outputs (a layer's seven projections'
    aten.mm), attention's (the SDPA kernels below; FlexAttention's op on a GPU, as torchtitan: not run here, no CPU
    backward), and with --tp sequence parallelism's reduce-scatters (torchtitan's choice). Recomputed: norms, RoPE, SiLU
    and product, residual adds, casts, views, all-gathers and all-reduces (as full checkpointing). torchtitan recomputes
    every second mm; this keeps all (the issue's policy): less recomputation, more memory (plan.py counts it)."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    names = [(aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "_scaled_dot_product_flash_attention_for_cpu"),
             (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
             (aten, "_scaled_dot_product_cudnn_attention"), (c10d, "reduce_scatter_tensor")]
    ops = {getattr(namespace, name).default for namespace, name in names if hasattr(namespace, name)}
    return frozenset(ops | {torch.ops.higher_order.flex_attention})


SELECTIVE_SAVE = _saved_ops()
CHECKPOINTING = ("none", "selective", "full")  # checkpointing_plan's modes


def _selective_policy(ctx, op, *args, **kwargs):
    return (torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE
            else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)


class _Reusable(dict):
    """A selective checkpoint's store of an op's outputs. torch marks an output consumed once recomputed and refuses a
    second recomputation, which checkpoint_once may need (a read it did not keep): the op then runs again."""
    def __setitem__(self, key, value):
        super().__setitem__(key, torch.utils.checkpoint._RECOMPUTE if value is torch.utils.checkpoint._CONSUMED
                            else value)


def _selective_contexts():
    """The context_fn of a selective checkpoint: torch's two modes (keep SELECTIVE_SAVE's outputs in forward, hand
    them back in the recomputation), sharing a store that allows checkpoint_once's rare second recomputation."""
    forward, recompute = torch.utils.checkpoint.create_selective_checkpoint_contexts(_selective_policy)
    forward.storage = recompute.storage = collections.defaultdict(_Reusable)
    return forward, recompute


def checkpoint_once(function, *args, context_fn=None, **kwargs):
    """torch.utils.checkpoint (non-reentrant) of function(*args, **kwargs), recomputed once however many backward calls
    read it. torch recomputes once per autograd call (graph task); a zero-bubble split backward makes several: I (input
    gradient) one, W (weight gradients) one per weight group, W rerunning I's nodes where a weight's gradient branches
    off (retain_graph), rereading their saved tensors. torch's GraphExecGroup shares one recompute among calls but
    refuses a tensor read twice. So: one group per region, every read under it, and a tensor W reads again kept from its
    first read until its node is freed (after W; in a plain backward after its run, as torch frees it). The rest is
    freed once read, as torch does: from I to W a split backward holds the weights' ops' inputs, not the whole layer.
    Should W read a freed one, the region reruns under a new group: slower, never wrong. context_fn: torch's."""
    context = {"context_fn": context_fn} if context_fn else {}
    # Traced by torch.compile, or a torch before 2.13 (no GraphExecGroup): torch's own, a recompute per call.
    if torch.compiler.is_compiling() or not hasattr(torch.utils.checkpoint, "GraphExecGroup"):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **context, **kwargs)
    group, runs = [torch.utils.checkpoint.GraphExecGroup()], []

    def hooked(*a, **k):
        runs.append(1)
        if len(runs) > 1:  # the recomputation, under torch's recording hooks: nothing of ours
            return function(*a, **k)
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)  # checkpoint's, just entered

        def unpack_once(saved: list):  # [torch's holder, the tensor if kept, the group it was read under]
            if saved[1] is not None:
                return saved[1]
            if saved[2] is group[0]:  # read and freed under this group, read again: recompute once more
                group[0] = torch.utils.checkpoint.GraphExecGroup()
            with group[0]:
                tensor, saved[2] = unpack(saved[0]), group[0]
            node = torch._C._current_autograd_node()
            if node is None or any(_weights_only(fn) for fn, _ in node.next_functions):
                saved[1] = tensor
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(lambda x: [pack(x), None, None], unpack_once):
            return function(*a, **k)
    return torch.utils.checkpoint.checkpoint(hooked, *args, use_reentrant=False, **context, **kwargs)


def _weights_only(fn, budget: int = 8) -> bool:
    """Whether autograd node fn leads to parameters alone within few nodes (transpose, cast, view): where the input
    gradient branches to a weight, which W runs again (stage_backward_input's intermediate of a parameter group)."""
    stack, found = [fn], False
    while stack:
        if (fn := stack.pop()) is None:
            continue
        if (budget := budget - 1) < 0:
            return False
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf
            if not isinstance(fn.variable, nn.Parameter):
                return False
            found = True
        stack += [next_fn for next_fn, _ in fn.next_functions]
    return found


def compile_layers(modules) -> None:
    """torch.compile each decoder layer in place (module.compile(): the names, and so checkpoints, stay), as
    torchtitan does: one small graph per layer, compiled once and reused by every layer of the same shape."""
    for layer in decoder_layers(modules):
        layer.compile()


def _grad_as_weight(weight: DTensor) -> None:
    if weight.grad.placements != weight.placements and not any(p.is_partial() for p in weight.grad.placements):
        weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)


def sum_partial_grads(params) -> None:
    """Sum the gradients left as partial sums over the tensor-parallel ranks (Partial DTensors: the norms' gains under
    sequence parallelism) in one all-reduce. Partial sums add up over a step's microbatches: one reduction a step
    (clip_grad_norm_'s), not 2 x layers + 1 all-reduces a microbatch. With FSDP2 (--dp) its own reduction sums them."""
    partial = [p for p in params if isinstance(p.grad, DTensor) and p.grad.placements != p.placements]
    if not partial:
        return
    local = [p.grad.to_local() for p in partial]  # on the 1-D tensor-parallel mesh, as tensor_parallel places them
    flat = torch.cat([g.flatten() for g in local])
    dist.all_reduce(flat, group=partial[0].device_mesh.get_group())
    for p, g, summed in zip(partial, local, flat.split([g.numel() for g in local])):
        p.grad = DTensor.from_local(summed.view_as(g), p.device_mesh, p.placements)


SHARD_OUT = {"output_layouts": Shard(1)}  # a row-wise layer's partial sums reduce-scattered by sequence


def tensor_parallel(model: LlamaForPretraining, tp_mesh, sequence_parallel: bool = True) -> None:
    """Tensor parallelism of a model or stage over tp_mesh (a 1-D DeviceMesh; the order: parallelize): Megatron-LM's
    plan (Shoeybi et al. 2019), as PyTorch's tutorial and torchtitan. Each layer's q/k/v and gate/up split by output
    (each rank its heads and MLP slice), o and down by input (each rank a partial sum); the embedding by vocabulary
    rows, the head by columns, logits left sharded for loss_parallel. Without sequence parallelism partial sums are
    all-reduced (every layer's output whole on every rank); with it (Korthikanti et al. 2022; local heads for RoPE and
    GQA) they are reduce-scattered by sequence: the residual stream, norms and what crosses to the next stage are each
    rank's [batch, seq / tp, hidden] piece, all-gathered only where attention and the MLP need every position."""
    if tp_mesh.size() == 1:
        return
    sp = sequence_parallel
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(**SHARD_OUT if sp else {}),
            "mlp.down_proj": RowwiseParallel(**SHARD_OUT if sp else {})}
    if sp:
        plan |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                 "self_attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                 "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())}
    for layer in model.base_model.layers.values():
        parallelize_module(layer, tp_mesh, plan)
    if model.base_model.embed_tokens is not None:
        parallelize_module(model.base_model.embed_tokens, tp_mesh, RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()))
        if not model.base_model.layers and model.base_model.norm is None:  # a stage of the embedding alone gives
            # out its to_local() view of the rank's piece: copied, as the final norm's below
            model.base_model.embed_tokens.register_forward_hook(lambda module, args, output: output.clone())
    if model.base_model.norm is not None and sp:  # its output, the stage's, stays a plain [batch, seq/tp, hidden]
        parallelize_module(model.base_model.norm, tp_mesh, SequenceParallel(use_local_output=True))
        # to_local() gives a view of the rank's piece; FSDP2 (--dp) warns of any: an in-place op on a view drops its
        # backward hook on a stage's output (its all-gather: wrong gradients). None here; a copy makes sure.
        model.base_model.norm.register_forward_hook(lambda module, args, output: output.clone())
    if model.lm_head is not None:  # the loss gathers each piece of the sequence it takes (chunked_loss)
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False))
    # A gradient laid out unlike its weight: the embedding's (no DTensor row-wise rule for its backward: each rank the
    # whole [vocab, hidden]) takes its weight's layout once accumulated (a slice, no message) for the tied copy's sum,
    # and norms' partial sums (sequence pieces) wait for sum_partial_grads: clipping and AdamW see weight layouts.
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_grad_as_weight)
    model.tie_weights()  # one stage, tied: the head takes the embedding's (sharded alike) matrix again


def parallelize(modules: list[nn.Module], mesh, dtype: torch.dtype, sequence_parallel: bool = True,
                activation_checkpointing: bool | str = False, compile: bool = False, stages=None) -> None:
    """A rank's stage modules, in place, in torchtitan's order: tensor parallelism over mesh["tp"], activation
    checkpointing, compile, then FSDP2 over mesh["dp"] (each decoder layer, then each stage's root, gathered and
    reduced as one unit). On the meta device, as the scripts call it: then materialize. dtype: of the computation
    and of what crosses between stages (cast_between_stages); weights, their gradients' reduction and what goes
    into the loss fp32. activation_checkpointing: --activation-checkpointing's SPEC (True: full), whose entry per
    stage is that of the modules' `stages` (their indices in the pipeline; a single entry is every stage's)."""
    for module in modules:
        tensor_parallel(module, mesh["tp"], sequence_parallel)
    entries = checkpointing_plan(activation_checkpointing)  # (layout() checked their count against the stages')
    checkpoint_layers(modules, entries * len(modules) if len(entries) == 1 else [entries[s] for s in stages])
    if compile:
        compile_layers(modules)
    if mesh["dp"].size() > 1:
        # reshard_after_forward=False: a stage runs forward once per microbatch, and gathering its parameters
        # again for each would multiply the all-gathers by the microbatches (torchtitan's choice too). bf16:
        # parameters gathered in bf16, gradients reduced in fp32; a stage's root gives out fp32 (as with dp 1).
        for module in decoder_layers(modules) + modules:  # (--vocab-parallel's slices, over pp x dp: VocabParallel's)
            pp = {p for p in module.parameters() if isinstance(p, DTensor) and "pp" in p.device_mesh.mesh_dim_names}
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(
                dtype, torch.float32, torch.float32 if module in modules else None), ignored_params=pp)
    if dtype != torch.float32:  # after FSDP2's hooks: its output cast comes first
        for module in modules:
            cast_between_stages(module, dtype)


def materialize(modules: list[nn.Module], config: LlamaConfig, device: torch.device, seed: int) -> None:
    """Allocate a rank's stage modules (built, parallelized on meta as torchtitan) and initialize each tensor
    (init_tensor_: the same weights, bit for bit, at any layout). A rank holds at most its shards (to_empty) and largest
    whole tensor (drawn one at a time): plan.py's start-up peak. llama-70b at pp 4 x dp 2 x tp 8 (2 stages a rank):
    8.2 GiB on rank 0 (4.3 of shards, 3.9 of the head drawn whole), not 68 GiB as whole stages before tp and FSDP2."""
    for module in modules:
        holders = {}  # each parameter's places (module, name): a tied one has two
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append((owner, name))
        module.to_empty(device=device)
        for param in module.parameters():
            # torch 2.13: a DTensor parameter is swapped in place (swap_tensors): the object keeps its
            # post-accumulate-grad hooks (tensor_parallel's), the tensor now under it has none: installed again.
            if param._post_accumulate_grad_hooks:
                param._post_accumulate_grad_hooks = param._post_accumulate_grad_hooks
        # A plain parameter is replaced: a tied head on a plain (tp 1, dp 1) stage gets a tensor of its own, so it
        # takes the embedding's again. (A DTensor, swapped in place, stays shared.)
        for (first, first_name), *others in holders.values():
            for owner, name in others:
                if getattr(owner, name) is not getattr(first, first_name):
                    setattr(owner, name, getattr(first, first_name))
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            init_tensor_(name, tensor, seed, config)


def cast_between_stages(stage: nn.Module, dtype: torch.dtype) -> None:
    """What a stage module gives out to the next stage in dtype (bf16: half fp32's bytes, as Megatron-LM and torchtitan
    send), its floating input taken back to fp32: the stage computes as on one process (residual stream fp32 under
    autocast), the gradient sent back rounded to dtype once, on its way. The last stage (the head's) gives the loss
    fp32: under tp the head sums their gradient over the ranks, in fp32 as every gradient sum here."""
    stage.register_forward_pre_hook(lambda module, args: tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))  # positions: int
    if getattr(stage, "lm_head", None) is None:
        stage.register_forward_hook(lambda module, args, output: output.to(dtype))


# ----------------------------------------------------------------------------------------------------------
# Tied embeddings across stages

class TiedEmbedding:
    """tie_word_embeddings across pipeline stages: the head is the embedding matrix, but the embedding is on the first
    stage and the head on the last. Each of the two stages keeps a copy (one tensor when a rank holds both stages and is
    one stage). The copies start equal, and every step, before clipping and AdamW, both get the sum of the two
    gradients, that of the one shared matrix: the ranks holding the first and the last stage of each replica all-reduce
    it between them (Megatron's embedding group); a rank holding both adds them up itself. Same gradient, same AdamW
    state, same update: the copies stay equal bit for bit. Checkpoints store the matrix once. With tensor parallelism
    both copies are split by vocabulary rows alike, so each tensor-parallel rank pairs with its own counterpart. Create
    it on every rank: it makes process groups."""

    def __init__(self, model, config, mesh, has_first: bool, has_last: bool):
        params = dict(model.named_parameters(remove_duplicate=False))
        self.embed, self.head = params.get("base_model.embed_tokens.weight"), params.get("lm_head.weight")
        self.active, self.group = config.tie_word_embeddings and self.embed is not self.head, None
        if not config.tie_word_embeddings or dist.get_world_size() == 1:
            return
        # Who holds the first or last stage of each replica's tensor-parallel slice; new_group is collective,
        # called by every rank in the same order.
        holders = [None] * dist.get_world_size()
        place = (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank())
        dist.all_gather_object(holders, (place, has_first or has_last))
        for where in sorted({where for where, _ in holders}):
            ranks = [rank for rank, (w, holds) in enumerate(holders) if w == where and holds]
            if len(ranks) == 2:
                group = dist.new_group(ranks)
                self.group = group if dist.get_rank() in ranks else self.group

    def sync_grads(self) -> None:
        if not self.active:
            return
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        if self.embed is not None and self.head is not None:  # both on this rank
            total = local(self.embed.grad) + local(self.head.grad)
            local(self.embed.grad).copy_(total)
            local(self.head.grad).copy_(total)
        else:  # FSDP shards both copies alike over the replicas: shard d meets shard d
            dist.all_reduce(local((self.embed if self.embed is not None else self.head).grad), group=self.group)

    @property
    def copies(self) -> list:
        return [self.head] if self.active and self.head is not None else []


def clip_grad_norm_(params, max_norm: float, copies=(), tp: int = 1) -> Tensor:
    """Clip by the norm of the whole model's gradient, of which each rank holds a disjoint part (its stages',
    its FSDP shard), and return it, the same on every rank. copies: a tied head's copy of the embedding,
    clipped but counted once. Sums the partial gradients first (sum_partial_grads). Collective."""
    def tp_copies(p) -> int:  # a tensor every tensor-parallel rank holds whole (a norm's gain) is counted once
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if "pp" in names:  # --vocab-parallel's slice (VocabParallel), over pp x dp: each tensor-parallel rank's copy
            return dist.get_world_size() // p.device_mesh.size()
        return tp if "tp" not in names or p.placements[names.index("tp")].is_replicate() else 1

    params, skip, squares = [p for p in params if p.grad is not None], {id(p) for p in copies}, []
    sum_partial_grads(params)
    for p in (p for p in params if id(p) not in skip):
        # In float64 over rows of 4096: torch's float32 norm on the CPU sums a whole tensor in one running sum,
        # 2e-5 off on the tiny model's embedding, more than two layouts may differ by.
        flat = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).flatten()
        whole = flat.numel() // 4096 * 4096
        norms = torch.cat([torch.linalg.vector_norm(flat[:whole].view(-1, 4096), dim=1),
                           torch.linalg.vector_norm(flat[whole:])[None]])
        squares.append((norms.double() ** 2).sum() / tp_copies(p))
    total = torch.stack(squares).sum()
    dist.all_reduce(total)
    total = total.sqrt().float()
    if max_norm > 0:  # as torch.nn.utils.clip_grads_with_norm_, on the local tensors
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params], scale)
    return total


def synchronize(device: torch.device) -> None:
    """The host waits for the device's work, NCCL's calls included (cudaDeviceSynchronize); nothing on the CPU.
    nccl_rules.py records each call, on the CPU too: the replay has the host wait there for every call issued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------
# Vocabulary parallelism over the pipeline ranks (--vocab-parallel, the hand-written pipeline)
#
# Yeung et al., MLSys 2025: each pipeline rank holds its rows (torch.chunk's) of the embedding and of the head (tied:
# one slice), DTensors: checkpoints hold whole matrices. Input layer, a step's: each rank looks up its rows (0 for
# other ids), a reduce sums them onto the first stage; their gradients are broadcast back. Output layer, each
# microbatch's: the final hidden states broadcast, each rank's logits slice (chunked_loss's pieces and weights),
# all-reduces of the softmax's maximum and of (sum of exponentials, target's logit); the slice's head gradient in
# closed form (softmax - one-hot), the hidden states' reduced onto the last stage. One order on every rank.
# With --dp each replica holds 1/dp of its rank's rows (Shard(0), Shard(0) over pp x dp) and of their AdamW state.
# Not by FSDP2: its hooks reduce autograd's gradients, and these are closed-form. So as FSDP2 does, by hand: each
# schedule step gathers the rows over the replicas (embed_all), the passes add into that copy's .grad, and an
# optimizer step's last reduce-scatters it, averaged, into the shards' (embed_backward).

class VocabParallel:
    """This rank's rows of the vocabulary layers (keep_only's vocab) and their passes; mesh: the run's (pp, dp, tp)."""

    def __init__(self, model: LlamaForPretraining, mesh):
        self.slices, self.group, self.dp = mesh["pp", "dp"], mesh.get_group("pp"), mesh["dp"].size()
        for module in (model.base_model.embed_tokens, model.lm_head):  # keep_only's rows, a replica's share of them
            module.weight = nn.Parameter(distribute_tensor(torch.empty(module.weight.shape, device="meta"),
                                                           self.slices, [Shard(0), Shard(0)], src_data_rank=None))
        model.tie_weights()
        self.embed, self.head = self.params = (model.base_model.embed_tokens.weight, model.lm_head.weight)
        self.whole = dict.fromkeys(self.params)  # each slice's (tied: one) copy gathered over the replicas (dp > 1)
        self.rank, self.last = dist.get_rank(self.group), dist.get_world_size(self.group) - 1
        (self.rows, _), (self.start, _) = compute_local_shape_and_global_offset(self.embed.shape, mesh["pp"],
                                                                                [Shard(0)])  # this rank's rows

    def _gather(self) -> None:  # the slices whole for a schedule step's passes, the step's gradients so far in .grad
        for p, whole in self.whole.items() if self.dp > 1 else ():  # (the last window's copy freed first)
            grad, self.whole[p] = getattr(whole, "grad", None), None
            self.whole[p] = p.redistribute(placements=[Shard(0), Replicate()])  # all-gathered over the replicas
            self.whole[p].grad = grad
        self.embed, self.head = (self.whole[p] if self.dp > 1 else p for p in self.params)

    def _own(self, ids: Tensor) -> tuple[Tensor, Tensor]:  # indices into this rank's rows, and which ids are its
        local = ids.to(self.embed.device) - self.start
        return local.clamp(0, self.rows - 1), (local >= 0) & (local < self.rows)

    @torch.no_grad()
    @torch.profiler.record_function("vocab embed")
    def embed_all(self, chunks: list[Chunk]) -> list[Chunk]:
        """A step's microbatches (cut_sequences' chunks), their inputs embedded on the first stage (its inputs)."""
        self.ids = [c.inputs for c in chunks]  # for embed_backward
        self._gather()
        out = [torch.where(own[..., None], self.embed.to_local()[i], 0.0) for i, own in map(self._own, self.ids)]
        self.works = list(filter(None, [dist.reduce(flat := torch.cat([e.flatten() for e in out]), group_dst=0,
                                                    group=self.group, async_op=self.rank > 0)]))  # the other ranks
        return [c._replace(inputs=e.copy_(f.view_as(e))) for c, e, f in zip(chunks, out, flat.split(  # need none of
            [e.numel() for e in out]))] if self.rank == 0 else chunks  # it (output waits); not views (FSDP2)

    @torch.no_grad()
    @torch.profiler.record_function("vocab embed backward")
    def embed_backward(self, chunks: list[Chunk], last: bool = True) -> None:
        """embed_all's (chunks) gradients broadcast, each rank adds its rows'; last: averaged over the replicas."""
        h, ids = self.embed.shape[1], self.ids
        flat = torch.cat([c.inputs.grad.flatten() for c in chunks]) if self.rank == 0 else torch.empty(
            sum(x.numel() for x in ids) * h, device=self.embed.device)
        dist.broadcast(flat, group_src=0, group=self.group)
        total = torch.zeros_like(self.embed.to_local())
        for (i, own), g in zip(map(self._own, ids), flat.split([x.numel() * h for x in ids])):
            total.index_add_(0, i[own], g.view(*own.shape, h)[own])
        _add_grad(self.embed, total)
        for p, whole in self.whole.items() if last and self.dp > 1 else ():  # reduce-scattered over the replicas
            grad = DTensor.from_local(whole.grad.to_local(), self.slices, [Shard(0), Partial()], shape=p.shape,
                                      stride=p.stride()).redistribute(placements=p.placements)
            _add_grad(p, grad.to_local().div_(self.dp))  # their mean, as FSDP2's
            self.whole[p] = self.embed = self.head = None  # the copies freed until the next step's gather

    @torch.profiler.record_function("vocab output")
    def output(self, out: Tensor, chunk: Chunk, chunks: int = 1, divisor: int = 1) -> tuple[Tensor, Tensor]:
        """A microbatch's (chunk's) loss, chunked_loss's, on every rank, of the last stage's out (sent in autocast's
        dtype); with grad the head's of loss / divisor added, the last stage's out a scalar to backward from."""
        device, y, last = self.head.device, chunk.targets.to(self.head.device), self.rank == self.last
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32
        h = out.detach().to(dtype) if last else torch.empty((*y.shape, self.head.shape[1]), dtype=dtype, device=device)
        self.works.append(dist.broadcast(h, group_src=self.last, group=self.group, async_op=True))  # the last stage
        while len(self.works) > last:  # computes its slice while it sends h; before it, the reduces this rank needs
            self.works.pop(0).wait()  # nothing of (embed_all's, the last pass's), complete by now
        weight, train, counted = self.head.to_local(), torch.is_grad_enabled(), y != -100
        tokens = counted.sum().clamp(min=1) if chunk.tokens is None else chunk.tokens
        total, grads, head, weights = torch.zeros((), device=device), [], torch.zeros_like(weight), counted / tokens
        with torch.no_grad():
            for hp, yp, w in zip(h.chunk(chunks, 1), y.chunk(chunks, 1), (weights / divisor).chunk(chunks, 1)):
                logits = F.linear(hp, weight).float()  # [batch, piece, rows]
                dist.all_reduce(top := logits.amax(-1), op=dist.ReduceOp.MAX, group=self.group)
                exps, (i, own) = (logits - top[..., None]).exp_(), self._own(yp)
                pair = torch.stack([exps.sum(-1), torch.where(own, logits.gather(-1, i[..., None])[..., 0], 0.0)])
                dist.all_reduce(pair, group=self.group)
                total += torch.where(yp != -100, pair[0].log() + top - pair[1], 0.0).sum()
                if train:  # d loss / d logits: (softmax - one-hot) x the token's weight
                    g = exps.div_(pair[0][..., None]).scatter_add_(-1, i[..., None], -own[..., None].float())
                    g = (g * w[..., None]).to(hp.dtype)
                    grads.append((g @ weight.to(g.dtype)).float())
                    head += (g.flatten(0, 1).T @ hp.flatten(0, 1)).float()
        if not train:
            return total / tokens, out
        _add_grad(self.head, head)  # the hidden states' gradient summed onto the last stage; the others go on
        self.works += filter(None, [dist.reduce(grad := torch.cat(grads, 1), group_dst=self.last, group=self.group,
                                                async_op=not last)])  # waited at the next pass, or Step.finish
        return total / tokens, (out * grad).sum() if last else out


def _add_grad(param: nn.Parameter, grad: Tensor) -> None:  # into a DTensor parameter's .grad, as autograd adds
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad.to_local().add_(grad)


def groups_of(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's: matrices decayed, gains not; no group empty (torch cannot load one's state on resume); one kind of
    tensor a group for fused AdamW (plain, or DTensors of one mesh: --vocab-parallel's slices apart)."""
    kind = lambda p: (p.ndim >= 2, getattr(p, "device_mesh", None))  # noqa: E731
    return [{"params": [p for p in model.parameters() if kind(p) == k], "weight_decay": weight_decay * k[0]}
            for k in dict.fromkeys(map(kind, model.parameters()))]


# ==========================================================================================================
# Extending torch's schedules: file orders, backwards merged where no gradient waits, accumulation, forward-only eval

# ----------------------------------------------------------------------------------------------------------
# A pipeline order from a file (--schedule FILE.csv), in torch's compute-only CSV form, run by torch's runtime

_ACTION = re.compile(r"(\d+)([FIWB])(\d+)")  # stage, F(orward) / I(nput gradient) / W(eight gradient) / B(oth), mb
MAX_ORDER_MICROBATCHES = 1000  # torch 2.13 lowers an order in time that grows with the square of its length


def _action(cell: str):
    """A cell's _Action: 0F1, or torch's (0F3;3B1)OVERLAP_F_B (DualPipeV's: a forward, another's backward); or None."""
    if cell.startswith("(") and cell.endswith(")OVERLAP_F_B"):
        parts = [_action(part) for part in cell[1:-len(")OVERLAP_F_B")].split(";")]
        return None if None in parts else _Action(-1, _ComputationType.OVERLAP_F_B, None, tuple(parts))
    match = _ACTION.fullmatch(cell)
    return match and _Action(int(match[1]), _ComputationType(match[2]), int(match[3]))


def _clipped(text: str, limit: int = 40) -> str:  # what an error line says of a file: its start
    return text[:limit] + ("..." if len(text) > limit else "")


@dataclasses.dataclass(eq=False)
class PipelineOrder:
    """Each pipeline rank's compute actions, in the order it runs them (torch's pipeline_order), as read_order
    read and checked them: the stage -> rank map, the stages per rank and the microbatches follow from it."""
    path: str
    actions: dict[int, list]  # pipeline rank -> an _Action, or None (idle), per step
    stage_ranks: dict[int, int]  # stage -> the pipeline rank that holds it (torch's _validate_schedule infers it)
    microbatches: int
    per_rank: int  # stages per pipeline rank
    seq_chunks: list | None = None  # chunk_order's: the lengths of a sequence's chunks (step_chunks cuts by them)

    def stages(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_ranks.items() if r == rank)

    def schedule(self, pipeline_stages: list, loss_fn) -> _PipelineScheduleRuntime:
        """torch's runtime over this rank's PipelineStages, running the order: lowered as its _load_csv lowers a
        file (sends and receives where a neighbour is on another rank, FSDP unshard/reshard, gradient reduction)."""
        if pipeline_stages[0].group_size != len(self.actions):  # torchrun restarted the job on other processes
            raise ValueError(f"it is an order for {len(self.actions)} pipeline ranks, the job now has "
                             f"{pipeline_stages[0].group_size}; start as many processes as before")
        schedule = _PipelineScheduleRuntime(pipeline_stages, n_microbatches=self.microbatches, loss_fn=loss_fn)
        schedule.seq_chunks = self.seq_chunks
        return merge_backwards(schedule, self.actions, self.stage_ranks)


def merge_backwards(schedule, order: dict | None = None, stage_ranks: dict | None = None):
    """Run an input gradient (I) and its own weight gradient (W: same stage, microbatch) next on the rank as one
    backward (B) where the gradient goes to no other rank: one autograd call, not I's and W's one per weight group,
    which walks the graph again from what I kept (small, one stage: I + W 1.07-1.16 x a B, checkpointed or not;
    docs/faster-and-smaller.md). Where it goes to another rank, a B would send it after the weights' part, that rank
    waiting W's time longer: there they stay apart (torch's unused _merge_bw merges every pair). Stage 0 sends no
    gradient; where the next stage down is the rank's own (the V's turn) its backward comes after W anyway. The rest as
    the order says (W's put off, DualPipeV's overlapped cells). order: a file's order, stage_ranks its stage -> rank
    map; None: the schedule's own (torch's classes), lowered again only if merged. No order (GPipe, 1F1B): as is."""
    own, order = order is None, order or getattr(schedule, "pipeline_order", None)
    if order is None or not isinstance(schedule, _PipelineScheduleRuntime):
        return schedule
    merged, changed = _merged(order, stage_ranks or schedule.stage_index_to_group_rank)
    if own and not changed:  # (interleaved 1F1B, LoopedBFS: as torch lowered them)
        return schedule
    schedule.pipeline_order = merged
    schedule._prepare_schedule_with_comms(merged)
    return schedule


def _merged(order: dict, rank_of: dict) -> tuple[dict, bool]:
    """merge_backwards' order (idle steps dropped: a rank waits for inputs without them), and whether it merged."""
    merged, changed = {}, False
    for rank, acts in order.items():
        merged[rank] = []
        for action in filter(None, acts):
            last = merged[rank][-1] if merged[rank] else None
            if last and (last.computation_type, action.computation_type) == ("I", "W") and (
                    last.stage_index, last.microbatch_index) == (action.stage_index, action.microbatch_index) and (
                    action.stage_index == 0 or rank_of[action.stage_index - 1] == rank):
                merged[rank][-1], changed = last._replace(computation_type=_ComputationType("B")), True
            else:
                merged[rank].append(action)
    return merged, changed


def read_order(path: str, world_size: int, dp: int, tp: int, microbatches: int, stages_per_rank: int | None,
               compile: bool) -> PipelineOrder | None:
    """--schedule FILE.csv: torch's compute-only CSV form, a row per pipeline rank, a cell per step (0F1: stage 0's
    forward of microbatch 1; I, W: a backward's input and weight halves; B: both; empty: idle), checked before anything
    runs (as given and as merged): torch's checks, then the scripts' stage placements, the flags and the processes.
    Mistakes: one-line ValueErrors naming --schedule and the flag; None for a schedule's name."""
    if not path.lower().endswith(".csv"):
        return None
    try:
        with open(path, newline="") as file:
            rows = list(csv.reader(file))
        while rows and not "".join(rows[-1]).strip():  # blank lines at the end: no rank of their own
            rows.pop()
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"--schedule {path}: cannot read it ({_clipped(getattr(e, 'strerror', None) or str(e), 100)});"
                         " give a CSV file of an order, a row per pipeline rank (plan.py --write-schedule writes one)"
                         ) from None
    actions, seen = {}, {}  # seen: (stage, F / I / W, microbatch) -> the row and cell that ran it (a B: I and W)
    for rank, row in enumerate(rows):
        actions[rank] = []
        for step, cell in enumerate(row):
            if (action := _action(cell.strip())) is None and cell.strip():
                raise ValueError(f"--schedule {path}: row {rank + 1}, cell {step + 1} is {_clipped(cell.strip())!r}, "
                                 "not an action: give stage, F, I, W or B, microbatch (such as 0F1), or nothing (idle)")
            actions[rank].append(action)
            for sub in action and (action.sub_actions or [action]) or ():  # torch's check counts sets: repeats pass
                for kind in ("I", "W") if sub.computation_type == "B" else (sub.computation_type.value,):
                    if (key := (sub.stage_index, kind, sub.microbatch_index)) in seen:
                        raise ValueError(f"--schedule {path}: row {rank + 1}, cell {step + 1} ({sub}) runs stage "
                                         f"{key[0]}'s {kind} of microbatch {key[2]} again (row {seen[key][0] + 1}, "
                                         f"cell {seen[key][1] + 1}); each stage runs each microbatch's F, and I "
                                         "and W or B, once")
                    seen[key] = rank, step
    if not seen:
        raise ValueError(f"--schedule {path}: no action in it; give a row of actions per pipeline rank")
    pp, num_stages = len(actions), 1 + max(key[0] for key in seen)
    held = sorted({key[0] for key in seen})  # (a cell 999999999F0 must not make torch's table of as many stages)
    if (missing := next((s for s, t in enumerate(held) if s != t), None)) is not None:
        raise ValueError(f"--schedule {path}: stage {missing} has no action, but stage {num_stages - 1} has; give "
                         "each stage from 0 up its actions")
    file_microbatches = 1 + max(key[2] for key in seen)
    if file_microbatches > MAX_ORDER_MICROBATCHES:  # measured, ZB-V on 2 ranks: 1,000 about 2 s, 20,000 10 minutes
        raise ValueError(f"--schedule {path}: {file_microbatches} microbatches; torch 2.13 lowers an order in time "
                         f"that grows with the square of its length: give at most {MAX_ORDER_MICROBATCHES} (a larger "
                         "batch as --accumulate steps)")
    try:  # torch's own checks, of the order as given and as merged: each stage on one rank, complete, can progress
        stage_ranks = _validate_schedule(actions, pp, num_stages, file_microbatches)
        merged = _merged(actions, stage_ranks)[0]
        _validate_schedule(merged, pp, num_stages, file_microbatches)
        for order in (actions, merged):  # (torch's FSDP unshard/reshard and gradient reduction, which it lowers too,
            # are local: they change no rank's progress; its _add_unshard_reshard is quadratic in the order's length)
            _add_send_recv({rank: list(acts) for rank, acts in order.items()}, stage_ranks.__getitem__, num_stages)
    except AssertionError as e:  # its first line (the rest: the whole order), of ordinary length
        first = " ".join(str(e).split("\n\n")[0].split())
        raise ValueError(f"--schedule {path}: torch refuses this order: {_clipped(first, 200)}") from None
    per_rank = num_stages // pp
    looped = {s: s % pp for s in range(num_stages)}  # rank r: r, r + p, ...; V: r and 2p - 1 - r
    v_shaped = {s: min(s, 2 * pp - 1 - s) for s in range(num_stages)} if num_stages == 2 * pp else looped
    if stage_ranks not in (looped, v_shaped):
        where = "; ".join(f"rank {r}: {[s for s in range(num_stages) if stage_ranks[s] == r]}" for r in range(pp))
        raise ValueError(f"--schedule {path}: stages {_clipped(where, 200)}; the scripts place stages looped (rank r "
                         f"holds r, r + {pp}, ...) or V-shaped (r and {2 * pp - 1} - r)")
    group = dp * tp
    if world_size % group == 0 and world_size // group != pp:  # (not divisible: the scripts' check says so)
        raise ValueError(f"--schedule {path} is an order for {pp} pipeline rank(s), but {world_size} process(es) "
                         f"/ (--dp {dp} x --tp {tp}) are {world_size // group}; start {pp * group} processes, or "
                         "give an order for as many pipeline ranks as there are")
    if file_microbatches != microbatches:
        raise ValueError(f"--microbatches {microbatches}: --schedule {path} runs {file_microbatches} microbatches; "
                         f"give --microbatches {file_microbatches}")
    if stages_per_rank not in (None, per_rank):
        raise ValueError(f"--stages-per-rank {stages_per_rank}: --schedule {path} holds {per_rank} stage(s) per "
                         "rank; leave the flag out")
    if compile and any(sub.computation_type in ("I", "W") for acts in actions.values() for a in filter(None, acts)
                       for sub in a.sub_actions or [a]):
        # torch 2.13 refuses torch.compile(module)'d stages for its zero-bubble schedules (weight halves failed: pytorch
        # #161904, open), but not an order for its runtime, nor in-place layer.compile() (untested).
        raise ValueError(f"--compile: --schedule {path} splits backwards into I and W, which torch 2.13 does not "
                         "support on compiled stages (pytorch #161904); leave --compile out, or give an order of B "
                         "actions")
    return PipelineOrder(path, actions, stage_ranks, file_microbatches, per_rank)


def chunk_order(name: str, pp: int, microbatches: int, lengths: list[int]) -> PipelineOrder | None:
    """--seq-chunks: each rank's compute-only order of `microbatches` sequences in len(lengths) chunks (microbatch
    s S + j: sequence s's chunk j), forwards in order, each sequence's backwards last chunk first: gpipe's forwards
    all first, 1f1b's Seq1F1B's ((p - 1 - r) + (S - 1) forwards on rank r, then one forward, one backward)."""
    S, n = len(lengths), microbatches * len(lengths)
    if S > 1 and name not in ("gpipe", "1f1b"):  # (the others loop stages or split backwards: no order made for them)
        raise ValueError(f"--seq-chunks {S}: --schedule {name} cannot order sequence chunks (a sequence's backwards "
                         "last chunk first); give --schedule gpipe or 1f1b, or --seq-chunks 1")
    backwards = [s * S + S - 1 - j for s in range(microbatches) for j in range(S)]
    warm = [n if name == "gpipe" else min(n, pp - 1 - r + S - 1) for r in range(pp)]
    actions = {r: [_Action(r, _ComputationType(kind), i) for kind, i in [("F", i) for i in range(w)] + [a for i, b in
               enumerate(backwards) for a in [("F", w + i)] * (w + i < n) + [("B", b)]]] for r, w in enumerate(warm)}
    return PipelineOrder(f"{name}, {S} chunks", actions, {r: r for r in range(pp)}, n, 1, lengths) if S > 1 else None


def step_chunks(schedule, inputs, targets, positions, losses: list, train: bool = True, traced: bool = False) -> None:
    """A schedule step (train) or evaluation of chunk_order's order: the microbatches' sequences (None where this rank
    takes none) cut into chunks (cut_sequences, slot s for microbatch s), pre-cut as the chunk comment above says."""
    m, schedule._has_backward = schedule._n_microbatches // len(schedule.seq_chunks), train  # (step()'s, eval()'s)
    chunks = [c for s, mb in enumerate(zip(*(t.chunk(m) if t is not None else [None] * m for t in (inputs, targets,
              positions)))) for c in cut_sequences(*mb, schedule.seq_chunks, s)]
    for stage in schedule._stages:  # (what step() and eval() set first)
        stage.has_backward, _ = train, stage.clear_runtime_states()
    schedule._step_microbatches([(c.inputs,) if c.inputs is not None else () for c in chunks], [  # traced: as a
        {"chunk": torch.tensor(dataclasses.astuple(c.chunk)), "positions": positions.chunk(m)[c.chunk.sequence]}
        if traced else {"chunk": c.chunk} | ({"positions": c.positions} if c.positions is not None else {})
        for c in chunks], [(c.targets, c.tokens) for c in chunks] if targets is not None else None, losses,
        return_outputs=False)  # traced graph takes them: the chunk a tensor, positions its sequence's (traced_chunk_kv)


# ----------------------------------------------------------------------------------------------------------
# Gradient accumulation (--accumulate K) under torch's schedules

def accumulate_into(schedule, step: int, steps: int) -> None:
    """Before schedule step `step` (from 0) of an optimizer step's `steps`. torch ends each in every stage's
    perform_reduce_grad: FSDP2's reduce-scatter, then division by the microbatches (scale_grads); K times, that would
    reduce-scatter K times and divide the first steps' sums again at each later step (torchtitan #1733's moving
    average). So the first K - 1 skip it: their backwards already run with FSDP's gradient sync off, parameters
    unsharded (torch's stage sets both for all but a step's last backward), so gradients add up; the last
    reduce-scatters the sum once, divided by all K x m microbatches. K = 1: torch's own path."""
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:  # a multi-stage schedule's, or the one
        vars(stage).pop("perform_reduce_grad", None)  # the previous step's choice undone: torch's method again
        if step < steps - 1:
            stage.perform_reduce_grad = lambda scale: None
        elif steps > 1:  # scale: torch's microbatch count (scale_grads)
            stage.perform_reduce_grad = lambda scale, stage=stage: type(stage).perform_reduce_grad(stage, scale * steps)


# ----------------------------------------------------------------------------------------------------------
# Evaluation where torch's eval() cannot run: a forward-only pass through this rank's stages

def forward_only(pipeline_stages, inputs, targets, microbatches, hidden_shape, dtype, loss_fn, losses, documents):
    """Each microbatch forward through this rank's stages by index: stage s waits only for s - 1, run earlier on every
    rank; sends do not wait (no rank waits on itself). Messages: one-op batches in the pipeline's group, both sides."""
    first, held, sends = pipeline_stages[0], {}, []  # held: (stage, microbatch) -> an output for a stage here
    peer = first.stage_index_to_group_rank  # group ranks; a lone send or receive would make a pair's communicator
    message = lambda op, t, s: dist.batch_isend_irecv([dist.P2POp(op, t, group=first.group, group_peer=peer[s])])
    for stage in sorted(pipeline_stages, key=lambda st: st.stage_index):
        s = stage.stage_index
        for i in range(microbatches):
            x = inputs.chunk(microbatches)[i] if s == 0 else held.pop((s - 1, i), None)
            if x is None:  # from another rank: one microbatch's hidden states, in the computation's dtype
                message(dist.irecv, x := torch.empty(hidden_shape, dtype=dtype, device=stage.device), s - 1)[0].wait()
            out = stage.submod(x, **{name: t.chunk(microbatches)[i] for name, t in documents.items()})
            if s == stage.num_stages - 1:
                losses.append(loss_fn(out, targets.chunk(microbatches)[i]))
            elif peer[s + 1] == first.group_rank:
                held[s, i] = out
            else:
                sends += message(dist.isend, out.contiguous(), s + 1)  # waited for at the end
    for work in sends:
        work.wait()
