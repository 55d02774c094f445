"""Tests for the collection, on CPU with gloo and real processes.

The central claim: a pipeline is the same model. Gradients and loss trajectories of the pipelined scripts are
compared with the unsplit model on one process. Run with:  pytest -q -n 2 --dist loadgroup test_small.py
(two workers, pytest-xdist; `pytest -q test_small.py` runs the same tests one at a time).

Eight sections, each under a "# ---" line: 1 model.py, 2 data, 3 parity (a pipeline is the same model), 4 checkpoints
and runs, 5 Hugging Face, 6 planning, 7 tools (benchmark.py, run.sh), 8 bad input and templates. What they run on
is in conftest.py beside this file: running things (processes, forked ranks), comparing numbers and files, small
configs, the fixtures (the data prepared once, the runs that several tests share) and the tests' xdist groups.
"""

import argparse
import ast
import collections
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import io
import itertools
import json
import math
import os
import pathlib
import pickle
import platform
import random
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
import types
import unittest.mock
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, SplitPoint
from torch.distributed.pipelining.schedules import _Action

import benchmark
import checkpoint
import export
import model as model_module
import nccl_rules
import plan
import plot
import prepare_data as prep
import train_pipeline_afab_manual as manual
import train_pipeline_gpipe as gpipe
import train_pipeline_tracer as tracer
from conftest import (  # the helpers; the fixtures pytest finds there itself
    ACCUMULATED_MICROBATCHES, BOS, DOCUMENT_RUNS, LAYOUT_RUNS, LLAMA3_ROPE, MAIN_STARTUPS, RESUME_ARGS, ROOT, RTOL,
    RUN_SH, SCRIPTS, SCRIPT_MODULES, STARTUP_CONFIG, TRAIN_ARGS, WORDS, assert_close_rel, assert_same_trajectory,
    checked_args, corpus, cpu_env, cpu_stage, cpu_traced, descendants, documents_batch, error_lines, errors, finish,
    free_port, kill_job, launch, launch_ranks, launcher_env, layer_count, library_pipeline, mount_tmpfs,
    one_line_error, parity_config, parity_step, plain_loss, prepare_small, random_batch, read_metrics, recorded,
    recorder, refused, replayed, run_main, run_script, run_sh, run_workers, schedule_file, script_env, seq_chunks,
    small_config, snapshot, split_layers, start, start_group, traced_pipeline, worker_pids, _chunks_tp_worker,
    _main_startup_worker, _recompute_worker)
from export import hf_config
from model import MAX_LAYERS, LlamaConfig, LlamaForPretraining, config_from_hf, config_from_preset, even


# ----------------------------------------------------------------------------------------------------------
# 1. model.py: meta init, stage weights, the same math as Hugging Face, the loss in pieces, flops, the split

def test_meta_init_equals_direct_build():
    config = small_config()
    direct = LlamaForPretraining(config)
    direct.init_weights(seed=7)
    via_meta = cpu_stage(config, 0, even(4, 1), seed=7)
    a = dict(direct.named_parameters()) | dict(direct.named_buffers())
    b = dict(via_meta.named_parameters()) | dict(via_meta.named_buffers())
    assert sorted(a) == sorted(b) and any(k.endswith("inv_freq") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Different seeds give different weights: the comparison above is not trivially true.
    other = LlamaForPretraining(config)
    other.init_weights(seed=8)
    assert not torch.equal(other.lm_head.weight, direct.lm_head.weight)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_each_stage_gets_the_full_models_weights(num_stages):
    config = small_config(layers=4)
    full = LlamaForPretraining(config)
    full.init_weights(seed=3)
    full_state = full.state_dict()
    seen = set()
    for stage in range(num_stages):
        part = cpu_stage(config, stage, even(4, num_stages), seed=3).state_dict()
        assert set(part) <= set(full_state)
        for name, tensor in part.items():
            assert torch.equal(tensor, full_state[name]), name
        seen |= set(part)
    assert seen == set(full_state)  # the stages together hold every parameter exactly once


# startup_runs (conftest.py): each script's start-up of a tied stage at each (dp, tp) of STARTUP_LAYOUTS,
# under the allocator's count.


def test_every_scripts_start_up_gives_the_full_models_weights_on_sharded_layouts(startup_runs):
    # Built on meta, sharded there, then each shard filled from its tensor drawn whole: the unsplit model's
    # init_weights on one process, bit for bit, at tp 2, dp 2 and dp 2 x tp 2 (pp 2 with them: the parity tests),
    # and the tied head still the embedding's one tensor.
    reference = LlamaForPretraining(STARTUP_CONFIG)
    reference.init_weights(seed=5)
    expected = dict(reference.named_parameters()) | dict(reference.named_buffers())
    assert any(name.endswith("inv_freq") for name in expected) and "lm_head.weight" not in expected  # tied
    for layout, ranks in startup_runs.items():
        assert sorted(ranks[0]) == (["library", "manual", "tracer"] if layout[1] == 1 else ["library", "manual"])
        for rank, results in enumerate(ranks):
            for kind, result in results.items():
                assert result["tied"], (layout, rank, kind)
                assert sorted(result["initial"]) == sorted(expected), (layout, kind)
                for name, tensor in result["initial"].items():
                    assert torch.equal(tensor, expected[name]), (layout, rank, kind, name)


def test_start_up_holds_at_most_the_shards_and_one_whole_tensor(startup_runs):
    # The allocator's own count (the profiler's memory events): start-up leaves exactly the rank's shards
    # allocated, and at its peak held them and one whole tensor, plus the int64 indices DTensor builds to find a
    # shard's offsets (compute_local_shape_and_global_offset; a _StridedShard's: an arange of the whole dimension
    # and its split). Measured: 4 bytes a row of the longest side of a tensor at tp 2 or dp 2, 16 at dp 2 x tp 2;
    # allowed 32 (4 KiB here). Allocating the stage whole and splitting it after (the scripts before materialize)
    # peaks at the whole stage, 1.8 to 3.2 x this bound here: that fails.
    for layout, ranks in startup_runs.items():
        for rank, results in enumerate(ranks):
            for kind, r in results.items():
                bound = r["shards"] + r["largest"] + 32 * r["rows"]
                assert r["left"] == r["shards"], (layout, rank, kind, r["left"], r["shards"])
                assert r["shards"] <= r["peak"] <= bound, (layout, rank, kind, r["peak"], bound)
                assert r["stage"] > 1.5 * bound, (layout, kind)  # the whole stage: the bound is not loose


def test_each_scripts_main_starts_up_holding_at_most_its_shards_and_one_whole_tensor(tmp_path, data_dir):
    # The same bound on each script's own main, from its start to its optimizer's creation (everything it builds
    # before the first step: the mesh, the data, the stage on meta, sharded, its shards allocated, the schedule), at
    # dp 2 and at tp 2, one stage on 2 processes of the tiny model (8 layers; the head untied), plus what the data
    # holds (the windows' orders, 8 bytes a window: 1.5 MB of the builtin corpus at --seq-len 16). A main that
    # allocated its stage whole at any point before sharding it would peak at the whole stage and those orders,
    # above the bound (measured at dp 2: a peak of 13.07 MB, the bound 13.29, a whole stage and the orders 16.18).
    run_workers(_main_startup_worker, 2, args=(2, str(tmp_path / "store"), str(tmp_path), data_dir))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert sorted(ranks[0]) == sorted((script, tuple(flags)) for script, flags in MAIN_STARTUPS)
    for rank, results in enumerate(ranks):
        for run, r in results.items():
            bound = r["shards"] + r["largest"] + 32 * r["rows"] + r["data"]  # (32: DTensor's indices, as above)
            assert r["shards"] + r["data"] <= r["peak"] <= bound < r["stage"] + r["data"], (run, rank, r)


def test_the_even_split_differs_by_at_most_one_layer():
    assert even(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            sizes = [len(r) for r in even(layers, stages)]
            assert sum(sizes) == layers and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("variant", ["plain", "tied_llama3_head_dim"])
def test_same_math_as_hugging_face_llama(variant):
    transformers = pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    extra = {} if variant == "plain" else {"tie_word_embeddings": True, "rope_scaling": dict(LLAMA3_ROPE),
                                           "head_dim": 8}
    hf_config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        attention_bias=False, mlp_bias=False, **{"tie_word_embeddings": False, **extra})
    config = model_module.config_from_hf(hf_config.to_dict())  # also reads transformers 5's rope_parameters
    assert (config.tie_word_embeddings, config.rope_scaling, config.head_dim) == (
        extra.get("tie_word_embeddings", False), LLAMA3_ROPE if extra else None, extra.get("head_dim", 16))
    ours = LlamaForPretraining(config)
    ours.init_weights(seed=0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    # Same names but for the prefix: a strict load proves it.
    hf_model.load_state_dict({k.replace("base_model.", "model.", 1): v for k, v in ours.state_dict().items()},
                             strict=True)
    tokens = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_model(tokens).logits, rtol=1e-5, atol=1e-6)


def test_documents_kept_apart_compute_as_each_does_alone(monkeypatch):
    # --document-masking: a window packs documents (each from its bos); each token attends within its own
    # document, and its rotary position counts from the document's start.
    model = LlamaForPretraining(small_config(layers=2))
    model.init_weights(seed=4)
    gen = torch.Generator().manual_seed(3)
    # Row 0: the tail of a document (0-5), then documents at 6, 19 and 30; row 1: documents at 0 and 25.
    tokens = documents_batch(torch.randint(0, 97, (2, 40), generator=gen), {0: [6, 19, 30], 1: [0, 25]})
    targets = torch.randint(0, 97, (2, 40), generator=gen)
    positions = model_module.document_positions(tokens, BOS)
    assert positions.tolist() == [[*range(6), *range(13), *range(11), *range(10)], [*range(25), *range(15)]]

    def outputs(x, positions):  # the logits and each token's term of the loss
        with torch.no_grad():
            logits = model(x, positions)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, 40)

    # Every token of row 0's document at 19 changed (its bos kept): no other token's logits or loss term moves,
    # bit for bit. Without the flag the tokens after it see the change.
    changed = tokens.clone()
    changed[0, 20:30] = 2 + (changed[0, 20:30] - 2 + 7) % 95  # other tokens, none of them the bos
    others = torch.ones(2, 40, dtype=torch.bool)
    others[0, 20:30] = False
    for got, want in zip(outputs(changed, positions), outputs(tokens, positions)):
        assert torch.equal(got[others], want[others])
        assert not torch.equal(got[0, 20:30], want[0, 20:30])
    leaked = outputs(changed, None)[0][0, 30:] - outputs(tokens, None)[0][0, 30:]
    assert leaked.abs().max() > 1e-3
    # A document computes at offset k what it computes at offset 0, alone, to rounding (the kernel sums a row's
    # scores, masked ones included, in another order); the tail before the first bos likewise.
    logits = outputs(tokens, positions)[0]
    for row, first, end in ((0, 30, 40), (0, 6, 19), (1, 25, 40), (0, 0, 6)):
        document = tokens[row:row + 1, first:end]
        alone = model(document, model_module.document_positions(document, BOS)).detach()
        torch.testing.assert_close(logits[row:row + 1, first:end], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(alone, model(document).detach(), rtol=1e-5, atol=1e-6)  # alone: plain causal
    # Rotary positions restart at each document: every layer rotates a document's tokens by the angles of positions
    # 0, 1, ..., bit for bit those of the document alone. (RoPE is relative, so within a document an offset
    # changes only the angles' rounding, which the comparisons above cannot tell from the kernels'.)
    original, tables = model_module.rope_tables, []
    monkeypatch.setattr(model_module, "rope_tables", lambda *args: tables.append(original(*args)) or tables[-1])
    model(tokens, positions)
    alone = original(model.base_model.layers["0"].self_attn.inv_freq, 10, torch.float32)
    assert len(tables) == 2 and all(torch.equal(got[0, 0, 30:40], want) for table in tables
                                    for got, want in zip(table, alone))

    # The GPU's kernel (FlexAttention's block mask from the same mask_mod) on this CPU, forward only (torch 2.13's
    # FlexAttention has no CPU backward): the dense mask the CPU path uses is the block mask's, and so are the
    # outputs, to rounding.
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
    q, k, v = (torch.randn(2, heads, 40, 8, generator=gen) for heads in (4, 2, 2))
    mask_mod = model_module.document_mask_mod(positions)
    assert torch.equal(model_module.document_mask(positions), create_mask(mask_mod, 2, 1, 40, 40, device="cpu"))
    with warnings.catch_warnings():  # eager FlexAttention warns that it is the unfused reference
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, 2, None, 40, 40, device="cpu"),
                              enable_gqa=True)
    torch.testing.assert_close(flex, model_module.document_attention(q, k, v, model_module.attention_mask(positions)),
                               rtol=1e-5, atol=1e-6)


def test_a_stage_builds_its_document_mask_once_a_microbatch_for_all_its_layers(monkeypatch):
    # --document-masking: a stage builds the mask of a microbatch's positions once and hands it to each of its
    # layers (LlamaModel.forward; the hand-written forward_stage): not once a layer, and not again in a checkpointed
    # layer's recompute. Counted on the CPU's dense mask; the pipelines' runs count theirs (the parity tests).
    built, dense = [], model_module.document_mask
    monkeypatch.setattr(model_module, "document_mask", lambda *args: built.append(1) or dense(*args))
    config, gen = small_config(layers=3), torch.Generator().manual_seed(0)
    tokens = documents_batch(torch.randint(0, 97, (2, 16), generator=gen), {0: [5], 1: [0, 9]})
    positions = model_module.document_positions(tokens, BOS)
    stage = gpipe.stage_module(config, 1, [range(0), range(3), range(3, 3)])  # 3 layers, on meta
    model_module.materialize([stage], config, torch.device("cpu"), 11)
    model_module.checkpoint_layers([stage])
    stage(torch.randn(2, 16, 32, generator=gen, requires_grad=True), positions).sum().backward()  # recomputed
    assert len(built) == 1
    model = LlamaForPretraining(config)  # whole: forward_stage runs rank 0's 2 layers itself
    model.init_weights(11)
    manual.forward_stage(manual.partition_model(model, 0, 2), tokens, positions)
    assert len(built) == 2
    # On a GPU the mask is FlexAttention's BlockMask, an input of each compiled layer (--compile): one graph takes
    # every microbatch's, whatever its documents (torch 2.13's guards match its mask_mod by code, not by object),
    # and computes the dense mask's attention. Here compiled without Inductor, forward only (no CPU backward).
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask
    layer, graphs = model.base_model.layers["0"], []
    layer.compile(backend="eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is the unfused reference
        for starts in ({0: [5], 1: [0, 9]}, {0: [1, 2, 3]}, {1: [15]}):
            positions = model_module.document_positions(documents_batch(tokens, starts), BOS)
            block_mask = create_block_mask(model_module.document_mask_mod(positions), 2, None, 16, 16, device="cpu")
            x = torch.randn(2, 16, 32, generator=gen)
            torch.testing.assert_close(layer(x, positions=positions, mask=block_mask), layer.forward(
                x, positions=positions, mask=dense(positions)), rtol=1e-5, atol=1e-6)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1] > 0, graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's path: FlexAttention, compiled")
def test_documents_on_a_gpu_take_compiled_flexattention_and_compute_the_dense_masks_attention(monkeypatch):
    # What the CPU cannot run (torch 2.13's FlexAttention has no CPU backward): document_attention on a GPU,
    # forward and backward, against SDPA with the dense mask. 5e-3: the compiled kernel may multiply fp32 in TF32
    # (10-bit mantissas); a wrong mask is off by the size of the outputs themselves.
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import BlockMask
    tokens = documents_batch(torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(0)),
                             {0: [0, 100, 130], 1: [50, 51, 200]})
    positions = model_module.document_positions(tokens, BOS).cuda()
    assert isinstance(model_module.attention_mask(positions), BlockMask)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(2, heads, 256, 64, device="cuda", generator=gen, requires_grad=True) for heads in (8, 2, 2)]
    results = []
    for attention in (lambda q, k, v, positions: model_module.document_attention(
            q, k, v, model_module.attention_mask(positions)), lambda q, k, v, positions: F.scaled_dot_product_attention(
            q, k, v, attn_mask=model_module.document_mask(positions), enable_gqa=True)):
        out = attention(*inputs, positions)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        results.append((out, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
    # A stage as the scripts run it with --activation-checkpointing --compile, 3 microbatches of other documents:
    # one block mask built a microbatch (not one a layer, none in the recomputes), the compiled layers taking each
    # microbatch's without compiling again, and the loss and gradients of the dense mask on the CPU (5e-3 as above).
    config = LlamaConfig(vocab_size=97, max_position_embeddings=256, hidden_size=128, intermediate_size=192,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32
    on_cpu = LlamaForPretraining(config)
    on_cpu.init_weights(seed=4)
    on_gpu = LlamaForPretraining(config).cuda()
    on_gpu.load_state_dict(on_cpu.state_dict())
    model_module.checkpoint_layers([on_gpu])
    model_module.compile_layers([on_gpu])
    built, original = [], model_module.attention_mask
    monkeypatch.setattr(model_module, "attention_mask", lambda p: built.append(p.device.type) or original(p))
    graphs, gen = [], torch.Generator().manual_seed(1)
    for starts in ({0: [0, 100, 130], 1: [50, 51, 200]}, {0: [7], 1: [0, 128]}, {0: [0, 1, 2, 3], 1: [255]}):
        tokens = documents_batch(torch.randint(0, 97, (2, 256), generator=gen), starts)
        targets, positions = torch.randint(0, 97, (2, 256), generator=gen), model_module.document_positions(tokens, BOS)
        results = []
        for model, device in ((on_gpu, "cuda"), (on_cpu, "cpu")):
            model.zero_grad()
            loss = plain_loss(model(tokens.to(device), positions.to(device)), targets.to(device))
            loss.backward()
            results.append((loss.detach().cpu(), *(p.grad.cpu() for p in model.parameters())))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
        graphs.append(counters["stats"]["unique_graphs"])
    assert built.count("cuda") == 3 and graphs[0] == graphs[-1] > 0, (built, graphs)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_the_chunked_loss_is_the_plain_loss_and_holds_a_piece_of_the_logits(chunks):
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(32, 1000, bias=False)
    hidden = torch.randn(3, 37, 32, generator=gen, requires_grad=True)  # 37 positions: uneven pieces
    targets = torch.randint(0, 1000, (3, 37), generator=gen)
    targets[0, :5] = -100
    results = []
    for loss_fn in (lambda: plain_loss(head(hidden), targets), lambda: model_module.chunked_loss(
            head, hidden, targets, chunks)):
        hidden.grad = head.weight.grad = None
        loss = loss_fn()
        loss.backward()
        results.append((loss.detach(), hidden.grad, head.weight.grad))
    for plain, chunked in zip(*results):  # the loss, the hidden states' gradient, the head's gradient
        assert ((chunked - plain).norm() / plain.norm()).item() <= 1e-6
    with torch.no_grad():  # evaluation: no pieces kept for a backward
        torch.testing.assert_close(model_module.chunked_loss(head, hidden, targets, chunks), results[0][0],
                                   rtol=1e-6, atol=0)
    if chunks == 8:
        # Measured (torch.profiler's allocator events) on the last stage of a model with a 32k vocabulary: the
        # loss's peak extra memory, and plan.py's figure for it within 10 %.
        config = LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=4)
        peaks = {n: benchmark.loss_peak_bytes(32768, 64, 2048, n) for n in (1, 8)}
        assert peaks[1] >= 4 * peaks[8], peaks
        for n, peak in peaks.items():
            assert plan.activation_bytes(config, 2048, 2048, False, 1, n)["loss"] == pytest.approx(peak, rel=0.1)


def test_the_loss_is_cut_into_pieces_only_when_its_logits_are_big():
    # --loss-chunks 0, the scripts' default: pieces of at most 256 MiB of fp32 logits on a tensor-parallel rank.
    tiny, llama = config_from_preset("tiny", 8192, None), config_from_preset("llama-8b", 128256, None)
    assert model_module.loss_chunks(0, tiny, (4, 128)) == 1  # the default job's 16 MiB: the plain loss
    assert [model_module.loss_chunks(0, llama, (1, 8192), tp) for tp in (1, 2, 8)] == [16, 8, 2]  # 4, 2, 0.5 GiB
    assert model_module.loss_chunks(0, llama, (4096, 4), 1) == 4  # 8 GiB, but at most a position a piece
    assert model_module.loss_chunks(3, llama, (1, 8192), 2) == 3  # as given


def test_model_flops_per_token_counts_every_matmul_once():
    config = small_config(vocab=97, layers=2)  # hidden 32, 4 heads of 8, 2 KV heads, MLP 48
    model = LlamaForPretraining(config)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert model_module.flops_per_token(config, seq_len=16) == 6 * n + 12 * 2 * 4 * 8 * 16


def test_the_mfu_peak_is_the_exact_gpus_for_the_runs_dtype():
    # Names as torch.cuda.get_device_name gives them; NVIDIA's dense peaks, (bf16, fp32 without TF32), TFLOP/s.
    expected = {"NVIDIA H100 80GB HBM3": (989.5, 67), "NVIDIA H100 PCIe": (756.5, 51), "NVIDIA H100 NVL": (835.5, 60),
                "NVIDIA H200": (989.5, 67), "NVIDIA H200 NVL": (835.5, 60), "NVIDIA GH200 480GB": (989.5, 67),
                "NVIDIA A100-SXM4-40GB": (312, 19.5), "NVIDIA A100 80GB PCIe": (312, 19.5),
                "NVIDIA L40S": (362, 91.6), "NVIDIA L4": (121, 30.3)}
    for name, peaks in expected.items():
        found = tuple(model_module.peak_flops(name, dtype) for dtype in (torch.bfloat16, torch.float32))
        assert found == tuple(p * 1e12 for p in peaks), name
    for name in ("NVIDIA L40", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090", ""):  # not in the table: no MFU
        assert model_module.peak_flops(name, torch.bfloat16) is None, name
    assert model_module.mfu(1000.0, small_config(), 16, torch.device("cpu"), torch.float32, 1) is None


def test_the_balanced_split_is_the_optimum_of_every_contiguous_split():
    # Against every contiguous split, the first and the last stage allowed no layer (the embedding alone, the norm
    # and the head alone): the balanced split's slowest stage is the least; it leaves an end stage without layers
    # only where every split with layers on each stage is slower; and of the splits as fast (and as many layerless
    # stages), its stage costs, from the slowest down, are the least (the most even).
    gen = torch.Generator().manual_seed(0)
    for layers, stages in [(1, 2), (1, 3), (4, 2), (5, 3), (6, 2), (7, 4), (8, 3), (3, 5), (4, 6)]:
        for _ in range(20):
            layer, head, embed = (torch.rand(3, generator=gen) * torch.tensor([1.0, 6.0, 1.5])).tolist()
            costs = {"layer": layer, "head": head, "embed": embed}
            ranked = lambda sizes: sorted(model_module.stage_costs(model_module.from_sizes(sizes), costs),  # noqa
                                          reverse=True)
            empty = lambda sizes: (sizes[0] == 0) + (sizes[-1] == 0)  # noqa: E731
            splits = [list(sizes) for sizes in itertools.product(range(layers + 1), repeat=stages)
                      if sum(sizes) == layers and min(sizes[1:-1], default=1) >= 1]
            sizes = [len(r) for r in model_module.balanced(layers, stages, costs)]
            assert sizes in splits, (layers, stages, sizes)
            # Exact comparisons: both sides add the same floats in the same order (n x layer + embed or head).
            best = min(ranked(s)[0] for s in splits)
            assert ranked(sizes)[0] == best, (layers, stages, costs, sizes)
            with_layers = [s for s in splits if not empty(s)]
            assert empty(sizes) == (0 if with_layers and min(ranked(s)[0] for s in with_layers) == best else
                                    min(empty(s) for s in splits if ranked(s)[0] == best)), (costs, sizes)
            assert ranked(sizes) == min(ranked(s) for s in splits if ranked(s)[0] == best and empty(s) == empty(sizes))
    # The tiny model at --seq-len 128: the head and the loss are worth about 4.6 layers. On 2 stages the last keeps
    # one layer; on 3 (the default job) it holds the head alone, 43 % of the work instead of 53 % with a layer;
    # 8 stages of its 6 layers: the embedding alone, a layer each, the head alone.
    tiny = config_from_preset("tiny", 8192, 6)
    costs = model_module.estimated_costs(tiny, 128)
    assert [[len(r) for r in model_module.balanced(6, n, costs)] for n in (2, 3, 8)] == [
        [5, 1], [3, 3, 0], [0, 1, 1, 1, 1, 1, 1, 0]]
    assert model_module.describe_layout(model_module.balanced(6, 3, costs), costs) == \
        "[embed + layers 0-2 (28%)] [layers 3-5 (28%)] [norm + head (43%)]"
    # Activation checkpointing runs each layer's forward (a third of its cost) again; the head is not recomputed.
    plain, again = model_module.estimated_costs(tiny, 128), model_module.estimated_costs(tiny, 128, recompute=True)
    assert again["layer"] == pytest.approx(plain["layer"] * 4 / 3) and again["head"] == plain["head"]


def test_vocab_parallel_balances_the_layers_alone_and_refuses_what_it_cannot_split_in_one_line(capsys):
    # --vocab-parallel spreads the embedding and the head over every stage: balanced splits the layers alone, and
    # the default job (3 ranks, tiny, 8192 tokens) goes from [28%] [28%] [43%] to a third each; the layout line
    # says each stage's rows (torch.chunk's: 2731, 2731, 2730).
    tiny = config_from_preset("tiny", 8192, 6)
    costs = model_module.estimated_costs(tiny, 128)
    layout = model_module.layout("balanced", tiny, 3, 128, vocab=True)
    assert model_module.describe_layout(layout, costs, 8192) == ("[layers 0-1 + vocab 0-2730 (33%)] [layers 2-3 + "
                                                                 "vocab 2731-5461 (33%)] [layers 4-5 + norm + vocab "
                                                                 "5462-8191 (33%)]")
    assert [len(r) for r in model_module.layout("balanced", tiny, 2, 128, vocab=True)] == [3, 3]
    # Refused in one line, before any work: --tp with it (the vocabulary is split over the pipeline ranks alone);
    # a vocabulary that leaves a rank no rows (5 over 4 ranks: 2, 2, 1, 0), once the model is known; the flag on
    # a script that lacks it: argparse's own line, exit status 2.
    with pytest.raises(checkpoint.UsageError, match=r"^--vocab-parallel with --tp: the vocabulary is split over the "
                                                    r"pipeline ranks alone; leave out one of --vocab-parallel and "
                                                    r"--tp$"):
        checked_args(manual, ["--vocab-parallel", "--tp", "2"], 4, "cpu")
    args = checked_args(manual, ["--vocab-parallel"], 4, "cpu")
    with pytest.raises(checkpoint.UsageError, match=r"^--vocab-parallel: a vocabulary of 5 leaves pipeline rank 3 "
                                                    r"of 4 no rows \(torch.chunk's\); leave --vocab-parallel out or "
                                                    r"use fewer ranks$"):
        manual.stage_layout(config_from_preset("tiny", 5, 6), 4, args)
    assert manual.stage_layout(config_from_preset("tiny", 7, 6), 4, args)  # 2, 2, 2, 1 rows
    for script in ("train_pipeline_gpipe.py", "train_pipeline_tracer.py"):
        err = refused(capsys, SCRIPT_MODULES[script].build_parser().parse_args, "--vocab-parallel", status=2)
        assert err == "error: unrecognized arguments: --vocab-parallel (see --help)", err


def test_split_counts_may_leave_the_first_or_the_last_stage_without_layers():
    # --split: a 0 first (the embedding alone) or last (the norm and the head alone); a 0 between them, a negative
    # count, counts that do not fit, or more stages than layers and two layerless ends: one line naming --split
    # or the stages. describe_layout prints a layerless stage by what it holds.
    tiny = config_from_preset("tiny", 8192, 6)
    costs = model_module.estimated_costs(tiny, 128)
    for spec, stages, sizes, described in [
            ("0,3,3,0", 4, [0, 3, 3, 0], "[embed (0%)] [layers 0-2 (28%)] [layers 3-5 (28%)] [norm + head (43%)]"),
            ("3,3,0", 3, [3, 3, 0], "[embed + layers 0-2 (28%)] [layers 3-5 (28%)] [norm + head (43%)]"),
            ("0,6", 2, [0, 6], "[embed (0%)] [layers 0-5 + norm + head (100%)]"),
            ("0,1,1,1,1,1,1,0", 8, [0, 1, 1, 1, 1, 1, 1, 0], None)]:
        layout = model_module.layout(spec, tiny, stages, 128)
        assert [len(r) for r in layout] == sizes and [r.start for r in layout] == [0, *itertools.accumulate(sizes)][:-1]
        assert described is None or model_module.describe_layout(layout, costs) == described
    for spec, stages, message in [
            ("3,0,3", 3, "--split 3,0,3: a stage between the first and the last needs at least 1 layer; only the "
                         "first (the embedding alone) and the last (the norm and the head alone) may have 0"),
            ("0,0,6", 3, "--split 0,0,6: a stage between the first and the last needs at least 1 layer"),
            ("-1,7", 2, "--split -1,7: a stage between the first and the last needs at least 1 layer"),
            ("3,3", 3, "--split 3,3: give 3 layer counts (one per stage) adding up to the model's 6 layers"),
            ("0,3,2,0", 4, "--split 0,3,2,0: give 4 layer counts"),
            ("even", 7, "--split even: 7 stages but 6 layers; use balanced, or layer counts with a 0"),
            ("balanced", 9, "9 pipeline stages but the model has 6 layers: each stage needs one, but for a first "
                            "stage of the embedding alone and a last one of the head alone")]:
        with pytest.raises(ValueError) as refused_split:
            model_module.layout(spec, tiny, stages, 128)
        assert str(refused_split.value).startswith(message) and "\n" not in str(refused_split.value), spec


# ----------------------------------------------------------------------------------------------------------
# 2. Data: prepare_data.py (documents -> tokenizer -> token files, once), and the scripts' Batches

def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list, field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path)
    return path


def tokens(out: Path, part: str) -> np.ndarray:
    """A split read back the way a training script reads it: np.memmap of each file, concatenated."""
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.memmap(out / name, dtype=meta["dtype"], mode="r") for name in meta[part]["files"]])


def whole(stream) -> list[str]:
    """prep.documents()'s (piece, end) stream as whole documents: the pieces joined up to each end."""
    docs, parts = [], []
    for text, end in stream:
        parts.append(text)
        if end:
            docs.append("".join(parts))
            parts = []
    assert not parts, "a stream that ends inside a document"
    return docs


def framed(backend, bos: int, eos: int, docs: list[str]) -> np.ndarray:
    return np.array([t for d in docs for t in [bos, *backend.encode(d, add_special_tokens=False).ids, eos]])


# -- prepare_data.py: the builtin corpus, prepared once (the session's `prepared`)

def test_builtin(prepared):
    from tokenizers import Tokenizer

    out, result = prepared
    pad = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("[PAD]")
    assert result.stdout.splitlines()[-1].startswith("prepared data: ")
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"]) == ("uint16", 8192)
    assert (meta["bos_token"], meta["eos_token"]) == ("[BOT]", "[EOT]")
    assert meta["source"] == {"data": "builtin", "eval_data": None, "tokenizer": None, "vocab_size": 8192,
                              "text_field": "text", "max_tokens": None}
    n_files = len(prep.builtin_files())
    assert meta["val"]["documents"] == n_files // 50 and meta["train"]["documents"] == n_files - n_files // 50
    for part in ("train", "val"):
        ids = tokens(out, part)
        assert len(ids) == sum(meta[part]["tokens"]) > 10_000 and ids[0] == meta["bos_id"]
        # Every document framed once: as many bos as eos as documents, and the stream ends on an eos.
        assert (ids == meta["bos_id"]).sum() == (ids == meta["eos_id"]).sum() == meta[part]["documents"]
        assert ids[-1] == meta["eos_id"] and not (ids == pad).any()
    assert sorted(os.listdir(out.parent)) == ["data"]  # no temporary folder left


def test_builtin_rerun_is_ready_fast_and_touches_nothing(prepared):
    out, _ = prepared
    before = snapshot(out.parent, folder_times=True)  # not even a temporary folder made and removed
    result = launch(0, "prepare_data.py", cwd=out.parent, timeout=300)
    assert result.returncode == 0 and result.stderr == ""
    assert len(result.stdout.splitlines()) == 1 and "ready" in result.stdout
    assert snapshot(out.parent, folder_times=True) == before  # nothing read or written: no tokenizing again


# -- prepare_data.py: what is written

def test_jsonl_tokens_are_framed_documents_in_order(tmp_path, capsys):
    from tokenizers import Tokenizer

    docs = corpus()
    data, out = write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out"
    code, stdout, err = run_main(capsys, prep.main, "--data", data, "--out", out)
    assert (code, err) == (0, "") and "prepared" in stdout.splitlines()[-1]
    meta = json.loads((out / "meta.json").read_text())
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos, pad = meta["bos_id"], meta["eos_id"], backend.token_to_id("[PAD]")
    held_out = [d for i, d in enumerate(docs) if i % 50 == 49]  # documents 49, 99, ...
    assert len(held_out) == 5 and meta["val"]["documents"] == 5 and meta["train"]["documents"] == 245
    trained_on = [d for i, d in enumerate(docs) if i % 50 != 49]
    np.testing.assert_array_equal(tokens(out, "train"), framed(backend, bos, eos, trained_on))
    np.testing.assert_array_equal(tokens(out, "val"), framed(backend, bos, eos, held_out))
    assert pad is not None and not (tokens(out, "train") == pad).any() and not (tokens(out, "val") == pad).any()
    assert meta["vocab_size"] == backend.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["fingerprint"].startswith(f"data={data.resolve()}:")
    # Same request again: ready, nothing rewritten.
    before = snapshot(tmp_path, folder_times=True)
    code, stdout, _ = run_main(capsys, prep.main, "--data", data, "--out", out)
    assert code == 0 and "ready" in stdout and snapshot(tmp_path, folder_times=True) == before


def test_every_source_form_gives_the_same_documents(tmp_path):
    docs = corpus(60)
    write_txt(tmp_path / "docs.txt", docs)
    write_jsonl(tmp_path / "docs.jsonl", docs)
    write_parquet(tmp_path / "docs.parquet", docs)
    write_jsonl(tmp_path / "body.jsonl", docs, field="body")
    write_parquet(tmp_path / "body.parquet", docs, field="body")
    folder = tmp_path / "folder"
    (folder / "b" / ".cache").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", docs[:20])
    write_txt(folder / "b" / "c.txt", docs[20:40])
    write_parquet(folder / "d.parquet", docs[40:])
    write_txt(folder / "b" / ".cache" / "hidden.txt", ["not a document"])
    (folder / "notes.md").write_text("not a document either")
    for spec in ["docs.txt", "docs.jsonl", "docs.parquet", "folder", "folder/a.jsonl,folder/b/c.txt,folder/d.parquet"]:
        got = whole(prep.documents(",".join(str(tmp_path / p) for p in spec.split(","))))
        assert got == docs, spec
    for spec in ["body.jsonl", "body.parquet"]:
        assert whole(prep.documents(str(tmp_path / spec), text_field="body")) == docs, spec
    # Windows line ends, blank lines of spaces, several blank lines in a row: still one document per paragraph.
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\r\n\r\n  \n\n\nc\r\n")
    assert whole(prep.documents(str(tmp_path / "crlf.txt"))) == ["a\nb", "c"]


def test_dtype_follows_the_vocabulary(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert prep.token_dtype(8192) == prep.token_dtype(65_536) == "uint16"
    assert prep.token_dtype(65_537) == prep.token_dtype(128_256) == "uint32"
    # A real vocabulary past 65,536 (a word-level one is quick to build): ids above 65,535 come back intact.
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["[BOT]", "[EOT]"])
    backend.save(str(tmp_path / "big.json"))
    docs = [" ".join(f"w{(i * 7919 + j * 104_729) % 70_000}" for j in range(30)) for i in range(250)]
    out = tmp_path / "out"
    code, _, err = run_main(capsys, prep.main, "--data", write_jsonl(tmp_path / "d.jsonl", docs), "--tokenizer",
                            tmp_path / "big.json", "--out", out)
    assert (code, err) == (0, "")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_003
    train = tokens(out, "train")
    assert train.dtype == np.uint32 and train.max() > 65_535
    trained_on = [d for i, d in enumerate(docs) if i % 50 != 49]
    np.testing.assert_array_equal(train, framed(backend, 70_001, 70_002, trained_on))


def test_given_tokenizer_file_with_bot_eot(tmp_path, capsys, tokenizer_file):
    from tokenizers import Tokenizer

    docs, out = corpus(), tmp_path / "out"
    code, stdout, err = run_main(capsys, prep.main, "--data", write_jsonl(tmp_path / "d.jsonl", docs), "--tokenizer",
                                 tokenizer_file, "--out", out)
    assert (code, err) == (0, "") and "training a" not in stdout
    meta = json.loads((out / "meta.json").read_text())
    backend = Tokenizer.from_file(str(tokenizer_file))
    assert (meta["bos_token"], meta["eos_token"], meta["bos_id"]) == ("[BOT]", "[EOT]", backend.token_to_id("[BOT]"))
    assert meta["source"]["tokenizer"] == str(tokenizer_file) and meta["source"]["vocab_size"] is None
    np.testing.assert_array_equal(tokens(out, "val"), framed(backend, meta["bos_id"], meta["eos_id"], docs[49::50]))
    # The saved tokenizer encodes as the data was encoded, and puts bos in front once with special tokens.
    saved = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert saved.encode(docs[0], add_special_tokens=False).ids == backend.encode(docs[0], add_special_tokens=False).ids
    ids = saved.encode(docs[0]).ids
    assert ids[0] == meta["bos_id"] and ids.count(meta["bos_id"]) == 1
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOT]", "eos_token": "[EOT]",
                      "pad_token": "[PAD]", "add_bos_token": True, "add_eos_token": False}


def hf_style_tokenizer(folder: Path, docs: list[str], adds_bos: bool) -> Path:
    """A Llama-2-like model folder: tokenizer.json with <s>/</s>, named in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    if adds_bos:  # as Llama 2's does already: the saved tokenizer must not get a second one
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                               special_tokens=[("<s>", 1)])
    backend.enable_truncation(max_length=16)  # as some model folders' files have: it must not cut documents
    backend.enable_padding(pad_id=0, pad_token="<unk>")  # nor pad them to the batch's longest
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": None,
         "model_max_length": 64}))
    return folder


def test_hf_style_tokenizer_folder(tmp_path, capsys):
    import transformers
    from tokenizers import Tokenizer

    docs = corpus()
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    for adds_bos in (False, True):
        folder = hf_style_tokenizer(tmp_path / f"model-{adds_bos}", docs, adds_bos)
        out = tmp_path / f"out-{adds_bos}"
        code, _, err = run_main(capsys, prep.main, "--data", data, "--tokenizer", folder, "--out", out)
        assert (code, err) == (0, "")
        meta = json.loads((out / "meta.json").read_text())
        assert (meta["bos_token"], meta["eos_token"], meta["bos_id"], meta["eos_id"]) == ("<s>", "</s>", 1, 2)
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend.no_truncation()
        backend.no_padding()
        # Documents come out whole and unpadded, though the tokenizer.json says truncate to 16 and pad.
        trained_on = [d for i, d in enumerate(docs) if i % 50 != 49]
        np.testing.assert_array_equal(tokens(out, "train"), framed(backend, 1, 2, trained_on))
        assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] == "<s>"
        assert "pad_token" not in json.loads((out / "tokenizer_config.json").read_text())
        ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode("the pipeline stage").ids
        assert ids[0] == 1 and ids.count(1) == 1
        hf_ids = transformers.AutoTokenizer.from_pretrained(str(out))("the pipeline stage")["input_ids"]
        assert hf_ids[0] == 1 and hf_ids.count(1) == 1 and hf_ids[1:] == ids[1:]


def test_shards_concatenate_to_the_one_file_result(tmp_path, capsys, monkeypatch, tokenizer_file):
    data = write_jsonl(tmp_path / "d.jsonl", corpus())
    code, _, _ = run_main(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", tmp_path / "one")
    assert code == 0
    monkeypatch.setattr(prep, "SHARD_TOKENS", 1000)
    code, _, _ = run_main(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", tmp_path / "many")
    assert code == 0
    one, many = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("one", "many"))
    assert one["train"]["files"] == ["train-00000.bin"]
    assert len(many["train"]["files"]) > 3 and many["train"]["files"][1] == "train-00001.bin"
    assert set(many["train"]["tokens"][:-1]) == {1000} and 0 < many["train"]["tokens"][-1] <= 1000
    for name, count in zip(many["train"]["files"], many["train"]["tokens"]):
        assert (tmp_path / "many" / name).stat().st_size == 2 * count
    np.testing.assert_array_equal(tokens(tmp_path / "many", "train"), tokens(tmp_path / "one", "train"))
    assert (tmp_path / "many" / "val.bin").read_bytes() == (tmp_path / "one" / "val.bin").read_bytes()


def test_max_tokens_and_eval_data(tmp_path, capsys, tokenizer_file):
    from tokenizers import Tokenizer

    docs, held_out = corpus(), corpus(10, seed=1)
    data, eval_data = write_jsonl(tmp_path / "d.jsonl", docs), write_txt(tmp_path / "held_out.txt", held_out)
    code, _, err = run_main(capsys, prep.main, "--data", data, "--eval-data", eval_data, "--tokenizer", tokenizer_file,
                            "--max-tokens", 500, "--out", tmp_path / "out")
    assert (code, err) == (0, "")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    backend = Tokenizer.from_file(str(tokenizer_file))
    bos, eos = meta["bos_id"], meta["eos_id"]
    # With --eval-data nothing of --data is held out; --max-tokens cuts the training stream at exactly 500.
    np.testing.assert_array_equal(tokens(tmp_path / "out", "train"), framed(backend, bos, eos, docs)[:500])
    np.testing.assert_array_equal(tokens(tmp_path / "out", "val"), framed(backend, bos, eos, held_out))
    assert meta["train"]["tokens"] == [500] and meta["val"]["documents"] == 10
    assert meta["source"]["max_tokens"] == 500 and meta["source"]["eval_data"] == str(eval_data)
    assert "eval_data=" in meta["fingerprint"] and "tokenizer=" in meta["fingerprint"]


# -- prepare_data.py, bad input: one line, exit status 1, nothing left behind

def _bad_inputs(d: Path, tokenizer_file: Path) -> dict:
    """name -> (arguments, words the one error line must hold); the files are written into d."""
    from tokenizers import Tokenizer, models

    (d / "binary.txt").write_bytes(b"good text\n\nmore \xff\xfe\x00 binary\n")
    (d / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": "b"\n')
    (d / "list.jsonl").write_text('["text"]\n')
    (d / "nofield.jsonl").write_text('{"body": "x", "id": 1}\n')
    (d / "number.jsonl").write_text('{"text": "a"}\n{"text": 5}\n')
    (d / "tok.json").write_text("not json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "plain.json"))
    write_parquet(d / "body.parquet", ["x", "y"], field="body")
    write_parquet(d / "null.parquet", ["x", None])
    (d / "a.csv").write_text("text\nx\n")
    small, docs = write_jsonl(d / "small.jsonl", ["hi", "there"]), write_jsonl(d / "docs.jsonl", corpus(40))
    return {
        "missing": (["--data", d / "nope.jsonl"], ["nope.jsonl", "no such file"]),
        "missing_eval": (["--data", docs, "--eval-data", d / "nope.txt"], ["--eval-data", "nope.txt"]),
        "extension": (["--data", d / "a.csv"], ["a.csv", ".jsonl"]),
        "binary_txt": (["--data", d / "binary.txt"], ["binary.txt", "line 3", "UTF-8"]),
        "bad_json": (["--data", d / "bad.jsonl"], ["bad.jsonl", "line 3", "not valid JSON"]),
        "json_list": (["--data", d / "list.jsonl"], ["list.jsonl", "line 1", "list"]),
        "json_no_field": (["--data", d / "nofield.jsonl"], ["nofield.jsonl", "line 1", "'body'", "--text-field"]),
        "json_number": (["--data", d / "number.jsonl"], ["number.jsonl", "line 2", "not a string"]),
        "parquet_column": (["--data", d / "body.parquet"], ["body.parquet", "'body'", "--text-field"]),
        "parquet_null": (["--data", d / "null.parquet"], ["null.parquet", "row 2"]),
        "tokenizer_missing": (["--data", docs, "--tokenizer", d / "nope.json"], ["nope.json"]),
        "tokenizer_garbage": (["--data", docs, "--tokenizer", d / "tok.json"], ["tok.json", "not a tokenizers"]),
        "tokenizer_no_bos": (["--data", docs, "--tokenizer", d / "plain.json"], ["plain.json", "bos_token"]),
        "vocab_with_tokenizer": (["--data", docs, "--tokenizer", tokenizer_file, "--vocab-size", 100],
                                 ["--vocab-size", "--tokenizer"]),
        "train_too_small": (["--data", small, "--eval-data", docs], ["training split", "tokens", "more documents"]),
    }


PREPARE_BAD = ["missing", "missing_eval", "extension", "binary_txt", "bad_json", "json_list", "json_no_field",
               "json_number", "parquet_column", "parquet_null", "tokenizer_missing", "tokenizer_garbage",
               "tokenizer_no_bos", "vocab_with_tokenizer", "train_too_small"]


@pytest.mark.parametrize("case", PREPARE_BAD)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, tokenizer_file, case):
    (tmp_path / "in").mkdir()
    argv, words = _bad_inputs(tmp_path / "in", tokenizer_file)[case]
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("untouched")
    before = snapshot(work)
    # Its parent is created, and removed again.
    code, _, err = run_main(capsys, prep.main, *argv, "--out", work / "new" / "out")
    assert code == 1
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    assert snapshot(work) == before


def test_error_while_writing_removes_the_partial_dataset(tmp_path, capsys, monkeypatch, tokenizer_file):
    lines = [json.dumps({"text": d}) for d in corpus(300)]
    lines[289] = '{"text": '
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(prep, "BATCH_DOCUMENTS", 10)  # many batches are written before line 290 is read
    written, write = [], prep.TokenFiles.write

    def spy(self, ids):  # where the partial dataset was written
        written.append(self.directory)
        write(self, ids)

    monkeypatch.setattr(prep.TokenFiles, "write", spy)
    before = snapshot(tmp_path)
    code, _, err = run_main(capsys, prep.main, "--data", tmp_path / "d.jsonl", "--tokenizer", tokenizer_file,
                            "--out", tmp_path / "out")
    assert code == 1 and "line 290" in err and len(err.splitlines()) == 1
    assert len(written) > 20 and not os.path.exists(written[0])
    assert snapshot(tmp_path) == before


def test_hf_dataset_that_cannot_be_opened(tmp_path):
    result = launch(0, "prepare_data.py", "--data", "hf:no-such-user-xyz/no-such-dataset", "--out", tmp_path / "out",
                    cwd=tmp_path, timeout=300)
    assert result.returncode == 1 and result.stdout.startswith("training a")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: --data hf:no-such-user-xyz/no-such-dataset: cannot open the dataset (")
    assert os.listdir(tmp_path) == []


def test_ctrl_c_removes_the_temporary_folder(tmp_path, capsys, monkeypatch, tokenizer_file):
    def interrupt(self, ids):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep.TokenFiles, "write", interrupt)
    data = write_jsonl(tmp_path / "d.jsonl", corpus())
    before = snapshot(tmp_path)
    code, _, err = run_main(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", tmp_path / "out")
    assert code == 130 and len(err.splitlines()) == 1
    assert snapshot(tmp_path) == before


def test_command_line_errors_are_one_line_with_status_2(capsys):
    for argv in (["--max-tokens", "lots"], ["--vocab-size", "0"], ["--no-such-flag"]):
        code, out, err = run_main(capsys, prep.main, *argv)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (argv, err)
        assert err.startswith("error: ") and err.rstrip().endswith("(see --help)")


def backend_of(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


# -- prepare_data.py: --out and what is read; what --force replaces

def test_out_that_is_holds_or_lies_inside_an_input_is_refused_even_with_force(tmp_path, capsys, tokenizer_file):
    folder = tmp_path / "corpus"
    folder.mkdir()
    good, second = write_jsonl(folder / "good.jsonl", corpus(60)), write_jsonl(folder / "second.jsonl", corpus(60, 1))
    (folder / "notes.md").write_text("mine")
    (tmp_path / "link").symlink_to(folder)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    tok = ["--tokenizer", tokenizer_file]
    cases = [  # (arguments, what the line says)
        (["--data", folder, *tok, "--out", folder], f"it is --data {folder}"),
        (["--data", good, *tok, "--out", good], f"it is --data {good}"),
        (["--data", good, *tok, "--out", folder], f"it holds --data {good}"),
        (["--data", folder, *tok, "--out", folder / "sub"], f"it lies inside --data {folder}"),
        (["--data", folder, *tok, "--out", tmp_path / "link"], f"it is --data {folder}"),  # real paths compared
        (["--data", good, "--eval-data", second, *tok, "--out", folder], f"it holds --data {good}"),
        (["--data", good, "--tokenizer", tmp_path / "tok", "--out", tmp_path / "tok"], "it is --tokenizer"),
    ]
    before = snapshot(tmp_path, folder_times=True)
    for argv in (a + extra for a, _ in cases for extra in ([], ["--force"])):
        err = refused(capsys, prep.main, *argv)
        assert "another --out" in err, err
        assert snapshot(tmp_path, folder_times=True) == before, argv  # nothing created, nothing deleted
    for argv, words in cases:
        assert words in refused(capsys, prep.main, *argv, "--force"), (argv, words)


def test_force_replaces_only_a_dataset_written_here(tmp_path, capsys, tokenizer_file):
    """Replaces test_small.py's test_out_holding_other_things_is_refused_and_force_replaces_it."""
    data_a, data_b = write_jsonl(tmp_path / "a.jsonl", corpus()), write_jsonl(tmp_path / "b.jsonl", corpus(seed=2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    common = ["--tokenizer", tokenizer_file, "--out", out]
    # Other files: refused, --force or not, saying what is there; untouched.
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        err = refused(capsys, prep.main, "--data", data_a, *common, *force)
        assert f"--out {out}: it holds other files (notes.txt)" in err and "another --out" in err, err
        assert snapshot(tmp_path) == before
    (out / "notes.txt").unlink()
    assert run_main(capsys, prep.main, "--data", data_a, *common)[0] == 0  # an empty folder is no obstacle
    # Another request: refused naming what changed, then replaced with --force.
    before = snapshot(tmp_path)
    err = refused(capsys, prep.main, "--data", data_b, *common)
    assert f"--data {data_a} -> {data_b}" in err and "--force" in err, err
    err = refused(capsys, prep.main, "--data", data_a, *common, "--max-tokens", 1000)
    assert "--max-tokens unset -> 1000" in err and "--data" not in err.split("(")[1], err
    assert snapshot(tmp_path) == before
    assert run_main(capsys, prep.main, "--data", data_b, *common, "--force")[0] == 0
    assert json.loads((out / "meta.json").read_text())["source"]["data"] == str(data_b)
    # The same request after its files changed: the refusal says so.
    os.utime(data_b, ns=(0, 0))
    err = refused(capsys, prep.main, "--data", data_b, *common)
    assert "the files of --data changed since" in err and "--force" in err, err
    # A file of the user's beside the dataset: --force does not delete it.
    (out / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    err = refused(capsys, prep.main, "--data", data_b, *common, "--force")
    assert "a dataset and other files (notes.txt)" in err and "another --out" in err, err
    assert snapshot(tmp_path) == before
    (out / "notes.txt").unlink()
    assert run_main(capsys, prep.main, "--data", data_b, *common, "--force")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl", "out"]  # no lock, no temporary folder
    # An --out that is a file of the user's is never replaced.
    (tmp_path / "file").write_text("mine")
    err = refused(capsys, prep.main, "--data", data_a, "--tokenizer", tokenizer_file, "--out", tmp_path / "file",
                  "--force")
    assert "is not a folder" in err and (tmp_path / "file").read_text() == "mine"


def test_damaged_meta_json_is_named_and_replaced_only_when_the_folder_is_ours(tmp_path, capsys, tokenizer_file):
    data = write_jsonl(tmp_path / "a.jsonl", corpus())
    out = tmp_path / "out"
    common = ["--data", data, "--tokenizer", tokenizer_file, "--out", out]
    assert run_main(capsys, prep.main, *common)[0] == 0
    (out / "meta.json").write_text('{"format": 1, "dtype": "uint1')  # cut short
    err = refused(capsys, prep.main, *common)
    assert "damaged dataset" in err and "--force" in err, err
    assert run_main(capsys, prep.main, *common, "--force")[0] == 0 and prep.read_meta(str(out)) is not None
    (out / "meta.json").write_text("[]")
    (out / "notes.md").write_text("mine")
    before = snapshot(tmp_path)
    err = refused(capsys, prep.main, *common, "--force")
    assert "damaged meta.json and other files (notes.md)" in err and "another --out" in err, err
    assert snapshot(tmp_path) == before


# -- prepare_data.py, small corpora: a held-out tail

def test_single_document_or_small_corpus_holds_out_the_last_tokens(tmp_path, capsys, monkeypatch, tokenizer_file):
    backend = backend_of(tokenizer_file)
    bos, eos = backend.token_to_id("[BOT]"), backend.token_to_id("[EOT]")
    lines = [" ".join(d.split()[:12]) for d in corpus(400)]  # one paragraph per line: one document
    cases = {"one.txt": (lines, ["\n".join(lines)]), "few.jsonl": (corpus(30), corpus(30)),
             # document 49 is held out whole, but is less than a window: it goes at the end of the tail
             "sixty.jsonl": (corpus(60), [d for i, d in enumerate(corpus(60)) if i != 49] + [corpus(60)[49]])}
    monkeypatch.setattr(prep, "SHARD_TOKENS", 100)  # the tail spans several training files
    for name, (docs, stream) in cases.items():
        data = tmp_path / name
        if name == "one.txt":
            data.write_text("\n".join(docs) + "\n")  # no blank line anywhere
        else:
            write_jsonl(data, docs)
        out = tmp_path / f"out-{name}"
        code, stdout, err = run_main(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", out)
        assert (code, err) == (0, ""), (name, err)
        assert "the last 10 % of the tokens" in stdout.splitlines()[-1], stdout
        meta = json.loads((out / "meta.json").read_text())
        train, val, expected = tokens(out, "train"), tokens(out, "val"), framed(backend, bos, eos, stream)
        assert meta["val"]["held_out"] == "tail" and len(val) == max(129, len(expected) // 10), name
        np.testing.assert_array_equal(np.concatenate([train, val]), expected)
        for part in ("train", "val"):
            for file, count in zip(meta[part]["files"], meta[part]["tokens"]):
                assert (out / file).stat().st_size == 2 * count > 0
        assert sorted(os.listdir(out)) == sorted(meta["train"]["files"] + ["val.bin", "meta.json", "tokenizer.json",
                                                                           "tokenizer_config.json"])
    # Enough documents: every 50th held out whole, as before; but --max-tokens 2000 stops before the 50th (a tail).
    many = write_jsonl(tmp_path / "many.jsonl", corpus())
    for max_tokens, held_out, counts in [([], "documents", None), (["--max-tokens", 2000], "tail", (1800, [200]))]:
        out = tmp_path / f"out-many-{held_out}"
        code, _, err = run_main(capsys, prep.main, "--data", many, "--tokenizer", tokenizer_file, *max_tokens, "--out",
                                out)
        meta = json.loads((out / "meta.json").read_text())
        assert (code, err, meta["val"]["held_out"]) == (0, "", held_out)
        assert counts in (None, (sum(meta["train"]["tokens"]), meta["val"]["tokens"]))


def test_too_few_tokens_name_the_cause_and_the_scripts_window(tmp_path, capsys, tokenizer_file):
    docs, small = write_jsonl(tmp_path / "d.jsonl", corpus()), write_jsonl(tmp_path / "s.jsonl", ["hi", "there"])
    window = "one window of 129 tokens (the training scripts' default --seq-len 128, plus one)"
    tok = ["--tokenizer", tokenizer_file]
    before = snapshot(tmp_path)
    err = refused(capsys, prep.main, "--data", docs, "--eval-data", small, *tok, "--max-tokens", 100, "--out",
                  tmp_path / "out")
    assert err.startswith("error: --max-tokens 100: ") and window in err, err
    err = refused(capsys, prep.main, "--data", docs, *tok, "--max-tokens", 200, "--out", tmp_path / "out")
    assert err.startswith("error: --max-tokens 200: ") and window in err and "258" in err, err
    err = refused(capsys, prep.main, "--data", small, *tok, "--out", tmp_path / "out")
    assert err.startswith(f"error: --data {small}: ") and window in err and "more documents" in err, err
    err = refused(capsys, prep.main, "--data", small, "--eval-data", docs, *tok, "--out", tmp_path / "out")
    assert "training split" in err and window in err, err
    assert snapshot(tmp_path) == before


# -- prepare_data.py: one line instead of a traceback or a surprise

def test_lone_surrogate_in_jsonl_is_one_line_naming_file_and_line(tmp_path, capsys, tokenizer_file):
    rows = ['{"text": "plain"}', '{"text": "a pair \\ud83d\\ude00 is fine"}', '{"text": "lone \\ud800 here"}']
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n")
    before = snapshot(tmp_path)
    for tok in (["--vocab-size", 300], ["--tokenizer", tokenizer_file]):  # training a tokenizer, or encoding
        err = refused(capsys, prep.main, "--data", data, *tok, "--out", tmp_path / "out")
        assert f"--data {data}, line 3: " in err and "surrogate" in err and "line 2" not in err, err
        assert snapshot(tmp_path) == before


def test_long_text_without_spaces_trains_quickly_and_is_encoded_in_bounded_pieces(tmp_path, capsys):
    rng = random.Random(0)
    blob = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=600_000))
    # The trainer's pieces: bounded, whole again when joined, and cut before whitespace (pre-tokens unchanged).
    from tokenizers import pre_tokenizers

    text = "\n".join(corpus(300))
    code = "".join(f"\n{'    ' * (i % 5)}x = {i}  # {'c ' * (i % 7)}\t" for i in range(3000))  # runs of whitespace
    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    for sample in (text, code, blob, "  " * 3000, "x" * 999 + " y"):
        parts = list(prep.pieces(sample))
        assert "".join(parts) == sample and max(map(len, parts)) <= prep.TOKENIZER_PIECE_CHARS
    for sample in (text, code):
        assert [t for p in prep.pieces(sample) for t, _ in split(p)] == [t for t, _ in split(sample)]
    started = time.process_time()  # CPU time, its threads' too: a loaded machine does not stretch it
    prep.train_tokenizer([blob], 300)
    took = time.process_time() - started
    assert took < 5, took  # 0.3 s; 20-40 s uncut (the trainer's time grows with the square of a pre-token's length)
    data = write_jsonl(tmp_path / "d.jsonl", [blob, *corpus(60)])
    held_out = write_jsonl(tmp_path / "held_out.jsonl", corpus(20, seed=1))
    code, _, err = run_main(capsys, prep.main, "--data", data, "--eval-data", held_out, "--vocab-size", 300, "--out",
                            tmp_path / "out")
    assert (code, err) == (0, "")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    # Encoded in pieces of PIECE_CHARS (no space to cut at: after PIECE_CHARS characters), not the trainer's.
    backend, size = backend_of(tmp_path / "out" / "tokenizer.json"), prep.PIECE_CHARS
    expected = [i for start in range(0, len(blob), size)
                for i in backend.encode(blob[start:start + size], add_special_tokens=False).ids]
    train = tokens(tmp_path / "out", "train")  # the blob is the first document
    assert train[0] == meta["bos_id"] and train[len(expected) + 1] == meta["eos_id"]
    np.testing.assert_array_equal(train[1:len(expected) + 1], expected)


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's tokenizer.json: where its pre-tokens begin and end


def test_a_long_document_is_encoded_in_pieces_to_its_whole_ids_in_bounded_memory(tmp_path, capsys, monkeypatch):
    # One document (a .txt without blank lines) of prose, indented code and lines without spaces, read, trained on
    # and encoded in small pieces: the ids are those of the document encoded whole, from a .txt read in parts
    # (characters cut between parts) and from a .jsonl line alike.
    rng, lines = random.Random(0), []
    for _ in range(40):
        lines += [" ".join(rng.choices(WORDS, k=rng.randint(5, 30))) + end for end in ("", ".", "  ", "\t")]
        lines += [f"{'    ' * (i % 4)}x{i} = f(y,  z)\t# {'a b ' * (i % 5)}" for i in range(4)]
        lines += ["".join(rng.choices("中文字的是了我不人在。，、", k=rng.randint(50, 600))) for _ in range(5)]
    text = "\n".join(lines)
    monkeypatch.setattr(prep, "PIECE_CHARS", 1000)
    monkeypatch.setattr(prep, "READ_BYTES", 4096)
    monkeypatch.setattr(prep, "BATCH_CHARS", 20_000)
    pieces = [piece for piece, _ in prep.in_pieces([(text, True)], prep.PIECE_CHARS)]
    cuts = {"before a space" if b[0] == " " else "after a newline" if a[-1] == "\n" else "inside a word"
            for a, b in zip(pieces, pieces[1:])}
    assert len(pieces) > 80 and cuts == {"before a space", "after a newline"}, cuts  # both kinds, and only those
    out, data = tmp_path / "txt", tmp_path / "doc.txt"
    data.write_text(text + "\n", encoding="utf-8")
    code, _, err = run_main(capsys, prep.main, "--data", data, "--vocab-size", 300, "--out", out)
    assert (code, err) == (0, "")
    meta = json.loads((out / "meta.json").read_text())
    backend = backend_of(out / "tokenizer.json")
    expected = framed(backend, meta["bos_id"], meta["eos_id"], [text])
    assert meta["train"]["documents"] == 1 and meta["val"]["held_out"] == "tail"  # the last tokens held out
    np.testing.assert_array_equal(np.concatenate([tokens(out, "train"), tokens(out, "val")]), expected)
    # The same with Llama 3's pre-tokenizer (its split pattern, then byte-level), the document a .jsonl line.
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    llama3 = Tokenizer(models.BPE())
    llama3.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama3.train_from_iterator([text[:30_000]], trainers.BpeTrainer(vocab_size=400, special_tokens=["[BOT]", "[EOT]"],
                                                                    show_progress=False))
    llama3.save(str(tmp_path / "llama3.json"))
    code, _, err = run_main(capsys, prep.main, "--data", write_jsonl(tmp_path / "doc.jsonl", [text]), "--tokenizer",
                            tmp_path / "llama3.json", "--out", tmp_path / "jsonl")
    assert (code, err) == (0, "")
    np.testing.assert_array_equal(np.concatenate([tokens(tmp_path / "jsonl", p) for p in ("train", "val")]),
                                  framed(llama3, 0, 1, [text]))
    # Memory: a 2 MB document on one line, in a process of its own (pieces of 10,000 characters, 50,000 at a time on 2
    # threads; the tokenizer trained on its first 100,000): its peak grows by ~20 MB whatever the document's length;
    # read, trained on and encoded whole, by ~220x the document (470 MB).
    data = tmp_path / "line.txt"
    data.write_text(" ".join(rng.choices(WORDS, k=350_000)) + "\n", encoding="utf-8")
    measure = ("import sys, tokenizers, prepare_data as prep\n"
               "def peak(): return 1024 * int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
               "prep.PIECE_CHARS, prep.READ_BYTES, prep.BATCH_CHARS = 10_000, 1 << 16, 50_000\n"
               "prep.TOKENIZER_TRAIN_CHARS = 100_000\n"
               "before = peak()\n"
               "prep.main(sys.argv[1:])\n"
               "print(peak() - before)\n")
    result = start([sys.executable, "-c", measure, "--data", data, "--vocab-size", 300, "--out", tmp_path / "line"],
                   cwd=ROOT, env=dict(script_env(), RAYON_NUM_THREADS="2"), timeout=120)
    assert result.returncode == 0, result.stderr
    grew, size = int(result.stdout.split()[-1]), data.stat().st_size
    assert size > 2_000_000 and grew < 16 * size, (grew, size)  # 16x: room above the ~20 MB measured


def test_eval_data_overlapping_data_is_refused(tmp_path, capsys, tokenizer_file):
    folder = tmp_path / "docs"
    folder.mkdir()
    data = write_jsonl(folder / "a.jsonl", corpus(60))
    other = write_jsonl(tmp_path / "b.jsonl", corpus(20, 1))
    (tmp_path / "alias.jsonl").symlink_to(data)
    before = snapshot(tmp_path, folder_times=True)
    for d, e in [(data, data), (folder, data), (data, folder), (data, tmp_path / "alias.jsonl"),
                 (f"{other},{data}", f"{folder}"), ("builtin", "builtin")]:
        err = refused(capsys, prep.main, "--data", d, "--eval-data", e, "--tokenizer", tokenizer_file, "--out",
                      tmp_path / "o")
        assert err.startswith(f"error: --eval-data {e}: it overlaps --data {d}"), err
    assert snapshot(tmp_path, folder_times=True) == before


# -- prepare_data.py: runs at once, SIGTERM, SIGKILL

def _blocked_run(tmp_path: Path, vocabulary: list, out: Path) -> subprocess.Popen:
    """prepare_data.py writing out, held up reading its --data: a FIFO no one writes to."""
    fifo = tmp_path / "stuck.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    proc = launch(0, "prepare_data.py", "--data", fifo, *vocabulary, "--out", out, cwd=tmp_path, wait=False)
    deadline = time.time() + 60
    while not [n for n in os.listdir(out.parent) if n.endswith(".tmp")]:  # it has begun writing
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    return proc


def test_a_second_run_into_the_same_out_is_refused_and_a_killed_ones_leftovers_removed(tmp_path, capsys,
                                                                                        tokenizer_file):
    out = tmp_path / "out"
    first = _blocked_run(tmp_path, ["--tokenizer", tokenizer_file], out)
    try:
        data = write_jsonl(tmp_path / "d.jsonl", corpus())
        err = refused(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", out, "--force")
        assert f"--out {out}: another prepare_data.py (pid {first.pid}) is writing it" in err, err
    finally:
        first.kill()  # SIGKILL: it can clean nothing up
        first.communicate()
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".out.")]
    assert any(n.endswith(".tmp") for n in leftovers), leftovers
    code, _, err = run_main(capsys, prep.main, "--data", data, "--tokenizer", tokenizer_file, "--out", out)
    assert (code, err) == (0, "")
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "out", "stuck.jsonl"]  # its folder and lock are gone


def test_sigterm_cleans_up_like_ctrl_c(tmp_path, tokenizer_file):
    (tmp_path / "new").mkdir()
    # While tokenizing with a given tokenizer, and while reading documents to train one.
    for vocabulary in (["--tokenizer", tokenizer_file], ["--vocab-size", 300]):
        proc = _blocked_run(tmp_path, vocabulary, tmp_path / "new" / "out")
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 128 + signal.SIGTERM and err == "interrupted: nothing written\n", \
            (vocabulary, proc.returncode, err)
        assert os.listdir(tmp_path / "new") == []


def test_nothing_runs_at_import_and_torch_is_not_needed():
    code = "import sys, prepare_data; assert 'torch' not in sys.modules and 'datasets' not in sys.modules; print('ok')"
    result = start([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert result.stdout == "ok\n", result.stderr


# -- The scripts' Batches

def test_batches_visit_every_window_once_per_epoch_in_a_seeded_order_and_resume(tmp_path):
    # Two token files of 1001 and 501 tokens: windows of 10 + 1 tokens, 100 + 50 of them.
    files = [np.arange(1001, dtype=np.uint16), np.arange(5000, 5501, dtype=np.uint16)]
    for name, tokens in zip(("a.bin", "b.bin"), files):
        tokens.tofile(tmp_path / name)
    meta = {"dtype": "uint16", "train": {"files": ["a.bin", "b.bin"]}}
    batches = gpipe.Batches(str(tmp_path), meta, "train", seq_len=10, batch_size=5, seed=1)
    assert batches.num_windows == 150
    epoch = [batches.next() for _ in range(30)]
    starts = torch.cat([inputs[:, 0] for inputs, _ in epoch]).tolist()
    assert sorted(starts) == list(range(0, 1000, 10)) + list(range(5000, 5500, 10))  # each window once
    for inputs, targets in epoch:  # targets are the inputs shifted by one; a window never crosses two files
        assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets[:, -1], inputs[:, -1] + 1)
    same = gpipe.Batches(str(tmp_path), meta, "train", 10, 5, seed=1)
    assert torch.equal(torch.cat([same.next()[0][:, 0] for _ in range(30)]), torch.tensor(starts))
    other = gpipe.Batches(str(tmp_path), meta, "train", 10, 5, seed=2)
    assert torch.cat([other.next()[0][:, 0] for _ in range(30)]).tolist() != starts
    state = json.loads(json.dumps(batches.state_dict()))  # it goes into meta.json
    ahead = [batches.next()[0] for _ in range(7)]
    assert batches.epoch == 1 and state == {"epoch": 0, "index": 150}  # the next epoch starts at the next call
    resumed = gpipe.Batches(str(tmp_path), meta, "train", 10, 5, seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, resumed.next()[0]) for a in ahead)
    in_order = gpipe.Batches(str(tmp_path), meta, "train", 10, 5, seed=0, shuffle=False)  # held-out batches
    assert in_order.next()[0][:, 0].tolist() == [0, 10, 20, 30, 40]


def test_an_evaluation_takes_up_to_4_held_out_batches_by_default_and_refuses_more_than_there_are():
    flags = lambda **given: argparse.Namespace(**{"eval_every": 100, "steps": 300, "eval_batches": None,  # noqa
                                                  "batch_size": 16, "seq_len": 128, "data": "d", **given})
    assert checkpoint.eval_batches(flags(), 585) == 4  # the default data: 585 held-out windows of 129 tokens
    assert checkpoint.eval_batches(flags(), 40) == 2  # fewer: as many batches as there are
    assert checkpoint.eval_batches(flags(), 1) == 1  # a small corpus's tail: its window repeated in one batch
    assert checkpoint.eval_batches(flags(eval_batches=2), 32) == 2
    assert checkpoint.eval_batches(flags(eval_every=0), 0) == 0  # no evaluation: nothing asked of the data
    with pytest.raises(checkpoint.UsageError, match=r"^--eval-batches 3: --data d holds 40 held-out windows of "
                       r"--seq-len \+ 1, fewer than --eval-batches x --batch-size; ask fewer, or leave the flag out"):
        checkpoint.eval_batches(flags(eval_batches=3), 40)
    for only_evaluating in ({}, {"steps": 0, "eval_every": 0}):
        with pytest.raises(checkpoint.UsageError, match=r"^--seq-len 128: --data d holds no held-out window .* or "
                           r"train without evaluating \(--eval-every 0\)$"):
            checkpoint.eval_batches(flags(**only_evaluating), 0)


# ----------------------------------------------------------------------------------------------------------
# 3. Parity: a pipeline is the same model, in each script

# -- One pipelined step: every gradient equals the unsplit model's, for every split and schedule

def unsplit_step(config, inputs, targets, microbatches: int, documents: bool = False):
    """The reference for one pipelined step: the unsplit model on this process, from the pipelines' seed, fed the
    same microbatches one after another, each loss divided by their count as the schedules do (documents: kept
    apart, from the bos in inputs): (the mean microbatch loss, every parameter's gradient, the model)."""
    reference = LlamaForPretraining(config)
    reference.init_weights(seed=11)
    losses, positions = [], model_module.document_positions(inputs, BOS) if documents else None
    for i, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
        losses.append(plain_loss(reference(x, positions.chunk(microbatches)[i] if documents else None), y))
        (losses[-1] / microbatches).backward()
    return torch.stack(losses).mean().detach(), {name: p.grad for name, p in reference.named_parameters()}, reference


def assert_unsplit(variant, ranks: list[dict], loss, expected: dict) -> None:
    """A launched variant's gradients, gathered from every rank, are the unsplit step's (unsplit_step), and so are
    its loss and its evaluation's (forward only)."""
    got = {name: g for result in ranks for name, g in result[variant]["grads"].items()}
    assert sorted(got) == sorted(expected), variant
    for name in expected:
        # --vocab-parallel ("vocab", "tied") sums the hidden states' gradient over the ranks' vocabulary slices, in
        # another order than one matmul over the whole vocabulary: that round-off reaches every layer, where an
        # entry near 0 is 1e-8 off (measured: 1.3e-8 on a v_proj entry at 3 stages, 4e-7 of the tensor's largest):
        # atol 1e-5 of the tensor's largest entry. (A microbatch lost or weighed wrong is off by far more.)
        atol = 1e-5 * expected[name].abs().max().item() if variant[0] in ("vocab", "tied") else 1e-8
        torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=atol, msg=f"{variant} {name}")
    for kind in ("loss", "eval"):
        value = next(result[variant][kind] for result in ranks if result[variant][kind] is not None)
        assert_close_rel(value.item(), loss.item(), what=f"{variant} {kind}")


# parity_run (conftest.py): one step, then an evaluation, of every variant of a layout in PARITY_LAYOUTS
# (every split and schedule) in one launch of real gloo ranks; the tests below hold it to the unsplit model.


def test_every_split_and_schedule_gives_the_unsplit_gradients(parity_run):
    (pp, dp, tp), variants, (inputs, targets), ranks = parity_run
    (microbatches, _), world_size = parity_step((pp, dp, tp)), pp * dp * tp
    # The unsplit model on this process, fed every replica's microbatches one after another.
    references = {(layer_count(split), documents, kind == "tied"): unsplit_step(  # "tied": its head the embedding
        parity_config(layer_count(split), kind == "tied"), inputs, targets, dp * microbatches, documents)
        for kind, _, split, documents in variants}
    if (4, True, False) in references:  # kept apart, the documents compute otherwise: the comparison can fail
        assert not torch.equal(references[4, True, False][1]["lm_head.weight"], unsplit_step(
            parity_config(4), inputs, targets, dp * microbatches)[1]["lm_head.weight"])
    assert sorted(ranks[0], key=str) == sorted(variants, key=str)
    for variant in variants:
        loss, expected, reference = references[layer_count(variant[2]), variant[3], variant[0] == "tied"]
        assert_unsplit(variant, ranks, loss, expected)  # the evaluation under every schedule too (forward only)
        # Every stage started from exactly the full model's weights and RoPE buffers for the seed (nothing
        # trained them: no optimizer step) ...
        tensors = dict(reference.named_parameters()) | dict(reference.named_buffers())
        initial = {name: t for result in ranks for name, t in result[variant]["initial"].items()}
        assert sorted(initial) == sorted(tensors), variant
        for name, tensor in initial.items():
            assert torch.equal(tensor, tensors[name]), (variant, name)
        # ... and what a checkpoint saves is the full model's state_dict keys, split across the stages, nothing more
        # (--vocab-parallel: the embedding and the head on every stage, each its rows).
        keys = [k for result in ranks for k in result[variant]["state_keys"]]
        vocab = {"base_model.embed_tokens.weight", "lm_head.weight"} if variant[0] in ("vocab", "tied") else set()
        assert [k for k in keys if k in vocab] == sorted(vocab) * pp, variant
        assert sorted([k for k in keys if k not in vocab] + [*vocab]) == sorted(reference.state_dict()), variant
        # Each rank holds its replica's share (torch.chunk's) of its pipeline rank's rows of each slice (tied: one),
        # (Shard(0), Shard(0)) over (pp, dp): at 2 x 2 the 98 rows in 25, 24 | 25, 24; AdamW's state follows them.
        for r, result in enumerate(ranks):
            rows = len(torch.arange(98).chunk(pp)[r // (dp * tp)].chunk(dp)[r // tp % dp])
            assert result[variant]["slices"] == dict.fromkeys(sorted(vocab)[:1 + (variant[0] == "vocab")],
                                                              (rows, 32)), (variant, r)
        # No stage gives out a view (tensor parallelism's to_local(), of the final norm or of the embedding alone):
        # FSDP2 warns of one, since an in-place op on it would drop its backward hook.
        assert not [r[variant]["views"] for r in ranks if r[variant]["views"]], variant
        # Documents kept apart: each stage that holds layers builds one mask a microbatch, for all its layers, in
        # the step and in the evaluation (none without documents). The tracer's stages build theirs in their graphs,
        # in each layer (model.LlamaModel.mask_in_each_layer): each rank traces the whole model once, a mask a layer.
        kind, name, split, documents = variant
        # With S chunks a sequence: each chunk's (a stream's later ones too: their mask over the earlier ones).
        chunks = len(seq_chunks(name, inputs.shape[1], parity_config(4), tp).get("lengths", [0]))
        for r, result in enumerate(ranks):
            stages = result[variant]["stages"]  # the schedule's (stage_ids), or a file's order's
            layers = split_layers(split, pp * len(stages))
            built = layer_count(split) if kind == "tracer" else 2 * microbatches * len([s for s in stages if layers[s]])
            built *= not (kind == "tracer" and chunks > 1)  # (a traced chunk's: from document_mask_mod, in its graph)
            assert result[variant]["masks"] == built * (chunks - 1 + documents), (variant, r)
    # 1F1B holds the activations of (p - r) of the m = 4 microbatches on stage r, GPipe all of them: nothing
    # more (e.g. none left over from torch's own shape inference, which the declared stage_io avoids). Against the
    # same split's GPipe where it ran (traced with documents, attention holds copied K/V heads: document_attention).
    # Seq1F1B ("1f1b:4", --seq-chunks 4): p - r + S - 1 of the S m chunks, against AFAB's or GPipe's of the same
    # chunks (which hold their prefix's keys and values alike: 0.31 and 0.25 at p 2, S 4); against GPipe's whole
    # sequences, the keys and values of its prefix that a chunk's attention saves (a copy) besides: here up to
    # 0.021 of GPipe's (at S 4; 16 tokens), bounded by 0.03.
    for kind, name, split, documents in (v for v in variants if v[0] not in ("vocab", "tied")):  # (--vocab-parallel)
        schedule, *cut = name.split(":")
        s = int(cut[0]) if cut else 1
        held = [(pp - r // (dp * tp) + s - 1) / (s * microbatches) for r in range(world_size)]
        own = (kind, ":".join(["afab" if kind == "manual" else "gpipe", *cut]), split, documents)
        whole = ("library", "gpipe", split, documents)
        if schedule != "1f1b" or own not in variants and not (whole in variants and (
                not cut or kind == "library" and len(cut) == 1)):
            continue
        ratios = [r[kind, name, split, documents]["activations"] / r[own if own in variants else whole]["activations"]
                  for r in ranks]
        if own in variants or not cut:
            assert ratios == pytest.approx(held, abs=0.01), (kind, name, ratios)
        else:
            assert all(h <= ratio < h + 0.03 for h, ratio in zip(held, ratios)), (kind, name, ratios, held)


def test_accumulated_schedule_steps_give_the_unsplit_gradients_and_reduce_scatter_once(accumulated_run):
    # --accumulate 2: an optimizer step's 8 microbatches in 2 schedule steps of 4 are the unsplit model's 8, for
    # every schedule: the gradients, the loss and the evaluation, also with replicas, tp and documents. torch ends
    # each schedule step by reducing and dividing the gradients (perform_reduce_grad); run twice, the first
    # step's would be divided twice (1/16 of them, not 1/8) and FSDP2 would reduce-scatter twice: each FSDP unit
    # of a replica reduce-scatters once, on the replicas' group (model.accumulate_into skips the first step's).
    (pp, dp, tp), variants, (inputs, targets), ranks = accumulated_run
    references = {(layer_count(split), documents): unsplit_step(parity_config(layer_count(split)), inputs, targets,
                                                                dp * ACCUMULATED_MICROBATCHES, documents)
                  for _, _, split, documents in variants}
    for variant in variants:
        loss, expected, _ = references[layer_count(variant[2]), variant[3]]
        assert_unsplit(variant, ranks, loss, expected)
        nccl_rules.check([result[variant]["calls"] for result in ranks])
        for r, result in enumerate(ranks):  # (--vocab-parallel's slices too, each once: DTensor's reduce-scatter)
            reduced = sum(e.get("name", "").startswith("reduce_scatter") and e.get("group") == result[variant][
                "dp_group"] for e in result[variant]["calls"]["events"])
            units = result[variant]["fsdp_units"] + len(result[variant]["slices"])
            assert reduced == (units if dp > 1 else 0), (variant, r, reduced)


ZERO_BUBBLE = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")  # the schedules that split a backward


def test_a_checkpointed_layer_is_recomputed_once_per_microbatch_in_a_split_backward(tmp_path):
    # The zero-bubble schedules split each microbatch's backward into I (the input gradient, one autograd call)
    # and W (one call per group of weights: 9 a layer), and torch.utils.checkpoint alone recomputes a layer once
    # per call: 10 times a microbatch (measured 35.2 s a step against 1F1B's 17.8 s, small, 2 ranks). With
    # model.checkpoint_once I and W share one. Each layer of each rank, split by the library and by the tracer,
    # 2 ranks, 4 stages: its forward and one recomputation per microbatch, and the unsplit model's gradients.
    # Selective checkpointing alike (its kept outputs handed back by the one recomputation), split both ways.
    variants, m = [(kind, name, "full") for kind in ("library", "tracer") for name in ZERO_BUBBLE] + [
        ("library", "interleavedzerobubble", "selective"), ("tracer", "zbvzerobubble", "selective")], 4
    inputs, targets = random_batch(parity_config(4), batch=8)
    run_workers(_recompute_worker, 2, args=(2, str(tmp_path / "store"), str(tmp_path), variants, (inputs, targets),
                                            m))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    _, expected, _ = unsplit_step(parity_config(4), inputs, targets, m)
    for variant in variants:
        assert [runs for rank in ranks for runs in rank[variant]["runs"]] == [2 * m] * 4, variant
        # Each I that its own W follows next on the rank ran as one backward where its gradient stays on the rank
        # (model.merge_backwards), the rest as torch orders them: what plan.py replays (plan.merged).
        torch_order = plan.schedule_orders(variant[1], 2, m, 2)
        rank_of = {s: r for r, acts in torch_order.items() for group in acts for _, s, _ in group}
        for r, rank in enumerate(ranks):
            order = plan.merged(torch_order[r], r, rank_of)
            assert rank[variant]["backwards"] == {k: sorted((s, i) for group in order for kind, s, i in group
                                                            if kind == k) for k in "BIW"}, (variant, r)
        if variant[1] == "zbvzerobubble":  # stage 0's 4 on rank 0; 3 of the V's turn (stage 2 -> 1) on rank 1
            assert [rank[variant]["backwards"]["B"] for rank in ranks] == [[(0, i) for i in range(4)],
                                                                           [(2, i) for i in range(3)]]
        got = {name: g for rank in ranks for name, g in rank[variant]["grads"].items()}
        assert sorted(got) == sorted(expected), variant
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=RTOL, atol=1e-8, msg=f"{variant} {name}")


def test_every_split_and_schedule_completes_under_nccls_rules(parity_run):
    """gloo buffers sends, NCCL does not, and runs a rank's calls on one communicator in the order issued: each
    variant's step and evaluation, replayed under NCCL's rules (nccl_rules.py), completes, with the 2-rank
    communicators torch makes for single sends and with eager ones. The recordings miss no collective (gloo's
    flight recorder saw as many)."""
    (pp, _, _), variants, _, ranks = parity_run
    for variant in variants:
        recordings = [result[variant]["calls"] for result in ranks]
        kinds = collections.Counter(e.get("kind") for recording in recordings for e in recording["events"])
        assert kinds["send"] == kinds["recv"] and (kinds["send"] > 0) == (pp > 1), (variant, kinds)
        if len(recordings) == 1:  # one process: no call at all, nothing to replay (check refuses an empty rank)
            assert not any("op" in e for e in recordings[0]["events"]), variant
            continue
        nccl_rules.check(recordings)
        if variant[0] in ("vocab", "tied"):
            assert_vocab_overlapped(variant, recordings, parity_step((pp, 1, 1))[0])


def assert_vocab_overlapped(variant, recordings: list[dict], microbatches: int) -> None:
    """--vocab-parallel's collectives, as recorded (and replayed above, async ones included: issued, waited later):
    a reduce a rank needs nothing of (the embeddings' onto the first stage, the hidden states' gradient onto the
    last) is left in flight there, waited for only after later calls, and at once where its result is read; in
    1F1B of whole sequences, output pass i (a broadcast from the last stage) runs on a rank d stages before the last
    after its backward i - d: min(k + d, m) passes before the rank receives its k-th gradient (each just before its
    backward k, as it was, would be k + 1), so the passes' collectives overlap other ranks' work, not wait for it."""
    for recording in recordings:
        events = recording["events"]
        group = next(e["group"] for e in events if e.get("name") == "broadcast")  # the pipeline's
        ranks = recording["groups"][group]["ranks"]
        r, last = ranks.index(recording["rank"]), len(ranks) - 1
        for i, e in enumerate(events):
            if e.get("name") == "reduce" and e["group"] == group:
                waited_at_once = e["op"] in events[i + 1].get("wait", [])
                assert waited_at_once == (r == e["root"]), (variant, r, e)  # the destination alone waits at once
                if not waited_at_once:  # a wait for it follows all the same (the next pass, or the step's end)
                    assert any(e["op"] in later.get("wait", []) for later in events[i + 2:]), (variant, r, e)
        if variant[1] == "1f1b" and r < last:
            passes, got = 0, []
            for e in events:
                passes += e.get("name") == "broadcast" and e["root"] == last
                if e.get("kind") == "recv" and e["peer"] == ranks[r + 1]:
                    got.append(passes)
            d = last - r
            assert got == [min(k + d, microbatches) for k in range(microbatches)], (variant, r, got)


class _StepAsItWas(manual.Step):
    """The hand-written pipeline's messages before they kept NCCL's rules: each send and receive on its own (a
    2-rank communicator each pair), the shape sent first and read by the host, every send kept to the end."""

    def message(self, op, tensor, stage, label, hold=False):
        group = self.partition.group
        if op is dist.isend:
            shape = torch.tensor(tensor.shape)
            self.sends += [(dist.isend(t, group=group, group_dst=stage), t) for t in (shape, tensor)]
            return tensor
        dims = torch.empty(len(tensor), dtype=torch.int64)
        dist.recv(dims, group=group, group_src=stage)
        received = torch.empty(dims.tolist(), dtype=self.dtype)
        dist.recv(received, group=group, group_src=stage)
        return received


def _orders_worker(rank, world_size, store_path, out_dir):
    """Recordings of known orders at 2 ranks: two sends that cross (each rank sends, then receives), the same
    two in one batch, a batched send met by a single receive, the hand-written 1F1B as it was and as it is,
    and torch's Schedule1F1B."""
    calls = recorder()
    mesh = start_group(rank, world_size, store_path)
    try:
        peer, results = 1 - rank, {}
        x, y = torch.ones(64), torch.empty(64)
        with calls:
            work = dist.isend(x, peer)
            dist.recv(y, peer)
            work.wait()
        results["crossed"] = calls.recording()
        with calls:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
                work.wait()
        results["batched"] = calls.recording()
        with calls:
            if rank == 0:
                dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])[0].wait()
            else:
                dist.recv(y, peer)
        results["batch against single"] = calls.recording()
        config, (inputs, targets) = parity_config(2), random_batch(parity_config(2))
        for name, step in (("1f1b as it was", _StepAsItWas), ("1f1b", manual.Step)):
            with torch.device("meta"):
                model = LlamaForPretraining(config)
            partition = manual.partition_model(model, rank, world_size, trim=True)
            model.to_empty(device="cpu")
            model.init_weights(11)
            with calls, unittest.mock.patch.object(manual, "Step", step):
                manual.train_step_pipeline_1f1b(partition, inputs.chunk(4), targets.chunk(4),
                                                torch.device("cpu"), torch.float32)
            results[name] = calls.recording()
        _, _, schedule, _ = library_pipeline(config, "1f1b", [rank], even(2, 2), mesh, (2, inputs.shape[1]), 4)
        with calls:
            gpipe.train_step(schedule, inputs if rank == 0 else None, targets if rank == 1 else None,
                             cpu_env(rank, world_size), 1)
        results["torch's 1f1b"] = calls.recording()
        # How many sends a rank keeps at once, over a step of 16 microbatches: its last batch, as it is; every
        # one (two a microbatch: its shape, then the tensor), as it was.
        inputs, targets = random_batch(config, batch=16)
        for name, step in (("held as it was", _StepAsItWas), ("held", manual.Step)):
            most = []
            counted = type("Counted", (step,), {  # after each message, and at the end of the step
                "message": lambda self, *args, **kwargs: (step.message(self, *args, **kwargs),
                                                          most.append(len(self.sends)))[0],
                "finish": lambda self: (most.append(len(self.sends)), step.finish(self))[1]})
            with unittest.mock.patch.object(manual, "Step", counted):
                manual.train_step_pipeline_afab(partition, inputs.chunk(16), targets.chunk(16), torch.device("cpu"),
                                                torch.float32)
            results[name] = max(most, default=0)
        # A send left unwaited across the host's synchronize (model.synchronize: the scripts' step ends), then a
        # collective on another group that the peer needs before it receives; the same across an .item(). (In
        # batches: on the group's own communicator, made at the start, as the hand-written pipeline sends.)
        other, one = dist.new_group([0, 1]), torch.ones(1)
        for name, sync in (("unwaited across a synchronize", lambda: model_module.synchronize(torch.device("cpu"))),
                           ("unwaited across an item", lambda: one.item())):
            with calls:
                if rank == 0:
                    work = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1)])[0]
                    sync()
                    dist.all_reduce(one, group=other)
                    work.wait()
                else:
                    dist.all_reduce(one, group=other)
                    dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, 0)])[0].wait()
            results[name] = calls.recording()
        with calls:  # what a collective's members must agree on: its size, reduce op, root
            dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX)
            dist.broadcast(torch.ones(1024), src=1)
        results["collectives"] = calls.recording()
        with calls:  # a receive from any source (NCCL has none)
            dist.send(x, 1) if rank == 0 else dist.recv(y)
        results["any source"] = calls.recording()
        with calls:  # a DeviceMesh's groups: a blocking call of every rank each (new_group, or NCCL's split_group)
            init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
        results["mesh"] = calls.recording()
        # pytorch #172668: torch's Interleaved1F1B at 2 ranks x 4 stages with each receive moved right before its
        # computation (the order of pytorch PR #172833), run by torch's runtime: on two nodes it hung with rank 0
        # at [... 0SEND_F1, 2RECV_F0, 2F0] and rank 1 at [... 1SEND_F0, 1RECV_F1, 1F1]. Beside it torch 2.13's own.
        config, (inputs, targets) = parity_config(4), random_batch(parity_config(4))
        for name, order in (("pytorch #172668", PR_172833_ORDER), ("torch's interleaved 1f1b", None)):
            _, _, schedule, _ = library_pipeline(config, "interleaved1f1b", [rank, rank + 2], even(4, 4), mesh,
                                                 (2, inputs.shape[1]), 4)
            if order is not None:
                schedule._prepare_schedule_with_comms({r: [_Action.from_str(a) for a in actions.split(", ")]
                                                       for r, actions in order.items()}, format="compute_comms")
            with calls:
                gpipe.train_step(schedule, inputs if rank == 0 else None, targets if rank == 1 else None,
                                 cpu_env(rank, world_size), 1)
            results[name] = calls.recording()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


PR_172833_ORDER = {  # pytorch PR #172833's description: Interleaved1F1B, 2 ranks, 4 microbatches, with its messages
    0: "0UNSHARD, 2UNSHARD, 0F0, 0SEND_F0, 0F1, 0SEND_F1, 2RECV_F0, 2F0, 2SEND_F0, 2RECV_F1, 2F1, 2SEND_F1, 0F2, "
       "0SEND_F2, 2RECV_B0, 2B0, 2SEND_B0, 0F3, 0SEND_F3, 2RECV_B1, 2B1, 2SEND_B1, 2RECV_F2, 2F2, 2SEND_F2, 0RECV_B0, "
       "0B0, 2RECV_F3, 2F3, 2SEND_F3, 0RECV_B1, 0B1, 2RECV_B2, 2B2, 2SEND_B2, 2RECV_B3, 2B3, 2SEND_B3, 2REDUCE_GRAD, "
       "2RESHARD, 0RECV_B2, 0B2, 0RECV_B3, 0B3, 0REDUCE_GRAD, 0RESHARD",
    1: "1UNSHARD, 3UNSHARD, 1RECV_F0, 1F0, 1SEND_F0, 1RECV_F1, 1F1, 1SEND_F1, 3RECV_F0, 3F0, 3B0, 3SEND_B0, 3RECV_F1, "
       "3F1, 3B1, 3SEND_B1, 1RECV_F2, 1F2, 1SEND_F2, 1RECV_B0, 1B0, 1SEND_B0, 1RECV_F3, 1F3, 1SEND_F3, 1RECV_B1, 1B1, "
       "1SEND_B1, 3RECV_F2, 3F2, 3B2, 3SEND_B2, 3RECV_F3, 3F3, 3B3, 3SEND_B3, 3REDUCE_GRAD, 3RESHARD, 1RECV_B2, 1B2, "
       "1SEND_B2, 1RECV_B3, 1B3, 1SEND_B3, 1REDUCE_GRAD, 1RESHARD"}


def test_a_file_of_torchs_own_order_runs_exactly_what_torchs_schedule_runs(tmp_path):
    # --schedule FILE.csv: torch's own multi-stage orders, written as files (schedule_file) and read as the scripts
    # read them, lower on every rank to the very actions torch's schedule class runs in the scripts (its
    # computation, an I and its own W back to back as one B in both, sends and receives, FSDP's unshards and
    # reshards, gradient reductions, in the same order); placeholder stages (the lowering needs only their indices
    # and ranks).
    for name, pp, m in [("interleavedzerobubble", 2, 4), ("zbvzerobubble", 3, 6), ("dualpipev", 2, 4),
                        ("loopedbfs", 3, 6)]:
        path = schedule_file(name, pp, m, tmp_path)
        for rank in range(pp):
            def stages():
                return [types.SimpleNamespace(num_stages=2 * pp, group_size=pp, group_rank=rank, stage_index=s,
                                              is_first=s == 0, is_last=s == 2 * pp - 1, submod=torch.nn.Module())
                        for s in gpipe.stage_ids(name, rank, pp, 2)]
            order = model_module.read_order(str(path), pp, 1, 1, m, None, False)  # dp 1, tp 1, --stages-per-rank
            assert order.per_rank == 2  # (left out: the file's), no --compile
            assert order.stages(rank) == gpipe.stage_ids(name, rank, pp, 2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = model_module.merge_backwards(gpipe.SCHEDULES[name](stages(), n_microbatches=m))
            assert order.schedule(stages(), None).pipeline_order_with_comms == expected.pipeline_order_with_comms, (
                name, rank)


def _forward_only_worker(rank, world_size, store_path, out_dir):
    """The V-shaped schedule's evaluation (the scripts' forward_only: torch's eval() asserts) on 2 pipeline ranks
    x 2 replicas, as the GPipe and the tracer script build it, its messages recorded: torch.distributed's sends and
    receives by themselves, and each batch_isend_irecv's ops as (op, in the pipeline's group?, the peer there)."""
    mesh = start_group(rank, world_size, store_path, 2, 2, 1)
    try:
        sent = []
        for name in ("send", "recv", "batch_isend_irecv"):  # not isend and irecv: P2POp checks they are torch's
            real = getattr(dist, name)
            setattr(dist, name, lambda *a, real=real, name=name, **k: (sent[-1].append(
                name if name != "batch_isend_irecv" else
                [(op.op.__name__, op.group is mesh.get_group("pp"), op.group_peer) for op in a[0]]), real(*a, **k))[1])
        pp_rank, m, config = mesh["pp"].get_local_rank(), 2, parity_config(4)
        inputs, targets = random_batch(config, batch=4, seq=8)
        for build, script in ((library_pipeline, gpipe), (traced_pipeline, tracer)):
            stages = gpipe.stage_ids("zbvzerobubble", pp_rank, 2, 2)
            _, built, schedule, loss_fn = build(config, "zbvzerobubble", stages, even(4, 4), mesh, (2, 8), m)
            sent.append([])
            script.eval_step(schedule, built, inputs if pp_rank == 0 else None, targets if pp_rank == 0 else None,
                             cpu_env(rank, world_size), 1, loss_fn, m, (2, 8, config.hidden_size))
        Path(out_dir, f"{rank}.json").write_text(json.dumps(sent))
    finally:
        dist.destroy_process_group()


def test_the_nccl_rules_replay_finds_crossed_sends_and_passes_torchs_1f1b(tmp_path):
    # The check itself: orders known to hang under NCCL hang in the replay, naming each rank's stuck call, and
    # the ones known to complete complete. Each rank sending before it receives, as the hand-written 1F1B's steady
    # state did (rank 0 sends activations then receives a gradient; rank 1 sends that gradient then receives those
    # activations): under NCCL neither send completes, each waiting for a receive queued behind the other one's
    # send on their one communicator (NVIDIA/nccl #479). In one batch_isend_irecv, as torch's Schedule1F1B sends
    # them (fwd_send_bwd_recv), they start together. A batched send and a single receive use two communicators
    # (the group's, a 2-rank one) under lazy initialization: they never meet.
    run_workers(_orders_worker, 2, args=(2, str(tmp_path / "store"), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    recorded = {name: [rank[name] for rank in ranks] for name in ranks[0]}
    for name in ("crossed", "1f1b as it was"):
        for eager in (False, True):
            with pytest.raises(nccl_rules.Deadlock) as stuck:
                nccl_rules.replay(recorded[name], eager)
            assert "rank 0" in str(stuck.value) and "rank 1" in str(stuck.value), str(stuck.value)
            assert "send to 1 of" in str(stuck.value) and "send to 0 of" in str(stuck.value), str(stuck.value)
    assert "train_pipeline_afab_manual.py" in str(stuck.value)  # where the stuck call was made
    with pytest.raises(nccl_rules.Deadlock, match="communicator's creation"):
        nccl_rules.replay(recorded["batch against single"], eager=False)
    nccl_rules.replay(recorded["batch against single"], eager=True)
    for name in ("batched", "1f1b", "torch's 1f1b", "torch's interleaved 1f1b", "unwaited across an item", "mesh"):
        nccl_rules.check(recorded[name])
    # pytorch #172668: each rank's send waits for a receive the other queued behind its own send.
    for eager in (False, True):
        with pytest.raises(nccl_rules.Deadlock) as stuck:
            nccl_rules.replay(recorded["pytorch #172668"], eager)
        assert re.search(r"rank 0, communicator .*: send to 1 of \d+ bytes", str(stuck.value)), str(stuck.value)
        assert re.search(r"rank 1, communicator .*: send to 0 of \d+ bytes", str(stuck.value)), str(stuck.value)
    # Rule 7: the host waits at a synchronize for every call issued. Rank 0's send, left unwaited across it, needs
    # rank 1's receive, which rank 1 issues after an all-reduce that rank 0 issues after the synchronize. Without
    # the synchronize (as the replay was before it knew of them) it completes; so it does across an .item(),
    # which waits for the current stream alone (the send was not waited for).
    unwaited = recorded["unwaited across a synchronize"]
    assert [[e["sync"] for e in r["events"] if "sync" in e] for r in unwaited] == [["device"], []]
    nccl_rules.check([dict(r, events=[e for e in r["events"] if "sync" not in e]) for r in unwaited])
    for eager in (False, True):
        with pytest.raises(nccl_rules.Deadlock) as stuck:
            nccl_rules.replay(unwaited, eager)
        assert "rank 0, host (main): waits at a device synchronize" in str(stuck.value), str(stuck.value)
        assert "for send to 1 of 256 bytes on group 0 (in a batch)" in str(stuck.value), str(stuck.value)
    assert [[e["sync"] for e in r["events"] if "sync" in e] for r in recorded["unwaited across an item"]] == [
        ["stream"], []]
    # Rule 5: the members of a collective agree on its bytes, reduce op and root, as recorded; any of them
    # changed on one rank is refused, as a receive from any source is.
    collectives = recorded["collectives"]
    assert [(e["name"], e["bytes"], e["reduce"], e["root"]) for e in collectives[1]["events"] if "op" in e] == [
        ("all_reduce", 4, "sum", None), ("all_reduce", 4, "max", None), ("broadcast", 4096, None, 1)]
    for index, key, value, what in ((0, "bytes", 4096, "size"), (1, "reduce", "sum", "reduce op"),
                                    (2, "root", 0, "root")):
        changed = json.loads(json.dumps(collectives))
        [e for e in changed[1]["events"] if "op" in e][index][key] = value
        with pytest.raises(ValueError, match=f"members of a collective differ in {what}: rank 0: "):
            nccl_rules.check(changed)
    with pytest.raises(ValueError, match=r"rank 1: a receive from any source at .*: NCCL has none"):
        nccl_rules.check(recorded["any source"])
    assert [sum(e.get("kind") == "split" for e in r["events"]) for r in recorded["mesh"]] == [2, 2]  # pp's two
    # Rule 1 (no buffering) decides: on gloo every one of them completed, as the recordings show.
    assert all(r["events"] for rank in ranks for r in rank.values() if isinstance(r, dict))
    # A rank keeps its last batch of sends (waited for once the next sends are issued), not the step's 16 outputs (or
    # gradients) and their shapes.
    assert [rank["held"] for rank in ranks] == [1, 1] and all(rank["held as it was"] >= 32 for rank in ranks)


def test_the_v_shaped_evaluation_sends_in_the_pipelines_group_a_batch_of_one_at_a_time(tmp_path):
    # NCCL runs a batch of sends and receives on the group's own communicator, a lone send or receive on one it
    # makes for the pair, and both sides of a message must use the same; on the world group, rather than the
    # pipeline's, each first contact would make a communicator at the first evaluation. Pipeline rank 0 (global
    # ranks 0 and 1, a replica each) holds stages 0 and 3, pipeline rank 1 (global 2 and 3) stages 1 and 2.
    run_workers(_forward_only_worker, 4, args=(4, str(tmp_path / "store"), str(tmp_path)))
    for rank in range(4):
        pp_rank = rank // 2
        first, then = ("isend", "irecv") if pp_rank == 0 else ("irecv", "isend")  # 2 microbatches, down and back
        expected = [[[op, True, 1 - pp_rank]] for op in (first, first, then, then)]
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == [expected, expected], rank  # GPipe's, tracer's


def _norm_reduction_worker(rank, world_size, store_path, out_dir):
    """One step of 4 microbatches of a stage at tp 2, sequence parallel, as the GPipe script runs it, then the
    scripts' clip_grad_norm_ (max_norm 0: nothing clipped): each norm gain's gradient as DTensor sums its partial
    sums, and the numel of every all-reduce the step issued, in order."""
    mesh = start_group(rank, world_size, store_path, 1, 1, 2)
    try:
        config = parity_config(2)
        model, _, schedule, _ = library_pipeline(config, "gpipe", [0], even(2, 1), mesh, (2, 24), 4)
        inputs, targets = random_batch(config, seq=24)  # 48 positions a microbatch: no all-reduce of 32 (hidden)
        with torch.profiler.profile(record_shapes=True) as step:
            gpipe.train_step(schedule, inputs, targets, cpu_env(rank, world_size), 2)
        summed = {n: p.grad.full_tensor() for n, p in model.named_parameters() if "norm" in n}
        with torch.profiler.profile(record_shapes=True) as clipping:
            model_module.clip_grad_norm_(model.parameters(), 0.0, (), 2)
        reduced = [math.prod(e.input_shapes[0]) for p in (step, clipping) for e in p.events()
                   if e.name == "gloo:all_reduce"]
        grads = {n: p.grad.to_local() for n, p in model.named_parameters() if n in summed}
        torch.save({"summed": summed, "grads": grads, "reduced": reduced}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_sums_the_norms_gradients_once_a_step_in_one_all_reduce(tmp_path):
    # With sequence parallelism each rank's norm gains get a partial sum of their gradient (over its positions).
    # They add up over the microbatches as partial sums and clip_grad_norm_ sums them once a step, all 5 (2 layers
    # x 2 norms + the final one) in one all-reduce; summed after each microbatch's backward, that was 5 all-reduces
    # a microbatch, 20 a step. The loss's all-reduces (loss_parallel: per microbatch, of the logits' pieces) and
    # clipping's one of the norm are the others.
    run_workers(_norm_reduction_worker, 2, args=(2, str(tmp_path / "store"), str(tmp_path)))
    hidden, ranks = parity_config(2).hidden_size, [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        sizes = {n: result["reduced"].count(n) for n in set(result["reduced"])}  # numel: how many all-reduces
        assert hidden not in sizes and sizes[5 * hidden] == 1, sizes
        assert sorted(result["grads"]) == sorted(result["summed"]) and len(result["grads"]) == 5
        for name, grad in result["grads"].items():  # the sum DTensor takes, on every rank
            assert torch.equal(grad, result["summed"][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_declared_stage_inputs_and_outputs_are_what_the_stages_compute(one_process_group, dtype):
    # The library script tells each PipelineStage its input and output up front (stage_io); ranks size their
    # receive buffers by it, so a wrong shape or dtype would garble or stall the exchange. Under bf16 what crosses
    # between stages is bf16 (parallelize casts it), what the last stage gives the loss fp32. bf16 autocast on the
    # CPU stands in for the GPU's.
    config, num_stages, shape = small_config(layers=3), 3, (2, 16)
    x = torch.randint(0, config.vocab_size, shape)
    modules = [cpu_stage(config, s, even(3, num_stages)) for s in range(num_stages)]
    model_module.parallelize(modules, init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp")), dtype)
    with gpipe.compute(cpu_env(0, 1, dtype), 1):
        for s, module in enumerate(modules):
            declared = gpipe.stage_io(config, s, num_stages, shape, 1, dtype)
            y = module(x)
            for want, got in ((declared["input_args"], x), (declared["output_args"], y)):
                assert (want.shape, want.dtype) == (got.shape, got.dtype), s
            assert y.dtype == (dtype if s < num_stages - 1 else torch.float32)
            assert y.requires_grad and declared["output_args"].requires_grad
            x = y


# -- The scripts themselves: the same losses at every layout

# layout_runs (conftest.py): 5 steps of every layout in LAYOUT_RUNS, at once, each under benchmark.py
# measure-memory.


def test_loss_trajectory_is_the_same_at_any_layout_and_by_hand(layout_runs):
    runs, tmp_path = layout_runs
    rows = {name: run[0] for name, run in runs.items()}
    for name, (nproc, _, _) in LAYOUT_RUNS.items():
        assert [r["step"] for r in rows[name]] == [1, 2, 3, 4, 5]
        assert len(runs[name][1]["peak_memory_bytes_per_rank"]) == max(nproc, 1)
        # Inductor's kernels round differently, more in torch's CUDA build run on a CPU (1.4e-4 at step 3).
        assert_same_trajectory(rows[name], rows["gpipe1"], name, floor=5e-4 if name == "compiled1" else 0)
    assert rows["gpipe1"][0]["grad_norm"] > 1.0  # clipping was active, so the cross-stage norm was exercised
    # No stage returns a view (the final norm's to_local() at tp x dp is copied): FSDP2 warns of one, since an
    # in-place op on it would drop its backward hook. (pp 2 x dp 2 x tp 2 gave one process's numbers with the view.)
    assert not [name for name, run in runs.items() if "returned a view tensor" in run[4]]
    # Activation checkpointing: the same numbers, bit for bit, and each layer keeps only its input.
    assert [(r["loss"], r["grad_norm"]) for r in rows["checkpointed2"]] == \
        [(r["loss"], r["grad_norm"]) for r in rows["gpipe2"]]
    # (4 layers at --seq-len 32: the balanced split gives the head and the loss a stage of their own, with no
    # layer to checkpoint.)
    held = {name: run[3]["activation_bytes_per_rank"] for name, run in runs.items()}
    assert held["checkpointed2"][0] < held["gpipe2"][0] / 10 and held["checkpointed2"][1] == held["gpipe2"][1]
    # --trace: each rank's torch.profiler trace of the last 3 steps, every forward and backward labelled, from
    # which benchmark.py takes the busy time of each stage: the hand-written script's sends and receives too.
    for trace, ranks in (("afab_trace", 3), ("gpipe_trace", 2)):
        assert sorted(os.listdir(tmp_path / trace)) == [f"rank{r}.json" for r in range(ranks)]
    names = {e["name"] for e in json.loads((tmp_path / "afab_trace" / "rank1.json").read_text())["traceEvents"]
             if e.get("cat") == "user_annotation"}
    assert {f"{kind} {i}" for kind in ("forward", "backward", "send", "recv") for i in range(4)} <= names
    assert len(benchmark.stage_times(str(tmp_path / "gpipe_trace"))) == 2


def test_the_layout_runs_complete_under_nccls_rules(layout_runs):
    # Each layout run of several processes, its script's whole main recorded (under measure-memory) and replayed
    # under NCCL's rules, each step's two synchronizes with it: the tracer's (interleaved 1F1B, 4 stages, dp 2),
    # the hand-written at dp 2 and at tp 2, without sequence parallelism, checkpointed at tp 2 (the recomputed
    # forward issues its collectives again inside the backward), GPipe at dp 2 x tp 2, ...
    _, tmp_path = layout_runs
    for name, (processes, _, _) in LAYOUT_RUNS.items():
        if processes:
            replayed(tmp_path / name / "calls", processes, steps=5)


# document_runs (conftest.py): 5 steps and an evaluation of every run in DOCUMENT_RUNS, on short documents.


def test_documents_kept_apart_train_and_evaluate_alike_at_any_layout(document_runs):
    # --document-masking through the scripts: each rank finds its replica's documents in the batch it reads and
    # every stage of every microbatch gets them, through the zero-bubble schedules' split backward, with replicas,
    # tensor parallelism, activation checkpointing and the evaluation: one process's numbers.
    document_runs, tmp_path = document_runs
    one, causal = document_runs["one"], document_runs["causal"]
    assert [e["step"] for e in one[1]] == [5]
    assert_close_rel(causal[0][0]["loss"], one[0][0]["loss"], 0.1)  # kept apart, the first step already differs:
    assert abs(causal[0][0]["loss"] - one[0][0]["loss"]) > 1e-3 * one[0][0]["loss"]  # the comparisons can fail
    for name in DOCUMENT_RUNS.keys() - {"one", "causal"}:
        rows, evaluations = document_runs[name]
        assert_same_trajectory(rows, one[0], name)
        assert_same_trajectory([{"step": 6, "loss": e["loss"]} for e in evaluations],  # step 6's weights
                               [{"step": 6, "loss": e["loss"]} for e in one[1]], f"{name} evaluation")
        # Each run's whole main, its evaluation included, under NCCL's rules (traced, the V's own forward pass).
        replayed(tmp_path / f"{name}.calls", DOCUMENT_RUNS[name][0], steps=5)


BF16 = ["--precision", "bf16"]
BF16_RUNS = {  # name: (processes (0: plain python), script, extra flags, the fp32 layout run of the same sends)
    "bf16": (0, "train_pipeline_gpipe.py", BF16, None),
    # 2 ranks x 2 stages in a V: the zero-bubble split backward, a stage's output passed on the same rank, and the
    # forward-only evaluation (torch's eval() cannot run it) receiving bf16 too.
    "bf16 pp2 zbv": (2, "train_pipeline_gpipe.py", [*BF16, "--schedule", "zbvzerobubble", "--eval-every", "5"], None),
    "bf16 pp2 x dp2": (4, "train_pipeline_gpipe.py", [*BF16, "--dp", "2", "--seq-chunks", "2"], "gpipe2x2"),  # FSDP:
    # bf16 gathers; each sequence in 2 chunks (the same bytes sent, in twice the messages)
    "bf16 pp2 x tp2": (4, "train_pipeline_gpipe.py", [*BF16, "--tp", "2"], "afab2xtp2"),  # sequence parallel
    "bf16 by hand pp2 x tp2": (4, "train_pipeline_afab_manual.py", [*BF16, "--tp", "2", "--schedule", "1f1b",
                                                                   "--seq-chunks", "2"], "afab2xtp2"),
    "bf16 traced pp2": (2, "train_pipeline_tracer.py", [*BF16, "--eval-every", "5"], "gpipe2"),
    # in 2 chunks a sequence (model.traced_chunk_kv in bf16); its positions and chunk fields travel too, in full
    "bf16 traced pp2 chunks": (2, "train_pipeline_tracer.py", [*BF16, "--schedule", "1f1b", "--seq-chunks", "2"],
                               None),
    # --vocab-parallel: the last stage's hidden states broadcast in bf16 (what the head's matmul takes), the
    # softmax's sums and the gradients summed in fp32
    "bf16 vocab pp3": (3, "train_pipeline_afab_manual.py", [*BF16, "--vocab-parallel", "--schedule", "1f1b",
                                                            "--eval-every", "5"], None),
}


def test_bf16_trains_as_fp32_does_within_bf16s_rounding_at_any_layout(tmp_path, data_dir, layout_runs):
    # --precision bf16, the GPUs' path (autocast; with replicas FSDP gathers bf16 parameters and reduces fp32
    # gradients; weights, AdamW and the loss in fp32; bf16 between stages), run on this CPU, against fp32 on one
    # process (layout_runs' gpipe1, the same 5 steps). Measured, relative, with torch's CPU build: every bf16 run's
    # loss within 2.1e-3 of fp32's and each layout within 2.2e-3 of bf16 on one process, over these 5 steps and
    # over 16 alike (the replicas, whose FSDP sums bf16 products in another order); with torch's CUDA build (what
    # pip installs from PyPI) run on a CPU, whose bf16 kernels round more, 2.2e-2 and 1.1e-2 over 16 steps (the
    # traced stages, which rotate q and k in fp32). Tolerances ~2.5x the worst.
    procs = {name: run_script(nproc, "benchmark.py", "measure-memory", str(tmp_path / f"{name}.json"),
                              str(ROOT / script), *TRAIN_ARGS, *extra, "--data", data_dir, "--metrics",
                              str(tmp_path / f"{name}.jsonl"), "--checkpoint-dir", str(tmp_path / name), cwd=tmp_path,
                              wait=False) for name, (nproc, script, extra, _) in BF16_RUNS.items()}
    rows = {"fp32": layout_runs[0]["gpipe1"][0]}
    for name, proc in procs.items():
        result = finish(proc, timeout=900)  # a hang's limit; all these runs share the CPUs at once
        assert result.returncode == 0, (name, errors(result.stderr))
        assert "cpu bfloat16" in result.stdout, (name, result.stdout)
        rows[name], _ = read_metrics(tmp_path / f"{name}.jsonl")
        assert [r["step"] for r in rows[name]] == [1, 2, 3, 4, 5], name
    for name in BF16_RUNS:
        for got, fp32, bf16 in zip(rows[name], rows["fp32"], rows["bf16"]):
            assert_close_rel(got["loss"], fp32["loss"], 5e-2, what=f"{name} against fp32, step {got['step']}")
            assert_close_rel(got["loss"], bf16["loss"], 3e-2, what=f"{name} against bf16, step {got['step']}")
    assert rows["bf16"] != rows["fp32"]  # bf16 did compute in bf16
    # What crosses between stages is bf16: each rank sends half the bytes of the same layout in fp32.
    for name, (_, _, _, fp32) in BF16_RUNS.items():
        sent = json.loads((tmp_path / f"{name}.json").read_text())["sent_bytes_per_rank"]
        assert min(sent) > 0 or name == "bf16", name
        if fp32:
            assert sent == [b / 2 for b in layout_runs[0][fp32][3]["sent_bytes_per_rank"]], (name, sent)


# -- train_pipeline_afab_manual.py: the pipeline by hand, on our model and on Hugging Face's Llama

def _hf_config(layers=4):
    import transformers
    return transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, pad_token_id=0, attn_implementation="eager")


def _build(kind: str, layers: int):
    """The same full model on every process: ours from (seed, names), HF's from the global seed."""
    if kind == "ours":
        model = LlamaForPretraining(small_config(layers=layers))
        model.init_weights(seed=2)
        return model
    import transformers
    torch.manual_seed(2)
    return transformers.LlamaForCausalLM(_hf_config(layers))


def _batches(seq_len: int, microbatches: int = 6):
    gen = torch.Generator().manual_seed(seq_len)
    inputs = torch.randint(1, 97, (microbatches * 2, seq_len), generator=gen)
    targets = torch.randint(0, 97, (microbatches * 2, seq_len), generator=gen)  # HF: token 0 is the pad id
    targets[0, :3] = -100
    return list(inputs.chunk(microbatches)), list(targets.chunk(microbatches))


@contextlib.contextmanager
def module_calls(model: nn.Module):
    """Every call of every module of model while inside, by module name, in order: its output tensors and the
    gradient each of them receives in backward. How a user checks a pipeline against the model's own forward."""
    calls, handles = {}, []

    def record(name, module, args, output):
        tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output]) if torch.is_tensor(t)]
        call = {"outputs": [t.detach().clone() for t in tensors], "grads": [None] * len(tensors)}
        calls.setdefault(name, []).append(call)
        for k, t in enumerate(tensors):
            if t.requires_grad:
                t.register_hook(functools.partial(lambda call, k, grad: call["grads"].__setitem__(k, grad.clone()),
                                                  call, k))

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(functools.partial(record, name)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _manual_worker(rank, world_size, store_path, out_dir, kinds, layers):
    """The tests of the torch-pipeline-parallelism guide (its "Verification Strategy"), its calls as it writes them,
    on each kind of model (_build), whole on every rank: partition_model for every rank of one model, each
    part's forward_stage on random hidden states; a step of AFAB and of 1F1B on the whole model (and of AFAB on a
    Partition, on shorter sequences), every module's calls recorded; an evaluation; then a user's loop, AdamW over
    model.parameters(). Saves each one's loss, calls, activations held, gradients and the weights that moved."""
    start_group(rank, world_size, store_path)  # rank and world size from torch.distributed: the pipeline
    cpu = torch.device("cpu")
    try:
        results = {}
        for kind in kinds:
            model = _build(kind, layers)
            for r in range(world_size):  # the guide's test_partition_model and test_forward_stage
                partition = manual.partition_model(model, r, world_size)
                assert partition is not None
                assert len(partition.layers) > 0
                output = manual.forward_stage(partition, torch.randn(2, 16, model.config.hidden_size))
                assert output.shape == (2, 16, model.config.hidden_size)
                assert not torch.isnan(output).any()
            runs = {}
            for name, step, seq_len in [("afab", manual.train_step_pipeline_afab, 16),
                                        ("1f1b", manual.train_step_pipeline_1f1b, 16),
                                        ("afab_short", manual.train_step_pipeline_afab, 9)]:
                model.zero_grad(set_to_none=True)
                inputs, targets = _batches(seq_len)
                taken = manual.partition_model(model, rank, world_size) if name == "afab_short" else model
                with benchmark.ActivationMeter() as meter, module_calls(model) as calls:
                    loss = step(taken, inputs, targets, cpu, torch.float32)
                runs[name] = {"loss": loss, "calls": calls, "activation_bytes": meter.peak_bytes, "grads": {
                    n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
            runs["eval"] = manual.eval_step_pipeline(model, *_batches(16), cpu, torch.float32)
            # --document-masking: 1F1B on packed documents (_documents), each microbatch's positions on every rank.
            model.zero_grad(set_to_none=True)
            inputs, targets = _documents()
            loss = manual.train_step_pipeline_1f1b(model, inputs, targets, cpu, torch.float32, positions=[
                model_module.document_positions(x, BOS) for x in inputs])
            runs["documents"] = {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                                         if p.grad is not None}}
            # The guide's multi-rank test: the loss decreases over iterations. AdamW's weight decay would move a
            # weight with a zero gradient too: only those given a gradient here may move.
            initial = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer, losses = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), []
            for _ in range(3):
                optimizer.zero_grad()
                losses.append(manual.train_step_pipeline_afab(model, *_batches(16), cpu, torch.float32))
                optimizer.step()
            runs["trained"] = {"losses": losses, "moved": {n for n, p in model.named_parameters()
                                                           if not torch.equal(p, initial[n])}}
            results[kind] = runs
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _documents():
    """_batches(16) packed with documents: each microbatch's first row holds 3 (from 0, 4 and 10), its second
    the tail of one and another (from 7)."""
    inputs, targets = _batches(16)
    return [documents_batch(x, {0: [0, 4, 10], 1: [7]}) for x in inputs], targets


def _documents_alone(kind: str, layers: int):
    """The reference of a step on _documents: each document run alone through the model's own forward (its
    positions from 0, causal), the logits put back in place: the mean microbatch loss and the gradients."""
    model, losses = _build(kind, layers), []
    inputs, targets = _documents()
    for x, y in zip(inputs, targets):
        rows = []
        for row in x:
            starts = [0, *(i for i in range(1, len(row)) if row[i] == BOS), len(row)]
            pieces = [row[None, a:b] for a, b in zip(starts, starts[1:])]
            rows.append(torch.cat([model(d) if kind == "ours" else model(d).logits for d in pieces], 1))
        loss = plain_loss(torch.cat(rows), y if kind == "ours" else y.masked_fill(y == 0, -100))
        (loss / len(inputs)).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}


def _reference(kind: str, layers: int, seq_len: int):
    """The whole model on one process, the same microbatches one after another through its own forward: the
    mean loss, the gradients, and every module's calls (module_calls)."""
    model = _build(kind, layers)
    inputs, targets = _batches(seq_len)
    losses = []
    with module_calls(model) as calls:
        for x, y in zip(inputs, targets):
            logits = model(x) if kind == "ours" else model(x).logits
            if kind == "hf":
                y = y.masked_fill(y == 0, -100)  # the pad id is ignored like -100
            loss = plain_loss(logits, y)
            (loss / len(inputs)).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_guides_calls_of_the_manual_pipeline_run_every_module_as_the_models_own_forward(tmp_path, world_size):
    """Called as the guide calls them, on a whole model (ours, and transformers' LlamaForCausalLM as a user's) on
    every rank, the hand-written AFAB and 1F1B run each of its modules once a microbatch, the head on the whole
    microbatch, with the outputs and output gradients of its own forward on one process; the parameters'
    gradients, the loss and the evaluated loss are the same too. Each rank's gradients, and AdamW's updates in a
    loop of steps, touch only its part of the model, and the loss decreases."""
    pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    layers, kinds, m = 4, ("ours", "hf"), 6  # 4 layers on 3 stages: 2, 1, 1
    run_workers(_manual_worker, world_size, args=(world_size, str(tmp_path / "store"), str(tmp_path), kinds,
                                                  layers))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    for kind in kinds:
        loss, grads, calls = _reference(kind, layers, 16)
        assert_close_rel(results[-1][kind]["afab"]["loss"].item(), loss.item(), what=f"{kind} loss")
        assert_close_rel(results[-1][kind]["eval"].item(), loss.item(), what=f"{kind} evaluated loss")
        assert_close_rel(results[-1][kind]["afab_short"]["loss"].item(), _reference(kind, layers, 9)[0].item(),
                         what="seq 9")
        trained = results[-1][kind]["trained"]["losses"]
        assert trained[0] > trained[1] > trained[2], (kind, trained)
        # Packed documents kept apart (--document-masking): the hand-written pipeline takes each microbatch's
        # positions, and computes what each document computes alone, Hugging Face's model too (its position_ids
        # per document, and a 4-D mask).
        alone, alone_grads = _documents_alone(kind, layers)
        assert_close_rel(results[-1][kind]["documents"]["loss"].item(), alone.item(), what=f"{kind} documents")
        got = {n: g for result in results for n, g in result[kind]["documents"]["grads"].items()}
        assert sorted(got) == sorted(alone_grads), kind
        for name, grad in alone_grads.items():
            torch.testing.assert_close(got[name], grad, rtol=RTOL, atol=1e-6, msg=f"{kind} documents {name}")
        # The whole model's root and decoder stack are containers the stages do not call; every other module
        # runs on the stage that holds it (the rotary embedding of transformers' Llama: on every stage).
        containers = {"", "base_model", "model"}
        ran, computed = set(), []
        for rank, result in enumerate(results):
            for schedule in ("afab", "1f1b"):
                for name, got in result[kind][schedule]["calls"].items():
                    if name in containers:
                        continue
                    ran.add(name)
                    want = calls[name]
                    assert len(got) == len(want) == m, (kind, schedule, rank, name, len(got))
                    for i, (g, w) in enumerate(zip(got, want)):
                        for a, b in zip(g["outputs"], w["outputs"], strict=True):
                            torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5, msg=f"{kind} {name} out {i}")
                        for a, b in zip(g["grads"], w["grads"], strict=True):
                            assert (a is None) == (b is None), (kind, name, i)
                            if b is not None:  # relative to the gradient's scale: a microbatch's is ~1e-3
                                torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5 * b.abs().max().item(),
                                                           msg=f"{kind} {schedule} {name} grad {i}")
            afab, one_f_one_b = result[kind]["afab"], result[kind]["1f1b"]
            if rank != world_size - 1:
                assert afab["loss"] is None and result[kind]["eval"] is None
                assert result[kind]["trained"]["losses"] == [None] * 3
            for name, grad in afab["grads"].items():
                torch.testing.assert_close(grad, grads[name], rtol=RTOL, atol=1e-6, msg=f"{kind} {name}")
                assert torch.equal(one_f_one_b["grads"][name], grad), f"1F1B differs from AFAB: {name}"
            assert afab["grads"].keys() == one_f_one_b["grads"].keys() == result[kind]["trained"]["moved"], rank
            computed += afab["grads"]
            # AFAB holds every microbatch's activations at its peak; 1F1B at most world_size - rank of them.
            ratio = one_f_one_b["activation_bytes"] / afab["activation_bytes"]
            assert abs(ratio - (world_size - rank) / m) < 0.02, (rank, ratio)  # (p - r) / m, as README says
        assert ran == set(calls) - containers, (kind, set(calls) - containers - ran)
        assert sorted(computed) == sorted(grads), kind  # each parameter's gradient on one rank, its stage's


# -- train_pipeline_tracer.py: the split made by pipeline() and SplitPoint

def meta_model(config) -> LlamaForPretraining:
    with torch.device("meta"):
        return LlamaForPretraining(config)


def test_traced_stages_hold_exactly_what_the_hand_split_holds():
    assert tracer.split_spec(even(4, 3)) == {"base_model.layers.2": SplitPoint.BEGINNING,
                                             "base_model.layers.3": SplitPoint.BEGINNING}
    assert tracer.split_spec(even(4, 1)) == {}  # one process: no split point, one stage
    # A first stage of the embedding alone: a cut before layer 0; a last one of the norm and the head alone: a cut
    # before the norm.
    assert tracer.split_spec(model_module.from_sizes([0, 2, 2, 0])) == {
        "base_model.layers.0": SplitPoint.BEGINNING, "base_model.layers.2": SplitPoint.BEGINNING,
        "base_model.norm": SplitPoint.BEGINNING}
    config = small_config(layers=4)
    example = torch.zeros(2, 8, dtype=torch.long, device="meta")
    for layout in [*(even(4, n) for n in range(1, 5)),
                   *(model_module.from_sizes(s) for s in ([0, 4], [4, 0], [0, 4, 0], [0, 1, 3, 0]))]:
        pipe = tracer.traced_pipeline(meta_model(config), example, tracer.split_spec(layout))
        assert pipe.num_stages == len(layout)
        for stage in range(len(layout)):
            hand = gpipe.stage_module(config, stage, layout)  # on meta: the names are what is compared
            traced = pipe.get_stage_module(stage)
            assert {name for name, _ in [*traced.named_parameters(), *traced.named_buffers()]} == \
                {name for name, _ in [*hand.named_parameters(), *hand.named_buffers()]}, (layout, stage)


def test_bf16_autocast_runs_the_traced_stages_in_bf16(one_process_group, monkeypatch):
    config = small_config(layers=4)
    _, pipe = cpu_traced(config, [0, 1], even(4, 2), (2, 16), 3)
    stages = [tracer.pipeline_stage(pipe, s, torch.device("cpu"), None, torch.float32).submod for s in range(2)]
    eager = LlamaForPretraining(config)
    eager.init_weights(seed=3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 97, (2, 16), generator=gen), torch.randint(0, 97, (2, 16), generator=gen)

    def run(forward, autocast):
        for module in (eager, *stages):
            module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = forward(x)
            plain_loss(logits, y).backward()
        grads = {n: p.grad for m in (eager, *stages) for n, p in m.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    traced = lambda tokens: stages[1].lm_head(stages[1](stages[0](tokens)))  # noqa: E731
    fp32_logits, fp32_grads = run(eager, autocast=False)
    traced_fp32, traced_fp32_grads = run(traced, autocast=False)
    assert torch.equal(traced_fp32, fp32_logits)  # without autocast: bit for bit the eager model
    for name in fp32_grads:
        assert torch.equal(traced_fp32_grads[name], fp32_grads[name]), name

    eager_bf16, _ = run(eager, autocast=True)
    traced_bf16, traced_bf16_grads = run(traced, autocast=True)
    assert traced_bf16.dtype == eager_bf16.dtype == torch.bfloat16  # autocast applies to the graph's ops
    # Not bit for bit the eager bf16 model: tracing froze `q.dtype` (fp32 then) into the RoPE tables' cast, so
    # the traced stages rotate q and k in fp32 where eager bf16 rotates in bf16. Just as close to fp32, though.
    assert not torch.equal(traced_bf16, eager_bf16)
    eager_error = (eager_bf16.float() - fp32_logits).abs().max()
    assert (traced_bf16.float() - fp32_logits).abs().max() <= 1.5 * eager_error
    # ... and exactly eager bf16 with the RoPE tables kept in fp32: that cast is the only difference.
    original = model_module.rope_tables
    monkeypatch.setattr(model_module, "rope_tables", lambda inv_freq, seq_len, dtype, positions=None: original(
        inv_freq, seq_len, torch.float32, positions))
    eager_fp32_rope, eager_fp32_rope_grads = run(eager, autocast=True)
    assert torch.equal(traced_bf16, eager_fp32_rope)
    for name in eager_fp32_rope_grads:
        assert torch.equal(traced_bf16_grads[name], eager_fp32_rope_grads[name]), name


def test_weights_shared_across_stages_are_refused():
    # pipeline() itself accepts tied weights split over two stages and gives each stage a copy of its own.
    example = torch.zeros(2, 8, dtype=torch.long, device="meta")
    tied = meta_model(small_config())
    tied.lm_head.weight = tied.base_model.embed_tokens.weight
    with pytest.raises(RuntimeError, match=r"base_model.embed_tokens.weight is held as 3 tensors by stages "
                                           r"\[0, 1\] \(tied\?\)"):
        tracer.traced_pipeline(tied, example, tracer.split_spec(even(4, 2)))
    tied = meta_model(small_config())  # a fresh model: pipeline() patched the split points into the last one
    tied.lm_head.weight = tied.base_model.embed_tokens.weight
    pipe = tracer.traced_pipeline(tied, example, tracer.split_spec(even(4, 1)))  # on one stage the tie survives
    assert "base_model.embed_tokens.weight" in dict(pipe.get_stage_module(0).named_parameters())


def test_traced_stage_only_takes_the_traced_microbatch_shape(one_process_group):
    _, pipe = cpu_traced(small_config(layers=2), [0], even(2, 1), (2, 16))
    module = tracer.pipeline_stage(pipe, 0, torch.device("cpu"), None, torch.float32).submod
    assert module(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 32)  # hidden states: the loss has the head
    with pytest.raises(RuntimeError):
        module(torch.zeros(2, 24, dtype=torch.long))  # a longer sequence: the trace baked in 16


def test_losses_equal_gpipe_script_and_checkpoints_cross_over(tmp_path, data_dir):
    args = [*TRAIN_ARGS, "--steps", "8", "--checkpoint-every", "4", "--data", data_dir, "--metrics", "m.jsonl"]
    # The tracer's balanced split: [embed + layers 0-1] [layers 2-3] [norm + head]; the GPipe script's 2 x 2 layers.
    fresh = {"tracer3": (3, "train_pipeline_tracer.py", []),
             "gpipe2": (2, "train_pipeline_gpipe.py", ["--split", "2,2"])}
    procs = {}
    for name, (nproc, script, extra) in fresh.items():
        (tmp_path / name).mkdir()
        procs[name] = run_script(nproc, script, *args, *extra, cwd=tmp_path / name, wait=False)
    rows = {}
    for name, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, errors(result.stderr)
        rows[name], _ = read_metrics(tmp_path / name / "m.jsonl")
        assert [r["step"] for r in rows[name]] == list(range(1, 9))
        if name == "tracer3":  # the one-time cost, reported for every rank
            assert re.search(r"traced and built the stages in [\d.]+, [\d.]+, [\d.]+ s", result.stdout), result.stdout
    reference = rows["gpipe2"]
    assert_same_trajectory(rows["tracer3"], reference, "tracer3")

    # Both scripts save the same keys (model and flattened AdamW state under full-model names, no RoPE buffers).
    def saved_keys(run):
        return set(FileSystemReader(str(tmp_path / run / "checkpoints" / "step-00000004")).read_metadata()
                   .state_dict_metadata)
    assert saved_keys("tracer3") == saved_keys("gpipe2")

    # Tracer (3 stages, the last without layers) -> GPipe script (2 stages of 2 layers), and GPipe script -> tracer,
    # which then runs on 2 stages: [embed + layers 0-3] [norm + head].
    crossings = {"to_gpipe": ("tracer3", 2, "train_pipeline_gpipe.py", ["--split", "2,2"]),
                 "to_tracer": ("gpipe2", 2, "train_pipeline_tracer.py", [])}
    for name, (source, nproc, script, extra) in crossings.items():
        shutil.copytree(tmp_path / source / "checkpoints" / "step-00000004",
                        tmp_path / name / "checkpoints" / "step-00000004")
        procs[name] = run_script(nproc, script, *args, *extra, cwd=tmp_path / name, wait=False)
    for name in crossings:
        result = finish(procs[name])
        assert result.returncode == 0, errors(result.stderr)
        assert "resumed from checkpoints/step-00000004 at step 4" in result.stdout, result.stdout
        resumed, _ = read_metrics(tmp_path / name / "m.jsonl")
        assert [r["step"] for r in resumed] == [5, 6, 7, 8]
        assert_same_trajectory(resumed, reference[4:], name, since=4)


# ----------------------------------------------------------------------------------------------------------
# 4. Checkpoints and runs: exact resume after SIGKILL, reshard, restarts, damaged input, one run per directory

def test_readme_command_trains_saves_and_resumes(tmp_path, data_dir):
    # The README's main command, shortened: loss must fall, a checkpoint must appear, a rerun must resume.
    shutil.copytree(data_dir, tmp_path / "data")  # where `python prepare_data.py` puts it: read by default
    args = ["--steps", "12", "--warmup-steps", "3", "--metrics", "m.jsonl"]
    result = launch(3, "train_pipeline_gpipe.py", *args, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert "done: 12 steps" in result.stdout
    layout = re.search(r"prints its layout \(`([^`]+)`", " ".join((ROOT / "README.md").read_text().split()))[1]
    assert layout in result.stdout, (layout, result.stdout[-3000:])  # as the README quotes it
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
    # By default it evaluates at the end (and every 100 steps), on 4 held-out batches; the last line says the last
    # step's loss and the held-out one.
    (held_out,) = evaluations(tmp_path / "m.jsonl")
    assert held_out["step"] == 12 and held_out["batches"] == 4 and f"eval at step 12: loss {held_out['loss']:.4f}" \
        in result.stdout
    assert f"done: 12 steps, loss {rows[-1]['loss']:.4f} (held-out {held_out['loss']:.4f} at step 12), median step " \
        in result.stdout, result.stdout
    assert (tmp_path / "checkpoints" / "step-00000012" / "meta.json").is_file()

    # The same command again: the run is done, nothing is trained and the metrics file keeps its summary.
    written = (tmp_path / "m.jsonl").read_text()
    result = launch(3, "train_pipeline_gpipe.py", *args, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert "checkpoints/step-00000012 is step 12: --steps 12 are done, nothing to train" in result.stdout
    assert (tmp_path / "m.jsonl").read_text() == written
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000012"]  # lock released


def test_the_last_line_says_the_last_loss_and_the_last_held_out_one_also_after_resuming(tmp_path):
    # checkpoint.Metrics keeps them for the scripts' done line; resumed, from the rows the file keeps.
    path = metrics_file(tmp_path / "m.jsonl", 6, evaluated=(4, 6))
    resumed = checkpoint.Metrics(str(path), 5)  # steps 1-5 and the evaluation at 4 kept
    assert resumed.final_losses() == "loss 7.7500 (held-out 8.5000 at step 4)"
    resumed.write({"step": 6, "loss": 7.0})
    assert resumed.final_losses() == "loss 7.0000 (held-out 8.5000 at step 4)"
    resumed.write({"eval": {"step": 6, "loss": 8.0}})
    assert resumed.final_losses() == "loss 7.0000 (held-out 8.0000 at step 6)"
    unwritten = checkpoint.Metrics(None, 0)  # no --metrics: the line still says them
    unwritten.write({"step": 1, "loss": 9.0})
    assert unwritten.final_losses() == "loss 9.0000"


def complete_and_partial(checkpoint_dir: Path):
    names = sorted(p.name for p in checkpoint_dir.glob("step-*")) if checkpoint_dir.is_dir() else []
    return [n for n in names if not n.endswith(".tmp")], [n for n in names if n.endswith(".tmp")]


def kill_during_a_save(args: list, cwd: Path) -> int:
    """Run train_pipeline_gpipe.py on 4 processes and kill the whole job at once while a save is in progress
    and an earlier checkpoint is complete; returns the step of that complete one. The test process competes for
    the CPU with the job, so a kill may land just after a save finished: then the same command (which resumes)
    is started again and killed again, a few times at most."""
    ckpt = cwd / "checkpoints"
    for _ in range(4):
        proc = run_script(4, "train_pipeline_gpipe.py", *args, cwd=cwd, wait=False)
        while proc.poll() is None:
            complete, partial = complete_and_partial(ckpt)
            if complete and partial:
                kill_job(proc)
                break
            time.sleep(0.001)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be interrupted"
        complete, partial = complete_and_partial(ckpt)
        if partial:
            return int(complete[-1].split("-")[1])
    pytest.fail("no kill landed inside a save")


def test_sigkill_during_a_save_then_rerun_gives_bit_identical_losses(tmp_path, data_dir, reference_run):
    args = [*RESUME_ARGS, "--dp", "2", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--data",
            data_dir, "--metrics", "m.jsonl"]
    ckpt = tmp_path / "checkpoints"
    killed_at = kill_during_a_save(args, tmp_path)
    assert killed_at < 16

    result = run_script(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path)  # the same command again
    assert result.returncode == 0, errors(result.stderr)
    assert f"resumed from checkpoints/step-{killed_at:08d} at step {killed_at}" in result.stdout
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    _, reference = reference_run
    assert [r["step"] for r in rows] == list(range(1, 17))  # no step repeated or skipped
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]  # bit for bit
    assert [r["lr"] for r in rows] == [r["lr"] for r in reference]
    assert complete_and_partial(ckpt) == (["step-00000015", "step-00000016"], [])  # keep-K, no leftovers


# A training script run with the write of one checkpoint held: the write of the save named by HOLD_SAVE (the end of
# its path) waits while the file HOLD_FILE exists. So a background save is in flight as long as a test needs, and
# the product holds no hook for it.
HOLD_A_WRITE = """
import os, runpy, sys, time
from torch.distributed.checkpoint import filesystem

write_data = filesystem._FileSystemWriter.write_data


def held(self, *args, **kwargs):
    while str(self.path).endswith(os.environ["HOLD_SAVE"]) and os.path.exists(os.environ["HOLD_FILE"]):
        time.sleep(0.05)
    return write_data(self, *args, **kwargs)


filesystem._FileSystemWriter.write_data = held
sys.argv.pop(0)  # then the training script, with its arguments, as python runs it
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def holding(tmp_path: Path, save: str) -> tuple[str, dict, Path]:
    """The command's first words that run a training script with the write of save (step-N.tmp) held, their
    environment, and the file whose removal lets the write go on."""
    (tmp_path / "hold_a_write.py").write_text(HOLD_A_WRITE)
    (tmp_path / "held").touch()
    return str(tmp_path / "hold_a_write.py"), dict(HOLD_SAVE=save, HOLD_FILE=str(tmp_path / "held")), tmp_path / "held"


def metrics_rows(path: Path) -> int:
    return lines_of(path).count('"step"')


def test_training_goes_on_while_an_async_save_is_written_and_a_kill_then_resumes_the_one_before(tmp_path, data_dir,
                                                                                             reference_run):
    # --async-checkpoint, 2 stages x 2 replicas under torchrun: step 8's checkpoint is written in the background and
    # its write is held; training goes on, steps 9 to 12, and at step 12 the next save waits for it (one in flight
    # at most). A SIGKILL of the whole job then: step-00000008.tmp has no meta.json, step 4 is the newest complete
    # checkpoint, and the same command resumes it: every loss bit for bit the reference run's (which saved in the
    # background too).
    args = [*RESUME_ARGS, "--dp", "2", "--checkpoint-every", "4", "--async-checkpoint", "--data", data_dir,
            "--metrics", "m.jsonl"]
    wrapper, env, _ = holding(tmp_path, "step-00000008.tmp")
    proc = launch(4, wrapper, ROOT / "train_pipeline_gpipe.py", *args, cwd=tmp_path, env={**script_env(), **env},
                  wait=False)
    try:
        wait_for("step 12", lambda: metrics_rows(tmp_path / "m.jsonl") >= 12, proc, seconds=180)
        time.sleep(1)  # every rank at step 12's save, waiting: nothing changes any more
        assert metrics_rows(tmp_path / "m.jsonl") == 12
        assert complete_and_partial(tmp_path / "checkpoints") == (["step-00000004"], ["step-00000008.tmp"])
        assert not (tmp_path / "checkpoints" / "step-00000008.tmp" / "meta.json").exists()
    finally:
        ranks = descendants(proc.pid)
        kill_job(proc)
        proc.communicate()
    deadline = time.monotonic() + 30  # a killed rank holds the run lock until the SIGKILL takes effect (a zombie: not)
    while any(map(running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    result = run_script(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path)  # the same command
    assert result.returncode == 0, errors(result.stderr)
    assert "resumed from checkpoints/step-00000004 at step 4" in result.stdout, result.stdout
    assert "saved checkpoints/step-00000008" in result.stdout and "saved checkpoints/step-00000016" in result.stdout
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in reference_run[1]]
    assert complete_and_partial(tmp_path / "checkpoints") == (["step-00000008", "step-00000012", "step-00000016"], [])


def test_a_stop_during_an_async_save_waits_for_it_then_saves_its_step(tmp_path, data_dir, reference_run):
    # run.sh, 2 stages x 2 replicas, --async-checkpoint: step 4's write held, and a SIGTERM to every process (as
    # SLURM sends it) a step later. The job stops after its step, waits for the save in flight (still waiting
    # seconds later, its step-00000004.tmp incomplete) and, once the write goes on, completes it, saves the step it
    # stopped after, and exits 0. The same command then continues: every loss the reference run's, bit for bit.
    args = [*RESUME_ARGS, "--dp", "2", "--checkpoint-every", "4", "--async-checkpoint", "--data", data_dir,
            "--metrics", "m.jsonl"]
    wrapper, env, hold = holding(tmp_path, "step-00000004.tmp")
    proc = run_sh(wrapper, ROOT / "train_pipeline_gpipe.py", *args, cwd=tmp_path, wait=False, log=tmp_path / "job",
                  NPROC_PER_NODE=4, **env)
    try:
        wait_for("step 5", lambda: metrics_rows(tmp_path / "m.jsonl") >= 5, proc)
        for pid in [proc.pid, *descendants(proc.pid)]:
            os.kill(pid, signal.SIGTERM)
        rows, quiet = metrics_rows(tmp_path / "m.jsonl"), time.monotonic()
        while time.monotonic() - quiet < 3:  # until the job waits: no step for 3 s
            time.sleep(0.2)
            if rows != (rows := metrics_rows(tmp_path / "m.jsonl")):
                quiet = time.monotonic()
        assert proc.poll() is None and complete_and_partial(tmp_path / "checkpoints") == ([], ["step-00000004.tmp"])
        hold.unlink()
        result = finish(proc)
    finally:
        kill_job(proc)
    assert result.returncode == 0, errors(result.stderr)
    stopped = re.search(r"^stopped by SIGTERM after step (\d+), saved in checkpoints/step-(\d+); the same command "
                        r"continues the run$", result.stdout, re.M)
    # The step it stopped after is the last one trained (on a loaded machine, one may have taken longer than 3 s).
    trained = read_metrics(tmp_path / "m.jsonl")[0][-1]["step"]
    assert stopped and int(stopped[1]) == int(stopped[2]) == trained >= rows, result.stdout
    rows = int(stopped[1])
    assert "saved checkpoints/step-00000004\n" in result.stdout
    saved = ["step-00000004", *(["step-00000008"] if rows > 8 else []), f"step-{rows:08d}"]
    assert complete_and_partial(tmp_path / "checkpoints") == (saved, [])
    result = run_script(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path)  # the same command
    assert result.returncode == 0 and f"resumed from checkpoints/step-{rows:08d}" in result.stdout, result.stderr
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in reference_run[1]]


def test_whole_runs_complete_under_nccls_rules(tmp_path, data_dir, reference_run):
    # Every call of torch.distributed of whole runs, replayed under NCCL's rules (nccl_rules.py; each schedule's
    # step and evaluation: test_every_split_and_schedule_completes_under_nccls_rules). The reference run: 2 stages x
    # 2 replicas (FSDP2), 16 steps, saves written in the background on their own gloo group by another thread.
    replayed(reference_run[0] / "calls", 4, steps=16)
    # The V-shaped zero bubble at 2 stages x tp 2 (sequence parallel) on packed documents, evaluated (the
    # script's own forward pass), saved in the background; the hand-written 1F1B at 4 stages asked to stop as it
    # starts (every rank agrees on the step to stop after, and saves it); the hand-written 1F1B at 2 stages x 2
    # replicas, each step in 2 schedule steps (--accumulate), evaluated.
    (tmp_path / "stop").write_text("SIGTERM")
    os.utime(tmp_path / "stop", (time.time() + 60,) * 2)  # newer than the ranks: made as they start (not a leftover)
    runs = {"zbv": run_script(4, *recorded(tmp_path / "zbv", "train_pipeline_gpipe.py"), *TRAIN_ARGS, "--steps", "2",
                              "--schedule", "zbvzerobubble", "--tp", "2", "--document-masking", "--eval-every", "2",
                              "--eval-batches", "1", "--async-checkpoint", "--checkpoint-every", "1", "--data",
                              data_dir, "--checkpoint-dir", "zbv-checkpoints", cwd=tmp_path, wait=False),
            "stop": run_script(4, *recorded(tmp_path / "stop-calls", "train_pipeline_afab_manual.py"), *TRAIN_ARGS,
                               "--schedule", "1f1b", "--data", data_dir, "--checkpoint-dir", "stop-checkpoints",
                               cwd=tmp_path, wait=False, env=dict(script_env(),
                                                                  PIPELINE_STOP_FILE=str(tmp_path / "stop"))),
            "by hand x dp 2": run_script(4, *recorded(tmp_path / "dp-calls", "train_pipeline_afab_manual.py"),
                                         *TRAIN_ARGS, "--steps", "2", "--schedule", "1f1b", "--dp", "2",
                                         "--accumulate", "2", "--microbatches", "2", "--eval-every", "1",
                                         "--eval-batches", "1", "--data", data_dir, "--checkpoint-dir",
                                         "dp-checkpoints", "--metrics", "dp.jsonl", cwd=tmp_path, wait=False)}
    runs = {name: finish(run) for name, run in runs.items()}  # all three at once
    for name, result in runs.items():
        assert result.returncode == 0, (name, errors(result.stderr))
    assert "stopped by SIGTERM after step 1" in runs["stop"].stdout, runs["stop"].stdout
    assert [r["eval"]["step"] for r in map(json.loads, (tmp_path / "dp.jsonl").read_text().splitlines())
            if "eval" in r] == [1, 2]
    for calls, processes, steps in (("zbv", 4, 2), ("stop-calls", 4, 1), ("dp-calls", 4, 2)):
        replayed(tmp_path / calls, processes, steps)


def test_resume_on_fewer_stages_continues_the_same_run(tmp_path, data_dir, reference_run, capsys):
    reference_dir, reference = reference_run
    # The reference ran 2 stages x 2 replicas, its tensors sharded by FSDP, the head on a stage of its own
    # (balanced: [embed + layers 0-3] [norm + head]). Resumed: 2 stages of 2 layers, no replicas, in the
    # hand-written script (checkpoints are shared by all scripts); 1 process; 1 stage x 2 replicas; 2 processes
    # holding 2 stages each in a V, split by the library and by the tracer (the rank's stages share one set of
    # full-model names; rank 0 holds both the embedding and the head, the tracer's rank 0 nothing else); the
    # tracer's stages running each sequence in 2 chunks (Seq1F1B), from a checkpoint of whole sequences, its layers
    # checkpointed (a recomputed chunk keeps no keys twice), in 2 accumulated schedule steps, evaluated in chunks.
    variants = {"manual2": (2, "train_pipeline_afab_manual.py", ["--split", "2,2"]),
                # each sequence in 4 chunks (Seq1F1B): a checkpoint holds no chunk count, a run resumes with another
                "manual2_seq1f1b": (2, "train_pipeline_afab_manual.py", ["--schedule", "1f1b", "--seq-chunks", "4"]),
                "one": (0, "train_pipeline_gpipe.py", ["--precision", "fp32"]),  # auto is fp32 on a CPU too
                "replicas2": (2, "train_pipeline_gpipe.py", ["--dp", "2"]),
                "zbv2": (2, "train_pipeline_gpipe.py", ["--schedule", "zbvzerobubble"]),
                "traced_dualpipev2": (2, "train_pipeline_tracer.py", ["--schedule", "dualpipev", "--split", "0,2,2,0"]),
                "traced_seq1f1b2": (2, "train_pipeline_tracer.py", ["--schedule", "1f1b", "--seq-chunks", "2",
                                                                    "--activation-checkpointing", "--accumulate", "2",
                                                                    "--microbatches", "2", "--eval-every", "4",
                                                                    "--trace", "trace"])}
    resumed = resumed_from_step_8(tmp_path, data_dir, reference_dir, variants)
    for name, (result, rows) in resumed.items():
        assert "(saved by 4 process(es))" in result.stdout
        assert ("; --precision auto → fp32 (free to change" in result.stdout) == (name == "one"), result.stdout
        assert_same_trajectory(rows, reference[8:], name, since=8)
    chunked = resumed["traced_seq1f1b2"][0].stdout  # evaluated in chunks too
    assert "1f1b, 2 x 2 microbatches an optimizer step, each sequence in 2 chunks" in chunked
    assert "eval at step 12: loss" in chunked and "eval at step 16: loss" in chunked
    for rank in (0, 1):  # --trace in chunks: each rank's profile of the last steps, its run described
        trace = json.loads((tmp_path / "traced_seq1f1b2" / "trace" / f"rank{rank}.json").read_text())
        assert trace["run"]["seq_chunks"] == 2 and any(e.get("ph") == "X" for e in trace["traceEvents"]), rank
    assert "traced with --seq-chunks 2, whose microbatches are chunks" in refused(  # a time there is a chunk's
        capsys, plan.main, "--processes", "2", "--layers", "4", "--trace", str(tmp_path / "traced_seq1f1b2" / "trace"))


def resumed_from_step_8(tmp_path, data_dir, reference_dir, variants: dict) -> dict:
    """Each variant {name: (processes, script, flags)} resumed from a copy of the reference run's step 8 to its
    step 16, all at once: {name: (its CompletedProcess, its metrics rows)}, each checked to have run steps 9-16."""
    procs, done = {}, {}
    for name, (nproc, script, extra) in variants.items():
        run_dir = tmp_path / name
        shutil.copytree(reference_dir / "checkpoints" / "step-00000008", run_dir / "checkpoints" / "step-00000008")
        procs[name] = run_script(nproc, script, *RESUME_ARGS, *extra, "--data", data_dir,
                                 "--metrics", "m.jsonl", cwd=run_dir, wait=False)
    for name, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, (name, errors(result.stderr))
        rows, _ = read_metrics(tmp_path / name / "m.jsonl")
        assert [r["step"] for r in rows] == list(range(9, 17)), name
        done[name] = result, rows
    return done


def test_a_schedule_file_resumes_a_named_schedules_run_and_back_and_evaluates(tmp_path, data_dir, reference_run):
    # Checkpoints hold no schedule: the reference's step 8 (GPipe, 2 stages x 2 replicas) resumed under orders
    # from files (--schedule FILE.csv): torch's zero-bubble V (I, W) on 2 processes, ZB-H1 on 1 (every stage on
    # it); beside them torch's looped interleaved 1F1B on 1 process, evaluated every 4 steps as the V is (both
    # forward only: a rank holding two stages in a row; torch 2.13's eval() asserted there). Then the V's step 12
    # resumed under a schedule by name in the tracer script: each continues the reference's trajectory.
    reference_dir, reference = reference_run
    zbv, zbh1 = schedule_file("zbvzerobubble", 2, 4, tmp_path), schedule_file("zbh1", 1, 4, tmp_path)
    variants = {"zbv_file": (2, "train_pipeline_gpipe.py", ["--schedule", zbv, "--checkpoint-every", "4",
                                                            "--eval-every", "4", "--eval-batches", "1"]),
                "zbh1_file_one": (0, "train_pipeline_tracer.py", ["--schedule", zbh1]),
                "interleaved_one": (0, "train_pipeline_gpipe.py", ["--schedule", "interleaved1f1b", "--eval-every",
                                                                   "4", "--eval-batches", "1"])}
    runs = resumed_from_step_8(tmp_path, data_dir, reference_dir, variants)
    for name, (result, rows) in runs.items():
        assert_same_trajectory(rows, reference[8:], name, since=8)
    held_out = {name: [float(loss) for loss in re.findall(r"^eval at step (?:12|16): loss ([\d.]+)",
                                                           runs[name][0].stdout, re.M)]
                for name in ("zbv_file", "interleaved_one")}
    assert len(held_out["zbv_file"]) == 2 and held_out["zbv_file"] == pytest.approx(held_out["interleaved_one"],
                                                                                   rel=1e-3), held_out  # 4 decimals
    back = tmp_path / "back"
    shutil.copytree(tmp_path / "zbv_file" / "checkpoints" / "step-00000012", back / "checkpoints" / "step-00000012")
    result = run_script(2, "train_pipeline_tracer.py", *RESUME_ARGS, "--schedule", "interleavedzerobubble",
                        "--data", data_dir, "--metrics", "m.jsonl", cwd=back)
    assert result.returncode == 0 and "resumed from checkpoints/step-00000012" in result.stdout, errors(result.stderr)
    rows, _ = read_metrics(back / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(13, 17))
    assert_same_trajectory(rows, reference[12:], "back to a named schedule", since=8)


def test_every_layerless_layout_resumes_in_every_script(tmp_path, data_dir, reference_run):
    # A stage of the embedding alone has no norm gains: its AdamW had an empty group, whose state torch 2.13 could
    # not load (IndexError in set_optimizer_state_dict), so such a run never resumed. Each script resumes the
    # reference's step 8 with the first stage layerless, the last, both, and the first at --dp 2.
    reference_dir, reference = reference_run
    layouts = {"first": (2, ["--split", "0,4"]), "last": (2, ["--split", "4,0"]), "both": (3, ["--split", "0,4,0"])}
    variants = {f"{script}_{where}": (nproc, f"train_pipeline_{script}.py", extra)
                for script in ("gpipe", "afab_manual", "tracer") for where, (nproc, extra) in layouts.items()}
    variants["gpipe_first_dp2"] = (4, "train_pipeline_gpipe.py", ["--split", "0,4", "--dp", "2"])
    # And with --accumulate: each optimizer step's batch of 8 (the reference's 4 microbatches a replica, in one
    # schedule step) in 2 or 4 schedule steps, from the same checkpoint (it holds no microbatch count). (The traced
    # stages run the library's train_step: accumulated_run checks them.)
    accumulated = {"gpipe_accumulate": (4, "train_pipeline_gpipe.py", ["--dp", "2", "--accumulate", "2"]),
                   "afab_manual_accumulate": (2, "train_pipeline_afab_manual.py", ["--schedule", "1f1b",
                                                                                   "--accumulate", "4"])}
    variants |= {name: (nproc, script, [*extra, "--microbatches", "2", "--eval-every", "4"])  # (evaluated in parts)
                 for name, (nproc, script, extra) in accumulated.items()}
    for name, (result, rows) in resumed_from_step_8(tmp_path, data_dir, reference_dir, variants).items():
        assert "resumed from" in result.stdout, name
        if name in accumulated:  # said where the layout is; evaluated a schedule step's microbatches at a time
            assert f"{accumulated[name][2][-1]} x 2 microbatches an optimizer step" in result.stdout, name
            assert "eval at step 12: loss" in result.stdout and "eval at step 16: loss" in result.stdout, name
        assert_same_trajectory(rows, reference[8:], name, since=8)


def test_a_run_in_sequence_chunks_resumes_without_them_and_continues_the_whole_sequences_run(tmp_path, data_dir,
                                                                                              reference_run):
    # Checkpoints hold no chunk count (--seq-chunks): the reference's step 8 (whole sequences, GPipe, 2 x 2) resumed
    # with each sequence in 2 chunks under Seq1F1B's 1F1B order, checkpointed layers, in 2 accumulated schedule
    # steps, evaluated in chunks every 4 steps, its calls recorded (replayed under NCCL's rules, the whole run); its
    # step 12 resumed on one process without chunks. Both continue the uninterrupted run without chunks (the
    # reference) within fp32 drift.
    reference_dir, reference = reference_run
    chunked = tmp_path / "chunks2"
    shutil.copytree(reference_dir / "checkpoints" / "step-00000008", chunked / "checkpoints" / "step-00000008")
    result = run_script(2, *recorded(chunked / "calls", "train_pipeline_gpipe.py"), *RESUME_ARGS, "--schedule", "1f1b",
                        "--seq-chunks", "2", "--accumulate", "2", "--microbatches", "2", "--activation-checkpointing",
                        "--checkpoint-every", "4", "--eval-every", "4", "--data", data_dir, "--metrics", "m.jsonl",
                        cwd=chunked)
    assert result.returncode == 0, errors(result.stderr)
    rows, _ = read_metrics(chunked / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(9, 17))
    replayed(chunked / "calls", 2, steps=8)
    assert "1f1b, 2 x 2 microbatches an optimizer step, each sequence in 2 chunks" in result.stdout
    assert "eval at step 12: loss" in result.stdout and "eval at step 16: loss" in result.stdout
    assert_same_trajectory(rows, reference[8:], "in 2 chunks", since=8)
    back = tmp_path / "back"
    shutil.copytree(chunked / "checkpoints" / "step-00000012", back / "checkpoints" / "step-00000012")
    result = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir, "--metrics", "m.jsonl",
                        cwd=back)
    assert result.returncode == 0 and "resumed from checkpoints/step-00000012" in result.stdout, errors(result.stderr)
    rows, _ = read_metrics(back / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(13, 17))
    assert_same_trajectory(rows, reference[12:], "back to whole sequences", since=8)


def test_vocab_parallel_resumes_without_it_on_other_layouts_and_back_and_exports_the_whole_matrices(tmp_path,
                                                                                                   data_dir,
                                                                                                   reference_run):
    # --vocab-parallel's checkpoints hold the whole embedding and head (each rank saves its rows of a DTensor): the
    # reference's step 4 (GPipe, 2 x 2, no vocabulary split) resumed by hand with it on 3 ranks (1F1B, evaluated
    # every 4 steps, its calls recorded: the whole run under NCCL's rules); its step 8 with it on 2 stages x 2
    # replicas (the slices sharded over them too, their gradients reduce-scattered), in 2 accumulated schedule
    # steps; that run's step 12 on 2 ranks without it. Each continues the reference within fp32 drift; exported,
    # the matrices are whole.
    reference_dir, reference = reference_run
    runs = [("vocab3", 3, reference_dir, 4, ["--vocab-parallel", "--schedule", "1f1b", "--eval-every", "4"]),
            ("vocab2x2", 4, tmp_path / "vocab3", 8, ["--vocab-parallel", "--dp", "2", "--accumulate", "2",
                                                     "--microbatches", "2"]),
            ("plain2", 2, tmp_path / "vocab2x2", 12, [])]
    for name, nproc, source, step, flags in runs:
        start = f"step-{step:08d}"
        shutil.copytree(source / "checkpoints" / start, tmp_path / name / "checkpoints" / start)
        result = run_script(nproc, *recorded(tmp_path / name / "calls", "train_pipeline_afab_manual.py"),
                            *RESUME_ARGS, *flags, "--checkpoint-every", "4", "--keep-checkpoints", "4", "--data",
                            data_dir, "--metrics", "m.jsonl", cwd=tmp_path / name)
        assert result.returncode == 0, (name, errors(result.stderr))
        assert f"resumed from checkpoints/{start}" in result.stdout, (name, result.stdout)
        rows, _ = read_metrics(tmp_path / name / "m.jsonl")
        assert [r["step"] for r in rows] == list(range(step + 1, 17)), name
        assert_same_trajectory(rows, reference[step:], name, since=step)
        replayed(tmp_path / name / "calls", nproc, steps=16 - step)
        if flags:  # the layout line says where the vocabulary went: 8192 rows in 2731, 2731, 2730 (or halves)
            assert ("vocab 2731-5461 (" if nproc == 3 else "vocab 4096-8191 (") in result.stdout, result.stdout
        if name == "vocab3":
            assert "eval at step 8: loss" in result.stdout and "eval at step 16: loss" in result.stdout
    # At 2 x 2 each rank saved a quarter of the head, and of its AdamW state: what it held (2048 of the 8192 rows).
    index = FileSystemReader(str(tmp_path / "vocab2x2" / "checkpoints" / "step-00000012")).read_metadata()
    for key in ("model.lm_head.weight", "optim.state.lm_head.weight.exp_avg", "optim.state.lm_head.weight.exp_avg_sq"):
        chunks = sorted((c.offsets[0], c.sizes[0]) for c in index.state_dict_metadata[key].chunks)
        assert chunks == [(i * 2048, 2048) for i in range(4)], (key, chunks)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    result = run_script(0, "export.py", tmp_path / "vocab3" / "checkpoints", tmp_path / "vocab.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    exported = torch.load(tmp_path / "vocab.pt", weights_only=True)
    dcp_to_torch_save(str(tmp_path / "vocab3" / "checkpoints" / "step-00000016"), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=False)["model"]  # our own file, written just above
    dcp_to_torch_save(str(reference_dir / "checkpoints" / "step-00000016"), str(tmp_path / "reference.pt"))
    expected = torch.load(tmp_path / "reference.pt", weights_only=False)["model"]
    assert sorted(exported) == sorted(everything) == sorted(expected)
    for name, tensor in exported.items():
        assert torch.equal(tensor, everything[name]) and tensor.shape == expected[name].shape, name
    LlamaForPretraining(LlamaConfig(**json.loads((tmp_path / "vocab.pt.config.json").read_text()))).load_state_dict(
        exported, strict=True)


def test_tensor_parallel_resumes_exactly_on_any_layout_and_exports_the_whole_model(tmp_path, data_dir,
                                                                                   reference_run):
    reference_dir, reference = reference_run
    # 2 stages x 2 tensor-parallel ranks, killed while it saves step 8 (or a later one), then the same command.
    args = [*RESUME_ARGS, "--tp", "2", "--checkpoint-every", "4", "--keep-checkpoints", "4", "--data", data_dir,
            "--metrics", "m.jsonl"]
    ckpt = tmp_path / "checkpoints"
    killed_at = kill_during_a_save(args, tmp_path)
    first_attempt, _ = read_metrics(tmp_path / "m.jsonl")
    result = run_script(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert f"resumed from checkpoints/step-{killed_at:08d} at step {killed_at}" in result.stdout
    assert "2 pipeline x 1 data x 2 tensor" in result.stdout
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    # Exact: the steps trained again after the resume are bit for bit those of the killed attempt ...
    again = [r["step"] for r in first_attempt if r["step"] > killed_at]
    assert again, "the killed attempt logged no step after its last checkpoint"
    assert [r["loss"] for r in rows if r["step"] in again] == [r["loss"] for r in first_attempt if r["step"] in again]
    # ... and every step is the run of any other layout (the reference: 2 stages x 2 replicas).
    assert_same_trajectory(rows, reference, "tp")

    # Its step-8 checkpoint (written with sequence parallelism, the default) continues on 1 process, on 2 stages
    # x 2 replicas, and at tp 2 without sequence parallelism, as the run itself did; and the reverse: the 2 x 2
    # reference's (no tensor parallelism) continues at tp 2 with it, as the reference did.
    procs = {}
    for name, nproc, extra, source in (("one", 0, [], ckpt), ("replicas2", 4, ["--dp", "2"], ckpt),
                                       ("tp2 no sp", 4, ["--tp", "2", "--no-sequence-parallel"], ckpt),
                                       ("2x2 to tp2 sp", 4, ["--tp", "2"], reference_dir / "checkpoints")):
        shutil.copytree(source / "step-00000008", tmp_path / name / "checkpoints" / "step-00000008")
        procs[name] = run_script(nproc, "train_pipeline_gpipe.py", *RESUME_ARGS, *extra, "--data", data_dir,
                                 "--metrics", "m.jsonl", cwd=tmp_path / name, wait=False)
    for name, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, (name, errors(result.stderr))
        resumed, _ = read_metrics(tmp_path / name / "m.jsonl")
        assert [r["step"] for r in resumed] == list(range(9, 17))
        assert_same_trajectory(resumed, (reference if name.startswith("2x2") else rows)[8:], name, since=8)

    # Exported, it is the whole model: the library's own converter of the checkpoint gives the same tensors,
    # full-sized, and the Hugging Face export holds the same. They are the reference run's after 16 steps to
    # 2e-2 of each tensor's norm: AdamW divides each gradient by its own running size, so the embedding rows of
    # rare tokens, whose gradients are sums that nearly cancel, move by rounding-sized differences times lr
    # (measured: up to 1.25e-3, the embedding, in a fresh clone; 1e-3 failed there). A tensor-parallel shard
    # put in the wrong place, or one rank's shard taken for the whole, is ~1 off.
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for output, given in (("tp.pt", []), ("tp-hf", ["--format", "hf"])):
        result = run_script(0, "export.py", ckpt, output, *given, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    exported = torch.load(tmp_path / "tp.pt", weights_only=True)
    dcp_to_torch_save(str(ckpt / "step-00000016"), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=False)["model"]  # our own file, written just above
    dcp_to_torch_save(str(reference_dir / "checkpoints" / "step-00000016"), str(tmp_path / "reference.pt"))
    expected = torch.load(tmp_path / "reference.pt", weights_only=False)["model"]
    hf = {k: v for file in (tmp_path / "tp-hf").glob("*.safetensors") for k, v in load_file(file).items()}
    assert sorted(exported) == sorted(everything) == sorted(expected)
    for name, tensor in exported.items():
        assert torch.equal(tensor, everything[name]), name
        assert ((tensor - expected[name]).norm() / expected[name].norm()).item() < 2e-2, name
        assert torch.equal(hf[model_module.hf_name(name)].float(), tensor), name


def test_bf16_resumes_exactly_after_sigkill_and_exports_fp32_weights_that_transformers_loads(tmp_path, data_dir):
    # 2 stages x 2 replicas in bf16 (FSDP's bf16 gathers), killed while it saves, then the same command: the steps
    # trained again are bit for bit the killed attempt's. The checkpoint holds the fp32 master weights, which the
    # Hugging Face export writes and transformers loads.
    import transformers
    args = [*RESUME_ARGS, *BF16, "--dp", "2", "--checkpoint-every", "4", "--keep-checkpoints", "4", "--data",
            data_dir, "--metrics", "m.jsonl"]
    killed_at = kill_during_a_save(args, tmp_path)
    first_attempt, _ = read_metrics(tmp_path / "m.jsonl")
    result = run_script(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert f"resumed from checkpoints/step-{killed_at:08d} at step {killed_at}" in result.stdout
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    again = [r["step"] for r in first_attempt if r["step"] > killed_at]
    assert again, "the killed attempt logged no step after its last checkpoint"
    assert [r["loss"] for r in rows if r["step"] in again] == [r["loss"] for r in first_attempt if r["step"] in again]
    result = run_script(0, "export.py", "checkpoints", "hf", "--format", "hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(p.dtype == torch.float32 for p in exported.parameters())
    tokens = torch.randint(0, exported.config.vocab_size, (1, 16))
    assert torch.isfinite(exported(tokens).logits).all()


def lines_of(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def evaluations(path: Path) -> list[dict]:
    return [row["eval"] for row in map(json.loads, path.read_text().splitlines()) if "eval" in row]


def test_sigterm_stops_after_the_step_saves_it_and_the_same_command_continues_exactly(tmp_path, data_dir):
    # A preempted job, as SLURM stops it (sbatch --signal=TERM@..., scancel): a SIGTERM to every process of the
    # job, run.sh, torchrun and each training process, which also gets run.sh's copy within milliseconds: one
    # request, said once. The processes finish their step, every rank the same one, save it, and run.sh exits 0
    # with one line naming the checkpoint (one rank prints the loop's lines, whole). The same command then
    # continues: the losses and evaluations (one a step; the stop came before its step's, done on resuming) of a
    # run never stopped, bit for bit.
    args = [*TRAIN_ARGS, "--steps", "30", "--eval-every", "1", "--eval-batches", "1", "--data", data_dir,
            "--metrics", "m.jsonl"]
    (tmp_path / "stopped").mkdir()
    reference = run_script(2, "train_pipeline_gpipe.py", *args, cwd=(tmp_path / "reference").mkdir() or
                           tmp_path / "reference", wait=False)
    proc = run_sh(SCRIPT, *args, cwd=tmp_path / "stopped", wait=False, NPROC_PER_NODE=2)
    # 3 steps' rows ({"step": ...}; an evaluation's row, {"eval": {"step": ...}}, is no step: counted, the stop
    # came after 2 steps in CI)
    while proc.poll() is None and lines_of(tmp_path / "stopped" / "m.jsonl").count('{"step"') < 3:
        time.sleep(0.05)
    for pid in [proc.pid, *descendants(proc.pid)]:
        os.kill(pid, signal.SIGTERM)
    result = finish(proc)
    assert result.returncode == 0, errors(result.stderr)
    stopped = re.search(r"^stopped by SIGTERM after step (\d+), saved in checkpoints/step-(\d+); the same command "
                        r"continues the run$", result.stdout, re.M)
    assert stopped and stopped[1] == str(int(stopped[2])), result.stdout
    step = int(stopped[1])
    assert result.stderr.count("SIGTERM: stopping after this step, with a checkpoint; again to stop at once") == 1
    rows, _ = read_metrics(tmp_path / "stopped" / "m.jsonl")
    assert 3 <= step < 30 and [r["step"] for r in rows] == list(range(1, step + 1))
    assert [e["step"] for e in evaluations(tmp_path / "stopped" / "m.jsonl")] == list(range(1, step))
    assert complete_and_partial(tmp_path / "stopped" / "checkpoints") == ([f"step-{step:08d}"], [])
    result = run_script(2, "train_pipeline_gpipe.py", *args, cwd=tmp_path / "stopped")  # the same command
    assert result.returncode == 0 and f"resumed from checkpoints/step-{step:08d}" in result.stdout, result.stderr
    assert finish(reference).returncode == 0
    rows, expected = read_metrics(tmp_path / "stopped" / "m.jsonl")[0], read_metrics(tmp_path / "reference" /
                                                                                        "m.jsonl")[0]
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in expected]
    assert evaluations(tmp_path / "stopped" / "m.jsonl") == evaluations(tmp_path / "reference" / "m.jsonl")


def test_a_stop_asked_while_the_job_starts_stops_it_after_its_first_step(tmp_path, data_dir):
    # A SIGTERM to run.sh while the training processes import torch, before they listen (killed, torchrun would
    # fail the job or, with MAX_RESTARTS, restart them to train on), or before torchrun has started them: run.sh
    # records the request, and they read it (and say it) when they start. The job stops after its first step,
    # with its checkpoint, status 0.
    proc = run_sh(SCRIPT, *TRAIN_ARGS, "--steps", "20", "--data", data_dir, cwd=tmp_path, wait=False,
                  log=tmp_path / "job", NPROC_PER_NODE=2)
    wait_for("the training processes", lambda: len(descendants(proc.pid)) == 3, proc)  # torchrun's 2
    proc.send_signal(signal.SIGTERM)
    result = finish(proc)
    assert result.returncode == 0, errors(result.stderr)
    assert "stopped by SIGTERM after step 1, saved in checkpoints/step-00000001" in result.stdout, result.stdout
    assert result.stderr.count("SIGTERM: stopping after this step, with a checkpoint; again to stop at once") == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]  # lock released


def _started_just_now(rank: int, forked_at: float) -> None:
    """In a process forked from the server after forked_at: its start, read from /proc, is just now (btime is
    whole: up to 1 s early; the start in clock ticks)."""
    assert forked_at - 1.02 < checkpoint._started_at.__wrapped__() <= time.time()


def launcher_of_this_process() -> str:
    """The pid of the process that started this one's parent: where run.sh stands to a training process."""
    return Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[1]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="a process's start and parent are read in /proc")
def test_a_stop_file_of_another_run_is_no_request_and_a_status_file_of_another_launch_is_left_alone(
        tmp_path, monkeypatch):
    # A PIPELINE_STOP_FILE is run.sh's record of a request ("SIGNAL RUN_SH_PID"): its own launch's is kept however
    # old (made before torchrun started, or restarted, the process), another one only if made since the process
    # started; older, it is left over from another run. In this process, as a rank reads it when it starts.
    stop, launcher = tmp_path / "stop", launcher_of_this_process()
    monkeypatch.setenv("PIPELINE_STOP_FILE", str(stop))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = checkpoint._started_at() - 5
    assert before + 5 < checkpoint._IMPORTED  # read (this process started before it imported checkpoint) ...
    run_workers(_started_just_now, 1, (time.time(),))  # ... and read right: of a process of known age, not this one
    for text, made, kept in [("SIGTERM", before, False), (f"SIGTERM {int(launcher) + 1}", before, False),
                             (f"SIGTERM {launcher}", before, True), ("SIGINT", time.time(), True)]:
        monkeypatch.setattr(checkpoint, "_STOP", {"signal": None, "at": None, "said": False})
        stop.write_text(text + "\n")
        os.utime(stop, (made, made))
        checkpoint._launcher_request()
        assert checkpoint._STOP["signal"] == (text.split()[0] if kept else None), text
    # RUN_SH_STATUS_FILE: run.sh's pid, then the status of a mistake that every process found. A process of another
    # launch that inherited the variable (its launcher's parent another) writes nothing there, and fails as itself.
    status = tmp_path / "status"
    monkeypatch.setenv("RUN_SH_STATUS_FILE", str(status))
    assert checkpoint.final_status(2) == 2 and not status.exists()  # its run.sh is gone
    status.write_text(f"{int(launcher) + 1}\n")
    assert checkpoint.final_status(2) == 2 and status.read_text() == f"{int(launcher) + 1}\n"
    status.write_text(f"{launcher}\n")
    assert checkpoint.final_status(2) == 0 and checkpoint.final_status(1) == 0  # every rank writes it
    assert status.read_text() == f"{launcher}\n1\n"


def test_a_closed_terminal_stops_the_job_after_its_step_and_saves_it(tmp_path, data_dir):
    # run.sh in a terminal that closes (a dropped ssh): SIGHUP to its process group (run.sh and torchrun), and
    # every write to the terminal fails from then on. The job stops as for a SIGTERM: the step saved, the run
    # lock released, status 0.
    master, terminal = os.openpty()
    proc = subprocess.Popen([RUN_SH, SCRIPT, *TRAIN_ARGS, "--steps", "100", "--data", data_dir, "--metrics",
                             "m.jsonl"], cwd=tmp_path, env=launcher_env(NPROC_PER_NODE=2), stdin=terminal,
                            stdout=terminal, stderr=terminal, start_new_session=True)
    os.close(terminal)
    try:
        while lines_of(tmp_path / "m.jsonl").count('"step"') < 2:
            assert proc.poll() is None
            while select.select([master], [], [], 0.05)[0]:  # read what the job writes, so it never blocks
                os.read(master, 1 << 16)
        os.close(master)  # the terminal is gone
        os.killpg(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=240) == 0
    finally:
        kill_job(proc)
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    assert 2 <= len(rows) < 100 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{len(rows):08d}"]


def _hung_up_worker(rank, world_size, store_path):
    start_group(rank, world_size, store_path)
    if rank == 0:  # heard the SIGHUP
        checkpoint._STOP.update(signal="SIGHUP", at=time.time())
    else:  # its output a closed terminal, and its own watcher has not run yet (it is starved, under load)
        master, terminal = os.openpty()
        os.dup2(terminal, 1)
        os.close(master)
    assert checkpoint.stop_requested() == "SIGHUP"
    print("saved step 2", flush=True)  # what the last stage writes after the stop's save


def test_a_rank_that_hears_of_a_sighup_from_another_no_longer_writes_to_its_closed_terminal(tmp_path):
    # Seen in CI: the test above ended with status 1, a rank dead writing "saved" to the closed terminal.
    run_workers(_hung_up_worker, 2, args=(2, str(tmp_path / "store")))


def local_rank(pid: int) -> int:
    """A torchrun process's LOCAL_RANK, read from /proc."""
    variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in variables if v.startswith(b"LOCAL_RANK="))[len("LOCAL_RANK="):])


def running(pid: int) -> bool:
    """Not ended (a process that ended and was not waited for yet is a zombie: state Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_signal_to_any_rank_is_said_once_and_again_ends_a_rank_waiting_for_a_hung_peer_at_once(tmp_path,
                                                                                                   data_dir):
    # The case where users press Ctrl-C twice: a peer hangs (SIGSTOP, during a save), and the other ranks wait
    # for it inside a collective, where Python runs no signal handler before gloo gives up (--timeout). A SIGINT
    # to the last stage, not local rank 0, is said there at once, once; again more than 2 s later, it ends that
    # rank within seconds, with one line (not a failed save's "free space"). Then Ctrl-C twice at run.sh (its
    # process group): the job ends at once with one line, status 130, no process left.
    args = [*TRAIN_ARGS, "--steps", "1000", "--checkpoint-every", "1", "--timeout", "300", "--data", data_dir]
    proc = run_sh(SCRIPT, *args, cwd=tmp_path, wait=False, log=tmp_path / "job", NPROC_PER_NODE=3)
    try:
        wait_for("a save", lambda: complete_and_partial(tmp_path / "checkpoints")[1], proc)
        ranks = sorted(worker_pids(worker_pids(proc.pid)[0]), key=local_rank)
        # run.sh's NCCL watchdog ends a rank past --timeout without aborting its communicators (torchrun's 1 would)
        assert b"TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
        os.kill(ranks[1], signal.SIGSTOP)  # the middle stage hangs, inside the save or just after it
        os.kill(ranks[2], signal.SIGINT)
        wait_for("the acknowledgement", lambda: "SIGINT: stopping after this step" in lines_of(tmp_path / "job.err"),
                 proc, seconds=30)
        time.sleep(2.5)
        asked = time.monotonic()
        os.kill(ranks[2], signal.SIGINT)
        while running(ranks[2]) and time.monotonic() - asked < 30:
            time.sleep(0.01)
        rank_took = time.monotonic() - asked
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2.5)
        asked = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        result = finish(proc, timeout=30)
        job_took = time.monotonic() - asked
    finally:
        kill_job(proc)
    assert rank_took < 10 and job_took < 10, (rank_took, job_took)  # seconds; measured 0.01-0.12, 0.12-0.17
    assert result.returncode == 128 + signal.SIGINT, errors(result.stderr)
    assert result.stderr.count("SIGINT: stopping after this step, with a checkpoint; again to stop at once") == 1
    assert result.stderr.count("\nSIGINT again: stopped at once, without saving this step") == 1  # the rank's
    assert result.stderr.count("\nrun.sh: SIGINT again: stopped at once, without saving this step") == 1
    assert "free space" not in result.stderr and "Traceback" not in result.stderr, errors(result.stderr)
    deadline = time.monotonic() + 10  # a SIGKILL takes effect a moment after kill() returns
    while any(map(running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, ranks))


def test_every_script_stops_on_sigterm_after_its_step_and_saves_it(tmp_path, data_dir):
    # The other two scripts alone on one process, SIGTERM to the process itself (as SLURM gives each task): the
    # step it stopped after saved, exit 0.
    procs = {}
    for script in ("train_pipeline_afab_manual.py", "train_pipeline_tracer.py"):
        (tmp_path / script).mkdir()
        procs[script] = launch(0, script, *TRAIN_ARGS, "--steps", "100000", "--data", data_dir, "--metrics",
                               "m.jsonl", "--checkpoint-dir", "ckpt", cwd=tmp_path / script, wait=False)
    for script, proc in procs.items():
        while proc.poll() is None and lines_of(tmp_path / script / "m.jsonl").count('"step"') < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        result = finish(proc)
        assert result.returncode == 0, (script, errors(result.stderr))
        step = int(re.search(r"^stopped by SIGTERM after step (\d+)", result.stdout, re.M)[1])
        assert complete_and_partial(tmp_path / script / "ckpt")[0][-1] == f"step-{step:08d}", script


def fake_checkpoint(directory: Path, step: int, world_size: int, dp: int, tp: int, layers: int = 4,
                    job: tuple = ("job7",), **args) -> Path:
    """A checkpoint's meta.json alone, as the job of launch ids job (a torchrun job: its run id) saved it on
    world_size processes at dp x tp (and args): what relayout and --fresh read."""
    path = directory / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "config": dataclasses.asdict(small_config(layers=layers)),
                                                "files": {}, "world_size": world_size,
                                                "args": {"dp": dp, "tp": tp, **args}, "job": list(job)}))
    return path


@pytest.mark.parametrize("saved, processes, flags, layout", [
    ((4, 2, 1), 2, [], (2, 1)),  # a node of 2 lost: the pipeline kept, one replica
    ((2, 1, 1), 4, [], (2, 2)),  # it came back: two replicas again
    ((4, 2, 1), 3, [], (3, 1)),  # 3 processes cannot hold 2 stages x any replicas: 3 stages
    ((8, 2, 2), 4, [], (2, 1)),  # tp kept
    ((4, 1, 1), 4, [], None),  # the same number of processes: the flags as given
    ((4, 2, 1), 3, ["--split", "2,2"], (3, 1, "balanced")),  # 2 counts for 3 stages: balanced, and said
    ((3, 1, 1), 4, ["--dp", "2", "--split", "2,2"], (2, 2, "2,2")),  # 2 stages again: the counts fit again
    ((4, 2, 1), 2, ["--split", "1,3"], (2, 1, "1,3")),  # the pipeline kept, and its --split
    ((4, 2, 1), 2, ["--schedule", "zbvzerobubble"], (2, 1)),  # V-shaped: 2 stages per rank
    # 3 processes, 2 stages each: 6 stages of 4 layers, both ends layerless (model.max_stages), as the scripts run
    ((4, 1, 1), 3, ["--schedule", "interleaved1f1b", "--batch-size", "12", "--microbatches", "2"], (3, 1)),
])
def test_a_restarted_run_takes_the_layout_that_fits_the_processes_left(tmp_path, saved, processes, flags, layout):
    world, dp, tp = saved
    path = fake_checkpoint(tmp_path / "ckpt", 8, world, dp, tp)
    args = gpipe.build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "ckpt"), "--dp", str(dp), "--tp",
                                            str(tp), "--batch-size", "8", "--microbatches", "4", *flags])
    per_rank = 1 if args.schedule in gpipe.SINGLE_STAGE else 2
    said, given = [], (args.dp, args.split)

    def say(line: str, flush: bool) -> None:
        said.append(line)

    def relayout(job: list[str]) -> tuple[int, str]:  # as a rank of the job of launch ids job
        return checkpoint.Run(args, 0, processes, say, job).relayout(per_rank)
    for job in [], ["job8"], ["job8", "job9"]:  # plain python; other jobs: their flags as given
        assert relayout(job) == given and not said
    new = relayout(["job1", "job7"])  # this job, a new node
    if layout is None:
        assert new == given and not said
        return
    pp, new_dp, split = (*layout, args.split)[:3]
    assert new == (new_dp, split) and processes == pp * new_dp * tp
    note = f" (--split {args.split} is for 2 stages: balanced)" if split != args.split else ""
    assert said == [f"{world} processes -> {processes}: pp {world // (dp * tp)} x dp {dp} x tp {tp} -> pp {pp} x dp "
                    f"{new_dp} x tp {tp}{note}; resuming {path} at step 8"]


@pytest.mark.parametrize("schedule, per_rank", [("zbvzerobubble", 2), ("interleaved1f1b", 2), ("gpipe", 1)])
def test_a_restart_that_no_layout_fits_is_one_line_naming_the_counts_that_would(tmp_path, schedule, per_rank):
    # Grown from 2 to 4 processes: 2 replicas would need 16 sequences, pp 4 8 stages (V-shaped, looped) on 4 layers,
    # 2 more than layerless ends allow. On 3 processes, 6 stages: the 4 layers and both ends layerless.
    fake_checkpoint(tmp_path / "ckpt", 8, 2, 1, 1)
    args = gpipe.build_parser().parse_args(["--checkpoint-dir", str(tmp_path / "ckpt"), "--schedule", schedule,
                                            "--batch-size", "8", "--microbatches", "8"])

    def relayout(processes: int) -> tuple[int, str]:  # as a rank of the job that saved it
        return checkpoint.Run(args, 0, processes, print, ["job7"]).relayout(per_rank)
    if per_rank == 1:  # one stage per rank: pp 4 fits
        assert relayout(4) == (1, "balanced")
        return
    assert relayout(3) == (1, "balanced")
    with pytest.raises(checkpoint.UsageError, match=re.escape(
            "4 process(es) cannot hold this run (step-00000008, saved by 2): with --tp 1, --batch-size 8, "
            "--microbatches 8 and 4 layers in 2 stage(s) per pipeline rank it needs 1, 2, 3 process(es); start "
            "that many")):
        relayout(4)


def test_no_layout_of_the_processes_left_is_one_line_and_touches_nothing(tmp_path, data_dir):
    # --tp 2 and one process left of the torchrun job that saved it (its id set as torchrun sets it): one line.
    fake_checkpoint(tmp_path / "checkpoints", 8, 4, 1, 2)
    before = snapshot(tmp_path / "checkpoints")
    result = run_script(0, "train_pipeline_gpipe.py", *TRAIN_ARGS, "--tp", "2", "--data", data_dir, cwd=tmp_path,
                        env=dict(script_env(), TORCHELASTIC_RUN_ID="job7"))
    one_line_error(result, "1 process(es) cannot hold this run (step-00000008, saved by 4): with --tp 2, "
                           "--batch-size 8, --microbatches 4 and 4 layers in 1 stage(s) per pipeline rank it needs "
                           "2, 4 process(es); start that many")
    assert snapshot(tmp_path / "checkpoints") == before


def test_dead_rank_with_max_restarts_resumes_and_finishes_and_fresh_acts_once(tmp_path, data_dir, reference_run):
    # torchrun --max-restarts 1, --fresh: the first attempt moves aside what another run left (the reference run's
    # step 12, which these flags would resume); a rank killed after step 4's checkpoint, the restart resumes this
    # job's checkpoint (--fresh acts once per job), and every step is trained once: the reference's losses.
    shutil.copytree(reference_run[0] / "checkpoints" / "step-00000012", tmp_path / "checkpoints" / "step-00000012")
    args = [*RESUME_ARGS, "--dp", "2", "--checkpoint-every", "2", "--data", data_dir, "--metrics", "m.jsonl", "--fresh"]
    proc = launch(4, "train_pipeline_gpipe.py", *args, cwd=tmp_path, wait=False, torchrun_args=["--max-restarts=1"])
    while proc.poll() is None and "step-00000004" not in complete_and_partial(tmp_path / "checkpoints")[0]:
        time.sleep(0.01)
    victims = worker_pids(proc.pid)
    assert len(victims) == 4, "the job ended before a rank could be killed"
    os.kill(victims[1], signal.SIGKILL)
    result = finish(proc)
    assert result.returncode == 0, errors(result.stderr)
    assert "resumed from checkpoints/step-0000000" in result.stdout and result.stdout.count("--fresh: moved") == 1
    aside = list(tmp_path.glob("checkpoints.previous-*"))
    assert len(aside) == 1 and os.listdir(aside[0]) == ["step-00000012"], result.stdout
    rows, _ = read_metrics(tmp_path / "m.jsonl")
    _, reference = reference_run
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]


def test_a_hung_peer_stops_the_job_after_the_timeout(tmp_path, data_dir):
    # Ranks started by hand, so nothing but --timeout can stop the waiting ones. 10 s: every wait of a rank is held
    # to it, from meeting the others (each importing torch) to a peer's fsync on a busy disk, not only the hang's.
    procs = launch_ranks(3, "train_pipeline_gpipe.py", *RESUME_ARGS, "--steps", "1000", "--timeout", "10",
                         "--data", data_dir, "--metrics", "m.jsonl", cwd=tmp_path)
    while not (tmp_path / "m.jsonl").is_file() or not (tmp_path / "m.jsonl").read_text():
        assert all(p.poll() is None for p in procs), [finish(p).stderr[-2000:] for p in procs]
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1 hangs: alive, but never answers again
    try:
        for rank in (0, 2):
            result = finish(procs[rank], timeout=60)
            assert result.returncode == 1
            # One line says what happened (rank 2 also shows its progress bar); no traceback.
            assert "error: lost contact with another rank" in result.stderr, errors(result.stderr)
            assert "Traceback" not in result.stderr, errors(result.stderr)
    finally:
        for proc in procs:
            kill_job(proc)
            proc.communicate()


FLIGHT_RECORDER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                   "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch 2.13's names, newer first


def _teardown_worker(rank, world_size, store_path, out_dir, fails):
    """checkpoint.run on a real gloo rank, torch's two teardowns recorded as they run. fails: rank 1 stops on a
    mistake of its own with a receive pending (never sent), while rank 0 waits for it in a collective. Rank 1 comes
    with its user's own flight recorder settings. Saves the exit status, the teardowns, the seconds run() took and
    the flight recorder's settings main() started with; the rank's stderr goes to out_dir/RANK.err."""
    os.dup2(os.open(os.path.join(out_dir, f"{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    for name in FLIGHT_RECORDER:
        os.environ.pop(name, None)
    if rank == 1:
        os.environ.update(TORCH_FR_BUFFER_SIZE="100", TORCH_NCCL_DUMP_ON_TIMEOUT="0",
                          TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/elsewhere/trace-")
    teardowns, seen = [], {}
    for module, name in ((dist, "destroy_process_group"), (dist.distributed_c10d, "_abort_process_group")):
        real = getattr(module, name)
        setattr(module, name, lambda *a, real=real, name=name, **k: (teardowns.append(name), real(*a, **k))[1])

    def main(args):
        seen.update({name: os.environ.get(name) for name in FLIGHT_RECORDER})
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=20))
        if fails and rank == 1:
            pending = dist.irecv(torch.empty(1000), src=0)  # noqa: F841 (kept: pending when the error stops the rank)
            raise checkpoint.UsageError("a mistake only this rank finds")
        dist.all_reduce(torch.ones(1))
    started = time.monotonic()
    try:
        checkpoint.run(main, argparse.Namespace(checkpoint_dir=os.path.join(out_dir, "ckpt")))
    except SystemExit as e:
        status = e.code
    result = {"status": status, "teardowns": teardowns, "seconds": time.monotonic() - started, "env": seen}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def test_a_rank_stopped_on_an_error_aborts_its_process_group_and_ends_at_once(tmp_path):
    # Destroying a process group flushes the calls still pending: under NCCL, a receive from a peer that stopped
    # waits until --timeout and the watchdog kills the rank (SIGABRT), after its one line. A rank stopped on an error
    # (a mistake, or a lost peer) aborts instead; only a run that ended well destroys. gloo does not hang either
    # way, so the teardown each rank took is recorded. run() also turns on NCCL's flight recorder before main.
    results = {}
    for fails in (True, False):
        out = tmp_path / str(fails)
        out.mkdir()
        run_workers(_teardown_worker, 2, args=(2, str(out / "store"), str(out), fails))
        results[fails] = [(json.loads((out / f"{r}.json").read_text()), (out / f"{r}.err").read_text())
                          for r in range(2)]
    (zero, zero_err), (one, one_err) = results[True]
    assert one["status"] == 1 and one_err == "error: a mistake only this rank finds\n", one_err
    assert zero["status"] == 1 and zero_err.startswith("error: lost contact with another rank (")
    assert len(zero_err.splitlines()) == 1, zero_err
    assert zero["teardowns"] == one["teardowns"] == ["_abort_process_group"]
    assert one["seconds"] < 20 and zero["seconds"] < 20, (one, zero)  # before the 20 s timeout: the peer's exit ends it
    for result, err in results[False]:
        assert (result["status"], result["teardowns"], err) == (0, ["destroy_process_group"], "")
    # The flight recorder's settings: dumps beside the checkpoints; a user's own kept, under either of torch's names.
    assert zero["env"] == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
                           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None,
                           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "True" / "ckpt" / "nccl-trace-rank")}
    assert one["env"] == {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
                          "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace-",
                          "TORCH_FR_DUMP_TEMP_FILE": None}
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}  # the older name of the buffer's size: no newer one beside it
    checkpoint.flight_recorder("ckpt", environ)
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_FR_DUMP_TEMP_FILE": os.path.abspath("ckpt/nccl-trace-rank")}


class _RunsACommand:
    """Pickled as os.system(command): what a hostile checkpoint file would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def hostile_index(original: bytes, module: str, name: str, argument: str) -> bytes:
    """A .metadata that calls module.name(argument) first (pickle's STACK_GLOBAL, which resolves a dotted name
    through the module), drops the result, then goes on as the original index: it loads as a checkpoint."""
    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value.encode())]) + value.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R0" + original[2:]


def tamper(checkpoint_dir: Path, name: str, content: bytes, **meta_fields) -> None:
    """Replace a file of a checkpoint, and fix meta.json's record of its size (as an attacker would)."""
    (checkpoint_dir / name).write_bytes(content)
    meta = json.loads((checkpoint_dir / "meta.json").read_text())
    meta["files"][name] = len(content)
    (checkpoint_dir / "meta.json").write_text(json.dumps({**meta, **meta_fields}))


def test_a_checkpoint_runs_none_of_the_code_its_files_ask_for(tmp_path, reference_run):
    """A checkpoint is untrusted input: DCP's index is read by an unpickler that hands out exact (module, name)
    pairs of DCP's classes only. Each payload here ran its command through the reader before (tried)."""
    source = reference_run[0] / "checkpoints" / "step-00000016"
    original = (source / ".metadata").read_bytes()
    ran = tmp_path / "ran"
    touch = f"touch {ran}"
    payloads = {f"dotted name through {module}": hostile_index(original, module, "os.system", touch)
                for module in ("torch.distributed.checkpoint.metadata", "torch", "torch.serialization", "pathlib",
                               "collections", "torch.distributed.checkpoint.filesystem")}
    payloads.update({
        "a module's function": b"cos\nsystem\n(S'" + touch.encode() + b"'\ntR.",
        "getattr on an allowed class": b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__reduce__'\ntR.",
        "getattr on the enum, not a member": (b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n"
                                              b"_MEM_FORMAT_ENCODING\nS'__init_subclass__'\ntR."),
        "an allowed class, hostile arguments": b"ctorch\nSize\n(S'" + touch.encode() + b"'\ntR.",
        "an allowed class, not an index": b"cpathlib\nPosixPath\n(S'/etc/passwd'\ntR.",
        "a layout by a hostile name": b"ctorch.serialization\n_get_layout\n(S'os'\ntR.",
        "a persistent id": b"(S'x'\nP.",
        "a shard outside the checkpoint": original.replace(b"__0_0.distcp", b"../../ab.dcp"),
    })
    for case, content in payloads.items():
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(source, copy)
        tamper(copy, ".metadata", content)
        with pytest.raises(checkpoint.UsageError) as failure:
            checkpoint.verify_files(str(copy), checkpoint.read_meta(str(copy)))
        message = str(failure.value)
        assert "damaged, or not a checkpoint of this project" in message and "\n" not in message, (case, message)
        assert not ran.exists(), case
    # Python 3.11.2 pickles DCP's memory-format enum as getattr(class, name) (3.11.7 by value): still accepted.
    enum_by_name = (b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                    b"S'TORCH_CONTIGUOUS_FORMAT'\ntR.")
    assert checkpoint._MetadataUnpickler(io.BytesIO(enum_by_name)).load() is \
        torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


def checkpoint_copy(source: Path, copy: Path) -> Path:
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy)
    return copy


def test_an_index_takes_no_memory_beyond_its_size_and_changes_no_class(tmp_path, reference_run):
    """DCP's index is read by pickle's pure-Python unpickler, restricted: its memo is a dict, BUILD sets only the
    fields of DCP's dataclasses' instances, an index's few levels of nesting and none of the opcodes it never
    holds. Each payload but the first passed every check before, and then went on as the original index."""
    source = reference_run[0] / "checkpoints" / "step-00000016"
    original = (source / ".metadata").read_bytes()
    zstd = pickle.loads(original)  # our own file, written by the reference run
    for info in zstd.storage_data.values():
        info.transform_descriptors = ["zstd"]
    payloads = {  # the C unpickler made a memo of 16 bytes a slot up to the slot named, 2**27 here: 2 GiB
        "a memo slot 2**27": b"\x80\x02Nr" + struct.pack("<I", 2**27) + b".",
        # (None, {"__str__": torch.Size}) built on the class: PurePosixPath.__str__ replaced for the process
        "BUILD on an allowed class": (b"\x80\x04cpathlib\nPurePosixPath\nN}S'__str__'\nctorch\nSize\ns\x86b0"
                                      + original[2:]),
        "a set, ~200 bytes of memory a byte": b"\x80\x04\x8f0" + original[2:],
        "100 nested marks, a list each": b"\x80\x04" + b"(" * 100 + b"1" * 100 + original[2:],
        "a shard that decompresses, to any size": pickle.dumps(zstd),
    }
    own_str = vars(pathlib.PurePosixPath).get("__str__")  # none: it inherits PurePath's
    try:
        for case, content in payloads.items():
            copy = checkpoint_copy(source, tmp_path / "copy")
            tamper(copy, ".metadata", content)
            tracemalloc.start()
            with pytest.raises(checkpoint.UsageError) as failure:
                checkpoint.verify_files(str(copy), checkpoint.read_meta(str(copy)))
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert f"{copy}: .metadata: damaged, or not a checkpoint of this project" in str(failure.value), case
            assert peak < 64 * 2**20, (case, peak)  # the index is 20 kB: what it reads, not what it names
            assert str(pathlib.PurePosixPath("a/b")) == "a/b", case
    finally:  # if the reader did replace it, the rest of this process must not see that
        if vars(pathlib.PurePosixPath).get("__str__") is not own_str:
            del pathlib.PurePosixPath.__str__


def test_a_checkpoint_reads_no_file_outside_itself(tmp_path, reference_run):
    """meta.json lists the files a checkpoint holds; DCP reads the shards its index names among them, export.py
    copies its tokenizer files. A name outside it, an absolute one or a link is refused before anything is read."""
    source = reference_run[0] / "checkpoints" / "step-00000016"
    outside = tmp_path / "ab.dcp"  # "../../ab.dcp" from the copy, as long a name as "__0_0.distcp"
    outside.write_bytes((source / "__0_0.distcp").read_bytes())
    absolute = pickle.loads((source / ".metadata").read_bytes())  # our own file, written by the reference run
    for info in absolute.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = str(outside)

    def named(name, index):  # the first shard, moved out and named name in meta.json and in the index
        def change(copy):
            meta = json.loads((copy / "meta.json").read_text())
            meta["files"][name] = meta["files"].pop("__0_0.distcp")
            (copy / "__0_0.distcp").unlink()
            (copy / "meta.json").write_text(json.dumps(meta))
            tamper(copy, ".metadata", index)
        return change

    def linked(name, target):
        def change(copy):
            (copy / name).unlink()
            (copy / name).symlink_to(target)
        return change

    cases = {
        "../": (named("../../ab.dcp", (source / ".metadata").read_bytes().replace(b"__0_0.distcp", b"../../ab.dcp")),
                'file name is "../../ab.dcp", not a path inside the checkpoint'),
        "absolute": (named(str(outside), pickle.dumps(absolute)), "not a path inside the checkpoint"),
        "a link": (linked("__0_0.distcp", outside), f"__0_0.distcp is a link to {os.path.realpath(outside)}"),
        "a tokenizer that is a link": (linked("tokenizer.json", source / "tokenizer.json"),
                                       "tokenizer.json is a link to"),
    }
    for case, (change, expected) in cases.items():
        copy = checkpoint_copy(source, tmp_path / "in" / "copy")
        change(copy)
        with pytest.raises(checkpoint.UsageError) as failure:
            checkpoint.verify_files(str(copy), checkpoint.read_meta(str(copy), "--init-from"), "--init-from")
        assert str(failure.value).startswith(f"--init-from {copy}: ") and expected in str(failure.value), \
            (case, str(failure.value))


def test_a_checkpoints_json_of_another_shape_is_one_line_naming_the_file_and_the_field(tmp_path, reference_run,
                                                                                      capsys):
    """meta.json, tokenizer.json and tokenizer_config.json of a checkpoint: each field the code reads is checked,
    each mistake one line naming the input as it was given and the field; only a run's own is worth deleting."""
    source = reference_run[0] / "checkpoints" / "step-00000016"
    meta = json.loads((source / "meta.json").read_text())
    wrong_meta = {  # what meta.json holds -> what the line names
        "a list": ([meta], "lacks step"),
        "step, a string": ({**meta, "step": "16"}, 'step is "16", not a whole number >= 0'),
        "step, negative": ({**meta, "step": -1}, "step is -1, not a whole number >= 0"),
        "a negative data position": ({**meta, "data": {"epoch": 0, "index": -8}}, "data.index is -8, not a whole"),
        "the data position, a list": ({**meta, "data": [0, 8]}, "data is [0, 8], not null or"),
        "config, a list": ({**meta, "config": [1]}, "config is [1], not the fields of a LlamaConfig"),
        "a size, a string": ({**meta, "config": {**meta["config"], "hidden_size": "64"}},
                             'config.hidden_size = "64": must be a whole number'),
        "files, a list": ({**meta, "files": list(meta["files"])}, "files is [\""),
        "a file size, a string": ({**meta, "files": {**meta["files"], ".metadata": "1"}},
                                  'files[".metadata"] is "1", not a size in bytes'),
        "world_size 0": ({**meta, "world_size": 0}, "world_size is 0, not a whole number >= 1"),
        "dp, a string": ({**meta, "args": {**meta["args"], "dp": "2"}}, 'args.dp is "2", not a whole number >= 1'),
        "run, a list": ({**meta, "run": []}, "run is [], not an object"),
        "init_from, a number": ({**meta, "run": {**meta["run"], "init_from": 3}}, "run.init_from is 3, not a path"),
        "job, an object": ({**meta, "job": {}}, "job is {}, not a list of launch ids"),
        "nested deeply": ("[" * 100_000 + "]" * 100_000, "cannot be read (nested too deeply)"),
    }
    copy = checkpoint_copy(source, tmp_path / "copy")
    for case, (content, expected) in wrong_meta.items():
        (copy / "meta.json").write_text(content if isinstance(content, str) else json.dumps(content))
        for flag, fix in (("--checkpoint-dir", "delete it to resume from an older one"),
                          ("--init-from", "give --init-from another checkpoint")):
            with pytest.raises(checkpoint.UsageError) as failure:
                checkpoint.read_meta(str(copy), flag)
            message = str(failure.value)
            assert message.startswith(f"{flag} {copy}: ") and expected in message and message.endswith(fix), \
                (case, message)
        err = refused(capsys, export.main, copy, tmp_path / "out.pt")
        assert f"checkpoint {copy}: " in err and expected in err and "give export.py another" in err, (case, err)
    (copy / "meta.json").write_text(json.dumps(meta))

    tokenizer = json.loads((source / "tokenizer.json").read_text())
    wrong_tokenizer = {  # (file, content) -> what the line names
        ("tokenizer.json", "a list"): ([tokenizer], "its tokenizer.json is [{"),
        ("tokenizer.json", "model, a string"): ({**tokenizer, "model": "BPE"}, 'model is "BPE"'),
        ("tokenizer.json", "an id, a string"): ({**tokenizer, "model": {**tokenizer["model"], "vocab": {"a": "1"}}},
                                                'model.vocab is {"a": "1"}, not tokens and their ids'),
        ("tokenizer.json", "a merge, a number"): ({**tokenizer, "model": {**tokenizer["model"], "merges": [1]}},
                                                  "model.merges is [1], not a list of"),
        ("tokenizer.json", "an added token, a string"): ({**tokenizer, "added_tokens": ["[BOT]"]},
                                                         'added_tokens is ["[BOT]"], not a list'),
        ("tokenizer.json", "nested deeply"): ('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                              "cannot read its tokenizer.json (nested too deeply)"),
        ("tokenizer_config.json", "a list"): ([], "its tokenizer_config.json is [], not an object"),
        ("tokenizer_config.json", "bos_token, a list"): ({"bos_token": ["[BOT]"]},
                                                         'bos_token is ["[BOT]"], not a token'),
    }
    for (name, case), (content, expected) in wrong_tokenizer.items():
        copy = checkpoint_copy(source, tmp_path / "copy")
        tamper(copy, name, (content if isinstance(content, str) else json.dumps(content)).encode())
        err = refused(capsys, export.main, copy, tmp_path / "out", "--format", "hf")
        assert f"checkpoint {copy}: " in err and expected in err, (name, case, err)
        assert not (tmp_path / "out").exists()
        if name == "tokenizer.json":  # --init-from compares it with the data's
            with pytest.raises(checkpoint.UsageError) as failure:
                checkpoint.same_tokenizer(str(copy), str(source))
            assert str(failure.value).startswith(f"--init-from {copy}: ") and expected in str(failure.value), case


def test_wrong_model_damaged_or_tampered_checkpoints_fail_in_one_line(tmp_path, data_dir, reference_run, capsys):
    reference_dir, _ = reference_run
    source = reference_dir / "checkpoints" / "step-00000016"
    runs = {}
    for name in ("wrong_model", "truncated", "tampered", "garbage", "position", "damaged_meta"):
        shutil.copytree(source, tmp_path / name / "checkpoints" / source.name)
    rng = tmp_path / "rng" / "checkpoints" / "step-00000012"  # a step before the last: resumed, it trains on
    shutil.copytree(source.parent / rng.name, rng)
    truncated, garbage = (tmp_path / name / "checkpoints" / source.name for name in ("truncated", "garbage"))
    shard = next(truncated.glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    shard = next(garbage.glob("__1_*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))  # its size, none of its tensors
    meta = json.loads((source / "meta.json").read_text())
    (tmp_path / "position" / "checkpoints" / source.name / "meta.json").write_text(
        json.dumps({**meta, "data": {"epoch": 0, "index": 10**6}}))
    (tmp_path / "damaged_meta" / "checkpoints" / source.name / "meta.json").write_text("{")
    # Each hostile file would touch this file if anything ran it: resumed, exported or started from.
    payload = tmp_path / "payload-ran"
    tampered = tmp_path / "tampered" / "checkpoints" / source.name
    tamper(tampered, ".metadata", hostile_index((source / ".metadata").read_bytes(),
                                                "torch.distributed.checkpoint.metadata", "os.system",
                                                f"touch {payload}"))
    hostile_rng = io.BytesIO()
    torch.save({"cpu": _RunsACommand(f"touch {payload}")}, hostile_rng)
    tamper(rng, "rng/rank0.pt", hostile_rng.getvalue(), world_size=1)  # 1 process reads rank 0's
    # Each names the input as it was given; only a run's own checkpoint is worth deleting, and no line passes on
    # torch.load's advice to load a file unsafely.
    run_own = f"--checkpoint-dir checkpoints/{source.name}: "
    expected = {"wrong_model": "model num_hidden_layers 4 → 3", "truncated": run_own + "damaged, __1_",
                "tampered": run_own + ".metadata: damaged, or not a checkpoint of this project",
                "rng": "checkpoints/step-00000012: rng/rank0.pt: damaged, or not a checkpoint of this project (it "
                       "asks for posix.system, which a checkpoint never contains); delete it",
                "position": run_own + "its meta.json's data index 1000000 is past the"}
    for name in expected:
        layers = ["--layers", "3"] if name == "wrong_model" else []
        runs[name] = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, *layers, "--data", data_dir,
                                cwd=tmp_path / name, wait=False)
    for name, path in (("init_from", tampered), ("init_from_truncated", truncated)):
        runs[name] = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir, "--init-from", path,
                                "--checkpoint-dir", "new-" + name, cwd=tmp_path, wait=False)
    expected["init_from"] = f"--init-from {tampered}: .metadata: damaged, or not a checkpoint of this project"
    expected["init_from_truncated"] = f"--init-from {truncated}: damaged, __1_"
    # A damaged newest meta.json, read by every rank under torchrun (to see if torchrun restarted the job on
    # other processes): said once for the node, as the other errors.
    runs["damaged_meta"] = launch(2, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir,
                                  cwd=tmp_path / "damaged_meta", wait=False)
    for path, fails_in in ((tampered, ".metadata: damaged"), (truncated, "damaged, __1_"),
                           (garbage, "cannot read its tensors")):
        err = refused(capsys, export.main, path, tmp_path / "exported.pt")
        assert err.startswith(f"error: checkpoint {path}: {fails_in}") and \
            err.endswith("; give export.py another checkpoint"), err
    for name, proc in runs.items():
        result = finish(proc)
        if name == "damaged_meta":
            assert result.returncode == 1 and error_lines(result.stderr) == [
                f"error: {run_own}not a complete checkpoint, its meta.json cannot be read (Expecting property name "
                "enclosed in double quotes: line 1 column 2 (char 1)); delete it to resume from an older one"], \
                errors(result.stderr)
            continue
        one_line_error(result, expected[name])
        assert ("delete" in result.stderr) == (name != "wrong_model" and not name.startswith("init_from")), name
        assert "weights_only" not in result.stderr
    assert not payload.exists()

    # --fresh starts over and moves the old checkpoints aside instead of deleting them.
    result = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--layers", "3", "--steps", "1", "--fresh",
                        "--data", data_dir, cwd=tmp_path / "wrong_model")
    assert result.returncode == 0, errors(result.stderr)
    aside = list((tmp_path / "wrong_model").glob("checkpoints.previous-*"))
    assert len(aside) == 1 and (aside[0] / source.name / "meta.json").is_file()
    assert complete_and_partial(tmp_path / "wrong_model" / "checkpoints")[0] == ["step-00000001"]


def test_an_index_that_moves_a_chunk_or_its_bytes_is_refused_in_one_line(tmp_path, data_dir, reference_run, capsys):
    # DCP takes its index on trust: a chunk moved outside its tensor (one flipped bit, the file's size unchanged, so
    # meta.json's check passes) was loaded as nothing, the tensor left as initialized, and exported as uninitialised
    # memory. Each damage below, as the index's own objects hold it, re-pickled (what an attacker would write).
    source = reference_run[0] / "checkpoints" / "step-00000016"
    fqn = "model.base_model.layers.2.self_attn.o_proj.weight"

    def damaged(name: str, change) -> Path:
        path = tmp_path / name / "checkpoints" / source.name
        shutil.copytree(source, path)
        index = checkpoint.read_index(str(source / ".metadata"))
        change(index, index.state_dict_metadata[fqn].chunks)  # the reference's 2 replicas: 2 chunks, rows 0-63, 64-127
        tamper(path, ".metadata", pickle.dumps(index))
        return path

    def moved(index, chunks):  # the issue's flipped bit: [0, 0] -> [0, 128], its stored bytes' key moved with it
        info = index.storage_data.pop(MetadataIndex(fqn, chunks[0].offsets))
        chunks[0].offsets = torch.Size([0, 128])
        index.storage_data[MetadataIndex(fqn, chunks[0].offsets)] = info

    def twice(index, chunks):  # rows 0-63 twice, rows 64-127 never
        chunks[1].offsets = chunks[0].offsets

    def unstored(index, chunks):
        del index.storage_data[MetadataIndex(fqn, chunks[1].offsets)]

    def past_the_end(index, chunks):
        info = index.storage_data[MetadataIndex(fqn, chunks[1].offsets)]
        info.offset += (source / info.relative_path).stat().st_size

    cases = {moved: "it places a chunk of \"model.base_model.layers.2.self_attn.o_proj.weight\" at [0, 128], of "
                    "[64, 128], outside its shape [128, 128]",
             twice: "its chunks of \"model.base_model.layers.2.self_attn.o_proj.weight\" do not cover its shape "
                    "[128, 128] exactly once",
             unstored: "it holds no bytes for the chunk of \"model.base_model.layers.2.self_attn.o_proj.weight\" at "
                       "[64, 0]",
             past_the_end: "it places the bytes of \"model.base_model.layers.2.self_attn.o_proj.weight\" at "}
    for change, problem in cases.items():
        path = damaged(change.__name__, change)
        with pytest.raises(checkpoint.UsageError) as refusal:
            checkpoint.verify_files(str(path), checkpoint.read_meta(str(path)))
        assert str(refusal.value).startswith(f"--checkpoint-dir {path}: .metadata: damaged, or not a checkpoint of "
                                             f"this project ({problem}"), str(refusal.value)
    # Damaged pickle data (an index cut short) is named as such, not as the unpickler's "pop from empty list".
    cut = tmp_path / "cut" / "checkpoints" / source.name
    shutil.copytree(source, cut)
    tamper(cut, ".metadata", b"\x80\x04.")
    with pytest.raises(checkpoint.UsageError, match=r"\(its bytes are not an index as DCP writes it\)"):
        checkpoint.verify_files(str(cut), checkpoint.read_meta(str(cut)))
    # Resumed, exported and started from: each refused in one line, before anything is loaded.
    moved_dir = tmp_path / "moved" / "checkpoints" / source.name
    runs = {"resume": run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir,
                                 cwd=tmp_path / "moved", wait=False),
            "init_from": run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir, "--init-from",
                                    moved_dir, "--checkpoint-dir", "new", cwd=tmp_path, wait=False)}
    err = refused(capsys, export.main, moved_dir, tmp_path / "exported.pt")
    assert err.startswith(f"error: checkpoint {moved_dir}: .metadata: damaged") and "[0, 128]" in err, err
    assert not (tmp_path / "exported.pt").exists()
    for name, proc in runs.items():
        one_line_error(finish(proc), ".metadata: damaged, or not a checkpoint of this project (it places a chunk")


def test_a_save_onto_a_step_another_run_wrote_is_named_as_such(tmp_path, data_dir):
    # Once reported as a full disk ("free space"): the rename onto a step-N that is not this run's fails.
    (tmp_path / "ckpt" / "step-00000001").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-00000001" / "theirs").write_text("x")
    result = run_script(0, "train_pipeline_gpipe.py", *TRAIN_ARGS, "--layers", "2", "--steps", "2",
                        "--checkpoint-every", "1", "--data", data_dir, "--checkpoint-dir", "ckpt", cwd=tmp_path)
    assert result.returncode == 1 and error_lines(result.stderr) == [  # after the progress bar of step 1
        "error: --checkpoint-dir: saving ckpt/step-00000001.tmp failed (ckpt/step-00000001 exists already, not this "
        "run's); the partial save is removed and there is no complete one yet; move ckpt/step-00000001 away and "
        "rerun the same command to resume"], errors(result.stderr)
    assert os.listdir(tmp_path / "ckpt" / "step-00000001") == ["theirs"]


def test_background_saves_before_torch_2_13_are_refused_in_one_line(tmp_path, monkeypatch, one_process_group):
    # Measured on a GPU machine's torch 2.11: its DefaultStager fails to copy the state (KeyError: <class 'type'>)
    # at the first background save, after the steps before it. Refused before any work instead, on every rank.
    args = gpipe.build_parser().parse_args(["--async-checkpoint", "--checkpoint-dir", str(tmp_path / "ckpt")])
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(checkpoint.UsageError, match=r"^--async-checkpoint: torch 2.11.0\+cu130 cannot stage a "
                                                    "checkpoint .*; use torch 2.13 or leave the flag out$"):
        checkpoint.check_run(args, 0, ["job"])
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_fresh_runs_within_a_second_each_set_their_checkpoints_aside(tmp_path, monkeypatch):
    # benchmark.py starts its runs one after another with --fresh in one folder, short runs within a second.
    monkeypatch.setattr(time, "strftime", lambda *args: "20260101-000000")
    for step in range(3):
        (tmp_path / "ckpt" / f"step-{step:08d}").mkdir(parents=True)
        checkpoint._set_aside(str(tmp_path / "ckpt"), [], say=lambda *args, **kwargs: None)
    aside = {p.name: os.listdir(p) for p in tmp_path.glob("ckpt.previous-*")}
    assert aside == {"ckpt.previous-20260101-000000": ["step-00000000"],
                     "ckpt.previous-20260101-000000-2": ["step-00000001"],
                     "ckpt.previous-20260101-000000-3": ["step-00000002"]}


def test_one_run_per_checkpoint_directory(tmp_path, data_dir):
    args = [*RESUME_ARGS, "--steps", "1000", "--data", data_dir, "--checkpoint-dir", "shared"]
    first = run_script(0, "train_pipeline_gpipe.py", *args, "--metrics", "m.jsonl", cwd=tmp_path, wait=False)
    try:
        while not (tmp_path / "m.jsonl").is_file() or not (tmp_path / "m.jsonl").read_text():
            assert first.poll() is None, finish(first).stderr[-2000:]
            time.sleep(0.05)
        second = run_script(0, "train_pipeline_gpipe.py", *args, cwd=tmp_path)
        one_line_error(second, "--checkpoint-dir shared: another run is using it",
                       f"pid {first.pid} on {socket.gethostname()}")
        assert first.poll() is None  # the first run goes on undisturbed
    finally:
        kill_job(first)  # like a machine losing power: the lock stays behind
        first.communicate()
    assert (tmp_path / "shared" / "run.lock").is_file()
    # Its holder is gone (same host, dead pid): the next run takes the lock over at once and releases it.
    result = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--steps", "2", "--data", data_dir,
                        "--checkpoint-dir", "shared", cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["step-00000002"]


def plain_torchrun(nproc: int, *args, cwd, wait=True, prefix=(), timeout=240):
    """train_pipeline_gpipe.py under `torchrun --master_port P`, as most launches are: no --standalone, no --rdzv-id
    (TORCHELASTIC_RUN_ID is "none", as in every other such launch); prefix: a command it runs under."""
    return start([*prefix, sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                  f"--master_port={free_port()}", str(ROOT / "train_pipeline_gpipe.py"), *args], cwd=cwd, wait=wait,
                 timeout=timeout)


def test_separate_plain_torchrun_launches_are_separate_jobs(tmp_path, data_dir):
    # torchrun's rendezvous id "none" names no job: each launch is one (its agent), so a launch is never taken for
    # another attempt of the job before it: no re-layout as if restarted, and --fresh moves the last one's aside.
    args = [*TRAIN_ARGS, "--layers", "2", "--steps", "3", "--data", data_dir, "--checkpoint-dir", "ckpt",
            "--checkpoint-every", "2"]
    result = plain_torchrun(2, *args, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    shutil.rmtree(tmp_path / "ckpt" / "step-00000003")  # as if stopped after step 2
    result = plain_torchrun(1, *args, cwd=tmp_path)  # another launch, on fewer processes
    assert result.returncode == 0, errors(result.stderr)
    assert "resumed from ckpt/step-00000002 at step 2 (saved by 2 process(es))" in result.stdout, result.stdout
    assert "processes ->" not in result.stdout  # its flags as given: not re-laid-out as a restart would be
    result = plain_torchrun(2, *args, "--fresh", cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert "--fresh: moved the previous checkpoints to" in result.stdout, result.stdout
    assert "nothing to train" not in result.stdout and "resumed" not in result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000003"]


def test_a_launch_on_another_host_leaves_a_live_runs_lock_alone(tmp_path, data_dir):
    # The same command from a second host (a UTS namespace of its own: another hostname, the same disk), while the
    # first run trains: both plain launches, both torchrun's "none", so it once took the live run's lock.
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode:
        pytest.skip("unshare --uts is not permitted here (it needs root or user namespaces)")
    args = [*TRAIN_ARGS, "--layers", "2", "--steps", "10000", "--data", data_dir, "--checkpoint-dir", "ckpt"]
    live = plain_torchrun(1, *args, cwd=tmp_path, wait=False)
    try:
        deadline, lock = time.monotonic() + 120, str(tmp_path / "ckpt" / "run.lock")
        while not (holder := checkpoint._read_lock(lock)) and live.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the run creates the file, then writes it: read once written
        assert holder, "the run never took its lock"
        other = plain_torchrun(1, *args, cwd=tmp_path, timeout=90, prefix=["unshare", "--uts", "sh", "-c",
                                                                            'hostname other-host && exec "$@"', "sh"])
        assert other.returncode == 1, errors(other.stderr)
        assert f"another run is using it (pid {holder['pid']} on {socket.gethostname()}" in other.stderr, other.stderr
        assert json.loads((tmp_path / "ckpt" / "run.lock").read_text()) == holder and live.poll() is None
    finally:
        kill_job(live)
        live.communicate()


def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path, monkeypatch):
    lock_file = tmp_path / "run.lock"
    # A lock of a run on another host: refused while its heartbeat is fresh, taken over once it is stale.
    lock_file.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "started": "2026-01-01 00:00:00"}))
    with pytest.raises(checkpoint.UsageError, match="another run is using it \\(pid 4242 on node-elsewhere"):
        checkpoint.RunLock.acquire(str(tmp_path))
    stale = time.time() - checkpoint.STALE_SECONDS - 5
    os.utime(lock_file, (stale, stale))
    monkeypatch.setattr(checkpoint, "HEARTBEAT_SECONDS", 0.05)
    lock = checkpoint.RunLock.acquire(str(tmp_path))
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    os.utime(lock_file, (stale, stale))
    deadline = time.monotonic() + 30  # the holder's heartbeat (a thread: on a loaded machine, not at once)
    while time.time() - lock_file.stat().st_mtime >= checkpoint.STALE_SECONDS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.time() - lock_file.stat().st_mtime < checkpoint.STALE_SECONDS
    lock.release()
    assert not lock_file.exists()
    # On another host, an earlier attempt of this job (one of its node launches the same) is taken over at once;
    # another job's lock is not, whatever its torchrun ids (a second job that torchrun restarted).
    lock_file.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "started": "2026-01-01 00:00:00",
                                     "job": ["node0-launch", "node1-launch"], "run_id": "pipeline", "restart": 0}))
    for other in [], ["node2-launch"], ["pipeline"]:
        with pytest.raises(checkpoint.UsageError, match="another run"):
            checkpoint.RunLock.acquire(str(tmp_path), other)
    checkpoint.RunLock.acquire(str(tmp_path), ["node0-launch", "node3-launch"]).release()
    assert not lock_file.exists()
    # On this host, only a holder that is gone: a live one of the same job is another run, not an earlier attempt.
    live = checkpoint.RunLock.acquire(str(tmp_path), ["node0-launch"])
    with pytest.raises(checkpoint.UsageError, match=f"another run is using it \\(pid {os.getpid()}"):
        checkpoint.RunLock.acquire(str(tmp_path), ["node0-launch"])
    live.release()
    # A holder killed a moment ago, not yet waited for by its parent: a zombie, which os.kill still finds, is gone.
    holder = subprocess.Popen(["sleep", "60"])
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": "2026-01-01 00:00:00",
                                     "pid_started": checkpoint._process_start(holder.pid)}))
    holder.kill()
    deadline = time.monotonic() + 30  # a SIGKILL takes effect a moment after kill() returns
    while running(holder.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    checkpoint.RunLock.acquire(str(tmp_path)).release()
    assert holder.wait() == -signal.SIGKILL and not lock_file.exists()


def test_resume_refuses_changed_flags_and_touches_nothing(tmp_path, data_dir, reference_run):
    reference_dir, _ = reference_run
    other = prepare_small(tmp_path / "other", tokenizer=Path(data_dir) / "tokenizer.json")
    cases = {  # the run was --steps 16 --seq-len 32 --batch-size 8 --lr 1e-2 --seed 0 on builtin, stopped at 8
        "longer": (["--steps", "32"], ["--steps 16 → 32"]),
        "several": (["--seq-len", "64", "--seed", "1", "--batch-size", "16", "--lr", "0.02", "--layers", "3",
                     "--document-masking"],
                    ["--seq-len 32 → 64", "--seed 0 → 1", "--batch-size 8 → 16", "--lr 0.01 → 0.02",
                     "--document-masking False → True", "model num_hidden_layers 4 → 3 (--model, --layers"]),
        "model": (["--model", "small", "--steps", "32"], ["model hidden_size 128 → 768", "--steps 16 → 32"]),
        "data": (["--data", str(other)], [f"--data {data_dir} → {other} (other data"]),
    }
    procs = {}
    for name, (given, _) in cases.items():
        shutil.copytree(reference_dir / "checkpoints" / "step-00000008", tmp_path / name / "step-00000008")
        procs[name] = run_script(0, "train_pipeline_gpipe.py", *RESUME_ARGS, "--data", data_dir, *given,
                                 "--checkpoint-dir", name, cwd=tmp_path, wait=False)
    for name, proc in procs.items():
        result = finish(proc)
        one_line_error(result, "--checkpoint-dir", "step-00000008 is another run", *cases[name][1], "--fresh",
                       f"--init-from {name}/step-00000008 --checkpoint-dir NEW_DIR")
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["step-00000008"]  # no lock left behind


def test_a_checkpoint_from_before_document_masking_ran_without_it(tmp_path):
    # Checkpoints saved before --document-masking existed record no value for it: they ran without it.
    args = gpipe.build_parser().parse_args(["--checkpoint-dir", str(tmp_path)])
    path = fake_checkpoint(tmp_path, 8, 1, 1, 1)
    meta = json.loads((path / "meta.json").read_text())
    meta["run"] = {k: v for k, v in checkpoint.run_identity(args, "d1").items() if k != "document_masking"}
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.check_same_run(args, str(path), "d1", meta)["step"] == 8
    args.document_masking = True
    with pytest.raises(checkpoint.UsageError, match="is another run: --document-masking False → True. Rerun"):
        checkpoint.check_same_run(args, str(path), "d1", meta)


def test_a_run_killed_during_an_evaluation_keeps_the_steps_checkpoint(tmp_path, data_dir):
    # A long evaluation after step 2 (200 held-out batches), and the step's checkpoint written before it: the
    # job is killed as soon as the checkpoint is reported, during the evaluation, and the rerun continues there.
    args = [*RESUME_ARGS, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--eval-batches", "200",
            "--data", data_dir, "--metrics", "m.jsonl"]
    proc = launch(0, "train_pipeline_gpipe.py", *args, cwd=tmp_path, wait=False)
    for line in proc.stdout:
        if "saved checkpoints/step-00000002" in line:
            kill_job(proc)
            break
    finish(proc)
    assert complete_and_partial(tmp_path / "checkpoints") == (["step-00000002"], [])
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2]  # killed before the evaluation's row
    result = run_script(0, "train_pipeline_gpipe.py", *args, "--eval-batches", "2", cwd=tmp_path)  # continues
    assert "resumed from checkpoints/step-00000002 at step 2" in result.stdout, errors(result.stderr)
    saved, evaluated = result.stdout.index("saved checkpoints/step-00000004"), result.stdout.index("eval at step 4")
    assert saved < evaluated  # saved before its evaluation
    assert [e["step"] for e in evaluations(tmp_path / "m.jsonl")] == [2, 4]  # the killed one done on resuming


def test_a_full_disk_stops_the_save_cleanly_and_the_rerun_resumes(tmp_path, data_dir):
    # Each checkpoint of this run takes about 36 MB: room for two, not three.
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "size=95m")
    try:
        args = [*RESUME_ARGS, "--steps", "4", "--checkpoint-every", "1", "--data", data_dir,
                "--checkpoint-dir", str(disk / "ckpt")]
        # Under torchrun: the ranks' output mixes, and the error comes after the last stage's progress bar.
        result = launch(2, "train_pipeline_gpipe.py", *args, "--keep-checkpoints", "2", cwd=tmp_path)
        assert result.returncode != 0
        said = re.findall(r"^error: .*", result.stderr, re.M)  # on a line of its own
        assert len(said) == 1 and "step-00000003.tmp failed (the disk is full" in said[0], errors(result.stderr)
        assert f"the newest complete one, {disk}/ckpt/step-00000002, is untouched" in said[0]
        assert "lost contact" not in result.stderr
        assert complete_and_partial(disk / "ckpt") == (["step-00000001", "step-00000002"], [])  # no partial save
        shutil.rmtree(disk / "ckpt" / "step-00000001")  # the user frees space
        result = run_script(2, "train_pipeline_gpipe.py", *args, "--keep-checkpoints", "1", cwd=tmp_path)
        assert result.returncode == 0, errors(result.stderr)
        assert f"resumed from {disk}/ckpt/step-00000002 at step 2" in result.stdout
        assert complete_and_partial(disk / "ckpt") == (["step-00000004"], [])

        # Written in the background (each save waits for the one before): step 3's write fails while step 4 trains,
        # and the run stops at the next step's end with the same line, no checkpoint looking complete.
        shutil.rmtree(disk / "ckpt")
        result = run_script(2, "train_pipeline_gpipe.py", *args, "--keep-checkpoints", "2", "--async-checkpoint",
                            cwd=tmp_path)
        said = re.findall(r"^error: .*", result.stderr, re.M)
        assert result.returncode != 0 and len(said) == 1, errors(result.stderr)
        assert "step-00000003.tmp failed (the disk is full" in said[0], said
        assert f"the newest complete one, {disk}/ckpt/step-00000002, is untouched" in said[0]
        assert "lost contact" not in result.stderr
        assert complete_and_partial(disk / "ckpt") == (["step-00000001", "step-00000002"], [])
    finally:
        subprocess.run(["umount", str(disk)])


def test_data_prepared_again_is_another_run_and_its_weights_start_a_new_one(tmp_path):
    prepare_small(tmp_path / "data")  # where the scripts read by default
    args = ["--layers", "2", "--steps", "2", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16"]
    result = run_script(0, "train_pipeline_gpipe.py", *args, "--checkpoint-every", "1", cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000002")  # as if stopped after step 1
    prepare_small(tmp_path / "data", documents=700, vocab_size=320)  # other documents and vocabulary, same folder
    one_line_error(run_script(0, "train_pipeline_gpipe.py", *args, cwd=tmp_path),
                   "--data data → data (other data, or prepared again differently)")
    # The way out it names: a new run from the checkpoint's weights (its shape comes from there; its tokenizer
    # must be the data's, and is not: this vocabulary was trained on other documents, so prepare them with it).
    new = ["--init-from", "checkpoints", "--checkpoint-dir", "new", "--steps", "1", "--metrics", "m.jsonl"]
    one_line_error(run_script(0, "train_pipeline_gpipe.py", *args[2:], *new, cwd=tmp_path),
                   "--init-from checkpoints/step-00000001: its tokenizer is not the one --data data was prepared "
                   "with", "python prepare_data.py --tokenizer checkpoints/step-00000001")
    prepare_small(tmp_path / "data", documents=700, tokenizer=tmp_path / "checkpoints" / "step-00000001")
    result = run_script(0, "train_pipeline_gpipe.py", *args[2:], *new, cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    assert "initialized from the weights of checkpoints/step-00000001" in result.stdout
    assert "model from checkpoints/step-00000001: 2 layers" in result.stdout


def test_a_run_started_from_weights_resumes_without_them(tmp_path, hf_models, data_dir):
    # A run started from a Hugging Face directory, stopped after its step-2 checkpoint; then the directory moved.
    source = tmp_path / "hf"
    shutil.copytree(hf_models / "tied", source)
    common = ["--batch-size", "8", "--microbatches", "4", "--seq-len", "32", "--warmup-steps", "2", "--lr", "1e-2",
              "--steps", "4", "--checkpoint-every", "2", "--data", data_dir]
    result = run_script(0, "train_pipeline_gpipe.py", *common, "--init-from", str(source), "--checkpoint-dir", "first",
                        "--metrics", "first.jsonl", cwd=tmp_path)
    assert result.returncode == 0, errors(result.stderr)
    reference, _ = read_metrics(tmp_path / "first.jsonl")
    source.rename(tmp_path / "hf-moved")
    cases = {"moved": ["--init-from", str(source)],  # no longer there
             "spelled": ["--init-from", str(tmp_path / "hf-moved") + "/"],  # another path, and a trailing slash
             "without": []}
    procs = {}
    for name, given in cases.items():
        shutil.copytree(tmp_path / "first" / "step-00000002", tmp_path / name / "step-00000002")
        procs[name] = run_script(0, "train_pipeline_gpipe.py", *common, *given, "--checkpoint-dir", name,
                                 "--metrics", f"{name}.jsonl", cwd=tmp_path, wait=False)
    for name, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, (name, errors(result.stderr))
        assert f"resumed from {name}/step-00000002 at step 2" in result.stdout, (name, result.stdout)
        rows, _ = read_metrics(tmp_path / f"{name}.jsonl")
        assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in reference[2:]], name


# ----------------------------------------------------------------------------------------------------------
# 5. Hugging Face: weights in and out, tied embeddings, the tokenizer

def _hf_worker(rank, world_size, store_path, out_dir, hf_root, schedules, batch, microbatches):
    """Each model: this rank's stage loaded from the Hugging Face directory, saved as a checkpoint of ours,
    then 3 training steps; the first step's loss and gradients and the weights after the last are saved, and the
    calls of torch.distributed of it all (to replay under NCCL's rules)."""
    calls = recorder()
    mesh = start_group(rank, world_size, store_path)
    try:
        env = cpu_env(rank, world_size)
        inputs, targets = batch
        results = {}
        for name, schedule in schedules.items():
            source = os.path.join(hf_root, name)
            config = checkpoint.read_hf_config(source)
            stages = gpipe.stage_ids(schedule, rank, world_size, 2)
            num_stages = world_size * len(stages)
            first, last = 0 in stages, num_stages - 1 in stages
            layers = even(config.num_hidden_layers, num_stages)
            if name == "tied" and num_stages > 2:  # the embedding's and the head's copies on stages of no layer
                layers = model_module.from_sizes([0, *map(len, even(config.num_hidden_layers, num_stages - 2)), 0])
            shape = (len(inputs) // microbatches, inputs.shape[1])
            model, built, run, _ = library_pipeline(config, schedule, stages, layers, mesh, shape, microbatches)
            calls.__enter__()
            checkpoint.load_weights(source, model, config)
            checkpoint.save(os.path.join(out_dir, f"ckpt-{name}"), 0, model, torch.optim.AdamW(model.parameters()),
                            {"config": dataclasses.asdict(config)}, rank, 1, tokenizer_dir=source)
            if name.endswith("bf16"):
                calls.__exit__(None, None, None)
                continue  # only the round trip
            optimizer = gpipe.make_optimizer(model, gpipe.build_parser().parse_args(["--lr", "1e-2"]))
            tied = model_module.TiedEmbedding(model, config, mesh, first, last)
            for step in range(3):
                optimizer.zero_grad()
                loss = gpipe.train_step(run, inputs if first else None, targets if last else None, env, 1)
                tied.sync_grads()
                if step == 0:  # before clipping
                    results[name] = {"loss": loss, "grads": {n: p.grad.clone() for n, p in
                                                             model.named_parameters(remove_duplicate=False)}}
                model_module.clip_grad_norm_(model.parameters(), 1.0, copies=tied.copies)
                optimizer.step()
            calls.__exit__(None, None, None)
            results[name]["after"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
            results[name]["calls"] = calls.recording()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hugging_face_weights_train_like_transformers_at_any_stage_count(tmp_path, hf_models, world_size):
    import transformers
    from safetensors.torch import load_file

    # 2 ranks: the tied model (4 layers) in a V, both copies on rank 0; 3 ranks: embedding and head copies on
    # ranks 0 and 2, their gradients summed over a process group. Each copy on a stage without layers: (0, 2, 2, 0)
    # and (0, 4, 0).
    schedules = {"untied": "gpipe", "tied": "zbvzerobubble" if world_size == 2 else "gpipe", "tied_bf16": "gpipe"}
    gen = torch.Generator().manual_seed(5)
    inputs, targets = torch.randint(0, 8192, (8, 16), generator=gen), torch.randint(0, 8192, (8, 16), generator=gen)
    run_workers(_hf_worker, world_size, args=(world_size, str(tmp_path / "store"), str(tmp_path), str(hf_models),
                                              schedules, (inputs, targets), 4))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    for name in ("untied", "tied"):
        reference = transformers.LlamaForCausalLM.from_pretrained(hf_models / name)
        losses = []
        for x, y in zip(inputs.chunk(4), targets.chunk(4)):
            losses.append(plain_loss(reference(x).logits, y))
            (losses[-1] / 4).backward()
        loss = next(r[name]["loss"] for r in ranks if r[name]["loss"] is not None)
        assert_close_rel(loss.item(), torch.stack(losses).mean().item(), what=f"{name} loss")
        expected = {k.replace("model.", "base_model.", 1): p.grad for k, p in reference.named_parameters()}
        if name == "tied":  # transformers' one tied matrix: its gradient is the sum of both uses
            expected["lm_head.weight"] = expected["base_model.embed_tokens.weight"]
        got = {}
        for result in ranks:
            got.update(result[name]["grads"])
        assert sorted(got) == sorted(expected), name
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=1e-7, msg=f"{name} {key}")
        if name == "tied":  # after 3 AdamW steps with clipping, the copies are still one matrix, bit for bit
            after = {}
            for result in ranks:
                after.update(result[name]["after"])
            assert torch.equal(after["base_model.embed_tokens.weight"], after["lm_head.weight"])
        # Loading, saving, training (the tied copies' gradients summed over their group): under NCCL's rules too.
        nccl_rules.check([result[name]["calls"] for result in ranks])
    if world_size < 3:
        return  # the export below runs once, on the checkpoint of 3 stages: it gathers every rank's part
    # Loaded and saved by the pipeline, then exported: the same tensors as the Hugging Face files, bit for bit.
    for name, dtype in (("untied", "float32"), ("tied", "float32"), ("tied_bf16", "bfloat16")):
        out = tmp_path / f"export-{name}"
        result = run_script(0, "export.py", tmp_path / f"ckpt-{name}", out, "--format", "hf", "--dtype", dtype,
                            cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        source = load_file(next((hf_models / name).glob("*.safetensors")))
        exported = load_file(next(out.glob("*.safetensors")))
        assert sorted(exported) == sorted(source), name  # a tied head is stored once, as transformers does
        for key in source:
            assert exported[key].dtype == source[key].dtype and torch.equal(exported[key], source[key]), key


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_python_block(marker: str) -> str:
    """The Python block after MARKER (an HTML comment, `<!-- example: NAME -->`) on the one page of README.md and
    docs/*.md that holds it."""
    (text,) = [t for t in (page.read_text() for page in DOC_PAGES) if marker in t]
    block = text[text.index(marker):]
    return block[block.index("```python\n") + 10:block.index("\n```", block.index("```python"))]


class _ReadsRecorded:
    """safetensors' safe_open, reading as it does, recording the tensor data asked of it: (name, [(start, stop)] per
    dimension) for each slice taken of a get_slice, (name, None) for a whole get_tensor. Headers (shapes) are not
    data: get_shape passes unrecorded."""

    def __init__(self, opened, reads: list):
        self.opened, self.reads = opened, reads

    def __enter__(self):
        self.file = self.opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def metadata(self):
        return self.file.metadata()

    def get_tensor(self, name):
        self.reads.append((name, None))
        return self.file.get_tensor(name)

    def get_slice(self, name):
        whole, reads = self.file.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return whole.get_shape()

            def get_dtype(self):
                return whole.get_dtype()

            def __getitem__(self, index):
                index = index if isinstance(index, tuple) else (index,)
                reads.append((name, [(s.start, s.stop) for s in index]))
                return whole[index]
        return Slice()


def _vocab_rows_worker(rank, world_size, store_path, out_dir, hf_root):
    """Each Hugging Face model loaded as --init-from loads it (checkpoint.load_weights) into this rank's
    --vocab-parallel stage, built as the hand-written script builds it, with safetensors' safe_open recording what
    is read: the reads, this rank's rows of the embedding and the head as loaded, and where its slice starts."""
    import safetensors
    mesh = start_group(rank, world_size, store_path)
    try:
        results = {}
        for name in ("untied", "tied"):
            source = os.path.join(hf_root, name)
            config = checkpoint.read_hf_config(source)
            with torch.device("meta"):
                model = LlamaForPretraining(config)
            partition = manual.partition_model(model, rank, world_size, mesh.get_group("pp"),
                                               even(config.num_hidden_layers, world_size), True, mesh)
            model_module.parallelize([model], mesh, torch.float32)
            model_module.materialize([model], config, torch.device("cpu"), 3)
            reads, real = [], safetensors.safe_open
            with unittest.mock.patch.object(safetensors, "safe_open",
                                            lambda *a, **k: _ReadsRecorded(real(*a, **k), reads)):
                checkpoint.load_weights(source, model, config)
            results[name] = {"reads": reads, "start": partition.vocab.start, "rows": partition.vocab.rows,
                             "embed": model.base_model.embed_tokens.weight.to_local().clone(),
                             "head": model.lm_head.weight.to_local().clone()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_init_from_hugging_face_with_vocab_parallel_reads_each_ranks_rows_only(tmp_path, hf_models):
    # --init-from a Hugging Face directory with --vocab-parallel: each of 3 pipeline ranks reads only its rows of
    # the embedding and of the head (torch.chunk's: 2731, 2731, 2730 of 8192) from the safetensors file, through
    # the real loading path (checkpoint.load_weights: DCP's HuggingFaceStorageReader, whose get_slice reads the
    # bytes of the rows asked for), and holds exactly those rows; tied: one read of the embedding's rows serves
    # both. A rank that read a whole matrix, or another's rows, fails here.
    from safetensors.torch import load_file
    run_workers(_vocab_rows_worker, 3, args=(3, str(tmp_path / "store"), str(tmp_path), str(hf_models)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(3)]
    for name in ("untied", "tied"):
        stored = load_file(hf_models / name / "model.safetensors")
        matrices = ["model.embed_tokens.weight"] + ([] if name == "tied" else ["lm_head.weight"])
        assert [(r[name]["start"], r[name]["rows"]) for r in ranks] == [(0, 2731), (2731, 2731), (5462, 2730)]
        for r in ranks:
            own, rows = r[name]["start"], r[name]["rows"]
            vocab = [(key, span) for key, span in r[name]["reads"] if key in matrices]
            assert sorted(vocab) == sorted((key, [(own, own + rows), (0, 64)]) for key in matrices), (name, vocab)
            for ours, theirs in (("embed", "model.embed_tokens.weight"), ("head", matrices[-1])):
                assert torch.equal(r[name][ours], stored[theirs][own:own + rows]), (name, ours)
        assert all(span is not None for r in ranks for _, span in r[name]["reads"])  # no whole get_tensor


def test_init_from_hugging_face_trains_evaluates_and_exports(tmp_path, hf_models, data_dir):
    import transformers

    tied = str(hf_models / "tied")
    common = ["--init-from", tied, "--batch-size", "8", "--microbatches", "4", "--seq-len", "32", "--warmup-steps",
              "2", "--lr", "1e-2", "--eval-batches", "2", "--data", data_dir]
    train = ["--steps", "4", "--eval-every", "2"]
    runs = {  # name: (processes, script, flags)
        "one": (0, "train_pipeline_gpipe.py", train),
        "gpipe3": (3, "train_pipeline_gpipe.py", train),
        # 2 stages x tp 2: each tensor-parallel rank pairs its rows of the embedding with the head's; each step
        # in 2 schedule steps (--accumulate), the evaluations too
        "manual2xtp2": (4, "train_pipeline_afab_manual.py", [*train, "--schedule", "1f1b", "--tp", "2",
                                                             "--accumulate", "2"]),
        # 4 stages in a V: the evaluations run the script's own forward pass (torch's eval() fails there)
        "tracer2": (2, "train_pipeline_tracer.py", [*train, "--schedule", "zbvzerobubble"]),
        # one stage, dp 2 x tp 2: the head is the embedding's one tensor, built on meta, sharded by FSDP2 over tp
        "one2x2": (4, "train_pipeline_gpipe.py", [*train, "--dp", "2", "--tp", "2"]),
        "eval_one": (0, "train_pipeline_gpipe.py", ["--steps", "0"]),
        "eval3": (3, "train_pipeline_afab_manual.py", ["--steps", "0"]),
        # --vocab-parallel: each rank reads its rows of the tied matrix (one slice serves the embedding and the
        # head), in 2 accumulated schedule steps; and an evaluation alone, at 2 stages x 2 replicas (a quarter each)
        "vocab3": (3, "train_pipeline_afab_manual.py", [*train, "--vocab-parallel", "--schedule", "1f1b",
                                                        "--accumulate", "2"]),
        "vocab_eval2x2": (4, "train_pipeline_afab_manual.py", ["--steps", "0", "--vocab-parallel", "--dp", "2"]),
    }
    procs = {name: run_script(n, *(recorded(tmp_path / f"{name}.calls", script) if n else [script]), *common, *flags,
                              "--metrics", f"{name}.jsonl", "--checkpoint-dir", name, cwd=tmp_path, wait=False)
             for name, (n, script, flags) in runs.items()}
    rows = {}
    for name, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, (name, errors(result.stderr))
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        rows[name] = ([r for r in lines if "loss" in r], [r["eval"] for r in lines if "eval" in r])
        if runs[name][0]:  # the tied copies' gradients summed at tp 2 and dp 2 x tp 2 too: under NCCL's rules
            replayed(tmp_path / f"{name}.calls", runs[name][0], steps=0 if name.startswith(("eval", "vocab_eval"))
                     else 4)
    assert [e["step"] for e in rows["one"][1]] == [2, 4] and [e["step"] for e in rows["eval_one"][1]] == [0]
    assert rows["eval3"][0] == [] and not (tmp_path / "eval3").exists()  # evaluated only, nothing written
    for name in ("gpipe3", "manual2xtp2", "tracer2", "one2x2", "eval3", "vocab3", "vocab_eval2x2"):
        reference = rows["eval_one" if "eval" in name else "one"]
        assert_same_trajectory(rows[name][0], reference[0], name)
        # An evaluation after step s sees the weights that step s + 1 starts from.
        evaluations = [[{"step": e["step"] + 1, "loss": e["loss"]} for e in run[1]] for run in (rows[name], reference)]
        assert_same_trajectory(*evaluations, f"{name} evaluation")
    evaluated = rows["eval_one"][1][0]
    assert evaluated["perplexity"] == pytest.approx(math.exp(evaluated["loss"]))

    # Export the 3-stage run for transformers, in several files: it loads with no missing or unexpected keys,
    # computes the pipeline model's logits, and its tokenizer encodes like ours.
    out = tmp_path / "exported"
    result = run_script(0, "export.py", tmp_path / "gpipe3", out, "--format", "hf", "--max-shard-size", "1MB",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state, config = export.full_model_state(checkpoint.resolve(str(tmp_path / "gpipe3")))
    ours = LlamaForPretraining(config)
    ours.load_state_dict(state, strict=True)
    assert torch.equal(ours.lm_head.weight, ours.base_model.embed_tokens.weight)
    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(1))
    bos = json.loads((Path(data_dir) / "meta.json").read_text())["bos_id"]
    document = tokens[:1].masked_fill(tokens[:1] == bos, bos + 1)
    document[0, 0] = bos  # one document, as --document-masking computes it: the exported model's logits too
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(document).logits, ours(document, model_module.document_positions(
            document, bos)), rtol=1e-5, atol=1e-6)
    # The docs' generation example (docs/hugging-face.md) runs on it.
    block = documented_python_block("<!-- example: generate-hf -->").replace("Llama-3.2-1B-2k", str(out))
    result = start([sys.executable, "-c", block], cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("def read_config(path):"), errors(result.stderr)
    # Its tokenizer is the data's: it encodes as the documents were encoded, and by default begins a text with
    # the bos every training document began with, once.
    from tokenizers import Tokenizer

    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours, meta = Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json")), json.loads(
        (Path(data_dir) / "meta.json").read_text())
    text = "def read_config(path):\n    return json.load(open(path))\n"
    assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text, add_special_tokens=False).ids
    assert (theirs.bos_token_id, theirs.eos_token_id) == (meta["bos_id"], meta["eos_id"])
    assert theirs(text).input_ids == [meta["bos_id"], *ours.encode(text, add_special_tokens=False).ids]
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == meta["bos_id"]

    # A Hugging Face model whose tokenizer is not the one the data was prepared with: refused in one line.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tied, other)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {token: (i + 1) % len(vocab["model"]["vocab"]) for token, i in
                               vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    # And one whose weights file was cut short (an interrupted download): one line naming the file.
    cut = tmp_path / "cut-short"
    shutil.copytree(tied, cut)
    os.truncate(cut / "model.safetensors", (cut / "model.safetensors").stat().st_size // 2)
    # And one whose tensor disagrees with its config.json, on 2 ranks: DCP's CheckpointException (a BaseException
    # in torch 2.13) was a traceback on each; one line for the node, from the rank that holds the layer.
    from safetensors.torch import load_file, save_file
    reshaped = tmp_path / "reshaped"
    shutil.copytree(tied, reshaped)
    tensors = load_file(reshaped / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:100].clone()
    save_file(tensors, reshaped / "model.safetensors", metadata={"format": "pt"})
    procs = {model: run_script(2 if model == reshaped else 0, "train_pipeline_gpipe.py", *common[2:], "--init-from",
                               str(model), "--steps", "0", "--checkpoint-dir", model.name, cwd=tmp_path, wait=False)
             for model in (other, cut, reshaped)}
    one_line_error(finish(procs[other]),
                   f"--init-from {other}: its tokenizer is not the one --data {data_dir} was prepared with")
    one_line_error(finish(procs[cut]), f"--init-from {cut}: model.safetensors is not a complete safetensors file")
    one_line_error(finish(procs[reshaped]), f"--init-from {reshaped}: its tensor model.layers.0.mlp.up_proj.weight "
                                            "is [100, 64], config.json makes it [128, 64]")


def test_export_writes_the_pipelines_weights_for_one_process(tmp_path, reference_run, capsys):
    reference_dir, _ = reference_run
    result = run_script(0, "export.py", reference_dir / "checkpoints", tmp_path / "tiny.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step-00000016" in result.stdout  # the newest checkpoint of the run
    exported = torch.load(tmp_path / "tiny.pt", weights_only=True)

    # Independent route: the library's own converter of the whole DCP checkpoint to one torch.save file.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(reference_dir / "checkpoints" / "step-00000016"), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=False)  # our own file, written just above
    model_state = everything["model"]
    assert sorted(exported) == sorted(model_state)
    for name in exported:
        assert torch.equal(exported[name], model_state[name]), name
    config = LlamaConfig(**json.loads((tmp_path / "tiny.pt.config.json").read_text()))
    LlamaForPretraining(config).load_state_dict(exported, strict=True)

    # Nothing is ever written over, into or around the checkpoint that is read, whatever the flags.
    run_dir = reference_dir / "checkpoints"
    before = snapshot(reference_dir)
    for output in (run_dir, run_dir / "step-00000016", run_dir / "inside.pt", reference_dir):
        for given in ([], ["--format", "hf"]):
            err = refused(capsys, export.main, run_dir, output, *given, "--force")
            assert "inside the checkpoint" in err, err
    assert snapshot(reference_dir) == before
    # Over an existing output: refused in one line, exit status 1, nothing touched; --force replaces an earlier
    # export, never a file or folder of the user's.
    (tmp_path / "precious.pt").write_bytes(b"keep me")
    (tmp_path / "hf-out").mkdir()
    (tmp_path / "hf-out" / "keep").write_text("me")
    for output, given in (("precious.pt", []), ("hf-out", ["--format", "hf"])):
        before = snapshot(tmp_path)
        err = refused(capsys, export.main, run_dir, tmp_path / output, *given)
        assert f"{output} exists" in err and "--force" in err, err
        err = refused(capsys, export.main, run_dir, tmp_path / output, *given, "--force")
        assert "not an earlier export" in err, err
        assert snapshot(tmp_path) == before
    # A directory (or a link) where an export would write OUT.pt.tokenizer.json is not an earlier export either.
    (tmp_path / "tiny.pt.tokenizer.json").unlink()
    (tmp_path / "tiny.pt.tokenizer.json").mkdir()
    (tmp_path / "tiny.pt.tokenizer.json" / "keep").write_text("me")
    before = snapshot(tmp_path)
    assert "not an earlier export" in refused(capsys, export.main, run_dir, tmp_path / "tiny.pt", "--force")
    assert snapshot(tmp_path) == before
    shutil.rmtree(tmp_path / "tiny.pt.tokenizer.json")
    (tmp_path / "tiny.pt").write_bytes(b"an earlier export, now out of date")
    assert run_main(capsys, export.main, run_dir, tmp_path / "tiny.pt", "--force")[0] == 0
    tokenizer = (run_dir / "step-00000016" / "tokenizer.json").read_bytes()
    assert (tmp_path / "tiny.pt.tokenizer.json").read_bytes() == tokenizer
    forced = torch.load(tmp_path / "tiny.pt", weights_only=True)
    assert all(torch.equal(forced[name], exported[name]) for name in exported)
    assert run_main(capsys, export.main, run_dir, tmp_path / "hf-new", "--format", "hf")[0] == 0
    assert run_main(capsys, export.main, run_dir, tmp_path / "hf-new", "--format", "hf", "--force")[0] == 0
    assert {"config.json", "tokenizer.json", "model-00001-of-00001.safetensors"} <= {
        p.name for p in (tmp_path / "hf-new").iterdir()}

    # The docs' inference example (docs/checkpoints.md) runs on the exported files, one process, no process group.
    result = start([sys.executable, "-c", documented_python_block("<!-- example: generate -->")], cwd=tmp_path,
                   env=dict(script_env(), PYTHONPATH=str(ROOT)), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def read_config(path):") and len(result.stdout) > 30, result.stdout


def test_the_hugging_face_export_takes_the_special_tokens_from_the_checkpoints_tokenizer(tmp_path, reference_run,
                                                                                          data_dir, capsys):
    # A checkpoint records no token ids: config.json's come from its copy of the data's tokenizer files. One
    # saved before (its meta.json's "tokens", what the data's files said) exports the same config.json.
    from tokenizers import Tokenizer
    source = reference_run[0] / "checkpoints" / "step-00000016"
    meta = json.loads((source / "meta.json").read_text())
    assert "tokens" not in meta
    older = tmp_path / "older" / source.name
    shutil.copytree(source, older)
    (older / "meta.json").write_text(json.dumps({**meta, "tokens": export.special_tokens(data_dir)}))
    configs = []
    for path, out in ((source, tmp_path / "hf"), (older, tmp_path / "older-hf")):
        assert run_main(capsys, export.main, path, out, "--format", "hf")[0] == 0
        configs.append(json.loads((out / "config.json").read_text()))
    data = json.loads((Path(data_dir) / "meta.json").read_text())
    pad = json.loads((Path(data_dir) / "tokenizer_config.json").read_text())["pad_token"]
    pad_id = Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json")).token_to_id(pad)
    assert pad_id is not None
    ids = [configs[0][f"{kind}_token_id"] for kind in ("bos", "eos", "pad")]
    assert ids == [data["bos_id"], data["eos_id"], pad_id]
    assert configs[1] == configs[0]


@pytest.mark.parametrize("field,value,named", [
    ("model_type", "mistral", "model_type"), ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"), ("hidden_act", "gelu", "hidden_act"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope_parameters"),
])
def test_what_model_py_does_not_compute_is_refused_naming_the_field(field, value, named):
    config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, field: value}
    with pytest.raises(ValueError, match=f"config.json {named} = "):
        model_module.config_from_hf(config)


def test_a_tokenizer_is_the_datas_whatever_its_file_spells_differently(tmp_path, data_dir):
    # prepare_data.py saves the tokenizer it was given again (with a bos post-processor, in the tokenizers
    # library's current spelling); the model directory keeps its own file. Same vocabulary and merges: the same.
    original = json.loads((Path(data_dir) / "tokenizer.json").read_text())
    assert all(isinstance(merge, list) for merge in original["model"]["merges"])
    older = json.loads(json.dumps(original))
    older["model"]["merges"] = [" ".join(merge) for merge in original["model"]["merges"]]
    older["post_processor"] = None
    older["model"].pop("ignore_merges", None)
    other = json.loads(json.dumps(original))
    other["model"]["vocab"] = {token: (i + 1) % len(original["model"]["vocab"])
                               for token, i in original["model"]["vocab"].items()}
    for name, tokenizer in (("older", older), ("other", other)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert checkpoint.same_tokenizer(str(tmp_path / "older"), data_dir)
    assert not checkpoint.same_tokenizer(str(tmp_path / "other"), data_dir)


# ----------------------------------------------------------------------------------------------------------
# 6. Planning: plan.py's memory and step time of a layout, computed, and its search

def planned(processes: int, data: str, *given) -> list[dict]:
    """plan.py's figures per pipeline rank for a run of the scripts' flags `given` on that many processes."""
    return plan.plan(plan.build_parser().parse_args(["--processes", str(processes), "--data", data, *given]))["ranks"]


def test_the_plan_counts_each_schedules_activations(parity_run):
    # plan.py's replay of each schedule's order counts each rank's peak within 10 %: the zero-bubble schedules'
    # too, whose I keeps the output gradients its W starts from (and stage 0 runs whole at W); with sequence
    # parallelism, the norms' and the residual stream's activations on 1/tp of the positions; with documents, the
    # rotary tables of each sequence. (Not the tracer's stages with documents: traced for any device, their
    # attention copies K/V heads as a GPU's masked kernel needs, which plan.py, planning the GPipe script, omits.)
    # --vocab-parallel ("vocab", "tied"; AFAB and 1F1B, with replicas, a stage of no layer): what plan.py counts of
    # its variant (vocab_held, vocab_peaks): the layers', the first rank's step embeddings and their gradients, the
    # last's hidden states' gradient, as the meter counts them.
    (pp, dp, tp), variants, (inputs, targets), ranks = parity_run
    (microbatches, _), world_size = parity_step((pp, dp, tp)), pp * dp * tp
    # (Not the orders from files: plan.py replays the schedules it names; a file's order is checked for parity. Not
    # the hand-written pipeline's sequence chunks, "1f1b:4": checked for parity and NCCL's rules.)
    for kind, name, split, documents in ((k, n, s, d) for k, n, s, d in variants
                                         if not (k == "tracer" and d) and not n.endswith(".csv") and ":" not in n):
        tokens, config = len(inputs) // (dp * microbatches) * inputs.shape[1], parity_config(layer_count(split))
        sizes = plan.activation_bytes(config, tokens, inputs.shape[1], False, tp, 8, tp, documents)
        library = {"afab": "gpipe"}.get(name, name)
        per_rank = 1 if kind in ("manual", "vocab", "tied") else 2
        num_stages = pp * len(gpipe.stage_ids(library, 0, pp, per_rank))
        layout = split_layers(split, num_stages)
        vocab = kind in ("vocab", "tied")
        held = plan.vocab_held(layout, sizes, False, tokens, config.hidden_size) if vocab else \
            plan.stage_held(layout, sizes, False)
        peak = plan.replay(plan.schedule_orders(library, pp, microbatches, per_rank), [1.0] * num_stages,
                           [2.0] * num_stages, held, plan.stage_between(layout, sizes))
        peak = (plan.vocab_peaks(peak, held, library, microbatches, tokens, config.hidden_size) if vocab
                else peak)["peak"]
        measured = [r[kind, name, split, documents]["activations"] for r in ranks]
        # The meter counts a storage whole: the token ids the embedding saves and the targets the loss saves are
        # views of the whole batch's (2 KiB), plan.py counts a microbatch's own. Seen on stages without layers.
        assert measured == pytest.approx([peak[r // (dp * tp)] for r in range(world_size)], rel=0.1,
                                         abs=inputs.nbytes + targets.nbytes), (kind, name, split, measured)


@pytest.mark.parametrize("script", sorted(SCRIPT_MODULES))
def test_each_script_reads_an_activation_checkpointing_spec_and_refuses_a_wrong_one_in_one_line(script, capsys):
    # The same flag in every script: bare, full (its meaning before it took a SPEC); left out, none; a SPEC that
    # is no SPEC stops the parser in one line, and one of the wrong length the checks, before any work.
    module = SCRIPT_MODULES[script]
    parse = module.build_parser().parse_args
    assert [parse(argv).activation_checkpointing for argv in ([], ["--activation-checkpointing"],
                                                              ["--activation-checkpointing", "2,selective"])] == \
        ["none", "full", "2,selective"]
    err = refused(capsys, parse, "--activation-checkpointing", "half", status=2)
    assert err.startswith("error: argument --activation-checkpointing: give full, selective, none, or one per "
                          "stage separated by commas"), err
    with pytest.raises(checkpoint.UsageError, match=r"^--activation-checkpointing 1,0,0: 3 entries for 2 stages; "
                                                    r"give one per stage \(2\), or one for all$"):
        checked_args(module, ["--activation-checkpointing", "1,0,0", "--checkpoint-dir", os.devnull + "/none"], 2,
                     "cpu")
    # A count beyond a stage's layers (tiny's 6 on 2 stages) is a mistake, not full; auto is plan.py's choice.
    with pytest.raises(checkpoint.UsageError, match=r"^--activation-checkpointing 7: 7 layer\(s\) recomputed whole, "
                                                    r"but the largest stage holds (\d) \(--split balanced: \[\d, \d\] "
                                                    r"layers\); give at most \1, or full$"):
        checked_args(module, ["--activation-checkpointing", "7"], 2, "cpu")
    with pytest.raises(checkpoint.UsageError, match=r"^--activation-checkpointing 6,0: 6 layer\(s\) recomputed whole, "
                                                    r"but stage 0 holds 5 "):
        checked_args(module, ["--activation-checkpointing", "6,0", "--split", "5,1"], 2, "cpu")
    assert checked_args(module, ["--activation-checkpointing", "5,1", "--split", "5,1"], 2, "cpu")
    err = refused(capsys, parse, "--activation-checkpointing", "auto", status=2)
    assert "auto is plan.py's: plan.py --processes N --activation-checkpointing auto" in err, err


def test_the_plan_chooses_the_least_checkpointing_that_fits_more_on_the_early_ranks(capsys):
    # plan.py --activation-checkpointing auto: for a --gpu-memory cap, each rank's least recomputation that fits
    # (none, selective, then the first 1, 2, ... of its layers whole). 1F1B's rank r holds p - r microbatches: the
    # first ranks recompute more. What it prints is a SPEC the scripts take, and the plan at that SPEC fits.
    run = ["--processes", "4", "--model", "small", "--batch-size", "64", "--microbatches", "8", "--device", "cpu",
           "--schedule", "1f1b"]
    expected = {"1.5": "selective,0,0,0", "1.2": "selective,selective,0,0", "1": "3,selective,0,0"}
    for memory, spec in expected.items():
        auto = plan.main([*run, "--activation-checkpointing", "auto", "--gpu-memory", memory])["ranks"]
        assert f"fits --gpu-memory {memory} with --activation-checkpointing {spec}: " in capsys.readouterr().out
        assert [row["total"] for row in auto] == [row["total"] for row in plan.main(
            [*run, "--activation-checkpointing", spec])["ranks"]]
        budget = float(memory) * 1e9 * (1 - plan.HEADROOM)
        assert max(row["total"] for row in auto) <= budget < max(row["total"] for row in plan.main(run)["ranks"])
        capsys.readouterr()
    # An order plan.py generates depends on what the stages hold: generated again for each SPEC tried.
    plan.main([*run[:-1], "zb1p", "--activation-checkpointing", "auto", "--gpu-memory", "1.2"])
    assert "fits --gpu-memory 1.2 with --activation-checkpointing " in capsys.readouterr().out
    # Each schedule of the table its own choice, on its own stages (1F1B's SPEC of 4 entries fits no 8 stages): the
    # one it gets as --schedule; where none fits, the row says what would.
    table = plan.main([*run, "--activation-checkpointing", "auto", "--gpu-memory", "1.5"])["schedules"]
    assert "zbh2                   not possible here: --gpu-memory 1.5: pipeline rank" in capsys.readouterr().out
    assert len(table["interleaved1f1b"]["checkpointing"].split(",")) == 8, table
    plan.main([*run[:-1], "interleaved1f1b", "--activation-checkpointing", "auto", "--gpu-memory", "1.5"])
    assert f"with --activation-checkpointing {table['interleaved1f1b']['checkpointing']}: " in capsys.readouterr().out
    # A SPEC's entries per stage (model.checkpointing_plan), and what each of a stage's layers does.
    assert model_module.checkpointing_plan("3,selective,0,0", 4, [0, 1]) == [3, "selective"]
    assert model_module.checkpointing_plan(True, 2) == ["full", "full"]
    assert model_module.layer_checkpointing(2, 3) == ["full", "full", "none"]


def test_the_plan_counts_the_start_up_peak(startup_runs, tmp_path, monkeypatch, capsys):
    # plan.py's start-up peak (the rank's shards and the largest whole tensor of its stages) is what every script's
    # start-up measured, within 10 %: one stage, tied, at tp 2, dp 2 and dp 2 x tp 2 (startup_runs); and it shows
    # it beside the other figures of each rank.
    config = write_config(tmp_path / "config.json", hf_config(STARTUP_CONFIG, 1, 2, None, torch.float32))
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    for (dp, tp), ranks in startup_runs.items():
        (row,) = plan.main(["--processes", str(dp * tp), "--dp", str(dp), "--tp", str(tp), "--model", config,
                            "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--device", "cpu"])["ranks"]
        assert "start-up: shards + the largest whole tensor" in capsys.readouterr().out
        measured = [result["peak"] for results in ranks for result in results.values()]
        assert measured == pytest.approx([row["startup"]] * len(measured), rel=0.1), (dp, tp, row["startup"])
        assert row["startup"] < row["total"]  # here the step holds more: the total is the step's


def test_plan_says_what_torchs_schedules_say_of_the_microbatches():
    # The scripts leave the microbatch rules to torch (a schedule's constructor raises; the script passes the
    # message on); plan.py, which builds no schedule, states them itself. Every schedule, pipeline size and
    # microbatch count: the same verdict as torch's constructor, fed placeholder stages.
    runtime = torch.distributed.pipelining.schedules._PipelineScheduleRuntime
    for name, schedule in gpipe.SCHEDULES.items():
        for pp in (2, 3, 4):
            stages = gpipe.stage_ids(name, 0, pp, 2)
            num_stages = pp * len(stages)
            for m in range(1, 13):
                placeholders = [types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0,
                                                      stage_index=s, is_first=s == 0, is_last=s == num_stages - 1,
                                                      submod=nn.Module()) for s in stages]
                with unittest.mock.patch.object(runtime, "_prepare_schedule_with_comms", lambda *a, **k: None):
                    try:
                        schedule(placeholders[0] if name in gpipe.SINGLE_STAGE else placeholders, n_microbatches=m)
                        accepted_by_torch = True
                    except ValueError:
                        accepted_by_torch = False
                try:
                    plan.check_microbatches(name, pp, m, num_stages)
                    accepted_by_plan = True
                except checkpoint.UsageError:
                    accepted_by_plan = False
                assert accepted_by_plan == accepted_by_torch, (name, pp, m)


def test_the_plan_counts_what_the_runs_hold(layout_runs, data_dir):
    # plan.py computes what the layout runs measured, within 10 %: each rank's parameter, gradient and AdamW
    # bytes, with and without replicas, and the activations held, with and without checkpointing and sequence
    # parallelism, in all three scripts; exactly the bytes each rank sends to other stages a step; the copy of
    # its state a background save stages; and the peak of its start-up (model.materialize: its shards and, when
    # sharded, the largest whole tensor of its stages). Checkpointing full, selective (what its kept ops give out)
    # and per stage (perstage2: selective on the first, its layer whole on the second).
    runs, _ = layout_runs
    for name in ("gpipe2", "checkpointed2", "perstage2", "gpipe2x2", "tracer2x2", "1f1b2x2", "afab2xtp2",
                 "afab2xtp2nosp", "gpipe2x2xtp2", "1f1b2x2xtp2"):
        processes, script, extra = LAYOUT_RUNS[name]
        shape = ["--layers", "4", "--batch-size", "8", "--microbatches", "4", "--seq-len", "32"]
        ranks = planned(processes, data_dir, *shape, *itertools.takewhile(  # the flags plan.py shares
            lambda flag: flag not in ("--trace", "--checkpoint-every"), extra))
        on_rank = [ranks[r // (processes // len(ranks))] for r in range(processes)]  # pp outermost, then dp, tp
        measured = runs[name][3]
        for kind in ("param", "grad", "optimizer", "startup"):
            assert measured[f"{kind}_bytes_per_rank"] == pytest.approx([row[kind] for row in on_rank], rel=0.1), \
                (name, kind)
        flag = extra.index("--activation-checkpointing") + 1 if "--activation-checkpointing" in extra else None
        spec = "none" if flag is None else extra[flag] if flag < len(extra) and extra[flag][0] != "-" else "full"
        key = {"none": "activations", "full": "activations_checkpointed"}.get(spec, "activations_flagged")
        assert measured["activation_bytes_per_rank"] == pytest.approx([row[key] for row in on_rank], rel=0.1), \
            (name, key, on_rank)
        assert measured["sent_bytes_per_rank"] == [row["sent"] for row in on_rank], name
        # --async-checkpoint: the copy of the weights and AdamW state each rank stages in CPU memory (its shards)
        assert measured["checkpoint_staging_bytes_per_rank"] == pytest.approx(
            [row.get("staged", 0) for row in on_rank], rel=0.1), name
        assert ("--async-checkpoint" in extra) == (min(measured["checkpoint_staging_bytes_per_rank"]) > 0), name
    # Sequence parallelism: each tensor-parallel rank sends 1/tp of the bytes to the next stage (measured, 5 %) and
    # holds fewer activations (the norms' and the residual stream's on half the positions).
    with_sp, without = (runs[name][3]["sent_bytes_per_rank"] for name in ("afab2xtp2", "afab2xtp2nosp"))
    assert with_sp == pytest.approx([b / 2 for b in without], rel=0.05) and min(with_sp) > 0
    with_sp, without = (runs[name][3]["activation_bytes_per_rank"] for name in ("afab2xtp2", "afab2xtp2nosp"))
    assert all(a < b for a, b in zip(with_sp, without)), (with_sp, without)
    # Each replica holds half of its stage's parameters, gradients and AdamW state (ranks 0, 1: stage 0).
    for kind in ("param", "grad", "optimizer"):
        alone, sharded = (runs[name][3][f"{kind}_bytes_per_rank"] for name in ("gpipe2", "gpipe2x2"))
        for rank, bytes_held in enumerate(sharded):
            assert bytes_held == pytest.approx(alone[rank // 2] / 2, rel=0.01), (kind, alone, sharded)


def test_the_replay_gives_gpipes_bubble_and_1f1bs_activations():
    for p, m in [(2, 4), (4, 8), (8, 3)]:
        equal = plan.replay(plan.schedule_orders("gpipe", p, m, 1), [1.0] * p, [2.0] * p, [1.0] * p)
        assert equal["bubble"] == pytest.approx((p - 1) / (m + p - 1))
        assert equal["step"] == pytest.approx((m + p - 1) * 3.0)
        assert list(equal["peak"].values()) == [m] * p  # GPipe holds every microbatch
        assert plan.schedule_orders("afab", p, m, 1) == plan.schedule_orders("gpipe", p, m, 1)
        one_f_one_b = plan.replay(plan.schedule_orders("1f1b", p, m, 1), [1.0] * p, [2.0] * p, [1.0] * p)
        assert list(one_f_one_b["peak"].values()) == [min(m, p - r) for r in range(p)]
        # A message of 0.25 delays each of the p - 1 hops down and back up once: the step by 2 (p - 1) x 0.25.
        sent = plan.replay(plan.schedule_orders("gpipe", p, m, 1), [1.0] * p, [2.0] * p, [1.0] * p, message=0.25)
        assert sent["step"] == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.25)
    # ... and only between ranks. ZB-V on 2 ranks, one microbatch: F0 F1 F2 F3 I3 I2 W2 I1 I0 W0 in a chain, 4 hops
    # between ranks (0 to 1 and 2 to 3, and back); stages 1 and 2 are both on rank 1.
    for message in (0.0, 0.5):
        v = plan.replay(plan.schedule_orders("zbvzerobubble", 2, 1, 2), [1.0] * 4, [2.0] * 4, [0.0] * 4,
                        split=([1.0] * 4, [1.0] * 4), message=message)
        assert v["step"] == pytest.approx(10 + 4 * message), v
    # Every schedule torch ships replays (its own order, from placeholder stages) without a deadlock, and no
    # schedule beats the work itself.
    for name, pp in itertools.product(gpipe.SCHEDULES, (4, 8)):
        stages = pp * (1 if name in gpipe.SINGLE_STAGE else 2)
        m = 2 * stages  # enough for every schedule (DualPipeV needs as many as stages)
        result = plan.replay(plan.schedule_orders(name, pp, m, 2), [1.0] * stages, [2.0] * stages, [1.0] * stages)
        assert result["step"] >= m * stages * 3 / pp and 0 <= result["bubble"] < 0.5, (name, pp, result)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_replay_gives_the_published_bubbles(p):
    # Every stage costs the same: forward 1, backward 2 (input and weight gradient 1 each for zero bubble).
    for m in (p, 2 * p, 4 * p, 3 * p + 1):
        for name in ("gpipe", "1f1b"):  # (p - 1) / (m + p - 1) of the step
            result = plan.replay(plan.schedule_orders(name, p, m, 1), [1.0] * p, [2.0] * p, [0.0] * p)
            assert result["bubble"] == pytest.approx((p - 1) / (m + p - 1)), (name, p, m)
        # ZB-H1 (Qi et al. 2023), T_F = T_B = T_W: (p - 1) / (3m) of the bubble-free time, 3m per rank.
        result = plan.replay(plan.schedule_orders("zbh1", p, m, 1), [1.0] * p, [2.0] * p, [0.0] * p)
        assert (result["step"] - 3 * m) / (3 * m) == pytest.approx((p - 1) / (3 * m)), (p, m)
    # Interleaved 1F1B (Narayanan et al. 2021), v stages per rank costing 1/v each: (p - 1) / (v m) of the
    # bubble-free time (m a multiple of p, as torch's schedule asks).
    for v, m in itertools.product((2, 3, 4), (p, 2 * p, 4 * p)):
        n = p * v
        result = plan.replay(plan.schedule_orders("interleaved1f1b", p, m, v), [1 / v] * n, [2 / v] * n, [0.0] * n)
        assert (result["step"] - 3 * m) / (3 * m) == pytest.approx((p - 1) / (v * m)), (p, v, m)


@pytest.mark.parametrize("how", ["full", "selective"])
def test_the_plan_counts_the_recomputation_of_a_split_backward(how, one_process_group):
    # ZBV's two stages on one rank, each layer checkpointed: count each layer's forwards in one step. torch
    # runs stage 0's backward whole (one recomputation); stage 1 recomputes for its input gradient, and its weight
    # gradient reads what that recomputed (model.checkpoint_once; torch's checkpoint alone recomputed once per
    # weight there, 9 more): what plan.split_backward charges. Selective (torch's op-level policy, its kept outputs
    # handed back by the recomputation) shares I's recomputation with W alike.
    config, m = small_config(layers=2), 2
    modules = [cpu_stage(config, s, even(2, 2)) for s in (0, 1)]
    calls = {0: 0, 1: 0}

    def counted(forward, i):
        def run(*args, **kwargs):
            calls[i] += 1
            return forward(*args, **kwargs)
        return run
    for i, layer in enumerate(model_module.decoder_layers(modules)):
        layer.forward = counted(layer.forward, i)
    model_module.checkpoint_layers(modules, how)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    built = [PipelineStage(module, s, 2, torch.device("cpu"), group=mesh.get_group("pp"),
                           **gpipe.stage_io(config, s, 2, (2, 16), 1, torch.float32))
             for module, s in zip(modules, (0, 1))]
    with unittest.mock.patch.object(gpipe, "merge_backwards", lambda schedule: schedule):  # every I and W apart
        schedule, _ = gpipe.make_schedule("zbvzerobubble", built, m, 1, 1)
    inputs, targets = random_batch(config, batch=4)
    gpipe.train_step(schedule, inputs, targets, cpu_env(0, 1), 1)
    assert calls == {0: m * 2, 1: m * 2}  # forward, and the recomputation in I (in W for stage 0)
    backward, again = [2.0, 2.0], [1.0, 1.0]  # the plan's I and W: one recomputation in I, none in W
    assert plan.split_backward(backward, again, 0.0) == ([0.0, 1.5], [2.0, 0.5])


@pytest.mark.parametrize("how", ["full", "selective"])
def test_a_checkpointed_layer_that_w_reads_again_unkept_is_recomputed_again_not_wrong(how, one_process_group):
    # model.checkpoint_once keeps from I to W only what the nodes W runs again read (_weights_only finds them).
    # Should it keep nothing, W's read of a freed tensor recomputes the layer once more: one more forward a
    # microbatch on stage 1, and the same loss and gradients as without checkpointing, bit for bit. Selective
    # too: torch refuses a second recomputation of a selective region (its kept outputs were handed back once);
    # model._Reusable lets it run those ops again.
    config, m = small_config(layers=2), 2
    grads, calls, losses = {}, {}, {}
    for checkpointed in (False, True):
        modules = [cpu_stage(config, s, even(2, 2)) for s in (0, 1)]
        for i, layer in enumerate(model_module.decoder_layers(modules)):
            forward = layer.forward
            layer.forward = lambda *a, i=i, forward=forward, **k: calls.update({i: calls.get(i, 0) + 1}) or \
                forward(*a, **k)
        if checkpointed:
            model_module.checkpoint_layers(modules, how)
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
        built = [PipelineStage(module, s, 2, torch.device("cpu"), group=mesh.get_group("pp"),
                               **gpipe.stage_io(config, s, 2, (2, 16), 1, torch.float32))
                 for module, s in zip(modules, (0, 1))]
        with unittest.mock.patch.object(gpipe, "merge_backwards", lambda schedule: schedule):  # I and W apart
            schedule, _ = gpipe.make_schedule("zbvzerobubble", built, m, 1, 1)
        calls.clear()
        with unittest.mock.patch.object(model_module, "_weights_only", lambda fn: False):
            losses[checkpointed] = gpipe.train_step(schedule, *random_batch(config, batch=4), cpu_env(0, 1), 1)
        grads[checkpointed] = {n: p.grad for module in modules for n, p in module.named_parameters()}
    assert calls == {0: m * 2, 1: m * 3}  # forward, I's recomputation (W's for stage 0), and W's again
    assert torch.equal(losses[True], losses[False])
    assert all(torch.equal(grads[True][n], g) for n, g in grads[False].items())


# The Zero Bubble paper (Qi et al., ICLR 2024, arXiv 2401.10241): its 28.3B GPT (62 layers, hidden 6144, 48 heads,
# sequence 1024, microbatch 1) on 32 GPUs, 96 microbatches, pure pipeline. Table 9 profiles a stage (the median
# one, 2 layers) at F 10.419, B 10.207, W 7.715 ms and a message at 0.408 ms; the paper's first and last stages
# hold a layer fewer for the embedding and the loss, each counted as a layer.
ZERO_BUBBLE_28B = {"model_type": "llama", "vocab_size": 50304, "hidden_size": 6144, "intermediate_size": 16384,
                   "num_hidden_layers": 62, "num_attention_heads": 48, "max_position_embeddings": 1024}


def test_the_plan_gives_the_zero_bubble_papers_bubbles_from_its_pass_times(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(ZERO_BUBBLE_28B))
    layer = ",".join(f"{t / 2:g}" for t in (10.419, 10.207, 7.715))  # a stage of Table 9 is 2 layers
    report = plan.main(["--processes", "32", "--model", str(tmp_path / "config.json"), "--seq-len", "1024",
                        "--batch-size", "96", "--microbatches", "96", "--device", "cuda", "--schedule", "1f1b",
                        "--layer-times", layer, "--embed-times", layer, "--head-times", layer, "--message-time",
                        "0.408"])["schedules"]
    out = capsys.readouterr().out
    assert "step time from the measured times, 0.408 ms a message" in out
    # Balanced on those times: a layer fewer on the end stages; with 2 stages per rank, 62 layers on 64 stages, the
    # embedding and the head each a stage of its own.
    assert report["1f1b"]["split"] == ",".join(["1"] + ["2"] * 30 + ["1"])
    for name in ("interleaved1f1b", "zbvzerobubble"):
        assert report[name]["split"] == ",".join(["0"] + ["1"] * 62 + ["0"]), name
    # The bubble, (step - m (F + B + W)) / step, within 2 points of its Table 8 (26.76, 15.09, 5.93 %: torch's ZB-V
    # order is fixed, the paper's adapts to the times); 1F1B's is its Table 5's to the 4 digits printed, 26.46 %.
    assert report["1f1b"]["bubble"] == pytest.approx(0.2646, abs=5e-5)
    for name, published in (("1f1b", 0.2676), ("interleaved1f1b", 0.1509), ("zbvzerobubble", 0.0593)):
        assert report[name]["bubble"] == pytest.approx(published, abs=0.02), name
    # The step against 1F1B's within 0.1 of the measured ratios (Table 4: 0.82 / 0.76 samples per GPU per second;
    # Table 6: 1.01 / 0.82); the paper's own bubbles say 1.16 and 1.28 (docs/plan-vs-the-zero-bubble-paper.md).
    for name, measured in (("interleaved1f1b", 0.82 / 0.76), ("zbvzerobubble", 1.01 / 0.82)):
        assert report["1f1b"]["step"] / report[name]["step"] == pytest.approx(measured, abs=0.1), name
    # The paper's orders, generated from these times with torch's memory (docs/plan-vs-the-zero-bubble-paper.md):
    # a row each; where the ranks start and end apart (ZB-H2) the paper's measure, the longest rank span, is below
    # the step's; ZB-1p's first rank spans the step.
    assert re.search(r"^  zbvauto +step +[\d.]+ ms .*\(generated; [\d.]+% by the paper's measure\)$", out, re.M)
    assert report["zbh2"]["span_bubble"] < report["zbh2"]["bubble"] - 0.04
    assert report["zb1p"]["span_bubble"] == pytest.approx(report["zb1p"]["bubble"])


# The Zero Bubble paper's profiled times (its repository's efficiency.py and v_schedule.py, tag zero-bubble-v0.1.0:
# Table 9's rows) as (p, m, F, B, W, message) in µs, with the hidden size and heads that set its memory model.
ZERO_BUBBLE_TABLE_5 = {  # model: (p, m, F, B, W, c, h, a), and Table 5's ZB-H1, ZB-H2, ZB-1p, ZB-2p
    "1.5B": ((8, 24, 18522, 18086, 9337, 601, 2304, 24), (0.1585, 0.1083, 0.1585, 0.0433)),
    "6.2B": ((8, 24, 29718, 29444, 19927, 527, 4096, 32), (0.1323, 0.0698, 0.1323, 0.0029)),
    "14.6B": ((16, 48, 11347, 11248, 8132, 377, 5120, 40), (0.1397, 0.0672, 0.1397, 0.0066)),
    "28.3B": ((32, 96, 10419, 10207, 7715, 408, 6144, 48), (0.1421, 0.0641, 0.1421, 0.0038)),
}
ZERO_BUBBLE_TABLE_8 = [  # (p, m, F, B, W, c, h, a) of a V's stage (half a rank's layers), and Table 8's ZB-V
    ((16, 48, 14407, 14380, 9676, 1610, 4096, 32), 0.0697), ((16, 64, 14412, 14393, 9688, 1621, 4096, 32), 0.0533),
    ((16, 128, 14316, 14306, 9639, 1619, 4096, 32), 0.0274), ((24, 72, 6763, 6969, 5251, 755, 5120, 40), 0.0638),
    ((24, 96, 6783, 6984, 5259, 758, 5120, 40), 0.0483), ((24, 192, 6785, 6990, 5260, 770, 5120, 40), 0.0250),
    ((32, 96, 9458, 9748, 7288, 879, 6144, 48), 0.0593), ((32, 128, 9469, 9744, 7306, 892, 6144, 48), 0.0451),
    ((32, 256, 9447, 9644, 7193, 887, 6144, 48), 0.0236)]


def zero_bubble_inputs(n: int, F: float, B: float, W: float, h: int, a: int) -> tuple[dict, dict, int]:
    """n stages' times and the paper's memory per microbatch (sequence 1024): a forward holds 34h + 5as, the
    input gradient frees all but the weight gradient's 32h, which W frees; and the forward's memory."""
    held, kept = 34 * h + 5 * a * 1024, 32 * h
    return ({"F": [F] * n, "I": [B] * n, "W": [W] * n}, {"F": [held] * n, "I": [kept - held] * n, "W": [-kept] * n},
            held)


def zero_bubble_replay(orders: dict, n: int, F: float, B: float, W: float, c: float) -> dict:
    return plan.replay(orders, [F] * n, [B + W] * n, [0.0] * n, split=([B] * n, [W] * n), message=c)


def test_the_generated_orders_give_the_zero_bubble_papers_table_5():
    # The paper's handcrafted ZB-H1 / ZB-H2 and its automatic heuristic at p and 2p microbatches' memory (ZB-1p,
    # ZB-2p), from its profiled times: Table 5's bubble rates within 0.1 point (to the 4 digits printed, today),
    # by its measure: the idle share of the longest rank's span (plan.span_bubble).
    for model, ((p, m, f, b, w, c, h, a), published) in ZERO_BUBBLE_TABLE_5.items():
        cost, memory, held = zero_bubble_inputs(p, f, b, w, h, a)
        orders = (plan.schedule_orders("zbh1", p, m, 1), plan.schedule_orders("zbh2", p, m, 1),
                  *(plan.zb_orders(cost, memory, [cap * p * held] * p, m, c) for cap in (1, 2)))
        for name, order, rate in zip(("ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p"), orders, published):
            result = zero_bubble_replay(order, p, f, b, w, c)
            assert plan.span_bubble(result) == pytest.approx(rate, abs=1e-3), (model, name)
            if name in ("ZB-H1", "ZB-1p"):  # the first rank spans the step: the replay's bubble too
                assert result["bubble"] == pytest.approx(rate, abs=1e-3), (model, name)
        # Each rank holds what its cap allows: the most held at any moment, by the paper's memory model.
        for cap in (1, 2):
            result = plan.replay(plan.zb_orders(cost, memory, [cap * p * held] * p, m, c), [f] * p, [b + w] * p,
                                 [held] * p, [32 * h - held] * p, ([b] * p, [w] * p), c)
            assert max(result["peak"].values()) <= cap * p * held, (model, cap)


def test_the_generated_v_gives_the_zero_bubble_papers_table_8():
    # The paper's V scheduler, re-implemented, on the nine settings of its Table 8 (2p stages, each rank's two a V,
    # at 1F1B's memory: 2p stages' forwards): its ZB-V column within 0.1 point (to the 4 digits printed, today).
    # torch's fixed ScheduleZBVZeroBubble order, replayed with the same times and measured alike, lands within 0.2
    # points of it (docs/plan-vs-the-zero-bubble-paper.md: above it at p 16, below it at p 24 and 32).
    # plan.py's zbvauto picks by the step instead (by="step", torch's V a candidate: torch's runtime synchronizes
    # every step), from the same attempts: never a longer step than torch's V (the paper's pick has one on all nine,
    # 0.08-1.1 % longer), but for a tie (plan.STEP_TIE, 0.1 %: then the one that holds less).
    for (p, m, f, b, w, c, h, a), published in ZERO_BUBBLE_TABLE_8:
        cost, memory, held = zero_bubble_inputs(2 * p, f, b, w, h, a)
        torch_v = plan.schedule_orders("zbvzerobubble", p, m, 2)
        paper, by_step = plan.zbv_orders(cost, memory, [2 * p * held] * p, m, c, ("span", "step"), (torch_v,))
        ours = zero_bubble_replay(paper, 2 * p, f, b, w, c)
        assert plan.span_bubble(ours) == pytest.approx(published, abs=1e-3), (p, m)
        torchs = zero_bubble_replay(torch_v, 2 * p, f, b, w, c)
        assert plan.span_bubble(torchs) == pytest.approx(published, abs=2e-3), (p, m)
        assert zero_bubble_replay(by_step, 2 * p, f, b, w, c)["step"] <= torchs["step"] * (1 + plan.STEP_TIE), (p, m)


@pytest.mark.parametrize("pp", [2, 3])
def test_the_generated_orders_are_chosen_by_the_step_torchs_runtime_takes(pp, capsys):
    # small, 8 microbatches of 1 x 128, from the pass times traced there (docs/schedules-and-benchmark.md: a layer
    # 44.9 / 92.8 ms, the head with the loss 28 / 67.1 ms, each backward in equal halves as plan.py cuts a trace's;
    # the embedding's not listed there, 2 ms). Picked by the paper's measure, zbvauto's step was 1.025 x torch's
    # V's at 2 ranks; picked by the step, with the fixed orders of the same placement as candidates, it is never
    # predicted slower than those (but for a tie, plan.STEP_TIE: then the one that holds less): torch's V, and
    # ZB-H2 for zb2p.
    report = plan.main(["--processes", str(pp), "--model", "small", "--seq-len", "128",
                        "--batch-size", "8", "--microbatches", "8", "--device", "cpu", "--schedule", "zbvauto",
                        "--layer-times", "44.9,46.4,46.4", "--embed-times", "2,1,1", "--head-times",
                        "28,33.55,33.55"])["schedules"]
    assert report["zbvauto"]["step"] <= report["zbvzerobubble"]["step"] * (1 + plan.STEP_TIE)
    assert report["zb2p"]["step"] <= report["zbh2"]["step"] * (1 + plan.STEP_TIE)
    out = capsys.readouterr().out
    assert re.search(r"^  zbvauto +step .*\(generated; [\d.]+% by the paper's measure\)$", out, re.M)


# The Vocabulary Parallelism paper (Yeung et al., MLSys 2025, arXiv 2411.05288): its ~4B model (32 layers, hidden
# 3072, FFN 12288, 24 heads) on 8 A100, PP 8, 1F1B, 128 microbatches of one sequence. Copied from its artifact's
# measurements, sail-sg/VocabularyParallelism artifact/exp_one_host.csv (commit 6191c3b; the file is not part of
# this project): per row, (method, vocabulary, seq) -> each stage's forward and backward µs per microbatch (its
# columns 26 and 27), the measured bubble in % (column 34), and the layers per stage (base: even; redis: fewer on
# the last stage, as the forward times show: 4 layers take 10.5 ms at 2k, 5 take 13.3).
VOCAB_PARALLEL_4B = {"model_type": "llama", "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 12288,
                     "num_hidden_layers": 32, "num_attention_heads": 24, "max_position_embeddings": 4096}
VOCAB_PARALLEL_MEASURED = {
    ("base", 256000, 2048): ("10572 10591 10475 10725 10360 10444 10381 36818",
                             "25185 21108 20737 21143 20805 21030 20827 52363", 57.20, "4,4,4,4,4,4,4,4"),
    ("redis", 256000, 2048): ("10627 10656 10606 13501 13327 13257 13200 26019",
                              "25401 21220 20851 26906 26392 26589 26431 30535", 33.57, "4,4,4,5,5,5,5,0"),
    ("base", 128000, 2048): ("10599 10616 10637 10612 10352 10540 10470 24152",
                             "23338 20978 20968 21162 20785 21242 21067 37615", 44.38, "4,4,4,4,4,4,4,4"),
    ("redis", 128000, 2048): ("10696 10629 10572 10612 10444 13674 13660 18708",
                              "23417 21081 20955 21362 20975 27415 27328 26685", 24.90, "4,4,4,4,4,5,5,2"),
    ("base", 256000, 4096): ("24223 23749 23346 23621 23470 23433 23650 76548",
                             "50416 45615 45146 45292 45518 45198 45715 106804", 55.14, "4,4,4,4,4,4,4,4"),
    ("redis", 256000, 4096): ("24391 23909 23369 30201 29923 30086 30028 52733",
                              "50764 46045 45464 58007 57927 58110 58271 58574", 27.22, "4,4,4,5,5,5,5,0"),
    ("base", 128000, 4096): ("24234 23606 23381 23389 23356 23545 23397 50855",
                             "48131 45522 45045 45316 45557 45624 45351 77239", 42.02, "4,4,4,4,4,4,4,4"),
    ("redis", 128000, 4096): ("24367 23848 23524 23500 23441 30108 30020 39031",
                              "48636 46143 45525 45740 45928 59536 59052 53522", 20.33, "4,4,4,4,4,5,5,2"),
}


# Its vocab-1 runs (the same file): each stage's forward (column 26) and its backward with the S and T passes'
# times added (columns 27-31), the measured bubble (column 34).
VOCAB_PARALLEL_VOCAB_1 = {
    (256000, 2048): ("10936 11477 11316 11010 11362 11428 11847 11108",
                     "32904 32285 32196 33315 31903 32667 32670 32093", 6.52),
    (128000, 2048): ("10840 11594 11286 10806 11229 11464 11898 11172",
                     "28497 27804 27793 28655 27548 28732 28799 28168", 8.02),
    (256000, 4096): ("23997 26990 25665 23827 25982 25546 27368 25087",
                     "69026 67740 66420 68561 66767 67664 68473 67513", 6.66),
    (128000, 4096): ("23864 27013 25923 23495 25882 25263 27090 24707",
                     "61028 59515 58970 59647 58250 59956 60877 60061", 7.63),
}


def vocab_parallel_4b(tmp_path, vocab: int) -> str:
    path = tmp_path / f"config-{vocab}.json"
    path.write_text(json.dumps({**VOCAB_PARALLEL_4B, "vocab_size": vocab}))
    return str(path)


def test_the_plan_replays_the_vocabulary_parallelism_papers_stage_times_to_its_measured_bubbles(tmp_path, capsys):
    # Each run's own per-stage times through --stage-times: the 1F1B replay's bubble within 1.5 points of the
    # measured one on all 8 rows (the replay counts no communication and no step-to-step jitter: 0.0-1.1 points
    # below, the measured steps longer). Wrong by more: a stage's times in the wrong place, or B's halves
    # counted twice (the base rows' bubbles are 44-57 %, the redistributed ones' 20-34 %).
    for (method, vocab, seq), (forward, backward, bubble, split) in VOCAB_PARALLEL_MEASURED.items():
        ms = lambda text: ",".join(f"{int(t) / 1e3:g}" for t in text.split())  # noqa: E731  (µs -> ms)
        report = plan.main(["--processes", "8", "--model", vocab_parallel_4b(tmp_path, vocab), "--seq-len", str(seq),
                            "--batch-size", "128", "--microbatches", "128", "--device", "cuda", "--schedule", "1f1b",
                            "--split", split, "--stage-times", f"{ms(forward)}/{ms(backward)}"])
        row = report["schedules"]["1f1b"]
        assert row["split"] == split
        assert row["bubble"] * 100 == pytest.approx(bubble, abs=1.5), (method, vocab, seq)
        # The step itself: m (F + B) of the slowest stage, plus the others' once each (the fill and drain).
        times = [[int(t) / 1e6 for t in text.split()] for text in (forward, backward)]
        slowest = max(range(8), key=lambda s: times[0][s] + times[1][s])
        assert row["step"] >= 128 * (times[0][slowest] + times[1][slowest])
    out = capsys.readouterr().out
    assert "step time from --stage-times" in out and "measured time per stage: " in out
    # The vocab-1 runs, their S and T passes counted in the backward (where plan.with_vocab counts them): with
    # --vocab-parallel the given times are the run's own, replayed to the measured bubble within 1.5 points too
    # (0.05-0.84 points today, either side).
    for (vocab, seq), (forward, backward, bubble) in VOCAB_PARALLEL_VOCAB_1.items():
        ms = lambda text: ",".join(f"{int(t) / 1e3:g}" for t in text.split())  # noqa: E731  (µs -> ms)
        report = plan.main(["--processes", "8", "--model", vocab_parallel_4b(tmp_path, vocab), "--seq-len", str(seq),
                            "--batch-size", "128", "--microbatches", "128", "--device", "cuda", "--schedule", "1f1b",
                            "--vocab-parallel", "--stage-times", f"{ms(forward)}/{ms(backward)}"])
        row = report["schedules"]["1f1b --vocab-parallel"]
        assert row["split"] == "4,4,4,4,4,4,4,4"
        assert row["bubble"] * 100 == pytest.approx(bubble, abs=1.5), (vocab, seq)


# The paper's speed-up of Vocab-1 over the base split (vocabulary layers on the end stages, layers even), as MFU
# ratios: its artifact's re-run (artifact/example-results/full-exp.txt, commit 71f0727: 128k 33.70 -> 52.22 %, 256k
# 17.29 -> 51.73 % at 2k; 128k 37.13 -> 57.87 %, 256k 27.63 -> 57.31 % at 4k) and the measured TFLOPS of
# artifact/exp_one_host.csv (column 33: 105.94 -> 159.43, 80.72 -> 159.01 at 2k; 111.99 -> 161.81, 85.60 -> 161.28
# at 4k).
VOCAB_PARALLEL_RERUN = {(128000, 2048): 52.22 / 33.70, (256000, 2048): 51.73 / 17.29,
                        (128000, 4096): 57.87 / 37.13, (256000, 4096): 57.31 / 27.63}
VOCAB_PARALLEL_TFLOPS = {(128000, 2048): 159.43 / 105.94, (256000, 2048): 159.01 / 80.72,
                         (128000, 4096): 161.81 / 111.99, (256000, 4096): 161.28 / 85.60}
VOCAB_PARALLEL_BUBBLE = {(128000, 2048): 8.02, (256000, 2048): 6.52, (128000, 4096): 7.63, (256000, 4096): 6.66}


def test_the_planned_vocabulary_parallel_speed_up_is_the_papers(tmp_path, capsys):
    # The FLOP estimate (no measured time) on the paper's 4B shapes, 1F1B on 8 ranks, 128 microbatches: the step of
    # the even split with the embedding and the head on the end stages over the step with --vocab-parallel, within
    # 15 % of the paper's speed-up (the model of time is good to about that: docs/pipeline-by-hand.md) on every
    # row of both sources but one: the re-run's 256k at 2k, 2.99, which the plan puts at 2.08 (30 % below). That
    # baseline is off from three other measurements of the same run: the artifact's exp_one_host.csv (80.72 TFLOPS,
    # 25.9 % of an A100's 312, a speed-up of 1.97), the paper's Table 5 (25.23 %) and the re-run's own 4k row
    # (27.63 %); the artifact's measured stage times replay to 1.94 (replayed as the test above does).
    for (vocab, seq), rerun in VOCAB_PARALLEL_RERUN.items():
        report = plan.main(["--processes", "8", "--model", vocab_parallel_4b(tmp_path, vocab), "--seq-len", str(seq),
                            "--batch-size", "128", "--microbatches", "128", "--device", "cuda", "--schedule", "1f1b",
                            "--split", "even"])["schedules"]
        plain, spread = report["1f1b"], report["1f1b --vocab-parallel"]
        assert plain["split"] == spread["split"] == "4,4,4,4,4,4,4,4"
        speed_up = plain["step"] / spread["step"]
        assert speed_up == pytest.approx(VOCAB_PARALLEL_TFLOPS[vocab, seq], rel=0.15), (vocab, seq)
        if (vocab, seq) != (256000, 2048):
            assert speed_up == pytest.approx(rerun, rel=0.15), (vocab, seq)
        # Vocab-1's bubble: the replay's within 3 points of the measured (it counts the collectives in the
        # backward and no synchronization of the S and T passes: 5.2 % against 6.5-8.0 %).
        assert spread["bubble"] * 100 == pytest.approx(VOCAB_PARALLEL_BUBBLE[vocab, seq], abs=3), (vocab, seq)
    out = capsys.readouterr().out
    assert re.search(r"^  afab --vocab-parallel +step .* bubble", out, re.M)
    assert re.search(r"^  1f1b --vocab-parallel +step .* bubble", out, re.M)


@pytest.mark.parametrize("tied", [False, True])
def test_the_vocabulary_parallel_plan_holds_a_slice_of_the_vocabulary_on_every_rank(tied, tmp_path, capsys):
    # The memory table under --vocab-parallel (8 ranks, the 4B shapes at 256k): every rank holds 1/8 of the
    # embedding's and of the head's rows (tied: one slice for both), so the parameters over all ranks are the plain
    # split's (tied: less the head's copy on the last stage); every rank's output pass holds for a moment one loss
    # piece's logits slice, 1/8 of the last rank's logits, and the head's gradient; the activations are what the
    # script's variant holds: 1F1B's layers' (p - r microbatches on rank r), on the first rank the step's 128 input
    # embeddings and, after each one's backward, its gradient (till the step's end), on the last the hidden states'
    # gradient of one microbatch (from its output pass to its backward).
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**VOCAB_PARALLEL_4B, "tie_word_embeddings": tied}))
    argv = ["--processes", "8", "--model", str(path), "--seq-len", "2048", "--batch-size", "128", "--microbatches",
            "128", "--device", "cuda", "--schedule", "1f1b", "--split", "even"]
    plain, spread = (plan.main(argv + flag)["ranks"] for flag in ([], ["--vocab-parallel"]))
    config = plan.plan_config(plan.build_parser().parse_args(argv))
    vocab = config.vocab_size * config.hidden_size
    assert sum(r["param"] for r in spread) == pytest.approx(sum(r["param"] for r in plain) - (4 * vocab if tied
                                                                                               else 0))
    assert len({r["param"] for r in spread[:-1]}) == 1 and spread[-1]["param"] == pytest.approx(
        spread[0]["param"] + 4 * config.hidden_size)  # the final norm's gain, on the last stage
    h, piece = config.hidden_size, 3 * 4 * 2048 // 8  # a piece's fp32 logits, exponentials, gradient, per row
    assert plain[-1]["loss"] == pytest.approx(256000 * piece)
    assert all(r["loss"] == pytest.approx(32000 * piece + 2 * 4 * 32000 * h + 2048 * h * (2 + 8)) for r in spread)
    sizes = plan.activation_bytes(config, 2048, 2048, True, chunks=8)
    held, embedding = plan.vocab_held(even(32, 8), sizes, False, 2048, h), 4 * 2048 * h  # (each fp32)
    assert held[0] == pytest.approx(plan.stage_held(even(32, 8), sizes, False)[0] - sizes["embed"] - embedding)
    assert spread[0]["activations"] == pytest.approx(max(min(8, 128 - j) * held[0] + (128 + j) * embedding
                                                         for j in range(128)))
    assert [r["activations"] for r in spread[1:]] == pytest.approx([(8 - r) * held[r] for r in range(1, 7)]
                                                                   + [held[7] + embedding])
    assert max(r["total"] for r in spread) < max(r["total"] for r in plain)
    # Sent a step: the hidden states to the next stage, and each microbatch's collectives (four bf16 hidden states,
    # three fp32 all-reduces of a number per token, 7/8 of it in a ring).
    collectives = 4 * 2048 * 3072 * 2 + 3 * 2 * 7 / 8 * 4 * 2048
    assert [r["sent"] for r in spread] == [pytest.approx(r["sent"] + 128 * collectives) for r in plain]
    out = capsys.readouterr().out
    assert "--vocab-parallel: the embedding and the head with its loss split by vocabulary over all 8 ranks, 32000 " \
           "rows each" in out


def test_the_vocabulary_parallel_step_counts_its_collectives_at_the_node_bandwidth(tmp_path):
    # Every rank's backward takes the collectives' time (nothing overlapped): per microbatch the hidden states
    # (bf16) four times over a GPU's link (broadcast to all, their gradient summed back, the embedding's output
    # summed to stage 0, its gradient broadcast back) and three fp32 all-reduces of a number per token. On equal
    # stages a 1F1B step is m + p - 1 of them: at 1 GB/s inside the node the step grows by exactly that much.
    argv = ["--processes", "8", "--model", vocab_parallel_4b(tmp_path, 256000), "--seq-len", "2048", "--batch-size",
            "128", "--microbatches", "128", "--device", "cuda", "--schedule", "1f1b", "--split", "even"]
    fast, slow = (plan.main(argv + ["--intra-node-bandwidth", bw])["schedules"] for bw in ("300", "1"))
    per_microbatch = (4 * 2048 * 3072 * 2 + 3 * 2 * 7 / 8 * 4 * 2048) * (1 / 1e9 - 1 / 300e9)
    assert slow["1f1b --vocab-parallel"]["step"] - fast["1f1b --vocab-parallel"]["step"] == pytest.approx(
        (128 + 8 - 1) * per_microbatch)
    assert slow["1f1b"] == fast["1f1b"]  # the plain split sends nothing the plan times here


def test_the_search_proposes_vocabulary_parallelism_where_it_pays(tmp_path, capsys, monkeypatch):
    # The paper's 4B at 256k on 8 GPUs of 80 GB: the search proposes the hand-written 1F1B with --vocab-parallel at
    # pp 8 (128 microbatches), faster than the plain 1F1B at the same shape, whose split the search balances (the
    # paper's "redis": the last stage's layers moved to the others), within 15 % of the paper's speed-up over redis
    # (the re-run's 38.21 -> 51.73 % MFU, 1.35; exp_one_host.csv's 124.52 -> 159.01 TFLOPS, 1.28; planned: 1.30);
    # every --vocab-parallel row it keeps is faster than its plain twin where that fits, and runs the hand-written
    # script.
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    rows = plan.main(["--gpus", "8", "--model", vocab_parallel_4b(tmp_path, 256000), "--seq-len", "2048",
                      "--batch-size", "128", "--gpu-memory", "80", "--top", "1000"])
    key = lambda row: (row["pp"], row["dp"], row["tp"], row["schedule"], row["microbatches"],  # noqa: E731
                       row["accumulate"], row["checkpointing"])
    plain = {key(row): row for row in rows if not row.get("vocab_parallel")}
    spread = [row for row in rows if row.get("vocab_parallel")]
    assert spread and all(row["pp"] > 1 and row["tp"] == 1 and row["schedule"] in ("gpipe", "1f1b") for row in spread)
    for row in spread:
        assert row["step"] < plain[key(row)]["step"] if key(row) in plain else True, row
        assert "train_pipeline_afab_manual.py" in row["command"] and row["command"].endswith(" --vocab-parallel")
    best = next(row for row in spread if (row["pp"], row["schedule"], row["checkpointing"]) == (8, "1f1b", False))
    assert best["microbatches"] == 128
    assert plain[key(best)]["step"] / best["step"] == pytest.approx(51.73 / 38.21, rel=0.15)
    assert re.search(r"^\d+\. pp 8 x dp 1 x tp 1, 1f1b --vocab-parallel, 128 microbatches: ", capsys.readouterr().out,
                     re.M)


def _placeholder_runtime(name: str, pp: int, m: int):
    """torch's _PipelineScheduleRuntime for rank 0 of a schedule's placement, its stages placeholders (no process
    group: loading and lowering a CSV is pure Python)."""
    placement = plan.placement(name)
    per_rank = 1 if placement in gpipe.SINGLE_STAGE else 2
    stages = [types.SimpleNamespace(num_stages=pp * per_rank, group_size=pp, group_rank=0, stage_index=s,
                                    is_first=s == 0, is_last=s == pp * per_rank - 1, submod=torch.nn.Module())
              for s in gpipe.stage_ids(placement, 0, pp, per_rank)]
    return torch.distributed.pipelining.schedules._PipelineScheduleRuntime(stages, n_microbatches=m), pp * per_rank


@pytest.mark.parametrize("pp", [2, 3])
def test_plan_writes_each_schedule_as_torchs_runtime_loads_and_lowers_it(pp, tmp_path, capsys):
    # --write-schedule: every schedule's order (torch's seven and the generated ones) at 2 and 3 pipeline ranks (2
    # stages each on the V's and the looped ones: up to 6), loaded by torch's own _PipelineScheduleRuntime._load_csv
    # in its compute_only form, which checks it (_validate_schedule) and lowers it (_add_send_recv raises on an
    # order that cannot progress); torch's simulator then runs the lowered order to its end. What torch loads is
    # the order plan.py replays, and no cell is empty (a rank's row: its compute actions in order).
    from torch.distributed.pipelining.schedules import _simulate_comms_compute
    m = 4 * pp
    for name in [*gpipe.SCHEDULES, *plan.GENERATED]:
        path = tmp_path / f"{name}.csv"
        plan.main(["--processes", str(pp), "--batch-size", str(m), "--microbatches", str(m), "--schedule", name,
                   "--device", "cpu", "--write-schedule", str(path)])
        assert f"wrote {path}: {name}'s order on {pp} pipeline ranks, {m} microbatches" in capsys.readouterr().out
        rows = [line.split(",") for line in path.read_text().splitlines()]
        assert len(rows) == pp and all(all(rows) for rows in rows), name
        runtime, num_stages = _placeholder_runtime(name, pp, m)
        runtime._load_csv(str(path), format="compute_only")
        assert {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order.items()} == dict(enumerate(rows))
        lowered = {r: [a for action in acts for a in (action.sub_actions or [action])  # (the simulator: no FSDP)
                       if a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
                   for r, acts in runtime.pipeline_order_with_comms.items()}
        _simulate_comms_compute(lowered, lambda s: runtime.stage_index_to_group_rank[s], num_stages)
        assert runtime.stage_index_to_group_rank == {s: r for r in range(pp) for s in gpipe.stage_ids(
            plan.placement(name), r, pp, 2)}, name


def _traced_run(split: list[int], schedule: str = "gpipe", device: str = "cpu", model: str = "tiny") -> dict:
    """What the scripts' --trace writes into a trace of the run (checkpoint.traced_run) of _costs_trace: 4 layers
    of the model (the scripts' default on the CPU), plan.py's default vocabulary (8192), a batch of 8 in 2
    microbatches of 32 tokens, the device's precision (bf16 on a GPU)."""
    args = gpipe.build_parser().parse_args(["--layers", "4", "--batch-size", "8", "--microbatches", "2", "--seq-len",
                                            "32", "--stages-per-rank", "1"])
    args.schedule, config = schedule, config_from_preset(model, 8192, 4)
    env = types.SimpleNamespace(world_size=len(split), device=torch.device(device),
                                dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    return checkpoint.traced_run(args, env, config, model_module.from_sizes(split),
                                 model_module.loss_chunks(0, config, (4, 32)))


def _costs_trace(directory: Path, labelled: bool, split: list[int]) -> str:
    """A GPipe trace of 2 microbatches whose parts cost what is known (ms): a layer forward 1, backward 2; the
    embedding 0.5, 1; the norm, head and loss 8, 12. labelled: the library's labels (the loss a "loss" span after
    the forward); else the hand-written script's (the loss inside "forward i", unlabelled), its run's afab."""
    ranks, number = [], iter(range(100, 1000))
    for stage, layers in enumerate(split):
        first, last, events, t = stage == 0, stage == len(split) - 1, [_span("ProfilerStep#1", 0, 200000)], 1000
        forward, backward = ("Forward", "Backward") if labelled else ("forward", "backward")
        for i in range(2):
            made = [next(number) for _ in range(first + 2 * last)]  # the lookup's, the head's and the loss's ops
            f, b = 1000 * layers + 500 * first, 2000 * layers + 1000 * first  # µs
            events += [_span(f"{forward} {i}", t, f + (0 if labelled else 8000 * last))]
            if first:
                events += [{**_span("aten::embedding", t + 10, 500, cat="cpu_op"),
                            "args": {"Sequence number": made[0]}}]
            if last:
                at = t + f if labelled else t + f - 500 * first
                events += [_span("loss", at, 8000)] if labelled else []
                events += [{**_span(op, at + 10 + 4000 * k, 3000, cat="cpu_op"), "args": {"Sequence number": n}}
                           for k, (op, n) in enumerate(zip(("aten::linear", "aten::cross_entropy_loss"), made[first:]))]
            t += f + 8000 * last + 100
            events += [_span(f"{backward} {i}", 100000 + t, b + 12000 * last)]
            nodes = list(zip(made, [1000] * first + [7000, 5000] * last))
            start = 100000 + t + 10
            for n, took in nodes:
                events += [{**_span(f"autograd::engine::evaluate_function: Node{n}", start, took, cat="cpu_op"),
                            "args": {"Sequence number": n}}]
                start += took + 10
        ranks.append(events)
    return _write(directory, ranks, _traced_run(split, "gpipe" if labelled else "afab"))


def test_the_plan_takes_each_parts_time_from_a_trace_of_known_costs(tmp_path, capsys):
    # A run's per-rank trace, the parts' costs known (_costs_trace): plan.py --trace finds each part's forward and
    # backward (the embedding's and the loss's from their own operators and the autograd nodes those made; a
    # layer's from the rest of its stage), the split that balances them, and the step it replays for both.
    shape = ["--layers", "4", "--batch-size", "8", "--microbatches", "2", "--seq-len", "32", "--device", "cpu"]
    expected = {"layer": (0.001, 0.001, 0.001), "embed": (0.0005, 0.0, 0.001), "head": (0.008, 0.006, 0.006)}
    for labelled, split, schedule, balanced_split, replayed in [
            # Stage times (forward, backward): 2.5, 5 and 10, 16 ms; GPipe replayed: 2.5 + 2 x 10 + 2 x 16 + 5.
            (True, [2, 2], "gpipe", "4,0", 0.0595),
            # The hand-written script labels no loss: the head's time is the last stage's, less a layer's, which
            # comes from the stages before it.
            (False, [2, 1, 1], "afab", "2,2,0", None)]:
        trace = _costs_trace(tmp_path / f"labelled{len(split)}" if labelled else tmp_path / "by_hand", labelled, split)
        report = plan.main(["--processes", str(len(split)), "--split", ",".join(map(str, split)), "--schedule",
                            schedule, *shape, "--trace", trace])
        out = capsys.readouterr().out
        for part, times in expected.items():
            assert report["passes"][part] == pytest.approx(times, abs=1e-9), (part, report["passes"])
        assert "a decoder layer 1 / 2 ms, the embedding 0.5 / 1 ms, the final norm, head and loss 8 / 12 ms" in out
        # Balanced on them (a layer 3, the embedding 1.5, the head 20): the head alone on the last stage.
        assert report["split"] == balanced_split and f"balanced on these times: --split {balanced_split}, " in out
        assert report["traced"]["split"] == ",".join(map(str, split)) and report["traced"]["step"] == 0.2
        if replayed:
            assert report["traced"]["replayed"] == pytest.approx(replayed)
            # The balanced split (4.5, 9 and 8, 12 ms): 4.5 + 2 x 8 + 2 x 12 + 9 = 53.5 ms.
            assert report["schedules"]["gpipe"]["step"] == pytest.approx(0.0535)
            assert "step 53.5 ms replayed (1.11 x as fast as the traced run's split)" in out
    # The same trace had the run accumulated 2 schedule steps an optimizer step (a batch of 16, the microbatches
    # the same): a profiled step is both, so the traced layout's replay is twice the schedule step's.
    trace = Path(_costs_trace(tmp_path / "accumulated", True, [2, 2]))
    for rank_file in trace.glob("rank*.json"):
        data = json.loads(rank_file.read_text())
        data["run"] |= {"accumulate": 2, "batch_size": 16}
        rank_file.write_text(json.dumps(data))
    report = plan.main(["--processes", "2", "--split", "2,2", *shape, "--batch-size", "16", "--accumulate", "2",
                        "--trace", str(trace)])
    capsys.readouterr()
    assert report["traced"]["replayed"] == pytest.approx(2 * 0.0595)
    # Without the loss's label and with no layer before the last stage, a layer cannot be told from the head.
    trace = _costs_trace(tmp_path / "by_hand2", False, [0, 4])
    assert "the traced run labels no loss" in refused(capsys, plan.main, "--processes", "2", "--split", "0,4",
                                                          *shape, "--trace", trace)


def test_the_plan_takes_a_traces_times_to_another_layout_of_the_same_microbatch_only(tmp_path, capsys):
    # A trace says what it measured (checkpoint.traced_run, in its top level, as the scripts' --trace writes it):
    # plan.py refuses it in one line where a microbatch costs another time, and carries its per-layer times over,
    # saying so, to another layout of the same microbatch.
    trace = _costs_trace(tmp_path / "t", True, [2, 2])  # the tiny model's 4 layers, 2 microbatches of 4 x 32, fp32
    shape = ["--processes", "2", "--layers", "4", "--batch-size", "8", "--microbatches", "2", "--seq-len", "32",
             "--device", "cpu", "--trace", trace]
    tiny, small = (config_from_preset(name, 8192, 4) for name in ("tiny", "small"))
    model = lambda c: f"a model of hidden {c.hidden_size}, {c.num_attention_heads} heads"  # noqa: E731
    rows = "microbatches of {} rows".format
    for flags, says in [(["--seq-len", "64"], "traced --seq-len 32 (this plan: --seq-len 64)"),
                        (["--batch-size", "16"], f"traced {rows(4)} (this plan: {rows(8)})"),
                        (["--precision", "bf16"], "traced --precision fp32 (this plan: --precision bf16)"),
                        (["--device", "cuda", "--model", "tiny"], "traced --device cpu (this plan: --device cuda), "
                                                                  "--precision fp32 (this plan: --precision bf16)"),
                        (["--activation-checkpointing"], "traced no --activation-checkpointing (this plan: "
                                                         "--activation-checkpointing)"),
                        (["--loss-chunks", "4"], "traced --loss-chunks 1 (this plan: --loss-chunks 4)"),
                        (["--document-masking"], "traced no --document-masking (this plan: --document-masking)"),
                        # The issue's: the tiny model's trace for the small model's plan, at a batch of 16.
                        (["--model", "small", "--batch-size", "16"], f"traced {model(tiny)}")]:
        err = refused(capsys, plan.main, *shape, *flags)
        assert err.startswith(f"error: --trace {trace}: traced ") and says in err, (flags, err)
        assert err.endswith(": a part's time does not carry over to another microbatch; give the traced run's, or "
                            "trace a run of these flags"), err
    err = refused(capsys, plan.main, *shape, "--model", "small", "--batch-size", "16")
    assert f"(this plan: {model(small)}" in err and f"{rows(4)} (this plan: {rows(8)})" in err, err
    # A --split given is the traced run's (which the trace says), or refused; so is a trace that does not say
    # what it measured (traced before the scripts wrote it) and one of files from two runs.
    assert refused(capsys, plan.main, *shape, "--split", "3,1").startswith(
        f"error: --split 3,1: the traced run's split, 2,2, comes from --trace {trace}, and the plan balances")
    for name, change, says in [
            ("older", lambda d: d.pop("run"), "rank0.json does not say what run it measured (traced before the "
                                              "scripts wrote that into the trace); trace the run again"),
            ("mixed", lambda d: d["run"].update(processes=3), "holds 2 rank files, not the 3 of one run (rank1.json "
                                                              "traced another); trace the run again")]:
        shutil.copytree(trace, tmp_path / name)
        data = json.loads((tmp_path / name / "rank0.json").read_text())
        change(data)
        (tmp_path / name / "rank0.json").write_text(json.dumps(data))
        err = refused(capsys, plan.main, *shape[:-1], str(tmp_path / name))
        assert err.startswith(f"error: --trace {tmp_path / name}: {says}"), err
    # Another layout of the same microbatch (4 rows of 32 tokens): 6 layers on 3 processes, a batch of 16 in 4.
    # The parts' times are the same, read on the traced run's own layout, and so is its replay (as in
    # test_the_plan_takes_each_parts_time_from_a_trace_of_known_costs); the plan balances its 6 layers on them.
    report = plan.main([*shape, "--processes", "3", "--layers", "6", "--batch-size", "16", "--microbatches", "4"])
    out = capsys.readouterr().out
    assert f"--trace {trace}: traced at --layers 4 --processes 2 --batch-size 8 --microbatches 2, this plan at " \
           "--layers 6 --processes 3 --batch-size 16 --microbatches 4: the same microbatch (4 x 32 tokens" in out
    expected = {"layer": (0.001, 0.001, 0.001), "embed": (0.0005, 0.0, 0.001), "head": (0.008, 0.006, 0.006)}
    for part, times in expected.items():
        assert report["passes"][part] == pytest.approx(times, abs=1e-9), (part, report["passes"])
    assert report["traced"]["split"] == "2,2" and report["traced"]["replayed"] == pytest.approx(0.0595)
    assert report["traced"]["run"]["split"] == [2, 2] and len(report["split"].split(",")) == 3
    assert sum(map(int, report["split"].split(","))) == 6 and "as fast as the traced run's split" not in out


MAIN, AUTOGRAD = 3914, 3931  # a GPU run's threads: the main one, and autograd's, which runs the backward there


def _kernel(name, launched, start, dur, correlation, tid=MAIN, stream=7, launch=("cuda_runtime", "cudaLaunchKernel")):
    """A kernel as kineto writes it (pid the device, tid its stream), and the call that launched it on thread tid
    at `launched` (None: no launch in the trace), linked by "correlation": the shapes and args of a real trace's
    (HolisticTraceAnalysis's tests/data/call_stack/backward_thread.json)."""
    kernel = {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
              "args": {"External id": correlation, "queued": 0, "device": 0, "context": 1, "stream": stream,
                       "correlation": correlation, "grid": [32, 1, 2], "block": [128, 1, 1]}}
    return [kernel] + ([] if launched is None else [{
        "ph": "X", "cat": launch[0], "name": launch[1], "pid": 1, "tid": tid, "ts": launched, "dur": 4,
        "args": {"External id": correlation, "cbid": 211, "correlation": correlation}}])


SEND_RECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"  # NCCL's point-to-point kernel


def _gpu_costs_trace(directory: Path) -> str:
    """_costs_trace's labelled GPipe run of 2 microbatches on 2 stages of 2 layers (of the small model, plan.py's
    on a GPU), as a GPU's trace: the CPU's spans only launch (µs), the kernels carry the parts' costs (ms): a
    layer's forward 1, backward 2; the embedding 0.5, 1; the norm, head and loss 8, 12. Between the ranks NCCL's
    point-to-point kernels, long where a rank waits for the other; the backward launched from autograd's thread;
    the optimizer unlabelled."""
    number, ranks = iter(range(1000, 2000)), []
    cpu = lambda name, at, dur, tid=MAIN, **args: {**_span(name, at, dur, tid, "cpu_op"), "args": args}  # noqa
    gpu = lambda *args, **kwargs: _kernel(args[0], args[1], args[2], args[3], next(number), *args[4:], **kwargs)  # noqa
    rank = [_span("ProfilerStep#1", 0, 50000, MAIN)]
    for i, (t, g) in enumerate([(1000, 1100), (1300, 3700)]):  # stage 0's forwards: CPU, GPU start (µs)
        rank += [_span(f"Forward {i}", t, 200, MAIN), cpu("aten::embedding", t + 10, 30, **{"Sequence number": i}),
                 *gpu("indexSelectLargeIndex", t + 20, g, 500),
                 *gpu("ampere_sgemm_128x64_tn", t + 100, g + 500, 1000),
                 *gpu("triton_poi_fused_mul_silu_0", t + 150, g + 1500, 1000, launch=("cuda_driver", "cuLaunchKernel")),
                 _span("nccl:send 0->1", t + 210, 20, MAIN), cpu("record_param_comms", t + 212, 16),
                 *gpu(SEND_RECV, t + 220, g + 2500, 100, MAIN, 20)]
    for i, (t, (r, until), g) in enumerate([(1600, (6300, 20000), 20000), (2000, (25000, 40000), 40000)]):
        rank += [_span(f"Backward {i}", t, 300, MAIN), _span("nccl:recv 0<-1", t + 10, 20, MAIN),
                 *gpu(SEND_RECV, t + 20, r, until - r, MAIN, 20)]  # waits for stage 1's gradient
        for k, (node, n, took) in enumerate([("MmBackward0", 900, 2000), ("MmBackward0", 901, 2000),
                                             ("EmbeddingBackward0", i, 1000)]):
            rank += [cpu(f"autograd::engine::evaluate_function: {node}", t + 100 + 50 * k, 40, AUTOGRAD,
                         **{"Sequence number": n}), *gpu("void cutlass::Kernel", t + 110 + 50 * k, g, took, AUTOGRAD)]
            g += took
    ranks.append(rank + gpu("multi_tensor_apply_kernel", 2500, 45000, 1000))  # the optimizer's: no label
    rank = [_span("ProfilerStep#1", 0, 60000, MAIN)]
    for i, (t, (r, until), g) in enumerate([(1000, (1100, 3700), 3700), (1500, (13700, 13750), 13750)]):
        rank += [_span(f"Forward {i}", t, 300, MAIN), _span("nccl:recv 1<-0", t + 5, 20, MAIN),
                 *gpu(SEND_RECV, t + 10, r, until - r, MAIN, 20),  # waits for stage 0's activations
                 *gpu("ampere_sgemm_128x64_tn", t + 100, g, 1000),
                 *gpu("ampere_sgemm_128x64_tn", t + 150, g + 1000, 1000),
                 _span("loss", t + 310, 90, MAIN), cpu("aten::linear", t + 320, 20, **{"Sequence number": 500 + 2 * i}),
                 *gpu("ampere_sgemm_128x128_nn", t + 330, g + 2000, 5000),
                 cpu("aten::cross_entropy_loss", t + 350, 20, **{"Sequence number": 501 + 2 * i}),
                 *gpu("cunn_SoftMaxForward", t + 360, g + 7000, 3000)]
    for i, (t, g) in enumerate([(2000, 23750), (2500, 39800)]):
        rank += [_span(f"Backward {i}", t, 400, MAIN)]
        for k, (node, n, took) in enumerate([("NllLossBackward0", 501 + 2 * i, 5000),
                                             ("LinearBackward0", 500 + 2 * i, 7000), ("MmBackward0", 950, 2000),
                                             ("MmBackward0", 951, 2000)]):
            rank += [cpu(f"autograd::engine::evaluate_function: {node}", t + 50 + 40 * k, 30, AUTOGRAD,
                         **{"Sequence number": n}), *gpu("void cutlass::Kernel", t + 60 + 40 * k, g, took, AUTOGRAD)]
            g += took
        rank += [_span("nccl:send 1->0", t + 300, 20, MAIN), *gpu(SEND_RECV, t + 310, g, 50, MAIN, 20)]
    ranks.append(rank)
    directory.mkdir()
    for r, events in enumerate(ranks):
        (directory / f"rank{r}.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": events,
                                                              "run": _traced_run([2, 2], "gpipe", "cuda", "small")}))
    return str(directory)


def test_a_gpu_trace_is_read_from_its_kernels(tmp_path, capsys):
    # On a GPU the CPU's spans only launch kernels: each part's time is its kernels' on the GPU (_gpu_costs_trace,
    # the parts' costs of _costs_trace), and the waiting is NCCL's point-to-point kernels where no other runs.
    trace = _gpu_costs_trace(tmp_path / "gpu")
    ranks = benchmark.read_trace(trace)
    # Stage 0: forwards 2.5 ms, backwards 5 ms; waiting: its sends while the GPU is idle (0.1 ms each), the
    # gradients' receives (13.7, 15 ms). Stage 1: 2 + 8 and 16 ms; waiting for the activations 2.6, 0.05 ms, its
    # sends 0.05 each. The optimizer's kernel is in no label.
    assert [r["steps"] for r in ranks.values()] == [
        [{"time": pytest.approx(0.05), "busy": pytest.approx(0.015), "waiting": pytest.approx(0.0289)}],
        [{"time": pytest.approx(0.06), "busy": pytest.approx(0.052), "waiting": pytest.approx(0.00275)}]]
    assert ranks[0]["stages"] == {None: {"forward": pytest.approx(0.0025), "backward": pytest.approx(0.005)}}
    assert ranks[1]["stages"] == {None: {"forward": pytest.approx(0.01), "backward": pytest.approx(0.016)}}
    assert ranks[0]["embed"] == {"forward": pytest.approx(0.0005), "backward": pytest.approx(0.001)}
    assert ranks[1]["head"] == {"forward": pytest.approx(0.008), "backward": pytest.approx(0.012)}
    # plan.py takes the same parts' times from it as from the CPU's trace of these costs.
    report = plan.main(["--processes", "2", "--split", "2,2", "--schedule", "gpipe", "--layers", "4", "--batch-size",
                        "8", "--microbatches", "2", "--seq-len", "32", "--device", "cuda", "--trace", trace])
    expected = {"layer": (0.001, 0.001, 0.001), "embed": (0.0005, 0.0, 0.001), "head": (0.008, 0.006, 0.006)}
    for part, times in expected.items():
        assert report["passes"][part] == pytest.approx(times, abs=1e-9), (part, report["passes"])
    assert "a decoder layer 1 / 2 ms, the embedding 0.5 / 1 ms" in capsys.readouterr().out
    # One labelled forward: a kernel, NCCL's all-reduce (tensor parallelism's: work, not waiting), a receive's
    # kernel (0.3 ms), a kernel; and a kernel the trace holds no launch of, in no part, but running in the middle
    # of the receive's: 0.2 ms waiting.
    number = iter(range(10))
    rank = [_span("ProfilerStep#1", 0, 5000, MAIN), _span("Forward 0", 100, 50, MAIN),
            *_kernel("ampere_sgemm_128x64_tn", 110, 200, 100, next(number)),
            *_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 120, 300, 100,
                     next(number), stream=20),
            *_kernel(SEND_RECV, 130, 400, 300, next(number), stream=20),
            *_kernel("ampere_sgemm_128x64_tn", 140, 700, 100, next(number)),
            *_kernel("triton_poi_fused_add_0", None, 500, 100, next(number))]
    directory = tmp_path / "one"
    directory.mkdir()
    (directory / "rank0.json").write_text(json.dumps({"traceEvents": rank}))
    parsed = benchmark.read_rank(str(directory / "rank0.json"))
    assert parsed["steps"] == [{"time": pytest.approx(0.005), "busy": pytest.approx(0.0003),
                                "waiting": pytest.approx(0.0002)}]
    # What cannot be read is refused in one line: CUDA launches with no kernel recorded (the CPU's spans would
    # time launches), kernels none of whose launches are in the trace.
    shape = ["--processes", "1", "--layers", "2", "--batch-size", "2", "--microbatches", "1", "--seq-len", "32"]
    for name, events, why in [
            ("launches", [e for e in rank if e["cat"] != "kernel"], "rank0.json: CUDA launches but no GPU kernel"),
            ("kernels", [e for e in rank if e["cat"] != "cuda_runtime"], "rank0.json: GPU kernels, but no launch")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.json").write_text(json.dumps({"traceEvents": events}))
        err = refused(capsys, plan.main, *shape, "--trace", str(tmp_path / name))
        assert err.startswith(f"error: --trace {tmp_path / name}: {tmp_path / name}/{why}"), err


def test_the_plan_reads_each_parts_time_from_the_runs_traces(layout_runs, data_dir, capsys):
    # The traces of real runs (the library's GPipe on 2 stages; the hand-written AFAB on 3, 2,1,1): every part's
    # forward and backward found (the embedding's backward and the loss's by the autograd nodes their operators
    # made), and the traced split replayed on them close to the step the trace shows.
    runs, tmp_path = layout_runs
    for name, trace in (("gpipe2", "gpipe_trace"), ("afab3", "afab_trace")):
        processes, script, extra = LAYOUT_RUNS[name]
        flags = [flag for i, flag in enumerate(extra) if "--trace" not in extra[max(0, i - 1):i + 1]]
        report = plan.main(["--processes", str(processes), "--data", data_dir, "--layers", "4", "--batch-size", "8",
                            "--microbatches", "4", "--seq-len", "32", *flags, "--trace", str(tmp_path / trace)])
        out = capsys.readouterr().out
        assert all(t > 0 for part in plan.PARTS for t in report["passes"][part] if part != "embed"), report
        assert report["passes"]["embed"][0] > 0 and report["passes"]["embed"][2] > 0, report
        assert "balanced on these times: --split " in out and len(report["split"].split(",")) == processes
        # The traced split replayed on these times: no longer than the traced step (a quarter more for noise),
        # and not much shorter. The replay leaves out the optimizer, the clipping and the waits beyond those of
        # the median microbatch, which grow when this fixture's 11 runs share 2 cores (measured: 0.45 to 0.83).
        assert 0.2 < report["traced"]["replayed"] / report["traced"]["step"] < 1.25, (name, report["traced"])
        # Each rank's trace says what the run measured (checkpoint.traced_run, in its top level): the plan read its
        # layout from there, and refuses it for another microbatch (the issue's: traced at 32 tokens, planned at 64).
        run = json.loads((tmp_path / trace / "rank0.json").read_text())["run"]
        assert run == report["traced"]["run"] and sum(run["split"]) == run["model"]["layers"] == 4, run
        assert {k: run[k] for k in ("processes", "schedule", "seq_len", "rows", "device", "dtype", "dp", "tp")} == {
            "processes": processes, "schedule": "gpipe" if name == "gpipe2" else "afab", "seq_len": 32, "rows": 2,
            "device": "cpu", "dtype": "float32", "dp": 1, "tp": 1}, run
        assert name == "gpipe2" or run["split"] == [2, 1, 1]
        err = refused(capsys, plan.main, "--processes", str(processes), "--data", data_dir, "--layers", "4",
                      "--batch-size", "8", "--microbatches", "4", "--seq-len", "64", "--trace", str(tmp_path / trace))
        assert "traced --seq-len 32 (this plan: --seq-len 64)" in err, err


def test_plan_finds_layouts_for_a_cluster_that_the_scripts_accept(capsys):
    # Llama 3 8B at 8192 tokens on 2 nodes of 8 x 80 GB: ranked layouts, each with the command that runs it.
    argv = ["--model", "llama-8b", "--vocab-size", "128256", "--seq-len", "8192", "--gpus", "16",
            "--gpus-per-node", "8", "--gpu-memory", "80", "--batch-size", "256", "--top", "8"]
    best = plan.main(argv)
    out = capsys.readouterr().out
    assert "assumed: 396 TFLOP/s per GPU (40% of 989)" in out and out.count("uncertainty: ") == 1
    assert len(best) == 8 and [row["step"] for row in best] == sorted(row["step"] for row in best)
    config = config_from_preset("llama-8b", 128256)
    for row in best:
        assert row["memory"] <= 0.9 * 80e9 and row["pp"] * row["dp"] * row["tp"] == 16 and row["tp"] <= 8
        for line in [row["command"], *([row["by_hand"]] if "by_hand" in row else [])]:
            assert line in out
            assert line.startswith("NNODES=2 NODE_RANK=<0..1> MASTER_ADDR=<first node> NPROC_PER_NODE=8 ./run.sh ")
            words = shlex.split(line.split("./run.sh ", 1)[1])
            module = SCRIPT_MODULES[words[0]]
            ns = checked_args(module, words[1:], 16)  # the script's own parser and checks
            module.stage_layout(config, 16 // (ns.dp * ns.tp) * getattr(ns, "stages_per_rank", 1), ns)
    # A --tp given is kept (timed for 64 GPUs in the README, not here); so is --document-masking, in the commands.
    best = plan.main([*argv[:-2], "--tp", "4", "--top", "3", "--document-masking"])
    assert len(best) == 3 and all(row["tp"] == 4 and row["pp"] * row["dp"] == 4 for row in best)
    for row in best:
        words = shlex.split(row["command"].split("./run.sh ", 1)[1])
        assert checked_args(SCRIPT_MODULES[words[0]], words[1:], 16).document_masking


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "12"], "error: --gpus 12: not whole nodes of --gpus-per-node 8; give a multiple of 8"),
    (["--gpus", "16", "--tp", "16"], "error: --tp 16: larger than a node (--gpus-per-node 8);"),
    (["--gpus", "16", "--dp", "3"], "error: --dp 3 x --tp 1: does not divide --gpus 16;"),
    # The least memory of a layout is at the largest --accumulate the scripts accept (here 1 sequence a step:
    # 134 GB, 215 at --accumulate 1), so it is said with it.
    (["--gpus", "1", "--gpu-memory", "40"], "error: --gpu-memory 40: no layout fits; the smallest, pp 1 x dp 1 x tp 1 "
                                            "with --activation-checkpointing and --accumulate 16, needs 134 GB"),
    (["--gpus", "8", "--gpu-memory", "8"], "needs 17 GB per GPU; --gpus 32 would fit"),
    (["--gpus", "8", "--gpu-memory", "1"], "; more GPUs would not fit it either"),
])
def test_plan_says_what_no_layout_fits_in_one_line(argv, message, capsys):
    assert message in refused(capsys, plan.main, "--model", "llama-8b", "--seq-len", "8192", "--batch-size", "16",
                              *argv)


def test_plan_piped_into_head_ends_quietly():
    # `plan.py ... | head`: the reader goes away after one line; the plan ends without a BrokenPipeError traceback.
    out = start(["sh", "-c", f"{shlex.quote(sys.executable)} plan.py --processes 2 | head -1"], cwd=ROOT, timeout=120)
    assert out.stdout.startswith("plan: ") and out.stderr == "", out


def test_plan_prints_every_schedule_for_a_cluster_on_this_machine(tmp_path):
    result = run_script(0, "plan.py", "--model", "llama-8b", "--seq-len", "8192", "--processes", "8", "--dp", "2",
                        "--batch-size", "64", "--microbatches", "8", "--device", "cuda", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "32 layers, hidden 4096, vocab 8192, 8 processes = 4 pipeline x 2 data x 1 tensor" in result.stdout
    assert ", bf16 autocast" in result.stdout  # --precision auto on a GPU
    assert len(re.findall(r"^  rank \d \(stages \d\): ", result.stdout, re.M)) == 4
    for name in gpipe.SCHEDULES:
        assert re.search(rf"^  {name} +step +[\d.e+]+ ms \([\d.]+ x no bubble\)  bubble +[\d.]+%  activations ",
                         result.stdout, re.M), (name, result.stdout)


def test_the_plan_of_accumulated_steps_pays_a_fill_and_drain_for_each(capsys, tmp_path, monkeypatch):
    # --accumulate K: an optimizer step is K schedule steps of --microbatches m each, every step its own fill and
    # drain (issue 47: 1F1B at p 4, 4 x 8 microbatches has a bubble of 27 %, 1 x 32 of 8.6 %: (p - 1)/(m + p - 1)
    # on equal stages), its activations those of m microbatches of batch / (dp x m x K) rows.
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    equal = ["--processes", "4", "--layers", "8", "--layer-times", "1,1,1", "--embed-times", "0,0,0", "--head-times",
             "0,0,0", "--schedule", "1f1b", "--device", "cpu"]  # four stages of 2 layers, nothing else timed

    def planned(*flags) -> dict:
        report = plan.main(list(flags))
        return report | {"out": capsys.readouterr().out}

    window = planned(*equal, "--batch-size", "32", "--microbatches", "8", "--accumulate", "4")
    whole = planned(*equal, "--batch-size", "32", "--microbatches", "32")
    step = planned(*equal, "--batch-size", "8", "--microbatches", "8")  # one of the window's steps
    assert f"{window['schedules']['1f1b']['bubble']:.0%}" == "27%" and window["schedules"]["1f1b"]["bubble"] == \
        pytest.approx(3 / 11) and whole["schedules"]["1f1b"]["bubble"] == pytest.approx(3 / 35)
    assert window["schedules"]["1f1b"]["step"] == pytest.approx(4 * 11 * 6e-3)  # 4 x (m + p - 1) x (F + B)
    assert whole["schedules"]["1f1b"]["step"] == pytest.approx(35 * 6e-3)
    for name, row in window["schedules"].items():  # every schedule: K times its step, the same bubble and bytes
        assert row == {**step["schedules"][name], "step": pytest.approx(4 * step["schedules"][name]["step"])}, name
    assert window["ranks"] == [{**row, "sent": 4 * row["sent"]} for row in step["ranks"]]
    assert "in each of 4 schedule steps per optimizer step (--accumulate)" in window["out"]
    # With --dp 2 FSDP keeps each stage's gathered parameters and gradients from the window's first step to its
    # last one's reduce-scatter, between steps too: the total counts them, beside a step's activations.
    replicas = ["--processes", "4", "--dp", "2", "--microbatches", "4", "--device", "cpu"]
    window = planned(*replicas, "--batch-size", "32", "--accumulate", "4")
    step = planned(*replicas, "--batch-size", "8")
    assert window["ranks"] == [{**row, "sent": 4 * row["sent"]} for row in step["ranks"]]
    for row in window["ranks"]:
        # (gathered: fp32 parameters and gradients, whole: 2 x dp x a parameter shard)
        assert row["gathered"] == 2 * 2 * row["param"] > 0 and row["total"] >= row["param"] + row["grad"] + \
            row["optimizer"] + row["gathered"] + row["activations"]
    assert "FSDP keeping each stage's gathered parameters and gradients from the first step to the last one's " \
           "reduce-scatter (the gathered column, in the total)" in window["out"]


def searched_schedule(row: dict) -> str:
    """A search row's schedule as plan.evaluate takes it: afab or 1f1b --vocab-parallel where the row says so."""
    return f"{'afab' if row['schedule'] == 'gpipe' else '1f1b'} --vocab-parallel" if row.get("vocab_parallel") \
        else row["schedule"]


def test_the_search_accumulates_steps_only_where_memory_forces_it_and_the_fewest(capsys, tmp_path, monkeypatch):
    # The small model at 2 GPUs of 3 GB, a batch of 64 x 1024: GPipe's and looped BFS's layouts fit only with
    # --accumulate. Each layout the search proposes, with checkpointing and without, comes at the smallest K at
    # which some microbatch count fits (K = 1 wherever one does), found here by trying them all: a layout that
    # fits at K = 1 only with checkpointing is also proposed without it at the K it needs (which may be faster).
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    argv = ["--model", "small", "--seq-len", "1024", "--batch-size", "64", "--gpus", "2", "--gpu-memory", "3",
            "--top", "1000"]
    best = plan.main(argv)
    out = capsys.readouterr().out
    args = plan.build_parser().parse_args(argv)
    args.device = "cuda"
    config, budget = plan.plan_config(args), 3e9 * (1 - plan.HEADROOM)

    def fewest(pp, dp, tp, schedule, ac) -> int | None:
        n = 64 // dp  # a replica's sequences
        for k in [k for k in range(1, n + 1) if n % k == 0]:
            for m in [m for m in range(1, n // k + 1) if n // k % m == 0]:
                row = plan.evaluate(args, config, pp, dp, tp, schedule, m, ac, None, k)
                if row is not None and row["memory"] <= budget:
                    return k
        return None

    layouts = {(*c[:4], c[5]) for c in plan.candidates(args, config, tuple(gpipe.SCHEDULES), (False, True))}
    expected = {layout: k for layout in layouts if (k := fewest(*layout))}
    got = {(row["pp"], row["dp"], row["tp"], searched_schedule(row), row["checkpointing"]): row["accumulate"]
           for row in best}
    # Every plain layout; the --vocab-parallel ones where they pay (faster than the plain split's row, or it does
    # not fit): each at its fewest K too.
    assert len(got) == len(best) and got == {layout: k for layout, k in expected.items() if layout in got}
    assert {layout for layout in expected if "--vocab-parallel" not in layout[3]} <= set(got)
    assert {1, 4} <= set(got.values()), got
    # Each choice at its own K (one K for both would hide a faster one): here GPipe at dp 2, 4 with checkpointing
    # and 32 without.
    assert any(k != got.get((*layout[:4], False), k) for layout, k in got.items() if layout[4]), got
    for row in best:
        k = row["accumulate"]
        if k == 1:
            assert "--accumulate" not in row["command"]
            continue
        m = row["microbatches"]
        assert f"{m} microbatch{'es' * (m > 1)} x {k} schedule steps (--accumulate: each its fill and drain)" in out
        words = shlex.split(row["command"])
        assert words[3] == ("train_pipeline_afab_manual.py" if row.get("vocab_parallel") else
                            "train_pipeline_gpipe.py") and f"--accumulate {k}" in row["command"]
        if not row.get("vocab_parallel"):  # (the hand-written script has no --vocab-parallel yet)
            assert checked_args(gpipe, words[4:], 2).accumulate == k
        # Memory forces a slower step: K fills and drains where K = 1 (if it fitted) would pay one.
        unforced = plan.evaluate(args, config, row["pp"], row["dp"], row["tp"], searched_schedule(row),
                                 k * row["microbatches"], row["checkpointing"], None, 1)
        assert unforced["memory"] > budget and (unforced["step"] < row["step"] if row["pp"] > 1 else
                                                unforced["step"] == pytest.approx(row["step"]))


@pytest.mark.parametrize("argv, status, message", [
    (["--processes", "0"], 2, "error: argument --processes: must be a whole number of at least 1, got 0"),
    (["--processes", "8", "--dp", "3"], 1, "error: --dp 3 x --tp 1: 8 processes do not divide into stages of 3"),
    (["--processes", "2", "--split", "1,2"], 1, "error: --split 1,2: give 2 layer counts"),  # tiny: 6 layers
    (["--processes", "9"], 1, "error: 9 pipeline stages but the model has 6 layers"),  # 8: two layerless ends
    (["--processes", "3", "--split", "3,0,3"], 1, "error: --split 3,0,3: a stage between the first and the last "
                                                  "needs at least 1 layer"),
    (["--processes", "4", "--tp", "4"], 1, "error: --tp 4: the model's KV heads (2) do not divide by it"),
    (["--processes", "2", "--schedule", "1f1b", "--microbatches", "1", "--batch-size", "4"], 1,
     "error: --microbatches 1: 1f1b needs at least as many microbatches as stages (2)"),
    (["--processes", "2", "--batch-size", "12", "--microbatches", "4", "--accumulate", "2"], 1,
     "error: --batch-size 12 is not divisible by --dp 1 x --microbatches 4 x --accumulate 2; give a multiple of 8"),
    (["--processes", "2", "--seq-len", "4096"], 1, "error: --seq-len 4096 exceeds the model's 1024 positions; give "
                                                   "at most 1024, or a model with more (a config.json's "
                                                   "max_position_embeddings and rope_scaling: docs/layouts.md)"),
    (["--gpus", "8", "--seq-len", "9000"], 1, "error: --seq-len 9000 exceeds the model's 2048 positions; give at "
                                              "most 2048"),  # (not: no layout passes, try another --batch-size)
    (["--processes", "2", "--data", "nowhere"], 1, "error: --data nowhere: no data prepared there; run python "
                                                   "prepare_data.py --out nowhere first"),
    (["--processes", "2", "--data", "x", "--vocab-size", "9"], 2, "error: argument --vocab-size: not allowed with"),
    (["--processes", "2", "--schedule", "nope"], 2, "error: argument --schedule: invalid choice: 'nope'"),
    (["--processes", "2", "--layer-times", "1,2"], 2, "error: argument --layer-times: must be three non-negative "
                                                      "numbers of milliseconds"),
    (["--processes", "2", "--head-times", "1,2,3"], 1, "error: --head-times: give --layer-times too"),
    # Times and sizes past what a sum or a ratio holds: no ZeroDivisionError traceback (a layer of 0, its 0 step),
    # no "inf ms" and "nan%" (1e308, the step's sums overflowed), no 300-digit step (a rate near 0).
    (["--processes", "2", "--layer-times", "0,0,0"], 2, "error: argument --layer-times: must be three non-negative "
                                                        "numbers of milliseconds up to an hour (3,600,000), forward, "
                                                        "input gradient and weight gradient, not all 0, such as"),
    (["--processes", "2", "--layer-times", "1e308,1,1"], 2, "error: argument --layer-times: must be three "),
    (["--processes", "2", "--layer-times", "1,1,1", "--head-times", "1,1e308,1"], 2,
     "error: argument --head-times: must be three non-negative numbers of milliseconds up to an hour"),
    (["--processes", "2", "--layer-times", "1,1,1", "--message-time", "1e308"], 2,
     "error: argument --message-time: must be a number from 0 to 3,600,000 ms, got 1e308"),
    (["--processes", "2", "--vocab-size", str(10 ** 40)], 2, "error: argument --vocab-size: must be a whole number "
                                                             "from 1 to 4294967296 (uint32 token ids)"),
    (["--gpus", "8", "--peak-tflops", "1e308"], 2, "error: argument --peak-tflops: must be a number from 0.001 to "
                                                   "100,000 TFLOP/s, got 1e308"),
    (["--gpus", "8", "--peak-tflops", "1e-300"], 2, "error: argument --peak-tflops: must be a number from 0.001"),
    (["--gpus", "8", "--efficiency", "2"], 2, "error: argument --efficiency: must be a number from 0.001 to 1 (a "
                                              "share of the peak), got 2"),
    (["--gpus", "8", "--intra-node-bandwidth", "1e-308"], 2, "error: argument --intra-node-bandwidth: must be a "
                                                             "number from 0.001 to 100,000 GB/s"),
    (["--gpus", "8", "--gpu-memory", "1e308"], 2, "error: argument --gpu-memory: must be a number from 0.001 to "
                                                  "100,000 GB"),
    (["--processes", "2", "--trace", "t", "--layer-times", "1,2,3"], 1, "error: --layer-times: --trace t measures "
                                                                        "the times; give one or the other"),
    (["--processes", "2", "--trace", "nowhere"], 1, "error: --trace nowhere: "),
    (["--processes", "2", "--vocab-parallel"], 1, "error: --vocab-parallel: the hand-written script's schedules "
                                                  "only (--schedule afab or 1f1b), not gpipe"),
    (["--gpus", "8", "--vocab-parallel"], 1, "error: --vocab-parallel: plans one layout (--processes); --gpus tries "
                                             "it on every afab and 1f1b layout"),
    (["--processes", "1", "--vocab-parallel", "--schedule", "afab"], 1, "error: --vocab-parallel: splits the "
                                                                        "vocabulary over the pipeline ranks; give 2"),
    (["--processes", "4", "--tp", "2", "--vocab-parallel", "--schedule", "1f1b"], 1,
     "error: --tp 2: --vocab-parallel is planned over the pipeline group alone; leave --tp out"),
    (["--processes", "2", "--vocab-parallel", "--schedule", "1f1b", "--activation-checkpointing", "auto"], 1,
     "error: --activation-checkpointing auto: not with --vocab-parallel yet"),
    (["--processes", "2", "--stage-times", "1,2/3"], 2, "error: argument --stage-times: must be each stage's "
                                                        "forward milliseconds, a slash, their backward"),
    (["--processes", "2", "--stage-times", "1,x/3,4"], 2, "error: argument --stage-times: must be each stage's"),
    (["--processes", "2", "--stage-times", "0,0/0,0"], 2, "error: argument --stage-times: must be each stage's"),
    (["--processes", "3", "--stage-times", "1,2/3,4"], 1, "error: --stage-times: 2 stages' times for a layout of "
                                                          "3 stages; give one per stage"),
    (["--processes", "2", "--stage-times", "1,2/3,4", "--layer-times", "1,2,3"], 1,
     "error: --layer-times: --stage-times gives each stage's whole time; give one or the other"),
    (["--gpus", "8", "--stage-times", "1,2/3,4"], 1, "error: --stage-times: measured times plan one layout"),
    (["--gpus", "8", "--message-time", "1"], 1, "error: --message-time: measured times plan one layout"),
    (["--processes", "2", "--write-schedule", "nowhere/s.csv"], 1, "error: --write-schedule nowhere/s.csv: no "
                                                                  "directory nowhere; give a file in an existing"),
    (["--processes", "2", "--write-schedule", "."], 1, "error: --write-schedule .: is a directory; give a file"),
    (["--gpus", "8", "--batch-size", "16", "--accumulate", "3"], 1, "error: --accumulate 3: does not divide "
                                                                    "--batch-size 16; leave it out to search it"),
    (["--gpus", "8", "--write-schedule", "s.csv"], 1, "error: --write-schedule s.csv: writes one layout's order; "
                                                      "give --processes instead of --gpus"),
    (["--processes", "2", "--schedule", "zbvauto", "--stages-per-rank", "3"], 1, "error: --stages-per-rank 3: "
                                                                                "zbvauto holds 2 stage(s) per rank"),
    (["--processes", "2", "--activation-checkpointing", "most"], 2, "error: argument --activation-checkpointing: "
     "give full, selective, none, or one per stage separated by commas, each full, selective, none or a count"),
    (["--processes", "2", "--activation-checkpointing", "1,full,0"], 1, "error: --activation-checkpointing "
                                                                        "1,full,0: 3 entries for 2 stages; give one "
                                                                        "per stage (2), or one for all"),
    (["--processes", "2", "--activation-checkpointing", "auto", "--gpu-memory", "0.01"], 1,
     "error: --gpu-memory 0.01: pipeline rank 0 needs"),
    (["--processes", "2", "--seq-len", "30", "--seq-chunks", "4"], 1,
     "error: --seq-chunks 4 does not cut --seq-len 30 into even chunks; the nearest that does: --seq-chunks 3"),
    (["--processes", "2", "--seq-chunks", "200"], 1, "error: --seq-chunks 200: give 1 to 128 chunks for --seq-len 128"),
    (["--processes", "2", "--schedule", "zb1p", "--seq-chunks", "2"], 1, "error: --seq-chunks 2: --schedule zb1p "
                                                                         "cannot order sequence chunks"),
    (["--processes", "2", "--schedule", "interleaved1f1b", "--seq-chunks", "2"], 1,
     "error: --seq-chunks 2: --schedule interleaved1f1b cannot order sequence chunks"),
    (["--gpus", "8", "--seq-chunks", "2"], 1, "error: --seq-chunks 2: --gpus searches it (whole sequences and 2, "
                                              "4, 8, 16, 32 chunks of 4096 tokens or more under gpipe and 1f1b); "
                                              "leave it out"),
])
def test_plan_refuses_what_the_script_refuses_in_one_line(argv, status, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, plan.main, *argv, "--device", "cpu", status=status)
    assert err.startswith(message), err


@pytest.mark.parametrize("pp, S", [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_plan_seq_chunks_of_equal_cost_bubble_as_s_times_the_microbatches(pp, S, capsys):
    # --stage-times gives a stage's whole time and says nothing of attention's share: chunks then cost alike
    # (their tokens' share), and Seq1F1B's order idles as 1F1B with S m microbatches, (p - 1) / (S m + p - 1),
    # GPipe's chunk order as GPipe with S m.
    m, times = pp, ",".join(["1"] * pp) + "/" + ",".join(["2"] * pp)
    common = ["--processes", str(pp), "--seq-len", "64", "--batch-size", str(S * m), "--stage-times", times,
              "--device", "cpu"]
    for name in ("1f1b", "gpipe"):
        chunked = plan.main([*common, "--schedule", name, "--microbatches", str(m), "--seq-chunks", str(S)])
        whole = plan.main([*common, "--schedule", name, "--microbatches", str(S * m)])
        row = chunked["schedules"][f"{name} --seq-chunks {S}"]
        assert row["bubble"] == pytest.approx(whole["schedules"][name]["bubble"], abs=1e-12)
        assert row["bubble"] == pytest.approx((pp - 1) / (S * m + pp - 1), abs=1e-12)
        # (--stage-times are a microbatch's, whatever its tokens: S m of them, S times a chunk's work)
        assert S * row["step"] == pytest.approx(whole["schedules"][name]["step"], rel=1e-12)
    out = capsys.readouterr().out
    assert re.search(rf"^  1f1b --seq-chunks {S} +step .* bubble .* activations ", out, re.M), out
    assert f"interleaved1f1b        not possible here: --seq-chunks {S}: --schedule interleaved1f1b cannot " in out


def test_plan_seq_chunks_cost_grows_with_the_prefix():
    # A chunk's share of a stage's time: its matrices' FLOPs by its tokens, causal attention's by what its
    # queries read, token x of the sequence its x + 1/2 keys (the mean of the triangle's row): counted token by
    # token here. attention: the stage's attention share.
    lengths, attention = [16, 16, 32], [0.0, 0.4]
    _, share, _ = plan.chunk_costs([range(1), range(1)], lengths, attention, [0.0, 0.0], [["none"], ["none"]], 0.0)
    starts = [0, 16, 32]
    for a, row in zip(attention, share):
        tokens = [(1 - a) * n / 64 + a * sum(x + 0.5 for x in range(o, o + n)) / (64 * 64 / 2)
                  for o, n in zip(starts, lengths)]
        assert row == pytest.approx(tokens, rel=1e-12) and sum(row) == pytest.approx(1.0, rel=1e-12)
    assert share[1][0] < share[1][1]  # even chunks: the later one dearer
    # FLOP-estimated: on the tiny model at 1024 tokens the 1F1B chunk row idles more than with equal chunk costs
    # would ((p - 1) / (S m + p - 1) is its least, reached with equal costs on equal stages alone).
    report = plan.main(["--processes", "2", "--seq-len", "1024", "--batch-size", "4", "--microbatches", "2",
                        "--schedule", "1f1b", "--seq-chunks", "4", "--split", "3,3", "--device", "cpu"])
    assert report["schedules"]["1f1b --seq-chunks 4"]["bubble"] > 1 / 9


def test_plan_seq_chunks_padded_to_the_longest_cost_more_than_even():
    # docs/long-sequences.md's replay of why train_pipeline_gpipe.py refuses --chunk-split compute: chunks of equal
    # FLOPs padded to the longest (each its length at its own offset) against even chunks and unpadded ones, equal
    # stages (F 1, B 2), each chunk its share as plan.chunk_costs counts it; the page's figures to its 3 decimals.
    page = (ROOT / "docs" / "long-sequences.md").read_text()
    cell = r" \| ([\d.]+) \((?:bubble )?([\d.]+)\)"
    rows = re.findall(rf"^\| (\d+), (\d+), (\d+), ([\d.]+)([^|]*){cell * 4} \|$", page, re.M)
    assert len(rows) == 5, rows
    for row in rows:
        (p, m, S), a, figures = map(int, row[:3]), float(row[3]), [float(x) for x in row[5:]]
        name = "gpipe" if "GPipe's chunk order" in row[4] else "1f1b"
        ends = [(-(1 - a) + math.sqrt((1 - a) ** 2 + 4 * a * j / S)) / (2 * a) for j in range(1, S)] + [1.0]
        compute = [e - s for s, e in zip([0.0] + ends, ends)]  # (1 - a) x + a x^2 = j / S: equal FLOPs

        def replayed(lengths, padded=None):
            share = plan.chunk_costs([range(1)] * p, lengths, [a] * p, [0.0] * p, [["none"]] * p, 0.0)[1]
            if padded:  # each chunk the longest's length at its own offset: the formula of chunk_costs
                offsets = [sum(lengths[:j]) for j in range(S)]
                share = [[(1 - a) * padded + a * padded * (o + padded / 2) * 2 for o in offsets]] * p
            r = plan.replay(plan.chunk_orders(name, p, m, S), [1.0] * p, [2.0] * p, [0.0] * p,
                            chunks=(S, share, [[0.0] * S] * p))
            return [r["step"] / (3 * m), r["bubble"]]
        whole = plan.replay(plan.schedule_orders(name, p, m, 1), [1.0] * p, [2.0] * p, [0.0] * p)
        got = [whole["step"] / (3 * m), whole["bubble"], *replayed([1 / S] * S), *replayed(compute),
               *replayed(compute, max(compute))]
        assert got == pytest.approx(figures, abs=0.0005 + 1e-9), row
        assert got[6] > got[2] > got[4]  # padded dearer than even, even than equal compute


def test_plan_counts_the_activations_measured_in_chunks(capsys):
    # docs/long-sequences.md's table of benchmark.py measure-memory's runs (minutes each, not repeated here): plan.py
    # --device cpu gives each rank's activations for the same flags, whole and in chunks, to the page's 2 decimals
    # and what it leaves out (under 0.02 MiB there: e.g. the rotary tables a chunk after the first builds): 0.03.
    rows = markdown_table("long-sequences.md", "| model | --seq-len | S | measured, rank 0")
    assert len(rows) >= 10 and {row["S"] for row in rows} == {"1", "2", "4"}, rows
    for row in rows:
        flags = ["--model", "small", "--batch-size", "2"] if row["model"] == "small" else \
            ["--model", "tiny", "--layers", "2", "--batch-size", "4", "--document-masking"]
        ranks = plan.main(["--processes", "2", *flags, "--microbatches", "2", "--schedule", "1f1b", "--seq-len",
                           row["--seq-len"], "--seq-chunks", row["S"], "--device", "cpu"])["ranks"]
        for r, rank in enumerate(ranks):
            if row[f"measured, rank {r}"] != "-":
                mib = rank["activations"] / 2**20
                assert mib == pytest.approx(float(row[f"planned, rank {r}"]), abs=0.005 + 1e-9), (row, r)
                assert mib == pytest.approx(float(row[f"measured, rank {r}"]), abs=0.03), (row, r)
    capsys.readouterr()


def test_plan_seq_chunks_first_rank_as_the_parity_test_measured(tmp_path, capsys):
    # docs/long-sequences.md gives what the parity test measured (the tensors autograd saves, its model: 2 stages
    # of 2 layers, 4 microbatches of 16 tokens, documents): rank 0 under 1F1B in 2 and in 4 chunks, a share of
    # GPipe's on whole sequences. plan.py on that shape (--device cpu: with the masks' float copies that SDPA
    # keeps, documents' and chunks') gives the same, to the page's two decimals: 0.005.
    page = (ROOT / "docs" / "long-sequences.md").read_text()
    measured = re.search(r"0\.50 of GPipe's activations under 1F1B, ([\d.]+) in 2 chunks and ([\d.]+) in 4", page)
    config = write_config(tmp_path / "config.json", {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 98, "max_position_embeddings": 64})
    common = ["--processes", "2", "--model", config, "--seq-len", "16", "--batch-size", "8", "--microbatches", "4",
              "--document-masking", "--split", "2,2", "--device", "cpu"]

    def rank_0(*argv):
        return plan.main([*common, *argv])["ranks"][0]["activations"]
    gpipe_whole = rank_0("--schedule", "gpipe")
    assert rank_0("--schedule", "1f1b") / gpipe_whole == pytest.approx(0.5, abs=1e-12)
    for S, figure in zip((2, 4), measured.groups()):
        assert rank_0("--schedule", "1f1b", "--seq-chunks", str(S)) / gpipe_whole == pytest.approx(float(figure),
                                                                                                  abs=0.005), S


def test_plan_seq_chunks_writes_the_order_the_scripts_make(tmp_path, capsys):
    # --write-schedule with --seq-chunks: the order model.chunk_order makes for the scripts, which plan.py replays.
    path = tmp_path / "chunks.csv"
    plan.main(["--processes", "3", "--schedule", "1f1b", "--seq-chunks", "4", "--microbatches", "3", "--batch-size",
               "6", "--write-schedule", str(path), "--device", "cpu"])
    assert "3 pipeline ranks, 12 microbatches" in capsys.readouterr().out
    order = model_module.chunk_order("1f1b", 3, 3, [32] * 4)
    assert path.read_text().splitlines() == [",".join(map(str, order.actions[r])) for r in range(3)]


def test_plan_gpus_searches_seq_chunks_of_4k_tokens_or_more(tmp_path, capsys, monkeypatch):
    # Llama 3.1 8B's shape at 32k tokens on 16 GPUs: the search tries 2, 4 and 8 chunks under gpipe and 1f1b
    # (chunks of 4,096 tokens or more) beside whole sequences; a chunked layout ranks, its commands the scripts
    # accept. At 8k tokens only 2 chunks are tried (4,096 tokens each).
    monkeypatch.chdir(tmp_path)
    llama = {**LLAMA_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32}
    config = write_config(tmp_path / "config.json", llama)
    best = plan.main(["--model", config, "--seq-len", "32768", "--gpus", "16", "--batch-size", "64", "--top", "5"])
    chunked = [row for row in best if row.get("seq_chunks")]
    assert chunked and all(row["schedule"] in ("gpipe", "1f1b") and 32768 // row["seq_chunks"] >= 4096
                           for row in chunked)
    out = capsys.readouterr().out
    for row in chunked:
        assert f"{row['schedule']} --seq-chunks {row['seq_chunks']}, " in out
        for line in (row["command"], row["by_hand"]):
            assert line.endswith(f" --seq-chunks {row['seq_chunks']}")
            words = shlex.split(line.split("./run.sh ", 1)[1])
            assert checked_args(SCRIPT_MODULES[words[0]], words[1:], 16).seq_chunks == row["seq_chunks"]
    tried = {row.get("seq_chunks", 1) for row in plan.layouts(
        plan.build_parser().parse_args(["--model", "llama-8b", "--vocab-size", "128256", "--seq-len", "8192",
                                        "--gpus", "8", "--batch-size", "16", "--device", "cuda"]),
        model_module.config_from_preset("llama-8b", 128256))}
    assert tried == {1, 2}


@pytest.mark.parametrize("S", [2, 4])
def test_plan_seq_chunks_first_rank_holds_p_plus_s_minus_1_chunks_and_their_prefixes(S):
    # 2 stages of 2 layers, 4 microbatches of 2 sequences of 64 tokens (fp32). 1F1B: rank 0 holds 2 microbatches
    # (H each). Seq1F1B: at most p + S - 1 chunks, (p + S - 1) / (S p) of that, plus what each chunk's attention
    # saves of its prefix: the keys and values, 2 x prefix x kv_heads x head_dim x 4 bytes per layer and sequence.
    # At its fullest rank 0 holds sequence 0's S chunks and sequence 1's first (S = 2: prefixes 0 + 32 tokens;
    # S = 4: 0 + 16 + 32 + 48). On the CPU a chunk after the first attends with a dense mask, of which SDPA keeps a
    # float copy per layer: length x (prefix + length) x 4 bytes a sequence (a GPU's FlexAttention: none).
    common = ["--processes", "2", "--model", "tiny", "--layers", "4", "--split", "2,2", "--seq-len", "64",
              "--batch-size", "8", "--microbatches", "4", "--schedule", "1f1b", "--device", "cpu"]
    whole = plan.main(common)["ranks"][0]["activations"]
    chunked = plan.main([*common, "--seq-chunks", str(S)])["ranks"][0]["activations"]
    tiny = model_module.PRESETS["tiny"]
    head_dim = tiny["hidden_size"] // tiny["num_attention_heads"]
    prefixes = sum(64 // S * j for j in range(S))  # tokens, of sequence 0's chunks
    kv = 2 * prefixes * tiny["num_key_value_heads"] * head_dim * 4 * 2 * 2  # x 2 layers x 2 sequences a chunk
    masks = sum(64 // S * (64 // S * j + 64 // S) for j in range(1, S)) * 4 * 2 * 2
    assert chunked == pytest.approx((2 + S - 1) / (S * 2) * whole + kv + masks, rel=1e-12)
    on_gpu = plan.main([*common[:-1], "cuda", "--precision", "fp32", "--seq-chunks", str(S)])["ranks"][0]
    assert on_gpu["activations"] == pytest.approx((2 + S - 1) / (S * 2) * whole + kv, rel=1e-12)


def test_plan_reads_the_model_from_a_hugging_face_directory(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": True}))
    (hf / "model.safetensors").write_bytes(b"")  # only the config is read
    report = plan.main(["--processes", "3", "--init-from", str(hf), "--seq-len", "64", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "plan: 3 layers, hidden 64, vocab 1000, 3 processes = 3 pipeline x 1 data x 1 tensor" in out
    assert len(report["ranks"]) == 3 and len(report["compute_share"]) == 3
    assert report["ranks"][0]["param"] == 4 * (1000 * 64 + (64 * (2 * 64 + 2 * 2 * 16) + 3 * 64 * 128 + 2 * 64))
    for argv, message in [(["--layers", "2"], "error: --layers 2: the model's shape comes from"),
                          (["--model", "tiny"], "error: --model tiny: the model's shape comes from"),
                          (["--vocab-size", "9"], "error: --vocab-size 9: the vocabulary comes from --init-from")]:
        err = refused(capsys, plan.main, "--processes", "3", "--init-from", hf, *argv)
        assert err.startswith(message), err


def test_a_plan_reads_the_model_from_a_checkpoint(reference_run, data_dir, capsys):
    checkpoints = str(reference_run[0] / "checkpoints")  # 4 layers
    common = ["--processes", "2", "--seq-len", "32", "--batch-size", "8", "--microbatches", "4", "--device", "cpu"]
    assert plan.main([*common, "--init-from", checkpoints]) == plan.main([*common, "--layers", "4", "--data",
                                                                         data_dir])
    capsys.readouterr()
    assert "--layers 2: the model's shape comes from" in refused(capsys, plan.main, *common, "--init-from",
                                                                 checkpoints, "--layers", "2")


# -- plan.py --model path/to/config.json

# Llama 3 70B's config.json (Llama 3.1's long-context RoPE), as the Hugging Face hub has it.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}


def write_config(path: Path, config) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


@contextlib.contextmanager
def deadline(seconds: float):
    """A TimeoutError where a call would run on (a hang fails the test instead of stopping the suite)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_every_documented_run_after_the_default_job_has_a_checkpoint_dir_of_its_own():
    # The default job (README's first command) leaves its finished run in checkpoints/: an example run there after
    # it, or in another example's folder, would resume a finished run ("nothing to train") or be refused as another
    # run. Each example then names a --checkpoint-dir, its own on one node (--steps 0 only evaluates: it writes
    # nothing; the examples on several nodes are each a cluster's).
    owners = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^ *```bash\n(.*?)^ *```", path.read_text(), re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split(" #")[0].strip()
                if not re.search(r"(torchrun|run\.sh) .*train_pipeline_\w+\.py", command) or "&& torchrun" in command \
                        or "cd ~/my-pipeline" in block:  # the default job; a copy in a folder of its own
                    continue
                assert "--checkpoint-dir" in command, (path.name, command)
                words = shlex.split(command)
                if "--steps 0 " not in command and not re.match(r"(NNODES=|srun )", command):
                    owners.setdefault(words[words.index("--checkpoint-dir") + 1], []).append(command)
    assert {directory: jobs for directory, jobs in owners.items() if len(jobs) > 1} == {}


def shell_commands(block: str, variables: dict) -> list[list[str]]:
    """A bash block's commands, each as the words a shell would give it: continued lines joined, a quote running
    over lines kept whole, comments left out, `$NAME` replaced by its value (when the page set one). A `NAME=...`
    line sets a value in variables (kept from block to block of a page, as a shell keeps them)."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote that goes on on the next line
            continue
        pending = ""
        if len(words) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0], re.S):
            name, value = words[0].split("=", 1)
            variables[name] = value
        elif words:  # an unquoted $NAME splits into its words
            commands.append([w for word in words for w in (
                shlex.split(re.sub(r"\$(\w+)", lambda m: variables.get(m[1], m[0]), word)) if "$" in word else [word])])
    return commands


def documented_plan_examples() -> list[tuple[str, list[str], list[str], dict]]:
    """The plan.py commands of README.md and docs/*.md as written in their bash blocks: (page, argv, shown,
    files), shown the lines of the output block that follows the command's block (the output of its last command;
    [] when none follows), files {name: text} that the page's `echo '...' > FILE` lines wrote by then. Commands
    that read a run's trace (--trace) are left out: they need the run."""
    examples = []
    for page in DOC_PAGES:
        blocks = re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(), re.M | re.S)
        variables, files = {}, {}
        for i, (kind, text) in enumerate(blocks):
            if kind != "bash":
                continue
            commands = shell_commands(text, variables)
            files.update({words[-1]: " ".join(words[1:-2]) + "\n" for words in commands
                          if words[0] == "echo" and words[-2] == ">"})
            plans = [words[2:] for words in commands if words[:2] == ["python", "plan.py"] and "--trace" not in words]
            shown = blocks[i + 1][1].splitlines() if i + 1 < len(blocks) and blocks[i + 1][0] == "" else []
            examples += [(page.name, argv, shown if k == len(plans) - 1 else [], dict(files))
                         for k, argv in enumerate(plans)]
    return examples


def test_the_docs_plan_examples_print_what_the_docs_show_and_plan_a_config_json_alike(tmp_path, capsys, monkeypatch):
    # Every plan.py command of README.md and docs/*.md, as written (its variables and files too), gives the output
    # the page shows after it ("..." where the page leaves a part out): plan.py computes, runs nothing, and prints
    # the same on any machine, so a figure that drifts from what the plan now says fails here.
    examples = documented_plan_examples()
    assert {"layouts.md", "faster-and-smaller.md", "plan-vs-the-zero-bubble-paper.md"} <= {
        page for page, _, shown, _ in examples if shown}
    assert {"--gpus", "--processes"} <= {a for _, argv, _, _ in examples for a in argv}
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    searched = set()
    for page, argv, shown, files in examples:
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        expected = plan.main(argv)
        out = capsys.readouterr().out
        for line in shown:
            for part in filter(None, (p.strip() for p in line.split("..."))):
                assert part in out, (page, argv, part, out)
        # The same shape as a Hugging Face config.json (`--model path/to/config.json`): the same plan. (A search
        # takes seconds: the first of each page's searches is enough.)
        preset = argv[argv.index("--model") + 1]
        if preset not in model_module.PRESETS or (page, "--gpus" in argv) in searched:
            continue
        searched.add((page, "--gpus" in argv))
        vocab = int(argv[argv.index("--vocab-size") + 1])
        config = write_config(tmp_path / preset / "config.json",
                              hf_config(config_from_preset(preset, vocab), 1, 2, None, torch.bfloat16))
        from_json = [config if a == preset else a for a in argv]
        del from_json[from_json.index("--vocab-size"):from_json.index("--vocab-size") + 2]
        got = plan.main(from_json)
        if "--gpus" in argv:
            for row in [*expected, *got]:
                row.pop("command"), row.pop("by_hand", None)
            assert f"--init-from {tmp_path / preset} " in capsys.readouterr().out  # beside the config.json
        assert got == expected, (page, argv)


def markdown_table(page: str, header: str) -> list[dict]:
    """The rows of the table in docs/PAGE whose header row begins with HEADER, as {column: cell}."""
    return markdown_table_of((ROOT / "docs" / page).read_text(), header)


def markdown_table_of(text: str, header: str) -> list[dict]:
    """markdown_table's rows, of a text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def test_the_docs_measured_bytes_are_what_plan_py_computes_for_the_runs_measured(tmp_path, capsys, monkeypatch):
    # The docs' measured tables of the tiny model's bytes (activations, parameters, gradients, AdamW state, what a
    # rank sends) come from benchmark.py's runs of the scripts, minutes each, not repeated here. plan.py computes
    # the same bytes for the same runs in milliseconds, and test_the_plan_counts_what_the_runs_hold keeps it within
    # 10 % of what the scripts hold: a row further than that from the plan was measured on another form of the
    # scripts (measure it again, as its page says). Each table's runs: the benchmark's flags and the row's own.
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    run = ["--model", "tiny", "--vocab-size", "8192", "--batch-size", "16", "--seq-len", "128", "--microbatches", "8",
           "--device", "cpu"]

    def planned(flags: list[str], key: str) -> list[float]:  # MiB per process: pp outermost, then dp and tp
        ranks = plan.main([*run, *flags])["ranks"]
        capsys.readouterr()
        processes = int(flags[flags.index("--processes") + 1])
        return [ranks[r // (processes // len(ranks))][key] / 2**20 for r in range(processes)]

    tables = {  # (page, header): ({row: its flags}, {column: plan.py's key})
        ("schedules-and-benchmark.md", "| variant | median step (ms) | vs gpipe"): (
            {name: ["--processes", "2", "--schedule", schedule] for name, schedule in (
                *((s, s) for s in gpipe.SCHEDULES), ("afab (by hand)", "gpipe"), ("1f1b (by hand)", "1f1b"),
                ("gpipe (tracer)", "gpipe"))},  # AFAB holds what GPipe holds
            {"peak activations per rank (MiB)": "activations"}),
        ("faster-and-smaller.md", "| variant | median step (ms) | speedup"): (
            {"one process": ["--processes", "1"], "even": ["--processes", "2", "--split", "even"],
             "balanced": ["--processes", "2"],
             "balanced + activation checkpointing": ["--processes", "2", "--activation-checkpointing"]},
            {"peak activations per stage (MiB)": "activations"}),  # compiled: inductor's, not planned
        ("faster-and-smaller.md", "| --activation-checkpointing | median step (ms)"): (  # small, 1F1B, 2 ranks
            {spec: ["--processes", "2", "--model", "small", "--schedule", "1f1b", "--batch-size", "8", "--microbatches",
                    "4", "--activation-checkpointing", spec] for spec in ("none", "selective", "full", "3,0")},
            {"peak activations per rank (MiB)": "activations_flagged"}),
        ("tensor-parallel.md", "| variant | median step (ms) | vs no sequence parallel"): (
            {"sequence parallel": ["--processes", "4", "--tp", "2"],
             "no sequence parallel": ["--processes", "4", "--tp", "2", "--no-sequence-parallel"]},
            {"sent to other stages a step per rank (MiB)": "sent", "peak activations per rank (MiB)": "activations"}),
        ("data-parallel.md", "| layout | processes | median step"): (
            {"2 stages": ["--processes", "2"], "2 stages x 2 replicas": ["--processes", "4", "--dp", "2"]},
            {"params per rank (MiB)": "param", "grads per rank (MiB)": "grad",
             "AdamW state per rank (MiB)": "optimizer"}),
    }
    for (page, header), (flags, columns) in tables.items():
        rows = markdown_table(page, header)
        assert {row[header.split("|")[1].strip()] for row in rows} >= set(flags), (page, rows)
        for row in rows:
            name = row[header.split("|")[1].strip()]
            if name not in flags:
                continue
            for column, key in columns.items():
                if "--activation-checkpointing" in flags[name] and key == "activations":
                    key = "activations_checkpointed"
                documented = [float(mib) for mib in row[column].split(",")]
                assert documented == pytest.approx(planned(flags[name], key), rel=0.1), (page, name, column)


def test_the_readmes_quoted_outputs_and_counts_hold(prepared):
    # What the README quotes of a command's output, where the suite has that output at hand: prepare_data.py's line
    # (this session's data: the builtin corpus is this Python's standard library, so its figures are checked on
    # the Python they were taken on, their form on any), and the sizes of the diffs between the scripts ("about":
    # within 15 %, so that a few lines' change leaves the README true).
    readme = " ".join((ROOT / "README.md").read_text().split())
    (quoted,) = re.findall(r"`(prepared data: [^`]+)`", readme)
    printed = " ".join(prepared[1].stdout.split())
    python = re.search(r"from Python (\d+\.\d+\.\d+)'s standard library", readme)[1]
    if platform.python_version() == python:
        assert quoted in printed, (quoted, printed)
    assert re.search(re.sub(r"\d[\d,]*", r"\\d[\\d,]*", re.escape(quoted)), printed), (quoted, printed)
    diffs = re.findall(r"`diff (\S+) (\S+) \| wc -l` \(about (\d+)", readme)
    assert len(diffs) == 2, diffs
    for a, b, about in diffs:
        lines = subprocess.run(["diff", ROOT / a, ROOT / b], capture_output=True, text=True).stdout.count("\n")
        assert lines == pytest.approx(int(about), rel=0.15), (a, b, lines)


def test_the_docs_links_lead_to_a_page_and_heading_that_exist():
    # README.md and docs/*.md link to each other's sections; a section renamed or moved breaks the link silently.
    def slug(heading: str) -> str:  # GitHub's anchor of a heading
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def prose(page: Path) -> str:  # code blocks hold no links or headings
        return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)

    broken = []
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = page.parent / file if file else page
            if not linked.exists() or anchor and anchor not in {
                    slug(h) for h in re.findall(r"^#+ (.*)$", prose(linked), re.M)}:
                broken.append((page.name, target))
    assert broken == []


def test_a_llama_3_70b_config_json_plans_and_searches_as_the_preset_does(tmp_path, capsys, monkeypatch):
    # The issue's commands: a traceback (KeyError from config_from_preset) in both modes.
    config = write_config(tmp_path / "cfg" / "config.json", LLAMA_70B)
    monkeypatch.chdir(tmp_path)  # the scripts' checks read --checkpoint-dir (./checkpoints): none here
    common = ["--model", config, "--seq-len", "4096", "--batch-size", "512"]
    report = plan.main([*common, "--processes", "64", "--tp", "8", "--microbatches", "64", "--device", "cuda"])
    out = capsys.readouterr().out
    assert "plan: 80 layers, hidden 8192, vocab 128256, 64 processes = 8 pipeline x 1 data x 8 tensor" in out
    assert len(report["ranks"]) == 8 and set(report["schedules"]) >= {"gpipe", "1f1b", "interleaved1f1b"}
    started = time.thread_time()  # the search's CPU time (it runs in this thread): not stretched by a loaded machine
    best = plan.main([*common, "--gpus", "64", "--gpus-per-node", "8", "--gpu-memory", "80"])
    took = time.thread_time() - started
    assert took < 30, took  # 7 s alone on this 2-core machine; the issue asks for under 10
    out = capsys.readouterr().out
    assert re.match(r"\d+ layouts of 80 layers \(hidden 8192, vocab 128256\) on 64 GPUs", out) and len(best) == 5
    shape = config_from_hf(LLAMA_70B)
    for row in best:  # each command: the script's own parser and checks on the config's shape
        assert row["memory"] <= 0.9 * 80e9 and row["command"] in out
        words = shlex.split(row["command"].split("./run.sh ", 1)[1])
        assert words[1:3] == ["--init-from", str(tmp_path / "cfg")]
        module = SCRIPT_MODULES[words[0]]
        ns = checked_args(module, words[1:], 64)
        per_rank = len(gpipe.stage_ids(ns.schedule, 0, row["pp"], ns.stages_per_rank))
        module.stage_layout(shape, row["pp"] * per_rank, ns)
    # The same figures as the llama-70b preset (its RoPE is plain, which no figure depends on).
    preset = plan.main(["--model", "llama-70b", "--vocab-size", "128256", *common[2:], "--processes", "64",
                        "--tp", "8", "--microbatches", "64", "--device", "cuda"])
    assert preset == report


def test_flags_that_contradict_a_config_json_are_refused(tmp_path, capsys):
    config = write_config(tmp_path / "config.json", LLAMA_70B)
    common = ["--model", config, "--processes", "8", "--seq-len", "4096", "--device", "cuda"]
    assert refused(capsys, plan.main, *common, "--layers", "4").startswith(
        f"error: --layers 4: the model's shape comes from {config} (80 layers)")
    assert refused(capsys, plan.main, *common, "--vocab-size", "9").startswith(
        f"error: --vocab-size 9: the vocabulary comes from --model {config}")
    assert plan.main([*common, "--layers", "80"])["ranks"]  # the config's own count is no contradiction
    # A config.json with --init-from: the checkpoint's shape or the config's? Refused, as --model with it is.
    hf = tmp_path / "hf"
    write_config(hf / "config.json", {**LLAMA_70B, "num_hidden_layers": 8})
    (hf / "model.safetensors").write_bytes(b"")
    assert refused(capsys, plan.main, *common, "--init-from", hf).startswith(
        f"error: --model {config}: the model's shape comes from {hf}")


# -- plan.py: what a config.json may hold

BAD_CONFIGS = {  # name: (config.json's text or fields, what the line names)
    "empty_list": ("[]", "config.json is [], not an object of fields"),
    "string": ('"llama"', 'config.json is "llama", not an object of fields'),
    "not_json": ('{"model_type": ', "Expecting value"),
    "zero_heads": ({"num_attention_heads": 0}, "num_attention_heads = 0: must be a whole number from 1"),
    "zero_kv_heads": ({"num_key_value_heads": 0}, "num_key_value_heads = 0: must be a whole number from 1"),
    "negative_hidden": ({"hidden_size": -8192}, "hidden_size = -8192: must be a whole number from 1"),
    "zero_layers": ({"num_hidden_layers": 0}, "num_hidden_layers = 0: must be a whole number from 1"),
    "zero_vocab": ({"vocab_size": 0}, "vocab_size = 0: must be a whole number from 1"),
    "fractional_width": ({"intermediate_size": 28672.5}, "intermediate_size = 28672.5: must be a whole number"),
    "string_size": ({"hidden_size": "8192"}, 'hidden_size = "8192": must be a whole number'),
    "true_size": ({"num_hidden_layers": True}, "num_hidden_layers = true: must be a whole number"),
    "hidden_not_divisible": ({"num_attention_heads": 48}, "num_attention_heads = 48: must divide hidden_size (8192)"),
    "kv_not_dividing": ({"num_key_value_heads": 5}, "num_key_value_heads = 5: must divide num_attention_heads (64)"),
    "huge_hidden": ({"hidden_size": 2 ** 40}, f"hidden_size = {2 ** 40}: must be a whole number from 1 to "
                                              f"{2 ** 31 - 1}"),
    "enormous_hidden": ({"hidden_size": 10 ** 400}, "hidden_size = 1000000000000000000000000000000000000...:"),
    "huge_layers": ({"num_hidden_layers": 10 ** 6}, f"num_hidden_layers = 1000000: must be a whole number from 1 "
                                                    f"to {MAX_LAYERS}"),
    "huge_positions": ({"max_position_embeddings": 2 ** 63}, "max_position_embeddings = 9223372036854775808:"),
    "no_vocab": ({"vocab_size": None}, "config.json has no vocab_size"),
    "mistral": ({"model_type": "mistral"}, 'model_type = "mistral": not llama'),
    "rope_number": ({"rope_scaling": 5}, "rope_scaling = 5: must be an object of RoPE settings"),
    "rope_factor": ({"rope_scaling": {**LLAMA_70B["rope_scaling"], "factor": "x"}}, 'rope_scaling factor = "x"'),
    "rope_bands": ({"rope_scaling": {**LLAMA_70B["rope_scaling"], "high_freq_factor": 1.0}},
                   "rope_scaling high_freq_factor = 1.0: must exceed low_freq_factor"),
    "theta": ({"rope_theta": -1}, "rope_theta = -1: must be a finite positive number"),
    "eps": ({"rms_norm_eps": "small"}, 'rms_norm_eps = "small": must be a finite non-negative number'),
    "tied": ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings = "yes": must be true or false'),
}


def bad_config(name: str):
    text, _ = BAD_CONFIGS[name]
    if isinstance(text, str):
        return text
    return {k: v for k, v in {**LLAMA_70B, **text}.items() if v is not None}


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_a_bad_config_json_is_one_line_naming_the_file_and_the_field(name, tmp_path, capsys):
    config = write_config(tmp_path / "config.json", bad_config(name))
    before = snapshot(tmp_path)
    for mode in (["--gpus", "64"], ["--processes", "8", "--device", "cuda"]):
        with deadline(10):  # nothing searched, nothing allocated: a huge size once ran on (or overflowed)
            err = refused(capsys, plan.main, "--model", config, "--seq-len", "4096", "--batch-size", "512", *mode)
        assert err.startswith(f"error: --model {config}: cannot read it as a Hugging Face config.json (")
        assert BAD_CONFIGS[name][1] in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["empty_list", "zero_heads", "kv_not_dividing", "enormous_hidden"])
def test_a_bad_config_json_in_a_hugging_face_directory_is_one_line_too(name, tmp_path, capsys):
    # --init-from reads the same function: checkpoint.read_hf_config's line, then plan.py's.
    write_config(tmp_path / "hf" / "config.json", bad_config(name))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(checkpoint.UsageError) as error:
        checkpoint.read_hf_config(str(tmp_path / "hf"))
    assert str(error.value).startswith(f"--init-from {tmp_path / 'hf'}: config.json ") and "\n" not in str(error.value)
    assert BAD_CONFIGS[name][1] in str(error.value)
    err = refused(capsys, plan.main, "--init-from", tmp_path / "hf", "--processes", "2", "--device", "cpu")
    assert err == f"error: {error.value}"


def test_a_config_json_takes_what_transformers_takes():
    # Left out or null: transformers' defaults (as many KV heads as heads, hidden / heads per head); a head_dim
    # given need not divide the hidden size; the largest sizes allowed are computed with, never allocated.
    plain = {k: v for k, v in LLAMA_70B.items() if k not in ("num_key_value_heads", "rope_scaling")}
    config = config_from_hf({**plain, "num_key_value_heads": None, "head_dim": None})
    assert (config.num_key_value_heads, config.head_dim, config.rope_scaling) == (64, 128, None)
    assert config_from_hf({**plain, "num_attention_heads": 48, "head_dim": 128}).head_dim == 128
    assert config_from_hf({**LLAMA_70B, "rms_norm_eps": 0, "rope_theta": 10000}).rope_theta == 10000.0
    largest = config_from_hf({**plain, "vocab_size": 2 ** 31 - 1, "hidden_size": 2 ** 30, "num_attention_heads": 1,
                              "intermediate_size": 2 ** 31 - 1, "num_hidden_layers": MAX_LAYERS})
    assert largest.head_dim == 2 ** 30


def test_the_largest_config_json_plans_in_one_line(tmp_path):
    config = write_config(tmp_path / "config.json", {**LLAMA_70B, "vocab_size": 2 ** 31 - 1, "hidden_size": 2 ** 30,
                                                     "num_attention_heads": 2 ** 30, "num_key_value_heads": 1,
                                                     "intermediate_size": 2 ** 31 - 1})
    common = ["--model", config, "--seq-len", "4096", "--batch-size", "512"]
    search = run_script(0, "plan.py", *common, "--gpus", "64", cwd=tmp_path, timeout=60)
    assert search.returncode == 1 and len(search.stderr.splitlines()) == 1, search.stderr
    assert search.stderr.startswith("error: --gpu-memory 80: no layout fits; the smallest, pp 64 x dp 1 x tp 1 ")
    one = run_script(0, "plan.py", *common, "--processes", "8", "--microbatches", "8", "--device", "cuda", cwd=tmp_path,
                     timeout=60)
    assert one.returncode == 0 and "hidden 1073741824, vocab 2147483647" in one.stdout, one.stderr


# -- plan.py: sizes of any magnitude; the layouts the scripts accept; units that show small figures

def test_divisors_are_found_by_trial_up_to_the_square_root():
    for n in range(1, 400):
        assert plan.divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    with deadline(5):
        assert plan.divisors(10 ** 12) == sorted(2 ** a * 5 ** b for a in range(13) for b in range(13))


@pytest.mark.parametrize("argv", [["--gpus", "8", "--batch-size", "99999999999999"],
                                  ["--gpus", "8", "--gpus-per-node", "99999999999999", "--batch-size", "9" * 14],
                                  ["--gpus", "99999999999992", "--batch-size", "99999999999992"]])
def test_a_huge_batch_or_cluster_is_searched_in_seconds(argv, tmp_path):
    # divisors() walked range(1, n + 1): each ran until killed (a timeout here).
    started = time.perf_counter()
    result = run_script(0, "plan.py", *argv, cwd=tmp_path, timeout=60)
    assert time.perf_counter() - started < 30
    assert result.returncode in (0, 1) and error_lines(result.stderr) == result.stderr.splitlines(), result.stderr
    assert result.returncode == 0 or "no layout fits" in result.stderr


def accepted(config, gpus: int, batch: int, gpus_per_node: int = 8, model: str = "small") -> dict:
    """(pp, dp, tp, schedule, checkpointing) -> the most microbatches train_pipeline_gpipe.py accepts (its
    check_args and stage_layout), over every pp x dp x tp = gpus with tp inside a node: found by trying all."""
    found = {}
    for tp in [t for t in range(1, gpus_per_node + 1) if gpus % t == 0 and gpus_per_node % t == 0]:
        for dp in [d for d in range(1, gpus // tp + 1) if gpus % (tp * d) == 0]:
            pp = gpus // (tp * dp)
            for schedule in gpipe.SCHEDULES:
                for checkpointing in (False, True):
                    for m in range(1, batch + 1):
                        try:
                            ns = checked_args(gpipe, [
                                "--model", model, "--batch-size", str(batch), "--microbatches", str(m), "--schedule",
                                schedule, "--dp", str(dp), "--tp", str(tp), "--checkpoint-dir", os.devnull + "/none",
                                *(["--activation-checkpointing"] if checkpointing else [])], gpus)
                            per_rank = len(gpipe.stage_ids(schedule, 0, pp, ns.stages_per_rank))
                            gpipe.stage_layout(config, pp * per_rank, ns)
                            plan.check_microbatches(schedule, pp, m, pp * per_rank)  # what torch's schedules say
                        except checkpoint.UsageError:
                            continue
                        found[pp, dp, tp, schedule, checkpointing] = m
    return found


@pytest.mark.parametrize("model, gpus, batch", [("small", 4, 2), ("small", 8, 4), ("small", 2, 1), ("tiny", 8, 4)])
def test_the_search_finds_every_layout_the_scripts_accept(model, gpus, batch, capsys):
    # 4 GPUs and a batch of 2 was "no layout passes the scripts' checks": the search asked for at least as many
    # microbatches as stages, which only 1F1B and DualPipeV need (GPipe runs 2 microbatches on 4 stages). The
    # tiny model's 6 layers on 8 stages: the embedding and the head each a stage of its own.
    config = config_from_preset(model, plan.VOCAB_SIZE)
    expected = accepted(config, gpus, batch, model=model)
    assert any(pp > m for (pp, *_), m in expected.items())
    assert model == "small" or any(pp > config.num_hidden_layers for pp, *_ in expected)
    best = plan.main(["--model", model, "--gpus", str(gpus), "--batch-size", str(batch), "--top", "1000"])
    capsys.readouterr()
    got = {(r["pp"], r["dp"], r["tp"], r["schedule"], r["checkpointing"]): r["microbatches"] for r in best}
    # One stage runs every schedule alike: the search times the first only.
    assert got == {k: m for k, m in expected.items() if k[0] > 1 or k[3] == next(iter(gpipe.SCHEDULES))}


def test_step_times_and_memory_are_printed_in_units_that_show_them(capsys):
    best = plan.main(["--gpus", "8"])  # the small model: steps of a millisecond or less, MiB per GPU
    out = capsys.readouterr().out
    rows = re.findall(r"^\d+\. .*: step ([\d.]+) (s|ms) \(.*, ([\d.]+) (GiB|MiB|KiB) per GPU$", out, re.M)
    assert len(rows) == len(best) == 5
    scale = {"s": 1, "ms": 1e-3, "GiB": 2 ** 30, "MiB": 2 ** 20, "KiB": 2 ** 10}
    for (step, s_unit, memory, m_unit), row in zip(rows, best):
        assert float(step) >= 1 or s_unit == "ms"
        assert float(step) * scale[s_unit] == pytest.approx(row["step"], rel=0.01)
        assert 1 <= float(memory) < 1024 and float(memory) * scale[m_unit] == pytest.approx(row["memory"], rel=0.01)
    assert "fit in 72 GB" in out
    err = refused(capsys, plan.main, "--gpus", "8", "--gpu-memory", "0.001")
    needs = re.search(r"needs ([\d.]+) (MiB|KiB) per GPU", err)
    assert needs and float(needs.group(1)) >= 1, err
    best = plan.main(["--gpus", "8", "--gpu-memory", "0.4"])
    assert "fit in 343.3 MiB (the rest" in capsys.readouterr().out and best
    assert [plan.show_seconds(t) for t in (21.356, 1.0, 0.000777, 2.5e-6)] == ["21.36 s", "1.00 s", "0.777 ms",
                                                                               "0.0025 ms"]
    assert [plan.show_bytes(n) for n in (62.6 * 2 ** 30, 2 ** 20, 1023 * 2 ** 10, 100)] == [
        "62.6 GiB", "1.0 MiB", "1023.0 KiB", "0.1 KiB"]
    assert [plan.show_gb(n) for n in (21e9, 1e9, 0.9e9)] == ["21 GB", "1 GB", "858.3 MiB"]


# ----------------------------------------------------------------------------------------------------------
# 7. Tools: benchmark.py and run.sh

# -- benchmark.py: measure-memory, reading the scripts' traces

def test_measure_memory_gives_a_scripts_error_in_one_line_and_fails_when_it_measured_nothing(tmp_path, data_dir):
    result = run_script(0, "benchmark.py", "measure-memory", "out.json", str(ROOT / "train_pipeline_afab_manual.py"),
                        "--data", "nowhere", "--steps", "1", cwd=tmp_path)
    assert result.returncode == 1 and error_lines(result.stderr) == [
        "error: --data nowhere: no data prepared there; run python prepare_data.py --out nowhere first (see its "
        "--help)"], result.stderr
    assert not (tmp_path / "out.json").exists()
    # A run that trains no step measured nothing: it says so. Here a finished run resumed (its checkpoint made by
    # the first run), and --steps 0, on 2 ranks.
    measure = ["benchmark.py", "measure-memory", "out.json", str(ROOT / "train_pipeline_gpipe.py"), *TRAIN_ARGS,
               "--steps", "1", "--data", data_dir]
    assert run_script(2, *measure, cwd=tmp_path).returncode == 0 and (tmp_path / "out.json").exists()
    (tmp_path / "out.json").unlink()
    for given, why in [([], "--checkpoint-dir checkpoints holds a run that already reached --steps 1; add --fresh, "
                            "or give another --checkpoint-dir"),
                       (["--steps", "0"], "--steps 0 only evaluates; give --steps 2")]:
        result = run_script(2, *measure, *given, cwd=tmp_path)
        assert result.returncode == 1 and error_lines(result.stderr) == [
            f"error: measure-memory: train_pipeline_gpipe.py trained no step, so nothing was measured: {why}"], \
            result.stderr
        assert not (tmp_path / "out.json").exists()


def _span(name, ts, dur, tid=7, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def _write(directory: Path, per_rank: list[list[dict]], run: dict | None = None) -> str:
    """Each rank's events as a trace file, and what the run measured (run, as the scripts' --trace writes it)."""
    directory.mkdir()
    for rank, events in enumerate(per_rank):
        (directory / f"rank{rank}.json").write_text(json.dumps({"traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "main"}}, *events],
            **({"run": run} if run else {})}))
    return str(directory)


def test_the_trace_of_a_single_stage_schedule(tmp_path):
    # GPipe, 2 ranks, 2 microbatches, one profiled step of 20 ms (µs below), then the profiler's tail.
    rank0 = [_span("ProfilerStep#5", 1000, 20000), _span("ProfilerStep#6", 21000, 5000),
             _span("Forward 0", 1100, 1000), _span("Forward 1", 2200, 1000),
             _span("gloo:send", 2100, 8000), _span("gloo:send", 8, 9000, tid=9),  # async, other threads: ignored
             _span("Backward 0", 5000, 4000), _span("c10d::recv_", 5000, 10, cat="cpu_op"),
             _span("gloo:recv", 5005, 1995),  # posted at 5005, but the wait starts after the op: 1990 blocked
             _span("aten::mm", 7100, 100, cat="cpu_op"),
             _span("Backward 1", 9500, 3000), _span("gloo:recv", 9500, 500)]
    rank1 = [_span("ProfilerStep#5", 1000, 20000),
             _span("Forward 0", 1200, 2000), _span("gloo:recv", 1200, 1000), _span("loss", 3300, 300),
             _span("Forward 1", 3700, 1500), _span("gloo:recv", 3700, 200), _span("loss", 5300, 300),
             _span("Backward 0", 5700, 3000), _span("Backward 1", 8800, 3000)]
    trace = _write(tmp_path / "gpipe.trace", [rank0, rank1])
    ranks = benchmark.read_trace(trace)
    assert [r["steps"] for r in ranks.values()] == [
        [{"time": pytest.approx(0.02, abs=1e-9), "busy": pytest.approx(0.00651, abs=1e-9),
          "waiting": pytest.approx(0.00249, abs=1e-9)}],
        [{"time": pytest.approx(0.02, abs=1e-9), "busy": pytest.approx(0.0089, abs=1e-9),
          "waiting": pytest.approx(0.0012, abs=1e-9)}]]
    # Medians per microbatch: rank 0 forwards 1 ms, backwards 2.01 and 2.5; rank 1 forwards 1 + 0.3 (the loss)
    # and 1.3 + 0.3, backwards 3.
    assert [pytest.approx(t, abs=1e-9) for t in [(0.001, 0.002255), (0.00145, 0.003)]] == \
        benchmark.forward_backward_times(trace)
    assert benchmark.stage_times(trace) == pytest.approx([0.003255, 0.00445], abs=1e-9)
    assert benchmark.measured_bubble(trace) == pytest.approx(((1 - 6510 / 20000) + (1 - 8900 / 20000)) / 2)
    assert benchmark.receive_share(trace) == pytest.approx((2490 / 20000 + 1200 / 20000) / 2)
    assert benchmark.traced_step_time(trace) == pytest.approx(0.02)
    assert benchmark.ideal_gpipe_step(trace, p=2, m=2) == pytest.approx(3 * 0.00445, abs=1e-9)
    assert benchmark.unequal_stages_bound(trace, m=2) == pytest.approx(0.003255 + 0.00445 + 0.00445, abs=1e-9)
    replay = benchmark.replayed(trace, "gpipe", 2)  # plan.py's replay fed these stage times
    assert replay["step"] == pytest.approx(0.001 + 0.00145 * 2 + 0.003 * 2 + 0.002255, abs=1e-9)


def test_the_trace_of_a_multi_stage_schedule(tmp_path):
    # One rank of a looped or V-shaped schedule: a receive posted in its RECV action and waited for in the
    # forward that needs it (after another stage's forward ran), an overlapped F + B, a backward as I + W.
    rank = [_span("ProfilerStep#3", 0, 10000),
            _span("PP:1RECV_F0", 100, 50), _span("c10d::recv_", 110, 20, cat="cpu_op"), _span("gloo:recv", 120, 2880),
            _span("PP:0F0", 200, 1000), _span("aten::mm", 300, 800, cat="cpu_op"),
            _span("PP:1F0", 1300, 2000),  # waits 1300 .. 3000, then computes 0.3 ms
            _span("PP:1SEND_F0", 3310, 50), _span("PP:(0F1;1B0)OVERLAP_F_B", 3400, 3000),
            _span("PP:0I0", 6500, 400), _span("PP:0W0", 7000, 600), _span("PP:0REDUCE_GRAD", 7700, 100)]
    parsed = benchmark.read_rank(_write(tmp_path / "looped.trace", [rank]) + "/rank0.json")
    assert parsed["steps"] == [{"time": pytest.approx(0.01), "busy": pytest.approx(0.0053, abs=1e-9),
                                "waiting": pytest.approx(0.0017, abs=1e-9)}]
    # The overlapped action counts as busy, but in no per-microbatch time; I + W make stage 0's backward.
    assert parsed["stages"] == {0: {"forward": pytest.approx(0.001), "backward": pytest.approx(0.001)},
                                1: {"forward": pytest.approx(0.0003, abs=1e-9), "backward": 0.0}}
    assert benchmark.compute_actions("PP:(0F1;3B0)OVERLAP_F_B") == [("F", 0, 1), ("B", 3, 0)]
    assert benchmark.compute_actions("PP:2W1") == [("W", 2, 1)] and benchmark.compute_actions("backward 3") == [
        ("B", None, 3)]
    for name in ("PP:0SEND_F3", "PP:2RECV_B1", "PP:0UNSHARD", "recv 3", "send 3", "loss", "gloo:recv"):
        assert benchmark.compute_actions(name) is None, name


# -- benchmark.py: one small run of each mode

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check runs there")
def test_the_one_gpu_check_says_in_one_line_that_it_needs_a_gpu(capsys, data_dir):
    # benchmark.py gpu-check runs what one GPU can check (README, "Measured on a GPU"); without one, one line.
    assert refused(capsys, benchmark.gpu_check, "--data", data_dir) == (
        "error: gpu-check: no GPU is visible; it runs on a machine with one (the CPU checks are pytest's)")
    assert refused(capsys, benchmark.gpu_check, "--only", "hang,nope").startswith(
        "error: --only: unknown nope; choose from compile, documents, hang,")


# What a rank's stderr holds when NCCL's watchdog ends a hung all-reduce: the lines measured on an H100 (torch
# 2.11, NCCL 2.28; docs/launching.md, "What a hang looks like on GPUs"), in the form c10's log gives each line
# (a public log's: "[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught ...").
WATCHDOG_STDERR = """\
[rank0]:[E1129 05:31:02.118275104 ProcessGroupNCCL.cpp:688] [PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught \
collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=20000) ran \
for 20092 milliseconds before timing out.
[rank0]:[E1129 05:32:08.203311985 ProcessGroupNCCL.cpp:2073] [PG ID 0 PG GUID 0(default_pg) Rank 0] Some NCCL \
operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations \
might run on corrupted/incomplete data. To avoid data inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
"""


def test_the_gpu_checks_hang_verdict_wants_the_watchdogs_line_and_the_flight_recorders_dump(tmp_path):
    # benchmark.py gpu-check's run whose all-reduce never completes passes only if it ended by itself with NCCL's
    # watchdog line for that all-reduce and the flight recorder's dump holding it uncompleted (any non-zero exit
    # passed before: a traceback, the scripts' own line). The dump: torch's flight recorder (the same one gloo's
    # calls go to) after a gloo all-reduce, in a process of its own; its state as NCCL's reads for a call that
    # never started (scheduled, docs/launching.md) and for one that went through (completed).
    write = ("import os, torch, torch.distributed as dist; dist.init_process_group('gloo', store=dist.HashStore(), "
             "rank=0, world_size=1); dist.all_reduce(torch.ones(1, dtype=torch.float64)); "
             "open('dump', 'wb').write(torch._C._distributed_c10d._dump_fr_trace())")
    result = start([sys.executable, "-c", write], cwd=tmp_path, env=dict(script_env(), TORCH_FR_BUFFER_SIZE="100"))
    assert result.returncode == 0, result.stderr
    dump = pickle.loads((tmp_path / "dump").read_bytes())
    (entry,) = [e for e in dump["entries"] if e["profiling_name"] == "gloo:all_reduce"]
    for state, name in (("scheduled", "pending"), ("completed", "completed")):
        entry["state"] = state
        (tmp_path / name).write_bytes(pickle.dumps(dump))
    (tmp_path / "object").write_bytes(pickle.dumps({"entries": [Path("x")]}))
    pending, verdict = str(tmp_path / "pending"), benchmark.hang_verdict
    assert verdict(-6, WATCHDOG_STDERR, pending) is None  # SIGABRT, as measured
    assert verdict(None, "", pending) == verdict(-9, WATCHDOG_STDERR, pending) == (
        "did not end by itself (killed at gpu-check's deadline)")
    assert verdict(0, "", pending) == "completed: the held call never waited"
    lost = "error: lost contact with another rank (Connection closed by peer); if another rank printed an error above"
    assert verdict(1, lost, pending) == "exited 1 without the watchdog's line for the all-reduce"
    broadcast = WATCHDOG_STDERR.replace("OpType=ALLREDUCE", "OpType=BROADCAST")  # another call timed out
    assert verdict(-6, broadcast, pending) == "exited -6 without the watchdog's line for the all-reduce"
    for path, why in ((tmp_path / "nowhere", "No such file"), (tmp_path / "object", "not in a flight recorder's")):
        assert verdict(-6, WATCHDOG_STDERR, str(path)).startswith(f"no flight recorder dump at {path} ("), path
        assert why in verdict(-6, WATCHDOG_STDERR, str(path))
    assert verdict(-6, WATCHDOG_STDERR, str(tmp_path / "completed")) == (
        f"the flight recorder's dump ({len(dump['entries'])} calls) holds no all-reduce left uncompleted")


def test_nccl_rules_says_what_it_cannot_check_in_one_line(tmp_path, capsys):
    assert refused(capsys, nccl_rules.main, "check", tmp_path) == (
        f"error: {tmp_path} holds no rankN.json; record a run into it first")
    assert refused(capsys, nccl_rules.main, "check", tmp_path / "nowhere").startswith(
        f"error: {tmp_path / 'nowhere'}: not a recording of nccl_rules.py record")
    (tmp_path / "rank0.json").write_text("{")
    assert refused(capsys, nccl_rules.main, "check", tmp_path).startswith(f"error: {tmp_path}: not a recording")
    assert refused(capsys, nccl_rules.main, "record", tmp_path, "nope.py") == (
        "error: nope.py: no such script; give the training script to run, then its flags")
    # A recording that shows nothing is no pass: a rank without a call, a rank its groups name without its file.
    groups = {"0": {"ranks": [0, 1], "backend": "nccl"}}
    call = {"op": 0, "thread": "main", "kind": "collective", "group": "0", "peer": None, "bytes": 4, "name": "barrier",
            "reduce": None, "root": None, "batch": None, "at": "torch"}
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "events": [call], "groups": groups, "gaps": []}))
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "events": [], "groups": {}, "gaps": []}))
    assert refused(capsys, nccl_rules.main, "check", tmp_path) == (
        "error: rank 1 recorded no call; record a run that communicates")
    (tmp_path / "rank1.json").unlink()
    assert refused(capsys, nccl_rules.main, "check", tmp_path) == (
        "error: no recording of rank 1, which the groups hold; check the directory of a whole run")
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "events": [call], "groups": groups, "gaps": []}))
    nccl_rules.main(["check", str(tmp_path)])  # both ranks' barrier: complete


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's checks")
def test_the_one_gpu_check_passes(tmp_path, data_dir):
    result = launch(0, "benchmark.py", "gpu-check", "--quick", "--data", data_dir, "--out", tmp_path, cwd=tmp_path,
                    timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize("argv, message", [
    (["--variants", "1f1b,nope"], "error: --variants: unknown nope; choose from gpipe, 1f1b,"),
    (["--splits", "--variants", "1f1b"], "error: --variants: unknown 1f1b; choose from one process, even,"),
    (["--variants", "1f1b,nowhere/gen.csv"], "error: --variants nowhere/gen.csv: no such file; write an order there "
                                             "with plan.py --write-schedule nowhere/gen.csv, or give the path of one"),
    (["--steps", "1"], "error: --repeats, --dp and --tp must be at least 1 and --steps at least 2"),
    (["--data", "nowhere"], "error: --data nowhere: no data prepared there; run python prepare_data.py --out "
                            "nowhere first"),
    # --seq-chunks' mode: its own variants; chunks the scripts would refuse, before the runs; --budget with it alone
    (["--seq-chunks", "2", "--variants", "1f1b,gpipe"], "error: --variants: unknown gpipe; choose from 1f1b, 1f1b "
                                                        "--seq-chunks 2, 1f1b (by hand), "),
    (["--seq-chunks", "3"], "error: --seq-chunks 3 does not cut --seq-len 128 into even chunks; the nearest that "
                            "does: --seq-chunks 2"),
    (["--budget", "100"], "error: --budget 100: give --seq-chunks S too"),
])
def test_benchmark_refuses_bad_flags_in_one_line(argv, message, data_dir, capsys):
    err = refused(capsys, benchmark.parse_args, "--data", data_dir, *argv, status=1 if "--data" in argv else 2)
    assert err.startswith(message), err


def forked_launch(cmd: list, ranks: int, workdir: str, what: str) -> str:
    """benchmark.launch, each rank forked (run_script) instead of started by torchrun."""
    result = run_script(ranks, cmd[0], *cmd[1:], cwd=workdir, timeout=600)
    if result.returncode != 0:
        sys.exit(f"benchmark: {what} failed:\n{errors(result.stderr)}")
    return result.stdout


def test_benchmark_writes_its_tables_in_every_mode(tmp_path, data_dir, monkeypatch, capsys):
    small = ["--repeats", "1", "--steps", "3", "--seq-len", "16", "--data", data_dir, "--", "--layers", "2"]
    order = str(schedule_file("zbh1", 2, 4, tmp_path))  # a FILE.csv variant: train_pipeline_gpipe.py runs it
    jobs = {"bench": ["--variants", f"1f1b,{order}", "--batch-size", "4", "--microbatches", "4", "--out", "bench"],
            "sweep": ["--sweep", "--sweep-microbatches", "1,2", "--batch-size", "4", "--out", "sweep"],
            "dp": ["--dp", "2", "--batch-size", "8", "--microbatches", "2", "--out", "dp"],
            "tp": ["--tp", "2", "--batch-size", "4", "--microbatches", "2", "--out", "tp"],
            "splits": ["--splits", "--variants", "balanced", "--batch-size", "4", "--microbatches", "2", "--out",
                       "splits"],
            "documents": ["--documents", "--ranks", "1", "--batch-size", "4", "--microbatches", "2", "--out",
                          "documents"],
            "chunks": ["--seq-chunks", "2", "--variants", "1f1b --seq-chunks 2", "--batch-size", "4", "--microbatches",
                       "2", "--out", "chunks"],
            "vocab": ["--vocab-parallel", "--batch-size", "4", "--microbatches", "2", "--out", "vocab"]}
    # The sweep as users run it (its runs under torchrun); the other modes' runs with their ranks forked.
    sweep = run_script(0, "benchmark.py", *jobs.pop("sweep"), *small, cwd=tmp_path, wait=False)
    monkeypatch.chdir(tmp_path)
    launched, kept = [], []  # kept: checkpoints an earlier run left in the runs' folder (small's: 1.4 GB a run)
    monkeypatch.setattr(benchmark, "launch", lambda *a: launched.append(a[3]) or kept.extend(
        n for n in os.listdir(a[2]) if n.startswith("ckpt")) or forked_launch(*a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the pictures are missing, and it says so
    said = {}
    for name, argv in jobs.items():
        benchmark.main(benchmark.parse_args([*argv, *small]))
        said[name], runs = capsys.readouterr().err, len(launched)
        launched.clear()
        # Before any run, how many it will make; then a tick of its progress bar per run, which ends at all of them.
        assert said[name].startswith(f"benchmark: {runs} training runs, one at a time") and runs > 1, said[name]
        assert re.search(rf"\b{runs}/{runs} \[", said[name]) and not re.search(rf"\b{runs + 1}/{runs}\b", said[name])
    assert kept == []
    assert "benchmark: no timeline pictures: matplotlib is not installed (pip install matplotlib)\n" in \
        said["bench"] and not list((tmp_path / "bench").glob("*.png"))
    result = finish(sweep, timeout=600)
    assert result.returncode == 0, errors(result.stderr)
    assert "benchmark: 2 training runs" in result.stderr and "2/2 [" in result.stderr  # m = 1, 2; no memory run

    table = (tmp_path / "bench" / "results.md").read_text()
    rows = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["variant", "gpipe", "1f1b", order]  # gpipe runs even when not asked for: it is the reference
    assert re.search(r"bubble-limited ideal .* = \d+\.\d\d\n", table), table
    assert re.search(r"tighter bound for unequal stages.* = \d+\.\d\d\n", table), table
    assert "Stage-0 activations, 1F1B / GPipe = 0.500; p/m = 0.500 (+0%)" in table  # 2 of 4 microbatches
    for name in ("gpipe", "1f1b"):  # plan.py's replay of the order, with the traced run's stage times
        assert re.search(rf"{name}: plan.py's replay .* step [\d.]+ ms \(traced [\d.]+ ms, .* bubble [\d.]+% "
                         r"\(measured [\d.]+%\)", table), table
        trace = str(tmp_path / "bench" / f"{name}.trace")
        assert sorted(os.listdir(trace)) == ["rank0.json", "rank1.json"]
        assert len(benchmark.stage_times(trace)) == 2 and min(benchmark.stage_times(trace)) > 0
        assert 0 < benchmark.measured_bubble(trace) < 1 and 0 < benchmark.receive_share(trace) < 1
    results = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]
    assert all(len(r["activation_bytes_per_rank"]) == 2 for r in results.values())
    assert sorted(os.listdir(results[order]["trace"])) == ["rank0.json", "rank1.json"]  # the file's order ran

    table = (tmp_path / "sweep" / "sweep.md").read_text()
    assert [line.split(" | ")[0] for line in table.splitlines() if re.match(r"\| \d", line)] == ["| 1", "| 2"]

    # Pipeline alone vs pipeline x 2 replicas: each replica's rank holds half (params, grads, AdamW state).
    layouts = json.loads((tmp_path / "dp" / "data_parallel.json").read_text())["results"]
    alone, sharded = (layouts[name]["memory"] for name in ("2 stages", "2 stages x 2 replicas"))
    for kind in ("param", "grad", "optimizer"):
        assert [b / 2 for b in alone[f"{kind}_bytes_per_rank"] for _ in range(2)] == \
            pytest.approx(sharded[f"{kind}_bytes_per_rank"], rel=0.01)

    # tp 2 with and without sequence parallelism: half the bytes sent (measure-memory's count), fewer activations.
    layouts = json.loads((tmp_path / "tp" / "sequence_parallel.json").read_text())["results"]
    with_sp, without = (layouts[name] for name in ("sequence parallel", "no sequence parallel"))
    assert with_sp["sent_bytes_per_rank"] == [b / 2 for b in without["sent_bytes_per_rank"]] and \
        len(with_sp["sent_bytes_per_rank"]) == 4
    assert all(a < b for a, b in zip(with_sp["memory"]["activation_bytes_per_rank"],
                                      without["memory"]["activation_bytes_per_rank"]))

    table = (tmp_path / "splits" / "splits.md").read_text()
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")][1:] == \
        ["| one process", "| balanced"]
    assert "[embed + layers 0-1 (" in table and "[norm + head (" in table  # the head outweighs 2 layers
    # Each stage's traced time per microbatch, the bubble, its activations, and GPipe's replay with those times.
    assert re.search(r"\| balanced \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+, [\d.]+ \| [\d.]+% \| [\d.]+, [\d.]+ \|",
                     table), table
    assert re.search(r"balanced: plan.py's replay .* step [\d.]+ ms \(traced [\d.]+ ms", table), table

    # --document-masking against causal attention, one rank: the step time, its ratio, the peak memory.
    table = (tmp_path / "documents" / "documents.md").read_text()
    assert re.search(r"\| causal \| [\d.]+ \| 1.00 \| \d+ \| \d+ \|\n\| document masking \| [\d.]+ \| [\d.]+ \| \d+ "
                     r"\| \d+ \|", table), table

    # 1F1B whole against in 2 chunks: the step and its ratio, plan.py's, the bubbles traced and planned, the
    # activations measured and planned (within the 10 % issue 53 asks), rank 0's share of whole sequences'.
    table = (tmp_path / "chunks" / "seq_chunks.md").read_text()
    rows = {row["variant"]: row for row in markdown_table_of(table, "| variant | median step (ms)")}
    assert list(rows) == ["1f1b", "1f1b --seq-chunks 2"], table
    for name, row in rows.items():
        assert re.fullmatch(r"[\d.]+%", row["bubble (traced)"]) and re.fullmatch(r"[\d.]+%", row["bubble (plan.py)"])
        measured, planned = ([float(x) for x in row[column].split(",")] for column in (
            "activations per rank (MiB), measured", "planned (plan.py)"))
        assert planned == pytest.approx(measured, rel=0.1), (name, row)
    assert rows["1f1b"]["vs whole (its script's, else 1f1b)"] == "1.00" and float(
        rows["1f1b --seq-chunks 2"]["rank 0 vs whole"]) < 1, table

    # The hand-written 1F1B with and without --vocab-parallel: each rank's share of the traced work (its vocabulary
    # passes counted, their collectives' waits not), and what it holds: the 2 layers one a stage, and with the flag
    # the vocabulary's rows split evenly, so every rank the same parameters, the same in all as without.
    table = (tmp_path / "vocab" / "vocab_parallel.md").read_text()
    rows = {row["variant"]: row for row in markdown_table_of(table, "| variant | median step (ms)")}
    assert list(rows) == ["1f1b (by hand)", "1f1b (by hand) --vocab-parallel"], table
    for name, row in rows.items():
        shares = [float(x.rstrip("%")) for x in row["work per rank"].split(" / ")]
        assert len(shares) == 2 and min(shares) > 0 and abs(sum(shares) - 100) <= 1, (name, row)
        assert 0 < float(row["bubble (measured)"].rstrip("%")) < 100, (name, row)
    plain, spread = ([float(x) for x in row["params per rank (MiB)"].split(",")] for row in rows.values())
    assert spread[0] == spread[1] and sum(spread) == pytest.approx(sum(plain), abs=0.02) and plain[0] != plain[1]
    # plan.py's memory rows are what the runs measured (measure-memory), within 10 % as for the other layouts
    # (test_the_plan_counts_what_the_runs_hold), with --vocab-parallel what its variant holds: each rank's slices,
    # their gradients and AdamW state; the layers' activations, on the first rank the step's embeddings and, from each
    # one's backward, its gradient (the meter counts them till the step's end), on the last the hidden states' gradient
    # of one microbatch; its start-up drawing each whole matrix to keep its rows.
    for name, r in json.loads((tmp_path / "vocab" / "vocab_parallel.json").read_text())["results"].items():
        for kind, key in (("param", "param"), ("grad", "grad"), ("optimizer", "optimizer"), ("startup", "startup"),
                          ("activation", "activations_flagged")):
            assert r["memory"][f"{kind}_bytes_per_rank"] == pytest.approx([row[key] for row in r["planned"]],
                                                                           rel=0.1), (name, kind, r["planned"])
        planned = [float(x) for x in rows[name]["planned (plan.py)"].split(",")]
        assert planned == pytest.approx([row["activations_flagged"] / 2**20 for row in r["planned"]], abs=0.005)
    trace = tmp_path / "vocab" / "1f1b_by_hand_vocab_parallel.trace"
    for rank, read in plan.read_trace(str(trace)).items():  # a step's work holds its vocabulary passes' own time
        events = [e for e in json.loads((trace / f"rank{rank}.json").read_text())["traceEvents"] if e.get("ph") == "X"]
        (lo, hi), *_ = read["spans"]
        spans = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e["name"].startswith("vocab ")]
        waits = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e["name"] in (
            "gloo:broadcast", "gloo:reduce", "gloo:all_reduce")]
        own = sum(e - s for s, e in spans if lo <= s <= hi) - sum(
            e - s for s, e in waits if lo <= s <= hi and any(a <= s and e <= b for a, b in spans))
        assert read["steps"][0]["busy"] >= own > 0, (rank, read["steps"][0], own)
        # and the passes' collective waits (gloo records them on its own thread) are read as waiting, not work
        assert any(a <= s and t <= b for s, t, kind in read["segments"] if kind == "waiting" for a, b in spans), rank
    assert "traced with --vocab-parallel, whose vocabulary passes run on every rank" in refused(
        capsys, plan.main, "--processes", "2", "--layers", "2", "--trace", str(trace))


@pytest.mark.parametrize("factor", [1.0, 1.25, 0.5])
def test_benchmark_budget_search_starts_at_plans_longest_and_walks(factor, data_dir, tmp_path, monkeypatch):
    # --seq-chunks --budget: the longest --seq-len (a multiple of 64 S, up to the model's positions: tiny's 1024)
    # within the budget, measured; each measurement here plan.py's count x factor (plan right, short, over), so the
    # answer is known from the plan alone: the search must find it, starting where the plan says (2 runs if right).
    argv = ["--seq-chunks", "2", "--batch-size", "2", "--microbatches", "2", "--data", data_dir, "--out",
            str(tmp_path / "out"), "--", "--model", "tiny", "--layers", "2"]
    args = benchmark.parse_args(argv)
    args.budget = 1.01 * max(r["activations_flagged"] for r in benchmark.planned(args, 512, 1)["ranks"]) / 2**20
    runs = []

    def memory(args, script, schedule, workdir, extra=(), **kwargs):  # measure-memory's answer: the plan's x factor
        seq_len, chunks = int(extra[-1]), int(extra[1]) if "--seq-chunks" in extra else 1
        runs.append(seq_len)
        return {"activation_bytes_per_rank": [factor * r["activations_flagged"] for r in benchmark.planned(
            args, seq_len, chunks)["ranks"]]}, ""
    monkeypatch.setattr(benchmark, "memory", memory)
    for name, extra, chunks in (("1f1b", [], 1), ("1f1b --seq-chunks 2", ["--seq-chunks", "2"], 2)):
        results, runs[:] = {name: {}}, []
        benchmark.longest(args, str(tmp_path), name, "train_pipeline_gpipe.py", extra, results)
        plans = {n: max(r["activations_flagged"] for r in benchmark.planned(args, n, chunks)["ranks"])
                 for n in range(128, 1025, 128)}
        fitting = [n for n in plans if factor * plans[n] <= args.budget * 2**20]
        found = results[name]["longest"]
        assert (found["seq_len"], found["positions"]) == (max(fitting, default=None), 1024), (name, found)
        assert runs[0] == found["planned_seq_len"] == max(n for n in plans if plans[n] <= args.budget * 2**20)
        assert sorted(found["measured"]) == sorted(runs)
        if factor == 1:  # the plan's longest fits, the next length does not (unless it is the top)
            assert runs == [found["seq_len"]] + [found["seq_len"] + 128] * (found["seq_len"] < 1024), runs


# -- benchmark.py: its numbers and its --out

@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "error: argument --ranks: must be a whole number of at least 1, got 0"),
    (["--microbatches", "0"], "error: argument --microbatches: must be a whole number of at least 1, got 0"),
    (["--batch-size", "-4"], "error: argument --batch-size: must be a whole number of at least 1, got -4"),
    (["--seq-len", "0"], "error: argument --seq-len: must be a whole number of at least 1, got 0"),
    (["--sweep", "--sweep-microbatches", "0,2"], "error: --sweep-microbatches 0,2: each count must be at least 1"),
])
def test_benchmark_refuses_counts_below_one_in_one_line(argv, message, fake_data, capsys):
    assert refused(capsys, benchmark.parse_args, "--data", fake_data, *argv, status=2).startswith(message)


def test_benchmark_out_that_is_a_file_is_one_line(tmp_path, fake_data, capsys):
    (tmp_path / "file").write_text("mine")
    assert refused(capsys, benchmark.parse_args, "--data", fake_data, "--out", tmp_path / "file") == (
        f"error: --out {tmp_path / 'file'}: not a folder; give a folder (it is created if missing)")
    result = run_script(0, "benchmark.py", "--data", fake_data, "--out", str(tmp_path / "file" / "sub"), cwd=tmp_path)
    assert result.returncode == 1 and result.stderr == (
        f"error: --out {tmp_path / 'file' / 'sub'}: cannot create it (Not a directory); give another --out\n")
    assert (tmp_path / "file").read_text() == "mine"


def earlier_run(fake_data: str, out: Path, *argv) -> list[str]:
    """--out as a finished benchmark.py run with these flags left it (finish()'s files, traces, pictures)."""
    args = benchmark.parse_args(["--data", fake_data, "--out", str(out), *argv])
    out.mkdir()
    results = {}
    for path in benchmark.outputs(args):
        if path.endswith(".trace"):
            os.mkdir(path)
            for rank in range(3):  # an earlier --ranks 3
                Path(path, f"rank{rank}.json").write_text("{}")
        elif path.endswith(".png"):
            Path(path).write_bytes(b"\x89PNG")
            results[os.path.basename(path)] = {"picture": path}
    name = os.path.basename(benchmark.outputs(args)[0]).removesuffix(".md")
    benchmark.finish(args, "| variant |\n|---|", results, name=name)
    return benchmark.outputs(args)


@pytest.mark.parametrize("mode", [[], ["--sweep"], ["--dp", "2"], ["--splits"], ["--seq-chunks", "4"]])
def test_benchmark_replaces_an_earlier_runs_results_only_with_force(mode, tmp_path, fake_data, capsys, monkeypatch):
    out = tmp_path / "bench"
    written = earlier_run(fake_data, out, *mode)
    capsys.readouterr()
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in written)
    before = snapshot(tmp_path)
    argv = ["--data", fake_data, "--out", str(out), *mode]
    err = refused(capsys, benchmark.parse_args, *argv)
    assert err.startswith(f"error: --out {out}: holds {os.path.basename(written[0])}, ") and \
        "from an earlier run; add --force to replace them, or give another --out" in err, err
    args = benchmark.parse_args([*argv, "--force"])
    assert snapshot(tmp_path) == before  # checking destroys nothing
    # With --force, main() first removes the earlier traces (a stale rank2.json would be read with the new
    # run's two), nothing else; then the runs (not run here).
    class Started(Exception):
        pass

    def runs_start(*args, **kwargs):  # main() makes the runs' working folder, then runs: stop there
        seen["left"] = sorted(os.listdir(out))
        raise Started

    seen = {}
    monkeypatch.setattr(benchmark.tempfile, "TemporaryDirectory", runs_start)
    with pytest.raises(Started):
        benchmark.main(args)
    assert seen["left"] == sorted(os.path.basename(p) for p in written if not p.endswith(".trace"))


@pytest.mark.parametrize("change", ["edited_table", "own_table", "extra_file_in_trace", "own_json", "link",
                                    "own_picture"])
def test_benchmark_force_replaces_nothing_it_did_not_write(change, tmp_path, fake_data, capsys):
    out = tmp_path / "bench"
    earlier_run(fake_data, out)
    if change == "edited_table":
        (out / "results.md").write_text((out / "results.md").read_text() + "my notes\n")
    elif change == "own_table":
        for path in out.iterdir():
            if path.name != "results.md":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif change == "extra_file_in_trace":
        (out / "gpipe.trace" / "notes.txt").write_text("mine")
    elif change == "own_json":
        (out / "results.json").write_text('{"mine": 1}')
    elif change == "link":
        (tmp_path / "elsewhere.md").write_text("mine")
        (out / "results.md").unlink()
        (out / "results.md").symlink_to(tmp_path / "elsewhere.md")
    elif change == "own_picture":
        (out / "1f1b.png").write_bytes(b"mine")
        record = json.loads((out / "results.json").read_text())
        del record["results"]["1f1b.png"]
        (out / "results.json").write_text(json.dumps(record))
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        err = refused(capsys, benchmark.parse_args, "--data", fake_data, "--out", out, *force)
        assert err.startswith(f"error: --out {out}: holds ") and ", not written by benchmark.py, where this run " \
            "writes; move them away or give another --out" in err, err
    assert snapshot(tmp_path) == before


# -- plot.py: the losses of --metrics files, drawn

def metrics_file(path: Path, steps: int, evaluated=()) -> Path:
    """A --metrics file written as the scripts write it (checkpoint.Metrics): a row a step, a row an evaluation (at
    the steps in evaluated), the summary."""
    metrics = checkpoint.Metrics(str(path), 0)
    for step in range(1, steps + 1):
        metrics.write({"step": step, "loss": 9 - 0.25 * step, "lr": 1e-3, "tokens": 256 * step})
        if step in evaluated:
            metrics.write({"eval": {"step": step, "loss": 9.5 - 0.25 * step, "perplexity": 1.0, "batches": 4}})
    metrics.write({"summary": {"steps": steps, "median_step_time": 0.1}})
    metrics.file.close()
    return path


def test_plot_reads_the_losses_and_says_in_one_line_what_it_cannot_draw(tmp_path, capsys, monkeypatch):
    run = metrics_file(tmp_path / "run.jsonl", 5, evaluated=(3, 5))
    train, held_out = plot.read_run(str(run))
    assert train == [(s, 9 - 0.25 * s) for s in range(1, 6)] and held_out == [(3, 8.75), (5, 8.25)]
    # A run writing its file: a last line not yet whole is left for the next time.
    (tmp_path / "writing.jsonl").write_text(run.read_text() + '{"step": 6, "lo')
    assert plot.read_run(str(tmp_path / "writing.jsonl")) == (train, held_out)
    # Bad input: one line naming the file, exit status 1, no picture.
    (tmp_path / "summary.jsonl").write_text('{"summary": {"steps": 0}}\n')
    (tmp_path / "log.txt").write_text("step 1: loss 9.0\n")
    out = tmp_path / "loss.png"
    for given, said in [("missing.jsonl", ": no such file; give the files that a training script's --metrics FILE "
                                          "wrote"),
                        ("summary.jsonl", ': no loss in it (no row {"step": N, "loss": L}); give a file that '
                                          "--metrics wrote, of a run that trained or evaluated"),
                        ("log.txt", ", line 1: not JSON (Expecting value); give a file that --metrics wrote")]:
        assert run_main(capsys, plot.main, run, tmp_path / given, "--out", out) == (
            1, "", f"error: {tmp_path / given}{said}\n")
    assert run_main(capsys, plot.main, run, "--out", run)[2] == f"error: --out {run} is one of the files to read; " \
        "give another --out\n" and run.read_text().count("\n") == 8  # never written over
    # Without matplotlib (here made unimportable, as where it is not installed): how to get it, in one line.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run_main(capsys, plot.main, run, "--out", out) == (
        1, "", "error: plot.py draws with matplotlib, which is not installed: pip install matplotlib\n")
    assert not out.exists()


def test_plot_draws_several_runs_overlaid_each_labelled_with_its_file(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (requirements-dev.txt has it)")
    first, second = metrics_file(tmp_path / "a.jsonl", 12, evaluated=(6, 12)), metrics_file(tmp_path / "b.jsonl", 8)
    runs = {str(path): plot.read_run(str(path)) for path in (first, second)}
    assert plot.draw(runs, str(tmp_path / "drawn.png")) == [
        f"{first}: training", f"{first}: held-out", f"{second}: training"]  # b evaluated nothing
    out = tmp_path / "pictures" / "loss.png"  # its folder made
    assert run_main(capsys, plot.main, first, second, "--out", out) == (
        0, f"plotted 2 run(s) into {out}\n", "")
    import matplotlib.image
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(out).shape[:2] == (550, 900)
    code, _, err = run_main(capsys, plot.main, first, "--out", tmp_path / "loss.jsonl")
    assert code == 1 and err.startswith(f"error: --out {tmp_path / 'loss.jsonl'}: matplotlib cannot write a jsonl ")


# -- run.sh: real runs

SCRIPT = "train_pipeline_gpipe.py"


def dry_run(tmp_path, *args, **env) -> tuple[list[str], str]:
    """The torchrun command run.sh would execute, as a list, and its one-line report on stderr."""
    result = run_sh(SCRIPT, *args, cwd=tmp_path, timeout=30, DRY_RUN=1, **env)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout), result.stderr.strip()


def option(cmd: list[str], flag: str) -> str:
    assert flag in cmd, (flag, cmd)
    return cmd[cmd.index(flag) + 1]


def test_two_nodes_train_like_one_node(tmp_path, data_dir):
    # Two "nodes" on this machine: two run.sh launches meeting at 127.0.0.1, each in a directory of its own.
    # The checkpoint directory is shared, as it must be on a real cluster.
    common = [*TRAIN_ARGS, "--steps", "4", "--data", data_dir, "--metrics", "m.jsonl"]
    port = free_port()
    nodes = [tmp_path / "node0", tmp_path / "node1", tmp_path / "single"]
    for d in nodes:
        d.mkdir()
    procs = [run_sh(SCRIPT, *common, "--checkpoint-dir", str(tmp_path / "shared-ckpt"), cwd=nodes[rank],
                    wait=False, NNODES=2, NODE_RANK=rank, NPROC_PER_NODE=2, MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port)
             for rank in (0, 1)]
    # The reference, one node with 4 ranks, at the same time; LOG_DIR gives one log per rank.
    procs.append(run_sh(SCRIPT, *common, "--checkpoint-dir", "ckpt", cwd=nodes[2], wait=False, NPROC_PER_NODE=4,
                        LOG_DIR=tmp_path / "logs"))
    try:
        results = [finish(p, timeout=180) for p in procs]
    finally:  # a node that failed leaves the other waiting at the rendezvous: stop every launch
        for p in procs:
            if p.poll() is None:
                kill_job(p)
    for d, result in zip(nodes, results):
        assert result.returncode == 0, (d.name, errors(result.stderr))
    assert "NNODES=2 NODE_RANK=1, rendezvous at 127.0.0.1" in results[1].stderr.splitlines()[0]

    # The rendezvous decides which node gets the last rank; only that node writes metrics.
    written = [d / "m.jsonl" for d in nodes[:2] if (d / "m.jsonl").exists()]
    assert len(written) == 1, written
    two_nodes, summary = read_metrics(written[0])
    one_node, _ = read_metrics(nodes[2] / "m.jsonl")
    assert len(summary[0]["peak_memory_bytes_per_rank"]) == 4  # 2 nodes x 2 ranks made one 4-stage pipeline
    assert [r["step"] for r in two_nodes] == [r["step"] for r in one_node] == [1, 2, 3, 4]
    assert_same_trajectory(two_nodes, one_node, "two nodes")
    assert (tmp_path / "shared-ckpt" / "step-00000004" / "meta.json").is_file()

    per_rank = sorted(p.parent.name for p in (tmp_path / "logs").rglob("stderr.log"))
    assert per_rank == ["0", "1", "2", "3"], per_rank


def signal_pending(pid: int, signum: int) -> bool:
    """Whether the signal waits to be handled by a process (one stopped, say), read from /proc; none waits for a
    process that is gone (it may end at any moment: its /proc entry goes, or lists no signals)."""
    try:
        pending = re.search(r"^ShdPnd:\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    return bool(pending and int(pending[1], 16) >> (signum - 1) & 1)


def wait_for(what: str, found, proc, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not found():
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"no {what}: {lines_of(Path(f'{proc.log}.err'))[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("script, nodes, flags", [("train_pipeline_gpipe.py", (2, 2), []),
                                                  ("train_pipeline_afab_manual.py", (3, 1), ["--split", "2,2"])])
def test_an_elastic_job_goes_on_without_a_lost_node_and_takes_it_back(tmp_path, data_dir, reference_run, script,
                                                                       nodes, flags):
    # Two "nodes" on this machine, NNODES=1:2, 4 processes: 2 stages x 2 replicas. The second node dies (SIGKILL of
    # it all) after the step-6 checkpoint: the first goes on by itself, the same run: at 2 stages x 1 replica
    # (GPipe, nodes of 2), or at 3 stages, --split 2,2 giving way to balanced (the hand-written script, nodes of 3
    # and 1). Then (GPipe) another job is started on the same --checkpoint-dir, as the first was but on another
    # port: it stops at once in one line, and the first job goes on; and a node comes back: the job takes it in at
    # its next restart and goes on at 2 x 2. One metrics row per step; every loss the uninterrupted GPipe run's
    # (reference_run: the same flags, 2 x 2), to the drift of fp32 sums since step 6 (another layout from there),
    # or from step 1 for the other script.
    ckpt = tmp_path / "shared" / "ckpt"
    args = [*RESUME_ARGS, "--dp", "2", "--checkpoint-every", "2", "--data", data_dir, "--checkpoint-dir", ckpt,
            "--metrics", tmp_path / "shared" / "m.jsonl", *flags]
    # The restart waits 3 s for more nodes after the first (torchrun's default: 30). run.sh's own rendezvous id.
    # The first node hosts the rendezvous (it must survive); the others only join it (is_host: on one machine, the
    # first to start would host it, and that need not be the first launched).
    node = dict(NNODES="1:2", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RDZV_CONF="last_call_timeout=3")
    joins = dict(node, RDZV_CONF="last_call_timeout=3,is_host=false")
    first = run_sh(script, *args, cwd=tmp_path, wait=False, log=tmp_path / "first", NPROC_PER_NODE=nodes[0], **node)
    jobs = [first]
    try:  # a failure leaves no job behind, stopped processes included
        jobs.append(run_sh(script, *args, cwd=tmp_path, wait=False, log=tmp_path / "second",
                           NPROC_PER_NODE=nodes[1], **joins))
        wait_for("step-6 checkpoint", lambda: (ckpt / "step-00000006").is_dir(), first)
        kill_job(jobs[1])
        if script == SCRIPT:
            # Resumed (the lock taken) after this restart's layout line: an earlier "resumed from" may be another
            # restart's (the second node joined late, say).
            wait_for("restart on 2 processes", lambda: "resumed from" in lines_of(tmp_path / "first.out").partition(
                "4 processes -> 2: ")[2], first)
            torchrun = worker_pids(first.pid)[0]
            workers = worker_pids(torchrun)
            for pid in workers:  # held, so that the job is still running when the others start
                os.kill(pid, signal.SIGSTOP)
            # torchrun would restart the other job: its rendezvous id is the same ("pipeline"), it is not the same job
            other = run_sh(script, *args, cwd=tmp_path, timeout=120, NPROC_PER_NODE=2,
                           **dict(node, MASTER_PORT=free_port(), RDZV_CONF="last_call_timeout=1"))
            holder = json.loads((ckpt / "run.lock").read_text())
            assert other.returncode == 1 and "Traceback" not in other.stderr and holder["pid"] in workers
            assert error_lines(other.stderr) == [
                f"error: --checkpoint-dir {ckpt}: another run is using it (pid {holder['pid']} on {holder['host']}, "
                f"started {holder['started']}); wait for it to finish or choose another --checkpoint-dir (if that "
                f"run is gone, delete {ckpt / 'run.lock'}) (found on rank 0)"], other.stderr[-3000:]
            jobs.append(run_sh(script, *args, cwd=tmp_path, wait=False, log=tmp_path / "back", NPROC_PER_NODE=2,
                               **joins))
            # torchrun sees the node waiting to join and stops the workers to restart them all: a SIGTERM they get
            # once running again (they finish their step, save, exit 0; then all 4 processes start). A worker gone
            # (torchrun's own kill) is waited for no more.
            wait_for("the node coming back", lambda: all(signal_pending(pid, signal.SIGTERM) or not running(pid)
                                                         for pid in workers), first)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        for proc in [first, *jobs[2:]]:
            result = finish(proc)
            assert result.returncode == 0, errors(result.stderr)
    finally:
        for proc in jobs:
            if proc.poll() is None:
                kill_job(proc)
    out = lines_of(tmp_path / "first.out")
    if script == SCRIPT:
        assert "4 processes -> 2: pp 2 x dp 2 x tp 1 -> pp 2 x dp 1 x tp 1; resuming " in out, out
        assert re.search(r"2 processes -> 4: pp 2 x dp 1 x tp 1 -> pp 2 x dp 2 x tp 1; resuming .* at step \d+",
                         out + lines_of(tmp_path / "back.out")), out
    else:
        assert ("4 processes -> 3: pp 2 x dp 2 x tp 1 -> pp 3 x dp 1 x tp 1 (--split 2,2 is for 2 stages: "
                "balanced); resuming ") in out, out
    rows, _ = read_metrics(tmp_path / "shared" / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert_same_trajectory(rows, reference_run[1], script, since=6 if script == SCRIPT else 0)


def test_an_elastic_job_that_no_layout_of_its_processes_fits_ends_in_one_line(tmp_path, data_dir):
    # ZBV (2 stages a rank) on a node of 2 processes: 4 stages on 4 layers. A second node of 2 joins: pp 4 would be
    # 8 stages (6 at most: 4 layers and two layerless ends), 2 replicas need --batch-size 8 to divide into 2 x 8
    # microbatches. Each node says so in one line,
    # and the job ends at once (no restart can mend it), its checkpoints as the first node left them.
    ckpt = tmp_path / "ckpt"
    args = [*RESUME_ARGS, "--steps", "1000", "--schedule", "zbvzerobubble", "--microbatches", "8",
            "--checkpoint-every", "1", "--data", data_dir, "--checkpoint-dir", ckpt]
    node = dict(NNODES="1:2", NPROC_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                RDZV_CONF="last_call_timeout=1")
    jobs = [run_sh(SCRIPT, *args, cwd=tmp_path, wait=False, log=tmp_path / "first", **node)]
    try:
        wait_for("a checkpoint", lambda: complete_and_partial(ckpt)[0], jobs[0])
        jobs.append(run_sh(SCRIPT, *args, cwd=tmp_path, wait=False, log=tmp_path / "second", **node))
        results = [finish(proc, timeout=180) for proc in jobs]
    finally:  # a failure leaves no job behind
        for proc in jobs:
            if proc.poll() is None:
                kill_job(proc)
    newest = complete_and_partial(ckpt)[0][-1]
    for result in results:
        assert result.returncode == 1 and "Traceback" not in result.stderr, errors(result.stderr)
        assert error_lines(result.stderr) == [
            f"error: 4 process(es) cannot hold this run ({newest}, saved by 2): with --tp 1, --batch-size 8, "
            "--microbatches 8 and 4 layers in 2 stage(s) per pipeline rank it needs 1, 2, 3 process(es); start "
            "that many"], errors(result.stderr)
    assert "stopped by SIGTERM after step" in lines_of(tmp_path / "first.out")  # saved when the node joined
    assert sorted(os.listdir(ckpt)) == complete_and_partial(ckpt)[0]  # no lock, no partial save left


def test_a_failed_job_fails_run_sh(tmp_path, data_dir):
    # A mistake is not retried: its one line once, and the script's status (argparse's 2), whatever MAX_RESTARTS.
    result = run_sh(SCRIPT, "--steps", "-1", "--data", data_dir, cwd=tmp_path, timeout=120, NPROC_PER_NODE=1,
                    MAX_RESTARTS=2)
    assert result.returncode == 2 and "Traceback" not in result.stderr, errors(result.stderr)
    assert error_lines(result.stderr) == ["error: argument --steps: must be a whole number of at least 0, got -1 "
                                          "(see --help)"]


# -- run.sh: the command it builds

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[07-08]"}


def test_slurm_environment_sets_nodes_rank_and_master(tmp_path):
    port = free_port()
    cmd, report = dry_run(tmp_path, "--steps", "3", "two words", "--nnodes", "9", MASTER_PORT=port,
                          NPROC_PER_NODE=2, **SLURM)
    assert "SLURM job 4242" in report and "\n" not in report
    assert option(cmd, "--nnodes") == "2"
    assert option(cmd, "--node-rank") == "1"
    assert option(cmd, "--rdzv-backend") == "c10d"
    assert option(cmd, "--rdzv-endpoint") == f"node07:{port}"
    assert option(cmd, "--rdzv-id") == "4242"
    assert option(cmd, "--nproc-per-node") == "2"
    assert "--standalone" not in cmd
    script_at = next(i for i, a in enumerate(cmd) if a.endswith(SCRIPT))
    assert cmd[script_at + 1:] == ["--steps", "3", "two words", "--nnodes", "9"]  # the script's, unchanged


def test_explicit_variables_win_over_slurm(tmp_path):
    cmd, _ = dry_run(tmp_path, NODE_RANK=0, MASTER_ADDR="10.0.0.5", NNODES=3, **SLURM)
    assert (option(cmd, "--nnodes"), option(cmd, "--node-rank")) == ("3", "0")
    assert option(cmd, "--rdzv-endpoint") == "10.0.0.5:29500"


NODELISTS = [("node[07-08]", "node07"), ("gpu-a[007-010,012]-ib,login1", "gpu-a007-ib"), ("alpha,beta", "alpha"),
             ("rack[2-3]-n[01-02]", "rack2-n01")]


@pytest.mark.parametrize("nodelist,first", NODELISTS)
def test_first_host_of_a_slurm_node_list(tmp_path, nodelist, first):
    cmd, _ = dry_run(tmp_path, **dict(SLURM, SLURM_JOB_NODELIST=nodelist))
    assert option(cmd, "--rdzv-endpoint") == f"{first}:29500"


def test_one_node_is_standalone_with_restarts_and_logs(tmp_path):
    cmd, report = dry_run(tmp_path, "--steps", "3", MAX_RESTARTS=1, NPROC_PER_NODE=3, LOG_DIR=tmp_path / "logs")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--rdzv-endpoint" not in cmd and "--nnodes" not in cmd
    assert option(cmd, "--max-restarts") == "1"
    assert option(cmd, "--nproc-per-node") == "3"
    assert option(cmd, "--log-dir") == str(tmp_path / "logs") and option(cmd, "--tee") == "3"
    assert cmd[-3:] == [str(ROOT / SCRIPT), "--steps", "3"]  # found next to run.sh from another directory
    assert not (tmp_path / "logs").exists()  # a dry run creates nothing
    assert "one node" in report


def test_an_elastic_range_of_nodes_meets_at_master_addr_and_restarts(tmp_path):
    cmd, report = dry_run(tmp_path, NNODES="1:2", NPROC_PER_NODE=2, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500,
                          RDZV_ID="job7", RDZV_CONF="last_call_timeout=5")
    assert option(cmd, "--nnodes") == "1:2" and option(cmd, "--rdzv-backend") == "c10d"
    assert option(cmd, "--rdzv-endpoint") == "10.0.0.1:29500" and option(cmd, "--rdzv-id") == "job7"
    assert option(cmd, "--rdzv-conf") == "last_call_timeout=5" and "--node-rank" not in cmd
    assert option(cmd, "--max-restarts") == "3" and option(cmd, "--shutdown-timeout") == "120"  # elastic: restarts
    assert "NNODES=1:2 (elastic)" in report


def test_defaults(tmp_path):
    cmd, _ = dry_run(tmp_path, CUDA_VISIBLE_DEVICES="")  # no GPU visible: 3 processes, the CPU default
    assert option(cmd, "--nproc-per-node") == "3" and option(cmd, "--max-restarts") == "0"
    assert option(cmd, "--shutdown-timeout") == "120"  # after a SIGTERM: time to finish the step and save it
    cmd, _ = dry_run(tmp_path, CUDA_VISIBLE_DEVICES="0,1")  # one process per visible GPU
    assert option(cmd, "--nproc-per-node") == "2"


# -- run.sh, bad input: one line, exit status 2, nothing started

RUN_SH_BAD = [  # (script, environment) -> what the one line must name
    ("no_such_script.py", {}, "no_such_script.py"),
    (SCRIPT, {"NNODES": "2"}, "MASTER_ADDR"),
    (SCRIPT, {"NPROC_PER_NODE": "abc"}, "NPROC_PER_NODE"),
    (SCRIPT, {"NNODES": "0"}, "NNODES"),
    (SCRIPT, {"NNODES": "2:1", "MASTER_ADDR": "127.0.0.1"}, "NNODES=2:1: the minimum is above the maximum"),
    (SCRIPT, {"NNODES": "1:x", "MASTER_ADDR": "127.0.0.1"}, "NNODES' maximum"),
    (SCRIPT, {"NNODES": "1:2"}, "MASTER_ADDR"),
    (SCRIPT, {"SHUTDOWN_TIMEOUT": "0"}, "SHUTDOWN_TIMEOUT"),
    (SCRIPT, {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "NODE_RANK": "2"}, "NODE_RANK"),
    (SCRIPT, {"MASTER_PORT": "http"}, "MASTER_PORT"),
    (SCRIPT, {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS"),
    (SCRIPT, {"PYTHON": "no-such-python"}, "PYTHON"),
    (SCRIPT, {"DRY_RUN": "true"}, "DRY_RUN"),  # a dry run mistyped must not start the real job
]


@pytest.mark.parametrize("script,env,named", RUN_SH_BAD, ids=[b[2] for b in RUN_SH_BAD])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, script, env, named):
    result = run_sh(script, "--steps", "1", cwd=tmp_path, timeout=30, **env)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.sh: error: ") and named in lines[0], result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []  # no torchrun, no checkpoint, no metrics


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    result = subprocess.run(["shellcheck", RUN_SH], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert os.access(RUN_SH, os.X_OK)


# ----------------------------------------------------------------------------------------------------------
# 8. Bad input and templates: one line before any work, nothing destroyed; each script stands alone

def test_flag_mistakes_are_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    # In this process, each script's own main() on each mistake the flags alone show: the error names the flag and
    # comes before any file or model. (The test below runs the same checks as real processes.)
    ckpt = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(ckpt), "--data", str(tmp_path / "data")]
    gpipe_cases = {  # given -> what the message must name
        ("--batch-size", "10", "--microbatches", "4"): "--microbatches",
        ("--seq-len", "5000"): "--seq-len",
        ("--schedule", "zbvzerobubble", "--stages-per-rank", "3"): "--stages-per-rank",
        # 5 stages hold 3 layers at most with the embedding and the head on stages of their own.
        ("--schedule", "interleaved1f1b", "--stages-per-rank", "5", "--layers", "2"): "5 pipeline stages but the "
                                                                                      "model has 2 layers",
        ("--schedule", "1f1b", "--stages-per-rank", "3"): "--stages-per-rank 3: 1f1b holds 1 stage(s) per rank",
        ("--stages-per-rank", "2"): "--stages-per-rank 2: gpipe holds 1 stage(s) per rank",
        ("--split", "3,2"): "--split 3,2: give 1 layer counts",
        ("--split", "fast"): "--split fast",
        # --seq-chunks: even chunks of --seq-len (128), under a schedule that can order them (model.chunk_order)
        ("--seq-chunks", "3"): "--seq-chunks 3 does not cut --seq-len 128 into even chunks; the nearest that does: "
                               "--seq-chunks 2",
        ("--seq-chunks", "129"): "--seq-chunks 129: give 1 to 128 chunks for --seq-len 128",
        ("--seq-chunks", "2", "--schedule", "interleaved1f1b"): "--seq-chunks 2: --schedule interleaved1f1b cannot "
                                                                "order sequence chunks (a sequence's backwards last "
                                                                "chunk first); give --schedule gpipe or 1f1b",
        ("--seq-chunks", "2", "--schedule", "zbvzerobubble"): "give --schedule gpipe or 1f1b, or --seq-chunks 1",
        # chunks of equal compute: torch's stages receive one shape; padded to the longest they cost more
        ("--seq-chunks", "2", "--chunk-split", "compute"): "--chunk-split compute: torch's PipelineStage takes one "
                                                           "message shape per stage, and chunks padded to the longest "
                                                           "cost more than even chunks save (docs/long-sequences.md); "
                                                           "run it with train_pipeline_afab_manual.py, or give "
                                                           "--chunk-split even",
    }
    cases = [("train_pipeline_gpipe.py", given, named, 1) for given, named in gpipe_cases.items()]
    # The other scripts share the checks; their own choices are checked too.
    cases += [("train_pipeline_afab_manual.py", ("--split", "1,1,1"), "--split 1,1,1: give 1 layer counts", 1),
              ("train_pipeline_tracer.py", ("--batch-size", "12", "--accumulate", "2"),
               "--batch-size 12 is not divisible by --dp 1 x --microbatches 4 x --accumulate 2", 1),
              ("train_pipeline_tracer.py", ("--schedule", "zbvzerobubble", "--stages-per-rank", "3"),
               "--stages-per-rank", 1),
              ("train_pipeline_tracer.py", ("--schedule", "1f1b", "--stages-per-rank", "2"),
               "--stages-per-rank 2: 1f1b holds 1 stage(s) per rank", 1),
              # --seq-chunks through traced stages: gpipe's and 1f1b's orders, even chunks (one shape a stage).
              ("train_pipeline_tracer.py", ("--seq-chunks", "2", "--schedule", "dualpipev"), "--seq-chunks 2: "
               "--schedule dualpipev cannot order sequence chunks", 1),
              ("train_pipeline_tracer.py", ("--seq-chunks", "3"), "--seq-chunks 3 does not cut --seq-len 128", 1),
              ("train_pipeline_tracer.py", ("--seq-chunks", "2", "--chunk-split", "compute"), "--chunk-split compute: "
               "the traced stages receive one shape of message each; use train_pipeline_afab_manual.py", 1)]
    # --dp against the number of processes, as torchrun would set it (a group of one stands in for them here).
    cases += [("train_pipeline_gpipe.py", given, named, 4) for given, named in [
        (("--dp", "3"), "--dp 3 x --tp 1: 4 processes do not divide"),
        (("--dp", "2", "--batch-size", "12"), "--dp 2 x --microbatches 4"),
        (("--dp", "2", "--schedule", "interleaved1f1b", "--stages-per-rank", "3", "--layers", "2"),
         "6 pipeline stages")]]
    # --tp the same way (the model's heads are checked by the processes, below:
    # test_tensor_parallel_that_the_model_cannot_take_is_one_line_on_every_rank).
    cases += [("train_pipeline_gpipe.py", ("--tp", "3"), "--dp 1 x --tp 3: 4 processes do not divide into stages", 4),
              ("train_pipeline_afab_manual.py", ("--dp", "2", "--tp", "2"), "--dp 2 x --tp 2: 6 processes", 6),
              ("train_pipeline_tracer.py", ("--tp", "2"), "--tp 2: the traced stages cannot be split", 4),
              ("train_pipeline_afab_manual.py", ("--tp", "2", "--compile"), "--compile with --tp: torch 2.13", 4),
              # Sequence parallelism gives each tp rank seq_len / tp positions.
              ("train_pipeline_gpipe.py", ("--tp", "2", "--seq-len", "101"), "--seq-len 101 is not divisible by "
                                                                             "--tp 2", 4),
              ("train_pipeline_afab_manual.py", ("--tp", "2", "--seq-len", "101"), "add --no-sequence-parallel", 4),
              # ... and each chunk seq_len / S / tp of them.
              ("train_pipeline_gpipe.py", ("--tp", "2", "--seq-len", "12", "--seq-chunks", "4"), "--seq-chunks 4 "
               "does not cut --seq-len 12 into even chunks of a multiple of 2 tokens (--tp); the nearest that does: "
               "--seq-chunks 3", 4)]
    # --seq-chunks: even chunks of --seq-len (128), of a multiple of --tp tokens with sequence parallelism; the
    # nearest count that cuts it named.
    cases += [("train_pipeline_afab_manual.py", given, named, world_size) for given, named, world_size in [
        (("--seq-chunks", "3"), "--seq-chunks 3 does not cut --seq-len 128 into even chunks; the nearest that does: "
                                "--seq-chunks 2", 1),
        (("--seq-chunks", "200", "--chunk-split", "compute"), "--seq-chunks 200: give 1 to 128 chunks", 1),
        (("--seq-chunks", "6", "--tp", "2"), "--seq-chunks 6 does not cut --seq-len 128 into even chunks of a "
                                             "multiple of 2 tokens (--tp); the nearest that does: --seq-chunks 4", 2)]]
    for script, given, named, world_size in cases:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        module = SCRIPT_MODULES[script]
        try:  # once the processes have met (a group of one here): a restart's layout needs them all
            with pytest.raises(checkpoint.UsageError) as failure:
                module.main(module.build_parser().parse_args([*given, *common]))
        finally:
            dist.destroy_process_group()
        message = str(failure.value)
        assert named in message and "\n" not in message, (script, given, message)
    # Values and flags argparse refuses: one line, status 2.
    for script, given, named in [("train_pipeline_gpipe.py", ("--model", "huge"), "--model"),
                                 ("train_pipeline_gpipe.py", ("--steps", "ten"), "--steps"),
                                 ("train_pipeline_gpipe.py", ("--steps", "-1"), "--steps: must be a whole number of "
                                                                                "at least 0, got -1"),
                                 ("train_pipeline_gpipe.py", ("--lr", "nan"), "--lr"),
                                 ("train_pipeline_tracer.py", ("--lr", "inf"), "--lr"),
                                 ("train_pipeline_gpipe.py", ("--dp", "0"), "--dp"),
                                 ("train_pipeline_afab_manual.py", ("--microbatches", "0"), "--microbatches"),
                                 ("train_pipeline_gpipe.py", ("--accumulate", "0"), "--accumulate"),
                                 ("train_pipeline_afab_manual.py", ("--seq-chunks", "0"), "--seq-chunks"),
                                 ("train_pipeline_afab_manual.py", ("--chunk-split", "flops"), "--chunk-split"),
                                 ("train_pipeline_tracer.py", ("--chunk-split", "flops"), "--chunk-split"),
                                 ("train_pipeline_gpipe.py", ("--seq-chunks", "0"), "--seq-chunks"),
                                 ("train_pipeline_afab_manual.py", ("--schedule", "gpipe"), "--schedule"),
                                 # past a week: an OverflowError (1e300) or torch's stores failing at once (1e10)
                                 ("train_pipeline_gpipe.py", ("--timeout", "1e300"), "--timeout: must be a finite "
                                                                                     "positive number up to 604800"),
                                 ("train_pipeline_afab_manual.py", ("--timeout", "1e10"), "up to 604800 (a week)"),
                                 # what plan.py generates, and a file where none is read: where to get and run it
                                 ("train_pipeline_tracer.py", ("--schedule", "zbvauto"), "--schedule: zbvauto is an "
                                  "order plan.py generates: write it with plan.py --schedule zbvauto --write-schedule"),
                                 ("train_pipeline_afab_manual.py", ("--schedule", "zb.csv"), "--schedule: zb.csv: "
                                  "this script runs afab or 1f1b; give an order from a file (plan.py --write-schedule)"
                                  " to train_pipeline_gpipe.py or train_pipeline_tracer.py"),
                                 ("train_pipeline_gpipe.py", ("--tokenizer", "t.json"),
                                  "unrecognized arguments: --tokenizer t.json")]:
        err = refused(capsys, SCRIPT_MODULES[script].build_parser().parse_args, *given, status=2)
        assert named in err, (script, given, err)
    assert not ckpt.exists()


def test_schedule_file_mistakes_are_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    # --schedule FILE.csv (model.read_order), in both scripts that take one: each mistake in the file, or between
    # the file and the flags or the processes, is one line naming --schedule (and the flag) before any data, model
    # or checkpoint; what torch refuses of an order too, in torch's words.
    orders = {name: schedule_file(name, 2, 4, tmp_path) for name in ("zbh1", "zbvzerobubble")}
    files = {"cell.csv": "0F0,0X1\n", "empty.csv": "", "backward-first.csv": "0F0,0B0\n1B0,1F0\n",
             # Rank 0's backward of microbatch 0 waits for rank 1's, which waits behind a forward rank 0 runs later.
             "stuck.csv": "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n",
             "blocks.csv": "0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n",  # stages 0, 1 on rank 0: neither looped nor V
             # An action twice: torch's check counts sets, so it passed it, to fail at the first step (a B is I + W).
             "twice-f.csv": "0F0,0F0,0B0\n1F0,1B0\n", "twice-w.csv": "0F0,0I0,0W0,0W0\n1F0,1B0\n",
             "twice-b.csv": "0F0,0B0\n1F0,1B0,1I0\n", "gap.csv": "0F0,2F0\n",
             # What the lines quote of a file is short: a long cell, torch's words about a long order (its table).
             "long-cell.csv": "0F0," + "x" * 20000 + "\n",
             "long-backward-first.csv": ",".join([f"0F{i}" for i in range(200)] + [f"0B{i}" for i in range(200)])
             + "\n" + ",".join(["1B0"] + [f"1F{i}" for i in range(200)] + [f"1B{i}" for i in range(1, 200)]) + "\n",
             "huge.csv": "0F0,0F1000\n", "far.csv": "0F0,999999999F0\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.csv").write_bytes(b"0F0,\xff\xfe\n")
    (tmp_path / "folder.csv").mkdir()
    ckpt = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(ckpt), "--data", str(tmp_path / "data")]
    zbh1, zbv = str(orders["zbh1"]), str(orders["zbvzerobubble"])
    (tmp_path / "ZBH1.CSV").write_text(orders["zbh1"].read_text())  # in capitals: a file all the same
    cases = [  # (script, flags, processes, what the line must say)
        ("gpipe", [str(tmp_path / "missing.csv")], 2, "missing.csv: cannot read it (No such file or directory)"),
        ("tracer", [str(tmp_path / "folder.csv")], 2, "folder.csv: cannot read it (Is a directory)"),
        ("gpipe", [str(tmp_path / "binary.csv")], 2, "binary.csv: cannot read it ("),
        ("gpipe", [str(tmp_path / "cell.csv")], 2, "row 1, cell 2 is '0X1', not an action"),
        ("gpipe", [str(tmp_path / "empty.csv")], 2, "empty.csv: no action in it"),
        ("gpipe", [str(tmp_path / "backward-first.csv")], 2, "torch refuses this order: Rank 1, step 0: Running Full "
                                                             "Backward for stage 1, microbatch 0 without first"),
        ("tracer", [str(tmp_path / "stuck.csv")], 2, "torch refuses this order: Malformed compute schedule"),
        ("gpipe", [str(tmp_path / "blocks.csv")], 2, "stages rank 0: [0, 1]; rank 1: [2, 3]; the scripts place"),
        ("gpipe", [zbh1], 3, "is an order for 2 pipeline rank(s), but 3 process(es) / (--dp 1 x --tp 1) are 3"),
        ("tracer", [zbh1, "--dp", "2"], 2, "but 2 process(es) / (--dp 2 x --tp 1) are 1; start 4 processes"),
        ("gpipe", [zbh1, "--microbatches", "2"], 2, "--microbatches 2: --schedule"),
        ("tracer", [zbv, "--stages-per-rank", "3"], 2, "--stages-per-rank 3: --schedule"),
        ("gpipe", [zbh1, "--compile"], 2, "--compile: --schedule"),  # I and W: not supported compiled (pytorch #161904)
        ("gpipe", [str(tmp_path / "twice-f.csv")], 2, "row 1, cell 2 (0F0) runs stage 0's F of microbatch 0 again "
                                                      "(row 1, cell 1); each stage runs each microbatch's F, and I"),
        ("tracer", [str(tmp_path / "twice-w.csv")], 2, "row 1, cell 4 (0W0) runs stage 0's W of microbatch 0 again"),
        ("gpipe", [str(tmp_path / "twice-b.csv")], 2, "row 2, cell 3 (1I0) runs stage 1's I of microbatch 0 again "
                                                      "(row 2, cell 2)"),
        ("gpipe", [str(tmp_path / "gap.csv")], 2, "gap.csv: stage 1 has no action, but stage 2 has"),
        ("gpipe", [str(tmp_path / "far.csv")], 2, "far.csv: stage 1 has no action, but stage 999999999 has"),
        ("gpipe", [str(tmp_path / "long-cell.csv")], 2, f"row 1, cell 2 is '{'x' * 40}...', not an action"),
        ("tracer", [str(tmp_path / "long-backward-first.csv")], 2, "torch refuses this order: Rank 1, step 0: Running"),
        ("gpipe", [str(tmp_path / "huge.csv")], 2, "1001 microbatches; torch 2.13 lowers an order in time that grows "
                                                   "with the square of its length: give at most 1000"),
        ("gpipe", [str(tmp_path / "ZBH1.CSV"), "--microbatches", "2"], 2, "--microbatches 2: --schedule"),
    ]
    for script, given, world_size, named in cases:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        module = gpipe if script == "gpipe" else tracer
        try:
            with pytest.raises(checkpoint.UsageError) as failure:
                module.main(module.build_parser().parse_args(["--schedule", *given, *common]))
        finally:
            dist.destroy_process_group()
        message = str(failure.value)
        assert named in message and "--schedule" in message and "\n" not in message, (script, given, message)
        assert len(message) < 400, (script, given, message)  # a line of ordinary length, whatever the file holds
    assert set(checkpoint.GENERATED_ORDERS) == set(plan.GENERATED)  # the names the scripts point to plan.py for
    # A file that is no CSV by its name is no schedule either: argparse's one line, which offers FILE.csv.
    err = refused(capsys, tracer.build_parser().parse_args, "--schedule", "order.txt", status=2)
    assert "--schedule: invalid choice: 'order.txt'" in err and "'FILE.csv'" in err, err
    assert not ckpt.exists()


def test_bad_input_is_one_line_and_destroys_nothing(tmp_path, data_dir):
    ckpt = tmp_path / "ckpt" / "step-00000001"
    ckpt.mkdir(parents=True)
    # A checkpoint as far as what is read before the errors below.
    meta = json.dumps({"step": 1, "config": dataclasses.asdict(small_config()), "files": {}, "world_size": 1})
    (ckpt / "meta.json").write_text(meta)
    common = ["--data", data_dir, "--checkpoint-dir", str(tmp_path / "ckpt")]
    cases = {  # given -> (the flag the message must name, exit status)
        ("--steps", "ten"): ("--steps", 2),  # refused by argparse
        ("--tokenizer", "t.json"): ("unrecognized arguments: --tokenizer", 2),
        ("--batch-size", "10", "--microbatches", "4"): ("--microbatches", 1),  # by the checks of the flags
        # Found by the checks of the files the flags name, on every rank, after the processes have met.
        ("--data", "missing"): ("--data missing: no data prepared there; run python prepare_data.py --out missing",
                                1),
    }
    procs = {given: run_script(0, "train_pipeline_gpipe.py", *common, *given, cwd=tmp_path, wait=False)
             for given in cases}
    # More processes than layers, on 3 ranks: every rank must stop, none may hang, one line for the node.
    procs[("ranks", "--layers", "2")] = run_script(3, "train_pipeline_gpipe.py", "--layers", "2", *common,
                                                      cwd=tmp_path, wait=False)
    cases[("ranks", "--layers", "2")] = ("--layers", 1)
    # What a schedule needs of the microbatches, torch says when the schedule is built: passed on in one line.
    procs[("ranks", "--schedule", "1f1b")] = run_script(2, "train_pipeline_gpipe.py", "--layers", "2", "--schedule",
                                                           "1f1b", "--microbatches", "1", "--batch-size", "4",
                                                           "--data", data_dir, "--checkpoint-dir", "other",
                                                           cwd=tmp_path, wait=False)
    cases[("ranks", "--schedule", "1f1b")] = ("--schedule 1f1b with --microbatches 1: ", 1)  # then torch's words
    for given, proc in procs.items():
        result = finish(proc, timeout=120)
        assert result.returncode == cases[given][1], (given, errors(result.stderr))
        said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert said and cases[given][0] in said[0], (given, errors(result.stderr))
        assert result.stderr.strip() == said[0], (given, result.stderr)  # one line, no traceback
    assert (ckpt / "meta.json").read_text() == meta
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000001"]


def test_damaged_data_is_one_line_when_opened_in_every_script(tmp_path, data_dir):
    """Each token file must have the size meta.json gives it (a file cut short after a checkpoint was saved, say):
    otherwise a run would train on less, silently, or fail mid-run."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    train, size = meta["train"]["files"][0], (Path(data_dir) / meta["train"]["files"][0]).stat().st_size
    damage = {  # what is done to a copy of the data -> what the line must say
        "cut short": (lambda d: os.truncate(d / train, size // 2), f"{train} has {size // 2:,} bytes"),
        "an odd byte count": (lambda d: os.truncate(d / train, size + 1), f"meta.json says {size:,}"),
        "val.bin missing": (lambda d: (d / "val.bin").unlink(), "val.bin is missing"),
        "meta.json not JSON": (lambda d: (d / "meta.json").write_text("{"), "its meta.json is damaged"),
        "meta.json without files": (lambda d: (d / "meta.json").write_text('{"dtype": "uint16"}'),
                                    "its meta.json is damaged"),
    }
    for case, (do, expected) in damage.items():
        copy = tmp_path / case.replace(" ", "_")
        shutil.copytree(data_dir, copy)
        do(copy)
        for module in SCRIPT_MODULES.values():
            args = module.build_parser().parse_args(["--data", str(copy)])
            with pytest.raises(checkpoint.UsageError) as failure:
                module.open_data(args)
            assert expected in str(failure.value) and "prepare_data.py" in str(failure.value), (case, failure.value)


# The smallest run: what is refused is refused before its first step; what is not, ends quickly.
QUICK_ARGS = ["--layers", "2", "--steps", "1", "--batch-size", "2", "--microbatches", "1", "--seq-len", "16"]


def test_bf16_where_the_gpu_cannot_is_one_line(monkeypatch):
    # A GPU without bf16 (a V100, say) asked for --precision bf16: one line before any work. No such GPU here,
    # so torch.cuda's answers are set to what one gives; every script picks device and dtype in launch_env. It asks
    # CUDA about bf16 once the rank's own GPU is the current one: asked before, every rank makes a context on GPU 0.
    # And bf16 means the GPU's own (Ampere or newer), not torch's emulation, which a V100 has.
    monkeypatch.setenv("LOCAL_RANK", "3")
    calls = []
    for name, value in (("is_available", True), ("device_count", 8), ("is_bf16_supported", False),
                        ("get_device_name", "Tesla V100-SXM2-32GB"), ("set_device", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name, value=value, **kwargs: calls.append(
            (name, args, kwargs)) or value)
    for module in SCRIPT_MODULES.values():
        for precision in ("bf16", "auto"):
            calls.clear()
            with pytest.raises(checkpoint.UsageError, match=r"^--precision bf16: Tesla V100-SXM2-32GB lacks bf16; "
                                                            r"use --precision fp32$") if precision == "bf16" \
                    else contextlib.nullcontext():
                assert module.launch_env("auto", precision).dtype == torch.float32  # auto: bf16 where the GPU has it
            asked = [call for call in calls if call[0] not in ("is_available", "device_count")]  # nothing else
            assert asked[0] == ("set_device", (torch.device("cuda", 3),), {}), asked  # before any question
            assert "is_bf16_supported" in {name for name, _, _ in asked}, asked
            for name, args, kwargs in asked[1:]:
                if name == "is_bf16_supported":  # the GPU's own bf16, not emulated
                    assert kwargs.get("including_emulation", args[0] if args else True) is False, asked
                else:  # the rank's GPU named in the line
                    assert (name, args or tuple(kwargs.values())) == ("get_device_name", (torch.device("cuda", 3),))


def test_directories_mistaken_for_others_are_refused_and_left_alone(tmp_path, data_dir):
    """--init-from a prepared dataset, a run.lock that is a folder, a leftover step-N.tmp that is a link to a
    folder outside: one line (and no advice to delete anything), or a save that never writes through the link."""
    quick = [*QUICK_ARGS, "--data", data_dir]
    (tmp_path / "locked" / "run.lock").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("mine")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "step-00000001.tmp").symlink_to(tmp_path / "outside")
    before = {path: snapshot(path, folder_times=True) for path in (Path(data_dir), tmp_path / "outside")}
    runs = {"init_from": ["--init-from", data_dir, "--checkpoint-dir", "new"],
            "lock": ["--checkpoint-dir", "locked"], "link": ["--checkpoint-dir", "linked"]}
    procs = {name: run_script(0, "train_pipeline_gpipe.py", *quick, *flags, cwd=tmp_path, wait=False)
             for name, flags in runs.items()}
    results = {name: finish(proc) for name, proc in procs.items()}
    one_line_error(results["init_from"], f"--init-from {data_dir}: not a complete checkpoint, it holds data "
                                         "prepared by prepare_data.py")
    assert "delete" not in results["init_from"].stderr
    one_line_error(results["lock"], "locked/run.lock is not a run lock")
    assert results["link"].returncode == 0, results["link"].stderr[-2000:]
    saved = tmp_path / "linked" / "step-00000001"
    assert saved.is_dir() and not saved.is_symlink() and (saved / "meta.json").is_file()
    assert not (tmp_path / "linked" / "step-00000001.tmp").exists()
    assert {path: snapshot(path, folder_times=True) for path in before} == before


def test_unusable_output_paths_stop_every_script_before_any_work(tmp_path, data_dir, read_only_dir,
                                                                 reference_run):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    quick = [*QUICK_ARGS, "--data", data_dir]
    cases = {  # (script, flags) -> what the line must say
        ("train_pipeline_gpipe.py", "--checkpoint-dir", "a-file"): ["--checkpoint-dir a-file", "is a file"],
        ("train_pipeline_afab_manual.py", "--checkpoint-dir", "a-file"): ["--checkpoint-dir a-file", "is a file"],
        ("train_pipeline_tracer.py", "--checkpoint-dir", "a-file"): ["--checkpoint-dir a-file", "is a file"],
        ("train_pipeline_gpipe.py", "--checkpoint-dir", str(read_only_dir)): ["--checkpoint-dir", "cannot write"],
        ("train_pipeline_gpipe.py", "--checkpoint-dir", str(read_only_dir / "new")): ["--checkpoint-dir",
                                                                                        "cannot be created"],
        ("train_pipeline_gpipe.py", "--metrics", str(read_only_dir / "m.jsonl")): ["--metrics", "cannot be created"],
        ("train_pipeline_gpipe.py", "--trace", str(read_only_dir / "t")): ["--trace", "cannot be created"],
        ("train_pipeline_gpipe.py", "--metrics", "a-dir"): ["--metrics a-dir", "is a directory"],
        ("train_pipeline_gpipe.py", "--trace", "a-file/t"): ["--trace", "a-file is a file"],
        # A filesystem where nothing can be created though permissions say yes: tried, not assumed.
        ("train_pipeline_gpipe.py", "--trace", "/proc/x"): ["--trace /proc/x", "cannot be created"],
        ("train_pipeline_afab_manual.py", "--metrics", "/proc/x/m.jsonl"): ["--metrics", "cannot be created"],
        # The data is never written into, nor moved aside by --fresh with the checkpoints around it.
        ("train_pipeline_gpipe.py", "--checkpoint-dir", data_dir, "--fresh"): ["is or lies inside --data"],
        ("train_pipeline_tracer.py", "--checkpoint-dir", f"{data_dir}/ckpt"): ["is or lies inside --data"],
        ("train_pipeline_gpipe.py", "--checkpoint-dir", str(Path(data_dir).parent), "--fresh"): ["holds --data"],
    }
    data_before = snapshot(Path(data_dir), folder_times=True)
    procs = {case: run_script(0, case[0], *quick, *case[1:], cwd=tmp_path, wait=False) for case in cases}
    exported = run_script(0, "export.py", reference_run[0] / "checkpoints", read_only_dir / "tiny.pt", cwd=tmp_path)
    for case, proc in procs.items():
        one_line_error(finish(proc), *cases[case])
    one_line_error(exported, "cannot write", "tiny.pt")
    # Nothing was written: no default checkpoint directory, no lock, no metrics file.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file", "read-only"]
    assert list((tmp_path / "a-dir").iterdir()) == []
    assert snapshot(Path(data_dir), folder_times=True) == data_before


def test_a_problem_one_rank_finds_ends_every_rank_with_the_same_line(tmp_path, data_dir):
    # Rank 2 works in a folder where --data (a relative path) holds nothing: as a node whose disk lacks the
    # data. The others find it; every rank must stop with the same line naming where it was found, none hang.
    for name in ("good", "bare"):
        (tmp_path / name).mkdir()
    os.symlink(data_dir, tmp_path / "good" / "data")
    procs = launch_ranks(3, *recorded(tmp_path / "calls", "train_pipeline_gpipe.py"), "--layers", "3", "--steps",
                         "5", "--timeout", "60", cwd=[tmp_path / "good", tmp_path / "good", tmp_path / "bare"])
    results = [finish(proc, timeout=120) for proc in procs]
    replayed(tmp_path / "calls", 3)  # the ranks' agreement on it, under NCCL's rules too (each rank has calls)
    assert [r.returncode for r in results] == [1, 1, 1], [r.stderr[-1500:] for r in results]
    errors = [line for r in results for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --data data: no data prepared there; run python prepare_data.py first (see its "
                      "--help) (found on rank 2)"], errors  # one line per node: printed by its first process
    assert not any("lost contact" in r.stderr or "Traceback" in r.stderr for r in results)
    assert sorted(os.listdir(tmp_path / "good")) == ["data"]  # nothing written


def test_tensor_parallel_that_the_model_cannot_take_is_one_line_on_every_rank(tmp_path, data_dir):
    # The tiny model has 4 attention heads but 2 KV heads: 4 tensor-parallel ranks cannot share them.
    procs = launch_ranks(4, "train_pipeline_gpipe.py", "--tp", "4", "--steps", "1", "--data", data_dir,
                         "--timeout", "60", cwd=tmp_path)
    results = [finish(proc, timeout=120) for proc in procs]
    assert [r.returncode for r in results] == [1] * 4, [r.stderr[-1500:] for r in results]
    # Printed once per node (each rank here is on the same node), nothing else on any rank's stderr.
    assert [r.stderr for r in results] == ["error: --tp 4: the model's KV heads (2) do not divide by it; use a --tp "
                                           "that divides 2\n", "", "", ""]
    assert not (tmp_path / "checkpoints").exists()


def test_help_works_without_torchrun_and_every_script_has_the_same_flags_with_their_defaults(tmp_path, capsys):
    procs = [run_script(0, script, "--help", cwd=tmp_path, wait=False) for script in SCRIPTS]
    helps = {script: finish(proc) for script, proc in zip(SCRIPTS, procs)}
    flags = {}
    for script, result in helps.items():
        assert result.returncode == 0, result.stderr
        flags[script] = set(re.findall(r"--[a-z][a-z-]+", result.stdout[result.stdout.index("options:"):]))
    for flag in ["--model", "--steps", "--batch-size", "--microbatches", "--seq-len", "--lr", "--warmup-steps",
                 "--seed", "--data", "--checkpoint-dir", "--checkpoint-every", "--metrics", "--schedule", "--dp",
                 "--trace", "--split", "--init-from", "--eval-every"]:
        assert all(flag in found for found in flags.values()), flag
    # The library scripts share every flag; the hand-written one lacks only what its schedules cannot use.
    assert flags["train_pipeline_tracer.py"] == flags["train_pipeline_gpipe.py"]
    assert flags["train_pipeline_gpipe.py"] - flags["train_pipeline_afab_manual.py"] == {"--stages-per-rank"}
    # The flags that define a run (declared with run=True: a resume keeps them) are the same in all three.
    assert {name: module.build_parser().parse_args([]).run_flags for name, module in SCRIPT_MODULES.items()} == \
        dict.fromkeys(SCRIPTS, ["steps", "batch_size", "seq_len", "document_masking", "lr", "warmup_steps",
                                "weight_decay", "grad_clip", "seed"])
    # Every flag that takes a value says its default in --help, in every script and tool (on/off flags are off).
    texts = {script: result.stdout for script, result in helps.items()}
    texts |= {name: module.build_parser().format_help() for name, module in [
        ("plan.py", plan), ("benchmark.py", benchmark), ("prepare_data.py", prep), ("export.py", export),
        ("plot.py", plot)]}
    with pytest.raises(SystemExit):
        benchmark.loss_memory(["--help"])
    texts["benchmark.py loss-memory"] = capsys.readouterr().out
    for name, text in texts.items():
        entries = re.split(r"\n(?=  -)", text[text.index("options:"):])[1:]  # one per flag: its line(s) of help
        takes_value = [entry.split("\n\n")[0] for entry in entries if re.match(r"  (-\w, )?--[\w-]+ [A-Z{]", entry)]
        assert takes_value, name  # found (plot.py has one: --out)
        silent = [entry.split()[0] for entry in takes_value if "default" not in entry
                  and entry.split()[0] not in ("--processes", "--gpus")]  # plan.py: one of the two is required
        assert not silent, (name, silent)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_ignores_what_the_documented_commands_write_and_nothing_of_the_project():
    written = ["data/meta.json", "data/llama/val.bin", "data-llama/train-00000.bin", "train.jsonl",  # prepare_data.py
               "checkpoints/step-00000300/meta.json", "checkpoints/nccl-trace-rank0", "ckpt-afab/run.lock",
               "checkpoints.previous-20260101-120000/step-00000300/meta.json", "m.jsonl", "trace/rank0.json",
               "zbh1.csv",  # an order for --schedule FILE.csv
               "bench/results.md", "bench-doc-2048/documents.json", "gpu-check/gpu-check.md", "mem.json",  # benchmark
               "tiny.pt", "tiny.pt.config.json", "tiny.pt.tokenizer.json", "tiny-hf/config.json",  # export.py
               "Llama-3.2-1B-continued/model.safetensors", "Llama-3.2-1B/tokenizer.json", "loss.png"]  # plot.py
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert [path for path in written if path not in ignored] == []
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert subprocess.run(["git", "check-ignore", "--no-index", *tracked], cwd=ROOT, capture_output=True,
                          text=True).stdout.split() == []  # docs/*.png included


def project_imports(path: Path) -> set[str]:
    """The modules of this project a file imports (its own folder's .py files)."""
    modules = {p.stem for p in ROOT.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & modules


def test_scripts_import_only_model_and_checkpoint():
    for script in SCRIPTS:
        assert project_imports(ROOT / script) <= {"model", "checkpoint"}, script
    assert project_imports(ROOT / "checkpoint.py") == {"model"}
    assert project_imports(ROOT / "export.py") == {"checkpoint", "model"}  # a tool: no script imports it
    assert project_imports(ROOT / "model.py") == set()
    assert project_imports(ROOT / "prepare_data.py") == set()  # and no torch: see its own test
    assert project_imports(ROOT / "plot.py") == set()  # a tool of its own (and matplotlib's)


def test_part_1_of_checkpoint_py_uses_no_name_of_part_2():
    # A copier can take checkpoint.py's errors and Part 1 (DCP: finding, saving, loading, --init-from, untrusted
    # input) alone: nothing above Part 2's title refers to a module-level name defined below it.
    source = (ROOT / "checkpoint.py").read_text()
    titles = [(int(m[1]), n) for n, line in enumerate(source.splitlines(), 1)
              if (m := re.match(r"#+\s*Part\s+(\d+)\b", line))]
    assert [part for part, _ in titles] == [1, 2], titles  # each part's title, a comment line, once
    body = ast.parse(source).body
    first, second = [n for n in body if n.lineno < titles[1][1]], [n for n in body if n.lineno > titles[1][1]]

    def bound(node) -> set[str]:  # the names a statement binds anywhere inside it (its locals, for a def)
        names = set()
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                names.add(n.name)
            names |= {n.id} if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) else set()
            names |= {n.arg} if isinstance(n, ast.arg) else {n.name} if isinstance(n, ast.ExceptHandler) else set()
            names |= {(n.asname or n.name).split(".")[0]} if isinstance(n, ast.alias) else set()
        return names
    defined = set().union(*({n.name} if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else bound(n)
                            for n in second))
    assert isinstance(second[0], ast.ClassDef) and second[0].name == "Run"  # Part 2 opens with Run
    assert {"run", "Parser", "check_run", "job_ids", "LOCK_NAME"} <= defined  # what Part 2 holds, found
    used = {n: {m.id for m in ast.walk(n) if isinstance(m, ast.Name) and isinstance(m.ctx, ast.Load)} - bound(n)
            for n in first}
    assert {"UsageError", "latest", "read_index"} <= set().union(*used.values())  # Part 1's own names, found
    assert {getattr(n, "name", n.lineno): sorted(names & defined) for n, names in used.items() if names & defined} \
        == {}


def test_each_script_copied_into_an_empty_folder_trains(tmp_path):
    corpus = "\n".join(json.dumps({"text": f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}"
                                                                         for j in range(5 + i % 17))})
                       for i in range(600))
    jobs = {}
    for script, nproc, extra in [(SCRIPTS[0], 2, []), (SCRIPTS[1], 2, ["--schedule", "1f1b"]),
                                 (SCRIPTS[2], 2, []), (SCRIPTS[0], 4, ["--dp", "2"])]:
        folder = tmp_path / f"{Path(script).stem}-{nproc}"
        folder.mkdir()
        for name in (script, "model.py", "checkpoint.py", "prepare_data.py"):
            shutil.copy(ROOT / name, folder)
        (folder / "docs.jsonl").write_text(corpus)
        env = dict(script_env(), PYTHONPATH="")  # nothing of the project but what was copied (launched there)
        result = launch(0, folder / "prepare_data.py", "--data", "docs.jsonl", "--vocab-size", "300", cwd=folder,
                        env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        jobs[folder] = script, launch(nproc, folder / script, "--layers", "2", "--steps", "3", "--batch-size", "8",
                                      "--seq-len", "16", "--metrics", "m.jsonl", *extra, cwd=folder, env=env,
                                      wait=False)
    for folder, (script, proc) in jobs.items():
        result = finish(proc, timeout=300)
        assert result.returncode == 0, (folder.name, errors(result.stderr))
        rows, _ = read_metrics(folder / "m.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3] and (folder / "checkpoints" / "step-00000003").is_dir()
        # Evaluated by default, at the end, on 4 held-out batches.
        assert [(e["step"], e["batches"]) for e in evaluations(folder / "m.jsonl")] == [(3, 4)], folder.name
        assert sorted(p.name for p in folder.iterdir() if p.suffix == ".py") == sorted(
            {script, "model.py", "checkpoint.py", "prepare_data.py"})


def test_a_forked_rank_starts_as_a_torchrun_rank_does(tmp_path):
    # run_script's ranks, against a real launch's: torchrun's variables (a new run id each launch), a string-hash
    # seed other than the next rank's, random state of its own (torch seeds each new process from the OS), the
    # warning filters after the scripts' imports. On ranks that shared the server's, a bug could hide.
    probe = tmp_path / "probe.py"
    probe.write_text(f"import json, os, random, sys, warnings\nsys.path.insert(0, {str(ROOT)!r})\n"
                     "import torch, train_pipeline_gpipe, train_pipeline_afab_manual, train_pipeline_tracer\n"
                     "os.write(1, json.dumps([int(os.environ['RANK']), sorted(k for k in os.environ if k.startswith("
                     "'TORCHELASTIC_')), os.environ['TORCHELASTIC_RUN_ID'], repr(warnings.filters), hash('a'), "
                     "torch.initial_seed(), random.random()]).encode() + b'\\n')\n")  # one write: whole lines
    env = {name: value for name, value in script_env().items() if name != "PYTHONHASHSEED"}  # torchrun's: random
    outputs = [launch(2, probe, cwd=tmp_path, env=env).stdout,
               *(run_script(2, probe, cwd=tmp_path, env=env).stdout for _ in range(2))]
    launches = [sorted(json.loads(line) for line in out.splitlines()) for out in outputs]
    for ranks in launches:
        assert [rank[0] for rank in ranks] == [0, 1], outputs
        (_, names, run_id, filters, *seeds), (_, _, *second) = ranks
        assert {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE"} <= set(names), names
        assert second[:2] == [run_id, filters] and all(a != b for a, b in zip(seeds, second[2:])), ranks
    assert len({ranks[0][2] for ranks in launches}) == 3 and len({ranks[0][3] for ranks in launches}) == 1, launches


# ----------------------------------------------------------------------------------------------------------
# 9. Sequence chunks (--seq-chunks, Seq1F1B): a sequence run as chunks computes what it computes whole

# A middle stage's worth of layers (no embedding, no head: hidden states in and out), 32 tokens, and documents that
# span chunks at S = 2 and 4: row 0 a tail (0-4), then documents at 5 (across 8), 13 (across 16 and 24) and 27;
# row 1 documents at 0 and 20.
CHUNK_DOCUMENTS = {0: [5, 13, 27], 1: [0, 20]}


def chunk_stage(layers=3, how="none", seed=21):
    stage = LlamaForPretraining(small_config(layers=layers)).keep_only(range(layers), embed=False, head=False)
    stage.init_weights(seed)
    model_module.checkpoint_layers([stage], how)
    return stage


def cached_chunks(module) -> int:
    """The keys and values of chunks held in flight by a module's attention layers."""
    return sum(len(m.kv_chunks) for m in module.modules() if isinstance(m, model_module.LlamaAttention))


def run_chunked(stage, x, positions, lengths, grad, backward=None):
    """Chunks of x through a stage as a pipeline runs them: forwards in order, each chunk's input a leaf of its own,
    then backwards last chunk first, each started from the chunk's own output (backward(out, grad, x): the default,
    torch.autograd.backward, which leaves the input's gradient in x.grad). The whole output and input gradient, and
    the cached chunks after each forward and each backward."""
    chunks = model_module.cut_sequences(x, torch.zeros(x.shape[:2], dtype=torch.long), positions, lengths)
    ins, outs, cached = [], [], []
    for c in chunks:
        ins.append(c.inputs.detach().requires_grad_())
        outs.append(stage(ins[-1], c.positions, chunk=c.chunk))
        cached.append(cached_chunks(stage))
    for j in reversed(range(len(chunks))):
        (backward or (lambda out, g, x: torch.autograd.backward(out, g)))(outs[j], grad.split(lengths, 1)[j], ins[j])
        cached.append(cached_chunks(stage))
    return torch.cat([o.detach() for o in outs], 1), torch.cat([x.grad for x in ins], 1), cached


def run_whole(stage, x, positions, grad):
    x = x.detach().requires_grad_()
    out = stage(x, positions)
    out.backward(grad)
    return out.detach(), x.grad


def assert_same_run(got, want, stage, reference):
    # 1e-5 relative (of each tensor's largest value): the chunks' attention sums a row's scores, and a key's gradient
    # over the queries, in other pieces than the whole's kernel (fp32 rounding, ~1e-7); a wrong mask, position or
    # a gradient stopped at a chunk boundary is off by the size of the values themselves (the test below).
    for a, b in [*zip(got, want), *((p.grad, reference.get_parameter(n).grad) for n, p in stage.named_parameters())]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_a_sequence_run_as_chunks_computes_what_it_computes_whole(documents, checkpointing):
    # Outputs, the input's gradient (what a stage sends back) and every weight's, at S = 2 and 4, chunks even and
    # of equal compute: each chunk's attention reads its sequence's earlier chunks' keys and values, its rotary
    # positions start at its offset, its mask over them follows the documents, and the earlier chunks get their
    # keys' and values' gradients from the later chunks' backwards. Checkpointed, a chunk's forward runs again in
    # its backward and does not keep its keys and values a second time: the cache holds the (S - 1) chunks' of each
    # of the 3 layers after the forwards, a chunk's fewer after each backward, none after the last.
    gen = torch.Generator().manual_seed(2)
    tokens = documents_batch(torch.randint(0, 97, (2, 32), generator=gen), CHUNK_DOCUMENTS)
    positions = model_module.document_positions(tokens, BOS) if documents else None
    x, grad = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    reference = chunk_stage()
    want = run_whole(reference, x, positions, grad)
    for chunks, how in itertools.product((2, 4), ("even", "compute")):
        lengths = model_module.chunk_lengths(32, chunks, reference.config, how)
        assert (len(set(lengths)) == 1) == (how == "even"), lengths  # (the tiny model's: nearly even)
        stage = chunk_stage(how=checkpointing)
        *got, cached = run_chunked(stage, x, positions, lengths, grad)
        assert_same_run(got, want, stage, reference)
        assert cached == [3 * min(j, chunks - 1) for j in range(1, chunks + 1)] + [3 * j for j in
                                                                                   reversed(range(chunks))], cached


def test_the_chunks_keys_values_gradient_is_what_makes_them_exact(monkeypatch):
    # Without the side channel (earlier chunks' keys and values read as constants: the gradient stops at a chunk
    # boundary, as zwx119/Seq1F1B's variant does) the outputs stay the same and the gradients are wrong by far more
    # than the tolerance above: the comparison would catch its loss.
    gen = torch.Generator().manual_seed(3)
    x, grad = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    reference = chunk_stage()
    want = run_whole(reference, x, None, grad)
    monkeypatch.setattr(model_module._ChunkEntry, "add", lambda self, dk, dv: None)
    stage = chunk_stage()
    out, x_grad, cached = run_chunked(stage, x, None, [8] * 4, grad)
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    def off(got, want):  # relative to the tensor's largest value, as the tolerance
        return ((got - want).abs().max() / want.abs().max()).item()
    assert off(x_grad, want[1]) > 1e-3  # (the residual stream's own gradient, untouched, is most of it)
    for name, param in stage.named_parameters():
        if "k_proj" in name or "v_proj" in name:
            assert off(param.grad, reference.get_parameter(name).grad) > 0.1, name
    assert cached[-1] == 0


def test_one_chunk_is_todays_path_bit_for_bit():
    # --seq-chunks 1: cut_sequences hands the microbatch over as it is, no chunk: the model runs today's code; and a
    # chunk that is the whole sequence computes the same bits (its own keys and values, nothing kept).
    gen = torch.Generator().manual_seed(4)
    x, grad = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    targets = torch.randint(0, 97, (2, 32), generator=gen)
    (only,) = model_module.cut_sequences(x, targets, None, model_module.chunk_lengths(32, 1, small_config()))
    assert only.inputs is x and only.targets is targets and only.chunk is None and only.tokens is None
    reference, stage = chunk_stage(), chunk_stage()
    want = run_whole(reference, x, None, grad)
    got = run_chunked(stage, x, None, [32], grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[2] == [0, 0]
    assert all(torch.equal(p.grad, reference.get_parameter(n).grad) for n, p in stage.named_parameters())


def test_the_loss_over_chunks_weighs_every_token_as_the_whole_sequence():
    # Each chunk's loss is its sum over its sequences' count of targets / S (cut_sequences' tokens): the mean over
    # the chunks, as a schedule takes it over its microbatches, is the whole sequences' loss, and so are its
    # gradients, with chunks of unequal lengths and ignored targets (-100) unevenly spread.
    config, gen = small_config(layers=2), torch.Generator().manual_seed(5)
    model = LlamaForPretraining(config)
    model.init_weights(6)
    model.head_in_loss = True
    inputs, targets = torch.randint(0, 97, (2, 32), generator=gen), torch.randint(0, 97, (2, 32), generator=gen)
    targets[0, 3:9] = -100
    whole = model_module.chunked_loss(model.lm_head, model(inputs), targets, 1)
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lengths = model_module.chunk_lengths(32, 4, config, "compute")
    losses = [model_module.chunked_loss(model.lm_head, model(c.inputs, c.positions, chunk=c.chunk), c.targets, 2,
                                        tokens=c.tokens) for c in model_module.cut_sequences(inputs, targets, None,
                                                                                             lengths)]
    for loss in reversed(losses):
        (loss / len(losses)).backward()
    torch.testing.assert_close(sum(losses) / len(losses), whole, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-5, atol=1e-5 * want[name].abs().max().item())
    with torch.no_grad():
        plain = sum(model_module.chunked_loss(model.lm_head, model(c.inputs, chunk=c.chunk), c.targets, 1)
                    for c in model_module.cut_sequences(inputs, targets, None, lengths)) / 4
    # Each chunk's own mean would divide chunk 0's sum by its 12 targets (6 of 18 ignored), not by 58 / 4 = 14.5: on
    # this model every token's loss is about log(97), so the error is small, but far above the 1e-6 above.
    assert abs(plain - whole) > 1e-5


def test_chunks_of_equal_compute_cost_the_same_and_bad_counts_say_so_in_one_line():
    # --chunk-split compute: causal attention reads each token's whole prefix, so later chunks are cut shorter, to
    # within a token (or a tp multiple) of equal FLOPs, counted as chunk_lengths counts them (a layer's matrices,
    # 6 N a token; attention, 12 H Q a key read): llama-8b at 32k, S 4, is 10972 / 8427 / 7107 / 6262 tokens.
    config = config_from_preset("llama-8b", 128256)
    linear, attention = 6 * model_module.parameter_counts(config)["layer"], 6 * config.num_attention_heads * 128
    for seq_len, chunks, multiple in ((32768, 4, 1), (32768, 4, 8), (131072, 8, 4), (64, 4, 2)):
        lengths = model_module.chunk_lengths(seq_len, chunks, config, "compute", multiple)
        assert sum(lengths) == seq_len and all(n % multiple == 0 for n in lengths) and lengths == sorted(lengths)[::-1]
        ends = list(itertools.accumulate(lengths))
        costs = [linear * (e - s) + attention * (e * (e + 1) - s * (s + 1)) for s, e in zip([0] + ends, ends)]
        token = linear + 2 * attention * seq_len  # the dearest token's cost, the last one's
        assert max(abs(c - sum(costs) / chunks) for c in costs) <= multiple * token, (lengths, costs)
    assert model_module.chunk_lengths(32768, 4, config, "compute")[0] > 10900  # not nearly even: it shows at 32k
    assert model_module.chunk_lengths(32, 4, config) == [8] * 4
    for args, message in (((32, 3), "--seq-chunks 3 does not cut --seq-len 32 into even chunks; the nearest that "
                                    "does: --seq-chunks 2"),
                          ((30, 4), "the nearest that does: --seq-chunks 3"),
                          ((32, 33), "--seq-chunks 33: give 1 to 32 chunks for --seq-len 32"),
                          ((32, 0), "--seq-chunks 0: give 1 to 32"),
                          ((32, 3, config, "even", 8), "of a multiple of 8 tokens (--tp); the nearest that does: "
                                                       "--seq-chunks 2"),
                          ((32, 2, config, "flops"), "--chunk-split flops: give even or compute")):
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            model_module.chunk_lengths(*(args if len(args) > 2 else (*args, config)))
        assert "\n" not in str(error.value)


def test_chunks_of_sequences_in_flight_interleave_and_evaluation_keeps_nothing():
    # Two sequences' chunks in flight at once, as 1F1B runs them on a first stage (slot 0's chunks forward, slot
    # 1's, then backwards interleaved, each sequence's last chunk first): each reads its own sequence's keys and
    # values. Forward-only (evaluation, no_grad) the same outputs, and a sequence's entries go with its last chunk.
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 32, 32, generator=gen) for _ in range(2)]
    grads = [torch.randn(2, 32, 32, generator=gen) for _ in range(2)]
    reference, stage = chunk_stage(), chunk_stage(how="full")
    wants = [run_whole(reference, x, None, g) for x, g in zip(xs, grads)]
    zeros = torch.zeros(2, 32, dtype=torch.long)
    chunks = [model_module.cut_sequences(x, zeros, None, [16, 8, 8], slot) for slot, x in enumerate(xs)]
    ins = {(s, c.chunk.index): c.inputs.detach().requires_grad_() for s in (0, 1) for c in chunks[s]}
    outs = {key: stage(x, chunk=chunks[key[0]][key[1]].chunk) for key, x in sorted(ins.items())}
    assert cached_chunks(stage) == 3 * 2 * 2
    for key in [(1, 2), (0, 2), (1, 1), (0, 1), (1, 0), (0, 0)]:
        outs[key].backward(grads[key[0]].split([16, 8, 8], 1)[key[1]])
    assert cached_chunks(stage) == 0
    for slot in (0, 1):
        got = [torch.cat([t[slot, j] for j in range(3)], 1) for t in (
            {k: o.detach() for k, o in outs.items()}, {k: x.grad for k, x in ins.items()})]
        for a, b in zip(got, wants[slot]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())  # as assert_same_run
    with torch.no_grad():
        out = [stage(c.inputs, chunk=c.chunk) for c in chunks[0]]
    torch.testing.assert_close(torch.cat(out, 1), wants[0][0], rtol=1e-5, atol=1e-5)
    assert cached_chunks(stage) == 0


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_chunks_compose_with_a_split_backward(checkpointing):
    # The zero-bubble schedules' backward in two calls, as torch's PipelineStage makes them: I (the input's gradient,
    # torch.autograd.grad) for each chunk, last first, then W (the weights') for each, later. The earlier chunks'
    # keys and values get their gradient in I (its node lies on the way to the input), and a checkpointed layer,
    # recomputed once for both (checkpoint_once), keeps its keys and values once.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    gen = torch.Generator().manual_seed(8)
    tokens = documents_batch(torch.randint(0, 97, (2, 32), generator=gen), CHUNK_DOCUMENTS)
    positions = model_module.document_positions(tokens, BOS)
    x, grad = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    reference, stage = chunk_stage(), chunk_stage(how=checkpointing)
    want = run_whole(reference, x, positions, grad)
    groups = []

    def backward_input(out, g, x):
        (x.grad,), param_groups = stage_backward_input([out], [g], [x], iter(list(stage.parameters())))
        groups.append(param_groups)
    *got, cached = run_chunked(stage, x, positions, [8] * 4, grad, backward_input)
    for param_groups in groups:
        stage_backward_weight(iter(list(stage.parameters())), param_groups)
    assert_same_run(got, want, stage, reference)
    assert cached == [3, 6, 9, 9, 9, 6, 3, 0]


def test_a_sequences_chunks_backward_out_of_order_is_refused():
    # A first chunk's backward before its later chunks' (GPipe's order, microbatch 0's first) would miss the gradient
    # they give its keys and values, silently: it is refused, naming the order to run.
    stage, x = chunk_stage(layers=1), torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(9))
    outs = [stage(c.inputs, chunk=c.chunk) for c in model_module.cut_sequences(x, x, None, [16, 16], 5)]
    with pytest.raises(RuntimeError, match=re.escape("chunk 0 of sequence 5: its backward ran before its later "
                                                     "chunks' backwards; run a sequence's chunks' backwards last")):
        outs[0].sum().backward()


def test_torchs_pipeline_runtime_drives_chunks_by_keyword(one_process_group):
    # torch's own PipelineStage and _PipelineScheduleRuntime, one stage holding the whole model: 2 sequences of 2
    # chunks as 4 microbatches (microbatch 2 s + j: sequence s's chunk j), the chunk and its positions handed to the
    # stage's forward as each microbatch's keyword arguments, the chunk's targets with their divisor to the loss,
    # in an order that runs each sequence's chunks forward in order and backward last first, interleaved. The
    # runtime's mean over its microbatches is then the 2 sequences' mean loss, and so are the gradients.
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime
    config, gen = small_config(layers=2), torch.Generator().manual_seed(10)
    inputs = documents_batch(torch.randint(0, 97, (4, 32), generator=gen), {0: [5, 13, 27], 3: [20]})
    targets, positions = torch.randint(0, 97, (4, 32), generator=gen), model_module.document_positions(inputs, BOS)
    reference, model = LlamaForPretraining(config), LlamaForPretraining(config)
    for m in (reference, model):
        m.init_weights(12)
        m.head_in_loss = True
    model_module.checkpoint_layers([model], "full")
    loss_fn = functools.partial(model_module.chunked_loss, reference.lm_head, chunks=1)
    whole = sum(loss_fn(reference(x, p), targets=y) for x, y, p in zip(inputs.chunk(2), targets.chunk(2),
                                                                      positions.chunk(2))) / 2
    whole.backward()
    chunks = [c for s, (x, y, p) in enumerate(zip(inputs.chunk(2), targets.chunk(2), positions.chunk(2)))
              for c in model_module.cut_sequences(x, y, p, [16, 16], s)]
    stage = PipelineStage(model, 0, 1, torch.device("cpu"), input_args=torch.empty(2, 16, dtype=torch.long,
                                                                                    device="meta"),
                          output_args=torch.empty(2, 16, 32, device="meta"))
    schedule = _PipelineScheduleRuntime([stage], n_microbatches=4, loss_fn=lambda h, target: model_module.chunked_loss(
        model.lm_head, h, target[0], 1, tokens=target[1]))
    schedule.pipeline_order = {0: [_Action(0, _ComputationType(kind), mb) for kind, mb in (
        ("F", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 3), ("B", 2))]}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    # Pre-cut microbatches (private in torch 2.13: step() would hand every microbatch the same chunk, a non-tensor
    # keyword), so what step() sets first is set here.
    stage.has_backward, losses = True, []
    schedule._step_microbatches(arg_mbs=[(c.inputs,) for c in chunks], target_mbs=[(c.targets, c.tokens) for c in
                                                                                   chunks], losses=losses,
                                kwarg_mbs=[{"positions": c.positions, "chunk": c.chunk} for c in chunks])
    torch.testing.assert_close(sum(losses) / 4, whole.detach(), rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        want = reference.get_parameter(name).grad
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert cached_chunks(model) == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_chunk_orders_keep_each_sequences_chunks_in_order_and_hold_p_plus_s_minus_1_under_1f1b(name):
    # model.chunk_order (--seq-chunks): on every rank each sequence's chunks go forward in order and backward last
    # chunk first, the sequences one after another; under 1F1B (Seq1F1B's order) rank r holds at most
    # (p - r) + (S - 1) chunks in flight, the first rank p + S - 1 (GPipe: all S m); torch validates each order and
    # lowers it with its sends and receives to the end (an order that cannot progress fails there).
    from torch.distributed.pipelining.schedules import _add_send_recv, _validate_schedule
    for pp, m, S in ((2, 4, 2), (4, 2, 4), (3, 3, 2), (4, 1, 8)):
        order = model_module.chunk_order(name, pp, m, [16] * S)
        assert (order.microbatches, order.seq_chunks, order.per_rank) == (S * m, [16] * S, 1)
        assert _validate_schedule(order.actions, pp, pp, S * m) == order.stage_ranks == {r: r for r in range(pp)}
        for r, actions in order.actions.items():
            kinds = [(a.computation_type.value, a.microbatch_index) for a in actions]
            assert [i for k, i in kinds if k == "F"] == list(range(S * m))
            assert [i for k, i in kinds if k == "B"] == [s * S + j for s in range(m) for j in reversed(range(S))]
            held = max(itertools.accumulate(1 if k == "F" else -1 for k, _ in kinds))
            assert held == (S * m if name == "gpipe" else min(S * m, pp - r + S - 1)), (pp, m, S, r, held)
        _add_send_recv({r: list(a) for r, a in order.actions.items()}, order.stage_ranks.__getitem__, pp)
    assert model_module.chunk_order(name, 2, 4, [16]) is None  # one chunk: the schedule by name, as before


def test_chunks_under_tensor_and_sequence_parallelism_compute_the_whole_sequence(tmp_path):
    # --tp 2 with sequence parallelism: each rank keeps its own heads' keys and values of a chunk (attention gathers
    # the chunk's positions), the loss takes each rank's piece of a chunk. At S 2 and 4 (a tp multiple: 8 tokens
    # each here), checkpointed or not, with documents across chunks: the whole sequences' loss and gradients.
    gen = torch.Generator().manual_seed(11)
    inputs = documents_batch(torch.randint(0, 97, (2, 32), generator=gen), CHUNK_DOCUMENTS)
    targets = torch.randint(0, 97, (2, 32), generator=gen)
    lengths = model_module.chunk_lengths(32, 4, small_config(layers=2), "compute", multiple=2)
    variants = [(how, chunks) for how in ("none", "full") for chunks in ([16, 16], lengths)]
    run_workers(_chunks_tp_worker, 2, args=(2, str(tmp_path / "store"), str(tmp_path), (inputs, targets), variants))
    results = torch.load(tmp_path / "chunks.pt", weights_only=True)
    loss, grads, _ = results["none", (32,)]
    for how, chunks in variants:
        got_loss, got, cached = results[how, tuple(chunks)]
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
        for name, want in grads.items():  # 1e-5 of the largest: as assert_same_run
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert cached == 0


def test_chunks_through_compiled_layers():
    # --compile (checkpointed too): a layer compiles around the chunks' keys and values (chunk_keys_values runs as it
    # is, between its graphs) and computes the whole sequence's. Compiled without Inductor, as compile_layers does
    # with it: the graphs, not the kernels, are at stake.
    gen = torch.Generator().manual_seed(12)
    x, grad = torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    reference, stage = chunk_stage(layers=2), chunk_stage(layers=2, how="full")
    for layer in model_module.decoder_layers([stage]):
        layer.compile(backend="eager")
    want = run_whole(reference, x, None, grad)
    *got, cached = run_chunked(stage, x, None, [16, 8, 8], grad)
    assert_same_run(got, want, stage, reference)
    assert cached == [2, 4, 4, 4, 2, 0]
