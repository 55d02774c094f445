"""Pretrain a Llama model split across processes by the pipeline tracer: pipeline() + SplitPoint + build_stage.

    torchrun --nproc_per_node 3 train_pipeline_tracer.py            # tiny model, builtin data, CPU or GPUs
    python train_pipeline_tracer.py --steps 20                       # one process, one stage
    torchrun --nproc_per_node 2 train_pipeline_tracer.py --schedule interleaved1f1b   # 2 stages per rank
    torchrun --nproc_per_node 4 train_pipeline_tracer.py --model llama-1b \\
        --data hf:HuggingFaceFW/fineweb:sample-10BT --tokenizer bpe_50K.json

How the model is split: every rank builds the *full* model on the meta device and traces one microbatch of
it with torch.export (meta tensors: shapes only, no memory, no compute). pipeline() cuts the graph before the
first layer of every stage but the first (SplitPoint.BEGINNING at "base_model.layers.K", layers spread as in
the other scripts); the parts keep the full model's parameter names. Each rank then allocates only its own
part and initializes every tensor from its full-model name, so the weights, losses and checkpoints are those of
train_pipeline_gpipe.py. The traced graph is fixed to the microbatch shape (--batch-size / --microbatches,
--seq-len) and to what the model's Python code computed while tracing; the README says what that means.
Every schedule of the GPipe script works here too: with several stages per rank, the model is traced into
p * V stages and the rank builds each of its own (looped or V-shaped placement, as there), then gathers their
parameters into one module for the optimizer and checkpoints.
"""

import dataclasses
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.pipelining import SplitPoint, pipeline

import checkpoint
import data
import flags
import plan
import preflight
import runtime
import split
import timeline
import training
from model import LlamaForPretraining, init_tensor_
from train_pipeline_gpipe import (SCHEDULES, check_schedule, eval_function, rank_stages, schedule_for,
                                  step_function)


# ----------------------------------------------------------------------------------------------------------
# The split: trace the whole model on the meta device, materialize only this rank's part

def split_spec(num_layers: int, num_stages: int, layout: list[range] | None = None) -> dict[str, SplitPoint]:
    """A split before the first layer of every stage but the first: the layout of the hand-split script
    (split.py; default: even)."""
    return {f"base_model.layers.{layers.start}": SplitPoint.BEGINNING
            for layers in (layout or split.even(num_layers, num_stages))[1:]}


def trace(model: torch.nn.Module, example: torch.Tensor, spec: dict[str, SplitPoint]):
    """Trace a (meta) model into a pipeline; also each stage's {traced name: full-model name}, checked."""
    full_name = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    canonical = {name: full_name[id(t)] for name, t in [*model.named_parameters(remove_duplicate=False),
                                                        *model.named_buffers(remove_duplicate=False)]}
    with warnings.catch_warnings():  # torch.export's own use of a deprecated pytree class, not ours to fix
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        pipe = pipeline(model, mb_args=(example,), split_spec=spec)
    if pipe.num_stages != len(spec) + 1:
        raise RuntimeError(f"the tracer made {pipe.num_stages} stages out of {len(spec)} split points")
    # The stages hold the model's own tensor objects (still on meta), so identity gives each traced name its
    # full-model name whatever the tracer calls it; a tensor it copied is known by its name. A tensor the model
    # does not own (a lifted constant) would have no initializer, and one weight held as two tensors (tied
    # weights used by two stages) would be trained as two copies that nothing keeps equal.
    names, holders = [], {}
    for i in range(pipe.num_stages):
        tensors = [*pipe.get_stage_module(i).named_parameters(), *pipe.get_stage_module(i).named_buffers()]
        names.append({name: full_name.get(id(t), canonical.get(name)) for name, t in tensors})
        strangers = [name for name, full in names[-1].items() if full is None]
        if strangers:
            raise RuntimeError(f"stage {i} holds tensors that are not the model's: {strangers}")
        for name, t in tensors:
            holders.setdefault(names[-1][name], set()).add((i, id(t)))
    for full, held in holders.items():
        if len(held) > 1:
            raise RuntimeError(f"{full} is held as {len(held)} separate tensors by stages "
                               f"{sorted({i for i, _ in held})} (tied weights?): each copy would be trained on "
                               "its own; untie it or keep every use of it in one stage")
    if missing := set(full_name.values()) - holders.keys():
        raise RuntimeError(f"no stage holds {sorted(missing)}")
    return pipe, names


def build_traced_stage(config, stage: int, num_stages: int, device: torch.device, seed: int,
                       microbatch_shape: tuple[int, int], mesh: runtime.Mesh | None = None):
    """One PipelineStage and its module, with the weights the full model would have for the same seed."""
    built, module = build_traced_stages(config, [stage], num_stages, device, seed, microbatch_shape, mesh)
    return built[0], module


