"""What a pipeline schedule costs: its bubble in closed form (equal to the simulator's makespan,
megatron/core/pipeline/simulate.py, tests/unit/test_pipeline_schedules.py) and what each stage holds in flight.

With one micro-batch's forward ``f``, input-gradient backward ``b`` and weight-gradient pass ``w`` on the slowest
stage (``f + b + w`` = today's per-micro-batch time), ``p`` stages, ``m`` micro-batches and ``v`` chunks per rank:

    1f1b          m (f + b + w)  +  (p - 1)(f + b + w)
    zbh1 (both)   m (f + b + w)  +  (p - 1)(f + b) - (min(m, p) - 1) min(b, w)
                                 (= (p - 1)(f + max(b - w, 0)) from m = p on: a third of 1F1B's at f = b = w)
    interleaved   (m v + p - 1) (f + b + w) / v      (m a multiple of p)

Both zero-bubble variants reach the same bound in our engine because its pipeline sends never block (upstream's
exact variant, on DeepSpeed's blocking sends, is no faster than 1F1B beyond m = 2p). The interleaved schedule sends
v times per micro-batch: the caller adds each chunk's sends to its per-chunk time (``pipeline_time``'s ``t_pp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.pipeline.deferral_cap import after
from megatron.core.pipeline.orders import SCHEDULES, train_order
from megatron.core.pipeline.simulate import Times, simulate


@dataclass(frozen=True)
class PipelineTime:
    """Seconds of the pipelined part of one step: ``work`` (m micro-batches of compute and sends on the slowest
    stage) and ``bubble`` (the rest)."""

    work: float
    bubble: float

    @property
    def total(self) -> float:
        return self.work + self.bubble


def pipeline_time(schedule: str, p: int, m: int, f: float, b: float, w: float, v: int = 1,
                  t_pp: float = 0.0, caps: tuple[int, ...] | None = None) -> PipelineTime:
    """The pipelined part of a step under ``schedule`` (``SCHEDULES``). ``f, b, w``: one micro-batch through one
    whole stage, computation and its TP collectives; ``t_pp``: one stage's pipeline sends of one micro-batch (both
    directions), on the critical path: once per micro-batch, or once per chunk (v times) when interleaved. ``caps``:
    zero-bubble H1's memory cap per stage (megatron/core/pipeline/deferral_cap.py), whose cost ``cap_cost`` adds."""
    t = _pipeline_time(schedule, p, m, f, b, w, v, t_pp)
    if caps is None or schedule not in ("zbh1", "zbh1-exact"):
        return t
    return PipelineTime(t.work, t.bubble + cap_cost(schedule, p, m, f, b, w, caps))


def cap_cost(schedule: str, p: int, m: int, f: float, b: float, w: float, caps: tuple[int, ...]) -> float:
    """What zero-bubble H1's memory caps add to the step (the simulator: nothing unless a cap is below upstream's
    count, s on stage s; then typically one forward or one W per step)."""
    if all(cap >= s for s, cap in enumerate(caps)):
        return 0.0
    m = min(m, 2 * p)  # the same cost from 2p micro-batches on (tests/unit/test_deferral_cap.py)
    capped = simulate([train_order(schedule, p, m, s, cap=cap) for s, cap in enumerate(caps)], Times(f, b, w))
    return capped - _pipeline_time(schedule, p, m, f, b, w, 1, 0.0).total  # the closed form is the simulator's


def _pipeline_time(schedule: str, p: int, m: int, f: float, b: float, w: float, v: int, t_pp: float) -> PipelineTime:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    t_mb = f + b + w
    if p == 1:
        return PipelineTime(m * (t_mb + t_pp), 0.0)
    if schedule == "interleaved" and v > 1:
        t_chunk = t_mb / v + t_pp
        return PipelineTime(m * v * t_chunk, (p - 1) * t_chunk)
    if schedule in ("zbh1", "zbh1-exact"):
        # The B of the last stage starts the backward chain right after its F; W fills what 1F1B leaves idle.
        bubble = (p - 1) * (f + b + t_pp) - (min(m, p) - 1) * min(b, w)
        return PipelineTime(m * (t_mb + t_pp), bubble)
    return PipelineTime(m * (t_mb + t_pp), (p - 1) * (t_mb + t_pp))


