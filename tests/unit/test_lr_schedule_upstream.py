"""The LR schedule and batch-size ramp against upstream Megatron-DeepSpeed's own values (tests/fixtures/lr_schedule:
computed by its OptimizerParamScheduler and micro-batch calculator at 4efb479d, see the README there).

Every case's flags go through our parser and RunConfig validation; the loop below does per iteration what
megatron/training/pretrain.py's does for the schedule (consumed tokens before the step, the step's global batch
from the consumed samples, DeepSpeed's ``step(increment=...)``).
"""

import itertools
import json
import os

import pytest
import torch

from megatron.arguments import parse_args, run_config_from_args
from megatron.errors import CheckpointError, ConfigError
from megatron.optim.lr_schedule import OptimizerParamScheduler
from megatron.optim.microbatches import MicroBatchPlan
from megatron.optim.schedule_config import micro_batch_plan

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "lr_schedule", "upstream_lr.json")
with open(FIXTURE) as f:
    UPSTREAM = json.load(f)
CASES = UPSTREAM["cases"]
OURS = ["--mock-data", "--vocab-size", "200"]


def _run(case: dict, extra=()):
    args = parse_args(UPSTREAM["model_flags"] + case["flags"] + OURS + list(extra))
    return run_config_from_args(args, case["data_parallel_size"], 200)


def _scheduler(run):
    # Our two groups (megatron/optim/optimizer.py param_groups): decayed, and biases/norms (wd_mult 0), as upstream's.
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 1.0},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 0.0}], lr=0.0)
    return OptimizerParamScheduler.from_run(opt, run)


def _train(run, sched, start_iter: int = 0, consumed: int = 0, stop_iter: int | None = None) -> dict:
    """Per iteration after ``start_iter`` (up to ``stop_iter``, default the run's end): the lr applied, the lr
    printed, the global batch, each group's weight decay during the update."""
    t, seq, plan = run.training, run.model.seq_length, micro_batch_plan(run)
    out = {"applied": [], "printed": [], "global_batch": [], "applied_weight_decay": []}
    for _ in range(start_iter, t.train_iters if stop_iter is None else stop_iter):
        if t.train_tokens is not None and consumed * seq >= t.train_tokens:
            break
        sched.consumed_tokens = consumed * seq
        gbs = plan.global_batch(consumed)
        out["applied"].append(sched.current_lr)
        out["applied_weight_decay"].append([g["weight_decay"] for g in sched.optimizer.param_groups])
        sched.step(increment=gbs)  # what DeepSpeed's engine.step(lr_kwargs=...) does at the boundary
        consumed += gbs
        out["printed"].append(sched.current_lr)
        out["global_batch"].append(gbs)
    return out


def test_fixture_covers_every_style_and_form():
    flags = " ".join(" ".join(c["flags"]) for c in CASES.values())
    for needed in ("cosine", "linear", "inverse-square-root", "constant", "--lr-warmup-fraction", "--train-samples",
                   "--lr-warmup-samples", "--lr-decay-samples", "--lr-warmup-tokens", "--lr-decay-tokens",
                   "--train-tokens", "--rampup-batch-size", "--min-lr", "--weight-decay-incr-style linear",
                   "--weight-decay-incr-style cosine"):
        assert needed in flags, needed
    assert UPSTREAM["upstream_commit"] == "4efb479d5317ce9b86096b9d8e3e8030b0b5263b"


@pytest.mark.parametrize("name", sorted(CASES))
def test_straight_run_matches_upstream(name):
    case = CASES[name]
    run = _run(case)
    assert run.training.train_iters == case["train_iters"]  # upstream's update_train_iters for --train-samples
    got = _train(run, _scheduler(run))
    assert len(got["applied"]) == case["iterations"]
    assert got["global_batch"] == case["global_batch"]
    assert got["applied"] == case["applied"]  # exact: the same formulas in the same order
    assert got["printed"] == case["printed"]
    assert got["applied_weight_decay"] == case["applied_weight_decay"]
    assert got["applied"][0] == 0.0 or "--lr-warmup" not in " ".join(case["flags"])  # upstream's first update


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("source", ["ours", "upstream"])
def test_resumed_run_matches_upstream(name, source):
    """Stop after k iterations, restore a fresh scheduler from the state (ours through JSON, as our checkpoint
    metadata holds it, or upstream's own state_dict), continue: the rest equals upstream's straight run."""
    case = CASES[name]
    k = case["iterations"] // 2
    run = _run(case)
    consumed = case["states"][k - 1]["consumed_samples"]
    if source == "ours":
        first = _scheduler(run)
        _train(run, first, stop_iter=k)
        state = json.loads(json.dumps(first.state_dict()))  # as megatron_meta.json holds it
    else:
        state = case["states"][k - 1]["scheduler"]
    resumed = _scheduler(run)
    resumed.load_state_dict(state)
    assert resumed.current_lr == case["printed"][k - 1]
    got = _train(run, resumed, start_iter=k, consumed=consumed)
    assert got["applied"] == case["applied"][k:]
    assert got["printed"] == case["printed"][k:]
    assert got["applied_weight_decay"] == case["applied_weight_decay"][k:]


