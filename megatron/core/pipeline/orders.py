"""The compute order of each pipeline schedule on one rank, as pure data (no torch, no DeepSpeed): the planner's
simulator, the unit tests and the engine's instruction lists (megatron/core/pipeline/schedules.py) read the same lists.

An ``Op`` is one compute of one micro-batch ``mb`` on one model chunk ``chunk`` of this rank:

    F   forward                          BW  backward, input and weight gradients together (DeepSpeed's BackwardPass)
    B   backward, input gradients only   W   the weight gradients a B left behind (zero-bubble H1)

Chunk ``c`` of rank ``r`` in a pipeline of ``p`` ranks is the virtual stage ``c * p + r`` (Megatron's interleaved
layout); with one chunk per rank that is the stage itself.
"""

from __future__ import annotations

from typing import NamedTuple

F, B, BW, W = "F", "B", "BW", "W"
SCHEDULES = ("1f1b", "zbh1", "zbh1-exact", "interleaved")
"""The schedule names: DeepSpeed's 1F1B, upstream's zero-bubble H1 (default and exact semantics), Megatron's
interleaved 1F1B."""


class Op(NamedTuple):
    kind: str
    mb: int
    chunk: int = 0

    def label(self, chunked: bool = False) -> str:
        """The tables' notation: F3, BW1, W0; with ``chunked``, F1.2 is chunk 1, micro-batch 2."""
        return f"{self.kind}{self.chunk}.{self.mb}" if chunked else f"{self.kind}{self.mb}"


def one_f_one_b_order(p: int, m: int, s: int) -> list[Op]:
    """DeepSpeed's TrainSchedule on stage ``s``: p - s - 1 warm-up forwards, then one forward and one backward, then
    the remaining backwards (its compute order; its sends are blocking)."""
    warmup = min(p - s - 1, m)
    ops = [Op(F, mb) for mb in range(warmup)]
    for k in range(m - warmup):
        ops += [Op(F, warmup + k), Op(BW, k)]
    return ops + [Op(BW, mb) for mb in range(m - warmup, m)]


def zbh1_order(p: int, m: int, s: int, exact: bool = False, cap: int | None = None) -> list[Op]:
    """Upstream Megatron-DeepSpeed's ZeroBubbleH1Pipeline (deepspeed_zbh1_schedule.py) on stage ``s``, op for op.

    Sections: p - s - 1 forwards; s pairs F, B; then F with a backward while forwards remain (stage 0: BW; default:
    BW, except the last one, B then W; exact: B then W); then the remaining backwards (stage 0: BW, else B then W);
    then the W still pending. W always takes the oldest pending B (FIFO): the exact variant therefore applies every
    micro-batch's weight gradients in order 0..m-1, as 1F1B; the default applies some out of order.

    ``cap`` (the memory cap, megatron/core/pipeline/deferral_cap.py): a forward starts with at most ``cap`` weight
    passes pending; the oldest run just before it. Upstream's order never has more than ``s`` pending at a forward,
    so a cap >= s changes nothing. Below s the stage's steady state is the exact variant's (B then W, never slower
    in the simulator than BW with the cap: tests/unit/test_deferral_cap.py). A W waits on nothing but its own B, so
    running it earlier cannot deadlock.
    """
    split_steady = exact or (cap is not None and cap < s)
    ops: list[Op] = []
    pending: list[int] = []
    f = b = 0

    def forward() -> None:
        nonlocal f
        while cap is not None and len(pending) > cap:
            weight()
        ops.append(Op(F, f))
        f += 1

    def backward(split: bool) -> None:
        nonlocal b
        ops.append(Op(B if split else BW, b))
        if split:
            pending.append(b)
        b += 1

    def weight() -> None:
        ops.append(Op(W, pending.pop(0)))

    for _ in range(min(p - s - 1, m)):
        forward()
    for _ in range(min(s, m - f)):
        forward()
        backward(split=True)
    while f < m:
        forward()
        if s == 0:
            backward(split=False)
        elif f == m or split_steady:
            backward(split=True)
            weight()
        else:
            backward(split=False)
    while b < m:
        if s == 0:
            backward(split=False)
        else:
            backward(split=True)
            weight()
    while pending:
        weight()
    return ops


def interleaved_warmup(p: int, m: int, v: int, r: int) -> int:
    """Forwards rank ``r`` runs before its first backward (Megatron's forward_backward_pipelining_with_interleaving):
    all of them when m == p."""
    total = m * v
    return total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)


def _interleaved_mb(p: int, v: int, k: int) -> tuple[int, int]:
    """(chunk position in its group, micro-batch) of the k-th forward (or backward) of any rank."""
    return (k % (p * v)) // p, (k // (p * v)) * p + k % p


def interleaved_order(p: int, m: int, v: int, r: int) -> list[Op]:
    """Megatron's interleaved 1F1B on rank ``r`` with ``v`` chunks: forwards in groups of p micro-batches per chunk,
    chunk 0 to v-1 (backwards v-1 to 0), warm-up forwards, then one forward and one backward, then the rest.
    Every rank runs its forwards in the same (chunk, micro-batch) sequence, so each link carries them in order.
    Needs m % p == 0 (as Megatron)."""
    if m % p:
        raise ValueError(f"interleaved schedule: {m} micro-batches is not a multiple of {p} stages")
    total, warmup = m * v, interleaved_warmup(p, m, v, r)

    def fwd(k: int) -> Op:
        c, mb = _interleaved_mb(p, v, k)
        return Op(F, mb, c)

    def bwd(k: int) -> Op:
        c, mb = _interleaved_mb(p, v, k)
        return Op(BW, mb, v - 1 - c)

    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(k + warmup), bwd(k)]
    return ops + [bwd(k) for k in range(total - warmup, total)]


def forward_only_order(p: int, m: int, v: int = 1) -> list[Op]:
    """Evaluation: every forward in the interleaved forward sequence (micro-batch order when v == 1). Every input of
    the k-th forward comes from a forward with a smaller k, so no rank waits on itself."""
    if v == 1:
        return [Op(F, mb) for mb in range(m)]
    return [Op(F, mb, c) for c, mb in (_interleaved_mb(p, v, k) for k in range(m * v))]


def train_order(schedule: str, p: int, m: int, r: int, v: int = 1, cap: int | None = None) -> list[Op]:
    """The compute order of ``schedule`` (one of ``SCHEDULES``) on rank ``r``; ``cap``: zero-bubble H1's memory cap
    on this rank (``zbh1_order``)."""
    if schedule == "1f1b":
        return one_f_one_b_order(p, m, r)
    if schedule in ("zbh1", "zbh1-exact"):
        return zbh1_order(p, m, r, exact=schedule == "zbh1-exact", cap=cap)
    if schedule == "interleaved":
        return interleaved_order(p, m, v, r)
    raise ValueError(f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
