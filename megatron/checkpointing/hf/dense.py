"""Our full state dict <-> HF transformers: GPT2LMHeadModel (GPT-2 variant), LlamaForCausalLM (Llama variant) and
GPTNeoXForCausalLM (layernorm + GELU + rotary, the variant partial rotary --rotary-percent exports to). The names on
both sides are megatron/model/param_names.py's; this module does the arithmetic.

Facts the mapping rests on (read from HF's modeling_gpt2.py / modeling_llama.py):
- GPT-2's c_attn / c_proj / c_fc are ``Conv1D``: weights are stored [in, out], the transpose of nn.Linear.
  c_attn's output is [all q heads | all k heads | all v heads]. GELU ``"gelu"`` is the exact erf form;
  ``"gelu_new"`` (GPT-2's default), ``"gelu_pytorch_tanh"`` and ``"gelu_fast"`` are the tanh approximation,
  which our ``openai_gelu`` (--openai-gelu) computes as torch's ``gelu(approximate="tanh")``.
- Llama's q/k/v/o and gate/up/down are nn.Linear ([out, in]); its rotary is rotate-half (ours), so q and k
  need no permutation. RMSNorm: x * rsqrt(mean(x^2) + eps) * w.
- Our fused QKV is laid out per KV group: [q_1 .. q_g, k, v] for each KV head (g = heads / kv heads);
  our SwiGLU fc1 is [gate; up].
- GPT-NeoX's query_key_value is [q, k, v] per head (view(..., heads, 3 x head_dim)): ours for g = 1. Its
  rotary is rotate-half over the first int(head_dim x partial_rotary_factor) channels (rotary_pct), as our
  --rotary-percent; its MLP always has biases. Sequential residual only (use_parallel_residual false).
  HF Llama (transformers 5.23) rotates every channel of a head: partial rotary has no Llama equivalent.
"""

from __future__ import annotations

import torch

from megatron.errors import ConfigError
from megatron.model.param_names import HF_GPT2, HF_LLAMA, HF_NEOX, HF_NEOX_HEADS, OURS, Naming

GPT2, LLAMA, NEOX, NEMOTRON = "gpt2", "llama", "gpt_neox", "nemotron"
# HF GPT-2 activation_function -> our openai_gelu (tanh approximation); relu2 is --squared-relu; others are refused.
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
SQUARED_RELU = "relu2"


def variant(model: dict) -> str:
    """Which HF class a model config maps to, or a ConfigError naming the mismatching fields. A rope + layernorm +
    plain-MLP model with --apply-layernorm-1p or --squared-relu is Nemotron's (megatron/checkpointing/hf/nemotron.py);
    GPT-2 takes both variants too (1 + weight stored, relu2)."""
    if model.get("apply_residual_connection_post_layernorm"):
        raise ConfigError("--apply-residual-connection-post-layernorm has no HF export: the only HF class that adds "
                          "the norm's output as the residual is BLOOM, whose ALiBi positions and embedding norm this "
                          "model lacks")
    gpt2 = (model["normalization"] == "layernorm" and not model["swiglu"]
            and model["position_embedding_type"] == "learned_absolute")
    llama = model["normalization"] == "rmsnorm" and model["swiglu"] and model["position_embedding_type"] == "rope"
    if gpt2 and model["num_key_value_heads"] == model["num_attention_heads"]:
        return GPT2
    partial = model.get("rotary_percent", 1.0) < 1.0
    if llama and not partial:
        return LLAMA
    if (model["normalization"] == "layernorm" and not model["swiglu"] and model["position_embedding_type"] == "rope"
            and (model.get("apply_layernorm_1p") or model.get("squared_relu"))):
        return NEMOTRON
    neox = (model["normalization"] == "layernorm" and not model["swiglu"] and model["position_embedding_type"] == "rope"
            and model["num_key_value_heads"] == model["num_attention_heads"] and model["add_bias_linear"])
    if neox:
        return NEOX
    if llama:
        raise ConfigError(f"--rotary-percent {model['rotary_percent']:g}: HF LlamaForCausalLM rotates every channel "
                          "of a head, so partial rotary has no Llama export (GPTNeoXForCausalLM has it: layernorm + "
                          "GELU + rope)")
    raise ConfigError("no HF class for this model: GPT2LMHeadModel needs layernorm + GELU + learned positions + "
                      "no GQA; LlamaForCausalLM needs rmsnorm + --swiglu + rope "
                      f"(got {model['normalization']}, swiglu={model['swiglu']}, {model['position_embedding_type']}, "
                      f"kv heads {model['num_key_value_heads']}/{model['num_attention_heads']})")


