"""RNG state tracking so dropout masks agree or differ across TP ranks exactly where Megatron's do.

Outside the tracker's fork (e.g. dropout on replicated [s, b, h] activations) every TP rank uses the
same default seed, so masks agree. Inside ``fork()`` (dropout on TP-sharded attention probabilities,
or on sequence-parallel shards) each TP rank uses ``seed + 2718 + tp_rank`` (Megatron's offset), so
masks differ. States live on the accelerator through DeepSpeed's accelerator API (CPU here).
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

_MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGStatesTracker:
    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        acc = get_accelerator()
        saved = acc.get_rng_state()
        acc.manual_seed(seed)
        self.states[name] = acc.get_rng_state()
        acc.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            yield  # no tracker seeded (single process unit use): default stream
            return
        acc = get_accelerator()
        saved = acc.get_rng_state()
        acc.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = acc.get_rng_state()
            acc.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def set_seeds(seed: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch and the accelerator. Pipeline stages get different default seeds
    (as in Megatron) so that their dropout is not correlated; TP ranks share the default seed."""
    base = seed + 100 * pp_rank
    random.seed(base)
    np.random.seed(base)
    torch.manual_seed(base)
    get_accelerator().manual_seed_all(base)
    _TRACKER.states.clear()
    _TRACKER.add("model-parallel-rng", base + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
