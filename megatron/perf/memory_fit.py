"""Which changes of a layout would make the memory model's estimate fit a rank's memory: the advice of the
out-of-memory check before the model is built (megatron/training/memory_check.py)."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from megatron.config import ModelConfig
from megatron.errors import ConfigError
from megatron.perf.layout import Layout
from megatron.perf.memory import estimate_memory

SHOWN = 4


def _candidates(model: ModelConfig, layout: Layout) -> list[tuple[str, str, dict]]:
    """(knob, flag text, Layout fields) for one step of each knob that lowers memory."""
    out = []
    if layout.shard_dp > 1:
        out += [("zero", f"--zero-stage {z}", {"zero_stage": z}) for z in range(layout.zero_stage + 1, 4)]
    if layout.recompute_granularity != "full":
        out.append(("recompute", "--recompute-granularity full", {"recompute_granularity": "full"}))
    mbs = layout.micro_batch_size // 2
    while mbs >= 1:
        out.append(("mbs", f"--micro-batch-size {mbs}", {"micro_batch_size": mbs}))
        mbs //= 2
    world, ulysses = layout.world_size, layout.ulysses
    for tp in (2, 4, 8):  # the same ranks: DP follows
        if tp > layout.tp and world % (tp * layout.pp * ulysses) == 0:
            out.append(("tp", f"--tensor-model-parallel-size {tp}", {"tensor_model_parallel_size": tp}))
    pp = layout.pp * 2
    while pp <= min(model.num_layers, world):
        if world % (layout.tp * pp * ulysses) == 0:
            out.append(("pp", f"--pipeline-model-parallel-size {pp}", {"pipeline_model_parallel_size": pp}))
        pp *= 2
    return out


def _estimate(model: ModelConfig, layout: Layout, fields: dict, overhead: float) -> float | None:
    """The estimate under ``fields``, None when that layout is not a valid one (the trainer would refuse it)."""
    try:
        changed = replace(layout, **fields)
        changed.validate_for(model)
    except ConfigError:
        return None
    return estimate_memory(model, changed, overhead).total


def fitting_changes(model: ModelConfig, layout: Layout, capacity: float, overhead: float) -> list[str]:
    """Changes (flags) under which the estimate fits ``capacity`` bytes: single ones first, else pairs of different
    knobs; the lightest (lowest estimate) first, at most SHOWN. Empty when nothing of the kind fits these ranks."""
    cands = _candidates(model, layout)
    fits = []
    for _, flag, fields in cands:
        est = _estimate(model, layout, fields, overhead)
        if est is not None and est <= capacity:
            fits.append((est, flag))
    if not fits:
        for (ka, fa, a), (kb, fb, b) in combinations(cands, 2):
            if ka == kb or {ka, kb} == {"tp", "pp"}:  # one change of the data-parallel size at a time
                continue
            est = _estimate(model, layout, {**a, **b}, overhead)
            if est is not None and est <= capacity:
                fits.append((est, f"{fa} with {fb}"))
    # Closest to the capacity first: the change that costs least throughput usually leaves the least headroom.
    return [flag for _, flag in sorted(fits, reverse=True)[:SHOWN]]
