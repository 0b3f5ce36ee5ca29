"""LR schedule shape, ds_config filling from the flags, and the FLOPs formula against Megatron's closed form."""

import math

import pytest
import torch

from megatron.arguments.deepspeed_json import with_deepspeed_json
from megatron.config import OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig, TrainingConfig
from megatron.engine import build_ds_config
from megatron.errors import ConfigError
from megatron.config.sizes import named_model
from megatron.perf.flops import iteration_flops
from megatron.optim.lr_schedule import OptimizerParamScheduler, ScheduleShape


def _sched(style, warmup=10, decay=100, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return OptimizerParamScheduler(opt, ScheduleShape(1.0, 0.1, warmup, decay, style), **kw)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_warmup_then_decay_to_min(style):
    s = _sched(style)
    assert s.current_lr == 0.0  # upstream: the first update of a warmup uses position 0
    lrs = []
    for _ in range(120):
        lrs.append(s.current_lr)
        s.step(1)
    assert lrs[1] == pytest.approx(0.1) and lrs[10] == pytest.approx(1.0)  # end of warmup
    mid = 0.1 + 0.9 * (0.5 if style == "linear" else 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert lrs[55] == pytest.approx(mid)  # halfway through decay
    assert lrs[100] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b - 1e-12 for a, b in zip(lrs[10:-1], lrs[11:], strict=True))  # monotone after warmup


def test_resume_shape_rules_as_upstream():
    """A changed schedule on resume: refused by default, the flags' with override, the checkpoint's with
    use-checkpoint; the position is restored in every case."""
    from megatron.errors import CheckpointError

    a = _sched("cosine")
    for _ in range(30):
        a.step(1)
    with pytest.raises(CheckpointError, match="override-opt_param-scheduler"):
        _sched("cosine", decay=200).load_state_dict(a.state_dict())
    b = _sched("cosine", decay=200, override=True)
    b.load_state_dict(a.state_dict())
    c = _sched("cosine", decay=200)
    for _ in range(30):
        c.step(1)
    assert b.num_steps == 30 and b.lr_decay_steps == 200 and b.current_lr == c.current_lr
    d = _sched("cosine", decay=200, use_checkpoint=True)
    d.load_state_dict(a.state_dict())
    assert d.lr_decay_steps == 100 and d.current_lr == a.current_lr


def test_legacy_iteration_state_is_read():
    """Checkpoints before the samples-based schedule saved {num_steps (iterations), ..., style}."""
    a = _sched("linear", warmup=40, decay=400)
    for _ in range(12):
        a.step(4)
    b = _sched("linear", warmup=40, decay=400, legacy_samples_per_step=4)
    b.load_state_dict({"num_steps": 12, "max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "decay_steps": 100,
                       "style": "linear"})
    assert b.num_steps == 48 and b.current_lr == a.current_lr


def _run(ds=None, **train):
    fields = dict(model=named_model("debug"), parallel=ParallelConfig(world_size=4, zero_stage=2),
                  optimizer=OptimizerConfig(clip_grad=0.0), precision=PrecisionConfig(fp16=True),
                  training=TrainingConfig(micro_batch_size=2, global_batch_size=32, **train))
    return RunConfig(**with_deepspeed_json(fields, ds))


@pytest.fixture
def fp16_device(monkeypatch):
    """Pretend the accelerator supports fp16 (the CPU one does not) to check the JSON we would write."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def test_fp16_refused_where_unsupported(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(ConfigError, match="--fp16: DeepSpeed does not support fp16"):
        build_ds_config(_run())


def test_ds_config_filled_from_flags(fp16_device):
    cfg = build_ds_config(_run())
    assert cfg["train_batch_size"] == 32 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 4  # 32 / (2 x DP 4)
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed would silently default to 1.0
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert cfg["fp16"]["initial_scale_power"] == 32 and "bf16" not in cfg


def test_ds_config_precision_disagreement(tmp_path, fp16_device):
    f = tmp_path / "ds.json"
    f.write_text('{"bf16": {"enabled": true}}')
    with pytest.raises(ConfigError, match="bf16.enabled=true but --bf16 is not set"):
        build_ds_config(_run(str(f)))


def test_ds_config_accepts_optimizer_section_unused(tmp_path, fp16_device):
    f = tmp_path / "ds.json"
    f.write_text('{"optimizer": {"type": "Adam"}}')
    cfg = build_ds_config(_run(str(f)))  # as upstream: not used, said in one log line
    assert "optimizer" not in cfg and any("'optimizer' section not used" in n for n in cfg["megatron_notes"])


def test_flops_formula_matches_megatron_closed_form():
    """For the GPT-2 shape our per-matmul count reduces to Megatron's 72 B s l h^2 (1 + s/6h) + 6 B s h V."""
    cfg = named_model("gpt-175b")
    b, s, h, L, V = 8, cfg.seq_length, cfg.hidden_size, cfg.num_layers, cfg.padded_vocab_size()
    f = iteration_flops(cfg, b, V, "full")
    assert f.model == pytest.approx(72 * b * s * L * h * h * (1 + s / (6 * h)) + 6 * b * s * h * V)
    assert f.recompute == pytest.approx(24 * b * s * L * h * h * (1 + s / (6 * h)))


def test_rampup_with_zero_offload_is_refused(tmp_path):
    """ZeRO-Offload sizes its host accumulation for the JSON's accumulation steps: a ramp is one line, before
    any process group (and the same JSON without the ramp is accepted)."""
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))

    def run(**ramp):
        fields = dict(model=named_model("debug"), parallel=ParallelConfig(world_size=2, zero_stage=2),
                      training=TrainingConfig(micro_batch_size=1, global_batch_size=8, train_iters=None,
                                              train_samples=64, **ramp))
        return RunConfig(**with_deepspeed_json(fields, str(path)))

    with pytest.raises(ConfigError, match="rampup-batch-size .*offload_optimizer"):
        build_ds_config(run(rampup_batch_size=(4, 2, 16)))
    assert build_ds_config(run())["train_batch_size"] == 8
