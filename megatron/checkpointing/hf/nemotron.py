"""Our full state dict <-> HF transformers' NemotronForCausalLM: LayerNorm with 1 + weight (--apply-layernorm-1p),
a plain (not gated) MLP, rotary positions over the first part of each head (--rotary-percent), grouped-query
attention. The export of a rope + layernorm + plain-MLP model with --apply-layernorm-1p or --squared-relu.

Facts the mapping rests on (transformers 5.24's modeling_nemotron.py):
- ``NemotronLayerNorm1P`` computes ``F.layer_norm(x, shape, weight + 1, bias, eps)`` on every norm, the final one
  included: our 1p weights are stored as they are; a model without 1p stores weight - 1 (and gets it back).
- ``NemotronMLP`` is ``down_proj(act(up_proj(x)))``: our fc1 / fc2; ``hidden_act`` ``relu2`` is relu(x)^2
  (--squared-relu), ``gelu`` the exact GeLU, ``gelu_pytorch_tanh`` --openai-gelu's.
- Attention: q/k/v/o nn.Linear as Llama's (one ``attention_bias`` for all four), rotate-half rotary over the first
  int(head_dim x partial_rotary_factor) channels, as our --rotary-percent; ``mlp_bias`` for up/down.
"""

from __future__ import annotations

import torch

from megatron.checkpointing.hf.dense import join_qkv, split_qkv, llama_attention_from_hf, llama_attention_to_hf
from megatron.errors import ConfigError
from megatron.model.param_names import HF_NEMOTRON, OURS

# Nemotron's hidden_act -> (our squared_relu, our openai_gelu)
ACTIVATIONS = {"relu2": (True, False), "gelu": (False, False), "gelu_pytorch_tanh": (False, True),
               "gelu_new": (False, True), "gelu_fast": (False, True)}


def _norm_shift(m: dict) -> float:
    """What to add to our norm weights to get Nemotron's (1 + w): 0 for a 1p model, -1 for a plain one."""
    return 0.0 if m.get("apply_layernorm_1p") else -1.0


def _norm_names(nl: int) -> list[tuple[str, str]]:
    pairs = [(OURS.final(k), HF_NEMOTRON.final(k)) for k in ("weight", "bias")]
    for i in range(nl):
        pairs += [(OURS.at(i, r, k), HF_NEMOTRON.at(i, r, k)) for r in ("input_norm", "post_norm")
                  for k in ("weight", "bias")]
    return pairs


