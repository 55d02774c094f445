"""Every pipeline variant side by side on the same model, data and machine, in one run.

    python prepare_data.py                                    # once: the data every run reads (data/)
    OMP_NUM_THREADS=1 python benchmark.py                     # 2 ranks, 8 microbatches, tiny model
    python benchmark.py --ranks 3 --microbatches 6 --repeats 5 --out bench/ --data data/corpus
    python benchmark.py --sweep                               # GPipe step time for m = 1, 2, 4, 8, 16
    python benchmark.py --dp 2                                # 2 stages alone vs 2 stages x 2 replicas
    python benchmark.py --tp 2                                # 2 stages x tp 2, sequence parallel or not
    python benchmark.py --splits                              # split by layers vs by cost; checkpointing, compile
    python benchmark.py --documents --ranks 1 --seq-len 1024  # --document-masking vs causal attention
    python benchmark.py --seq-chunks 4 --budget 900 --batch-size 2 --microbatches 2 --seq-len 1024 -- --model small
                                                              # 1F1B whole vs in 4 chunks; the longest --seq-len
    python benchmark.py --vocab-parallel --ranks 3            # the hand-written 1F1B with and without it
    python benchmark.py --variants 1f1b -- --layers 2         # flags after -- go to every run
    python benchmark.py --variants 1f1b,zbvzerobubble,gen.csv # an order of plan.py --write-schedule gen.csv too
    torchrun --nproc_per_node 2 benchmark.py measure-memory OUT.json train_pipeline_gpipe.py --steps 2 ...
    torchrun --nproc_per_node 2 benchmark.py run train_pipeline_gpipe.py --schedule 1f1b --trace DIR ...
    python benchmark.py loss-memory                           # the loss's peak memory, plain and in chunks
    python benchmark.py gpu-check                             # on one GPU: every feature it can run, checked

Variants: every schedule of torch.distributed.pipelining (train_pipeline_gpipe.py), the hand-written AFAB
and 1F1B (train_pipeline_afab_manual.py), the tracer split (train_pipeline_tracer.py), and any FILE.csv that
--variants names (an order in torch's CSV form, such as plan.py --write-schedule writes: train_pipeline_gpipe.py
--schedule FILE.csv, its variant named as given). Each is a real
training run under torchrun, reading --data (prepared once by prepare_data.py), the script's main() run by
`benchmark.py run` (which labels torch's 1F1B in the trace: torch 2.13's Schedule1F1B records no labels of
its own, unlike its GPipe and the multi-stage schedules). Runs alternate between
variants, repeat after repeat, so drift of a shared machine hits every variant alike; a variant's step time is
the median over its runs of each run's median step (first step excluded). The last run of each variant records
a trace (the scripts' --trace DIR: torch.profiler's Chrome trace of the last 3 steps, DIR/rank{R}.json), from
which come the measured bubble, the share of time waiting in receives, each stage's forward and backward time
of one microbatch, and a timeline picture; a separate short run under measure-memory gives the peak
activation bytes per rank.

measure-memory runs a training script's main() in this process (under torchrun: on every rank) inside an
ActivationMeter (the peak bytes of tensors autograd saves for backward, parameters left out, and of the
gradients the zero-bubble schedules keep from a backward's input half to its weight half; with --vocab-parallel
also the first rank's step embeddings and their gradients, held till the step's end), and counts after
each optimizer step the bytes of parameters, gradients and AdamW state the rank holds (with FSDP its shards),
and the bytes it sends to other stages a step, with --async-checkpoint the bytes of the copy of its state it
stages in CPU memory for a background save, and the peak bytes its start-up allocates (model.materialize: its
shards and one whole tensor at a time); rank 0 writes {"activation_bytes_per_rank": [...],
"param_bytes_per_rank": [...], "grad_bytes_per_rank": [...], "optimizer_bytes_per_rank": [...],
"sent_bytes_per_rank": [...], "checkpoint_staging_bytes_per_rank": [...], "startup_bytes_per_rank": [...]} to
OUT.json. A run that trains no step (--steps 0, or a finished run in its --checkpoint-dir resumed) measured
nothing: one line, exit status 1, no OUT.json.

Writes OUT/results.md (Markdown table), OUT/results.json, OUT/<variant>.trace/rank{R}.json and, when matplotlib
is installed, OUT/<variant>.png (forward / backward / waiting per rank over time). An earlier run's files there
are replaced only with --force, and only those benchmark.py wrote.
"""

import argparse
import contextlib
import importlib.util
import inspect
import io
import itertools
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
import weakref

import torch
import torch.distributed as dist
import torch.distributed.pipelining.stage
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor
import tqdm
from torch.optim.optimizer import register_optimizer_step_post_hook

import checkpoint
import model
import plan
from checkpoint import Parser, UsageError, number, whole
from plan import compute_actions, read_rank, read_trace, traced_step_time  # noqa: F401 (the tests ask them here)

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
# --seq-chunks S: 1F1B on whole sequences (the reference) against each sequence in S chunks (Seq1F1B), even in both
# scripts that run them, and of equal compute in the hand-written one (torch's stages take one message shape).
def seq_chunk_variants(S: int) -> dict:  # name: (script, flags)
    cut = ["--seq-chunks", str(S)]
    return {"1f1b": ("train_pipeline_gpipe.py", []), f"1f1b --seq-chunks {S}": ("train_pipeline_gpipe.py", cut),
            "1f1b (by hand)": ("train_pipeline_afab_manual.py", []),
            f"1f1b (by hand) --seq-chunks {S}": ("train_pipeline_afab_manual.py", cut),
            f"1f1b (by hand) --seq-chunks {S} --chunk-split compute": ("train_pipeline_afab_manual.py",
                                                                      [*cut, "--chunk-split", "compute"])}


SPLITS = {"one process": (1, []), "even": (None, ["--split", "even"]), "balanced": (None, ["--split", "balanced"]),
          "balanced + activation checkpointing": (None, ["--activation-checkpointing"]),
          "balanced + compile": (None, ["--compile"])}  # name: (processes, None: --ranks; flags)


# ----------------------------------------------------------------------------------------------------------
# Reading the scripts' traces: plan.py reads them (read_trace: what each rank's steps, stages, embedding and
# loss took), for its measured pass times; these are the benchmark's questions to them

def measured_bubble(trace_dir: str) -> float:
    """The idle share of a step (1 - busy / step time), averaged over every rank and profiled step."""
    shares = [1 - s["busy"] / s["time"] for r in read_trace(trace_dir).values() for s in r["steps"]]
    return sum(shares) / len(shares)


def receive_share(trace_dir: str) -> float:
    """The share of a step spent blocked in receives, averaged over every rank and profiled step."""
    shares = [s["waiting"] / s["time"] for r in read_trace(trace_dir).values() for s in r["steps"]]
    return sum(shares) / len(shares)


def forward_backward_times(trace_dir: str) -> list[tuple[float, float]]:
    """Per rank: the median forward (with the loss, on the last stage) and the median backward of one
    microbatch, in seconds; a rank holding several stages: the sums over its stages."""
    return [(sum(s["forward"] for s in r["stages"].values()), sum(s["backward"] for s in r["stages"].values()))
            for r in read_trace(trace_dir).values()]


def stage_times(trace_dir: str) -> list[float]:
    """Per rank: the median forward plus the median backward of one microbatch, in seconds."""
    return [t_f + t_b for t_f, t_b in forward_backward_times(trace_dir)]


def replayed(trace_dir: str, schedule: str, m: int) -> dict:
    """plan.py's replay of a single-stage schedule with the stage times measured in a traced run."""

    times = forward_backward_times(trace_dir)
    orders = plan.schedule_orders(schedule, len(times), m, 1)
    return plan.replay(orders, [t for t, _ in times], [t for _, t in times], [0.0] * len(times))


def ideal_gpipe_step(trace_dir: str, p: int, m: int) -> float:
    """(m + p - 1) x (t_forward + t_backward) of the slowest stage: the bubble-limited GPipe step."""
    return (m + p - 1) * max(stage_times(trace_dir))


def unequal_stages_bound(trace_dir: str, m: int) -> float:
    """The same bound for stages of unequal cost: the first microbatch passes every stage once, the other
    m - 1 follow at the pace of the slowest. Equals the one above when the stages are equal."""
    times = stage_times(trace_dir)
    return sum(times) + (m - 1) * max(times)


