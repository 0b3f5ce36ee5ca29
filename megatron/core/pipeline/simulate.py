"""Runs the compute orders of megatron/core/pipeline/orders.py against each other in simulated time: each rank works
through its list in order, an op starts once its inputs have arrived, sends never block (as our engine's), and a
message takes ``t_pp``. The makespan is what the planner's closed forms (megatron/perf/schedules.py) must equal; a
schedule whose ranks wait on each other in a cycle raises."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.pipeline.orders import B, BW, F, W, Op, train_order


@dataclass(frozen=True)
class Times:
    """Seconds of one op on one chunk (a whole stage's forward is ``f``; with v chunks per rank each takes f / v)."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    t_pp: float = 0.0

    def of(self, kind: str) -> float:
        return {F: self.f, B: self.b, W: self.w, BW: self.b + self.w}[kind]


class Deadlock(RuntimeError):
    pass


def simulate(orders: list[list[Op]], times: Times, v: int = 1) -> float:
    """The makespan of ranks running ``orders`` (``orders[r]``: rank r's list) with v chunks each."""
    p = len(orders)
    last = p * v - 1
    f_end: dict[tuple[int, int], float] = {}  # (virtual stage, mb) -> when its forward ended
    b_end: dict[tuple[int, int], float] = {}  # (virtual stage, mb) -> when its input gradient was ready
    clock = [0.0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                vs = op.chunk * p + r
                ready = _ready(op, vs, last, f_end, b_end, times.t_pp)
                if ready is None:
                    break
                end = max(clock[r], ready) + times.of(op.kind)
                clock[r] = end
                if op.kind == F:
                    f_end[(vs, op.mb)] = end
                elif op.kind in (B, BW):
                    b_end[(vs, op.mb)] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]].label(v > 1) for r in range(p) if pos[r] < len(orders[r])}
            raise Deadlock(f"pipeline ranks wait on each other: next ops {stuck}")
    return max(clock)


def _ready(op: Op, vs: int, last: int, f_end: dict, b_end: dict, t_pp: float) -> float | None:
    """When ``op``'s inputs are there (None: not yet)."""
    if op.kind == F:
        if vs == 0:
            return 0.0
        done = f_end.get((vs - 1, op.mb))
        return None if done is None else done + t_pp
    if op.kind == W:
        return 0.0  # its B ran earlier on this rank
    if vs == last:
        return 0.0
    done = b_end.get((vs + 1, op.mb))
    return None if done is None else done + t_pp


def schedule_makespan(schedule: str, p: int, m: int, times: Times, v: int = 1) -> float:
    """Simulated step (pipeline part) of ``schedule``; ``times`` are per chunk."""
    return simulate([train_order(schedule, p, m, r, v) for r in range(p)], times, v)
