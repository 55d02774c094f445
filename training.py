"""The part of training that is the same for every script: AdamW, the learning-rate schedule, gradient
clipping across stages, and the loop (resume, steps, checkpoints, summary) that drives a script's own step."""

import collections
import contextlib
import math
import time

import torch
import torch.distributed as dist
import tqdm
from torch.distributed.fsdp import fully_shard
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
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


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


def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip by the norm of the *whole model's* gradient and return that norm (the same on every rank).

    Each rank holds only part of the gradient: its stage's, and with FSDP (dp > 1) only its shard of that. The
    parts are disjoint, so the squared norm of the whole is the sum of every rank's squared part (group: all
    ranks); clipping each part by its own norm would change the update.
    """
    params = [p for p in params if p.grad is not None]  # every stage has a layer, so never empty
    squared = torch.stack([_squared_norm(p.grad) for p in params]).sum()  # on the device: no sync per tensor
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
    flat = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).flatten()
    whole = flat.numel() // 4096 * 4096
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, 4096), dim=1)
    rest = torch.linalg.vector_norm(flat[whole:]).reshape(1)
    return (torch.cat([rows, rest]).double() ** 2).sum()


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
    layers = {id(m): m for stage in stage_modules for name, m in stage.named_modules()
              if name.rsplit(".", 1)[0].endswith("layers") and name.rsplit(".", 1)[-1].isdigit()}
    for layer in layers.values():  # several stages of one rank may share nothing, but never shard twice
        fully_shard(layer, mesh=dp_mesh, **policy)
    for stage in stage_modules:
        fully_shard(stage, mesh=dp_mesh, **policy)


# ----------------------------------------------------------------------------------------------------------
# The loop: everything after the split, the same for every script

def train(args, env, model, step_fn, config, tokenizer, loader, *, has_first: bool, has_last: bool, say,
          record: bool = False) -> None:
    """Optimizer, resume, the training loop with its checkpoints, and the summary, around a script's own step.

    step_fn(inputs, targets, events) runs this replica's share of the batch forward and backward through this
    rank's part of the pipeline and returns the mean loss on the rank holding the last stage (None elsewhere).
    inputs: [batch / dp, seq] token ids on the rank holding the first stage, else None; targets likewise on the
    rank holding the last stage. events: the timeline.Timeline to record this step into, or None when nothing
    is recorded (record=False and no --trace).
    """
    mesh = env.mesh
    # The loss and the progress bar come from the last stage of the first replica (with dp > 1, every replica's
    # last stage has its own loss; they are averaged first).
    reports = has_last and mesh.dp_rank == 0

    # --- optimizer
    optimizer = make_optimizer(model, args)

    # --- resume from the newest complete checkpoint, if any (or start from --init-from's weights)
    step = checkpoint.resume(args, env, model, optimizer, config, tokenizer, loader, say)
    if step >= args.steps:
        return  # nothing to train: the metrics file, and everything else, stays as it was
    resumed = step > 0

    # --- training loop
    # With packing every position is a real target, so the tokens trained on so far follow from the step.
    log = metrics.Metrics(args.metrics, enabled=reports, resume_step=step if resumed else None,
                          tokens_seen=step * args.batch_size * args.seq_len)
    meter = metrics.ActivationMeter(model.parameters()) if args.measure_activations else None
    record = record or args.trace is not None
    recent = collections.deque(maxlen=10)  # (events, step time) of the last steps, for the bubble and --trace
    # Every loader reads the whole global batch, so its position is the run's whatever dp is (resume works at
    # any layout); each replica trains on its own rows of it.
    share = args.batch_size // mesh.dp
    rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
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
                    loss = step_fn(inputs[rows].to(env.device) if has_first else None,
                                   targets[rows].to(env.device) if has_last else None, events)
                if has_last and mesh.dp > 1:  # the global batch's mean: the replicas' shares are equal
                    dist.all_reduce(loss, group=mesh.group("dp"))
                    loss /= mesh.dp
                grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
            if record and step > 1:  # the first step pays one-time costs
                recent.append((events.events, timer.seconds))
            if reports:
                row = log.log(step, loss, lr, targets, timer.seconds, grad_norm, data.IGNORE_INDEX)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                bar.update()
            path = checkpoint.save_if_due(args, env, step, model, optimizer, config, loader, tokenizer)
            if path and reports:
                bar.write(f"saved {path}")
    if record:  # measured bubble next to the theoretical one, and the Chrome trace
        timeline.report(env.rank, env.world_size, mesh.pp, list(recent), args.microbatches, args.trace)

    # --- summary (collective: every rank reports its memory)
    log.finish(env, positions_per_step=args.batch_size * args.seq_len, meter=meter,
               flops_per_token=metrics.model_flops_per_token(config, args.seq_len),
               state_bytes=metrics.state_bytes(model, optimizer))
