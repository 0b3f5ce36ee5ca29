"""Upstream's flags, fused-QKV order and TP splits, mapped to ours (the names: megatron/model/param_names.py).

Upstream's fused QKV (``ParallelAttention.forward`` at its pinned commit) is, on each TP rank, all local queries, then
all keys, then all values ``[Q | K | V]``; ours is per KV group ``[q_1 .. q_g, k, v]``: ``qkv_to_ours`` permutes each
TP rank's rows (weights and Adam moments) before the TP merge. Upstream's flags that decide shapes and arithmetic
become our ModelConfig fields (``model_fields``); variants this trainer does not implement are refused.
"""

from __future__ import annotations

import os

import torch

from megatron.checkpointing.full_state.merge import merge_tp
from megatron.checkpointing.live.safe_io import safe_load
from megatron.checkpointing.upstream.layout import LAYER_FILE
from megatron.errors import CheckpointError
from megatron.model.param_names import OURS, expert_index, is_fused_qkv, pipe_roles_from_keys, tp_split


def pipe_roles(files: list[str]) -> dict[int, str]:
    """Pipeline layer index -> "embedding" / "layers.N" / "final_layernorm" / "output_layer", from the keys each
    ``layer_XX`` file holds (upstream's GPTModelPipe: embedding, the transformer layers, the final norm, the head)."""
    keys: dict[int, set[str]] = {}
    for f in files:
        idx = int(LAYER_FILE.match(os.path.basename(f)).group(1))
        keys.setdefault(idx, set()).update(safe_load(f, mmap=True).keys())
    return pipe_roles_from_keys(keys)


# Upstream variants this trainer does not implement: resuming them here would silently compute something else.
_UNSUPPORTED = {"rotary_percent": "--rotary-percent below 1",
                "num_experts_switch": "--num-experts-switch (Megatron-LM's switch MLP)"}


def model_fields(a: dict) -> dict:
    """Upstream's flags under our ModelConfig names (only those that decide shapes and arithmetic)."""
    for key, flag in _UNSUPPORTED.items():
        v = a.get(key)
        bad = (v not in (None, 1.0)) if key == "rotary_percent" else bool(v)
        if bad:
            raise CheckpointError(f"upstream checkpoint trained with {flag} ({v}): this trainer has no such model; "
                                  "it cannot be resumed or converted here")
    rope = a.get("position_embedding_type") == "rope" or a.get("use_rotary_position_embeddings", False)
    return {
        "num_layers": a["num_layers"], "hidden_size": a["hidden_size"],
        "num_attention_heads": a["num_attention_heads"], "ffn_hidden_size": a.get("ffn_hidden_size"),
        "num_key_value_heads": a.get("num_key_value_heads") or a["num_attention_heads"],
        "max_position_embeddings": a.get("max_position_embeddings"),
        "make_vocab_size_divisible_by": a.get("make_vocab_size_divisible_by", 128),
        "normalization": a.get("normalization", "layernorm").lower(), "swiglu": bool(a.get("swiglu", False)),
        "openai_gelu": _tanh_gelu(a), "position_embedding_type": "rope" if rope else
        "learned_absolute", "untie_embeddings_and_output_weights": bool(a.get("untie_embeddings_and_output_weights")),
        "add_bias_linear": bool(a.get("add_bias_linear", True)),
        "layernorm_epsilon": float(a.get("layernorm_epsilon", 1e-5)),
        # upstream's activation order: openai-gelu, onnx-safe (erf GeLU), swiglu, then squared-relu
        "squared_relu": bool(a.get("squared_relu")) and not (a.get("openai_gelu") or a.get("onnx_safe")
                                                             or a.get("swiglu")),
        # its RMSNorm ignores the flag (CUDA LayerNorms only: a CPU-trained upstream run ignored it altogether)
        "apply_layernorm_1p": bool(a.get("apply_layernorm_1p")) and a.get("normalization", "layernorm").lower()
        == "layernorm",
        "apply_residual_connection_post_layernorm": bool(a.get("apply_residual_connection_post_layernorm")),
        "moe": moe_fields(a),
    }


