"""Hierarchical ZeRO (--zero-hierarchy package,node,network) checkpoints on 4 gloo ranks (2 simulated nodes of 2):
bit-exact resume in fp32 and in bf16 with the int8 network stage (its error-feedback residuals are saved), HF
export of the saved shards, resharding with Adam moments to another DP size, layout names and the TP refusal
(another DP size or tiers resumes in place: tests/checkpointing/test_relayout.py), retention, and a kill -9 in the
middle of a save."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.checkpointing.common import pretrain_on
from tests.checkpointing.test_faults import SAVING, SLOW_SAVE
from tests.launch import PRETRAIN, run_pretrain, start_ranks
from tests.models import CKPT_GPT

HIER = ["--zero-stage", "3", "--zero-hierarchy", "package,node,network", "--train-iters", "20"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _two_nodes(tmp_path) -> list[str]:
    """4 local ranks as 2 nodes x 2 GCDs, so the network tier (and its int8 stage) really exists."""
    path = str(tmp_path / "ds.json")
    with open(path, "w") as f:
        json.dump({"zero_optimization": {"stage": 3}, "megatron_frontier": {"ranks_per_node": 2}}, f)
    return ["--deepspeed_config", path]


def _batch(iteration: int, gbs: int = 4, seq: int = 16, vocab: int = 200, seed: int = 7) -> torch.Tensor:
    from megatron.data.mock_dataset import MockGPTDataset

    ds = MockGPTDataset(100, seq, vocab, seed)
    return torch.stack([torch.from_numpy(ds[i]["text"]) for i in range((iteration - 1) * gbs, iteration * gbs)])


@pytest.mark.timeout(600)
def test_fp32_resume_bit_exact_export_to_hf_and_layout_checks(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron.checkpointing.hf.convert import read_any
    from megatron.checkpointing.full_state.shard import load_into_model
    from megatron.checkpointing.resume_checks import refuse_hzero_tp_change, run_layout, saved_layout
    from megatron.core.parallel_state import single_process_state
    from megatron.errors import ConfigError
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model
    from tools.convert_checkpoint_to_hf import main as to_hf
    from tools.reshard_checkpoint import main as reshard

    save = str(tmp_path / "ckpt")
    # Vocab 256 needs no padding: HF sees the true vocabulary, so its loss equals ours only without padded rows.
    one_node = CKPT_GPT + NO_DROPOUT + HIER + ["--vocab-size", "256"]
    args = one_node + _two_nodes(tmp_path)
    straight = pretrain_on(4, args + ["--save", save, "--save-interval", "10"])["losses"]
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step10")
    step10 = os.path.join(save, "global_step10")
    assert sorted(os.listdir(step10)) == ([f"hzero_rank_{r:05d}.pt" for r in range(4)] + ["integrity.json",
                                                                                        "megatron_meta.json"])
    with open(os.path.join(step10, "megatron_meta.json")) as f:
        meta = json.load(f)
    assert meta["hierarchy"]["level_sizes"] == {"package": 2, "network": 2} and meta["has_optimizer"]

    # HF export of the hierarchical shards: GPT2LMHeadModel's logits are ours (same weights), and its loss on
    # batch 11 is the straight run's logged loss of iteration 11 (computed with the weights after step 10).
    assert to_hf(["--load", save, "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    full, model_fields, progress = read_any(save)
    assert progress["iteration"] == 10
    cfg = named_model("debug", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=256,
                      make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0)
    ours = GPTModel(cfg, tp=single_process_state().tp).eval()
    load_into_model(ours, full, 2, 1, 0, save)
    tokens = _batch(11, vocab=256)
    with torch.no_grad():
        theirs = hf(tokens[:, :-1]).logits
        mine = ours(tokens[:, :-1])
    assert (theirs - mine).abs().max().item() < 1e-5
    hf_loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, 256), tokens[:, 1:].reshape(-1)).item()
    assert abs(hf_loss - straight[11]) < 1e-5, (hf_loss, straight[11])

    # The fix those refusals name: resharded (weights and Adam moments) to one rank, DP 4 -> 1, the run goes on with
    # the straight run's losses (12 is the first update that reads the moments).
    assert reshard(["--load", save, "--save", str(tmp_path / "full")]) == 0
    one = pretrain_on(1, one_node + ["--load", str(tmp_path / "full"), "--exit-interval", "12"])["losses"]
    assert list(one) == [11, 12] and all(abs(one[i] - straight[i]) < 1e-5 for i in (11, 12)), (one, straight)

    # Another DP size, tiers, int8 stage or engine is a layout change, read in place (tests/checkpointing/
    # test_relayout.py resumes one); another TP size is refused before any process group, naming the fix.
    def now(**parallel):
        p = {"tp": 1, "pp": 1, "dp": 4, "ulysses": 1, "ep": 1, "zero_stage": 3,
             "zero_hierarchy": "package,node,network", "zero_hierarchy_int8": False, **parallel}
        return str(run_layout(SimpleNamespace(parallel=SimpleNamespace(**p), model=SimpleNamespace(
            moe=SimpleNamespace(enabled=False)))))

    assert str(saved_layout(meta)) == now() == ("TP 1 x PP 1 x DP 4 x EP 1, hierarchical ZeRO package,node,network "
                                                "(4 ranks)")
    assert now(dp=2) != now() and now(zero_hierarchy_int8=True).endswith("package,node,network + int8 (4 ranks)")
    assert now(zero_hierarchy=None).endswith("ZeRO-3 (4 ranks)")
    with pytest.raises(ConfigError) as e:
        refuse_hzero_tp_change(saved_layout(meta), run_layout(SimpleNamespace(parallel=SimpleNamespace(
            tp=2, pp=1, dp=2, ulysses=1, ep=1, zero_stage=3, zero_hierarchy="package,node,network",
            zero_hierarchy_int8=False), model=SimpleNamespace(moe=SimpleNamespace(enabled=False)))), step10)
    assert "--tensor-model-parallel-size 1, now 2" in str(e.value) and "tools/reshard_checkpoint.py" in str(e.value)
    assert "\n" not in str(e.value)

    # Resume from step 10 (retention keeps only the newest): iterations 11..20 are the straight run's, bit for bit.
    resumed = pretrain_on(4, args + ["--load", save, "--save", save, "--keep-last-n-checkpoints", "1"])["losses"]
    assert resumed == {i: straight[i] for i in range(11, 21)}, (resumed, straight)
    assert len(set(resumed.values())) == 10
    assert sorted(n for n in os.listdir(save) if n.startswith("global_step")) == ["global_step20"]


@pytest.mark.timeout(600)
def test_bf16_int8_exit_save_resume_bit_exact(tmp_path):
    """Dropout on: exactness also needs every rank's RNG state, which each rank writes into its own file."""
    save = str(tmp_path / "ckpt")
    args = CKPT_GPT + HIER + ["--bf16", "--zero-hierarchy-int8"] + _two_nodes(tmp_path)
    first = pretrain_on(4, args + ["--save", save, "--exit-interval", "10"])
    assert first["exit_reason"] == "--exit-interval 10" and list(first["losses"]) == list(range(1, 11))
    state = torch.load(os.path.join(save, "global_step10", "hzero_rank_00001.pt"), weights_only=True)
    assert state["residual"] is not None and state["residual"].abs().sum() > 0  # int8 error feedback is kept
    assert state["secondary"][0].dtype == torch.bfloat16 and state["master"].dtype == torch.float32
    resumed = pretrain_on(4, args + ["--save", save, "--load", save])["losses"]
    straight = pretrain_on(4, args)["losses"]
    assert resumed[20] == straight[20] and resumed == {i: straight[i] for i in range(11, 21)}, (resumed, straight)




@pytest.mark.timeout(200)
def test_kill_during_hierarchical_save_keeps_latest_loadable(tmp_path):
    save = str(tmp_path / "ckpt")
    args = CKPT_GPT + ["--zero-stage", "3", "--zero-hierarchy", "package,node,network", "--save", save,
                       "--save-interval", "2"]
    with start_ranks(1, [sys.executable, PRETRAIN, *args, "--train-iters", "6"], str(tmp_path),
                     env={"MEGATRON_FAULT": SLOW_SAVE}) as run:
        line = run.wait_for_line(0, SAVING, "err")  # the step-4 shard, under its temporary tag, not committed
        assert "hzero_rank_00000.pt" in line, line
        run[0].kill()
        run.wait(30)
    assert any(n.startswith("global_step4.tmp-") for n in os.listdir(save))
    assert open(os.path.join(save, "latest")).read() == "global_step2"
    out = run_pretrain(1, args + ["--load", save, "--train-iters", "3", "--lr-decay-iters", "6"])
    assert "loaded " + os.path.join(save, "global_step2") in out.stdout
    assert open(os.path.join(save, "latest")).read() == "global_step3"
    assert not any(".tmp-" in n for n in os.listdir(save))
