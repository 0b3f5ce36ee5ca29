"""Named model sizes, so scripts, tests and the planner agree on shapes.

The GPT 22B / 175B / 1T shapes are the ones used by the ORNL Frontier runs (see shared FRONTIER.md).
"""

from __future__ import annotations

from megatron.config.model import ModelConfig
from megatron.errors import ConfigError

_GPT2 = dict(normalization="layernorm", swiglu=False, position_embedding_type="learned_absolute")
_LLAMA = dict(
    normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
    untie_embeddings_and_output_weights=True, add_bias_linear=False,
)

# name -> (variant flags, num_layers, hidden, heads, kv heads, seq, vocab)
_SIZES = {
    "debug": (_GPT2, 2, 64, 4, None, 32, 256),
    "debug-llama": (_LLAMA, 2, 64, 4, 2, 32, 256),
    "tiny": (_GPT2, 4, 128, 4, None, 128, 512),
    "gpt2-small": (_GPT2, 12, 768, 12, None, 1024, 50257),
    "gpt2-medium": (_GPT2, 24, 1024, 16, None, 1024, 50257),
    "gpt-1.3b": (_GPT2, 24, 2048, 16, None, 2048, 50257),
    "gpt-20b": (_GPT2, 44, 6144, 64, None, 2048, 50257),
    "gpt-22b": (_GPT2, 48, 6144, 48, None, 2048, 50257),
    "gpt-175b": (_GPT2, 96, 12288, 96, None, 2048, 50257),
    "gpt-1t": (_GPT2, 128, 25600, 128, None, 2048, 50257),
    "llama-7b": (_LLAMA, 32, 4096, 32, None, 4096, 32000),
    "llama-70b": (_LLAMA, 80, 8192, 64, 8, 4096, 32000),
}


def model_names() -> list[str]:
    return list(_SIZES)


def named_model(name: str, **overrides) -> ModelConfig:
    """The ModelConfig for a named size; keyword overrides replace fields (e.g. seq_length=4096)."""
    if name not in _SIZES:
        raise ConfigError(f"unknown model size {name!r}: choose one of {', '.join(_SIZES)}")
    variant, nl, h, nh, nkv, s, v = _SIZES[name]
    fields = dict(variant, num_layers=nl, hidden_size=h, num_attention_heads=nh, num_key_value_heads=nkv,
                  seq_length=s, vocab_size=v)
    if name.startswith("llama-7b") or name.startswith("llama-70b"):
        fields["ffn_hidden_size"] = {"llama-7b": 11008, "llama-70b": 28672}[name]
    fields.update(overrides)
    return ModelConfig(**fields)
