"""Pipeline schedules as pure data (megatron/core/pipeline/orders.py): upstream's zero-bubble H1 and Megatron's
interleaved order op for op (the tables of DESIGN issue 42, verbatim), every micro-batch's F, B and W exactly once,
no deadlock under non-blocking sends, and the planner's closed forms (megatron/perf/schedules.py) equal to the
simulated makespan."""

from __future__ import annotations

import pytest

from megatron.core.pipeline.orders import (
    BW,
    B,
    F,
    W,
    Op,
    forward_only_order,
    interleaved_order,
    interleaved_warmup,
    one_f_one_b_order,
    train_order,
    zbh1_order,
)
from megatron.core.pipeline.simulate import Deadlock, Times, schedule_makespan, simulate
from megatron.perf.schedules import bubble_fraction, held, pipeline_time

ZB_DEFAULT_P4_M8 = [
    "F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7",
    "F0 F1 F2 B0 F3 BW1 F4 BW2 F5 BW3 F6 BW4 F7 B5 W0 B6 W5 B7 W6 W7",
    "F0 F1 B0 F2 B1 F3 BW2 F4 BW3 F5 BW4 F6 BW5 F7 B6 W0 B7 W1 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 BW3 F4 BW4 F5 BW5 F6 BW6 F7 B7 W0 W1 W2 W7",
]
ZB_EXACT_P4_M8 = [
    "F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7",
    "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
    "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
    "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
]
INTERLEAVED_P4_M8_V2 = [  # Megatron's order; "BW" is a combined backward (its "B")
    "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 F0.5 F0.6 BW1.0 F0.7 BW1.1 F1.4 BW1.2 F1.5 BW1.3 F1.6 BW0.0 "
    "F1.7 BW0.1 BW0.2 BW0.3 BW1.4 BW1.5 BW1.6 BW1.7 BW0.4 BW0.5 BW0.6 BW0.7",
    "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 BW1.0 F0.5 BW1.1 F0.6 BW1.2 F0.7 BW1.3 F1.4 BW0.0 F1.5 BW0.1 "
    "F1.6 BW0.2 F1.7 BW0.3 BW1.4 BW1.5 BW1.6 BW1.7 BW0.4 BW0.5 BW0.6 BW0.7",
    "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 BW1.0 F1.3 BW1.1 F0.4 BW1.2 F0.5 BW1.3 F0.6 BW0.0 F0.7 BW0.1 F1.4 BW0.2 "
    "F1.5 BW0.3 F1.6 BW1.4 F1.7 BW1.5 BW1.6 BW1.7 BW0.4 BW0.5 BW0.6 BW0.7",
    "F0.0 F0.1 F0.2 F0.3 F1.0 BW1.0 F1.1 BW1.1 F1.2 BW1.2 F1.3 BW1.3 F0.4 BW0.0 F0.5 BW0.1 F0.6 BW0.2 F0.7 BW0.3 "
    "F1.4 BW1.4 F1.5 BW1.5 F1.6 BW1.6 F1.7 BW1.7 BW0.4 BW0.5 BW0.6 BW0.7",
]
SIZES = [(p, m) for p in range(2, 9) for m in range(1, 33)]


def _labels(ops, chunked=False) -> str:
    return " ".join(op.label(chunked) for op in ops)


def test_zbh1_orders_are_upstreams_at_p4_m8():
    assert [_labels(zbh1_order(4, 8, s)) for s in range(4)] == ZB_DEFAULT_P4_M8
    assert [_labels(zbh1_order(4, 8, s, exact=True)) for s in range(4)] == ZB_EXACT_P4_M8
    # Upstream's README: the default variant applies the last stage's weight gradients as 4,5,6,7,1,2,3,8 (1-based).
    last = zbh1_order(4, 8, 3)
    assert [op.mb + 1 for op in last if op.kind in (W, BW)] == [4, 5, 6, 7, 1, 2, 3, 8]


def test_interleaved_order_is_megatrons_at_p4_m8_v2():
    assert [_labels(interleaved_order(4, 8, 2, r), chunked=True) for r in range(4)] == INTERLEAVED_P4_M8_V2
    assert [interleaved_warmup(4, 8, 2, r) for r in range(4)] == [10, 8, 6, 4]
    assert interleaved_warmup(4, 4, 2, 0) == 8  # m == p: every forward first
    with pytest.raises(ValueError, match="multiple of 4"):
        interleaved_order(4, 6, 2, 0)


