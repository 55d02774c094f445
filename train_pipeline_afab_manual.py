"""Pretrain a Llama model with a pipeline written by hand over torch.distributed send/recv: AFAB and 1F1B.

    torchrun --nproc_per_node 3 train_pipeline_afab_manual.py                  # All-Forward-All-Backward
    torchrun --nproc_per_node 3 train_pipeline_afab_manual.py --schedule 1f1b  # one forward, one backward
    torchrun --nproc_per_node 2 train_pipeline_afab_manual.py --trace trace.json   # open in ui.perfetto.dev

No torch.distributed.pipelining here: this is what that library does for you. Each rank keeps a slice of the
layers (partition_model), runs it on every microbatch (forward_stage), and passes activations forward and
their gradients backward with point-to-point messages. Training is the same as train_pipeline_gpipe.py (same
flags, data, checkpoints, and for the same --seed the same losses).

The functions also train a Hugging Face `LlamaForCausalLM` that a user brings: partition_model(hf_model, ...).
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

import checkpoint
import data
import flags
import plan
import preflight
import runtime
import split
import timeline
import training
from model import LlamaForPretraining


# ----------------------------------------------------------------------------------------------------------
# The split: this rank's slice of the model, and how to run it

@dataclasses.dataclass
class Partition:
    """One rank's part of a model. `model` is the trimmed model itself: its parameters are exactly this stage's,
    under the full model's names, so the optimizer and checkpoints use it directly."""
    model: nn.Module
    rank: int
    world_size: int
    layers: list[nn.Module]
    embed: nn.Module | None  # first stage only
    norm: nn.Module | None  # last stage only
    head: nn.Module | None  # last stage only
    rotary: nn.Module | None  # HF: computes (cos, sin) from positions; our layers build their own tables
    pad_id: int | None  # targets equal to it are ignored by the loss, like data.IGNORE_INDEX
    explicit_causal_mask: bool  # HF's eager attention applies no causal mask unless given one
    group: dist.ProcessGroup | None = None  # the pipeline's ranks; None: the default group is the pipeline

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def peer(self, offset: int) -> int:
        """The global rank of the previous (-1) or next (+1) stage. send/recv always take global ranks; with
        data parallelism, rank + 1 of the pipeline is not global rank + 1 (the mesh puts the replicas of a stage
        between them), so map it through the pipeline's group."""
        rank = self.rank + offset
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def partition_model(model: nn.Module, rank: int, world_size: int, group: dist.ProcessGroup | None = None,
                    layout: list[range] | None = None) -> Partition:
    """Keep this rank's slice of the layers (by default an even one: sizes differ by at most one), with the
    embedding on the first rank and the final norm and head on the last. The model is trimmed in place, so the
    other layers can be freed; calling it again with the same rank and world size returns the same slice.

    rank and world_size count the pipeline's stages. group: the process group of this rank's pipeline, when
    it is not the default group (several pipelines side by side, one per data-parallel replica); rank is then
    this process's rank within that group. layout: the layers of every stage, to balance the stages by cost
    (split.py) instead of by layer count.

    Works with model.py's LlamaForPretraining and with a Hugging Face LlamaForCausalLM
    (model.model.embed_tokens / layers / norm / rotary_emb, lm_head).
    """
    if isinstance(model, LlamaForPretraining):
        base, owner, rotary, pad_id, eager = model.base_model, model, None, None, False
    elif hasattr(model, "model") and hasattr(model.model, "layers") and hasattr(model, "lm_head"):
        base, owner, rotary = model.model, model, model.model.rotary_emb
        pad_id = getattr(model.config, "pad_token_id", None)
        eager = getattr(model.config, "_attn_implementation", "eager") == "eager"
    else:
        raise TypeError(f"partition_model: unsupported model {type(model).__name__}")
    layers, as_dict = base.layers, isinstance(base.layers, nn.ModuleDict)
    keep = (layout or split.even(model.config.num_hidden_layers, world_size))[rank]
    for key in [int(k) for k in layers.keys()] if as_dict else range(len(layers)):
        if key not in keep and as_dict:
            del layers[str(key)]  # names stay global: "layers.4" is layer 4 on any stage
        elif key not in keep:
            layers[key] = None  # a ModuleList cannot delete from the middle without renumbering the rest
    kept = [layers[str(i)] if as_dict else layers[i] for i in keep]
    if any(layer is None for layer in kept):
        raise ValueError("partition_model: the model was already partitioned for another layout")
    if rank != 0:
        base.embed_tokens = None
    if rank != world_size - 1:
        base.norm = None
        owner.lm_head = None
    return Partition(owner, rank, world_size, kept, base.embed_tokens, base.norm, owner.lm_head, rotary,
                     pad_id, eager, group)


