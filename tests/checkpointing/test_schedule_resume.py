"""A run changes pipeline schedule on resume (the per-layer files are the same whatever the schedule), optimizer
included. Saved under 1F1B: resumed under zero-bubble H1 directly (the same layers on each rank) and under interleaved
1F1B (other layers on each rank: the Adam moments follow their parameters by name), each with the straight run's
losses (within 1e-5 relative: the default ZB-H1 rounds differently, docs/verification.md); and back, interleaved ->
1F1B, with the straight run's last loss. Through pretrain_gpt.py's flags, PP=2 on 2 fresh processes per run."""

import os

import pytest

from tests.checkpointing.common import pretrain_on
from tests.models import CKPT_GPT

ARGS = CKPT_GPT + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--hidden-dropout", "0",
                   "--attention-dropout", "0", "--train-iters", "4"]
ZBH1 = ["--enable-zbh1-pipeline"]
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 4 layers, PP=2: two chunks per rank


def _point_latest(save_dir, tag: str) -> None:
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (got, want)
    for it in got:
        assert abs(got[it] - want[it]) <= 1e-5 * abs(want[it]), (it, got, want)


@pytest.mark.timeout(600)
def test_resume_under_another_schedule(tmp_path):
    first, second = tmp_path / "1f1b", tmp_path / "interleaved"
    straight = pretrain_on(2, ARGS + ["--save", str(first), "--save-interval", "2"])["losses"]
    assert len(set(straight.values())) == 4, straight
    _point_latest(first, "global_step2")
    _close(pretrain_on(2, ARGS + ZBH1 + ["--load", str(first)])["losses"], {3: straight[3], 4: straight[4]})
    interleaved = pretrain_on(2, ARGS + INTERLEAVED + ["--load", str(first), "--save", str(second),
                                                       "--save-interval", "3"])["losses"]
    _close(interleaved, {3: straight[3], 4: straight[4]})  # iteration 4: the carried moments' update
    _point_latest(second, "global_step3")
    _close(pretrain_on(2, ARGS + ["--load", str(second)])["losses"], {4: straight[4]})
