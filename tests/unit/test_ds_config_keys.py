"""Every DeepSpeed JSON key is in exactly one class, and build_ds_config applies the classes to real JSONs.

The schema is megatron/compat/ds_schema_keys.txt (extracted from DeepSpeed by tools/extract_ds_config_keys.py);
test_schema_is_current re-runs the extraction so a DeepSpeed upgrade that adds keys fails here.
"""

import copy
import dataclasses
import json
import os

import pytest

from megatron.arguments.deepspeed_json import with_deepspeed_json
from megatron.compat import ds_config_keys as keys
from megatron.config import OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig, TrainingConfig
from megatron.engine import NOTES_KEY, build_ds_config
from megatron.errors import ConfigError
from megatron.config.sizes import named_model

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat_json")


def test_every_schema_key_is_in_exactly_one_class():
    schema = keys.schema_keys()
    assert len(schema) > 300 and "fp16.initial_scale_power" in schema and "zero_optimization.stage" in schema
    for key in schema:
        exact = key in keys.TABLE
        covering = [a for a in (".".join(key.split(".")[:i]) + ".*" for i in range(1, key.count(".") + 1))
                    if a in keys.TABLE]
        # Exactly one entry decides: its own, or (without one) the single nearest whole-section entry.
        assert exact or covering, f"{key}: in no class"
        assert not (exact and covering), f"{key}: both its own entry and {covering}"
        assert len(covering) <= 1, f"{key}: under several section entries {covering}"
        assert keys.lookup(key)[0] in (keys.HONOURED, keys.NOOP, keys.REFUSED)
    for entry in keys.TABLE:  # no stale entry: each names a key (or a section) DeepSpeed has
        assert entry.removesuffix(".*") in schema, entry