def split_qkv(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our grouped [nkv, g+2, d, ...] QKV rows -> q [nq*d, ...], k [nkv*d, ...], v [nkv*d, ...]."""
    nq, nkv = m["num_attention_heads"], m["num_key_value_heads"]
    d, g = m["hidden_size"] // nq, nq // nkv
    x = w.reshape(nkv, g + 2, d, *w.shape[1:])
    return (x[:, :g].reshape(nq * d, *w.shape[1:]), x[:, g].reshape(nkv * d, *w.shape[1:]),
            x[:, g + 1].reshape(nkv * d, *w.shape[1:]))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: dict) -> torch.Tensor:
    nq, nkv = m["num_attention_heads"], m["num_key_value_heads"]
    d, g = m["hidden_size"] // nq, nq // nkv
    rest = q.shape[1:]
    x = torch.cat([q.reshape(nkv, g, d, *rest), k.reshape(nkv, 1, d, *rest), v.reshape(nkv, 1, d, *rest)], dim=1)
    return x.reshape((nq + 2 * nkv) * d, *rest)


def llama_attention_to_hf(full: dict[str, torch.Tensor], i: int, m: dict,
                          theirs: Naming = HF_LLAMA) -> dict[str, torch.Tensor]:
    """Layer i's two norms and attention weights (no biases) as a HF Llama-family model names them (inverse of
    ``llama_attention_from_hf``)."""
    src, dst = OURS.in_layer(i), theirs.in_layer(i)
    out = {dst("input_norm"): full[src("input_norm")], dst("post_norm"): full[src("post_norm")],
           dst("attn_out"): full[src("attn_out")]}
    for role, t in zip(("q", "k", "v"), split_qkv(full[src("qkv")], m), strict=True):
        out[dst(role)] = t
    return out


def llama_attention_from_hf(hf: dict[str, torch.Tensor], i: int, m: dict,
                            theirs: Naming = HF_LLAMA) -> dict[str, torch.Tensor]:
    """Layer i's two norms and attention weights (no biases) of a HF Llama-family model (Llama, Mixtral,
    Qwen2-MoE) under our names; q/k/v joined into our per-group QKV."""
    src, dst = theirs.in_layer(i), OURS.in_layer(i)
    return {dst("input_norm"): hf[src("input_norm")], dst("post_norm"): hf[src("post_norm")],
            dst("qkv"): join_qkv(hf[src("q")], hf[src("k")], hf[src("v")], m),
            dst("attn_out"): hf[src("attn_out")]}


def swiglu_mlp_from_hf(hf: dict[str, torch.Tensor], i: int, theirs: Naming = HF_LLAMA) -> dict[str, torch.Tensor]:
    """Layer i's HF SwiGLU MLP weights (gate, up, down) as ours (fc1: the gate stacked over the up projection;
    fc2)."""
    src, dst = theirs.in_layer(i), OURS.in_layer(i)
    return {dst("fc1"): torch.cat([hf[src("gate")], hf[src("up")]]), dst("fc2"): hf[src("fc2")]}


def swiglu_mlp_to_hf(full: dict[str, torch.Tensor], i: int, m: dict,
                     theirs: Naming = HF_LLAMA) -> dict[str, torch.Tensor]:
    """Inverse of ``swiglu_mlp_from_hf`` (weights only)."""
    src, dst = OURS.in_layer(i), theirs.in_layer(i)
    gate, up = full[src("fc1")].split(m["ffn_hidden_size"])  # our fc1 is [gate; up]
    return {dst("gate"): gate, dst("up"): up, dst("fc2"): full[src("fc2")]}


def to_hf(full: dict[str, torch.Tensor], m: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(HF state dict, HF config.json dict) for our full state ``full`` with model config ``m``."""
    kind = variant(m)
    assert kind != NEMOTRON, "hf/convert.py routes Nemotron's models to hf/nemotron.py"
    out: dict[str, torch.Tensor] = {}
    h, nl = m["hidden_size"], m["num_layers"]
    tied = not m["untie_embeddings_and_output_weights"]
    full = one_plus_to_plain(full, m)
    if kind == NEOX:
        return _neox_to_hf(full, m)
    if kind == GPT2:
        bias = m["add_bias_linear"]
        g = HF_GPT2
        out[g.embedding] = full[OURS.embedding]
        out[g.position] = full[OURS.position]
        for i in range(nl):
            src, dst = OURS.in_layer(i), g.in_layer(i)
            for role in ("input_norm", "post_norm"):
                out[dst(role)] = full[src(role)]
                out[dst(role, "bias")] = full[src(role, "bias")]
            qkv = full[src("qkv")]
            out[dst("qkv")] = torch.cat(split_qkv(qkv, m)).t()  # Conv1D: [in, out]
            qkv_b = full.get(src("qkv", "bias")) if bias else None
            out[dst("qkv", "bias")] = torch.cat(split_qkv(qkv_b, m)) if bias else qkv.new_zeros(3 * h)
            out[dst("attn_out")] = full[src("attn_out")].t()
            out[dst("attn_out", "bias")] = full[src("attn_out", "bias")] if bias else qkv.new_zeros(h)
            fc1 = full[src("fc1")]
            out[dst("fc1")] = fc1.t()
            out[dst("fc1", "bias")] = full[src("fc1", "bias")] if bias else fc1.new_zeros(fc1.shape[0])
            out[dst("fc2")] = full[src("fc2")].t()
            out[dst("fc2", "bias")] = full[src("fc2", "bias")] if bias else qkv.new_zeros(h)
        out[g.final()] = full[OURS.final()]
        out[g.final("bias")] = full[OURS.final("bias")]
        if not tied:
            out[g.head] = full[OURS.head]
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
                  "n_positions": m["max_position_embeddings"], "n_embd": h, "n_layer": nl,
                  "n_head": m["num_attention_heads"], "n_inner": m["ffn_hidden_size"],
                  "activation_function": _activation(m, "gelu_new"),
                  "layer_norm_epsilon": m["layernorm_epsilon"], "resid_pdrop": m.get("hidden_dropout", 0.1),
                  "embd_pdrop": m.get("hidden_dropout", 0.1), "attn_pdrop": m.get("attention_dropout", 0.1),
                  "initializer_range": m.get("init_method_std", 0.02), "tie_word_embeddings": tied,
                  "torch_dtype": "float32"}
        return {k: v.contiguous() for k, v in out.items()}, config
    bias = m["add_bias_linear"]
    out[HF_LLAMA.embedding] = full[OURS.embedding]
    f = m["ffn_hidden_size"]
    for i in range(nl):
        src, dst = OURS.in_layer(i), HF_LLAMA.in_layer(i)
        out.update(llama_attention_to_hf(full, i, m))
        if bias:
            for role, t in zip(("q", "k", "v"), split_qkv(full[src("qkv", "bias")], m), strict=True):
                out[dst(role, "bias")] = t
            out[dst("attn_out", "bias")] = full[src("attn_out", "bias")]
            out[dst("gate", "bias")], out[dst("up", "bias")] = full[src("fc1", "bias")].split(f)
            out[dst("fc2", "bias")] = full[src("fc2", "bias")]
        out.update(swiglu_mlp_to_hf(full, i, m))
    out[HF_LLAMA.final()] = full[OURS.final()]
    if not tied:
        out[HF_LLAMA.head] = full[OURS.head]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab_size"],
              "hidden_size": h, "intermediate_size": f, "num_hidden_layers": nl,
              "num_attention_heads": m["num_attention_heads"], "num_key_value_heads": m["num_key_value_heads"],
              "max_position_embeddings": m["max_position_embeddings"], "rms_norm_eps": m["layernorm_epsilon"],
              "rope_theta": m["rotary_base"], "hidden_act": "silu", "attention_bias": bias, "mlp_bias": bias,
              "attention_dropout": m.get("attention_dropout", 0.1), "initializer_range": m.get("init_method_std", 0.02),
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    return {k: v.contiguous() for k, v in out.items()}, config


