"""DeepSpeed-Ulysses checkpoints: SP=2 resumes exactly, and its checkpoint resharded to a full state (weights and
Adam moments) resumes at SP=1 on one process with the same losses."""

import os

import pytest

from tests.checkpointing.common import pretrain_on
from tests.models import TINY_LLAMA

ARGS = TINY_LLAMA + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "1", "--vocab-size",
                       "256", "--train-iters", "4"]


@pytest.mark.timeout(400)
def test_sp2_resume_exact_and_reshard_to_sp1(tmp_path):
    from tools.reshard_checkpoint import main as reshard

    save = str(tmp_path / "ckpt")
    sp2 = ARGS + ["--ds-sequence-parallel-size", "2"]
    straight = pretrain_on(2, sp2 + ["--save", save, "--save-interval", "2"])["losses"]
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step2")
    resumed = pretrain_on(2, sp2 + ["--load", save])["losses"]
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)
    assert len(set(straight.values())) == 4, straight

    # Iteration 3 checks the weights, iteration 4 the Adam moments' update.
    assert reshard(["--load", save, "--tag", "global_step2", "--save", str(tmp_path / "full")]) == 0
    single = pretrain_on(1, ARGS + ["--load", str(tmp_path / "full")])["losses"]
    assert list(single) == [3, 4], single
    assert all(abs(single[i] - resumed[i]) < 1e-5 for i in (3, 4)), (single, resumed)
