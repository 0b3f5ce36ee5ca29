"""--partition-activations / JSON partition_activations with TP=2: each checkpoint keeps half of its input, and the
loss and every gradient equal the unpartitioned recompute's (dropout on, so the RNG replay is exercised too)."""

import pytest

from tests.launch import run_distributed


def _cfg(partition: bool):
    from megatron.config import ModelConfig

    return ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
                       make_vocab_size_divisible_by=64, use_cpu_initialization=True, hidden_dropout=0.2,
                       attention_dropout=0.2, recompute_granularity="full", attention_backend="torch",
                       recompute_partition=partition)


def _worker():
    import torch

    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel.random import set_seeds
    from megatron.initialize import initialize_distributed
    from megatron.model.gpt_model import GPTModel
    from megatron.perf.saved_tensors import saved_activation_bytes

    initialize_distributed("gloo")
    state = ParallelState.build(2)
    out = {}
    for partition in (False, True):
        cfg = _cfg(partition)
        set_seeds(11)
        model = GPTModel(cfg, tp=state.tp, init_seed=3)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
        nbytes = saved_activation_bytes(model, lambda m=model, t=tokens: m(t[:, :-1], t[:, 1:]).mean())
        out[partition] = (nbytes, {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.timeout(300)
def test_partitioned_checkpoints_keep_half_the_input_and_the_same_grads():
    for res in run_distributed(_worker, world_size=2):
        (whole, ref), (half, got) = res[False], res[True]
        assert max((ref[n] - got[n]).abs().max().item() for n in ref) <= 1e-6
        assert any(g.abs().sum() > 0 for g in got.values())
        input_bytes = 32 * 2 * 64 * 4  # one [s, b, h] fp32 layer input
        assert whole - half == 3 * input_bytes // 2  # 3 checkpoints, each keeps 1/TP of its input