def _activation(m: dict, tanh: str) -> str:
    """HF's name of the MLP's activation: relu2 (--squared-relu), ``tanh`` (--openai-gelu) or the exact gelu."""
    return SQUARED_RELU if m.get("squared_relu") else tanh if m.get("openai_gelu") else "gelu"


def _activation_from_hf(act: str, model: str) -> dict:
    """Our activation fields of an HF activation name (GPT-2's activation_function, GPT-NeoX's hidden_act)."""
    if act == SQUARED_RELU:
        return {"squared_relu": True, "openai_gelu": False}
    if act not in GPT2_ACTIVATIONS:
        raise ConfigError(f"HF {model} activation {act!r}: only {', '.join(GPT2_ACTIVATIONS)} and {SQUARED_RELU} map "
                          "to this trainer's MLP (exact GeLU, --openai-gelu for the tanh approximation, "
                          "--squared-relu)")
    return {"squared_relu": False, "openai_gelu": GPT2_ACTIVATIONS[act]}


def one_plus_to_plain(full: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """The norm weights of a --apply-layernorm-1p model as a plain LayerNorm's (1 + weight), for HF classes without
    the 1p form (GPT-2, GPT-NeoX); other models unchanged."""
    if not m.get("apply_layernorm_1p"):
        return full
    norms = [OURS.final()] + [OURS.at(i, r) for i in range(m["num_layers"]) for r in ("input_norm", "post_norm")]
    return {**full, **{n: full[n] + 1 for n in norms}}


def _neox_names(nl: int) -> list[tuple[str, str]]:
    """(ours, HF GPT-NeoX) for every weight and bias but the output layer."""
    pairs = [(OURS.embedding, HF_NEOX.embedding)] + [(OURS.final(k), HF_NEOX.final(k)) for k in ("weight", "bias")]
    for i in range(nl):
        pairs += [(OURS.at(i, role, k), HF_NEOX.at(i, role, k)) for role in HF_NEOX.roles for k in ("weight", "bias")]
    return pairs


def _neox_to_hf(full: dict[str, torch.Tensor], m: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tied = not m["untie_embeddings_and_output_weights"]
    out = {theirs: full[ours] for ours, theirs in _neox_names(m["num_layers"])}  # QKV: the same layout (g = 1)
    if not tied:
        out[HF_NEOX.head] = full[OURS.head]
    pct, base = float(m.get("rotary_percent", 1.0)), m["rotary_base"]
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": m["vocab_size"],
              "hidden_size": m["hidden_size"], "intermediate_size": m["ffn_hidden_size"],
              "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_attention_heads"],
              "hidden_act": _activation(m, "gelu_new"),
              "max_position_embeddings": m["max_position_embeddings"], "layer_norm_eps": m["layernorm_epsilon"],
              "use_parallel_residual": False, "attention_bias": True, "rotary_pct": pct, "rotary_emb_base": base,
              "rope_parameters": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": pct},
              "attention_dropout": m.get("attention_dropout", 0.1), "hidden_dropout": m.get("hidden_dropout", 0.1),
              "initializer_range": m.get("init_method_std", 0.02), "tie_word_embeddings": tied,
              "torch_dtype": "float32"}
    return {k: v.contiguous() for k, v in out.items()}, config