def forward_stage(partition: Partition, hidden_states: torch.Tensor) -> torch.Tensor:
    """Run this rank's slice. The first stage takes token ids [mb, seq]; the others hidden states
    [mb, seq, hidden]. Returns hidden states, or logits on the last stage.

    Positions are 0..seq-1 on every stage: each stage sees whole sequences, so it can rebuild positions (and
    the rotary tables) from the sequence length and nothing but hidden states needs to travel.
    """
    if isinstance(partition.model, LlamaForPretraining):
        # model.py's Llama skips what a stage does not hold, so the trimmed model is exactly the stage. Calling it
        # (not its parts) also runs FSDP's hooks when the stage is sharded over data-parallel replicas.
        return partition.model(hidden_states)
    h = partition.embed(hidden_states) if partition.embed is not None else hidden_states
    kwargs = {}
    if partition.rotary is not None:  # Hugging Face layers take precomputed (cos, sin) and optionally a mask
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        kwargs["position_embeddings"] = partition.rotary(h, positions)
        if partition.explicit_causal_mask:
            kwargs["attention_mask"] = torch.full((h.shape[1], h.shape[1]), float("-inf"), device=h.device,
                                                  dtype=h.dtype).triu(1)[None, None]
    for layer in partition.layers:
        h = layer(h, **kwargs)
        h = h[0] if isinstance(h, tuple) else h  # older transformers return (hidden_states, ...)
    if partition.norm is not None:
        h = partition.norm(h)
    return partition.head(h) if partition.head is not None else h


def microbatch_loss(partition: Partition, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if partition.pad_id is not None:
        targets = targets.masked_fill(targets == partition.pad_id, data.IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=data.IGNORE_INDEX)


# ----------------------------------------------------------------------------------------------------------
# Point-to-point messages with a shape/dtype handshake

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_DIMS = 6


class _Comm:
    """Sends and receives of one training step. Sends are non-blocking so that two neighbours sending to each
    other at the same moment (1F1B's steady state) cannot deadlock; they are waited for at the end of the step,
    and the tensors are kept alive until then."""

    def __init__(self, device: torch.device, timeline: "timeline.Timeline | None"):
        self.device, self.timeline, self.pending = device, timeline, []

    def now(self) -> float:
        return self.timeline.now() if self.timeline else 0.0

    def send(self, tensor: torch.Tensor, dst: int, mb: int) -> None:
        start = self.now()
        tensor = tensor.contiguous()
        # The receiver cannot know the shape (the sequence length may change from batch to batch) nor the
        # dtype, and a receive buffer must match the sender's dtype byte for byte: send both first.
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        header = header.to(self.device)
        self.pending += [(dist.isend(header, dst), header), (dist.isend(tensor, dst), tensor)]
        if self.timeline:
            self.timeline.add("send", mb, start)

    def recv(self, src: int, mb: int) -> torch.Tensor:
        start = self.now()
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        dtype_index, ndim, *shape = header.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype_index], device=self.device)
        dist.recv(tensor, src)
        if self.timeline:
            self.timeline.add("recv", mb, start)
        return tensor

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# ----------------------------------------------------------------------------------------------------------
# The schedules

