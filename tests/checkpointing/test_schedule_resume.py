"""A run changes pipeline schedule on resume: saved under 1F1B, resumed under zero-bubble H1 directly (the same layers
on each rank), under interleaved 1F1B through the full-state conversion (each rank's optimizer state follows its
layers: a direct resume is refused in one line), and from interleaved back to 1F1B, each with the straight 1F1B run's
losses (within 1e-5 relative: the default ZB-H1 and interleaving round differently, docs/verification.md). Through
pretrain_gpt.py's flags, PP=2 on 2 fresh processes per run."""

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
    from tools.reshard_checkpoint import main as reshard

    first, second = tmp_path / "1f1b", tmp_path / "interleaved"
    straight = pretrain_on(2, ARGS + ["--save", str(first), "--save-interval", "2"])["losses"]
    assert len(set(straight.values())) == 4, straight
    _point_latest(first, "global_step2")
    _close(pretrain_on(2, ARGS + ZBH1 + ["--load", str(first)])["losses"], {3: straight[3], 4: straight[4]})
    with pytest.raises(RuntimeError, match="model chunk"):  # a rank's error fails its launch
        pretrain_on(2, ARGS + INTERLEAVED + ["--load", str(first)])
    assert reshard(["--load", str(first), "--tag", "global_step2", "--save", str(tmp_path / "full2")]) == 0
    interleaved = pretrain_on(2, ARGS + INTERLEAVED + ["--load", str(tmp_path / "full2"), "--save", str(second),
                                                       "--save-interval", "3"])["losses"]
    _close(interleaved, {3: straight[3], 4: straight[4]})
    assert reshard(["--load", str(second), "--tag", "global_step3", "--save", str(tmp_path / "full3")]) == 0
    _close(pretrain_on(2, ARGS + ["--load", str(tmp_path / "full3")])["losses"], {4: straight[4]})