def _neox_from_hf(hf: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    if config.get("use_parallel_residual", True):
        raise ConfigError("HF GPT-NeoX with use_parallel_residual=true (its default, e.g. Pythia): this trainer's "
                          "layers add attention and MLP in sequence; only sequential-residual GPT-NeoX converts")
    if not config.get("attention_bias", True):
        raise ConfigError("HF GPT-NeoX with attention_bias=false: its MLP keeps biases, and our "
                          "--disable-bias-linear covers both")
    activation = _activation_from_hf(config.get("hidden_act", "gelu"), "GPT-NeoX")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"HF GPT-NeoX rope_type={rope['rope_type']!r}: not supported by our rotary embedding")
    nl = config["num_hidden_layers"]
    tied = bool(config.get("tie_word_embeddings", False))
    m = {"num_layers": nl, "hidden_size": config["hidden_size"], "num_attention_heads": config["num_attention_heads"],
         "num_key_value_heads": config["num_attention_heads"], "ffn_hidden_size": config["intermediate_size"],
         "seq_length": config["max_position_embeddings"], "max_position_embeddings": config["max_position_embeddings"],
         "vocab_size": config["vocab_size"], "normalization": "layernorm", "apply_layernorm_1p": False,
         "swiglu": False, **activation,
         "position_embedding_type": "rope",
         "rotary_base": float(rope.get("rope_theta", config.get("rotary_emb_base", 10000.0))),
         "rotary_percent": float(rope.get("partial_rotary_factor", config.get("rotary_pct", 0.25))),
         "layernorm_epsilon": config.get("layer_norm_eps", 1e-5), "add_bias_linear": True,
         "untie_embeddings_and_output_weights": not tied, "hidden_dropout": config.get("hidden_dropout", 0.0),
         "attention_dropout": config.get("attention_dropout", 0.0),
         "init_method_std": config.get("initializer_range", 0.02)}
    full = {ours: hf[theirs] for ours, theirs in _neox_names(nl)}
    if not tied:
        full[OURS.head] = hf[next((h for h in HF_NEOX_HEADS if h in hf), HF_NEOX_HEADS[-1])]
    return {k: v.contiguous() for k, v in full.items()}, m