class _Step:
    """Per-step state shared by AFAB and 1F1B: one forward and one backward per microbatch."""

    def __init__(self, partition, inputs, targets, device, dtype, timeline, capture):
        self.p, self.inputs, self.targets, self.device, self.dtype = partition, inputs, targets, device, dtype
        self.m = len(inputs)
        self.comm = _Comm(device, timeline)
        self.timeline, self.capture = timeline, capture
        self.saved: dict[int, tuple] = {}  # microbatch -> (stage input, stage output or scaled loss)
        self.loss = torch.zeros((), device=device)
        self.in_flight_peak = 0

    def forward(self, i: int) -> None:
        p = self.p
        if p.is_first:
            x = self.inputs[i].to(self.device)
        else:
            # A received tensor has no autograd history. Making it a leaf that requires grad lets this stage's
            # backward stop here and leave d(loss)/d(input) in x.grad, which is what the previous stage needs.
            x = self.comm.recv(p.peer(-1), i).to(self.dtype).requires_grad_()
        start = self.comm.now()
        out = forward_stage(p, x)
        if self.capture is not None:
            self.capture.setdefault("outputs", {})[i] = out.detach().clone()  # hidden states, or logits
        if p.is_last:
            # Divide by the number of microbatches so the accumulated gradient is that of the mean loss.
            out = microbatch_loss(p, out, self.targets[i].to(self.device)) / self.m
            self.loss += out.detach()
        if self.timeline:
            self.timeline.add("forward", i, start)
        if not p.is_last:  # values only travel; the graph stays here in `out` for this stage's backward
            self.comm.send(out.detach().to(self.dtype), p.peer(+1), i)
        self.saved[i] = (x, out)
        self.in_flight_peak = max(self.in_flight_peak, len(self.saved))

    def backward(self, i: int) -> None:
        p = self.p
        x, out = self.saved.pop(i)  # dropping it frees this microbatch's activations after the backward
        grad = None if p.is_last else self.comm.recv(p.peer(+1), i).to(out.dtype)
        if isinstance(p.model, FSDPModule):
            # Data parallelism: the replicas of this stage must end the step with the same gradient, the mean
            # of theirs. Syncing on every microbatch's backward would reduce-scatter m times per step; instead
            # each backward adds into the local unsharded gradient and only the last one (microbatch m - 1 in
            # both AFAB and 1F1B) reduce-scatters the sum, once. Until then the parameters stay gathered
            # (reshard after backward only at the end), and FSDP finishes its step only after the last one.
            last = i == self.m - 1
            p.model.set_requires_gradient_sync(last)
            p.model.set_reshard_after_backward(last)
            p.model.set_is_last_backward(last)
        start = self.comm.now()
        out.backward(grad)  # the last stage starts from its scaled loss, the others from the received gradient
        if self.timeline:
            self.timeline.add("backward", i, start)
        if not p.is_first:
            if self.capture is not None:
                self.capture.setdefault("input_grads", {})[i] = x.grad.detach().clone()
            self.comm.send(x.grad.to(self.dtype), p.peer(-1), i)

    def finish(self) -> torch.Tensor | None:
        self.comm.wait_all()
        if self.capture is not None:
            self.capture["in_flight_peak"] = self.in_flight_peak
        return self.loss if self.p.is_last else None


def _as_partition(model) -> Partition:
    if isinstance(model, Partition):
        return model
    return partition_model(model, dist.get_rank(), dist.get_world_size())


def train_step_pipeline_afab(model, inputs, targets, device, dtype, *, timeline=None, capture=None):
    """One training step with All-Forward-All-Backward: every microbatch forward, then every one backward in
    microbatch order (0, 1, ...). The caller zeroes gradients before and runs the optimizer after.

    Args:
        model: a Partition from partition_model, or a model that is partitioned here (rank and world size
            from the default process group, which must be initialized).
        inputs, targets: lists of [mb, seq] token-id tensors, one per microbatch. Only the first rank reads
            inputs and only the last reads targets; other ranks may pass lists of None of the same length.
        device: where this stage computes. dtype: dtype of the activations and gradients sent between stages.
        timeline: optional Timeline that records every forward, backward, send and recv.
        capture: optional dict that receives this stage's per-microbatch outputs and input gradients.

    Returns the step's loss (mean over microbatches of the cross-entropy, ignoring -100 and the pad id) on the
    last rank; None on the other ranks. All m microbatches' activations are held at the peak.
    """
    step = _Step(_as_partition(model), inputs, targets, device, dtype, timeline, capture)
    for i in range(step.m):
        step.forward(i)
    for i in range(step.m):
        step.backward(i)
    return step.finish()


