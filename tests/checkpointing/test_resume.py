"""Exact resume through pretrain_gpt.py's providers on fresh processes (2N straight == N, save, resume N),
plus what the saved checkpoints must also serve: DeepSpeed's zero_to_fp32, HF export from a TP=2 x PP=2
run, and loading a TP=2 x PP=2 checkpoint at TP=1 x PP=1 (full-state resharding, Adam moments included)."""

import os

import pytest
import torch

from tests.checkpointing.common import check_resume_exact, pretrain_on
from tests.models import CKPT_GPT, TINY_LLAMA

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
ITERS = ["--train-iters", "4"]


def _batch(iteration: int, gbs: int = 4, seq: int = 16, vocab: int = 200, seed: int = 7) -> torch.Tensor:
    """The global batch of ``iteration`` (1-based) under --mock-data: samples depend only on (seed, index)."""
    from megatron.data.mock_dataset import MockGPTDataset

    ds = MockGPTDataset(100, seq, vocab, seed)
    return torch.stack([torch.from_numpy(ds[i]["text"]) for i in range((iteration - 1) * gbs, iteration * gbs)])


def _point_latest(save_dir: str, tag: str) -> None:
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


@pytest.mark.timeout(300)
def test_zero1_tp2_resume_exact_with_dropout(tmp_path):
    """Dropout on: exactness needs every rank's RNG (python, numpy, torch, tracker) restored."""
    args = CKPT_GPT + ["--tensor-model-parallel-size", "2", "--zero-stage", "1"] + ITERS
    straight = pretrain_on(2, args)["losses"]
    first = pretrain_on(2, args + ["--exit-interval", "2", "--save", str(tmp_path)])
    assert first["exit_reason"] == "--exit-interval 2" and list(first["losses"]) == [1, 2]
    assert open(tmp_path / "latest").read() == "global_step2"
    resumed = pretrain_on(2, args + ["--save", str(tmp_path), "--load", str(tmp_path), "--keep-last-n-checkpoints",
                                     "1"])["losses"]
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)
    assert len(set(straight.values())) == 4
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("global_step")) == ["global_step4"]


@pytest.mark.timeout(300)
def test_zero3_dp2_resume_exact_and_zero_to_fp32(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model
    from megatron.training.step import gpt_forward_step

    args = CKPT_GPT + NO_DROPOUT + ["--zero-stage", "3"] + ITERS
    straight = pretrain_on(2, args + ["--save", str(tmp_path), "--save-interval", "2"])["losses"]
    _point_latest(str(tmp_path), "global_step2")
    resumed = pretrain_on(2, args + ["--load", str(tmp_path)])["losses"]
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)

    # DeepSpeed's own zero_to_fp32 reads the checkpoint; its weights give the straight run's loss at step 3.
    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="global_step2")
    cfg = named_model("debug", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
                      make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, tp=single_process_state().tp).eval()
    model.load_state_dict(sd)
    with torch.no_grad():
        loss = gpt_forward_step(model, {"text": _batch(3)}).item()
    assert abs(loss - straight[3]) < 1e-5, (loss, straight[3])


@pytest.mark.timeout(400)
def test_pp2_tp2_llama_resume_export_and_reshard(tmp_path):
    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint_to_hf import main as to_hf
    from tools.reshard_checkpoint import main as reshard

    save = str(tmp_path / "ckpt")
    # Vocab 256 needs no padding at TP=1 or 2: padded rows take part in our softmax but are dropped on export
    # (HF sees the true vocab) and zero-filled on resharding, so only then must the losses agree exactly.
    args = TINY_LLAMA + NO_DROPOUT + ["--zero-stage", "1", "--vocab-size", "256"] + ITERS
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    straight = pretrain_on(4, args + layout + ["--save", save, "--save-interval", "2"])["losses"]
    _point_latest(save, "global_step2")
    resumed = pretrain_on(4, args + layout + ["--load", save])["losses"]
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)

    # HF export of the TP=2 x PP=2 checkpoint: LlamaForCausalLM's loss on batch 3 is the run's own.
    assert to_hf(["--load", save, "--tag", "global_step2", "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    tokens = _batch(3, vocab=256)
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(hf_loss.item() - straight[3]) < 1e-5, (hf_loss.item(), straight[3])

    # Resharding: the TP=2 x PP=2 checkpoint, as a full state with its Adam moments, resumes at TP=1 x PP=1 with the
    # unresharded resume's losses: iteration 3 checks the weights, iteration 4 the moments' update.
    assert reshard(["--load", save, "--tag", "global_step2", "--save", str(tmp_path / "full")]) == 0
    single = pretrain_on(1, args + ["--load", str(tmp_path / "full")])["losses"]
    assert list(single) == [3, 4], single
    assert all(abs(single[i] - resumed[i]) < 1e-5 for i in (3, 4)), (single, resumed)
    # The same resume with the moments restarted (--no-load-optim) misses iteration 4: the check can fail.
    fresh = pretrain_on(1, args + ["--load", str(tmp_path / "full"), "--no-load-optim"])["losses"]
    assert abs(fresh[3] - resumed[3]) < 1e-5 and abs(fresh[4] - resumed[4]) > 1e-4, (fresh, resumed)


@pytest.mark.timeout(300)
def test_bf16_zero1_resume_exact(tmp_path):
    """bf16 (DeepSpeed's bf16 ZeRO-1 optimizer: fp32 master weights and moments in the checkpoint) with dropout
    on, one process; tests/gpu runs the same check on a GPU."""
    check_resume_exact(1, CKPT_GPT + ["--bf16", "--zero-stage", "1"], str(tmp_path))
