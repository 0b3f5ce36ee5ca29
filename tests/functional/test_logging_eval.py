"""pretrain_gpt.py's TensorBoard event files hold upstream Megatron-DeepSpeed's tags (read back with tensorboard's
own event reader), a finished run evaluates the valid and test splits at the end, and --skip-train evaluates a
saved checkpoint to the same numbers. One 3-iteration run with every honoured logging flag (2 ranks, ZeRO-1: DP=2
averages and reductions), one --skip-train run."""

import glob
import json
import math
import re
from pathlib import Path

import pytest

from tests.launch import free_port, losses, run_pretrain
from tests.models import TINY_GPT

EVAL = re.compile(r"^-+\n validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| \n-+$", re.M)
FLAGS = ["--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
         "--log-memory-to-tensorboard", "--log-timers-to-tensorboard", "--timing-log-level", "2",
         "--timing-log-option", "max", "--log-params-norm", "--log-optimizer-states-to-tensorboard",
         "--tensorboard-log-interval", "2", "--no-log-learnig-rate-to-tensorboard", "--log-num-zeros-in-grad"]


UPSTREAM = json.loads((Path(__file__).parents[1] / "fixtures" / "upstream_tensorboard" / "tags.json").read_text())


def _series(*tags: str) -> set[str]:
    return {f"{t}{s}" for t in tags for s in ("", " vs samples", " vs tokens")}


# Written here beyond upstream's run: the grad norm (upstream under --deepspeed without a pipeline has none),
# --log-params-norm and --log-memory-to-tensorboard (upstream cannot run them on CPU), our throughput series.
EXTRAS = _series("grad-norm/grad-norm", "params-norm/params-norm") | {
    "mem-reserved-bytes", "mem-allocated-bytes", "tokens-per-sec", "TFLOPs", "MFU", "mem-GB"}


def _args(**over) -> list[str]:
    argv = list(TINY_GPT)
    for flag, value in over.items():
        i = argv.index(flag)
        argv[i + 1] = value
    return argv


def _evals(stdout: str) -> dict[str, tuple[float, float]]:
    out = {}
    for m in EVAL.finditer(stdout):
        # the dashed lines are one longer than the text line, as upstream's
        assert len(m.group(0).splitlines()[0]) == len(m.group(0).splitlines()[1]) + 1
        out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return out


