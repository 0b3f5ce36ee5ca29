"""Zero-bubble H1 within 1F1B's peak memory on every stage: how many weight passes each stage may defer (the memory
limit the Zero Bubble paper's scheduler takes), from each stage's bytes per micro-batch. Pure data, as orders.py.

Upstream's order holds, on stage s right after a forward, that micro-batch's activations plus s deferred weight-gradient
inputs (the linears' inputs and output gradients); 1F1B's worst stage holds p micro-batches' activations. With equal
stages the two are the same (the paper's claim); a last stage that carries the head (final norm, logits, loss) can hold
more. The cap runs the oldest W before a forward instead, on that stage only, and costs time there (the simulator,
megatron/core/pipeline/simulate.py, says how much).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from megatron.core.pipeline.orders import B, BW, F, W, Op, train_order

ZB_SCHEDULES = ("zbh1", "zbh1-exact")


def after(op: Op, acts: int, pending: int) -> tuple[int, int]:
    """(micro-batches whose activations are held, weight passes pending) after ``op``."""
    if op.kind == F:
        return acts + 1, pending
    if op.kind == BW:
        return acts - 1, pending
    if op.kind == B:
        return acts - 1, pending + 1
    assert op.kind == W
    return acts, pending - 1


def peak_bytes(order: list[Op], act_bytes: float, deferred_bytes: float) -> float:
    """The most a rank running ``order`` holds between two ops: ``act_bytes`` per micro-batch forwarded and not yet
    backwarded, ``deferred_bytes`` per weight pass pending (as the engine's counter, memory_count.py, measures)."""
    acts = pending = 0
    most = 0.0
    for op in order:
        acts, pending = after(op, acts, pending)
        most = max(most, acts * act_bytes + pending * deferred_bytes)
    return most


def one_f_one_b_peak(p: int, m: int, act_bytes: Sequence[float]) -> float:
    """1F1B's largest stage: stage s holds min(p - s, m) micro-batches at once."""
    return max(min(p - s, m) * a for s, a in enumerate(act_bytes))


def deferral_caps(schedule: str, p: int, m: int, act_bytes: Sequence[float],
                  deferred_bytes: Sequence[float]) -> tuple[int, ...]:
    """Per stage, the most weight passes pending at a forward (orders.py ``zbh1_order``'s ``cap``) with which that
    stage's peak stays within 1F1B's largest stage; ``act_bytes[s]`` / ``deferred_bytes[s]``: one micro-batch's
    activations / weight-gradient inputs on stage s. Upstream's own count (s) where it fits, which is every stage when
    the stages are equal; 0 at worst (each W before the next forward: 1F1B's memory when a weight-gradient input is
    no larger than the activations it comes from)."""
    if schedule not in ZB_SCHEDULES:
        raise ValueError(f"deferral caps are zero-bubble H1's ({', '.join(ZB_SCHEDULES)}), not {schedule!r}'s")
    # Every stage reaches its peak by its first steady-state forward, so p + 1 micro-batches give the same peaks
    # (tests/unit/test_deferral_cap.py checks it); the planner asks for many layouts.
    return _caps(schedule, p, min(m, p + 1), tuple(act_bytes), tuple(deferred_bytes))


@functools.lru_cache(maxsize=1024)
def _caps(schedule: str, p: int, m: int, act_bytes: tuple[float, ...],
          deferred_bytes: tuple[float, ...]) -> tuple[int, ...]:
    limit = one_f_one_b_peak(p, m, act_bytes)

    def fits(s: int, cap: int) -> bool:
        return peak_bytes(train_order(schedule, p, m, s, cap=cap), act_bytes[s], deferred_bytes[s]) <= limit

    caps = []
    for s in range(p):
        lo, hi = 0, s  # the peak grows with the cap: the largest that fits, 0 if none does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(s, mid) else (lo, mid - 1)
        caps.append(lo)
    return tuple(caps)
