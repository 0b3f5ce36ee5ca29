"""What a checkpoint records besides weights: RNG states, the run's arguments as plain data, the TP partition of
each parameter, the format tags of our metadata, and ``Resume``: what a load hands to the loop."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from megatron.config import RunConfig
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.errors import CheckpointError
from megatron.model.param_names import canonical_name

DEEPSPEED_FORMAT = "megatron-frontier/deepspeed-v1"
"""megatron_meta.json's ``format`` of DeepSpeed's own layout (ds_layout/)."""
HZERO_FORMAT = "megatron-frontier/hierarchical-zero-v1"
"""megatron_meta.json's ``format`` of hierarchical ZeRO's per-rank shards (hzero/)."""


def rng_state() -> dict:
    """This rank's RNG states as tensors and plain Python data (safe for weights_only loading)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    get_rng_tracker().set_states(state["tracker"])


def _tuples(x):
    """random.setstate wants tuples; a round trip through some serialisers gives lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def rng_for_rank(states: list, dp_rank: int, dp_size: int) -> dict | None:
    """The saved RNG state of this DP index, or None (with the reason) when the DP size changed."""
    if len(states) != dp_size:
        return None
    if not 0 <= dp_rank < len(states):
        raise CheckpointError(f"RNG state list has {len(states)} entries, no entry for DP rank {dp_rank}")
    return states[dp_rank]


def plain_args(flags: dict) -> dict:
    """The parsed flags (``RunConfig.flags``) as JSON-able data, as upstream's checkpoints keep its ``args``
    (no pickled objects in checkpoints)."""
    return {k: v for k, v in flags.items() if v is None or isinstance(v, (bool, int, float, str))}


def plain_run(run: RunConfig) -> dict:
    """The validated settings as plain data (the record of the flags is kept apart, as 'args')."""
    return {k: v for k, v in dataclasses.asdict(run).items() if k != "flags"}


def partition_table(module: torch.nn.Module, num_layers: int) -> dict[str, list[int]]:
    """{canonical name: [partition_dim, stride]} of this rank's TP-sharded parameters."""
    return {canonical_name(n, num_layers): [int(p.partition_dim), int(getattr(p, "partition_stride", 1))]
            for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)
            and canonical_name(n, num_layers) is not None}


def apply_schedule_lr(engine) -> None:
    """The first resumed update uses the current schedule's lr (e.g. after a longer --train-iters).

    Every engine's resume ends here (DeepSpeed ZeRO-0..3, pipeline, hierarchical ZeRO): DeepSpeed restores
    the ZeRO optimizer partitions, param_groups' lr included, *after* the LR scheduler, so without this the
    first step ran at the lr the old schedule gave the saved step's successor."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "apply_schedule"):
        scheduler.apply_schedule()


@dataclass
class Resume:
    iteration: int = 0
    consumed_samples: int = 0
    path: str | None = None
    lr_num_steps: int = 0
    lr_state: dict | None = None
    """The LR schedule's state_dict (samples and tokens); None in checkpoints older than it (lr_num_steps then)."""
    rng: dict | None = None
    """Saved RNG states of this rank; applied by ``restore_rng`` right before the first iteration, because
    set-up work between loading and training (e.g. the peak-FLOPs probe) draws random numbers."""

    moments: tuple | None = None
    """(Adam moments by name, step) read along with the weights (an upstream checkpoint), for the engine's load."""

    def restore_rng(self) -> None:
        if self.rng is not None:
            set_rng_state(self.rng)