def draw(trace_dir: str, png_path: str, title: str) -> bool:
    """The last two profiled steps of every rank: forward, backward, waiting in receives, idle."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = read_trace(trace_dir)
    start = min(r["spans"][-2:][0][0] for r in ranks.values())
    colors = {"forward": "#4c72b0", "backward": "#55a868", "overlapped": "#8172b2", "waiting": "#c0c0c0"}
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(ranks)))
    for rank, r in ranks.items():
        for s, e, kind in r["segments"]:
            if s >= start:
                ax.broken_barh([((s - start) * 1e3, (e - s) * 1e3)], (rank - 0.4, 0.8), facecolors=colors[kind])
    ax.set_yticks(sorted(ranks), [f"rank {r}" for r in sorted(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue: forward, green: backward, purple: overlapped F+B, grey: waiting in a receive, "
                  "white: idle)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------
# Activations held for backward

class ActivationMeter:
    """Peak bytes of activations held for backward while active: the tensors autograd saves, counted through its
    saved-tensor hooks, and the gradients the zero-bubble schedules keep from a microbatch's input gradient (I)
    to its weight gradient (W), and the outputs a selective checkpoint keeps (model._Reusable, the store torch's
    selective checkpointing fills in forward and empties as its recomputation takes them back), and with
    --vocab-parallel the first rank's step embeddings and their gradients (model.VocabParallel: held from embed_all
    to embed_backward, not saved by autograd).

    Parameters (which autograd also saves, e.g. a linear's weight) are not activations and are not counted: an
    nn.Parameter, or a view of one (FSDP2's unsharded parameters, gathered for the step, are Parameters too). A
    storage saved by several ops counts once; it stops counting when the last graph node saving it is freed.
    The I/W split is torch's stage_backward_input / stage_backward_weight (what PipelineStage calls): the meter
    wraps the two while active and counts the gradients the first hands to the second (param_groups' "grads").

        with ActivationMeter() as meter:
            train_step(...)
        meter.peak_bytes
    """

    def __init__(self):
        self._live: dict[int, list] = {}  # storage pointer -> [bytes, number of holders still alive]
        self.current = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._kept: dict[int, list[int]] = {}  # id(param_groups) -> the storages its gradients hold, until W
        self._embedded: list[int] = []  # --vocab-parallel: the first rank's step embeddings and their gradients
        stage, vocab = torch.distributed.pipelining.stage, model.VocabParallel
        self._split = [unittest.mock.patch.object(stage, "stage_backward_input", self._input_grad(stage)),
                       unittest.mock.patch.object(stage, "stage_backward_weight", self._weight_grad(stage)),
                       unittest.mock.patch.object(model._Reusable, "__setitem__",
                                                  self._stored(model._Reusable.__setitem__)),
                       unittest.mock.patch.object(vocab, "embed_all", self._embed_all(vocab.embed_all)),
                       unittest.mock.patch.object(vocab, "embed_backward", self._embed_backward(vocab.embed_backward))]

    def _hold(self, tensor) -> list[int]:
        ptrs = []
        for storage in _storages(tensor):
            ptr = storage.data_ptr()
            entry = self._live.setdefault(ptr, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.current += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.current)
            entry[1] += 1
            ptrs.append(ptr)
        return ptrs

    def _release(self, ptr):
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]

    def _pack(self, tensor):
        if tensor.device.type == "meta" or isinstance(tensor, torch.nn.Parameter) or \
                isinstance(tensor._base, torch.nn.Parameter):
            return tensor
        # Held through a detached alias: the tensor itself may be the output of the node that saves it, and
        # holding it (so its grad_fn) from that node's saved state would be a reference cycle that keeps the graph
        # (and so the count) alive past its backward whenever part of it never runs a backward that frees it (the
        # input-gradient-only side of a zero-bubble W). Autograd gives the unpacked alias its grad_fn back.
        return _Saved(self, self._hold(tensor), tensor.detach())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _input_grad(self, stage):
        original = stage.stage_backward_input

        def input_grad(*args, **kwargs):
            dinputs, param_groups = original(*args, **kwargs)
            self._kept[id(param_groups)] = [ptr for group in param_groups for grads in group.get("grads") or ()
                                            for g in grads if g is not None for ptr in self._hold(g)]
            return dinputs, param_groups
        return input_grad

    def _weight_grad(self, stage):
        original = stage.stage_backward_weight

        def weight_grad(weights, param_groups, *args, **kwargs):
            try:
                return original(weights, param_groups, *args, **kwargs)
            finally:
                for ptr in self._kept.pop(id(param_groups), ()):
                    self._release(ptr)
        return weight_grad

    def _stored(self, original):
        held = {}  # id(a store) -> {the op's call number: the storages its kept output holds}

        def free(store_id):  # the region's backward is done: what its recomputation did not need to take back
            for ptrs in held.pop(store_id, {}).values():  # (it stops at the last tensor its backward reads)
                for ptr in ptrs:
                    self._release(ptr)

        def setitem(store, key, value):  # kept in forward; replaced once the recomputation took it back
            if id(store) not in held:
                held[id(store)] = {}
                weakref.finalize(store, free, id(store))
            for ptr in held[id(store)].pop(key, ()):
                self._release(ptr)
            kept = [leaf.val for leaf in torch.utils._pytree.tree_leaves(value)
                    if isinstance(getattr(leaf, "val", None), torch.Tensor)]
            if kept:
                held[id(store)][key] = [ptr for tensor in kept for ptr in self._hold(tensor)]
            original(store, key, value)
        return setitem

    def _embed_all(self, original):
        def embed_all(vocab, chunks):  # --vocab-parallel's first rank: the step's m embeddings, its forwards' inputs,
            chunks = original(vocab, chunks)  # held from here (its first layer saves each for a while too: counted
            if vocab.rank == 0 and torch.is_grad_enabled():  # once), and each one's gradient from its backward,
                for c in chunks:  # till the step's embed_backward reads them (a forward-only step: none)
                    self._embedded += self._hold(c.inputs)
                    c.inputs.requires_grad_()  # (as the step's forward makes it, to take the gradient's hook)
                    c.inputs.register_post_accumulate_grad_hook(lambda t: self._embedded.extend(self._hold(t.grad)))
            return chunks
        return embed_all

    def _embed_backward(self, original):
        def embed_backward(vocab, *args, **kwargs):
            try:
                return original(vocab, *args, **kwargs)
            finally:
                for ptr in self._embedded:
                    self._release(ptr)
                self._embedded = []
        return embed_backward

    def __enter__(self):
        for patch in self._split:
            patch.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for patch in reversed(self._split):
            patch.__exit__(*exc)


class _Saved:
    # Autograd drops this object when it frees the graph node that saved the tensor; that is when the
    # activation stops being held for backward.
    __slots__ = ("meter", "ptrs", "tensor")

    def __init__(self, meter, ptrs, tensor):
        self.meter, self.ptrs, self.tensor = meter, ptrs, tensor

    def __del__(self):
        for ptr in self.ptrs:
            self.meter._release(ptr)


def _storages(tensor) -> list:
    """The storages a tensor holds: its own, or those inside a tensor subclass that wraps others (a DTensor's
    shard, a collective's result waiting to be read), through the subclass protocol's __tensor_flatten__."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [storage for t in inner if isinstance(t, torch.Tensor) for storage in _storages(t)]
    return [tensor.untyped_storage()]


# ----------------------------------------------------------------------------------------------------------
# The loss's memory: the whole logits at once, or a piece of the sequence at a time

def loss_peak_bytes(vocab_size: int, hidden_size: int, tokens: int, chunks: int, seed: int = 0) -> int:
    """The peak bytes the loss allocates beyond what exists before it, forward and backward, on the last stage
    of a one-layer model with that vocabulary: model.chunked_loss with `chunks` pieces (1: the plain loss,
    the whole [tokens, vocab] fp32 logits at once). Measured by torch.profiler's memory events (the CPU
    allocator's running total), so it is exact bytes, not a timing."""
    from model import LlamaConfig, LlamaForPretraining, chunked_loss

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForPretraining(config).keep_only([0], False, True)  # the last stage: a layer, norm and head
    model.init_weights(seed)
    model.head_in_loss = True
    gen = torch.Generator().manual_seed(seed)
    hidden = model(torch.randn(1, tokens, hidden_size, generator=gen))
    targets = torch.randint(0, vocab_size, (1, tokens), generator=gen)
    return allocated_bytes(lambda: chunked_loss(model.lm_head, hidden, targets, chunks).backward())[1]


def allocated_bytes(run, device: str = "cpu") -> tuple[object, int, int]:
    """run()'s result, the most bytes it had allocated on device at once beyond what was allocated there before
    it, and the bytes it left allocated: torch.profiler's memory events, the allocator's running total (on the CPU
    of what was allocated while profiling: a tensor from before, freed during, is not subtracted), so exact
    bytes, not a timing."""
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"
                      and e["args"]["Device Type"] == DEVICE_TYPES[torch.device(device).type]]
    if not events:
        return result, 0, 0
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return result, max(e["Total Allocated"] for e in events) - before, events[-1]["Total Allocated"] - before


DEVICE_TYPES = {"cpu": 0, "cuda": 1}  # c10::DeviceType: the "Device Type" of the profiler's memory events


@contextlib.contextmanager
def counted_startup(module):
    """[bytes]: the peak a rank allocates while the script's materialize allocates and initializes its stages (its
    shards, and one whole tensor at a time: plan.py's start-up peak), by allocated_bytes."""
    peak, materialize = [0], module.materialize

    def counted(modules, config, device, seed):
        _, peak[0], _ = allocated_bytes(lambda: materialize(modules, config, device, seed), device)
    with unittest.mock.patch.object(module, "materialize", counted):
        yield peak


def loss_memory(argv: list[str]) -> None:
    """benchmark.py loss-memory: the loss's peak extra bytes, plain and in chunks, side by side."""
    p = Parser(prog="benchmark.py loss-memory", description=loss_peak_bytes.__doc__)
    p.add_argument("--vocab-size", type=whole(1), default=32768, help="of the one-layer model measured")
    p.add_argument("--hidden-size", type=whole(4), default=256, help="a multiple of 4 (the model's 4 heads)")
    p.add_argument("--tokens", type=whole(1), default=4096, help="one microbatch: sequences x sequence length")
    p.add_argument("--chunks", type=whole(1), nargs="+", default=[1, 2, 4, 8, 16], help="the --loss-chunks to measure")
    args = p.parse_args(argv)
    print(f"the loss's peak extra memory, vocab {args.vocab_size}, hidden {args.hidden_size}, {args.tokens} tokens "
          f"(the whole fp32 logits: {4 * args.tokens * args.vocab_size / 2**20:.0f} MiB)")
    plain = None
    for chunks in args.chunks:
        peak = loss_peak_bytes(args.vocab_size, args.hidden_size, args.tokens, chunks)
        plain = plain or peak
        print(f"  --loss-chunks {chunks:3d}: {peak / 2**20:8.1f} MiB ({plain / peak:.1f}x smaller than "
              f"--loss-chunks {args.chunks[0]})")


def load_script(path: str):
    """A training script as a module (its main() and build_parser()), imported from its path."""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such training script")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # its model.py and checkpoint.py
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    if not (callable(getattr(module, "main", None)) and callable(getattr(module, "build_parser", None))):
        raise UsageError(f"{path}: not a training script of this collection (no main and build_parser)")
    return module


@contextlib.contextmanager
def labelled_1f1b():
    """Label torch's 1F1B in a trace as its GPipe is: "Forward i" / "Backward i" around the stage's forward and
    backward of microbatch i (torch 2.13's Schedule1F1B records no labels of its own; its receives are waited
    for outside these, as in the hand-written script). Nothing changes once torch labels it itself."""
    from torch.distributed.pipelining import Schedule1F1B
    from torch.profiler import record_function

    original = Schedule1F1B._step_microbatches
    if "record_function" in inspect.getsource(original):
        yield
        return

    def labelled(label, method):
        def run(chunk, *args, **kwargs):
            with record_function(f"{label} {chunk}"):
                return method(chunk, *args, **kwargs)
        return run

    def step_microbatches(self, *args, **kwargs):
        stage = self._stage
        stage.forward_one_chunk = labelled("Forward", type(stage).forward_one_chunk.__get__(stage))
        stage.backward_one_chunk = labelled("Backward", type(stage).backward_one_chunk.__get__(stage))
        try:
            return original(self, *args, **kwargs)
        finally:
            del stage.forward_one_chunk, stage.backward_one_chunk

    Schedule1F1B._step_microbatches = step_microbatches
    try:
        yield
    finally:
        Schedule1F1B._step_microbatches = original


@contextlib.contextmanager
def counted_sends(module):
    """[bytes] this rank sends to other stages while training (activations forward, their gradients back; not
    evaluating): from the sends torch's PipelineStage builds, or the hand-written script's Step.message (its
    sends)."""
    sent = [0]

    def ops_counted(build):
        def counted(self, *args, **kwargs):
            ops = build(self, *args, **kwargs)
            sent[0] += sum(op.tensor.nbytes for op in ops) if torch.is_grad_enabled() else 0
            return ops
        return counted

    def send_counted(message):
        def counted(self, op, tensor, *args, **kwargs):
            sent[0] += tensor.nbytes if torch.is_grad_enabled() and op is dist.isend else 0
            return message(self, op, tensor, *args, **kwargs)
        return counted

    base = torch.distributed.pipelining.stage._PipelineStageBase  # PipelineStage's and the tracer's stages'
    with contextlib.ExitStack() as patches:
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            patches.enter_context(unittest.mock.patch.object(base, name, ops_counted(getattr(base, name))))
        if hasattr(module, "Step"):
            patches.enter_context(unittest.mock.patch.object(module.Step, "message", send_counted(module.Step.message)))
        yield sent


@contextlib.contextmanager
def counted_staging():
    """[bytes] of the copy of its state a rank stages in CPU memory for a background save (--async-checkpoint),
    the most any save took: DCP's stager's copy, each storage once."""
    staged, stage = [0], DefaultStager.stage

    def counted(self, state_dict, **kwargs):
        copy = stage(self, state_dict, **kwargs)
        storages = {s.data_ptr(): s.nbytes() for t in torch.utils._pytree.tree_leaves(copy) if torch.is_tensor(t)
                    for s in _storages(t)}
        staged[0] = max(staged[0], sum(storages.values()))
        return copy
    with unittest.mock.patch.object(DefaultStager, "stage", counted):
        yield staged


def in_process(argv: list[str]) -> None:
    """benchmark.py run SCRIPT [SCRIPT ARGS...] and benchmark.py measure-memory OUT.json SCRIPT [SCRIPT ARGS...],
    on every rank under torchrun: the script's main() in this process, with torch's 1F1B labelled for --trace
    (labelled_1f1b); measuring, every rank's activations (ActivationMeter), held bytes and bytes sent a step
    (counted_sends) to rank 0, which writes them to OUT.json. Errors as the scripts give them: one line."""
    measure = argv[0] == "measure-memory"
    p = Parser(prog=f"benchmark.py {argv[0]}",
               description="Run a training script with torch's 1F1B labelled for --trace" + (
                   "; write each rank's peak activations, the bytes of parameters, gradients and AdamW state it "
                   "holds, and the bytes it sends to other stages a step to OUT.json" if measure else "") + ".")
    if measure:
        p.add_argument("out", metavar="OUT.json")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS")
    args = p.parse_args(argv[1:])
    try:
        module = load_script(args.script)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    script_args = module.build_parser().parse_args(args.script_args)
    held, steps = {"param": 0, "grad": 0, "optimizer": 0}, [0]

    def count_held(optimizer, *_):  # after each optimizer step: what this rank holds (with FSDP, its shards)
        if all(group["lr"] == 0 for group in optimizer.param_groups):
            return  # a resume's load initializes AdamW's state with a step at lr 0 (DCP): not a training step
        steps[0] += 1
        size = lambda ts: sum((t.to_local() if isinstance(t, DTensor) else t).nbytes  # noqa: E731
                              for t in ts if torch.is_tensor(t))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held.update(param=size(params), grad=size(p.grad for p in params),
                    optimizer=size(v for state in optimizer.state.values() for v in state.values()))

    def measured(script_args):
        hook = register_optimizer_step_post_hook(count_held)
        try:
            measuring = (lambda counter: counter if measure else contextlib.nullcontext())  # noqa: E731
            with labelled_1f1b(), measuring(counted_sends(module)) as sent, counted_staging() as staged, \
                    measuring(counted_startup(module)) as startup, measuring(ActivationMeter()) as meter:
                module.main(script_args)  # leaves the process group up; checkpoint.run takes it down
        finally:
            hook.remove()
        if not measure:
            return
        if steps[0] == 0:  # every rank alike: each trains the same steps
            why = ("--steps 0 only evaluates; give --steps 2" if script_args.steps == 0 else
                   f"--checkpoint-dir {script_args.checkpoint_dir} holds a run that already reached --steps "
                   f"{script_args.steps}; add --fresh, or give another --checkpoint-dir")
            raise UsageError(f"measure-memory: {os.path.basename(args.script)} trained no step, so nothing was "
                             f"measured: {why}", on_every_rank=True)
        ranks = [(meter.peak_bytes, held, sent[0] / max(1, steps[0]), staged[0], startup[0])]  # sent: a step's
        if dist.is_initialized():
            mine, ranks = ranks[0], [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump({"activation_bytes_per_rank": [peak for peak, *_ in ranks],
                           **{f"{kind}_bytes_per_rank": [h[kind] for _, h, *_ in ranks] for kind in held},
                           "sent_bytes_per_rank": [sent for _, _, sent, *_ in ranks],
                           "checkpoint_staging_bytes_per_rank": [staged for *_, staged, _ in ranks],
                           "startup_bytes_per_rank": [startup for *_, startup in ranks]}, f)
            os.replace(args.out + ".tmp", args.out)
            print(f"peak activations held per rank (MiB): {', '.join(f'{p / 2**20:.1f}' for p, *_ in ranks)} "
                  f"-> {args.out}", flush=True)

    checkpoint.run(measured, script_args)  # a UsageError: one line, exit 1; the process group torn down


# ----------------------------------------------------------------------------------------------------------
# Runs

def command(args, script, schedule, steps, workdir, microbatches=None, extra=()) -> list[str]:
    """A training script and its flags for one run of the benchmark (training alone: no held-out evaluation)."""
    return [os.path.join(ROOT, script), "--schedule", schedule, "--steps", str(steps), "--warmup-steps", "2",
            "--batch-size", str(args.batch_size), "--microbatches", str(microbatches or args.microbatches),
            "--seq-len", str(args.seq_len), "--data", args.data, "--metrics", os.path.join(workdir, "metrics.jsonl"),
            "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--fresh", "--eval-every", "0", *args.script_args,
            *extra]


PROGRESS = {"bar": None}  # main()'s progress bar, a tick per training run


def planned_runs(args) -> int:
    """The training runs main() makes with these flags, one after another: the timed ones, and one untimed run per
    variant under measure-memory (but for --sweep and --documents)."""
    if args.sweep:
        return args.repeats * len(args.sweep_microbatches)
    if args.dp > 1 or args.tp > 1:
        return (args.repeats + 1) * 2
    if args.splits:
        return (args.repeats + 1) * len(chosen(SPLITS, "one process", args.variants))
    if args.documents:
        return args.repeats * 2
    if args.vocab_parallel:
        return (args.repeats + 1) * 2
    if args.seq_chunks > 1:  # the search: 2 runs per variant of the gpipe script if plan.py's estimate is right
        chunked = chosen(seq_chunk_variants(args.seq_chunks), "1f1b", args.variants)
        return (args.repeats + 2) * len(chunked) + 2 * sum(
            script == "train_pipeline_gpipe.py" for script, _ in chunked.values()) * bool(args.budget)
    return (args.repeats + 1) * len(timed_variants(args))


def launched(cmd: list[str], ranks: int, workdir: str, what: str) -> str:
    """launch(), shown on the progress bar: the run under way, then one more done."""
    bar = PROGRESS["bar"]
    if bar is not None:
        bar.set_postfix_str(what)
    stdout = launch(cmd, ranks, workdir, what)
    # A run's checkpoints measure nothing, and --fresh keeps each earlier run's aside (ckpt.previous-TIME): `small`
    # saves 1.4 GB a run, and 24 runs of it filled this machine's disk. Only the metrics are read afterwards.
    for name in os.listdir(workdir):
        if name == "ckpt" or name.startswith("ckpt.previous-"):
            shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    if bar is not None:
        bar.update()
    return stdout


def timed(args, repeat: int, name: str, summary: dict) -> None:
    """A timed run's line, above the progress bar."""
    tqdm.tqdm.write(f"repeat {repeat + 1}/{args.repeats} {name}: median step {summary['median_step_time'] * 1e3:.1f} "
                    "ms", file=sys.stderr)


def launch(cmd: list[str], ranks: int, workdir: str, what: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark: {what} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def run(args, script, schedule, steps, workdir, microbatches=None, extra=(), ranks=None) -> tuple[dict, str]:
    """One training run (the script's main() under benchmark.py run: torch's 1F1B labelled in its trace);
    returns its summary row and stdout."""
    stdout = launched([os.path.abspath(__file__), "run",
                       *command(args, script, schedule, steps, workdir, microbatches, extra)],
                      ranks or args.ranks, workdir, f"{script} --schedule {schedule}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["summary"] for line in f if line.startswith('{"summary"')][-1], stdout


def memory(args, script, schedule, workdir, microbatches=None, extra=(), ranks=None) -> tuple[dict, str]:
    """A short untimed run under measure-memory (the saved-tensor hooks slow a step down): every rank's peak
    activation bytes and the bytes it holds ({"activation_bytes_per_rank": [...], ...}), and the run's stdout."""
    out = os.path.join(workdir, "memory.json")
    stdout = launched([os.path.abspath(__file__), "measure-memory", out,
                       *command(args, script, schedule, 2, workdir, microbatches, extra)], ranks or args.ranks,
                      workdir, f"measure-memory {script} --schedule {schedule}")
    with open(out) as f:
        return json.load(f), stdout


def trace_dir(args, name: str) -> str:
    return os.path.join(args.out, re.sub(r"[^\w]+", "_", name).strip("_") + ".trace")


def traced(r: dict, trace: str) -> None:
    """What a variant's traced run shows: bubble, waiting, step time (all from its trace)."""
    r["trace"], r["bubble"], r["recv_share"] = trace, measured_bubble(trace), receive_share(trace)
    r["traced_step_time"] = traced_step_time(trace)


def main(args):
    """Every run of the mode the flags ask for, one after another, under a progress bar (a tick per run)."""
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        fail(f"--out {args.out}: cannot create it ({e.strerror}); give another --out")
    runs = planned_runs(args)
    print(f"benchmark: {runs} training runs, one at a time (each starts its processes, then trains); the bar's "
          "time left is estimated from the runs done" + ("; the --budget search's 2 a variant may become more or "
                                                         "fewer" if args.seq_chunks > 1 and args.budget else ""),
          file=sys.stderr, flush=True)
    with tqdm.tqdm(total=runs, unit="run", file=sys.stderr) as bar:
        PROGRESS["bar"] = bar
        try:
            compare(args)
        finally:
            PROGRESS["bar"] = None


def compare(args):
    for path in outputs(args):  # an earlier run's traces (--force; check_out saw they are ours): a stale
        if path.endswith(".trace") and os.path.isdir(path):  # rank file would be read with the new ones
            shutil.rmtree(path)
    p, m = args.ranks, args.microbatches
    with tempfile.TemporaryDirectory() as workdir:
        if args.sweep:
            return sweep(args, workdir)
        if args.dp > 1:
            return data_parallel(args, workdir)
        if args.tp > 1:
            return sequence_parallel(args, workdir)
        if args.splits:
            return splits(args, workdir)
        if args.documents:
            return documents(args, workdir)
        if args.seq_chunks > 1:
            return seq_chunks(args, workdir)
        if args.vocab_parallel:
            return vocab_parallel(args, workdir)
        variants = timed_variants(args)
        results = {name: {"step_times": []} for name in variants}
        for repeat in range(args.repeats):
            for name, (script, schedule) in variants.items():
                last = repeat == args.repeats - 1
                trace = trace_dir(args, name)
                summary, _ = run(args, script, schedule, args.steps, workdir,
                                 extra=["--trace", trace] if last else [])
                r = results[name]
                r["step_times"].append(summary["median_step_time"])
                r["tokens_per_s"] = summary["tokens_per_s"]
                if last:
                    traced(r, trace)
                timed(args, repeat, name, summary)
        for name, (script, schedule) in variants.items():
            results[name]["activation_bytes_per_rank"] = memory(args, script, schedule, workdir)[0][
                "activation_bytes_per_rank"]

    base = statistics.median(results["gpipe"]["step_times"])
    gpipe_act = results["gpipe"]["activation_bytes_per_rank"][0]
    lines = [f"{p} ranks, {m} microbatches, batch {args.batch_size} x {args.seq_len} tokens, {args.repeats} "
             f"alternating runs of {args.steps} steps per variant (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', '1')}). GPipe's theoretical bubble (p-1)/(m+p-1) = "
             f"{(p - 1) / (m + p - 1):.1%}. Bubble and waiting from the last run's trace (its last 3 steps).", "",
             "| variant | median step (ms) | vs gpipe | tokens/s | bubble (measured) | waiting in receives "
             "| peak activations per rank (MiB) | stage 0 vs gpipe |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes_per_rank"])
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['bubble']:.1%} | {r['recv_share']:.1%} | {mib} | "
                     f"{r['activation_bytes_per_rank'][0] / gpipe_act:.2f} |")
        picture = os.path.join(args.out, os.path.basename(r["trace"]).removesuffix(".trace") + ".png")
        if draw(r["trace"], picture, name):
            r["picture"] = picture
    if not any("picture" in r for r in results.values()):  # draw() found no matplotlib
        print("benchmark: no timeline pictures: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr, flush=True)
    gpipe = results["gpipe"]  # step, t_f and t_b all from the one traced run
    ideal, step = ideal_gpipe_step(gpipe["trace"], p, m), gpipe["traced_step_time"]
    lines += ["", f"GPipe step vs the bubble-limited ideal (m + p - 1) x (t_f + t_b) of the slowest stage, "
                  f"timed in the same run: {step * 1e3:.1f} ms / {ideal * 1e3:.1f} ms = {step / ideal:.2f}"]
    bound = unequal_stages_bound(gpipe["trace"], m)
    lines.append(f"Against the tighter bound for unequal stages, sum of t_f + t_b + (m - 1) x the slowest's: "
                 f"{step * 1e3:.1f} ms / {bound * 1e3:.1f} ms = {step / bound:.2f}")
    for name in ("gpipe", "1f1b"):  # plan.py's replay, fed the stage times of the same traced run
        if name in results:
            replay = replayed(results[name]["trace"], name, m)
            results[name]["replay"] = replay
            lines.append(f"{name}: plan.py's replay of its order with this run's stage times: step "
                         f"{replay['step'] * 1e3:.1f} ms (traced {results[name]['traced_step_time'] * 1e3:.1f} ms, "
                         f"{results[name]['traced_step_time'] / replay['step']:.2f} x), bubble "
                         f"{replay['bubble']:.1%} "
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
            trace = trace_dir(args, f"sweep_m{m}")
            summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, microbatches=m,
                             extra=["--trace", trace] if last else [])
            times.setdefault(m, []).append(summary["median_step_time"])
            if last:
                bounds[m] = (traced_step_time(trace), unequal_stages_bound(trace, m), measured_bubble(trace))
            timed(args, repeat, f"m={m}", summary)
    top = max(times)
    ref = statistics.median(times[top]) / ((top + p - 1) / top)
    lines = [f"GPipe, {p} ranks, batch {args.batch_size} x {args.seq_len}: step time vs microbatches m. Model: "
             f"T(m) = T_work x (m + p - 1) / m (bubble (p-1)/(m+p-1)), T_work fitted at m = {top}. Bound: "
             f"sum of the stages' t_f + t_b + (m - 1) x the slowest's, timed in the last run at each m (traced: its "
             "last 3 steps).", "",
             "| m | bubble (p-1)/(m+p-1) | measured step (ms) | model (ms) | measured / model "
             "| traced step (ms) | bound (ms) | traced / bound | bubble (traced) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, t in times.items():
        measured, predicted = statistics.median(t), ref * (m + p - 1) / m
        traced_step, bound, bubble = bounds[m]
        lines.append(f"| {m} | {(p - 1) / (m + p - 1):.1%} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
                     f"{measured / predicted:.2f} | {traced_step * 1e3:.1f} | {bound * 1e3:.1f} | "
                     f"{traced_step / bound:.2f} | {bubble:.1%} |")
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
            results[name]["tokens_per_s"] = summary["tokens_per_s"]
            timed(args, repeat, name, summary)
    for name, (ranks, extra) in layouts.items():  # untimed: what each rank holds
        results[name]["memory"], _ = memory(args, "train_pipeline_gpipe.py", "gpipe", workdir, extra=extra,
                                            ranks=ranks)
    base = statistics.median(results[f"{p} stages"]["step_times"])
    lines = [f"GPipe, {p} stages, batch {args.batch_size} x {args.seq_len} (global), {args.microbatches} "
             f"microbatches per replica, {args.repeats} alternating runs of {args.steps} steps; {os.cpu_count()} CPU "
             "cores shared by all processes.", "",
             "| layout | processes | median step (ms) | vs no replicas | tokens/s | params per rank (MiB) "
             "| grads per rank (MiB) | AdamW state per rank (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        held = [", ".join(f"{b / 2**20:.2f}" for b in r["memory"][f"{kind}_bytes_per_rank"])
                for kind in ("param", "grad", "optimizer")]
        lines.append(f"| {name} | {layouts[name][0]} | {median * 1e3:.1f} | {median / base:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {' | '.join(held)} |")
    finish(args, "\n".join(lines), results, name="data_parallel")


def sequence_parallel(args, workdir):
    """--ranks stages x --tp tensor-parallel ranks, with and without sequence parallelism, alternating: step
    time, the bytes each rank sends to other stages a step and the activations it holds (measure-memory)."""
    layouts = {"sequence parallel": ["--tp", str(args.tp)],
               "no sequence parallel": ["--tp", str(args.tp), "--no-sequence-parallel"]}
    results = {name: {"step_times": []} for name in layouts}
    ranks = args.ranks * args.tp
    for repeat in range(args.repeats):
        for name, extra in layouts.items():
            summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, extra=extra, ranks=ranks)
            results[name]["step_times"].append(summary["median_step_time"])
            timed(args, repeat, name, summary)
    for name, extra in layouts.items():  # untimed: what each rank holds and sends
        results[name]["memory"], _ = memory(args, "train_pipeline_gpipe.py", "gpipe", workdir, extra=extra,
                                            ranks=ranks)
        results[name]["sent_bytes_per_rank"] = results[name]["memory"]["sent_bytes_per_rank"]
    base = statistics.median(results["no sequence parallel"]["step_times"])
    lines = [f"GPipe, {args.ranks} stages x tp {args.tp} ({ranks} processes), batch {args.batch_size} x "
             f"{args.seq_len}, {args.microbatches} microbatches, {args.repeats} alternating runs of {args.steps} "
             f"steps; {os.cpu_count()} CPU cores shared by all processes.", "",
             "| variant | median step (ms) | vs no sequence parallel | sent to other stages a step per rank (MiB) "
             "| peak activations per rank (MiB) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        sent, held = (", ".join(f"{b / 2**20:.3g}" for b in values) for values in (
            r["sent_bytes_per_rank"], r["memory"]["activation_bytes_per_rank"]))
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {sent} | {held} |")
    finish(args, "\n".join(lines), results, name="sequence_parallel")


def splits(args, workdir):
    """One process holding the whole model, then --ranks stages cut evenly and balanced by estimated cost; then
    the balanced split with activation checkpointing and with --compile; all GPipe, alternating run after run.
    Speedup over one process, as a fraction of the ideal p m / (m + p - 1)."""
    p, m = args.ranks, args.microbatches
    variants = {name: (ranks or p, extra) for name, (ranks, extra) in chosen(SPLITS, "one process",
                                                                             args.variants).items()}
    results = {name: {"step_times": []} for name in variants}
    for repeat in range(args.repeats):
        for name, (ranks, extra) in variants.items():
            trace = trace_dir(args, name)
            last = repeat == args.repeats - 1 and ranks > 1  # the last run: each stage's own times
            summary, stdout = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, ranks=ranks,
                                  extra=[*extra, *(["--trace", trace] if last else [])])
            results[name]["step_times"].append(summary["median_step_time"])
            if last:
                traced(results[name], trace)
            timed(args, repeat, name, summary)
    for name, (ranks, extra) in variants.items():  # untimed: the saved-tensor hooks slow a step down
        measured, stdout = memory(args, "train_pipeline_gpipe.py", "gpipe", workdir, extra=extra, ranks=ranks)
        results[name]["activation_bytes_per_rank"] = measured["activation_bytes_per_rank"]
        results[name]["layout"] = next((found.group(1) for line in stdout.splitlines()
                                        if (found := re.search(r"(\[embed .*\]) \|", line))), "")
    one = statistics.median(results["one process"]["step_times"])
    ideal = p * m / (m + p - 1)
    lines = [f"GPipe, {m} microbatches, batch {args.batch_size} x {args.seq_len}, {args.repeats} alternating runs of "
             f"{args.steps} steps (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}); ideal speedup of "
             f"{p} stages over one process p m / (m + p - 1) = {ideal:.2f}.", "",
             "| variant | median step (ms) | speedup over one process | fraction of the ideal | stage t_f + t_b per "
             "microbatch (ms, traced) | bubble (traced) | peak activations per rank (MiB) | layout |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        speedup = one / median
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes_per_rank"])
        stage_ms = ", ".join(f"{t * 1e3:.1f}" for t in stage_times(r["trace"])) if "trace" in r else "-"
        bubble = f"{r['bubble']:.1%}" if "trace" in r else "-"
        lines.append(f"| {name} | {median * 1e3:.1f} | {speedup:.2f} | "
                     f"{speedup / ideal if name != 'one process' else 1 / ideal:.2f} | {stage_ms} | {bubble} | "
                     f"{mib} | {r['layout']} |")
    lines.append("")
    for name, r in results.items():  # plan.py's replay of GPipe's order, fed the stage times of the traced run
        if "trace" in r:
            replay, step = replayed(r["trace"], "gpipe", m)["step"], r["traced_step_time"]
            lines.append(f"{name}: plan.py's replay with the traced run's stage times: step {replay * 1e3:.1f} ms "
                         f"(traced {step * 1e3:.1f} ms, {step / replay:.2f} x)")
    finish(args, "\n".join(lines), results, name="splits")


def documents(args, workdir):
    """GPipe at --ranks with --document-masking (attention within each packed document: on a GPU FlexAttention,
    on the CPU SDPA with a dense mask) and without (causal over the window), alternating: step time and the peak
    memory each rank reports (a GPU's allocated bytes; the CPU's resident set)."""
    variants = {"causal": [], "document masking": ["--document-masking"]}
    results = {name: {"step_times": []} for name in variants}
    for repeat in range(args.repeats):
        for name, extra in variants.items():
            summary, _ = run(args, "train_pipeline_gpipe.py", "gpipe", args.steps, workdir, extra=extra)
            results[name]["step_times"].append(summary["median_step_time"])
            results[name]["tokens_per_s"] = summary["tokens_per_s"]
            results[name]["peak_memory_bytes_per_rank"] = summary["peak_memory_bytes_per_rank"]
            timed(args, repeat, name, summary)
    base = statistics.median(results["causal"]["step_times"])
    lines = [f"GPipe, {args.ranks} rank(s), batch {args.batch_size} x {args.seq_len}, {args.microbatches} "
             f"microbatches, {args.repeats} alternating runs of {args.steps} steps (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', '1')}); flags for every run: {' '.join(args.script_args) or '-'}.",
             "", "| attention | median step (ms) | vs causal | tokens/s | peak memory per rank (MiB) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        peaks = ", ".join(f"{b / 2**20:.0f}" for b in r["peak_memory_bytes_per_rank"])
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {r['tokens_per_s']:.0f} | {peaks} |")
    finish(args, "\n".join(lines), results, name="documents")


def vocab_parallel(args, workdir):
    """The hand-written 1F1B at --ranks with and without --vocab-parallel (the embedding, the head and the loss by
    vocabulary rows on every rank), alternating: step time; each rank's share of the step's work from the last
    run's trace; the bytes of parameters, gradients, AdamW state and activations each rank holds (measure-memory),
    and the activations plan.py plans for it."""
    variants = {"1f1b (by hand)": [], "1f1b (by hand) --vocab-parallel": ["--vocab-parallel"]}
    results = {name: {"step_times": []} for name in variants}
    for repeat in range(args.repeats):
        for name, extra in variants.items():
            last = repeat == args.repeats - 1
            trace = trace_dir(args, name)
            summary, _ = run(args, "train_pipeline_afab_manual.py", "1f1b", args.steps, workdir,
                             extra=[*extra, "--trace", trace] if last else extra)
            results[name]["step_times"].append(summary["median_step_time"])
            if last:
                traced(results[name], trace)
                busy = [statistics.median(s["busy"] for s in r["steps"]) for r in read_trace(trace).values()]
                results[name]["work_share_per_rank"] = [b / sum(busy) for b in busy]
            timed(args, repeat, name, summary)
    note = ""
    for name, extra in variants.items():  # untimed: what each rank holds, and what plan.py plans it holds
        results[name]["memory"], _ = memory(args, "train_pipeline_afab_manual.py", "1f1b", workdir, extra=extra)
        try:
            results[name]["planned"] = planned(args, args.seq_len, 1, extra)["ranks"]
        except UsageError as e:
            note = f"plan.py: {e}"
    base = statistics.median(results["1f1b (by hand)"]["step_times"])
    lines = [f"The hand-written 1F1B, {args.ranks} ranks, batch {args.batch_size} x {args.seq_len}, "
             f"{args.microbatches} microbatches, {args.repeats} alternating runs of {args.steps} steps (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', '1')}); flags for every run: {' '.join(args.script_args) or '-'}. "
             "Work: each rank's busy time in a traced step, as a share of all ranks'.", "",
             "| variant | median step (ms) | vs without | bubble (measured) | work per rank | params per rank (MiB) "
             "| AdamW state per rank (MiB) | peak activations per rank (MiB) | planned (plan.py) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["median_step_time"] = median = statistics.median(r["step_times"])
        shares = " / ".join(f"{share:.0%}" for share in r["work_share_per_rank"])
        held = [", ".join(f"{b / 2**20:.2f}" for b in r["memory"][f"{kind}_bytes_per_rank"])
                for kind in ("param", "optimizer", "activation")]
        plan_mib = ", ".join(f"{row['activations_flagged'] / 2**20:.2f}" for row in r.get("planned", [])) or "-"
        lines.append(f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {r['bubble']:.1%} | {shares} | "
                     f"{' | '.join(held)} | {plan_mib} |")
    finish(args, "\n".join([*lines, *(["", note] if note else [])]), results, name="vocab_parallel")


PLAN_FLAGS = {"--model": 1, "--layers": 1, "--init-from": 1, "--document-masking": 0, "--device": 1, "--precision": 1,
              "--split": 1, "--activation-checkpointing": 1, "--loss-chunks": 1, "--tp": 1, "--dp": 1}


def planned(args, seq_len: int, chunks: int, extra=()) -> dict:
    """plan.py's plan of a 1F1B run of these flags at seq_len tokens in `chunks` chunks (its report, what it prints
    left out); given the flags after -- that plan.py shares with the scripts, and extra (such as --vocab-parallel).
    A UsageError where plan.py (or the scripts) refuses them, such as a --seq-len beyond the model's positions."""
    argv, rest = [], list(args.script_args)
    while rest:
        flag, _, value = rest.pop(0).partition("=")
        if flag in PLAN_FLAGS:  # (a value, unless the next word is a flag: --activation-checkpointing alone is full)
            if not value and PLAN_FLAGS[flag] and rest and not rest[0].startswith("--"):
                value = rest.pop(0)
            argv += [flag, *([value] if value else [])]
    if "--device" not in argv:
        argv += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    plan_args = plan.build_parser().parse_args(
        ["--processes", str(args.ranks), "--seq-len", str(seq_len), "--batch-size", str(args.batch_size),
         "--microbatches", str(args.microbatches), "--schedule", "1f1b", "--seq-chunks", str(chunks),
         "--data", args.data, *argv, *extra])
    with contextlib.redirect_stdout(io.StringIO()):
        return plan.plan(plan_args)


def longest(args, workdir, name: str, script: str, extra: list, results: dict) -> None:
    """The longest --seq-len, a multiple of 64 S, whose fullest rank holds at most --budget MiB of activations
    (measure-memory): started at plan.py's longest, then a length up while the run fits, or down until it does.
    Each length measured and its plan go into results (the rank's bytes, measured and planned)."""
    quantum, budget, chunks = 64 * args.seq_chunks, args.budget * 2**20, args.seq_chunks if extra else 1
    plans, positions = {}, False  # (the lengths planned end at the model's positions, or at twice the budget)
    for n in itertools.count(1):
        try:
            plans[n * quantum] = max(r["activations_flagged"] for r in planned(args, n * quantum, chunks)["ranks"])
        except UsageError as e:
            if not plans:
                fail(f"--budget: plan.py cannot plan --seq-len {quantum} with these flags: {e}")
            positions = True
            break
        if plans[n * quantum] > 2 * budget:  # far past it (the plan counts within a few %: the page's table)
            break
    lengths = sorted(plans)
    start = max([i for i, length in enumerate(lengths) if plans[length] <= budget] or [0])
    measured = {}

    def fits(i: int) -> bool:
        if lengths[i] not in measured:
            if len(measured) >= 2 and PROGRESS["bar"] is not None:  # a run more than planned_runs counted
                PROGRESS["bar"].total += 1
            held = memory(args, script, "1f1b", workdir, extra=[*extra, "--seq-len", str(lengths[i])])[0]
            measured[lengths[i]] = max(held["activation_bytes_per_rank"])
        return measured[lengths[i]] <= budget
    i = start
    if fits(i):
        while i + 1 < len(lengths) and fits(i + 1):
            i += 1
        best = lengths[i]
    else:
        while i > 0 and not fits(i - 1):
            i -= 1
        best = lengths[i - 1] if i > 0 else None
    results[name]["longest"] = {"seq_len": best, "planned_seq_len": lengths[start] if plans[lengths[start]] <= budget
                                else None, "measured": measured, "planned": {n: plans[n] for n in measured},
                                "quantum": quantum, "positions": lengths[-1] if positions else None}


def seq_chunks(args, workdir):
    """1F1B on whole sequences against each sequence in --seq-chunks S chunks (Seq1F1B), in the gpipe script and
    by hand (even, and of equal compute), alternating: step time, the bubble traced and planned, the activations
    measured (measure-memory) and planned (plan.py); with --budget, the longest --seq-len within it, whole and in
    chunks (the gpipe script's). The timed runs are not traced; a run more per variant is, for its bubble."""
    S, p, m = args.seq_chunks, args.ranks, args.microbatches
    variants = chosen(seq_chunk_variants(S), "1f1b", args.variants)
    results = {name: {"step_times": []} for name in variants}
    note = ""
    try:  # before the runs: the search needs the plan
        plans = {chunks: planned(args, args.seq_len, chunks) for chunks in (1, S)}
    except UsageError as e:
        if args.budget:
            fail(f"--budget: plan.py cannot plan these flags, where the search starts: {e}")
        plans, note = {}, f"plan.py: {e}"
    for repeat in range(args.repeats):  # untraced: the profiler's cost grows with the microbatches, S times more
        for name, (script, extra) in variants.items():
            summary, _ = run(args, script, "1f1b", args.steps, workdir, extra=extra)
            results[name]["step_times"].append(summary["median_step_time"])
            results[name]["tokens_per_s"] = summary["tokens_per_s"]
            timed(args, repeat, name, summary)
    for name, (script, extra) in variants.items():  # untimed: the bubble, from a trace
        trace = trace_dir(args, name)
        run(args, script, "1f1b", max(args.steps, 3), workdir, extra=[*extra, "--trace", trace])
        traced(results[name], trace)
    for name, (script, extra) in variants.items():  # untimed: the saved-tensor hooks slow a step down
        r = results[name]
        r["activation_bytes_per_rank"] = memory(args, script, "1f1b", workdir, extra=extra)[0][
            "activation_bytes_per_rank"]
        if "compute" not in extra and plans:  # (plan.py plans even chunks)
            plan_report = plans[S if extra else 1]
            r["planned_activation_bytes_per_rank"] = [rank["activations_flagged"] for rank in plan_report["ranks"]]
            r["planned"] = plan_report["schedules"][f"1f1b --seq-chunks {S}" if extra else "1f1b"]
    if args.budget:
        for name, (script, extra) in variants.items():
            if script == "train_pipeline_gpipe.py":
                longest(args, workdir, name, script, extra, results)
        if PROGRESS["bar"] is not None:  # the search took as many runs as it took: the bar ends at them
            PROGRESS["bar"].total = PROGRESS["bar"].n
            PROGRESS["bar"].refresh()
    lines = [f"1F1B, {p} ranks, {m} microbatches, batch {args.batch_size} x {args.seq_len} tokens, each sequence "
             f"whole or in {S} chunks (--seq-chunks), {args.repeats} alternating runs of {args.steps} steps per "
             f"variant (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}); flags for every run: "
             f"{' '.join(args.script_args) or '-'}; the step times of untraced runs. Bubble with equal chunk costs: "
             f"whole (p-1)/(m+p-1) = "
             f"{(p - 1) / (m + p - 1):.1%}, in chunks (p-1)/(S m+p-1) = {(p - 1) / (S * m + p - 1):.1%}; plan.py's "
             "bubble and step with each chunk's own cost (attention grows with the prefix); traced: a run more per "
             "variant, its last 3 steps.", "",
             "| variant | median step (ms) | vs whole (its script's, else 1f1b) | plan.py's step vs whole | tokens/s "
             "| bubble (traced) | bubble (plan.py) | activations per rank (MiB), measured | planned (plan.py) "
             "| rank 0 vs whole |", "|---|---|---|---|---|---|---|---|---|---|"]
    whole = {script: results[name] for name, (script, extra) in variants.items() if not extra}
    for name, (script, extra) in variants.items():
        r = results[name]
        r["median_step_time"] = median = statistics.median(r["step_times"])
        base = whole.get(script, results["1f1b"])
        ratio = f"{median / statistics.median(base['step_times']):.2f}"
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes_per_rank"])
        plan_mib = ", ".join(f"{b / 2**20:.1f}" for b in r.get("planned_activation_bytes_per_rank", [])) or "-"
        plan_ratio = (f"{r['planned']['step'] / results['1f1b']['planned']['step']:.2f}" if "planned" in r
                      and "planned" in results["1f1b"] else "-")
        held = f"{r['activation_bytes_per_rank'][0] / base['activation_bytes_per_rank'][0]:.2f}"
        plan_bubble = f"{r['planned']['bubble']:.1%}" if "planned" in r else "-"
        lines.append(f"| {name} | {median * 1e3:.1f} | {ratio} | {plan_ratio} | {r['tokens_per_s']:.0f} | "
                     f"{r['bubble']:.1%} | {plan_bubble} | {mib} | {plan_mib} | {held} |")
    searched = {name: r["longest"] for name, r in results.items() if "longest" in r}
    if searched:
        quantum = next(iter(searched.values()))["quantum"]
        lines += ["", f"The longest --seq-len (a multiple of {quantum}, up to the model's positions) whose fullest "
                      f"rank holds at most {args.budget:g} MiB of activations (--budget; measure-memory runs, "
                      "started at plan.py's longest):", "",
                  "| variant | longest --seq-len | plan.py's longest | runs | --seq-len: measured / planned (MiB) |",
                  "|---|---|---|---|---|"]
        for name, found in searched.items():
            each = "; ".join(f"{n}: {found['measured'][n] / 2**20:.1f} / {found['planned'][n] / 2**20:.1f}"
                             for n in sorted(found["measured"]))
            top = " (the model's positions)" * (found["seq_len"] == found["positions"])
            lines.append(f"| {name} | {found['seq_len'] or 'none'}{top} | {found['planned_seq_len'] or 'none'} | "
                         f"{len(found['measured'])} | {each} |")
    finish(args, "\n".join([*lines, *(["", note] if note else [])]), results, name="seq_chunks")


def chosen(variants: dict, reference: str, asked: str | None) -> dict:
    """The variants --variants names, and the reference every ratio is taken against (it always runs)."""
    if not asked:
        return variants
    return {k: v for k, v in variants.items() if k in {reference, *asked.split(",")}}


def timed_variants(args) -> dict:
    """The default mode's variants: those of VARIANTS --variants names (gpipe always), then each FILE.csv it names,
    an order run as train_pipeline_gpipe.py --schedule FILE.csv (its path made absolute: the runs start in a
    folder of their own)."""
    files = [v for v in (args.variants or "").split(",") if v.endswith(".csv")]
    return {**chosen(VARIANTS, "gpipe", args.variants),
            **{v: ("train_pipeline_gpipe.py", os.path.abspath(v)) for v in files}}


def finish(args, table: str, results: dict, name: str = "results") -> None:
    print(table)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    # The table again in the JSON: how a later --force tells the .md beside it for this file's own.
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"config": vars(args), "results": results, "table": table}, f, indent=1)


def outputs(args) -> list[str]:
    """What main() writes into --out with these flags: the table and its JSON; the trace folder of each traced
    variant, and in the default mode its picture."""
    if args.sweep:
        name, traced_names = "sweep", [f"sweep_m{m}" for m in args.sweep_microbatches]
    elif args.dp > 1:
        name, traced_names = "data_parallel", []
    elif args.tp > 1:
        name, traced_names = "sequence_parallel", []
    elif args.splits:
        name, traced_names = "splits", [variant for variant, (ranks, _) in chosen(SPLITS, "one process",
                                                                                  args.variants).items()
                                        if (ranks or args.ranks) > 1]
    elif args.documents:
        name, traced_names = "documents", []
    elif args.vocab_parallel:
        name, traced_names = "vocab_parallel", ["1f1b (by hand)", "1f1b (by hand) --vocab-parallel"]
    elif args.seq_chunks > 1:
        name, traced_names = "seq_chunks", list(chosen(seq_chunk_variants(args.seq_chunks), "1f1b", args.variants))
    else:
        name, traced_names = "results", list(timed_variants(args))
    traces = [trace_dir(args, variant) for variant in traced_names]
    pictures = [trace.removesuffix(".trace") + ".png" for trace in traces] if name == "results" else []
    return [os.path.join(args.out, f"{name}.md"), os.path.join(args.out, f"{name}.json"), *traces, *pictures]


def written_here(path: str) -> bool:
    """Whether a path in --out is benchmark.py's own output: a trace folder (rank{R}.json files only, what the
    scripts' --trace writes), a results JSON that finish() wrote, or the table or a picture that JSON records."""
    if os.path.islink(path):  # writing through a link would change a file elsewhere
        return False
    folder, name = os.path.split(path)
    if name.endswith(".trace"):
        return os.path.isdir(path) and all(re.fullmatch(r"rank\d+\.json", f) for f in os.listdir(path))
    try:
        with open(os.path.join(folder, "results.json" if name.endswith(".png") else
                               name.removesuffix(".md").removesuffix(".json") + ".json")) as f:
            record = json.load(f)
        with open(path, "rb") as f:
            content = f.read()
    except (OSError, ValueError):
        return False
    if not (isinstance(record, dict) and {"config", "results", "table"} <= record.keys()
            and isinstance(record["results"], dict)):
        return False
    if name.endswith(".md"):
        return content == (str(record["table"]) + "\n").encode()
    if name.endswith(".png"):
        return any(isinstance(r, dict) and os.path.basename(str(r.get("picture"))) == name
                   for r in record["results"].values())
    return True


def check_out(args) -> None:
    """Refuse an --out that is no folder, one with files of someone else's where this run writes (written_here),
    and one with an earlier run's results unless --force."""
    def listed(paths):
        return ", ".join(os.path.basename(p) for p in paths[:3]) + (f" and {len(paths) - 3} more"
                                                                    if len(paths) > 3 else "")
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        fail(f"--out {args.out}: not a folder; give a folder (it is created if missing)")
    taken = [path for path in outputs(args) if os.path.lexists(path)]
    if foreign := [path for path in taken if not written_here(path)]:
        fail(f"--out {args.out}: holds {listed(foreign)}, not written by benchmark.py, where this run writes; "
             "move them away or give another --out")
    if taken and not args.force:
        fail(f"--out {args.out}: holds {listed(taken)} from an earlier run; add --force to replace them, or give "
             "another --out")


def fail(message: str) -> None:
    """A mistake in the flags: one line, exit status 1, as the training scripts say theirs."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="benchmark.py", description=__doc__)
    parser.add_argument("--ranks", type=whole(1), default=2, help="processes per run (default: %(default)s)")
    parser.add_argument("--microbatches", type=whole(1), default=8, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=whole(1), default=16, help="(default: %(default)s)")
    parser.add_argument("--seq-len", type=whole(1), default=128, help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="steps per timed run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (default: %(default)s)")
    parser.add_argument("--data", default="data",
                        help="data prepared by prepare_data.py, read by every run (default: %(default)s)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of (gpipe always runs): " + ", ".join(VARIANTS) + ", and any "
                             "FILE.csv (an order run by train_pipeline_gpipe.py --schedule FILE.csv); with "
                             "--splits (one process always runs): " + ", ".join(SPLITS) + "; with --seq-chunks S "
                             "(1f1b always runs): " + ", ".join(seq_chunk_variants(0)).replace("0", "S") +
                             " (default: all)")
    parser.add_argument("--sweep", action="store_true", help="time GPipe against the microbatch count instead")
    parser.add_argument("--sweep-microbatches", default="1,2,4,8,16",
                        help="the microbatch counts --sweep runs (default: %(default)s)")
    parser.add_argument("--splits", action="store_true",
                        help="compare one process with --ranks stages split evenly and balanced by cost, and the "
                             "cost of activation checkpointing and --compile, instead")
    parser.add_argument("--documents", action="store_true",
                        help="compare --document-masking with causal attention (GPipe at --ranks) instead: step "
                             "time and peak memory")
    parser.add_argument("--dp", type=int, default=1,
                        help="compare --ranks stages alone with --ranks stages x DP data-parallel replicas "
                             "(FSDP2) at the same global batch instead")
    parser.add_argument("--tp", type=int, default=1,
                        help="compare --ranks stages x TP tensor-parallel ranks with and without sequence "
                             "parallelism instead")
    parser.add_argument("--seq-chunks", type=whole(1), default=1,
                        help="compare 1F1B on whole sequences with each sequence in this many chunks (Seq1F1B: even, "
                             "and of equal compute by hand) instead; 1: not this mode (default: %(default)s)")
    parser.add_argument("--budget", type=number(positive=False), default=0, metavar="MIB",
                        help="with --seq-chunks: also the longest --seq-len whose fullest rank holds at most MIB of "
                             "activations, whole and in chunks (measure-memory runs); 0: none (default: %(default)s)")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="compare the hand-written 1F1B with and without --vocab-parallel instead: step time, "
                             "each rank's share of the work, what each rank holds")
    parser.add_argument("--out", default="bench", help="output folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="replace the results of an earlier run in --out (only what benchmark.py wrote)")
    parser.add_argument("script_args", nargs="*", help="more flags for every run, after --")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Every run's first step is left out of its median: a run needs a second step.
    if args.repeats < 1 or args.steps < 2 or args.dp < 1 or args.tp < 1:
        parser.error("--repeats, --dp and --tp must be at least 1 and --steps at least 2")
    try:
        args.sweep_microbatches = [int(m) for m in args.sweep_microbatches.split(",")]
    except ValueError:
        parser.error(f"--sweep-microbatches: {args.sweep_microbatches!r} is not a comma-separated list of counts")
    if min(args.sweep_microbatches) < 1:
        parser.error(f"--sweep-microbatches {','.join(map(str, args.sweep_microbatches))}: each count must be at "
                     "least 1")
    if args.budget and args.seq_chunks == 1:
        parser.error(f"--budget {args.budget:g}: give --seq-chunks S too (the search compares whole sequences with "
                     "chunks)")
    if args.seq_chunks > 1:
        try:  # the scripts' own check, before the runs: even chunks
            model.chunk_lengths(args.seq_len, args.seq_chunks, None)
        except ValueError as e:
            parser.error(str(e))
    chunked = args.seq_chunks > 1 and not args.splits
    known = SPLITS if args.splits else seq_chunk_variants(args.seq_chunks) if chunked else VARIANTS
    asked = set(args.variants.split(",")) if args.variants else set()
    files = set() if args.splits or chunked else {v for v in asked if v.endswith(".csv")}
    if unknown := asked - files - set(known):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}"
                     f"{'' if args.splits or chunked else ', or a FILE.csv'}")
    if missing := sorted(v for v in files if not os.path.isfile(v)):
        parser.error(f"--variants {missing[0]}: no such file; write an order there with plan.py --write-schedule "
                     f"{missing[0]}, or give the path of one")
    if not os.path.isfile(os.path.join(args.data, "meta.json")):  # as the scripts say it: one line, exit 1
        fail(f"--data {args.data}: no data prepared there; run python prepare_data.py"
             f"{'' if args.data == 'data' else ' --out ' + args.data} first (see its --help)")
    args.data, args.out = os.path.abspath(args.data), os.path.abspath(args.out)  # the runs start elsewhere
    check_out(args)  # before the runs, which take minutes
    return args


# ----------------------------------------------------------------------------------------------------------
# gpu-check: what one GPU can check (several NCCL ranks need several GPUs: those are checked on the CPU under
# NCCL's rules, nccl_rules.py)

GPU_PEAK_PROBE = """import os, runpy, sys, torch
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # the script's folder, as python SCRIPT has it
def probe(name):  # torch.cuda's peak at the optimizer's creation: the stage built, nothing trained yet
    original = getattr(torch.optim, name)
    def make(*args, **kwargs):
        print(f"startup peak bytes {torch.cuda.max_memory_allocated()}", file=sys.stderr, flush=True)
        return original(*args, **kwargs)
    setattr(torch.optim, name, make)
probe("AdamW")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# A peer that never answers, as one process can have it: the clipping's all-reduce issued behind a kernel that
# spins for minutes (torch.cuda._sleep), as a call waits for a peer that died or hangs. The kernel goes in just
# before the call. Put at clipping's start instead, it was never seen by the watchdog on one H100 (no line, no end
# in 170 s): the host blocked somewhere before issuing the all-reduce (not found which op); a program issuing the
# all-reduce right after the kernel was ended by the watchdog (docs/measured.md). (A receive from this very rank
# with no send to meet it is no stand-in: NCCL 2.28 fails it at once.)
GPU_HANG_PROBE = """import os, runpy, sys, torch
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # the script's folder, as python SCRIPT has it
import torch.distributed as dist
original = dist.all_reduce
def all_reduce(tensor, *args, **kwargs):
    if tensor.dtype == torch.float64:  # clip_grad_norm_'s sum of squares
        torch.cuda._sleep(2 ** 40)  # cycles: about 10 minutes
    return original(tensor, *args, **kwargs)
dist.all_reduce = all_reduce
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# What NCCL's watchdog writes when a call outlives the group's timeout (ProcessGroupNCCL's watchdog; the scripts'
# --timeout), e.g. "[rank0]:[E1129 ... ProcessGroupNCCL.cpp:...] [Rank 0] Watchdog caught collective operation
# timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=20000) ran for 20092
# milliseconds before timing out." (docs/launching.md, measured on an H100).
WATCHDOG_LINE = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\((?P<work>.*?)\) ran for "
                           r"\d+ milliseconds before timing out")


class _PlainPickle(pickle.Unpickler):
    """A flight recorder's dump holds dicts, lists, strings and numbers: anything else (a class) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}: not in a flight recorder's dump")


def hang_verdict(status: int | None, stderr: str, dump: str) -> str | None:
    """None when gpu-check's hang run ended as a call that never completes ends under NCCL: by itself (not killed
    at gpu-check's deadline, -9), with the watchdog's line for the probe's all-reduce (OpType=ALLREDUCE) in its
    stderr and the flight recorder's dump of the rank (dump: CKPT/nccl-trace-rank0, checkpoint.flight_recorder)
    holding that all-reduce not completed; else what is missing, in a few words. Any other failure (a traceback,
    the scripts' own line) is no such end."""
    if status in (None, -9):
        return "did not end by itself (killed at gpu-check's deadline)"
    if status == 0:
        return "completed: the held call never waited"
    line = next((m for m in WATCHDOG_LINE.finditer(stderr) if "OpType=ALLREDUCE" in m["work"]), None)
    if line is None:
        return f"exited {status} without the watchdog's line for the all-reduce"
    try:
        with open(dump, "rb") as f:
            entries = _PlainPickle(f).load()["entries"]
    except (OSError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as e:
        return f"no flight recorder dump at {dump} ({e})"
    if not any(e.get("profiling_name", "").endswith(":all_reduce") and e.get("state") != "completed"
               for e in entries):
        return f"the flight recorder's dump ({len(entries)} calls) holds no all-reduce left uncompleted"
    return None


def gpu_check(argv: list[str]) -> None:
    """benchmark.py gpu-check [--out DIR] [--data DIR]: every feature one GPU can run, each a real run of a script
    (NCCL at one process), checked and timed; the table to OUT/gpu-check.md, the numbers to OUT/gpu-check.json."""
    p = Parser(prog="benchmark.py gpu-check", description=gpu_check.__doc__)
    p.add_argument("--out", default="gpu-check", help="output folder (default: %(default)s)")
    p.add_argument("--data", default="data", help="data prepared by prepare_data.py (default: %(default)s)")
    p.add_argument("--model", default="small", help="of the checks (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="the checks only, not the llama-1b timings")
    p.add_argument("--budget", type=float, default=600, help="seconds: no timed run starts after (default: 600)")
    p.add_argument("--only", help="comma-separated: of schedules, scripts, documents, trace, hang, compile, "
                   "resume, timings (or one of them: llama-1b, llama-1b-documents, llama-1b-8192, "
                   "llama-1b-8192-documents) (default: all)")
    args = p.parse_args(argv)
    names = {"schedules", "scripts", "documents", "trace", "hang", "compile", "resume", "timings", "llama-1b",
             "llama-1b-documents", "llama-1b-8192", "llama-1b-8192-documents"}
    if args.only and (unknown := set(args.only.split(",")) - names):
        fail(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(sorted(names))}")
    if not torch.cuda.is_available():
        fail("gpu-check: no GPU is visible; it runs on a machine with one (the CPU checks are pytest's)")
    if not os.path.isfile(os.path.join(args.data, "meta.json")):
        fail(f"--data {args.data}: no data prepared there; run python prepare_data.py first (see its --help)")
    out, data = os.path.abspath(args.out), os.path.abspath(args.data)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
    small = ["--model", args.model, "--layers", "4", "--seq-len", "256", "--batch-size", "8", "--microbatches", "4",
             "--warmup-steps", "2", "--data", data]

    def start(name, script, *flags, probe=None, timeout=300, again=False, environ=None):
        """A run in OUT/NAME (again: where it ran before): python SCRIPT FLAGS, under a probe (GPU_PEAK_PROBE or
        GPU_HANG_PROBE) or not; environ: variables of its own."""
        workdir = os.path.join(out, name)
        if not again:
            shutil.rmtree(workdir, ignore_errors=True)
            os.makedirs(workdir)
        cmd = [sys.executable, *(["-c", probe] if probe else []), os.path.join(ROOT, script), *flags,
               "--metrics", "m.jsonl", "--checkpoint-dir", "ckpt"]
        proc = subprocess.Popen(cmd, cwd=workdir, env=dict(env, **(environ or {})),
                                stdout=open(os.path.join(workdir, "out"), "w"),
                                stderr=open(os.path.join(workdir, "err"), "w"), start_new_session=True)
        proc.name, proc.workdir, proc.started, proc.deadline = name, workdir, time.monotonic(), timeout
        return proc

    def finish(proc) -> dict:
        try:
            proc.wait(timeout=proc.deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        text = lambda f: open(os.path.join(proc.workdir, f)).read()  # noqa: E731
        rows = [json.loads(line) for line in text("m.jsonl").splitlines()] if os.path.exists(
            os.path.join(proc.workdir, "m.jsonl")) else []
        return {"status": proc.returncode, "seconds": round(time.monotonic() - proc.started, 1),
                "losses": [r["loss"] for r in rows if "step" in r], "summary": next(
                    (r["summary"] for r in rows if "summary" in r), None), "stderr": text("err")[-2500:],
                "stdout": text("out")[-1500:], "command": " ".join(shlex.quote(c) for c in proc.args[-30:])}

    def together(procs) -> dict:
        return {proc.name: finish(proc) for proc in procs}

    began, only = time.monotonic(), set(args.only.split(",")) if args.only else None
    wanted = lambda name: only is None or name in only  # noqa: E731
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    # 1. Checks, several runs at once (their times are not compared): every schedule that fits one process (the
    # looped and V-shaped ones hold 2 stages), the other scripts, --document-masking (FlexAttention), --trace read
    # back by plan.py, a call that never completes, --compile, and a stopped run resumed bit for bit, its saves in
    # the background (torch 2.13; an older torch refuses --async-checkpoint in one line).
    runs = [start(f"schedule-{s}", "train_pipeline_gpipe.py", *small, "--steps", "4", "--schedule", s)
            for s in ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                      "dualpipev") if wanted("schedules")]
    runs += [start("manual-1f1b", "train_pipeline_afab_manual.py", *small, "--steps", "4", "--schedule", "1f1b"),
             start("tracer", "train_pipeline_tracer.py", *small, "--steps", "4")] if wanted("scripts") else []
    runs += [start("documents", "train_pipeline_gpipe.py", *small, "--steps", "4", "--document-masking")
             ] if wanted("documents") else []
    runs += [start("trace", "train_pipeline_gpipe.py", *small, "--steps", "5", "--trace", "t")  # GPipe labels it
             ] if wanted("trace") else []
    hang_dump = os.path.join(out, "hang", "ckpt", "nccl-trace-rank")  # the flight recorder's, whatever the user set
    recorder = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", **{name: "2000" for name in ("TORCH_FR_BUFFER_SIZE",
                                                                              "TORCH_NCCL_TRACE_BUFFER_SIZE")},
                **{name: hang_dump for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}}
    runs += [start("hang", "train_pipeline_gpipe.py", *small, "--steps", "4", "--timeout", "30",
                   probe=GPU_HANG_PROBE, timeout=400, environ=recorder)] if wanted("hang") else []
    runs += [start("compile", "train_pipeline_gpipe.py", *small, "--steps", "4", "--compile")
             ] if wanted("compile") else []
    saves = ["--steps", "8", "--checkpoint-every", "2", *["--async-checkpoint"] * (torch.__version__ >= "2.13")]
    if wanted("resume"):  # the cut one stopped (SIGTERM) once 5 steps are done; the same command goes on from there
        runs += [start("resume-whole", "train_pipeline_gpipe.py", *small, *saves),
                 cut := start("resume-cut", "train_pipeline_gpipe.py", *small, *saves)]
        metrics = os.path.join(cut.workdir, "m.jsonl")
        while cut.poll() is None and (not os.path.exists(metrics) or open(metrics).read().count('"step"') < 5):
            time.sleep(0.1)
        cut.send_signal(signal.SIGTERM)
    checks = results["checks"] = together(runs)
    verdicts = {name: run["status"] == 0 for name, run in checks.items() if name not in ("hang", "resume-cut")}
    if wanted("resume"):
        resumed = results["resumed"] = checks["resume-cut"]["status"] == 0 and finish(start(
            "resume-cut", "train_pipeline_gpipe.py", *small, *saves, again=True))
        verdicts["resume bit for bit"] = bool(resumed) and resumed["losses"] == checks["resume-whole"]["losses"] \
            and len(resumed["losses"]) == 8  # the steps before the stop kept in --metrics, the rest added
    if wanted("trace"):
        planned = subprocess.run([sys.executable, os.path.join(ROOT, "plan.py"), "--processes", "1", "--data", data,
                                  *small[:10], "--trace", os.path.join(out, "trace", "t")],
                                 capture_output=True, text=True, env=env)
        results["plan --trace"] = {"status": planned.returncode, "output": (planned.stdout + planned.stderr)[-2500:]}
        verdicts["plan.py --trace"] = planned.returncode == 0
    if wanted("hang"):  # ends as NCCL's watchdog ends it: its line, the flight recorder's dump (hang_verdict)
        hang = checks["hang"]
        hang["verdict"] = hang_verdict(hang["status"], open(os.path.join(out, "hang", "err")).read(), hang_dump + "0")
        verdicts["a call that never completes ends"] = hang["verdict"] is None
    with open(os.path.join(out, "gpu-check.json"), "w") as f:  # so far: kept if what follows fails
        json.dump(results, f, indent=1)
    # 2. Timings, one run at a time: llama-1b as gpu-check.md's item 1, causal against --document-masking at
    # sequence 2048 and 8192; the start-up peak (the stage built) against the training peak.
    llama = ["--model", "llama-1b", "--microbatches", "1", "--warmup-steps", "2", "--data", data]
    for name, flags in (("llama-1b", ["--seq-len", "2048", "--batch-size", "8", "--steps", "15"]),
                        ("llama-1b documents", ["--seq-len", "2048", "--batch-size", "8", "--steps", "15",
                                                "--document-masking"]),
                        ("llama-1b 8192", ["--seq-len", "8192", "--batch-size", "2", "--steps", "10"]),
                        ("llama-1b 8192 documents", ["--seq-len", "8192", "--batch-size", "2", "--steps", "10",
                                                     "--document-masking"])):
        if args.quick or time.monotonic() - began > args.budget:
            break
        if not wanted("timings") and not wanted(name.replace(" ", "-")):
            continue
        run = results[name] = finish(start(name.replace(" ", "-"), "train_pipeline_gpipe.py", *llama, *flags,
                                           probe=GPU_PEAK_PROBE))
        peak = re.search(r"startup peak bytes (\d+)", run["stderr"])
        run["startup_peak_bytes"] = int(peak[1]) if peak else None
        verdicts[name] = run["status"] == 0
    results["verdicts"] = verdicts
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"{results['device']}, torch {results['torch']}, CUDA {results['cuda']}, NCCL {results['nccl']}", "",
             "| check | result | seconds |", "|---|---|---|"]
    for name, ok in verdicts.items():
        seconds = (checks.get(name) or results.get(name) or {}).get("seconds", "")
        lines.append(f"| {name} | {'ok' if ok else 'FAILED'} | {seconds} |")
    if (hang := checks.get("hang")):
        lines += ["", f"a call that never completes (--timeout 30): status {hang['status']} after {hang['seconds']} "
                  f"s, {hang['verdict'] or 'the watchdog line and the dump'}; its last lines:", "", "```",
                  *hang["stderr"].strip().splitlines()[-12:], "```"]
    for name in ("llama-1b", "llama-1b documents", "llama-1b 8192", "llama-1b 8192 documents"):
        if (row := (results.get(name) or {}).get("summary")):
            lines.append(f"- {name}: median step {row['median_step_time'] * 1e3:.0f} ms, "
                         f"{row['tokens_per_s']:.0f} tokens/s, MFU {row['mfu'] or 0:.1%}, peak "
                         f"{max(row['peak_memory_bytes_per_rank']) / 2**30:.1f} GiB, start-up peak "
                         f"{(results[name]['startup_peak_bytes'] or 0) / 2**30:.1f} GiB")
    with open(os.path.join(out, "gpu-check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    sys.exit(0 if all(verdicts.values()) else 1)


if __name__ == "__main__":
    if sys.argv[1:2] in (["run"], ["measure-memory"]):
        in_process(sys.argv[1:])
    elif sys.argv[1:2] == ["loss-memory"]:
        loss_memory(sys.argv[2:])
    elif sys.argv[1:2] == ["gpu-check"]:
        gpu_check(sys.argv[2:])
    else:
        main(parse_args())
