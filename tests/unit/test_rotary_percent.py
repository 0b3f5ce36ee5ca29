"""--rotary-percent (partial rotary): against HF GPT-NeoX's rotary (an independent implementation of the same
thing, rotary_pct), and 1.0 is exactly the full rotary of before."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.errors import ConfigError
from megatron.model.rotary import apply_rotary, rotary_cos_sin


def _hf_neox(q, k, percent, base=10000.0):
    """q, k: [b, n, s, d] through HF GPT-NeoX's rotary embedding and apply_rotary_pos_emb."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    b, n, s, d = q.shape
    cfg = GPTNeoXConfig(hidden_size=n * d, num_attention_heads=n, rotary_pct=percent, rotary_emb_base=base,
                        max_position_embeddings=s)
    cfg.rope_parameters.update(partial_rotary_factor=percent, rope_theta=base)
    cos, sin = GPTNeoXRotaryEmbedding(cfg)(q, torch.arange(s)[None].expand(b, s))
    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("percent", [0.25, 0.5, 1.0])
def test_partial_rotary_matches_hf_gpt_neox(percent):
    s, b, n, d = 12, 2, 3, 16
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, b, n, d, generator=gen), torch.randn(s, b, n, d, generator=gen)
    rotary_dim = ModelConfig(num_layers=1, hidden_size=n * d, num_attention_heads=n, seq_length=s, vocab_size=8,
                             position_embedding_type="rope", rotary_percent=percent).rotary_dim
    assert rotary_dim == int(d * percent)
    cos, sin = rotary_cos_sin(s, rotary_dim, 10000.0, q.device, q.dtype)
    ours = [apply_rotary(t, cos, sin).permute(1, 2, 0, 3) for t in (q, k)]  # -> [b, n, s, d]
    theirs = _hf_neox(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), percent)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    if percent < 1:  # the channels past rotary_dim pass unchanged
        assert torch.equal(ours[0][..., rotary_dim:], q.permute(1, 2, 0, 3)[..., rotary_dim:])


def _loss(percent):
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
                      make_vocab_size_divisible_by=64, use_cpu_initialization=True, hidden_dropout=0.0,
                      attention_dropout=0.0, position_embedding_type="rope", attention_backend="torch",
                      **({} if percent is None else {"rotary_percent": percent}))
    model = GPTModel(cfg, tp=single_process_state().tp, init_seed=3)
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    return model(tokens[:, :-1], tokens[:, 1:]).mean().item()


def test_rotary_percent_one_is_full_rotary_and_less_changes_the_model():
    assert _loss(1.0) == _loss(None)
    assert abs(_loss(0.5) - _loss(None)) > 1e-6


def test_bad_rotary_percent_is_refused():
    with pytest.raises(ConfigError, match="--rotary-percent 0.1 of head dim 16 rotates 1 channels"):
        ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=8,
                    position_embedding_type="rope", rotary_percent=0.1).validate()
    with pytest.raises(ConfigError, match="--rotary-percent 1.5: out of range"):
        ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=8,
                    rotary_percent=1.5).validate()


def test_hf_llama_has_no_partial_rotary():
    from dataclasses import asdict

    from megatron.checkpointing.hf.dense import from_hf, variant
    from megatron.config.sizes import named_model

    with pytest.raises(ConfigError, match="partial rotary has no Llama export"):
        variant(asdict(named_model("debug-llama", rotary_percent=0.5)))
    assert variant(asdict(named_model("debug", position_embedding_type="rope", rotary_percent=0.5))) == "gpt_neox"
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5"):
        from_hf({}, {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "intermediate_size": 128, "max_position_embeddings": 8, "vocab_size": 8, "hidden_act": "silu",
                     "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}})