def nemotron_to_hf(full: dict[str, torch.Tensor], m: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(HF state dict, config.json dict) of our full state ``full`` with model config ``m``."""
    nl, h, bias = m["num_layers"], m["hidden_size"], m["add_bias_linear"]
    tied = not m["untie_embeddings_and_output_weights"]
    out = {HF_NEMOTRON.embedding: full[OURS.embedding]}
    for i in range(nl):
        src, dst = OURS.in_layer(i), HF_NEMOTRON.in_layer(i)
        out.update(llama_attention_to_hf(full, i, m, HF_NEMOTRON))
        out[dst("fc1")], out[dst("fc2")] = full[src("fc1")], full[src("fc2")]
        if bias:
            for role, t in zip(("q", "k", "v"), split_qkv(full[src("qkv", "bias")], m), strict=True):
                out[dst(role, "bias")] = t
            for role in ("attn_out", "fc1", "fc2"):
                out[dst(role, "bias")] = full[src(role, "bias")]
    shift = _norm_shift(m)
    for ours, theirs in _norm_names(nl):
        out[theirs] = full[ours] + shift if theirs.endswith("weight") else full[ours]
    if not tied:
        out[HF_NEMOTRON.head] = full[OURS.head]
    act = "relu2" if m.get("squared_relu") else "gelu_pytorch_tanh" if m.get("openai_gelu") else "gelu"
    pct, base = float(m.get("rotary_percent", 1.0)), m["rotary_base"]
    config = {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "vocab_size": m["vocab_size"],
              "hidden_size": h, "intermediate_size": m["ffn_hidden_size"], "num_hidden_layers": nl,
              "num_attention_heads": m["num_attention_heads"], "num_key_value_heads": m["num_key_value_heads"],
              "head_dim": h // m["num_attention_heads"], "max_position_embeddings": m["max_position_embeddings"],
              "norm_eps": m["layernorm_epsilon"], "hidden_act": act, "attention_bias": bias, "mlp_bias": bias,
              "rope_parameters": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": pct},
              "attention_dropout": m.get("attention_dropout", 0.1), "initializer_range": m.get("init_method_std", 0.02),
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    return {k: v.contiguous() for k, v in out.items()}, config


def nemotron_from_hf(hf: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(our full state, our ModelConfig fields) of an HF Nemotron state dict and config.json."""
    act = config.get("hidden_act", "relu2")
    if act not in ACTIVATIONS:
        raise ConfigError(f"HF Nemotron hidden_act={act!r}: only {', '.join(ACTIVATIONS)} map to this trainer's MLP")
    bias = bool(config.get("attention_bias", False))
    if bias != bool(config.get("mlp_bias", False)):
        raise ConfigError("HF Nemotron with attention_bias != mlp_bias: our --disable-bias-linear covers both")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"HF Nemotron rope_type={rope['rope_type']!r}: not supported by our rotary embedding")
    h, nh, nl = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    if config.get("head_dim") not in (None, h // nh):
        raise ConfigError(f"HF Nemotron head_dim={config['head_dim']} is not hidden_size / num_attention_heads "
                          f"({h // nh}): this trainer's heads are hidden/heads wide")
    squared_relu, openai_gelu = ACTIVATIONS[act]
    tied = bool(config.get("tie_word_embeddings", False))
    m = {"num_layers": nl, "hidden_size": h, "num_attention_heads": nh,
         "num_key_value_heads": config.get("num_key_value_heads") or nh, "ffn_hidden_size": config["intermediate_size"],
         "seq_length": config["max_position_embeddings"], "max_position_embeddings": config["max_position_embeddings"],
         "vocab_size": config["vocab_size"], "normalization": "layernorm", "apply_layernorm_1p": True,
         "swiglu": False, "squared_relu": squared_relu, "openai_gelu": openai_gelu, "position_embedding_type": "rope",
         "rotary_base": float(rope.get("rope_theta", 10000.0)),
         "rotary_percent": float(rope.get("partial_rotary_factor", 0.5)),  # NemotronConfig's default
         "layernorm_epsilon": config.get("norm_eps", 1e-5), "add_bias_linear": bias,
         "untie_embeddings_and_output_weights": not tied, "hidden_dropout": 0.0,  # no residual dropout
         "attention_dropout": config.get("attention_dropout", 0.0),
         "init_method_std": config.get("initializer_range", 0.02)}
    full = {OURS.embedding: hf[HF_NEMOTRON.embedding]}
    for i in range(nl):
        src, dst = HF_NEMOTRON.in_layer(i), OURS.in_layer(i)
        full.update(llama_attention_from_hf(hf, i, m, HF_NEMOTRON))
        full[dst("fc1")], full[dst("fc2")] = hf[src("fc1")], hf[src("fc2")]
        if bias:
            full[dst("qkv", "bias")] = join_qkv(hf[src("q", "bias")], hf[src("k", "bias")], hf[src("v", "bias")], m)
            for role in ("attn_out", "fc1", "fc2"):
                full[dst(role, "bias")] = hf[src(role, "bias")]
    for ours, theirs in _norm_names(nl):
        full[ours] = hf[theirs]
    if not tied:
        full[OURS.head] = hf[HF_NEMOTRON.head]
    return {k: v.contiguous() for k, v in full.items()}, m
