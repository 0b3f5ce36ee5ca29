"""Acceptance (issue 44, Weights & Biases): a 30-iteration run with --wandb-project p --wandb-exp-name e, without
network and without a W&B key, starts without waiting and writes an offline run whose history, read back with wandb's
own reader (`wandb leet inspect --json`), holds the lm loss of every logged iteration equal to the TensorBoard scalar
(and every other TensorBoard series under its name and step). The run is a campaign of two jobs (the first exits at
iteration 15, the second resumes), each on two pipeline stages: both log to one run id, kept in the run folder, and
the printed `wandb sync` command names both jobs' folders."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

import numpy as np
import pytest

from megatron.training.wandb_writer import custom_axis
from tests.functional.wandb_reader import WANDB, offline_env, wandb_history
from tests.launch import clean_env, run_distributed
from tests.models import CKPT_GPT

STARTED = re.compile(r"^> W&B run (\w+) \(p, e\): offline \(no W&B API key.*?\), started in ([\d.]+) s", re.M)
MEASURED = {"tokens-per-sec", "TFLOPs", "MFU", "mem-GB"}
"""Series each writer's rank measures itself (its own step time and memory): TensorBoard's are rank 0's."""
SYNC = re.compile(r"^> W&B run (\w+) written offline; upload it .* with: (wandb sync .*)$", re.M)


def _pretrain_job(argv: list[str]) -> str:
    """One job of the campaign on a function rank (pretrain_gpt.py's providers), a key or mode of the caller's
    environment dropped (offline_env's job); returns what it printed."""
    import contextlib
    import io

    from tests.checkpointing.common import _pretrain

    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        os.environ.pop(k, None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _pretrain(argv)
    return out.getvalue()


def _job(args: list[str], env: dict[str, str]) -> list[str]:
    """What each of the two pipeline stages printed."""
    return run_distributed(_pretrain_job, 2, timeout=300, env=env, argv=args)


def _tensorboard(path: str) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in the TensorBoard folder (both jobs' event files)."""
    from tensorboard.backend.event_processing import event_accumulator

    got: dict[str, dict[int, float]] = {}
    for events in sorted(glob.glob(os.path.join(path, "events.*"))):
        acc = event_accumulator.EventAccumulator(events, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            got.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return got


@pytest.mark.timeout(600)
def test_offline_run_holds_tensorboards_loss_and_the_campaign_keeps_one_run(tmp_path):
    env = offline_env(tmp_path)
    save, tb = tmp_path / "run", tmp_path / "tb"
    # Two pipeline stages: TensorBoard's writer is rank 0's, W&B's the last rank's (upstream's), the loss reaches
    # both from the last stage.
    args = CKPT_GPT + ["--train-iters", "30", "--pipeline-model-parallel-size", "2", "--save", str(save),
                       "--tensorboard-dir", str(tb), "--wandb-project", "p", "--wandb-exp-name", "e",
                       "--eval-interval", "10", "--eval-iters", "1"]
    jobs = [_job(args + ["--exit-interval", "15"], env), _job(args + ["--load", str(save)], env)]
    assert not any(STARTED.search(stage0) for stage0, _ in jobs)  # one writer, on the last rank
    first, second = (last for _, last in jobs)
    starts = [STARTED.search(out) for out in (first, second)]
    assert all(starts), (first[-2000:], second[-2000:])
    run_id = starts[0].group(1)
    assert starts[1].group(1) == run_id == json.loads((save / "wandb" / "wandb_run.json").read_text())["id"]
    # No wait for the service: the hang this guards against is wandb.init's timeout (90 s by default, 60 s as we
    # start it online). W&B's own start (its wandb-core process) takes about 1 s here; the bound leaves room for a
    # 2-core machine shared by several test runs (import and start took up to 24 s at a load average of 40). No key: no
    # connection is even tried (tests/unit/test_wandb_writer.py).
    assert all(float(m.group(2)) < 30 for m in starts), [m.group(0) for m in starts]

    folders = sorted(glob.glob(str(save / "wandb" / "wandb" / f"offline-run-*-{run_id}")))
    assert len(folders) == 2
    history = wandb_history(folders, env)
    assert sorted(history) == list(range(1, 31))
    scalars = _tensorboard(str(tb))
    loss = scalars["lm-loss-training/lm loss"]
    assert sorted(loss) == list(range(1, 31))
    for it in range(1, 31):  # TensorBoard stores float32
        assert np.float32(history[it]["lm-loss-training/lm loss"]) == np.float32(loss[it]), it
        assert history[it]["loss/lm loss"] == history[it]["lm-loss-training/lm loss"]  # upstream's W&B-only series
        assert history[it]["Samples"] == 4 * it  # the "vs samples" series' axis, on the iteration's step
    # Every TensorBoard series under its name: at the iteration's step, or (" vs samples/tokens") where W&B's axis
    # holds TensorBoard's step; equal but for what each writer's rank measures itself.
    assert len(scalars) >= 15
    assert {"learning-rate/learning-rate", "grad-norm/grad-norm", "MFU", "mem-GB",
            "lm-loss-validation/lm loss validation", "lm-loss-validation/lm loss test"} <= set(scalars)
    for tag, series in scalars.items():
        axis = custom_axis(tag)
        for step, value in series.items():
            rows = [history[step]] if axis is None else [r for r in history.values() if r.get(axis) == step]
            got = [np.float32(r[tag]) for r in rows if tag in r]
            assert len(got) == 1 and (tag in MEASURED or got[0] == np.float32(value)), (tag, step, got, value)

    sync = SYNC.search(second)
    assert sync and sync.group(1) == run_id
    command = sync.group(2).split()
    assert command[:5] == ["wandb", "sync", "--id", run_id, "-p"] and command[6:] == folders
    dry = subprocess.run([WANDB, *command[1:], "--dry-run"], capture_output=True, text=True,
                         env=clean_env(env))
    assert dry.returncode == 0, dry.stderr[-2000:]
