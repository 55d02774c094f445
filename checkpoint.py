"""Distributed checkpoints for pipeline-split models.

Each rank saves only what its stage holds, with `torch.distributed.checkpoint` (DCP), under the *full* model's
parameter names; no rank ever gathers the whole model. Because names do not depend on the split, a checkpoint
can be loaded by any stage layout: each stage asks DCP for exactly its own keys.

Layout of --checkpoint-dir:

    step-00000100/          one complete checkpoint: DCP shards (*.distcp), .metadata, and meta.json
    step-00000200.tmp/      a save in progress; renamed to step-00000200 only after every rank has finished

A directory without the .tmp suffix is always complete, so a run killed during a save leaves the previous
checkpoint intact.
"""

import json
import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from runtime import UsageError

_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Optimizer state and hyperparameters keyed by parameter FQN ("optim.state.<fqn>.exp_avg",
# "optim.param_groups.<fqn>.lr"). The default keys param groups by their index; every stage has a group 0 with
# different parameters in it, DCP keeps only one rank's copy of such a shared key, and the others lose theirs.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step-{step:08d}")


def latest(checkpoint_dir: str) -> str | None:
    """The newest complete checkpoint in checkpoint_dir, or None."""
    if not os.path.isdir(checkpoint_dir):
        return None
    steps = [int(m.group(1)) for name in os.listdir(checkpoint_dir) if (m := _STEP_DIR.match(name))
             and os.path.isfile(os.path.join(checkpoint_dir, name, "meta.json"))]
    return step_dir(checkpoint_dir, max(steps)) if steps else None


def save(checkpoint_dir: str, step: int, model, optimizer, meta: dict, rank: int) -> str:
    """Save this rank's stage, collectively with every rank. Returns the finished checkpoint's path."""
    final = step_dir(checkpoint_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    state = _state(model, optimizer)
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every shard is on disk before the checkpoint becomes visible
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, step=step), f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(path: str, model, optimizer) -> dict:
    """Load this rank's stage from the checkpoint at path, collectively. Returns its meta.json."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--checkpoint-dir: {path} is not a complete checkpoint ({e})") from None
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=_OPTIONS)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIONS)
    return meta


def _state(model, optimizer) -> dict:
    return {"model": get_model_state_dict(model, options=_OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIONS)}
