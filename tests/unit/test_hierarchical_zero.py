"""Hierarchical ZeRO without processes: tier groups, int8 round trip, config refusals, CLI -> ds_config, perf model."""

import pytest
import torch

from megatron.core.hierarchical_zero import SECTION, from_ds_config, level_groups
from megatron.core.hierarchical_zero.accounting import tier_bytes
from megatron.core.hierarchical_zero.quant import dequantize, quantize
from megatron.core.parallel_state import layout_groups
from megatron.errors import ConfigError
from megatron.topology import frontier_placement

LEVELS = ("package", "node", "network")
LEVELS_TEXT = ",".join(LEVELS)  # --zero-hierarchy's form


def test_groups_on_2_nodes_x_2_packages_x_2_gcds():
    g = level_groups(layout_groups(8, 1, 1)["dp"], frontier_placement(8, 4), LEVELS)
    assert g == {"package": [[0, 1], [2, 3], [4, 5], [6, 7]], "node": [[0, 2], [1, 3], [4, 6], [5, 7]],
                 "network": [[0, 4], [1, 5], [2, 6], [3, 7]]}


def test_groups_with_tp2_inside_a_package_skip_the_package_level():
    g = level_groups(layout_groups(8, 2, 1)["dp"], frontier_placement(8, 4), LEVELS)
    assert all(len(x) == 1 for x in g["package"])
    assert g["node"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert g["network"] == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_groups_on_real_frontier_nodes():
    g = level_groups(layout_groups(32, 1, 1)["dp"], frontier_placement(32, 8), ("node", "network"))
    assert g["node"] == [list(range(n * 8, n * 8 + 8)) for n in range(4)]
    assert g["network"][3] == [3, 11, 19, 27]


def test_uneven_nodes_are_refused():
    # 6 ranks at 4 per node: 4 on one node, 2 on the other.
    with pytest.raises(ConfigError, match="unevenly"):
        level_groups([list(range(6))], frontier_placement(8, 4), LEVELS)


def test_int8_blockwise_error_is_half_a_step_of_its_block():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.linspace(0.01, 100, 4096)  # blocks with very different ranges
    q, scale = quantize(x, 256)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    err = (dequantize(q, scale, 256) - x).abs().view(16, 256)
    assert (err.amax(dim=1) <= scale / 2 + 1e-6).all()


def test_config_section_checks():
    assert from_ds_config({}) is None
    h = from_ds_config({SECTION: {"zero_hierarchy": "package,node,network", "ranks_per_node": 4}})
    assert h.levels == LEVELS and h.weights == "node" and not h.int8
    for bad in (["node", "package", "network"], ["package", "node"], ["rack", "network"]):
        with pytest.raises(ConfigError, match="--zero-hierarchy"):
            from_ds_config({SECTION: {"zero_hierarchy": bad}})
    assert from_ds_config({SECTION: {"zero_hierarchy": ["package", "network"]}}).weights == "package"
    with pytest.raises(ConfigError, match="--zero-hierarchy-weights"):
        from_ds_config({SECTION: {"zero_hierarchy": ["node", "network"], "zero_hierarchy_weights": "package"}})
    with pytest.raises(ConfigError, match="unknown keys"):
        from_ds_config({SECTION: {"zero_hierarchy": ["network"], "zero_hpz_size": 2}})


def _run(**parallel):
    import dataclasses

    from tests.distributed.hzero_probe import run_config

    run = run_config(8, 1, "ours", 8, 10)
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, **parallel))


def test_cli_flags_fill_the_ds_config_section():
    from megatron.arguments import build_parser

    from megatron.engine import build_ds_config

    args = build_parser().parse_args(["--zero-stage", "3", "--zero-hierarchy", "package,node,network",
                                      "--zero-hierarchy-int8", "--zero-hierarchy-weights", "package"])
    run = _run(zero_hierarchy=args.zero_hierarchy, zero_hierarchy_int8=args.zero_hierarchy_int8,
               zero_hierarchy_weights=args.zero_hierarchy_weights)
    cfg = build_ds_config(run)
    assert cfg[SECTION] == {"zero_hierarchy": list(LEVELS), "zero_hierarchy_weights": "package",
                            "zero_hierarchy_int8": True}


def test_pipeline_and_other_stages_are_refused():
    with pytest.raises(ConfigError, match="--zero-hierarchy .*--pipeline-model-parallel-size 2"):
        _run(pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="--zero-stage 3"):
        _run(zero_stage=2)


def test_tier_accounting_group_and_ring():
    placements = frontier_placement(8, 4)
    counts = {(tuple(range(8)), "all_gather"): 800, ((0, 4), "reduce_scatter"): 200}
    group = tier_bytes(counts, placements, rank=3)
    assert group["network"] == pytest.approx(800 * 7 / 8 + 200 / 2)
    ring = tier_bytes(counts, placements, rank=2, mode="ring")  # 2 -> 3 share a package; 2 is not in (0, 4)
    assert ring == {"package": pytest.approx(700), "node": 0, "network": 0}
    ring = tier_bytes(counts, placements, rank=3, mode="ring")  # 3 -> 4 leaves the node
    assert ring["network"] == pytest.approx(700)


def test_planner_20b_on_48_nodes_orders_the_modes():
    from megatron.config.sizes import named_model
    from megatron.perf.comm import estimate_comm
    from megatron.perf.layout import Layout
    from megatron.perf.step_time import estimate_step_time

    model, times, net = named_model("gpt-20b"), {}, {}
    for mode, kw in {"zero3": {}, "hpz": {"zero_hpz_partition_size": 8}, "ours": {"zero_hierarchy": LEVELS_TEXT},
                     "ours-int8": {"zero_hierarchy": LEVELS_TEXT, "zero_hierarchy_int8": True}}.items():
        layout = Layout.of(tp=1, pp=1, dp=384, micro_batch_size=1, global_batch_size=1536, zero_stage=3,
                           recompute_granularity="full", **kw)
        times[mode] = estimate_step_time(model, layout).total
        net[mode] = estimate_comm(model, layout).wire_bytes_by_tier()["network"]
    assert times["ours-int8"] < times["ours"] < times["hpz"] < times["zero3"]
    assert net["ours"] <= net["zero3"] / 4
    with pytest.raises(ConfigError, match="--zero-hierarchy"):
        Layout.of(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=8, zero_stage=1, zero_hierarchy=LEVELS_TEXT)


def test_deepspeed_hpz_sized_from_the_topology():
    from megatron.core.hierarchical_zero import hpz_partition_size

    cfg = {SECTION: {"zero_hpz": "node"}}
    assert hpz_partition_size(cfg, tp=1, zero_stage=3, ranks_per_node=8) == 8
    assert hpz_partition_size({SECTION: {"zero_hpz": "package"}}, 1, 3, 8) == 2
    assert hpz_partition_size({}, 1, 3, 8) is None
    with pytest.raises(ConfigError, match="--zero-stage 3"):
        hpz_partition_size(cfg, 1, 1, 8)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2"):
        hpz_partition_size(cfg, 2, 3, 8)
    with pytest.raises(ConfigError, match="pick one"):
        hpz_partition_size({SECTION: {"zero_hpz": "node", "zero_hierarchy": ["network"]}}, 1, 3, 8)
