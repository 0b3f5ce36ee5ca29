"""Our models with experts -> HF transformers, to the architecture that computes the same function:
MixtralForCausalLM (every layer MoE, top-k >= 2) or Qwen2MoeForCausalLM (top-1, or some layers dense).

Facts the mapping rests on (transformers 5.24's modeling_mixtral.py / modeling_qwen2_moe.py; DeepSpeed's
sharded_moe.py as megatron/core/moe/gating.py implements it):
- Our gate: softmax of x W^T (fp32) over the experts; top-1 weights a token's expert by its softmax probability,
  *not* renormalised; top-2 and top-k (k > 2) renormalise the chosen probabilities to sum to 1 (with no token
  dropped). Mixtral's router always renormalises its top-k (so top-1 would weigh 1.0): exact for k >= 2 only.
  Qwen2-MoE's router renormalises only with ``norm_topk_prob``: false gives top-1's weight, true top-k's.
- Mixtral makes every layer MoE; Qwen2-MoE makes layer i (0-based) MoE when (i + 1) % decoder_sparse_step == 0 and
  i is not in mlp_only_layers: upstream's --expert-interval K (layers K, 2K, ... 1-based) is decoder_sparse_step K,
  and a layer given 1 expert in a --num-experts list goes into mlp_only_layers.
- Files hold each expert's projections apart (transformers fuses them on load): Mixtral's
  ``block_sparse_moe.experts.N.w1/w3/w2`` and Qwen2-MoE's ``mlp.experts.N.gate_proj/up_proj/down_proj`` are the
  gate and up halves of our SwiGLU fc1 [gate; up] and our fc2; the router ``gate.weight`` [E, h] is our gate's wg.
- Qwen2-MoE adds a shared expert, sigmoid(x g) x MLP(x); exported with width 0 (shared_expert_intermediate_size 0)
  it adds exactly 0. Its q/k/v biases are off with qkv_bias false.
- Neither has capacity or random draws: HF runs every token through its top-k experts and takes top-2's second
  largest gate. Our model computes the same where no token is dropped (--disable-moe-token-dropping, or an eval
  capacity no expert exceeds) and second-expert sampling is off (--disable-moe-top2-2nd-expert-sampling).
"""

from __future__ import annotations

import torch

from megatron.checkpointing.hf.dense import (
    LLAMA,
    llama_attention_from_hf,
    llama_attention_to_hf,
    swiglu_mlp_from_hf,
    swiglu_mlp_to_hf,
    variant,
)
from megatron.config.moe import MoEConfig
from megatron.errors import ConfigError
from megatron.model.param_names import HF, OURS

MIXTRAL, QWEN2_MOE = "mixtral", "qwen2_moe"
# The files' layout (what transformers' save_pretrained writes and the Hub holds; it fuses the experts on load):
# each expert's (gate, up, down) projections apart, nn.Linear [out, in] (megatron/model/param_names.py names them).


def moe_config(m: dict) -> MoEConfig:
    moe = dict(m.get("moe") or {})
    return MoEConfig(**{**moe, "num_experts": tuple(moe.get("num_experts", (1,)))})


def has_experts(m: dict) -> bool:
    return moe_config(m).enabled


def moe_variant(m: dict) -> str:
    """Which HF class computes the same function as model config ``m`` (with experts), or a ConfigError saying why
    none does."""
    moe = moe_config(m)
    try:
        dense = variant(m)
    except ConfigError as e:
        raise ConfigError(f"no HF MoE export for this model: {e}") from None
    if dense != LLAMA:
        raise ConfigError(f"no HF MoE export for the {dense} variant with experts: HF's MoE models (Mixtral, "
                          "Qwen2-MoE) are Llama-style: export needs --normalization rmsnorm --swiglu "
                          "--position-embedding-type rope")
    if m["add_bias_linear"]:
        raise ConfigError("no HF MoE export with linear biases: Mixtral's and Qwen2-MoE's experts have none (train "
                          "with --disable-bias-linear)")
    if moe.mlp_type == "residual":
        raise ConfigError("no HF MoE export for PR-MoE (--mlp-type residual): no HF model mixes a dense MLP and the "
                          "experts by a learned softmax coefficient (Qwen2-MoE's shared expert is added, "
                          "sigmoid-gated)")
    counts = {n for n in moe.experts_per_layer(m["num_layers"]) if n > 1}
    if len(counts) > 1:
        raise ConfigError(f"no HF MoE export with MoE layers of different expert counts ({sorted(counts)} from "
                          "--num-experts): Mixtral and Qwen2-MoE have one count for every MoE layer")
    every_layer = all(n > 1 for n in moe.experts_per_layer(m["num_layers"]))
    return MIXTRAL if every_layer and moe.topk >= 2 else QWEN2_MOE