def from_hf(hf: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(our full state, our ModelConfig fields) from an HF GPT-2, Llama or GPT-NeoX state dict and config.json."""
    mt = config.get("model_type")
    if mt == NEOX:
        return _neox_from_hf(hf, config)
    if mt == "gpt2":
        h, nl, nh = config["n_embd"], config["n_layer"], config["n_head"]
        activation = _activation_from_hf(config.get("activation_function", "gelu_new"),  # GPT2Config's default
                                         "GPT-2")
        if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
            raise ConfigError("HF GPT-2 with scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true: our "
                              "attention scales by 1/sqrt(head dim) only; such a model would not match")
        m = {"num_layers": nl, "hidden_size": h, "num_attention_heads": nh, "num_key_value_heads": nh,
             "ffn_hidden_size": config.get("n_inner") or 4 * h, "seq_length": config["n_positions"],
             "max_position_embeddings": config["n_positions"], "vocab_size": config["vocab_size"],
             "normalization": "layernorm", "apply_layernorm_1p": False, "swiglu": False,
             "position_embedding_type": "learned_absolute",
             "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5), "add_bias_linear": True,
             **activation, "hidden_dropout": config.get("resid_pdrop", 0.1),
             "attention_dropout": config.get("attn_pdrop", 0.1),
             "init_method_std": config.get("initializer_range", 0.02),
             "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True)}
        g = HF_GPT2
        full = {OURS.embedding: hf[g.embedding], OURS.position: hf[g.position],
                OURS.final(): hf[g.final()], OURS.final("bias"): hf[g.final("bias")]}
        for i in range(nl):
            src, dst = g.in_layer(i), OURS.in_layer(i)
            for role in ("input_norm", "post_norm"):
                full[dst(role)] = hf[src(role)]
                full[dst(role, "bias")] = hf[src(role, "bias")]
            full[dst("qkv")] = join_qkv(*hf[src("qkv")].t().split(h), m)  # Conv1D: [in, out]
            full[dst("qkv", "bias")] = join_qkv(*hf[src("qkv", "bias")].split(h), m)
            for role in ("attn_out", "fc1", "fc2"):
                full[dst(role)] = hf[src(role)].t()
                full[dst(role, "bias")] = hf[src(role, "bias")]
        head = g.head
    elif mt == "llama":
        h, nl = config["hidden_size"], config["num_hidden_layers"]
        bias = bool(config.get("attention_bias", False))
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"HF Llama hidden_act={config['hidden_act']!r}: our SwiGLU uses silu")
        if bias != bool(config.get("mlp_bias", False)):
            raise ConfigError("HF Llama with attention_bias != mlp_bias: our --disable-bias-linear covers both")
        m = {"num_layers": nl, "hidden_size": h, "num_attention_heads": config["num_attention_heads"],
             "num_key_value_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
             "ffn_hidden_size": config["intermediate_size"], "seq_length": config["max_position_embeddings"],
             "max_position_embeddings": config["max_position_embeddings"], "vocab_size": config["vocab_size"],
             "normalization": "rmsnorm", "swiglu": True, "position_embedding_type": "rope",
             "layernorm_epsilon": config.get("rms_norm_eps", 1e-6), "rotary_base": config.get("rope_theta", 10000.0),
             "add_bias_linear": bias, "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings"),
             "hidden_dropout": 0.0, "attention_dropout": config.get("attention_dropout", 0.0),  # no residual dropout
             "init_method_std": config.get("initializer_range", 0.02)}
        if config.get("rope_scaling"):
            raise ConfigError(f"HF Llama rope_scaling={config['rope_scaling']}: not supported by our rotary embedding")
        factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if factor is not None and float(factor) != 1.0:
            raise ConfigError(f"HF Llama partial_rotary_factor={factor}: LlamaForCausalLM (transformers 5.23) rotates "
                              "every channel regardless, so its meaning is unclear; convert from GPT-NeoX instead")
        full = {OURS.embedding: hf[HF_LLAMA.embedding], OURS.final(): hf[HF_LLAMA.final()]}
        for i in range(nl):
            src, dst = HF_LLAMA.in_layer(i), OURS.in_layer(i)
            full.update(llama_attention_from_hf(hf, i, m))
            full.update(swiglu_mlp_from_hf(hf, i))
            if bias:
                full[dst("qkv", "bias")] = join_qkv(hf[src("q", "bias")], hf[src("k", "bias")], hf[src("v", "bias")],
                                                     m)
                full[dst("attn_out", "bias")] = hf[src("attn_out", "bias")]
                full[dst("fc1", "bias")] = torch.cat([hf[src("gate", "bias")], hf[src("up", "bias")]])
                full[dst("fc2", "bias")] = hf[src("fc2", "bias")]
        head = HF_LLAMA.head
    else:
        raise ConfigError(f"HF model_type {mt!r}: only 'gpt2', 'llama', 'gpt_neox', 'nemotron', 'mixtral' and "
                          "'qwen2_moe' convert to this trainer's GPT")
    if m["untie_embeddings_and_output_weights"]:
        full[OURS.head] = hf[head]
    return {k: v.contiguous() for k, v in full.items()}, m


def special_token_ids(config: dict) -> dict:
    """The bos/eos ids an HF config names (kept through a full state so an export writes them back)."""
    return {k: int(config[k]) for k in ("bos_token_id", "eos_token_id") if isinstance(config.get(k), int)}


def matching_flags(m: dict) -> list[str]:
    """pretrain_gpt.py flags whose ModelConfig equals the model fields ``m`` (shape, variant, epsilon,
    dropout), so that ``--load`` of the imported weights passes the shape check and computes the same model."""
    flags = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--num-attention-heads",
             m["num_attention_heads"], "--num-key-value-heads", m["num_key_value_heads"], "--ffn-hidden-size",
             m["ffn_hidden_size"], "--seq-length", m["seq_length"], "--max-position-embeddings",
             m["max_position_embeddings"], "--vocab-size", m["vocab_size"], "--normalization", m["normalization"],
             "--layernorm-epsilon", m["layernorm_epsilon"]]
    if m.get("position_embedding_type", "learned_absolute") == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", m.get("rotary_base", 10000.0)]
        if m.get("rotary_percent", 1.0) != 1.0:
            flags += ["--rotary-percent", float(m["rotary_percent"])]
    for key, flag, on in (("swiglu", "--swiglu", True), ("openai_gelu", "--openai-gelu", True),
                          ("squared_relu", "--squared-relu", True),
                          ("apply_layernorm_1p", "--apply-layernorm-1p", True),
                          ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True),
                          ("add_bias_linear", "--disable-bias-linear", False)):
        if bool(m.get(key, not on)) == on:
            flags.append(flag)
    for key, flag in (("hidden_dropout", "--hidden-dropout"), ("attention_dropout", "--attention-dropout")):
        if key in m:
            flags += [flag, m[key]]
    moe = m.get("moe") or {}
    if any(n > 1 for n in moe.get("num_experts", [1])):  # an imported Mixtral / Qwen2-MoE (moe.py)
        flags += ["--num-experts", *moe["num_experts"], "--expert-interval", moe["expert_interval"], "--topk",
                  moe["topk"]]
        flags += ["--disable-moe-token-dropping"] if not moe.get("moe_token_dropping", True) else []
        flags += ["--disable-moe-top2-2nd-expert-sampling"] if not moe.get("moe_top2_2nd_expert_sampling", True) else []
    return [f"{v:g}" if isinstance(v, float) else str(v) for v in flags]
