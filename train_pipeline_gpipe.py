"""Pretrain a Llama model split across processes with torch.distributed.pipelining (GPipe and every other
schedule torch ships).

    torchrun --nproc_per_node 3 train_pipeline_gpipe.py             # tiny model, builtin data, CPU or GPUs
    python train_pipeline_gpipe.py --steps 20                        # one process holds the whole model
    torchrun --nproc_per_node 2 train_pipeline_gpipe.py --schedule interleaved1f1b --stages-per-rank 2
    torchrun --nproc_per_node 4 train_pipeline_gpipe.py --model llama-1b \\
        --data hf:HuggingFaceFW/fineweb:sample-10BT --tokenizer bpe_50K.json

How the model is split: every rank builds the *full* model on the meta device (shapes only, no memory),
deletes the parts other stages own, and only then allocates and initializes what is left. Stage 0 keeps the
embedding and the first layers, the last stage the last layers, the final norm and the head; layers are spread
as evenly as possible. Each stage is wrapped in a PipelineStage, and ScheduleGPipe runs every microbatch
forward through the pipeline, then every microbatch backward, exchanging activations and their gradients
between neighbouring ranks.

Schedules with several stages per rank (--stages-per-rank V) cut the model into p * V stages. Looped ones
(interleaved1f1b, loopedbfs, interleavedzerobubble) give rank r the stages r, r + p, r + 2p, ...; the V-shaped
ones (zbvzerobubble, dualpipev) give it stages r and 2p - 1 - r, so rank 0 holds both the first and the last.
A rank's stages share one trimmed model, so its optimizer and checkpoint see one set of full-model names.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

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
from split import SCHEDULES, SINGLE_STAGE, V_SHAPED, check_schedule, stage_ids  # which stages each rank holds

# ----------------------------------------------------------------------------------------------------------
# The split: one stage of the model, built without ever allocating the rest

def rank_stages(args, env: runtime.Env) -> tuple[list[int], int]:
    """Check what --schedule requires, then this rank's stage indices and the total number of stages. Ranks are
    counted along the pipeline (the mesh's "pp" dim): the dp replicas of a rank hold the same stages."""
    pp_rank, pp = env.mesh.pp_rank, env.mesh.pp
    check_schedule(args, pp, flags.num_layers(args, env.device.type))
    stages = stage_ids(args.schedule, pp_rank, pp, args.stages_per_rank)
    return stages, pp * len(stages)


def build_stage_model(config, stage: int | list[int], num_stages: int, device: torch.device, seed: int,
                      layout: list[range] | None = None) -> LlamaForPretraining:
    """This rank's part of the model: the layers of its stage(s), plus the embedding if it holds stage 0 and the
    norm and head if it holds the last stage. Built on meta, trimmed, then allocated and initialized.
    layout: the layers of each stage (split.py; default: even)."""
    stages = [stage] if isinstance(stage, int) else stage
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    splits = layout or split.even(config.num_hidden_layers, num_stages)
    _trim(model, {i for s in stages for i in splits[s]}, 0 in stages, num_stages - 1 in stages)
    model.to_empty(device=device)  # allocates, uninitialized: init_weights must set every parameter and buffer
    if num_stages == 1:  # embedding and head in one stage: one tensor if tied (else training.TiedEmbedding)
        model.tie_weights()
    model.init_weights(seed)
    return model


def _trim(model: LlamaForPretraining, keep: set[int], embed: bool, head: bool) -> None:
    for i in range(model.config.num_hidden_layers):
        if i not in keep:
            del model.base_model.layers[str(i)]  # keys stay global indices: "layers.4" is layer 4 on any stage
    if not embed:
        model.base_model.embed_tokens = None
    if not head:
        model.base_model.norm = None
        model.lm_head = None


def stage_views(model: LlamaForPretraining, stages: list[int], num_stages: int,
                layout: list[range] | None = None) -> list[LlamaForPretraining]:
    """One module per stage of this rank, sharing the parameters of `model` (the rank's whole part)."""
    if len(stages) == 1:
        return [model]
    splits = layout or split.even(model.config.num_hidden_layers, num_stages)
    views = []
    for s in stages:
        with torch.device("meta"):  # only a skeleton: every part kept below is replaced by the real one
            view = LlamaForPretraining(model.config)
        _trim(view, set(splits[s]), s == 0, s == num_stages - 1)
        for i in splits[s]:
            view.base_model.layers[str(i)] = model.base_model.layers[str(i)]
        if s == 0:
            view.base_model.embed_tokens = model.base_model.embed_tokens
        if s == num_stages - 1:
            view.base_model.norm, view.lm_head = model.base_model.norm, model.lm_head
        views.append(view)
    return views


def stage_io(config, stage: int, num_stages: int, microbatch_shape: tuple[int, int],
             env: runtime.Env) -> dict[str, torch.Tensor]:
    """What a stage takes in and gives out for one microbatch, as meta tensors (shape and dtype, no memory).

    Declared up front, PipelineStage need not find it out itself: otherwise torch 2.13 runs a real microbatch
    through each stage before the first step, and on the first stage it never frees that forward's
    activations (0.8 of a microbatch's, held for the whole run; see README). Token ids come in; hidden states
    stay in the weights' dtype under autocast (fp32 embedding, fp32 residual additions); logits come out in
    the compute dtype. test_small.py checks these against a real forward under bf16 autocast."""
    batch, seq = microbatch_shape
    hidden = torch.empty(batch, seq, config.hidden_size, device="meta", requires_grad=True)
    return {"input_args": torch.empty(batch, seq, dtype=torch.long, device="meta") if stage == 0 else hidden,
            "output_args": torch.empty(batch, seq, config.vocab_size, dtype=env.dtype, device="meta",
                                       requires_grad=True) if stage == num_stages - 1 else hidden}


def make_schedule(name: str, model, stages: list[int], num_stages: int, env: runtime.Env, microbatches: int,
                  microbatch_shape: tuple[int, int], recorder: timeline.Recorder | None = None,
                  layout: list[range] | None = None):
    """This rank's PipelineStages, sharded over their dp replicas, and the schedule that drives them."""
    views = stage_views(model, stages, num_stages, layout)
    # With dp > 1 each stage becomes an FSDP module. PipelineStage sees that and does the per-microbatch
    # bookkeeping itself: no gradient sync on each microbatch's backward, one reduce-scatter after the last.
    training.shard_replicas(views, env.mesh)
    # group: the pipeline's ranks (this rank's column of the mesh). Stage s lives on the group's rank
    # s % pp, and PipelineStage turns that into the global rank it sends to and receives from.
    pipeline_stages = [PipelineStage(view, s, num_stages, env.device, group=env.mesh.group("pp"),
                                     **stage_io(model.config, s, num_stages, microbatch_shape, env))
                       for view, s in zip(views, stages)]
    if recorder is not None:
        recorder.instrument(pipeline_stages)
    return schedule_for(name, pipeline_stages, microbatches, recorder), pipeline_stages


def schedule_for(name: str, pipeline_stages: list, microbatches: int, recorder: timeline.Recorder | None = None):
    """The schedule driving this rank's stages (one for gpipe/1f1b, a list for the others)."""
    loss = recorder.timed_loss(loss_fn) if recorder is not None else loss_fn  # the last stage's work too
    try:
        if name in SINGLE_STAGE:
            return SCHEDULES[name](pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss)
        return SCHEDULES[name](pipeline_stages, n_microbatches=microbatches, loss_fn=loss)
    except ValueError as e:  # a requirement check_schedule does not know about (a newer torch, say)
        raise runtime.FlagError(f"--schedule {name} with --microbatches {microbatches}: {e}") from None


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Mean over the microbatch's real targets. The schedule divides gradients by the number of microbatches,
    # so a step's gradient is that of the mean of the microbatch losses, as on one process.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=data.IGNORE_INDEX)


def step_function(schedule, env: runtime.Env, recorder: timeline.Recorder | None):
    """The step the shared training loop calls: train_step, recording into the loop's timeline when tracing."""
    def step(inputs, targets, events):
        if recorder is not None:
            recorder.current = events
        return train_step(schedule, env, inputs, targets)
    return step


def eval_function(schedule, pipeline_stages: list, env: runtime.Env, recorder: timeline.Recorder | None,
                  name: str, microbatches: int, hidden_shape: tuple[int, int, int]):
    """The forward-only pass the training loop's evaluations call: the schedule's eval(), no gradients; for the
    V-shaped schedules, whose eval() fails in torch 2.13, forward_only() over the same stages."""
    def evaluate(inputs, targets):
        if recorder is not None:
            recorder.current = None  # not part of any step's timeline
        losses: list[torch.Tensor] = []
        args = (inputs,) if inputs is not None else ()
        kwargs = {"target": targets, "losses": losses} if targets is not None else {}
        with runtime.autocast(env):
            if name in V_SHAPED:
                forward_only(pipeline_stages, inputs, targets, microbatches, hidden_shape, losses)
            else:
                schedule.eval(*args, return_outputs=False, **kwargs)
        training.reshard(stage.submod for stage in pipeline_stages)  # FSDP gathered them for the forwards
        return torch.stack(losses).mean() if targets is not None else None
    return evaluate


def forward_only(pipeline_stages: list, inputs, targets, microbatches: int, hidden_shape: tuple[int, int, int],
                 losses: list) -> None:
    """Every microbatch forward through this rank's stages, the last stage's losses appended to `losses`.
    inputs, targets: as for train_step; hidden_shape: a microbatch's hidden states, [mb, seq, hidden].

    torch 2.13's eval() runs the V-shaped schedules' training order without its backward actions, and the
    stage that meets its neighbour on the same rank then asserts ("can't steal_bwd_input if this stage doesn't
    have backward"). Here each rank runs its stages in the order of their index, each on all microbatches:
    an input comes from the stage before (in memory when this rank holds it too, else received from its rank),
    an output goes to the stage after the same way. Sends do not wait, so no rank waits for one that waits
    for it: stage s only ever waits for stage s - 1, which every rank runs earlier in the same order."""
    first = pipeline_stages[0]
    group = first.group if first.group is not None else dist.group.WORLD
    peer = lambda s: dist.get_global_rank(group, first.stage_index_to_group_rank[s])  # noqa: E731
    held, sends = {}, []  # (stage, microbatch) -> output kept for a stage on this rank; pending sends
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


def train_step(schedule, env: runtime.Env, inputs, targets) -> torch.Tensor | None:
    """Forward and backward of one batch through the pipeline. inputs: on the rank holding the first stage, else
    None; targets: on the rank holding the last stage, else None. Returns the mean microbatch loss there."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if inputs is not None else ()
    kwargs = {"target": targets, "losses": losses} if targets is not None else {}
    with runtime.autocast(env):
        # return_outputs=False: the logits are not needed after the loss, so do not keep them for the step.
        schedule.step(*args, return_outputs=False, **kwargs)
    return torch.stack(losses).mean().detach() if targets is not None else None


# ----------------------------------------------------------------------------------------------------------

def main(args):
    if args.plan is not None:  # memory and step time of a layout, computed: nothing allocated, no process group
        return plan.run(args, args.plan)
    env = runtime.launch_env(args.device)
    flags.check_args(args, env.world_size, env.device.type)
    check_schedule(args, env.world_size // args.dp, flags.num_layers(args, env.device.type))
    runtime.init_process_group(env, args.timeout, args.dp)
    preflight.check(args, env)  # paths, inputs, one run per --checkpoint-dir: one line on every rank if wrong
    stages, num_stages = rank_stages(args, env)
    has_first, has_last = 0 in stages, num_stages - 1 in stages  # V-shaped: rank 0 holds both
    say = print if env.rank == 0 else (lambda *a, **k: None)

    # --- data: inputs for the first stage, targets for the last
    tokenizer, loader = data.setup(args, env.local_rank, needs_batches=has_first or has_last)

    # --- model, split, schedule
    with runtime.collective_errors():
        config, name = checkpoint.model_config(args, tokenizer.vocab_size(), env.device.type)
    layout, costs = split.run_layout(args, config, num_stages)  # the layers of each stage
    model = build_stage_model(config, stages, num_stages, env.device, args.seed, layout)
    if args.activation_checkpointing:
        training.checkpoint_layers([model])
    if args.compile:
        training.compile_layers([model])
    model.train()
    recorder = timeline.Recorder() if args.trace else None
    microbatch = (args.batch_size // (args.dp * args.microbatches), args.seq_len)
    schedule, pipeline_stages = make_schedule(args.schedule, model, stages, num_stages, env, args.microbatches,
                                              microbatch, recorder, layout)
    say(split.describe_run(name, config, env, f"{args.schedule} (torch.distributed.pipelining)", layout, costs),
        flush=True)
    if loader is not None:
        say(f"data: {loader.describe()}", flush=True)

    # --- optimizer, resume, training loop, checkpoints, summary: the same for every script
    training.train(args, env, model, step_function(schedule, env, recorder),
                   eval_function(schedule, pipeline_stages, env, recorder, args.schedule, args.microbatches,
                                 (*microbatch, config.hidden_size)), config, tokenizer, loader,
                   has_first=has_first, has_last=has_last, say=say)


if __name__ == "__main__":
    runtime.run(main, flags.build_parser(__doc__, list(SCHEDULES), stages_per_rank=True).parse_args())
