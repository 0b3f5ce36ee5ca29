"""Zero-bubble H1's memory cap (megatron/core/pipeline/deferral_cap.py, orders.py ``zbh1_order(cap=)``) on the
simulator, no processes: every cap gives a valid order (each op once, W after its B, no deadlock, the exact variant's
weight passes in micro-batch order), a cap never shortens the step without sends, and the caps keep every stage
within 1F1B's largest (upstream's order wherever it already does: equal stages)."""

from __future__ import annotations

import pytest

from megatron.core.pipeline.deferral_cap import deferral_caps, one_f_one_b_peak, peak_bytes
from megatron.core.pipeline.orders import BW, B, F, W, train_order, zbh1_order
from megatron.core.pipeline.simulate import Times, simulate

SIZES = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
ZB = ("zbh1", "zbh1-exact")
# The engine's counts on tests/distributed/test_pipeline_schedules.py's PP=4 layout (tiny GPT, 2 layers a stage):
# one micro-batch's activations per stage (the last with the head) and its weight-gradient inputs.
TINY_GPT_ACTS = (132352, 132096, 132096, 148948)
TINY_GPT_W_INPUTS = (131072,) * 4


def _check_order(ops, m: int, cap: int, exact: bool) -> None:
    kinds = {k: [op.mb for op in ops if op.kind == k] for k in (F, B, BW, W)}
    assert sorted(kinds[F]) == list(range(m)) and sorted(kinds[B] + kinds[BW]) == list(range(m))
    assert sorted(kinds[W]) == sorted(kinds[B])
    pending: list[int] = []
    for op in ops:
        if op.kind == F:
            assert len(pending) <= cap, ops
        elif op.kind == B:
            pending.append(op.mb)
        elif op.kind == W:
            assert op.mb in pending
            pending.remove(op.mb)
    if exact:  # the weight gradients of every micro-batch accumulate in 1F1B's order
        assert [op.mb for op in ops if op.kind in (W, BW)] == list(range(m))


@pytest.mark.parametrize("schedule", ZB)
def test_every_cap_gives_a_valid_order_without_deadlock(schedule):
    exact = schedule == "zbh1-exact"
    for p, m in SIZES:
        plain = [train_order(schedule, p, m, s) for s in range(p)]
        for cap in range(p):
            orders = [train_order(schedule, p, m, s, cap=cap) for s in range(p)]
            for s, ops in enumerate(orders):
                _check_order(ops, m, min(cap, s), exact)
                if cap >= s:
                    assert ops == plain[s], (p, m, s, cap)
            last_only = plain[:-1] + orders[-1:]
            for times in (Times(), Times(w=0.5), Times(w=2.0)):  # raises on a deadlock
                assert simulate(orders, times) >= simulate(plain, times)
                assert simulate(last_only, times) >= simulate(plain, times)
            simulate(orders, Times(t_pp=0.1))  # with sends on the path a capped stage can be faster: B sends before W


def test_a_capped_stage_runs_its_weight_passes_in_micro_batch_order():
    assert " ".join(op.label() for op in zbh1_order(4, 8, 3, cap=2)) == (
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 F5 B5 W3 F6 B6 W4 F7 B7 W5 W6 W7")
    assert zbh1_order(4, 8, 3, cap=2) == zbh1_order(4, 8, 3, exact=True, cap=2)


@pytest.mark.parametrize("schedule", ZB)
def test_equal_stages_keep_upstreams_order(schedule):
    for p, m in SIZES:
        assert deferral_caps(schedule, p, m, [1.0] * p, [0.99] * p) == tuple(range(p))
        assert deferral_caps(schedule, p, m, [0.0] * p, [0.0] * p) == tuple(range(p))  # the bench's stand-ins


@pytest.mark.parametrize("schedule", ZB)
def test_the_caps_keep_every_stage_within_1f1bs_largest(schedule):
    for p, m in SIZES:
        for head in (0.0, 0.13, 0.5, 2.0):
            acts = [1.0] * (p - 1) + [1.0 + head]
            for ratio in (0.5, 0.99, 1.0):
                deferred = [ratio] * p
                caps = deferral_caps(schedule, p, m, acts, deferred)
                limit = one_f_one_b_peak(p, m, acts)
                for s, cap in enumerate(caps):
                    assert peak_bytes(train_order(schedule, p, m, s, cap=cap), acts[s], deferred[s]) <= limit
                    if cap < s:  # the largest cap that fits
                        over = train_order(schedule, p, m, s, cap=cap + 1)
                        assert peak_bytes(over, acts[s], deferred[s]) > limit


def test_the_tiny_gpts_last_stage_defers_one_pass_less_and_pays_one_forward():
    for schedule in ZB:
        caps = deferral_caps(schedule, 4, 8, TINY_GPT_ACTS, TINY_GPT_W_INPUTS)
        assert caps == (0, 1, 2, 2)
        peaks = [peak_bytes(train_order(schedule, 4, 8, s, cap=c), a, w)
                 for s, (c, a, w) in enumerate(zip(caps, TINY_GPT_ACTS, TINY_GPT_W_INPUTS, strict=True))]
        assert peaks == [529408, 527360, 526336, 411092]  # 1F1B's largest: 4 x 132352 = 529408
        assert peak_bytes(train_order(schedule, 4, 8, 3), TINY_GPT_ACTS[3], TINY_GPT_W_INPUTS[3]) == 542164
        capped = simulate([train_order(schedule, 4, 8, s, cap=c) for s, c in enumerate(caps)], Times())
        assert capped == simulate([train_order(schedule, 4, 8, s) for s in range(4)], Times()) + 1


def test_only_zero_bubble_schedules_have_caps():
    with pytest.raises(ValueError, match="zbh1"):
        deferral_caps("1f1b", 2, 4, [1.0, 1.0], [1.0, 1.0])


@pytest.mark.parametrize("schedule", ZB)
def test_peaks_and_costs_repeat_after_the_steady_state(schedule):
    """What deferral_caps and the planner's cap_cost shorten m to: every stage peaks by its first steady-state
    forward (m = p + 1 gives every peak), and the cap's cost in time is the same from m = 2p on."""
    for p in range(2, 8):
        for cap in range(p - 1):
            caps = [min(cap, s) for s in range(p)]
            for m in range(p + 1, 3 * p + 1):
                for s in range(p):
                    for act, deferred in ((1.0, 0.5), (1.0, 1.6), (1.3, 1.0)):
                        assert peak_bytes(train_order(schedule, p, m, s, cap=caps[s]), act, deferred) == peak_bytes(
                            train_order(schedule, p, p + 1, s, cap=caps[s]), act, deferred)

            def cost(m: int, times: Times) -> float:
                return (simulate([train_order(schedule, p, m, s, cap=c) for s, c in enumerate(caps)], times)
                        - simulate([train_order(schedule, p, m, s) for s in range(p)], times))

            for times in (Times(), Times(w=0.5), Times(b=2.0)):
                assert {cost(m, times) for m in range(2 * p, 4 * p + 1)} == {cost(2 * p, times)}


@pytest.mark.parametrize("schedule", ZB)
def test_a_larger_cap_never_holds_less(schedule):
    """Why deferral_caps may bisect."""
    for p in range(2, 9):
        for m in (p, 2 * p + 1):
            for s in range(p):
                for act, deferred in ((1.0, 0.5), (1.0, 1.6), (1.3, 1.0)):
                    peaks = [peak_bytes(train_order(schedule, p, m, s, cap=c), act, deferred) for c in range(s + 1)]
                    assert peaks == sorted(peaks)
