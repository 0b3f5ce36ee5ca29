"""Activation recompute: identical loss and gradients (with dropout on, so RNG replay is tested), and fewer
activation bytes kept for the backward, measured with saved_tensors_hooks."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core.parallel_state import single_process_state
from megatron.core.tensor_parallel.random import set_seeds
from megatron.model.gpt_model import GPTModel
from megatron.perf.saved_tensors import saved_activation_bytes

TOL = 1e-6


def _cfg(granularity, **kw) -> ModelConfig:
    fields = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
                  make_vocab_size_divisible_by=64, use_cpu_initialization=True, hidden_dropout=0.2,
                  attention_dropout=0.2, recompute_granularity=granularity, attention_backend="torch")
    fields.update(kw)
    return ModelConfig(**fields)


def _loss_and_grads(cfg: ModelConfig, steps: int = 2):
    """Two forward/backward passes from the same seeds; dropout draws from both the default and TP streams."""
    set_seeds(11)
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    gen = torch.Generator().manual_seed(0)
    losses, grads = [], {}
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads


def _max_diff(a, b) -> float:
    losses = max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
    grads = max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])
    return max(losses, grads)


@pytest.mark.parametrize("granularity,extra", [("full", {}), ("full", {"recompute_num_layers": 2}),
                                               ("selective", {}), ("full", {"num_key_value_heads": 2,
                                                                            "normalization": "rmsnorm",
                                                                            "swiglu": True,
                                                                            "position_embedding_type": "rope"})])
def test_recompute_leaves_loss_and_grads_unchanged(granularity, extra):
    ref = _loss_and_grads(_cfg(None, **extra))
    assert _max_diff(ref, _loss_and_grads(_cfg(granularity, **extra))) <= TOL


def test_tracker_replay_is_what_makes_it_exact(monkeypatch):
    """Negative control: torch's checkpoint alone does not replay our TP RNG tracker, and the grads move."""
    from megatron.model import attention

    ref = _loss_and_grads(_cfg(None))
    monkeypatch.setattr(attention, "checkpoint",
                        lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
    assert _max_diff(ref, _loss_and_grads(_cfg("selective"))) > 1e-4


def _saved_bytes(cfg: ModelConfig) -> int:
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1))
    return saved_activation_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]).mean())


def test_recompute_lowers_saved_activation_memory():
    shape = dict(num_layers=4, seq_length=128, vocab_size=120)
    none, full, selective = (_saved_bytes(_cfg(g, **shape)) for g in (None, "full", "selective"))
    print(f"\nsaved activation bytes: none {none}, full {full} ({full / none:.3f}x), "
          f"selective {selective} ({selective / none:.3f}x)")
    assert full < 0.35 * none
    assert selective < 0.75 * none


def test_uniform_checkpoints_of_several_layers_keep_fewer_inputs():
    """--recompute-method uniform / --checkpoint-num-layers 2: one checkpoint per 2 layers, still exact."""
    shape = dict(num_layers=4, seq_length=128, vocab_size=120)
    ref = _loss_and_grads(_cfg(None))
    assert _max_diff(ref, _loss_and_grads(_cfg("full", checkpoint_chunk_layers=2))) <= TOL  # 3 layers: 2 + 1
    per_layer, chunks = (_saved_bytes(_cfg("full", checkpoint_chunk_layers=c, **shape)) for c in (1, 2))
    h_bytes = 4 * 128 * 64 * 4  # one [s, b, h] fp32 layer input
    assert per_layer - chunks == 2 * h_bytes  # 4 kept inputs -> 2


def test_checkpoint_options_leave_loss_and_grads_unchanged(capsys):
    """cpu_checkpointing, synchronize_checkpoint_boundary and profile (a CPU device: .to('cpu') is the input)."""
    ref = _loss_and_grads(_cfg(None))
    opts = dict(recompute_on_cpu=True, recompute_synchronize=True, recompute_profile=True)
    assert _max_diff(ref, _loss_and_grads(_cfg("full", **opts))) <= TOL
    out = capsys.readouterr().out
    assert out.count("> activation checkpoint forward:") == 2 * 3  # 2 steps x 3 layers
    assert out.count("> activation checkpoint backward (with recompute):") == 2 * 3


@pytest.mark.parametrize("flags,chunk,layers", [
    (["--checkpoint-activations"], 1, None),
    (["--checkpoint-activations", "--deepspeed-activation-checkpointing", "--checkpoint-num-layers", "2"], 2, None),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], 3, None),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"], 1, 3),
    (["--recompute-granularity", "full", "--recompute-method", "block"], 1, 1),
    # upstream: the DeepSpeed branch wins over --recompute-method
    (["--checkpoint-activations", "--deepspeed-activation-checkpointing", "--recompute-method", "block"], 1, None)])
def test_recompute_flags_mean_what_upstream_does(flags, chunk, layers):
    from megatron.arguments import model_config_from_args, parse_args

    cfg = model_config_from_args(parse_args(["--model-size", "debug", *flags]), 100)
    assert (cfg.recompute_granularity, cfg.checkpoint_chunk_layers, cfg.recompute_num_layers) == ("full", chunk, layers)


def test_recompute_flag_noops_are_said():
    from megatron.arguments import parse_args, run_config_from_args

    args = parse_args(["--model-size", "debug", "--lr", "1e-4", "--train-iters", "2", "--checkpoint-num-layers", "1",
                       "--deepspeed-activation-checkpointing", "--partition-activations"])
    notes = run_config_from_args(args, 1, 100).notes
    assert len(notes) == 3 and "nothing is recomputed" in notes[0] and "--checkpoint-num-layers" in notes[1]