def match_notes(m: dict) -> list[str]:
    """What the export computes differently from this model's own runs (printed by the converter)."""
    moe, notes = moe_config(m), []
    if moe.moe_token_dropping:
        notes.append("HF has no expert capacity: it matches this model where no token is dropped (ours with "
                     "--disable-moe-token-dropping, or an eval capacity factor no expert exceeds)")
    if moe.topk == 2 and moe.moe_top2_2nd_expert_sampling:
        notes.append("HF takes top-2's second largest gate: the model trained with second-expert sampling, which "
                     "ours also draws at evaluation unless --disable-moe-top2-2nd-expert-sampling")
    return notes


def moe_to_hf(full: dict[str, torch.Tensor], m: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(HF state dict, HF config.json dict) for our full state ``full`` (experts under global ids) of model ``m``."""
    kind, moe = moe_variant(m), moe_config(m)
    nl, h, f = m["num_layers"], m["hidden_size"], m["ffn_hidden_size"]
    per_layer = moe.experts_per_layer(nl)
    tied = not m["untie_embeddings_and_output_weights"]
    theirs = HF[kind]
    out = {theirs.embedding: full[OURS.embedding], theirs.final(): full[OURS.final()]}
    for i, n in enumerate(per_layer):
        src, dst = OURS.in_layer(i), theirs.in_layer(i)
        out.update(llama_attention_to_hf(full, i, m, theirs))
        if n == 1:
            out.update(swiglu_mlp_to_hf(full, i, m, theirs))
            continue
        out[dst("router")] = full[src("router")]
        for e in range(n):
            gate, up = full[OURS.expert_at(i, e, "fc1")].split(f)  # our fc1 is [gate; up]
            for part, t in zip(("gate", "up", "fc2"), (gate, up, full[OURS.expert_at(i, e, "fc2")]), strict=True):
                out[theirs.expert_at(i, e, part)] = t
        if kind == QWEN2_MOE:  # the shared expert, width 0: it adds exactly 0
            like = out[dst("router")]
            out[dst("shared_gate")] = like.new_zeros(0, h)
            out[dst("shared_up")] = like.new_zeros(0, h)
            out[dst("shared_down")] = like.new_zeros(h, 0)
            out[dst("shared_expert_gate")] = like.new_zeros(1, h)
    if not tied:
        out[theirs.head] = full[OURS.head]
    num_experts, base = max(per_layer), m["rotary_base"]
    config = {"vocab_size": m["vocab_size"], "hidden_size": h, "intermediate_size": f, "num_hidden_layers": nl,
              "num_attention_heads": m["num_attention_heads"], "num_key_value_heads": m["num_key_value_heads"],
              "max_position_embeddings": m["max_position_embeddings"], "rms_norm_eps": m["layernorm_epsilon"],
              "rope_theta": base, "rope_parameters": {"rope_type": "default", "rope_theta": base},
              "hidden_act": "silu", "num_experts_per_tok": moe.topk, "output_router_logits": False,
              "attention_dropout": m.get("attention_dropout", 0.1), "initializer_range": m.get("init_method_std", 0.02),
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    if kind == MIXTRAL:
        config.update(architectures=["MixtralForCausalLM"], model_type=MIXTRAL, num_local_experts=num_experts,
                      router_jitter_noise=0.0, sliding_window=None)
    else:
        interval = moe.expert_interval
        config.update(architectures=["Qwen2MoeForCausalLM"], model_type=QWEN2_MOE, num_experts=num_experts,
                      moe_intermediate_size=f, shared_expert_intermediate_size=0, decoder_sparse_step=interval,
                      mlp_only_layers=[i for i, n in enumerate(per_layer) if (i + 1) % interval == 0 and n == 1],
                      norm_topk_prob=moe.topk >= 2, qkv_bias=False, use_sliding_window=False)
    return {k: v.contiguous() for k, v in out.items()}, config


def _refuse_unless(ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"HF {what}")


def moe_from_hf(hf: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(our full state, our ModelConfig fields) from an HF Mixtral or Qwen2-MoE state dict (the files' per-expert
    layout) and config.json; a model ours cannot compute exactly is refused in one line naming the field."""
    kind, nl, h = config["model_type"], config["num_hidden_layers"], config["hidden_size"]
    heads, k = config["num_attention_heads"], config["num_experts_per_tok"]
    _refuse_unless(config.get("hidden_act", "silu") == "silu", f"{kind} hidden_act={config.get('hidden_act')!r}: our "
                   "SwiGLU uses silu")
    _refuse_unless(not config.get("rope_scaling") and (config.get("rope_parameters") or {}).get(
        "rope_type", "default") == "default", f"{kind} rope scaling: not supported by our rotary embedding")
    _refuse_unless(config.get("head_dim") in (None, h // heads), f"{kind} head_dim={config.get('head_dim')}: ours is "
                   "hidden_size / num_attention_heads")
    if kind == MIXTRAL:
        _refuse_unless(k >= 2, "mixtral with num_experts_per_tok 1 weighs its expert 1.0; our top-1 gate (DeepSpeed's) "
                       "weighs it by its softmax probability")
        _refuse_unless(config.get("sliding_window") is None, f"mixtral sliding_window={config['sliding_window']}: our "
                       "attention is full causal")
        f, interval, per_layer = config["intermediate_size"], 1, [config["num_local_experts"]] * nl
    else:
        _refuse_unless(not config.get("shared_expert_intermediate_size", 5632), "qwen2_moe with a shared expert "
                       f"(shared_expert_intermediate_size {config.get('shared_expert_intermediate_size', 5632)}): "
                       "not built here (PR-MoE's residual MLP is mixed by a softmax coefficient, not added)")
        _refuse_unless(not config.get("qkv_bias", True), "qwen2_moe with qkv_bias: our --add-bias-linear puts biases "
                       "on every linear layer, not q/k/v alone")
        _refuse_unless(bool(config.get("norm_topk_prob", False)) == (k >= 2), f"qwen2_moe with num_experts_per_tok {k}"
                       f" and norm_topk_prob={config.get('norm_topk_prob', False)}: our gate renormalises exactly "
                       "when k >= 2")
        _refuse_unless(not config.get("use_sliding_window", False), "qwen2_moe use_sliding_window: our attention is "
                       "full causal")
        interval, only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        per_layer = [config["num_experts"] if (i + 1) % interval == 0 and i not in only else 1 for i in range(nl)]
        f = config["moe_intermediate_size"]
        _refuse_unless(all(n > 1 for n in per_layer) or config["intermediate_size"] == f, "qwen2_moe with "
                       f"intermediate_size {config['intermediate_size']} != moe_intermediate_size {f}: our dense and "
                       "expert MLPs have one --ffn-hidden-size")
    tied = bool(config.get("tie_word_embeddings", False))
    base = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    counts = [per_layer[n - 1] for n in range(interval, nl + 1, interval)]
    m = {"num_layers": nl, "hidden_size": h, "num_attention_heads": heads,
         "num_key_value_heads": config.get("num_key_value_heads") or heads, "ffn_hidden_size": f,
         "seq_length": config["max_position_embeddings"], "max_position_embeddings": config["max_position_embeddings"],
         "vocab_size": config["vocab_size"], "normalization": "rmsnorm", "swiglu": True,
         "position_embedding_type": "rope", "layernorm_epsilon": config.get("rms_norm_eps", 1e-6),
         "rotary_base": float(base), "add_bias_linear": False, "untie_embeddings_and_output_weights": not tied,
         "hidden_dropout": 0.0, "attention_dropout": config.get("attention_dropout", 0.0),
         "init_method_std": config.get("initializer_range", 0.02),
         # HF's function: every token through its top-k experts (no capacity), top-2's second largest gate.
         "moe": {"num_experts": counts if len(set(counts)) > 1 else counts[:1], "expert_interval": interval,
                 "topk": k, "moe_token_dropping": False, "moe_top2_2nd_expert_sampling": False}}
    theirs = HF[kind]
    full = {OURS.embedding: hf[theirs.embedding], OURS.final(): hf[theirs.final()]}
    for i, n in enumerate(per_layer):
        src, dst = theirs.in_layer(i), OURS.in_layer(i)
        full.update(llama_attention_from_hf(hf, i, m, theirs))
        if n == 1:
            full.update(swiglu_mlp_from_hf(hf, i, theirs))
            continue
        full[dst("router")] = hf[src("router")]
        for e in range(n):
            full[OURS.expert_at(i, e, "fc1")] = torch.cat([hf[theirs.expert_at(i, e, "gate")],
                                                           hf[theirs.expert_at(i, e, "up")]])
            full[OURS.expert_at(i, e, "fc2")] = hf[theirs.expert_at(i, e, "fc2")]
    if not tied:
        full[OURS.head] = hf[theirs.head]
    return {k: v.contiguous() for k, v in full.items()}, m