@pytest.mark.parametrize("p,m", SIZES)
def test_every_micro_batch_once_in_order_without_deadlock(p, m):
    for exact in (False, True):
        orders = [zbh1_order(p, m, s, exact) for s in range(p)]
        for s, ops in enumerate(orders):
            if s == 0:  # nobody waits on the first stage's input gradients: it never defers
                assert {op.kind for op in ops} == {F, BW}
            assert sorted(op.mb for op in ops if op.kind == F) == list(range(m))
            assert sorted(op.mb for op in ops if op.kind in (B, BW)) == list(range(m))
            assert sorted(op.mb for op in ops if op.kind in (W, BW)) == list(range(m))
            split = [op.mb for op in ops if op.kind == B]
            assert [op.mb for op in ops if op.kind == W] == split  # W takes the oldest B (FIFO)
            for op in ops:
                if op.kind == W:
                    assert ops.index(Op(B, op.mb)) < ops.index(op)
            if exact:  # the exact variant accumulates weight gradients in micro-batch order, as 1F1B
                assert [op.mb for op in ops if op.kind in (W, BW)] == list(range(m))
        simulate(orders, Times())  # raises Deadlock
    simulate([one_f_one_b_order(p, m, s) for s in range(p)], Times())
    if m % p == 0:
        for v in (2, 3):
            orders = [interleaved_order(p, m, v, r) for r in range(p)]
            for ops in orders:
                assert sorted((op.chunk, op.mb) for op in ops if op.kind == F) == \
                    sorted((c, mb) for c in range(v) for mb in range(m))
            simulate(orders, Times(1 / v, 1 / v, 1 / v), v)


def test_a_cycle_is_a_deadlock():
    with pytest.raises(Deadlock, match="wait on each other"):  # stage 0 waits for a gradient before its forward
        simulate([[Op(BW, 0), Op(F, 0)], [Op(F, 0), Op(BW, 0)]], Times())


@pytest.mark.parametrize("times", [Times(1, 1, 1), Times(1, 2, 1), Times(1, 1, 1.5), Times(2, 1, 1),
                                   Times(1, 1, 0.5)], ids=lambda t: f"f{t.f}b{t.b}w{t.w}")
def test_closed_forms_equal_the_simulator(times):
    f, b, w = times.f, times.b, times.w
    for p, m in SIZES:
        for schedule in ("1f1b", "zbh1", "zbh1-exact"):
            assert schedule_makespan(schedule, p, m, times) == pytest.approx(
                pipeline_time(schedule, p, m, f, b, w).total), (schedule, p, m)
        if m % p == 0:
            for v in (2, 4):
                chunk = Times(f / v, b / v, w / v)
                assert schedule_makespan("interleaved", p, m, chunk, v) == pytest.approx(
                    pipeline_time("interleaved", p, m, f, b, w, v).total), (p, m, v)


def test_the_theoretical_ratios_of_the_bench():
    one = pipeline_time("1f1b", 4, 8, 1, 1, 1).total
    assert one == 33
    assert pipeline_time("zbh1", 4, 8, 1, 1, 1).total / one == pytest.approx(27 / 33)  # 0.818x
    assert pipeline_time("interleaved", 4, 8, 1, 1, 1, v=2).total / one == pytest.approx(28.5 / 33)  # 0.864x
    assert pipeline_time("zbh1", 4, 8, 1, 2, 1).total == 38  # unequal times: 38 against 1F1B's 44
    # ZB-H1's bubble is a third of 1F1B's at F = B = W, from m = p on.
    assert pipeline_time("zbh1", 8, 16, 1, 1, 1).bubble * 3 == pipeline_time("1f1b", 8, 16, 1, 1, 1).bubble
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)


def test_what_stages_hold_in_flight():
    # 1F1B: stage s holds min(p - s, m) micro-batches; ZB-H1 at most the same activations, plus deferred inputs.
    for s in range(4):
        assert held("1f1b", 4, 8, s, 1.0).activations == 4 - s
        zb = held("zbh1", 4, 8, s, 1.0, 0.5)
        assert zb.activations <= 4 - s and zb.deferred <= s + 1  # s pending W, s + 1 for an instant
        assert held("zbh1-exact", 4, 8, s, 1.0, 0.5).deferred == (s + 1 if s else 0)
    assert held("zbh1", 4, 8, 3, 1.0, 0.5).deferred == 4  # the last stage: p - 1 pending W, and its newest B
    # Interleaved v=2 (Megatron): rank r holds warm-up + 1 chunks, 11/9/7/5 halves of a stage at p=4, m=8.
    assert [held("interleaved", 4, 8, r, 1.0, v=2).activations for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    # Rank 0 holds (p + (p - 1)/v) stage-micro-batches: +37.5% over 1F1B at p=4, v=2.
    assert held("interleaved", 4, 8, 0, 1.0, v=2).peak_bytes / held("1f1b", 4, 8, 0, 1.0).peak_bytes == 1.375


def test_forward_only_orders_feed_forward():
    assert _labels(forward_only_order(4, 3)) == "F0 F1 F2"
    ops = forward_only_order(2, 4, 2)
    assert _labels(ops, chunked=True) == "F0.0 F0.1 F1.0 F1.1 F0.2 F0.3 F1.2 F1.3"
    assert train_order("zbh1", 4, 8, 1) == zbh1_order(4, 8, 1)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        train_order("gpipe", 4, 8, 0)
