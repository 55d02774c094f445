"""The part of training that is the same for every script: AdamW, the learning-rate schedule, gradient
clipping across stages, and the loop (resume, steps, checkpoints, summary) that drives a script's own step."""

import collections
import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint
import tqdm
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import checkpoint
import data
import metrics
import runtime
import timeline


def make_optimizer(module: torch.nn.Module, args) -> torch.optim.Optimizer:
    # Decay matrices only; norm gains stay undecayed. Grouping is per parameter, so it is the same on any split.
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel over all of a group's tensors, on CUDA and on CPU (FSDP's sharded DTensors too), instead
    # of a loop of small ops per tensor: the tiny model's stage 0 updates in 4 ms instead of 20 on one CPU core.
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of --lr for 1-based optimizer step `step`: linear warmup, then cosine down to min_ratio."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer, step: int, args) -> float:
    """Set and return the LR of 1-based step `step`. A pure function of the step: resuming needs no LR state."""
    lr = args.lr * lr_factor(step, args.warmup_steps, args.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_grad_norm_(params, max_norm: float, group=None, copies=()) -> torch.Tensor:
    """Clip by the norm of the *whole model's* gradient and return that norm (the same on every rank).

    Each rank holds only part of the gradient: its stage's, and with FSDP (dp > 1) only its shard of that. The
    parts are disjoint, so the squared norm of the whole is the sum of every rank's squared part (group: all
    ranks); clipping each part by its own norm would change the update. copies: parameters that copy a weight
    counted elsewhere (a tied head, see TiedEmbedding); clipped, but not counted twice.
    """
    params = [p for p in params if p.grad is not None]  # every stage has a layer, so never empty
    skip = {id(p) for p in copies}
    squared = torch.stack([_squared_norm(p.grad) for p in params if id(p) not in skip]).sum()  # on the device
    dist.all_reduce(squared, group=group)
    total = squared.sqrt().float()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares of this rank's part of a tensor, in float64. torch's float32 norm on the CPU adds up a
    whole tensor in one running sum (measured: 2e-5 relative error on a tiny model's embedding gradient, more
    than the 1e-5 the layouts must agree to); norms of 4096-element rows, added in float64, are exact to 1e-7
    and allocate only the rows' norms."""
    flat = _local(tensor).flatten()
    whole = flat.numel() // 4096 * 4096
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, 4096), dim=1)
    rest = torch.linalg.vector_norm(flat[whole:]).reshape(1)
    return (torch.cat([rows, rest]).double() ** 2).sum()


class TiedEmbedding:
    """tie_word_embeddings across pipeline stages: the head is the embedding matrix, but the embedding is on
    the first stage and the head on the last.

    Each of the two stages keeps a copy (one tensor only when a stage holds both). The copies start equal
    (initialized or loaded from the same values), and each step, before clipping and the optimizer, both get
    the sum of the two gradients, that of the one shared matrix: the rank holding the first stage and the rank
    holding the last stage of each replica all-reduce it between them (Megatron's embedding group); a rank
    holding both stages adds them up itself. Same gradient, same AdamW state and update: the copies stay equal,
    bit for bit. Checkpoints store the matrix once (checkpoint._state). Create it on every rank: it makes
    process groups."""

    EMBED, HEAD = "base_model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, model: torch.nn.Module, config, env: runtime.Env, has_first: bool, has_last: bool):
        params = dict(model.named_parameters(remove_duplicate=False))
        self.embed, self.head = params.get(self.EMBED), params.get(self.HEAD)
        tied = config.tie_word_embeddings
        self.active = tied and (self.embed is not None or self.head is not None) and self.embed is not self.head
        self.group = None
        if not tied or env.world_size == 1:
            return
        # Who holds the first and the last stage of each replica; new_group is collective, in the same order.
        holders = [None] * env.world_size
        dist.all_gather_object(holders, (env.mesh.dp_rank, has_first or has_last))
        for replica in range(env.mesh.dp):
            ranks = [rank for rank, (r, holds) in enumerate(holders) if r == replica and holds]
            if len(ranks) == 2:
                group = dist.new_group(ranks)
                if env.rank in ranks:
                    self.group = group

    def sync_grads(self) -> None:
        """Give both copies the shared matrix's gradient: the sum of the embedding's and the head's."""
        if not self.active:
            return
        if self.embed is not None and self.head is not None:  # both stages on this rank
            total = _local(self.embed.grad) + _local(self.head.grad)
            _local(self.embed.grad).copy_(total)
            _local(self.head.grad).copy_(total)
        else:  # FSDP shards both copies alike over the replicas: shard d meets shard d
            dist.all_reduce(_local((self.embed if self.embed is not None else self.head).grad), group=self.group)

    @property
    def copies(self) -> list[torch.Tensor]:
        """The head's copy, to count the shared matrix once in the gradient norm."""
        return [self.head] if self.active and self.head is not None else []


