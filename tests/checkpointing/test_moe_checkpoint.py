"""A model with experts through pretrain_gpt.py on EP=2 with ZeRO-2: the log's lm and MoE losses, an exact resume
from DeepSpeed's per-expert checkpoint files (weights, the experts' ZeRO optimizer partitions, RNG), and the same
checkpoint resharded over EP through a full state (tools/reshard_checkpoint.py) going on at EP=1."""

import os

import pytest

from tests.checkpointing.common import pretrain_on
from tests.models import CKPT_GPT

ARGS = CKPT_GPT + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "2", "--train-iters", "3",
                   "--num-experts", "4", "--expert-interval", "1", "--moe-expert-parallel-size", "2", "--topk", "2",
                   "--moe-train-capacity-factor", "0.75", "--micro-batch-size", "2", "--moe-min-capacity", "2",
                   "--vocab-size", "256"]  # no padded vocabulary rows: a full state drops them (exact resharding)


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

    # Resharded over EP: the experts merged by global index (weights and ZeRO-2 Adam moments) into a full state,
    # loaded at EP=1 (every rank all 4 experts): iteration 3 as the straight EP=2 run. The gate sees the same
    # tokens on each DP rank whatever EP is, so only the order of float sums may differ.
    import tools.reshard_checkpoint as reshard
    from megatron.checkpointing.full_state.files import read_full_moments, read_full_state

    full = str(tmp_path / "full")
    assert reshard.main(["--load", save, "--save", full]) == 0
    weights, _ = read_full_state(full)
    moments, step = read_full_moments(full)
    experts = sorted(n for n in weights if ".deepspeed_experts." in n)
    assert len(experts) == 2 * 4 * 4 and set(moments) == set(weights) and step == 2, (len(experts), step)
    at_ep1 = list(ARGS)
    at_ep1[at_ep1.index("--moe-expert-parallel-size") + 1] = "1"
    moved = pretrain_on(2, at_ep1 + ["--load", full])
    assert sorted(moved["losses"]) == [3], moved
    assert moved["losses"][3] == pytest.approx(straight["losses"][3], abs=1e-5), (moved, straight)
    assert moved["moe_losses"][3] == pytest.approx(straight["moe_losses"][3], abs=1e-6), (moved, straight)

    # The integrity manifest covers every expert file: a flipped byte in one is named before any conversion.
    from megatron.checkpointing.live import integrity
    from megatron.errors import CheckpointError

    step2 = os.path.join(save, "global_step2")
    listed = integrity.read_manifest(step2)
    assert {f for f in files if "_expert_" in f} <= set(listed), sorted(listed)
    victim = os.path.join(step2, "layer_1_expert_3_mp_rank_00_model_states.pt")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="layer_1_expert_3_mp_rank_00_model_states.pt"):
        reshard.main(["--load", save, "--save", str(tmp_path / "full2")])

PIPE = CKPT_GPT + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "1", "--train-iters", "3",
                   "--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-interval", "1",
                   "--moe-expert-parallel-size", "2", "--topk", "1", "--moe-train-capacity-factor", "0.75",
                   "--moe-min-capacity", "2", "--global-batch-size", "8", "--eval-interval", "2", "--eval-iters", "1",
                   "--vocab-size", "256"]  # no padded vocabulary rows: exact through a full state


@pytest.mark.timeout(400)
def test_ep2_pp2_resumes_exactly_from_the_pipelines_files(tmp_path):
    """PP=2 x EP=2 (4 ranks, ZeRO-1), one MoE layer per stage: under a pipeline with experts DeepSpeed writes each
    stage's dense weights in its model file (no pipeline layer files) and one file per expert, numbered by the
    stage's own MoE layers with the stage's model-parallel rank in the name; the integrity manifest lists them."""
    from megatron.checkpointing.live import integrity

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
    # Resharded: the pipeline's per-stage model files and expert files merged into a full state (weights and ZeRO-1
    # moments), loaded without a pipeline at EP=1 on 2 ranks: iteration 3 as the straight PP=2 x EP=2 run.
    import tools.reshard_checkpoint as reshard
    from megatron.checkpointing.full_state.files import read_full_moments, read_full_state

    full = str(tmp_path / "full")
    assert reshard.main(["--load", save, "--tag", "global_step2", "--save", full]) == 0
    weights, _ = read_full_state(full)
    moments, step = read_full_moments(full)
    assert len([n for n in weights if ".deepspeed_experts." in n]) == 2 * 4 * 4 and set(moments) == set(weights)
    flat = list(PIPE)
    flat[flat.index("--pipeline-model-parallel-size") + 1] = "1"
    flat[flat.index("--moe-expert-parallel-size") + 1] = "1"
    moved = pretrain_on(2, flat + ["--load", full])
    assert sorted(moved["losses"]) == [3], moved
    assert moved["losses"][3] == pytest.approx(straight["losses"][3], abs=1e-5), (moved, straight)
    assert moved["moe_losses"][3] == pytest.approx(straight["moe_losses"][3], abs=1e-6), (moved, straight)