@pytest.mark.parametrize("table", UPSTREAM["ramps"], ids=lambda r: "-".join(map(str, r["rampup"])))
def test_micro_batch_plan_matches_upstream_calculator(table):
    plan = MicroBatchPlan(table["global_batch_size"], table["micro_batch_size"], table["data_parallel_size"],
                          tuple(table["rampup"]))
    n = len(table["current_global_batch"])
    assert [plan.global_batch(c) for c in range(n)] == table["current_global_batch"]
    assert [plan.num_microbatches(c) for c in range(n)] == table["num_microbatches"]
    assert {s: plan.train_iters(int(s)) for s in table["train_iters"]} == table["train_iters"]


@pytest.mark.parametrize("table", UPSTREAM["ramps"], ids=lambda r: "-".join(map(str, r["rampup"])))
def test_validation_position_after_a_resume_is_the_straight_runs(table):
    """Upstream's straight run, from its calculator's batches: each evaluation (every eval_interval iterations)
    draws eval_iters batches of the step just done. A run resumed at any iteration starts its validation stream
    at that count (upstream restores it as consumed_valid_samples)."""
    plan = MicroBatchPlan(table["global_batch_size"], table["micro_batch_size"], table["data_parallel_size"],
                          tuple(table["rampup"]))
    upstream_batch, final = table["current_global_batch"], table["global_batch_size"]
    fixed_formula_off = False
    for eval_interval, eval_iters in ((1, 1), (3, 2), (5, 4)):
        consumed = drawn = 0
        for it in range(1, 60):
            gbs = upstream_batch[consumed] if consumed < len(upstream_batch) else final
            consumed += gbs
            if it % eval_interval == 0:
                drawn += eval_iters * gbs
            assert plan.valid_samples_before(it, eval_interval, eval_iters) == drawn, (eval_interval, it)
            fixed_formula_off |= drawn != (it // eval_interval) * eval_iters * final
    assert fixed_formula_off  # the ramp changes the count: the fixed-batch formula would resume elsewhere
    steps = list(itertools.islice(plan.positions(), 40))
    assert [plan.samples_after(i + 1) for i in range(40)] == steps
    assert plan.samples_after(3, steps[4]) == steps[7]


def test_samples_schedule_equals_iterations_schedule_where_they_coincide():
    """--train-samples N*GBS with --lr-{warmup,decay}-samples W*GBS, D*GBS is the iteration schedule N, W, D."""
    base = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine"]
    iters = _run({"flags": base + ["--train-iters", "12", "--lr-warmup-iters", "3", "--lr-decay-iters", "10"],
                  "data_parallel_size": 2})
    samples = _run({"flags": base + ["--train-samples", "48", "--lr-warmup-samples", "12", "--lr-decay-samples",
                                     "40"], "data_parallel_size": 2})
    assert samples.training.train_iters == iters.training.train_iters == 12
    a, b = _train(iters, _scheduler(iters)), _train(samples, _scheduler(samples))
    assert a == b
    assert len(set(a["applied"])) > 6  # warmup and decay both happen: the equality is not trivial
    # and they are upstream's own values for these flags
    assert a["applied"] == CASES["iters-cosine"]["applied"][:12]


REFUSED = {  # upstream asserts (or fails later) on each of these; here one line before any process group
    "warmup >= decay": ["--train-iters", "10", "--lr-warmup-iters", "10"],
    "both lengths": ["--train-iters", "10", "--train-samples", "40"],
    "samples flag, iteration run": ["--train-iters", "10", "--lr-decay-samples", "20"],
    "iters flag, sample run": ["--train-samples", "40", "--lr-warmup-iters", "2"],
    "fraction and iters": ["--train-iters", "10", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
    "fraction and samples": ["--train-samples", "40", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "2"],
    "ramp, iteration run": ["--train-iters", "10", "--rampup-batch-size", "2", "2", "8"],
    "ramp not a multiple": ["--train-samples", "40", "--rampup-batch-size", "2", "3", "8"],
    "ramp start = gbs": ["--train-samples", "40", "--rampup-batch-size", "4", "2", "8"],
    "ramp, hierarchical ZeRO": ["--train-samples", "40", "--rampup-batch-size", "2", "2", "8", "--zero-stage", "3",
                                "--zero-hierarchy", "package,node,network"],
    "token decay, no warmup start": ["--train-iters", "10", "--lr-decay-tokens", "100", "--lr-decay-style", "linear"],
    "token decay, warmup off the grid": ["--train-iters", "10", "--lr-decay-tokens", "500", "--lr-warmup-fraction",
                                         "0.15"],
    "min-lr above lr": ["--train-iters", "10", "--min-lr", "1"],
    "override and use-checkpoint": ["--train-iters", "10", "--override-opt_param-scheduler",
                                    "--use-checkpoint-opt_param-scheduler"],
    "decay length 0": ["--train-iters", "10", "--lr-decay-iters", "0"],
    "start wd without a style": ["--train-iters", "10", "--start-weight-decay", "0.1"],
    "wd style without its ends": ["--train-iters", "10", "--weight-decay-incr-style", "linear",
                                  "--end-weight-decay", "0.1"],
    "wd decreasing": ["--train-iters", "10", "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1",
                      "--end-weight-decay", "0.01"],
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_in_one_line(name):
    flags = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3"] + REFUSED[name]
    with pytest.raises(ConfigError) as e:
        _run({"flags": flags, "data_parallel_size": 1})
    assert "\n" not in str(e.value)


def test_upstream_state_with_other_flags_is_refused_unless_told():
    """Upstream asserts when the flags' schedule differs from the checkpoint's; either flag resolves it."""
    case = CASES["iters-cosine"]
    state = case["states"][5]["scheduler"]
    flags = list(case["flags"])
    i = flags.index("--lr-decay-iters")
    flags[i + 1] = "20"
    changed = {"flags": flags, "data_parallel_size": case["data_parallel_size"]}
    with pytest.raises(CheckpointError, match="decay length \\(samples\\) 40 in the checkpoint, 80 "):
        _scheduler(_run(changed)).load_state_dict(state)
    own = _scheduler(_run(changed, ["--use-checkpoint-opt_param-scheduler"]))
    own.load_state_dict(state)
    assert own.current_lr == case["printed"][5] and own.lr_decay_steps == 40
    new = _scheduler(_run(changed, ["--override-opt_param-scheduler"]))
    new.load_state_dict(state)
    assert new.lr_decay_steps == 80 and new.num_steps == 24


def test_weight_decay_schedule_checked_on_resume_as_upstream():
    """A wd ramp resumed with other ends is refused as upstream's _check_and_set refuses it; a constant decay's
    length (--train-iters x batch, never read) may change; a state without wd keys (ours before them) loads."""
    case = CASES["wd-linear-iters"]
    state = case["states"][3]["scheduler"]
    flags = [f if f != "0.1" else "0.2" for f in case["flags"]]  # --end-weight-decay 0.2
    changed = {"flags": flags, "data_parallel_size": case["data_parallel_size"]}
    with pytest.raises(CheckpointError, match="--end-weight-decay \\(or --weight-decay\\) 0.1 in the checkpoint"):
        _scheduler(_run(changed)).load_state_dict(state)
    kept = _scheduler(_run(changed, ["--use-checkpoint-opt_param-scheduler"]))
    kept.load_state_dict(state)
    assert kept.end_wd == 0.1 and kept.current_wd == case["applied_weight_decay"][4][0]
    const = CASES["iters-cosine"]
    longer = [f if f != "12" else "16" for f in const["flags"]]  # --train-iters 16: another wd length
    sched = _scheduler(_run({"flags": longer, "data_parallel_size": const["data_parallel_size"]}))
    sched.load_state_dict(const["states"][5]["scheduler"])
    assert sched.current_wd == 0.01 and sched.optimizer.param_groups[1]["weight_decay"] == 0.0
    old = {k: v for k, v in const["states"][5]["scheduler"].items() if "wd" not in k}
    fresh = _scheduler(_run(const))
    fresh.load_state_dict(old)
    assert fresh.current_lr == const["printed"][5]