def test_schema_is_current():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("extract", os.path.join(
        os.path.dirname(HERE), "..", "..", "tools", "extract_ds_config_keys.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["extract"] = mod
    spec.loader.exec_module(mod)
    assert mod.extract() == keys.schema_keys()


def _run(fp16=True, mbs=2, zero=0, ds=None, zero_stage_given=True, clip_grad_given=True, model=None, optimizer="adam",
         **prec):
    """The run of these flags with the user JSON ``ds`` merged in, as configure() builds it."""
    fields = dict(model=model or named_model("debug"), parallel=ParallelConfig(world_size=2, zero_stage=zero),
                  optimizer=OptimizerConfig(lr=3e-4, clip_grad=1.0, optimizer=optimizer),
                  precision=PrecisionConfig(fp16=fp16, **prec),
                  training=TrainingConfig(micro_batch_size=mbs, global_batch_size=8))
    return RunConfig(**with_deepspeed_json(fields, ds, zero_stage_given, clip_grad_given))


@pytest.fixture
def fp16_device(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name,mbs,stage", [("ornl_175b_zero1_fp16", 4, 1), ("rebase_zero2_fp16", 2, 2),
                                            ("offload_zero3_fp16", 2, 3), ("actckpt_zero1_fp16", 2, 1)])
def test_real_frontier_jsons_build(fp16_device, name, mbs, stage):
    cfg = build_ds_config(_run(mbs=mbs, ds=os.path.join(HERE, name + ".json"), zero_stage_given=False))
    assert cfg["zero_optimization"]["stage"] == stage and "optimizer" not in cfg
    if name != "ornl_175b_zero1_fp16":  # the JSON's loss-scale keys are kept (they were overwritten before)
        assert {k: cfg["fp16"][k] for k in ("loss_scale", "initial_scale_power", "loss_scale_window")} == \
            {"loss_scale": 0, "initial_scale_power": 11, "loss_scale_window": 500}
    else:  # none in the JSON and no flag: DeepSpeed's own defaults apply, as under upstream
        assert set(cfg["fp16"]) == {"enabled"}
        opt_line, = [n for n in cfg[NOTES_KEY] if "'optimizer' section" in n]
        for value in ("adam_w_mode=false", "params.lr='auto'", "params.betas='auto'"):
            assert value in opt_line
        assert "torch_adam" not in opt_line  # an implementation choice, not a value the run differs in


def test_unknown_and_refused_keys_are_refused(tmp_path, fp16_device):
    with pytest.raises(ConfigError, match="fp16.loss_scale_windw: not a DeepSpeed"):
        _run(ds=_write(tmp_path, {"fp16": {"enabled": True, "loss_scale_windw": 500}}))
    with pytest.raises(ConfigError, match="steps_per_prnt: not a DeepSpeed"):
        _run(ds=_write(tmp_path, {"steps_per_prnt": 1}))
    with pytest.raises(ConfigError, match="fp16: must be a JSON object of fp16.\\* keys, got True"):
        _run(ds=_write(tmp_path, {"fp16": True}))
    with pytest.raises(ConfigError, match="torch_autocast: precision comes from"):
        _run(ds=_write(tmp_path, {"torch_autocast": {"enabled": True}}))
    # Off values of refused keys ask for nothing: accepted, dropped before DeepSpeed (which refuses some itself).
    cfg = build_ds_config(_run(ds=_write(tmp_path, {"amp": {"enabled": False}, "torch_autocast": {"enabled": False},
                                                    "zero_optimization": {"stage": 0, "mics_shard_size": None}})))
    assert "amp" not in cfg and "torch_autocast" not in cfg and "mics_shard_size" not in cfg["zero_optimization"]
    assert any(n.startswith("> DeepSpeed JSON: amp accepted") for n in cfg[NOTES_KEY])


def test_noop_keys_are_said_once(tmp_path, fp16_device):
    cfg = build_ds_config(_run(ds=_write(tmp_path, {"dataloader_drop_last": True, "pipeline": {"stages": 4}})))
    said = [n for n in cfg[NOTES_KEY] if "accepted, no effect" in n]
    assert len(said) == 2 and "dataloader_drop_last" in said[0] and "pipeline.stages" in said[1]


def test_fp16_flags_fill_missing_json_keys_and_warn_on_contradiction(tmp_path, fp16_device):
    run = _run(initial_loss_scale=2.0**20, loss_scale_window=100, hysteresis=4,
               ds=_write(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 11}}))
    cfg = build_ds_config(run)
    assert cfg["fp16"]["initial_scale_power"] == 11  # the JSON wins, as upstream
    assert cfg["fp16"]["loss_scale_window"] == 100 and cfg["fp16"]["hysteresis"] == 4  # filled from the flags
    warning, = [n for n in cfg[NOTES_KEY] if n.startswith("WARNING")]
    assert "--initial-loss-scale 1.04858e+06" in warning and "fp16.initial_scale_power=11" in warning
    static = build_ds_config(_run(loss_scale=128.0, ds=_write(tmp_path, {"fp16": {"enabled": True}})))
    assert static["fp16"]["loss_scale"] == 128.0
    with pytest.raises(ConfigError, match="--initial-loss-scale 1000 is not a power of 2"):
        build_ds_config(_run(initial_loss_scale=1000.0))


def test_fp16_flags_are_noops_without_fp16(tmp_path):
    cfg = build_ds_config(_run(fp16=False, loss_scale=128.0))
    assert "fp16" not in cfg
    assert cfg[NOTES_KEY] == ["> --loss-scale 128 has no effect without --fp16 (fp32 needs no "
                              "loss scaling)"]


def test_template_yields_to_given_flags(fp16_device):
    assert build_ds_config(_run())["fp16"]["initial_scale_power"] == 32  # the template (Megatron's 2**32)
    assert build_ds_config(_run(initial_loss_scale=2.0**16))["fp16"]["initial_scale_power"] == 16


