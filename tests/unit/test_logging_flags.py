"""Upstream Megatron-DeepSpeed's logging flags, in-process: each honoured flag changes what is written, the
no-ops are said; the TensorBoard tag sets against upstream's training_log (W&B's flags: test_wandb_writer.py)."""

import math

import pytest
import torch

from megatron.arguments import log_options_from_args, parse_args
from megatron.core.parallel_state import single_process_state
from megatron.errors import ConfigError
from megatron.training import tensorboard as tb
from megatron.config.log import LogOptions
from megatron.training.model_stats import OPTIMIZER_STATS, optimizer_stats, params_norm
from megatron.training.timers import Timers


def _opts(*flags: str) -> LogOptions:
    return log_options_from_args(parse_args(list(flags)))


class _Rec:
    """A SummaryWriter stand-in recording add_scalar calls."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars.setdefault(tag, []).append((step, value))


def _written(opts: LogOptions, loss_scale=None, params=None) -> dict:
    w = _Rec()
    tb.write_training(w, opts, 3, 24, 768, loss=2.5, lr=1e-4, batch_size=8, loss_scale=loss_scale, world_size=4,
                      grad_norm=0.5, params_norm=params, seq_length=32)
    return w.scalars


def _series(tag):
    return {tag, f"{tag} vs samples", f"{tag} vs tokens"}


STEPS = {"steps-vs-samples/y=steps,x=samples", "steps-vs-samples/y=samples,x=steps",
         "steps-vs-tokens/y=steps,x=tokens", "steps-vs-tokens/y=tokens,x=steps"}


def test_default_tags_are_upstreams():
    got = _written(_opts("--tensorboard-dir", "x"))
    assert set(got) == STEPS | _series("learning-rate/learning-rate") | _series("lm-loss-training/lm loss") | \
        _series("grad-norm/grad-norm") | _series("seqlen/actual_seq_length")
    # x axes: iteration, consumed samples, consumed tokens (upstream's custom steps)
    assert got["lm-loss-training/lm loss"] == [(3, 2.5)]
    assert got["lm-loss-training/lm loss vs samples"] == [(24, 2.5)]
    assert got["lm-loss-training/lm loss vs tokens"] == [(768, 2.5)]
    assert got["steps-vs-samples/y=steps,x=samples"] == [(24, 3)]


def test_each_tensorboard_flag_changes_the_tags():
    base = set(_written(_opts("--tensorboard-dir", "x"), loss_scale=1024.0))
    assert _series("loss-scale/loss-scale") <= base  # fp16 runs report a scale: written by default
    no_lr = set(_written(_opts("--tensorboard-dir", "x", "--no-log-learnig-rate-to-tensorboard"), loss_scale=1024.0))
    assert base - no_lr == _series("learning-rate/learning-rate")
    no_ls = set(_written(_opts("--tensorboard-dir", "x", "--no-log-loss-scale-to-tensorboard"), loss_scale=1024.0))
    assert base - no_ls == _series("loss-scale/loss-scale")
    bs = _written(_opts("--tensorboard-dir", "x", "--log-batch-size-to-tensorboard"), loss_scale=1024.0)
    assert set(bs) - base == _series("batch-size/batch-size") and bs["batch-size/batch-size"] == [(3, 8)]
    ws = _written(_opts("--tensorboard-dir", "x", "--log-world-size-to-tensorboard"), loss_scale=1024.0)
    assert set(ws) - base == _series("world-size/world-size") and ws["world-size/world-size"] == [(3, 4)]
    mem = set(_written(_opts("--tensorboard-dir", "x", "--log-memory-to-tensorboard"), loss_scale=1024.0))
    assert {"mem-reserved-bytes", "mem-allocated-bytes"} <= mem - base
    pn = set(_written(_opts("--tensorboard-dir", "x", "--log-params-norm"), loss_scale=1024.0, params=3.0))
    assert pn - base == _series("params-norm/params-norm")


def test_validation_ppl_tags():
    w = _Rec()
    tb.write_evaluation(w, _opts("--tensorboard-dir", "x"), 2.0, 5, 40, 1280, test=True)
    assert set(w.scalars) == _series("lm-loss-validation/lm loss test")
    w = _Rec()
    tb.write_evaluation(w, _opts("--tensorboard-dir", "x", "--log-validation-ppl-to-tensorboard"), 2.0, 5, 40, 1280)
    assert set(w.scalars) == _series("lm-loss-validation/lm loss validation") | \
        _series("lm-loss-validation/lm loss validation ppl")
    assert w.scalars["lm-loss-validation/lm loss validation ppl"] == [(5, math.exp(2.0))]


def test_queue_size_and_args_reach_the_writer(tmp_path):
    args = parse_args(["--tensorboard-dir", str(tmp_path), "--tensorboard-queue-size", "7", "--seed", "5"])
    writer = tb.open_writer(log_options_from_args(args), 0, vars(args))
    try:
        assert writer.max_queue == 7  # SummaryWriter's own record of max_queue
    finally:
        writer.close()
    # rank 0 writes, as every rank has the values
    assert tb.open_writer(log_options_from_args(args), 1, vars(args)) is None
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert "seed/text_summary" in acc.Tags()["tensors"]  # upstream's write_args_to_tensorboard


def test_interval_and_refusals():
    opts = _opts("--tensorboard-dir", "x", "--tensorboard-log-interval", "3")
    assert [it for it in range(1, 8) if opts.tb_step(it)] == [3, 6]
    assert not _opts("--tensorboard-log-interval", "3").tb_step(3)  # no --tensorboard-dir: nothing, on every rank
    for flags, needle in ((["--tensorboard-log-interval", "0"], "--tensorboard-log-interval"),
                          (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size")):
        with pytest.raises(ConfigError, match=needle):
            _opts(*flags)
    notes = " ".join(_opts("--log-memory-to-tensorboard").notes)
    assert "--log-memory-to-tensorboard" in notes
    assert _opts().notes == ()


def test_timers_levels_and_options():
    t0 = Timers(**_timer_kwargs(_opts()))
    with t0("forward-backward"):
        pass
    assert t0.report(1.0) is None  # level 0: no timer exists, nothing printed (upstream's default)
    for option, needle in (("minmax", "(min, max) time across ranks (ms):"), ("max", "(min, max) time across ranks"),
                           ("all", "times across ranks (ms):")):
        t = Timers(**_timer_kwargs(_opts("--timing-log-level", "1", "--timing-log-option", option)))
        with t("forward-backward"):
            sum(range(10000))
        with t("batch-generator"):  # level 2: not timed at level 1
            pass
        out = t.report(1.0)
        assert out.startswith(needle) and "forward-backward" in out and "batch-generator" not in out, out
        line = out.splitlines()[1]
        assert ("(" in line) == (option == "minmax")
        assert ("rank  0" in out) == (option == "all")
    t2 = Timers(**_timer_kwargs(_opts("--timing-log-level", "2", "--no-barrier-with-level-1-timing")))
    assert t2("batch-generator").barrier is False and t2("optimizer").barrier is False
    assert Timers(**_timer_kwargs(_opts("--timing-log-level", "1")))("optimizer").barrier is True


def _timer_kwargs(o: LogOptions) -> dict:
    return {"level": o.timing_level, "option": o.timing_option, "barrier_l1": o.barrier_l1}


def test_params_norm_and_optimizer_states_against_hand_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    pstate = single_process_state()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    assert params_norm(model, pstate) == pytest.approx(float(flat.norm()), rel=1e-12)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    got = optimizer_stats(opt, pstate, zero_stage=0)
    assert list(got) == list(OPTIMIZER_STATS)
    v = torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in model.parameters()]).double()
    m = torch.cat([opt.state[p]["exp_avg"].flatten() for p in model.parameters()]).double()
    w = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    want = {"variance_l2": v.norm(), "variance_sqrt_l2": v.sqrt().norm(), "momentum_l2": m.norm(),
            "weight_l2": w.norm(), "variance_l1": v.abs().sum(), "variance_sqrt_l1": v.sqrt().sum(),
            "momentum_l1": m.abs().sum(), "weight_l1": w.abs().sum(), "variance_abs_max": v.abs().max(),
            "variance_sqrt_abs_max": v.sqrt().max(), "momentum_abs_max": m.abs().max(), "weight_abs_max": w.abs().max()}
    for k, val in want.items():
        assert got[k] == pytest.approx(float(val), rel=1e-9), k


def test_every_upstream_logging_flag_reaches_the_options():
    """The honoured logging flags (megatron/compat/flags.py classes the rest) change LogOptions."""
    values = {"--tensorboard-dir": "d", "--timing-log-level": "1", "--timing-log-option": "max",
              "--tensorboard-log-interval": "2", "--tensorboard-queue-size": "9"}
    honoured = ["--tensorboard-dir", "--skip-train", "--log-params-norm", "--timing-log-level",
                "--no-barrier-with-level-1-timing", "--timing-log-option", "--tensorboard-log-interval",
                "--tensorboard-queue-size", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                "--no-log-learnig-rate-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--log-optimizer-states-to-tensorboard",
                "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard"]
    for flag in honoured:
        args = parse_args([flag] + ([values[flag]] if flag in values else []))
        assert log_options_from_args(args) != log_options_from_args(parse_args([])), flag