def build_traced_stages(config, stages: list[int], num_stages: int, device: torch.device, seed: int,
                        microbatch_shape: tuple[int, int], mesh: runtime.Mesh | None = None,
                        layout: list[range] | None = None, activation_checkpointing: bool = False,
                        compile: bool = False):
    """This rank's PipelineStages, and one module holding all their parameters under full-model names. With a
    mesh, the stages talk over its pipeline group and are sharded over its dp replicas (FSDP2). layout: the
    layers of each stage (split.py; default: even)."""
    with torch.device("meta"):  # shapes only: neither the model nor the trace allocates or computes anything
        # Traced untied: pipeline() would give the head's stage a copy of a tied embedding that nothing keeps
        # equal. The copies are initialized equal (init_tensor_ knows the tie) and kept equal in training
        # (training.TiedEmbedding), as in the hand split; on one stage they are tied back into one tensor.
        model = LlamaForPretraining(dataclasses.replace(config, tie_word_embeddings=False))
        example = torch.zeros(microbatch_shape, dtype=torch.long)
    not_persistent = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    pipe, all_names = trace(model, example, split_spec(config.num_hidden_layers, num_stages, layout))
    modules = []
    for stage in stages:
        module, names = pipe.get_stage_module(stage), all_names[stage]
        renamed = {k: v for k, v in names.items() if k != v}
        if renamed:  # checkpoint.py saves under the module's own names; they must be the full model's
            raise RuntimeError(f"the tracer renamed tensors, checkpoints would not match the other scripts: "
                               f"{renamed}")
        # The tracer re-registers every buffer as persistent; inv_freq is derived from the config and the other
        # scripts do not save it, so restore the original flag or checkpoints would differ by those keys.
        for prefix, sub in module.named_modules():
            for buffer in sub._buffers:
                if (f"{prefix}.{buffer}" if prefix else buffer) in not_persistent:
                    sub._non_persistent_buffers_set.add(buffer)
        module.to_empty(device=device)  # allocates this stage only, uninitialized: every tensor is set below
        if num_stages == 1 and config.tie_word_embeddings:
            module.get_submodule("lm_head").weight = module.get_submodule("base_model.embed_tokens").weight
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            init_tensor_(names.get(name, name), tensor, seed, config)
        modules.append(module)
    if activation_checkpointing:  # on the traced layers, which keep their names (base_model.layers.K)
        training.checkpoint_layers(modules)
    if compile:
        training.compile_layers(modules)
    if mesh is not None:  # the traced layers keep their names (base_model.layers.K): shard them as the others
        training.shard_replicas(modules, mesh)
    # build_stage also rewrites the device that tracing burned into ops like arange (meta) to this rank's.
    group = mesh.group("pp") if mesh is not None else None
    built = [_without_self_sends(pipe.build_stage(stage, device, group=group)) for stage in stages]
    # The stages' submodules run their graphs through torch.fx.Interpreter, some microseconds of Python per op
    # (5 ms per forward + backward of the tiny model); their generated code runs the same graph at eager speed.
    # A private switch in torch 2.13; without it the stages are only slower.
    for sub in (sub for module in modules for sub in module.modules()):
        if hasattr(sub, "_run_with_interpreter"):
            sub._run_with_interpreter = False
    return built, modules[0] if len(modules) == 1 else _merged(modules)


def _without_self_sends(stage):
    """The stage, made to skip the links to neighbours on its own rank when it warms up its links.

    Before the first step, torch 2.13's traced stage opens the link to each neighbouring stage with a small
    send/recv, also when that neighbour is on this same rank (the V-shaped schedules put stages r and
    2p - 1 - r on rank r, so p - 1 and p meet on the last rank). A rank cannot send to itself over gloo
    ("Pair is not connected"); the schedules pass tensors between same-rank stages in memory anyway, and the
    hand-split PipelineStage skips those links the same way. The method replaced is private in torch 2.13;
    the V-shaped tests in test_small.py fail if a newer torch changes it."""
    open_links, me = stage._get_init_p2p_neighbors_ops, dist.get_rank()
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in open_links() if op.peer != me]
    return stage


def _merged(modules: list[torch.nn.Module]) -> torch.nn.Module:
    """One module holding the parameters of several stage modules under their (full-model) names, for the
    optimizer and checkpoints. The parameters are shared, not copied: training the stages trains these."""
    root = torch.nn.Module()
    for module in modules:
        for name, param in module.named_parameters():
            *path, leaf = name.split(".")
            node = root
            for part in path:
                if part not in node._modules:
                    node.add_module(part, torch.nn.Module())
                node = node._modules[part]
            node.register_parameter(leaf, param)
    return root


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
    started = time.perf_counter()
    microbatch = (args.batch_size // (args.dp * args.microbatches), args.seq_len)
    built, model = build_traced_stages(config, stages, num_stages, env.device, args.seed, microbatch, env.mesh,
                                       layout, args.activation_checkpointing, args.compile)
    trace_seconds = [None] * env.world_size  # the one-time cost of tracing and building, every rank's
    dist.all_gather_object(trace_seconds, time.perf_counter() - started)
    model.train()
    recorder = timeline.Recorder() if args.trace else None
    if recorder is not None:
        recorder.instrument(built)
    schedule = schedule_for(args.schedule, built, args.microbatches, recorder)
    say(split.describe_run(name, config, env, f"{args.schedule}, split by the tracer (pipeline + SplitPoint)",
                           layout, costs), flush=True)
    say("traced and built the stages in " + ", ".join(f"{t:.2f}" for t in trace_seconds) + " s (per rank)",
        flush=True)
    if loader is not None:
        say(f"data: {loader.describe()}", flush=True)

    # --- optimizer, resume, training loop, checkpoints, summary: the same for every script
    training.train(args, env, model, step_function(schedule, env, recorder),
                   eval_function(schedule, built, env, recorder, args.schedule, args.microbatches,
                                 (*microbatch, config.hidden_size)), config, tokenizer, loader,
                   has_first=has_first, has_last=has_last, say=say)


if __name__ == "__main__":
    runtime.run(main, flags.build_parser(__doc__, list(SCHEDULES), stages_per_rank=True).parse_args())