def test_optimizer_section_agreeing_is_said_so(tmp_path, fp16_device):
    section = {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
    cfg = build_ds_config(_run(ds=_write(tmp_path, {"optimizer": section, "scheduler": {"type": "WarmupLR"}})))
    opt, sched = [n for n in cfg[NOTES_KEY] if "section not used" in n]
    assert opt.endswith("it agrees with the flags") and "type='WarmupLR'" in sched


def test_offload_refusals(tmp_path, fp16_device):
    offload = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="offload_optimizer needs ZeRO stage 1, 2 or 3"):
        build_ds_config(_run(ds=_write(tmp_path, offload)))
    with pytest.raises(ConfigError, match="nvme"):
        build_ds_config(_run(zero=1, ds=_write(tmp_path, {"zero_optimization": {
            "stage": 1, "offload_optimizer": {"device": "nvme"}}})))
    run = _run(zero=1, optimizer="sgd", ds=_write(tmp_path, {"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "cpu"}}}))
    with pytest.raises(ConfigError, match="ZeRO-Offload runs Adam on the CPU"):
        build_ds_config(run)


def test_activation_checkpointing_keys_reach_the_recompute(tmp_path):
    ac = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "profile": True,
                                       "synchronize_checkpoint_boundary": True, "number_checkpoints": 4,
                                       "contiguous_memory_optimization": False}}
    run = _run(fp16=False, model=named_model("debug", recompute_granularity="full"), ds=_write(tmp_path, ac))
    cfg = build_ds_config(run)
    m = run.model
    assert m.recompute_partition and m.recompute_on_cpu and m.recompute_profile and m.recompute_synchronize
    notes = cfg[NOTES_KEY]
    assert sum("honoured (upstream's" in n for n in notes) == 4
    assert any("number_checkpoints accepted, no effect" in n for n in notes)
    assert not any("JSON: activation_checkpointing.contiguous" in n for n in notes)  # false: nothing to say
    assert any("no effect with --tensor-model-parallel-size 1" in n for n in notes)
    quiet = _run(fp16=False, ds=_write(tmp_path, ac))  # no recompute: said, not silently kept
    notes = build_ds_config(quiet)[NOTES_KEY]
    assert any("no effect, nothing is recomputed" in n for n in notes)


def test_json_gradient_clipping_applies_when_the_flag_is_not_given(tmp_path, fp16_device):
    path = _write(tmp_path, {"gradient_clipping": 0.5})
    run = _run(ds=path, clip_grad_given=False)
    assert build_ds_config(run)["gradient_clipping"] == 0.5
    assert run.optimizer.clip_grad == 0.5  # our own clip paths (pipeline fp32) read it from the run
    with pytest.raises(ConfigError, match="gradient_clipping=0.5 but --clip-grad gives 1.0"):
        build_ds_config(_run(ds=path, clip_grad_given=True))


def test_json_precision_without_a_flag_is_the_runs_precision(tmp_path):
    """Upstream's engine takes the dtype from the JSON alone: an ORNL JSON enabling bf16/fp16 with no --bf16/--fp16
    flag trains in it (said once), where it used to be refused."""
    run = _run(fp16=False, ds=_write(tmp_path, {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2}))
    cfg = build_ds_config(run)
    assert run.precision.bf16 and cfg["bf16"]["enabled"]
    assert any("enables bf16 and neither --fp16 nor --bf16" in n for n in cfg[NOTES_KEY])
    run = _run(fp16=False, bf16=True, ds=_write(tmp_path, {"fp16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="fp16.enabled=true but --fp16 is not set"):
        build_ds_config(run)  # a given flag that contradicts the JSON is still refused


def test_legacy_keys_real_scripts_carry_are_noops():
    verdicts = {v.key: v for v in keys.classify({"aio": {"thread_count": 2, "block_size": 1048576}})}
    assert verdicts["aio.thread_count"].cls == keys.NOOP and verdicts["aio.thread_count"].drop
    assert verdicts["aio.block_size"].cls != keys.REFUSED


def test_build_ds_config_is_a_pure_function_of_the_frozen_run(tmp_path):
    """What the JSON decides (stage, clipping, bf16, recompute) is in the run when it is built; build_ds_config
    reads the run and writes only the dict it returns, the same dict each time."""
    ds = _write(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.25, "bf16": {"enabled": True},
                           "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
                           "pipeline": {"activation_checkpoint_interval": 1}})
    run = _run(fp16=False, ds=ds, zero_stage_given=False, clip_grad_given=False)
    assert (run.parallel.zero_stage, run.optimizer.clip_grad, run.precision.name) == (2, 0.25, "bf16")
    assert run.model.recompute_granularity == "full" and run.model.recompute_partition and run.model.recompute_on_cpu
    before = copy.deepcopy(run)
    first = build_ds_config(run)
    assert run == before and build_ds_config(run) == first
    assert first["pipeline"]["activation_checkpoint_interval"] == 0 and first["zero_optimization"]["stage"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.parallel.zero_stage = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.notes = ()
