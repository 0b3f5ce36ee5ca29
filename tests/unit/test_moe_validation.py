"""Validation of a model with experts, as upstream Megatron-DeepSpeed's evaluate: the lm loss alone (its evaluate
drops every 'moe' key of the loss dict: ``if 'moe' not in key``), printed in its ' validation loss at ... |' line."""

import re
from types import SimpleNamespace

import pytest
import torch

from megatron.config import MoEConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
from megatron.config.sizes import named_model
from megatron.core.parallel_state import GroupInfo
from megatron.data.mock_dataset import MockGPTDataset
from megatron.model.gpt_model import GPTModel
from megatron.training.batches import microbatches
from megatron.training.evaluate import evaluate
from megatron.training.log import TrainingLogger
from megatron.training.step import gpt_forward_step

LINE = re.compile(r"^-+\n validation loss at iteration 4 \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| \n-+$", re.M)


def test_moe_validation_is_the_lm_loss_in_upstreams_line(capsys):
    model_cfg = named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            seq_length=16, vocab_size=120, make_vocab_size_divisible_by=64,
                            moe=MoEConfig(num_experts=(4,), expert_interval=1, topk=2, moe_loss_coeff=10.0,
                                          moe_eval_capacity_factor=0.5))
    run = RunConfig(model=model_cfg, parallel=ParallelConfig(world_size=1),
                    optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4),
                    training=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=4, eval_iters=2,
                                            seed=3))
    model = GPTModel(run.model, tp=GroupInfo([0], 0, None), init_seed=3)
    data = microbatches(MockGPTDataset(100, 16, 120, seed=4), 0, 2, 0, 1, "cpu")
    batches = [next(data) for _ in range(4)]  # 2 evaluation iterations x 2 micro-batches
    pstate = SimpleNamespace(global_rank=0, dp=GroupInfo([0], 0, None))
    got = evaluate(model, iter(batches), run, pstate, gpt_forward_step, run.training.eval_iters)
    assert model.training  # back to training mode
    model.eval()
    with torch.no_grad():  # by hand, in eval mode (the eval capacity factor): each micro-batch's lm and MoE losses
        lm, moe = zip(*[(gpt_forward_step(model, b).item(), model.take_moe_loss().item()) for b in batches],
                      strict=True)
    lm_mean, moe_mean = sum(lm) / 4, sum(moe) / 4
    assert got == pytest.approx(lm_mean, rel=1e-6) and moe_mean > 0.5  # the balancing loss is there, and left out
    logger = TrainingLogger(run, 0, model_cfg.padded_vocab_size(), 191.5)
    logger.validation("iteration 4", got, 4, 16)
    out = capsys.readouterr().out
    m = LINE.search(out)
    assert m and float(m.group(1)) == pytest.approx(lm_mean, rel=1e-6) and "moe" not in out, out
