"""TP=2 and TP=4 against the single-process model: logits, loss and every parameter's gradient."""

import pytest
import torch
import torch.nn.functional as F

from tests.launch import run_distributed

TOL = 1e-5


def _shard(full, p, tp):
    from megatron.core.tensor_parallel.layers import shard_tensor

    if not getattr(p, "tensor_model_parallel", False):
        return full
    return shard_tensor(full, p.partition_dim, tp.size, tp.rank, getattr(p, "partition_stride", 1))


def _compare_model(variant, tp, sequence_parallel):
    from megatron.core.parallel_state import GroupInfo
    from megatron.model.gpt_model import GPTModel, gather_logits
    from megatron.config.sizes import named_model

    cfg = named_model(variant, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                      seq_length=16, vocab_size=250, make_vocab_size_divisible_by=64)
    if cfg.swiglu:  # GQA with 2 query heads per KV head, and KV heads divisible by TP=4
        cfg = cfg.replace(num_attention_heads=8, num_key_value_heads=4)
    cfg.validate(tp.size)
    ref = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=7)
    par = GPTModel(cfg, tp=tp, sequence_parallel=sequence_parallel, init_seed=7)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    errs = {}
    with torch.no_grad():
        errs["logits"] = (gather_logits(par(x), tp) - ref(x)).abs().max().item()
    loss_ref = ref(x, y).mean()
    loss_par = par(x, y).mean()
    loss_ref.backward()
    loss_par.backward()
    errs["loss"] = abs(loss_ref.item() - loss_par.item())
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in par.named_parameters():
        g_ref = _shard(ref_params[name].grad, p, tp)
        scale = max(1.0, g_ref.abs().max().item())
        worst = max(worst, (p.grad - g_ref).abs().max().item() / scale)
    errs["grad"] = worst
    errs["nparams"] = len(ref_params)
    return errs


def _compare_cross_entropy(tp):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 5, 64, generator=gen) * 3
    target = torch.randint(0, 64, (4, 5), generator=gen)
    ref_logits = logits.clone().requires_grad_()
    F.cross_entropy(ref_logits.view(-1, 64), target.view(-1), reduction="none").view(4, 5).sum().backward()
    ref_loss = F.cross_entropy(logits.view(-1, 64), target.view(-1), reduction="none").view(4, 5)
    shard = logits.chunk(tp.size, dim=-1)[tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, tp)
    loss.sum().backward()
    g_ref = ref_logits.grad.chunk(tp.size, dim=-1)[tp.rank]
    return {"loss": (loss - ref_loss).abs().max().item(), "grad": (shard.grad - g_ref).abs().max().item()}


def _dropout_masks(tp):
    """Megatron's rule: outside the tracker fork TP ranks draw the same numbers (dropout on replicated
    activations agrees); inside it they differ (dropout on TP-sharded attention heads)."""
    from megatron.core import comm
    from megatron.core.tensor_parallel.random import get_rng_tracker, set_seeds

    set_seeds(42, tp_rank=tp.rank)
    shared = torch.rand(16)
    with get_rng_tracker().fork():
        forked = torch.rand(16)
    after = torch.rand(16)  # the fork must not disturb the default stream
    gathered = [comm.all_gather(t.unsqueeze(0), tp.group) for t in (shared, forked, after)]
    return {"shared_agree": bool((gathered[0] == gathered[0][0]).all()),
            "forked_differ": bool((gathered[1][0] != gathered[1][1]).all()),
            "after_agree": bool((gathered[2] == gathered[2][0]).all())}


def _worker():
    from megatron.core.parallel_state import ParallelState
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    out = {"rng": _dropout_masks(ParallelState.build(2).tp)}
    torch.manual_seed(0)
    for tp_size in (2, 4):
        tp = ParallelState.build(tp_size).tp
        out[("ce", tp_size)] = _compare_cross_entropy(tp)
        for variant in ("debug", "debug-llama"):
            for seq_par in (False, True):
                out[(variant, tp_size, seq_par)] = _compare_model(variant, tp, seq_par)
    return out


@pytest.mark.timeout(600)
def test_tp2_tp4_match_single_process():
    results = run_distributed(_worker, world_size=4)
    for rank, res in enumerate(results):
        assert res.pop("rng") == {"shared_agree": True, "forked_differ": True, "after_agree": True}, rank
        for key, errs in res.items():
            for what in ("logits", "loss", "grad"):
                if what in errs:
                    assert errs[what] <= TOL, f"rank {rank} {key}: {what} differs by {errs[what]:.3e}"
    # Both variants cover every parameter kind (the test would be vacuous otherwise).
    assert results[0][("debug-llama", 4, True)]["nparams"] > 10