def pipe_final_norm_to_ours(weights: dict[str, torch.Tensor], fields: dict) -> dict[str, torch.Tensor]:
    """Upstream's GPTModelPipe builds its final LayerNorm without --apply-layernorm-1p (gpt_model.py at the pinned
    commit), ours is 1p like every other norm: a pipeline checkpoint's final weight w means our w - 1."""
    name = OURS.final()
    if fields.get("apply_layernorm_1p") and name in weights:
        weights[name] = weights[name] - 1
    return weights


def moe_fields(a: dict) -> dict:
    """Upstream's DeepSpeed-MoE flags under our MoEConfig names (the ones that decide which tensors exist), and
    its expert-parallel size (``ep``; the experts are read whole, so any EP here can resume them)."""
    n = a.get("num_experts") or [1]
    n = list(n) if isinstance(n, (list, tuple)) else [int(n)]
    if any(k > 1 for k in n) and a.get("mlp_type", "standard") != "standard":
        raise CheckpointError(f"upstream checkpoint trained with --mlp-type {a.get('mlp_type')} (PR-MoE): reading "
                              "its residual MLP is not built; only standard MoE layers are read")
    return {"num_experts": n, "expert_interval": int(a.get("expert_interval", 2)),
            "mlp_type": a.get("mlp_type", "standard"),
            "enable_expert_tensor_parallelism": bool(a.get("enable_expert_tensor_parallelism", False)),
            "ep": int(a.get("moe_expert_parallel_size", 1))}


def qkv_to_ours(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (weight [rows, h] or bias [rows]) from upstream's [Q | K | V] (Q: ``heads``
    x ``head_dim`` rows, K and V: ``kv_heads`` x ``head_dim``) to ours, per KV group [q_1 .. q_g, k, v]."""
    rest = t.shape[1:]
    if t.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise CheckpointError(f"fused QKV has {t.shape[0]} rows on a TP rank, expected (heads {heads} + 2 x kv heads "
                              f"{kv_heads}) x head dim {head_dim}: a QKV layout this converter does not know")
    g = heads // kv_heads
    q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    q = q.reshape(kv_heads, g, head_dim, *rest)  # [nkv, g, d, (h)]
    k, v = k.reshape(kv_heads, 1, head_dim, *rest), v.reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(t.shape)  # [nkv, g + 2, d, (h)] -> rows


def local_heads(fields: dict, tp: int) -> tuple[int, int, int]:
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    if heads % tp or kv % tp:
        raise CheckpointError(f"upstream checkpoint: {heads} heads / {kv} KV heads do not split over TP {tp}")
    return heads // tp, kv // tp, fields["hidden_size"] // heads


def _tanh_gelu(a: dict) -> bool:
    """Upstream's MLP runs the tanh GeLU (our --openai-gelu) under --openai-gelu and also under its default
    --bias-gelu-fusion (``bias_gelu_impl`` is the tanh form); exact erf only with --no-bias-gelu-fusion/--onnx-safe."""
    if a.get("openai_gelu"):
        return True
    plain_gelu = not (a.get("onnx_safe") or a.get("swiglu") or a.get("squared_relu"))
    return bool(plain_gelu and a.get("bias_gelu_fusion", True) and a.get("add_bias_linear", True))


def merge_ranks(per_tp: list[dict[str, torch.Tensor]], fields: dict) -> dict[str, torch.Tensor]:
    """Our full tensors from upstream's per-TP-rank ones: QKV rows permuted on each rank, then merged over TP."""
    full = {}
    local = local_heads(fields, len(per_tp))
    expert_tp = (fields.get("moe") or {}).get("enable_expert_tensor_parallelism", False)
    for name in per_tp[0]:
        # upstream's experts are whole on every TP rank unless --enable-expert-tensor-parallelism (as ours)
        split = None if expert_index(name) is not None and not expert_tp else tp_split(name, fields["swiglu"])
        shards = [qkv_to_ours(s[name], *local) if is_fused_qkv(name) else s[name] for s in per_tp]
        full[name] = merge_tp(shards, *split) if split else shards[0]
    return {k: v.detach().float().clone().contiguous() if v.is_floating_point() else v.clone()
            for k, v in full.items()}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out