def train_step_pipeline_1f1b(model, inputs, targets, device, dtype, *, timeline=None, capture=None):
    """One training step with 1F1B (PipeDream-flush): same arguments, result and gradients as AFAB, but a
    rank holds the activations of at most world_size - rank microbatches instead of all of them."""
    step = _Step(_as_partition(model), inputs, targets, device, dtype, timeline, capture)
    p = step.p
    # Warmup: enough forwards to fill the pipeline below this rank. The last rank needs none.
    warmup = min(p.world_size - p.rank - 1, step.m)
    for i in range(warmup):
        step.forward(i)
    # Steady state: each new forward is followed by the backward of the oldest microbatch still held,
    # so the number held stays at warmup + 1.
    for i in range(step.m - warmup):
        step.forward(warmup + i)
        step.backward(i)
    # Cooldown: drain the microbatches still held.
    for i in range(step.m - warmup, step.m):
        step.backward(i)
    return step.finish()


@torch.no_grad()
def eval_step_pipeline(model, inputs, targets, device, dtype):
    """Forward only, for a held-out loss: every microbatch through the stages (no activations kept), the last
    rank returns the mean loss. Same arguments as train_step_pipeline_afab."""
    step = _Step(_as_partition(model), inputs, targets, device, dtype, None, None)
    for i in range(step.m):
        step.forward(i)
        step.saved.pop(i)  # nothing to go backward through
    return step.finish()


SCHEDULES = {"afab": train_step_pipeline_afab, "1f1b": train_step_pipeline_1f1b}


# ----------------------------------------------------------------------------------------------------------

def main(args):
    if args.plan is not None:  # memory and step time of a layout, computed: nothing allocated, no process group
        return plan.run(args, args.plan)
    env = runtime.launch_env(args.device)
    flags.check_args(args, env.world_size, env.device.type)
    runtime.init_process_group(env, args.timeout, args.dp)
    preflight.check(args, env)  # paths, inputs, one run per --checkpoint-dir: one line on every rank if wrong
    mesh = env.mesh  # this rank's stage along "pp", its replica along "dp"
    is_first, is_last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp - 1
    say = print if env.rank == 0 else (lambda *a, **k: None)

    # --- data: inputs for the first stage, targets for the last
    tokenizer, loader = data.setup(args, env.local_rank, needs_batches=is_first or is_last)

    # --- model, split, schedule: the full model on meta, this rank's slice kept, then materialized
    with runtime.collective_errors():
        config, name = checkpoint.model_config(args, tokenizer.vocab_size(), env.device.type)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    layout, costs = split.run_layout(args, config, mesh.pp)  # the layers of each stage
    partition = partition_model(model, mesh.pp_rank, mesh.pp, group=mesh.group("pp"), layout=layout)
    model.to_empty(device=env.device)
    if mesh.pp == 1:  # embedding and head in one stage: one tensor if tied (else training.TiedEmbedding)
        model.tie_weights()
    model.init_weights(args.seed)
    if args.activation_checkpointing:
        training.checkpoint_layers([model])
    if args.compile:
        training.compile_layers([model])
    training.shard_replicas([model], mesh)  # dp > 1: FSDP2 over this stage's replicas (see _Step.backward)
    model.train()
    train_step = SCHEDULES[args.schedule]
    say(split.describe_run(name, config, env, f"{args.schedule} by hand", layout, costs), flush=True)
    if loader is not None:
        say(f"data: {loader.describe()}", flush=True)

    # --- optimizer, resume, training loop, checkpoints, summary: the same for every script. record=True: this
    # script always times its forwards, backwards, sends and receives, and prints the measured bubble.
    def microbatches(inputs, targets):
        m = args.microbatches
        return inputs.chunk(m) if is_first else [None] * m, targets.chunk(m) if is_last else [None] * m

    def step(inputs, targets, events):
        with runtime.autocast(env):
            # fp32 between stages: the residual stream is fp32 under autocast too, as in the library scripts.
            return train_step(partition, *microbatches(inputs, targets), env.device, torch.float32, timeline=events)

    def evaluate(inputs, targets):
        with runtime.autocast(env):
            loss = eval_step_pipeline(partition, *microbatches(inputs, targets), env.device, torch.float32)
        training.reshard([model])  # FSDP gathered the parameters for the forwards
        return loss

    training.train(args, env, model, step, evaluate, config, tokenizer, loader, has_first=is_first,
                   has_last=is_last, say=say, record=True)


if __name__ == "__main__":
    runtime.run(main, flags.build_parser(__doc__, list(SCHEDULES)).parse_args())
