"""CAMPAIGN_MIN_NODES (examples/frontier/campaign.sh's successor range ``sbatch -N MIN-MAX``): every node count from
MIN up to this job's must serve the run, or the trainer refuses in one line before any process group, naming the
first count that does not and the smallest minimum that would (megatron/preflight/node_range.py)."""

from __future__ import annotations

import pytest

from megatron.arguments import parse_args, run_config_from_args
from megatron.errors import ConfigError
from megatron.preflight.node_range import check_node_range
from tests.models import CONFIG_GPT
from tests.unit.preflight_common import BASE, assert_one_line_error, run_until_process_group, with_flag


def _run(argv: list[str], world: int):
    return run_config_from_args(parse_args(argv), world, 200)


def _env(minimum: str, nodes: int) -> dict[str, str]:
    return {"CAMPAIGN_MIN_NODES": minimum, "SLURM_JOB_NUM_NODES": str(nodes)}


def test_a_range_whose_every_count_serves_passes_and_no_range_is_not_checked():
    run = _run(with_flag(CONFIG_GPT, "--global-batch-size", "60"), 6)  # 60 splits over DP 1-6
    check_node_range(run, 1, _env("1", 6))
    bad = _run(with_flag(CONFIG_GPT, "--global-batch-size", "30"), 6)  # DP 4 does not divide 30
    for env in ({}, _env("6", 6), _env("7", 6), _env("x", 6), {"CAMPAIGN_MIN_NODES": "1"}):
        check_node_range(bad, 1, env)  # no range; malformed values are campaign.sh's to refuse


def test_a_count_whose_dp_does_not_split_the_global_batch_names_the_smallest_minimum_that_serves():
    run = _run(with_flag(CONFIG_GPT, "--global-batch-size", "30"), 6)
    with pytest.raises(ConfigError) as e:
        check_node_range(run, 1, _env("1", 6))
    assert str(e.value) == (
        "CAMPAIGN_MIN_NODES=1: the next job may start on 4 nodes (4 ranks), where --global-batch-size 30 is not "
        "divisible by --micro-batch-size 1 x data-parallel size 4 = 4: use a multiple of 4; set "
        "CAMPAIGN_MIN_NODES=5 (every count from 5 to 6 serves)")


def test_a_world_size_the_model_parallel_sizes_do_not_divide_is_refused():
    run = _run(with_flag(CONFIG_GPT, "--global-batch-size", "24") + ["--pipeline-model-parallel-size", "2"], 8)
    check_node_range(run, 2, _env("1", 4))  # every count gives an even world size
    with pytest.raises(ConfigError) as e:
        check_node_range(run, 1, _env("2", 8))  # one rank per node: 3, 5, 7 nodes are odd
    assert str(e.value).startswith("CAMPAIGN_MIN_NODES=2: the next job may start on 3 nodes (3 ranks), where ")
    assert str(e.value).endswith("; unset CAMPAIGN_MIN_NODES (no smaller range serves this run)")


def test_a_checkpoint_that_would_not_load_at_the_smaller_size_is_refused(tmp_path):
    """Without --global-batch-size the batch would follow DP: the successor's resume refuses that, so the range
    is refused now (the checkpoint's own resume check, asked for each count)."""
    implicit = [a for i, a in enumerate(CONFIG_GPT) if "--global-batch-size" not in CONFIG_GPT[max(0, i - 1):i + 1]]
    run = _run(implicit + ["--zero-stage", "1", "--save", str(tmp_path)], 2)
    with pytest.raises(ConfigError) as e:
        check_node_range(run, 1, _env("1", 2))
    assert "the next job may start on 1 node (1 rank), where --load" in str(e.value)
    assert "--global-batch-size was not given" in str(e.value)
    check_node_range(_run(CONFIG_GPT + ["--zero-stage", "1", "--save", str(tmp_path)], 2), 1, _env("1", 2))


def test_the_trainer_refuses_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setenv("CAMPAIGN_MIN_NODES", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    argv = with_flag(with_flag(BASE, "--micro-batch-size", "1"), "--global-batch-size", "4")
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys, world_size=4, local_world_size=1)
    assert_one_line_error(rc, err, out, "CAMPAIGN_MIN_NODES=1: the next job may start on 3 nodes (3 ranks)",
                          "unset CAMPAIGN_MIN_NODES")
    monkeypatch.setenv("CAMPAIGN_MIN_NODES", "2")  # 2-4 nodes: DP 3 still does not split 4
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys, world_size=4, local_world_size=1)
    assert rc == 2 and "3 nodes" in err
    monkeypatch.setenv("CAMPAIGN_MIN_NODES", "4")
    rc, err, _ = run_until_process_group(argv, monkeypatch, capsys, world_size=4, local_world_size=1)
    assert rc is None, err
