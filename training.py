"""The part of training that is the same for every script: AdamW, the learning-rate schedule, gradient
clipping across stages, and the loop (resume, steps, checkpoints, summary) that drives a script's own step."""

import collections
import contextlib
import math
import time

import torch
import torch.distributed as dist
import tqdm

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
    """Clip by the norm of the *whole model's* gradient and return that norm.

    Each stage holds only part of the gradient; clipping each part by its own norm would change the update.
    The squared local norms are summed across stages first, as one process holding the full model would.
    """
    params = [p for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    squared = local.float() ** 2
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total




# ----------------------------------------------------------------------------------------------------------
# The loop: everything after the split, the same for every script

def train(args, env, model, step_fn, config, tokenizer, loader, *, has_first: bool, has_last: bool, say,
          record: bool = False) -> None:
    """Optimizer, resume, the training loop with its checkpoints, and the summary, around a script's own step.

    step_fn(inputs, targets, events) runs one batch forward and backward through this rank's part of the
    pipeline and returns the step's mean loss on the rank holding the last stage (None elsewhere). inputs:
    [batch, seq] token ids on the rank holding the first stage, else None; targets likewise on the rank holding
    the last stage. events: the timeline.Timeline to record this step into, or None when nothing is recorded
    (record=False and no --trace).
    """
    # --- optimizer
    optimizer = make_optimizer(model, args)

    # --- resume from the newest complete checkpoint, if any (or start from --init-from's weights)
    step = checkpoint.resume(args, env, model, optimizer, config, tokenizer, loader, say)
    if step >= args.steps:
        return  # nothing to train: the metrics file, and everything else, stays as it was
    resumed = step > 0

    # --- training loop
    # With packing every position is a real target, so the tokens trained on so far follow from the step.
    log = metrics.Metrics(args.metrics, enabled=has_last, resume_step=step if resumed else None,
                          tokens_seen=step * args.batch_size * args.seq_len)
    meter = metrics.ActivationMeter(model.parameters()) if args.measure_activations else None
    record = record or args.trace is not None
    recent = collections.deque(maxlen=10)  # (events, step time) of the last steps, for the bubble and --trace
    dist.barrier()
    clock_zero = time.perf_counter()  # ranks leave the barrier together: a shared zero for the trace
    # As a context, the bar ends its line also when the run stops with an error, which then reads on its own.
    with tqdm.tqdm(total=args.steps, initial=step, disable=not has_last, unit="step", mininterval=1.0) as bar:
        while step < args.steps:
            step += 1
            lr = set_lr(optimizer, step, args)
            events = timeline.Timeline(env.device, zero=clock_zero) if record else None
            with metrics.Timer(env.device) as timer:
                # A streamed source can fail mid-run (a row without text, a broken shard); the ranks that read it
                # must not leave the others waiting in the pipeline for a batch that never comes.
                with runtime.collective_errors():
                    inputs, targets = loader.next_batch() if loader is not None else (None, None)
                inputs = inputs.to(env.device) if has_first else None
                targets = targets.to(env.device) if has_last else None
                optimizer.zero_grad(set_to_none=True)
                with meter or contextlib.nullcontext():
                    loss = step_fn(inputs, targets, events)
                grad_norm = clip_grad_norm_(model.parameters(), args.grad_clip)
                optimizer.step()
            if record and step > 1:  # the first step pays one-time costs
                recent.append((events.events, timer.seconds))
            if has_last:
                row = log.log(step, loss, lr, targets, timer.seconds, grad_norm, data.IGNORE_INDEX)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                bar.update()
            path = checkpoint.save_if_due(args, env, step, model, optimizer, config, loader, tokenizer)
            if path and has_last:
                bar.write(f"saved {path}")
    if record:  # measured bubble next to the theoretical one, and the Chrome trace
        timeline.report(env.rank, env.world_size, list(recent), args.microbatches, args.trace)

    # --- summary (collective: every rank reports its peak memory)
    log.finish(env, positions_per_step=args.batch_size * args.seq_len, meter=meter,
               flops_per_token=metrics.model_flops_per_token(config, args.seq_len))