def reshard(modules) -> None:
    """Free the parameters FSDP gathered (after a forward-only pass, which has no backward to do it)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_replicas(stage_modules: list[torch.nn.Module], mesh: runtime.Mesh) -> None:
    """Data parallelism beside the pipeline: shard each stage over its dp replicas with FSDP2 (in place).

    fully_shard on every decoder layer, then on the stage's root (embedding, final norm, head): each layer is
    all-gathered and its gradient reduce-scattered as one unit. Each rank then keeps 1/dp of its stage's
    parameters, gradients and AdamW state. reshard_after_forward=False: a pipeline runs every stage forward
    once per microbatch, and re-gathering the parameters for each would multiply the all-gathers by the
    number of microbatches (torchtitan's choice with pipelining too); the stage holds them unsharded during the
    step. Gradients are reduced once per step: PipelineStage skips the sync on all but the last microbatch's
    backward, and the hand-written schedules do the same (train_pipeline_afab_manual.py).
    Called on modules that already hold their initial weights, so every split starts from the same values.
    """
    if mesh.dp == 1:
        return  # nothing to shard: plain tensors, no FSDP hooks
    dp_mesh, policy = mesh.device_mesh["dp"], {"reshard_after_forward": False}
    for layer in decoder_layers(stage_modules):
        fully_shard(layer, mesh=dp_mesh, **policy)
    for stage in stage_modules:
        fully_shard(stage, mesh=dp_mesh, **policy)


def decoder_layers(stage_modules) -> list[torch.nn.Module]:
    """The decoder layers (base_model.layers.K) of some stage modules, each once; traced stages keep the names."""
    layers = {id(m): m for stage in stage_modules for name, m in stage.named_modules()
              if name.rsplit(".", 1)[0].endswith("layers") and name.rsplit(".", 1)[-1].isdigit()}
    return list(layers.values())


def checkpoint_layers(stage_modules) -> None:
    """Activation checkpointing: each decoder layer keeps only its input for backward and runs its forward again
    there (non-reentrant torch.utils.checkpoint: FSDP's hooks and autocast work inside; the same ops, so the
    same numbers, bit for bit). Done on the layer modules, so it works on traced stages too."""
    for layer in decoder_layers(stage_modules):
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # forward only (evaluation): nothing to keep either way
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def compile_layers(stage_modules) -> None:
    """torch.compile each decoder layer in place (module.compile(): the names, and so checkpoints, stay), as
    torchtitan does: one small graph per layer, compiled once and reused by every layer of the same shape."""
    for layer in decoder_layers(stage_modules):
        layer.compile()


# ----------------------------------------------------------------------------------------------------------
# The loop: everything after the split, the same for every script

def train(args, env, model, step_fn, eval_fn, config, tokenizer, loader, *, has_first: bool, has_last: bool, say,
          record: bool = False) -> None:
    """Optimizer, resume, the training loop with its checkpoints and evaluations, and the summary, around a
    script's own step.

    step_fn(inputs, targets, events) runs this replica's share of the batch forward and backward through this
    rank's part of the pipeline and returns the mean loss on the rank holding the last stage (None elsewhere).
    inputs: [batch / dp, seq] token ids on the rank holding the first stage, else None; targets likewise on the
    rank holding the last stage. events: the timeline.Timeline to record this step into, or None when nothing
    is recorded (record=False and no --trace). eval_fn(inputs, targets): the same, forward only.
    """
    mesh = env.mesh
    # The loss and the progress bar come from the last stage of the first replica (with dp > 1, every replica's
    # last stage has its own loss; they are averaged first).
    reports = has_last and mesh.dp_rank == 0
    # Every loader reads the whole global batch, so its position is the run's whatever dp is (resume works at
    # any layout); each replica trains on its own rows of it.
    share = args.batch_size // mesh.dp
    rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)

    def local(inputs, targets):
        return (inputs[rows].to(env.device) if has_first else None, targets[rows].to(env.device) if has_last else None)

    def replicas_mean(loss):  # the global batch's mean loss: the replicas' shares are equal
        if has_last and mesh.dp > 1:
            dist.all_reduce(loss, group=mesh.group("dp"))
            loss /= mesh.dp
        return loss

    # --- optimizer; the tied head's copy, if the head and the embedding are on different stages
    optimizer = make_optimizer(model, args)
    tied = TiedEmbedding(model, config, env, has_first, has_last)

    # --- resume from the newest complete checkpoint, if any (or start from --init-from's weights)
    step = checkpoint.resume(args, env, model, optimizer, config, tokenizer, loader, say)
    resumed = step > 0
    log = metrics.Metrics(args.metrics, enabled=reports and (step < args.steps or args.steps == 0),
                          resume_step=step if resumed else None, tokens_seen=step * args.batch_size * args.seq_len)

    def evaluate(at_step: int) -> None:
        """--eval-batches held-out batches forward only (the same ones every time), their mean loss logged."""
        held_out = data.make_loader(data.eval_spec(args), tokenizer, args.seq_len, args.batch_size, 0,
                                    args.cache_dir, held_out=True) if has_first or has_last else None
        total = torch.zeros((), device=env.device)
        with torch.no_grad():
            for _ in range(args.eval_batches):
                with runtime.collective_errors():
                    batch = held_out.next_batch() if held_out is not None else (None, None)
                loss = eval_fn(*local(*batch))
                total += loss if has_last else 0
        total = replicas_mean(total / args.eval_batches)
        if reports:
            row = log.log_eval(at_step, total.item(), args.eval_batches)
            tqdm.tqdm.write(f"eval at step {at_step}: loss {row['loss']:.4f}, perplexity {row['perplexity']:.2f} "
                            f"({args.eval_batches} held-out batches of {args.batch_size})")

    if args.steps == 0:  # only evaluate: the weights of --init-from, or of this run's newest checkpoint
        evaluate(step)
        log.finish(env, positions_per_step=args.batch_size * args.seq_len)
        return
    if step >= args.steps:
        return  # nothing to train: the metrics file, and everything else, stays as it was

    # --- training loop
    # With packing every position is a real target, so the tokens trained on so far follow from the step.
    meter = metrics.ActivationMeter(model.parameters()) if args.measure_activations else None
    record = record or args.trace is not None
    recent = collections.deque(maxlen=10)  # (events, step time) of the last steps, for the bubble and --trace
    dist.barrier()
    clock_zero = time.perf_counter()  # ranks leave the barrier together: a shared zero for the trace
    # As a context, the bar ends its line also when the run stops with an error, which then reads on its own.
    with tqdm.tqdm(total=args.steps, initial=step, disable=not reports, unit="step", mininterval=1.0) as bar:
        while step < args.steps:
            step += 1
            lr = set_lr(optimizer, step, args)
            events = timeline.Timeline(env.device, zero=clock_zero) if record else None
            with metrics.Timer(env.device) as timer:
                # A streamed source can fail mid-run (a row without text, a broken shard); the ranks that read it
                # must not leave the others waiting in the pipeline for a batch that never comes.
                with runtime.collective_errors():
                    inputs, targets = loader.next_batch() if loader is not None else (None, None)
                optimizer.zero_grad(set_to_none=True)
                with meter or contextlib.nullcontext():
                    loss = replicas_mean(step_fn(*local(inputs, targets), events))
                tied.sync_grads()
                grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip, copies=tied.copies)
                optimizer.step()
            if record and step > 1:  # the first step pays one-time costs
                recent.append((events.events, timer.seconds))
            if reports:
                row = log.log(step, loss, lr, targets, timer.seconds, grad_norm, data.IGNORE_INDEX)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                bar.update()
            # Save before evaluating: whatever happens in an evaluation, this step's work is kept.
            path = checkpoint.save_if_due(args, env, step, model, optimizer, config, loader, tokenizer)
            if path and reports:
                bar.write(f"saved {path}")
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                evaluate(step)
    if record:  # measured bubble next to the theoretical one, and the Chrome trace
        timeline.report(env.rank, env.world_size, mesh.pp, list(recent), args.microbatches, args.trace)

    # --- summary (collective: every rank reports its memory)
    log.finish(env, positions_per_step=args.batch_size * args.seq_len, meter=meter,
               flops_per_token=metrics.model_flops_per_token(config, args.seq_len),
               state_bytes=metrics.state_bytes(model, optimizer))
