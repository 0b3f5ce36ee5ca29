"""configure(): a user's DeepSpeed JSON merged into the flags' settings before the RunConfig is built, the config
frozen after, build_ds_config a pure function of it, and the dry run on the same path."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from megatron.arguments import configure
from megatron.arguments.dry_run import configure_dry_run
from megatron.config import RunConfig
from megatron.engine import NOTES_KEY, build_ds_config
from megatron.errors import ConfigError
from megatron.tokenizer import FixedVocabulary
from tests.models import CONFIG_GPT_L4, replaced

FLAGS = replaced(CONFIG_GPT_L4, {"--micro-batch-size": "1", "--train-iters": "4"})


def _configure(tmp_path, ds: dict | None, *extra: str, world: int = 8) -> RunConfig:
    argv = FLAGS + list(extra)
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        argv += ["--deepspeed_config", str(path)]
    run, _ = configure(argv, world, lambda data: FixedVocabulary(128, None))
    return run


def _frozen_parts(obj) -> list[str]:
    """Dataclasses inside ``obj`` (itself included) that are not frozen."""
    if not dataclasses.is_dataclass(obj):
        return []
    out = [] if obj.__dataclass_params__.frozen else [type(obj).__name__]
    return out + [name for f in dataclasses.fields(obj) for name in _frozen_parts(getattr(obj, f.name))]


def test_the_json_decides_before_validation_and_build_ds_config_changes_nothing(tmp_path):
    ds = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.3, "bf16": {"enabled": True},
          "activation_checkpointing": {"cpu_checkpointing": True},
          "pipeline": {"activation_checkpoint_interval": 1}}
    run = _configure(tmp_path, ds, "--pipeline-model-parallel-size", "2")
    assert (run.parallel.zero_stage, run.optimizer.clip_grad, run.precision.name) == (1, 0.3, "bf16")
    assert run.model.recompute_granularity == "full" and run.model.recompute_on_cpu
    assert run.deepspeed.zero_stage_from_json and run.deepspeed.precision_from_json == "bf16"
    assert run.deepspeed.recompute_from_json == ("cpu_checkpointing",)
    assert run.flags["zero_stage"] is None and run.flags["clip_grad"] is None  # the command line, as given
    assert not _frozen_parts(run)
    before = copy.deepcopy(run)
    cfg = build_ds_config(run)
    assert run == before and build_ds_config(run) == cfg
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["gradient_clipping"] == 0.3 and cfg["bf16"]["enabled"]
    notes = cfg[NOTES_KEY]
    assert any("cpu_checkpointing=true honoured" in n for n in notes)
    assert any("enables bf16 and neither --fp16 nor --bf16" in n for n in notes)


def test_given_flags_still_win_or_disagree(tmp_path):
    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}
    run = _configure(tmp_path, ds, "--zero-stage", "2", "--clip-grad", "0.3")
    assert not run.deepspeed.zero_stage_from_json and run.optimizer.clip_grad == 0.3
    with pytest.raises(ConfigError, match="zero_optimization.stage=2 but --zero-stage gives 1"):
        build_ds_config(_configure(tmp_path, ds, "--zero-stage", "1", "--clip-grad", "0.3"))


def test_a_variant_is_a_replace_validated_again(tmp_path):
    run = _configure(tmp_path, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.global_batch_size = 16
    bigger = dataclasses.replace(run, training=dataclasses.replace(run.training, global_batch_size=16))
    assert bigger.training.global_batch_size == 16 and run.training.global_batch_size == 8
    with pytest.raises(ConfigError, match="--global-batch-size 6 is not divisible"):
        dataclasses.replace(run, training=dataclasses.replace(run.training, global_batch_size=6))


def test_moe_refusals_name_where_the_setting_came_from(tmp_path):
    moe = ("--num-experts", "4")
    with pytest.raises(ConfigError) as e:
        _configure(tmp_path, {"zero_optimization": {"stage": 3}}, *moe, world=2)
    assert str(e.value) == (f"--deepspeed_config {tmp_path / 'ds.json'} sets zero_optimization.stage=3 with "
                            "--num-experts: DeepSpeed's ZeRO-3 does not shard expert parameters (its engine refuses "
                            "MoE); use stage 1 or 2")
    with pytest.raises(ConfigError, match=r"^mixture of experts \(--num-experts\) with --zero-stage 3: .*use "
                                          "--zero-stage 1 or 2$"):
        _configure(tmp_path, None, *moe, "--zero-stage", "3", world=2)
    hierarchy = {"zero_optimization": {"stage": 3}, "megatron_frontier": {"zero_hierarchy": ["node", "network"]}}
    with pytest.raises(ConfigError) as e:
        _configure(tmp_path, hierarchy, *moe, "--zero-stage", "3", world=2)
    assert str(e.value) == (f"hierarchical ZeRO (--deepspeed_config {tmp_path / 'ds.json'}) with --num-experts: its "
                            "engine reduces every gradient over the whole data-parallel group, not the experts' own "
                            "replicas; use --zero-stage 1 or 2")


def test_hierarchical_zero_from_the_json_is_the_runs(tmp_path):
    section = {"zero_hierarchy": ["node", "network"], "zero_hierarchy_int8": True, "ranks_per_node": 4}
    run = _configure(tmp_path, {"megatron_frontier": section}, "--zero-stage", "3", "--bf16")
    p = run.parallel
    assert (p.zero_hierarchy, p.zero_hierarchy_int8, run.deepspeed.hierarchy_from_json) == ("node,network", True, True)
    assert build_ds_config(run)["megatron_frontier"] == section  # the JSON's own section, as written
    with pytest.raises(ConfigError, match="--zero-hierarchy is a ZeRO-3 mode but --zero-stage is 1"):
        _configure(tmp_path, {"megatron_frontier": section}, "--zero-stage", "1", "--bf16")


def test_the_dry_run_reads_the_same_flags_and_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}))
    dry = configure_dry_run(["--world-size", "16", "--model-size", "gpt-1.3b", "--tensor-model-parallel-size", "2",
                             "--deepspeed_config", str(path), "--save", "ckpt", "--lr", "3e-4"], 8)
    p = dry.run.parallel
    assert (p.world_size, p.tp, p.dp, p.zero_stage, dry.run.precision.name) == (16, 2, 8, 1, "bf16")
    assert dry.ignored == ("--lr", "--save")
    with pytest.raises(ConfigError, match="--world-size and --nodes are both given"):
        configure_dry_run(["--world-size", "8", "--nodes", "1", "--model-size", "debug"], 8)
