"""A model with experts through pretrain_gpt.py on EP=2 with ZeRO-2: the log's lm and MoE losses, and an exact resume
from DeepSpeed's per-expert checkpoint files (weights, the experts' ZeRO optimizer partitions, RNG)."""

import os

import pytest

from tests.checkpointing.common import BASE, pretrain_on

ARGS = BASE + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "2", "--train-iters", "3",
               "--num-experts", "4", "--expert-interval", "1", "--moe-expert-parallel-size", "2", "--topk", "2",
               "--moe-train-capacity-factor", "0.75", "--micro-batch-size", "2", "--moe-min-capacity", "2"]


@pytest.mark.timeout(400)
def test_ep2_zero2_resumes_exactly_from_its_expert_files(tmp_path):
    save = str(tmp_path / "ckpt")
    straight = pretrain_on(2, ARGS + ["--save", save, "--save-interval", "2"])
    files = os.listdir(os.path.join(save, "global_step2"))  # (and global_step3: the end of training is kept)
    # Each of the 2 MoE layers' 4 experts in a file of its own (DeepSpeed's layout), whichever rank holds it.
    assert sorted(f for f in files if "_expert_" in f) == sorted(
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)), files
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step2")
    resumed = pretrain_on(2, ARGS + ["--load", save])
    assert resumed["losses"] == {3: straight["losses"][3]}, (resumed, straight)
    assert resumed["moe_losses"] == {3: straight["moe_losses"][3]}, (resumed, straight)
    assert len(set(straight["losses"].values())) == 3 and min(straight["moe_losses"].values()) > 0.05, straight


PIPE = BASE + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "1", "--train-iters", "3",
               "--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-interval", "1",
               "--moe-expert-parallel-size", "2", "--topk", "1", "--moe-train-capacity-factor", "0.75",
               "--moe-min-capacity", "2", "--global-batch-size", "8", "--eval-interval", "2", "--eval-iters", "1"]


@pytest.mark.timeout(400)
def test_ep2_pp2_resumes_exactly_from_the_pipelines_files(tmp_path):
    """PP=2 x EP=2 (4 ranks, ZeRO-1), one MoE layer per stage: under a pipeline with experts DeepSpeed writes each
    stage's dense weights in its model file (no pipeline layer files) and one file per expert, numbered by the
    stage's own MoE layers with the stage's model-parallel rank in the name; the integrity manifest lists them."""
    from megatron.checkpointing import integrity

    save = str(tmp_path / "ckpt")
    straight = pretrain_on(4, PIPE + ["--save", save, "--save-interval", "2"])
    step2 = os.path.join(save, "global_step2")
    files = set(os.listdir(step2))
    experts = {f for f in files if "_expert_" in f}
    assert experts == {f"layer_0_expert_{e}_mp_rank_{m:02d}_model_states.pt" for e in range(4) for m in (0, 1)}, files
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= files, files
    assert experts <= set(integrity.read_manifest(step2)), "expert files missing from the integrity manifest"
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step2")
    resumed = pretrain_on(4, PIPE + ["--load", save])
    assert resumed["losses"] == {3: straight["losses"][3]}, (resumed, straight)
    assert resumed["moe_losses"] == {3: straight["moe_losses"][3]}, (resumed, straight)
    assert len(set(straight["losses"].values())) == 3 and min(straight["moe_losses"].values()) > 0.05, straight
    # Evaluation on the pipeline (the lm loss alone, tests/unit/test_moe_pipe.py) resumes exactly too.
    assert 2 in straight["valid_losses"] and resumed["final_eval"] == straight["final_eval"], (resumed, straight)