def _scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(600)
def test_upstream_tags_end_evaluation_and_skip_train(tmp_path):
    base = _args(**{"--train-iters": "3", "--eval-iters": "1"})
    base += ["--zero-stage", "1", "--eval-interval", "2", "--save", str(tmp_path / "ck")]
    out = run_pretrain(2, base + ["--tensorboard-dir", str(tmp_path / "tb"), *FLAGS,
                                  "--profile", "pt", "--profile_steps", "2,2"]).stdout
    tags = _scalars(str(tmp_path / "tb"))
    assert len(glob.glob(str(tmp_path / "tb" / "*.pt.trace.json.gz"))) == 2  # --profile: step 2 of each rank

    # The same tags as upstream's own run with these flags, at the same iterations (tests/fixtures/upstream_tensorboard;
    # its run kept the learning rate, which this one turns off).
    upstream = {t: steps for t, steps in UPSTREAM["scalars"].items() if not t.startswith("learning-rate/")}
    assert set(upstream) <= set(tags), sorted(set(upstream) - set(tags))
    assert set(tags) - set(upstream) <= EXTRAS, sorted(set(tags) - set(upstream) - EXTRAS)
    for tag, steps in upstream.items():
        if " vs " not in tag and "=" not in tag:  # the iteration axis (samples and tokens depend on the batch shape)
            assert [s for s, _ in tags[tag]] == steps, (tag, tags[tag], steps)
    assert [re.sub(r"\d+-sample", "N-sample", p) for p in UPSTREAM["evaluation_lines"]] == \
        [re.sub(r"\d+-sample", "N-sample", p) for p in _evals(out)]
    setup = {"model-and-optimizer-setup"}  # printed once at start-up by upstream, not a training timer
    assert set(re.findall(r"^    ([a-z-]+) \.+: \d+\.\d\d$", out, re.M)) == set(UPSTREAM["timer_lines"]) - setup

    # Stdout: periodic validation at 2, then valid and test at the end over eval_iters x GBS = 8 samples.
    evals = _evals(out)
    end_valid = "iteration 3 on 8-sample draw from validation set"
    end_test = "iteration 3 on 8-sample draw from test set"
    assert list(evals) == ["iteration 2", end_valid, end_test], out
    for loss, ppl in evals.values():
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert evals[end_valid][0] != evals[end_test][0]  # the test split is other data

    # Tags: upstream's names; the validation and test losses against iteration, samples and tokens.
    for kind, points in (("validation", [(2, evals["iteration 2"][0]), (3, evals[end_valid][0])]),
                         ("test", [(3, evals[end_test][0])])):
        for suffix, scale in (("", 1), (" vs samples", 8), (" vs tokens", 8 * 32)):
            got = tags[f"lm-loss-validation/lm loss {kind}{suffix}"]
            assert [s for s, _ in got] == [s * scale for s, _ in points]
            assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6)
        assert [v for _, v in tags[f"lm-loss-validation/lm loss {kind} ppl"]] == \
            pytest.approx([math.exp(v) for _, v in points], rel=1e-5)  # --log-validation-ppl-to-tensorboard

    # Training series at --tensorboard-log-interval 2 only, the iteration's own loss (= the log's at interval 1).
    train_loss = losses(out)
    assert tags["lm-loss-training/lm loss"] == [(2, pytest.approx(train_loss[2], rel=1e-6))]
    assert tags["lm-loss-training/lm loss vs samples"][0][0] == 16
    assert tags["lm-loss-training/lm loss vs tokens"][0][0] == 16 * 32
    assert tags["batch-size/batch-size"] == [(2, 8.0)] and tags["world-size/world-size"] == [(2, 2.0)]
    assert not any(t.startswith("learning-rate/") for t in tags)  # --no-log-learnig-rate-to-tensorboard
    assert {"mem-reserved-bytes", "mem-allocated-bytes"} <= set(tags)
    assert [s for s, _ in tags["grad-norm/grad-norm"]] == [2]
    # --log-params-norm: in the log line, and the tag equals the norm of the optimizer's fp32 weights, which ZeRO-1
    # splits over the 2 DP ranks (summed over DP as upstream's): another path to the same number.
    assert re.search(r"grad norm: \S+ \| params norm: \d+\.\d{3} \|", out)
    assert len([t for t in tags if t.startswith("optimizer/")]) == 24
    assert tags["params-norm/params-norm"][0][1] == pytest.approx(tags["optimizer/weight_l2"][0][1], rel=1e-6)
    # --log-timers-to-tensorboard: iteration time at every log interval, timers at the TensorBoard interval.
    assert [s for s, _ in tags["iteration-time/iteration-time"]] == [1, 2, 3]
    assert {f"{n}-time" for n in ("forward-backward", "batch-generator", "optimizer")} <= set(tags)
    # --timing-log-level 2 with --timing-log-option max: upstream's block, max only.
    assert re.search(r"\(min, max\) time across ranks \(ms\):\n    forward-backward \.+: \d+\.\d\d\n", out), out
    assert "--log-num-zeros-in-grad is accepted and has no effect here" in out

    # --skip-train on the saved checkpoint: the same end-of-training numbers, no training, no TensorBoard.
    skip = run_pretrain(2, base[:-2] + ["--load", str(tmp_path / "ck"), "--skip-train", "--tensorboard-dir",
                                        str(tmp_path / "tb2")])
    assert "skipping training (--skip-train is on)" in skip.stdout and not losses(skip.stdout)
    assert _evals(skip.stdout) == {end_valid: evals[end_valid], end_test: evals[end_test]}, skip.stdout
    assert not (tmp_path / "tb2").exists()


def test_wandb_without_a_folder_is_refused_in_one_line():
    """W&B is honoured (tests/functional/test_wandb_offline.py); with neither --wandb-save-dir nor --save it has no
    folder (upstream crashes on os.path.join(None, 'wandb')): one line naming both."""
    proc = run_pretrain(1, TINY_GPT + ["--wandb-project", "p"], check=False, env={"MASTER_PORT": str(free_port())})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--wandb-project" in proc.stderr and "--wandb-save-dir" in \
        proc.stderr and "--save DIR" in proc.stderr, proc.stderr
