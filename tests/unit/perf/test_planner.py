"""The planner keeps only valid layouts that fit, best first."""

from __future__ import annotations

import pytest

from megatron.errors import ConfigError
from megatron.config.sizes import named_model
from megatron.perf.memory import GIB
from megatron.perf.planner import SearchSpace, enumerate_layouts, plan, pp_splits_sensibly


def test_enumerated_layouts_are_valid():
    m = named_model("gpt-22b")
    layouts = enumerate_layouts(m, 32, 640)
    assert len(layouts) > 100
    for lay in layouts:
        assert lay.world_size == 32
        assert lay.tp <= 8 and m.num_attention_heads % lay.tp == 0
        assert lay.zero_stage < 2 or lay.pp == 1
        assert 640 % (lay.micro_batch_size * lay.dp) == 0
        assert pp_splits_sensibly(m.num_layers, lay.pp)
        assert not (lay.sequence_parallel and lay.tp == 1)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}


def test_pp_split_rule():
    assert pp_splits_sensibly(48, 16) and pp_splits_sensibly(96, 32)
    assert not pp_splits_sensibly(96, 64)  # 2 layers on some stages, 1 on others: 33% over average
    assert pp_splits_sensibly(44, 4) and not pp_splits_sensibly(4, 8)


@pytest.mark.parametrize("capacity_gib", [64, 45])
def test_plan_returns_only_fitting_layouts_ranked(capacity_gib):
    m = named_model("gpt-22b")
    fitting, everything = plan(m, 16, 640, capacity=capacity_gib * GIB)
    assert fitting and len(fitting) < len(everything)
    assert all(c.memory.total <= capacity_gib * GIB for c in fitting)
    speeds = [c.time.model_tflops_per_gcd for c in fitting]
    assert speeds == sorted(speeds, reverse=True)
    dropped = [c for c in everything if not c.fits]
    assert all(c.memory.total > capacity_gib * GIB for c in dropped)


def test_plan_respects_search_space_and_refuses_impossible():
    m = named_model("gpt-22b")
    fitting, _ = plan(m, 16, 640, SearchSpace(tp=(2,), zero_stage=(1,), recompute_granularity=(None,)))
    assert {c.layout.tp for c in fitting} == {2} and {c.layout.zero_stage for c in fitting} == {1}
    with pytest.raises(ConfigError, match="no layout fits"):
        plan(named_model("gpt-1t"), 8, 64)
    with pytest.raises(ConfigError, match="no valid layout"):
        plan(m, 1024, 7)
