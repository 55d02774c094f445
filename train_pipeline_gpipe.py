"""Pretrain a Llama model split across processes with torch.distributed.pipelining (GPipe schedule).

    torchrun --nproc_per_node 3 train_pipeline_gpipe.py             # tiny model, builtin data, CPU or GPUs
    python train_pipeline_gpipe.py --steps 20                        # one process holds the whole model
    torchrun --nproc_per_node 4 train_pipeline_gpipe.py --model llama-1b \\
        --data hf:HuggingFaceFW/fineweb:sample-10BT --tokenizer bpe_50K.json

How the model is split: every rank builds the *full* model on the meta device (shapes only, no memory),
deletes the parts other stages own, and only then allocates and initializes what is left. Stage 0 keeps the
embedding and the first layers, the last stage the last layers, the final norm and the head; layers are spread
as evenly as possible. Each stage is wrapped in a PipelineStage, and ScheduleGPipe runs every microbatch
forward through the pipeline, then every microbatch backward, exchanging activations and their gradients
between neighbouring ranks.
"""

import contextlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tqdm
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import checkpoint
import data
import runtime
from model import LlamaForPretraining, config_from_preset

SCHEDULES = {"gpipe": ScheduleGPipe}


# ----------------------------------------------------------------------------------------------------------
# The split: one stage of the model, built without ever allocating the rest

def build_stage_model(config, stage: int, num_stages: int, device: torch.device, seed: int) -> LlamaForPretraining:
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    keep = runtime.layer_split(config.num_hidden_layers, num_stages)[stage]
    for i in range(config.num_hidden_layers):
        if i not in keep:
            del model.base_model.layers[str(i)]  # keys stay global indices: "layers.4" is layer 4 on any stage
    if stage != 0:
        model.base_model.embed_tokens = None
    if stage != num_stages - 1:
        model.base_model.norm = None
        model.lm_head = None
    model.to_empty(device=device)  # allocates, uninitialized: init_weights must set every parameter and buffer
    model.init_weights(seed)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Mean over the microbatch's real targets. The schedule divides gradients by the number of microbatches,
    # so a step's gradient is that of the mean of the microbatch losses, as on one process.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=data.IGNORE_INDEX)


def train_step(schedule, env: runtime.Env, inputs, targets) -> torch.Tensor | None:
    """Forward and backward of one batch through the pipeline; the mean microbatch loss on the last stage."""
    is_first, is_last = env.rank == 0, env.rank == env.world_size - 1
    losses: list[torch.Tensor] = []
    args = (inputs,) if is_first else ()
    kwargs = {"target": targets, "losses": losses} if is_last else {}
    with runtime.autocast(env):
        # return_outputs=False: the logits are not needed after the loss, so do not keep them for the step.
        schedule.step(*args, return_outputs=False, **kwargs)
    return torch.stack(losses).mean().detach() if is_last else None


# ----------------------------------------------------------------------------------------------------------

def main(args):
    env = runtime.launch_env(args.device)
    runtime.check_args(args, env.world_size, env.device.type)
    runtime.init_process_group(env, args.timeout)
    is_first, is_last = env.rank == 0, env.rank == env.world_size - 1
    say = print if is_first else (lambda *a, **k: None)

    # --- data: inputs for the first stage, targets for the last
    tokenizer, loader = data.setup(args, env.rank, env.world_size, env.local_rank)

    # --- model, split, schedule
    preset = runtime.model_preset(args, env.device.type)
    config = config_from_preset(preset, tokenizer.get_vocab_size(), args.layers)
    model = build_stage_model(config, env.rank, env.world_size, env.device, args.seed)
    model.train()
    stage = PipelineStage(model, env.rank, env.world_size, env.device)
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    say(runtime.describe_run(preset, config, env, "GPipe (torch.distributed.pipelining)"), flush=True)
    if loader is not None:
        say(f"data: {loader.describe()}", flush=True)

    # --- optimizer
    optimizer = runtime.make_optimizer(model, args)

    # --- resume from the newest complete checkpoint, if any
    step = checkpoint.resume(args, env, model, optimizer, config, loader, say)
    resumed = step > 0

    # --- training loop
    # With packing every position is a real target, so the tokens trained on so far follow from the step.
    metrics = runtime.Metrics(args.metrics, enabled=is_last, resume_step=step if resumed else None,
                              tokens_seen=step * args.batch_size * args.seq_len)
    meter = runtime.ActivationMeter(model.parameters()) if args.measure_activations else None
    bar = tqdm.tqdm(total=args.steps, initial=step, disable=not is_last, unit="step", mininterval=1.0)
    while step < args.steps:
        step += 1
        lr = runtime.set_lr(optimizer, step, args)
        with runtime.Timer(env.device) as timer:
            inputs, targets = loader.next_batch() if loader is not None else (None, None)
            if inputs is not None:
                inputs, targets = inputs.to(env.device), targets.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            with meter or contextlib.nullcontext():
                loss = train_step(schedule, env, inputs, targets)
            grad_norm = runtime.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
        if is_last:
            row = metrics.log(step, loss, lr, targets, timer.seconds, grad_norm, data.IGNORE_INDEX)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            bar.update()
        path = checkpoint.save_if_due(args, env, step, model, optimizer, config, loader, tokenizer)
        if path and is_last:
            bar.write(f"saved {path}")
    bar.close()

    # --- summary (collective: every rank reports its peak memory)
    metrics.finish(env, positions_per_step=args.batch_size * args.seq_len, meter=meter)


if __name__ == "__main__":
    runtime.run(main, runtime.build_parser(__doc__, list(SCHEDULES)).parse_args())