def bubble_fraction(schedule: str, p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0,
                    v: int = 1) -> float:
    """The bubble's share of the pipelined part (1F1B: (p - 1) / (m + p - 1))."""
    t = pipeline_time(schedule, p, m, f, b, w, v)
    return t.bubble / t.total


@dataclass(frozen=True)
class Held:
    """The most one stage holds at once over a step, in units of one micro-batch through the whole stage: its
    activations (``activations``; interleaved counts a chunk as 1/v), the weight-gradient inputs its B passes left
    for W (``deferred``), and their sum at the worst instant (``peak_bytes``, with the byte sizes given)."""

    activations: float
    deferred: float
    peak_bytes: float


def held(schedule: str, p: int, m: int, stage: int, act_bytes: float, deferred_bytes: float = 0.0,
         v: int = 1, cap: int | None = None) -> Held:
    """What ``stage`` holds under ``schedule`` (zero-bubble H1: with its memory ``cap`` on this stage), walking its
    compute order: a forward adds one chunk's activations (``act_bytes / v``); a B trades them for its weight-gradient
    inputs (``deferred_bytes / v``) until its W; a combined backward drops them. Counted between instructions, as the
    engine's counter measures them."""
    v = v if schedule == "interleaved" else 1
    ops = train_order(schedule, p, m, stage, v, cap=cap)
    acts = pending = 0
    most = [0, 0, 0.0]
    for op in ops:
        acts, pending = after(op, acts, pending)
        most[0], most[1] = max(most[0], acts), max(most[1], pending)
        most[2] = max(most[2], (acts * act_bytes + pending * deferred_bytes) / v)
    return Held(most[0] / v, most[1] / v, most[2])


def schedule_flags(schedule: str, layers_per_chunk: int | None = None) -> str:
    """The command-line flags that choose ``schedule`` (upstream's spelling)."""
    return {"1f1b": "", "zbh1": "--enable-zbh1-pipeline",
            "zbh1-exact": "--enable-zbh1-pipeline --enable-zbh1-exact-semantics",
            "interleaved": f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk}"}[schedule]


def bubble_line(parallel, num_layers: int, microbatches: int, caps: tuple[int, ...] | None = None) -> str:
    """The dry run's and the layout report's line: ``parallel``'s (a ParallelConfig) schedule and its predicted
    bubble, with forward = input-gradient = weight-gradient time, beside 1F1B's; under zero-bubble H1 with ``caps``
    (megatron/perf/memory.py ``zbh1_caps``) below upstream's count, which stages defer fewer and what it costs."""
    schedule, v = parallel.pipeline_schedule, parallel.virtual_stages(num_layers)
    p = parallel.pp
    t = pipeline_time(schedule, p, microbatches, 1.0, 1.0, 1.0, v, caps=caps)
    chunks = f", {v} model chunks per rank" if v > 1 else ""
    base = "" if schedule == "1f1b" else f" (1F1B: {100 * bubble_fraction('1f1b', p, microbatches):.1f}%)"
    line = (f"pipeline schedule {schedule}{chunks}: predicted bubble {100 * t.bubble / t.total:.1f}% of the "
            f"pipelined time{base}")
    capped = [f"stage {s} {cap} of {s}" for s, cap in enumerate(caps or ()) if cap < s]
    if capped:
        cost = cap_cost(schedule, p, microbatches, 1.0, 1.0, 1.0, caps)
        line += (f"; memory cap (1F1B's peak): weight passes deferred {', '.join(capped)}, +{cost:g} forward "
                 "time per step")
    return line
