"""Writing a full state (our names, experts by global index) back in upstream Megatron-DeepSpeed's layout without
its pipeline, so upstream resumes it: ``latest``, ``latest_checkpointed_iteration.txt`` and ``global_stepN/`` with
``mp_rank_XX_model_states.pt`` (``module`` nested as upstream's ``state_dict_for_save_checkpoint``, its ``args``,
iteration and DeepSpeed's fields) and, with experts, DeepSpeed's ``layer_{M}_expert_{E}_mp_rank_XX_model_states.pt``
(M counts MoE layers, E the global expert; names as upstream's, ``...deepspeed_experts.E...``). Upstream's
GPTModel applies --apply-layernorm-1p to its final norm as ours does, so every norm is written as it is (its
GPTModelPipe does not: the reader converts that one, mapping.pipe_final_norm_to_ours).

Weights, progress and the LR schedule's state (ours keeps upstream's form, in samples; DeepSpeed's engine loads it
even under ``--no-load-optim``, and upstream checks it against its flags, so run upstream with the same LR flags and
--train-iters); no ZeRO optimizer files and no RNG states: upstream loads it with ``--no-load-optim --no-load-rng``
and its Adam restarts.
"""

from __future__ import annotations

import argparse
import os
from collections import OrderedDict

import deepspeed
import torch

from megatron.checkpointing.live.markers import LATEST, TRACKER
from megatron.checkpointing.upstream import writer_zero
from megatron.checkpointing.upstream.mapping import local_heads
from megatron.errors import CheckpointError
from megatron.model.param_names import (
    VOCAB_PARAMS,
    expert_index,
    expert_layer_key,
    experts_per_layer,
    is_fused_qkv,
    layer_index,
    tp_split,
    upstream_flat,
    upstream_nested,
)


def qkv_to_upstream(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of mapping.qkv_to_ours: one TP rank's rows from ours (per KV group [q_1 .. q_g, k, v]) to upstream's
    [Q | K | V]."""
    rest, g = t.shape[1:], heads // kv_heads
    grouped = t.reshape(kv_heads, g + 2, head_dim, *rest)  # [nkv, g + 2, d, (h)]
    q = grouped[:, :g].reshape(heads * head_dim, *rest)
    k, v = grouped[:, g].reshape(kv_heads * head_dim, *rest), grouped[:, g + 1].reshape(kv_heads * head_dim, *rest)
    return torch.cat([q, k, v])


def tp_shard(name: str, t: torch.Tensor, fields: dict, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's piece of a full tensor, in upstream's form (its [Q | K | V] per rank)."""
    expert_tp = (fields.get("moe") or {}).get("enable_expert_tensor_parallelism", False)
    split = None if expert_index(name) is not None and not expert_tp else tp_split(name, fields["swiglu"])
    if split is not None:
        dim, stride = split
        blocks = t.chunk(stride, dim=dim)  # each stride block split evenly (ColumnParallel of a GLU's two halves)
        t = torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim)
    if is_fused_qkv(name):
        t = qkv_to_upstream(t, *local_heads(fields, tp))
    return t.contiguous().clone()


def pad_vocab(full: dict[str, torch.Tensor], padded: int) -> dict[str, torch.Tensor]:
    """Vocabulary rows zero-padded (or kept) to upstream's padded size."""
    out = dict(full)
    for name in VOCAB_PARAMS:
        if name in out and out[name].shape[0] < padded:
            t = out[name]
            out[name] = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
    return out


def upstream_args(fields: dict, padded_vocab: int, tp: int, dp: int, progress: dict, run_flags: dict) -> dict:
    """The ``args`` upstream reads back (check_checkpoint_args, consumed samples) and our reader maps."""
    moe = fields.get("moe") or {}
    a = {"num_layers": fields["num_layers"], "hidden_size": fields["hidden_size"],
         "ffn_hidden_size": fields["ffn_hidden_size"], "num_attention_heads": fields["num_attention_heads"],
         "num_key_value_heads": fields["num_key_value_heads"],
         "max_position_embeddings": fields["max_position_embeddings"], "add_position_embedding":
         fields["position_embedding_type"] == "learned_absolute", "make_vocab_size_divisible_by":
         fields["make_vocab_size_divisible_by"], "padded_vocab_size": padded_vocab,
         "normalization": fields["normalization"], "swiglu": fields["swiglu"], "openai_gelu": fields["openai_gelu"],
         "bias_gelu_fusion": False, "use_rotary_position_embeddings": fields["position_embedding_type"] == "rope",
         "untie_embeddings_and_output_weights": fields["untie_embeddings_and_output_weights"],
         "add_bias_linear": fields["add_bias_linear"], "layernorm_epsilon": fields["layernorm_epsilon"],
         **{k: bool(fields.get(k, False)) for k in ("squared_relu", "apply_layernorm_1p",
                                                    "apply_residual_connection_post_layernorm")},
         "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "data_parallel_size": dp,
         "world_size": tp * dp, "deepspeed": True, "zero_stage": int(run_flags.get("zero_stage", 1)),
         "num_experts": list(moe.get("num_experts", [1])), "expert_interval": moe.get("expert_interval", 2),
         "mlp_type": moe.get("mlp_type", "standard"), "moe_expert_parallel_size": int(run_flags.get("ep", 1)),
         "enable_expert_tensor_parallelism": moe.get("enable_expert_tensor_parallelism", False),
         "iteration": progress["iteration"], "consumed_train_samples": progress["consumed_samples"],
         "consumed_valid_samples": 0, "global_batch_size": int(run_flags.get("global_batch_size", 1))}
    a.update({k: v for k, v in run_flags.items() if k in ("tokenizer_type", "vocab_file", "merge_file",
                                                         "seq_length")})
    return a


def write_upstream(out: str, full: dict[str, torch.Tensor], fields: dict, progress: dict, *, tp: int, dp: int,
                   ep: int, padded_vocab: int, run_flags: dict | None = None, moments: dict | None = None,
                   optimizer_step: int = 0, hyper: dict | None = None) -> str:
    """Write ``full`` (our names; experts by global index) as upstream's global_step<iteration>/ under ``out`` for
    TP ``tp``, data-parallel ``dp`` and expert-parallel ``ep`` ranks; returns the step directory. With ``moments``
    (and ``hyper``: betas, eps, weight_decay, clip_grad, zero_stage, ds_config) also DeepSpeed's ZeRO-1/2 files."""
    run_flags = {**(run_flags or {}), "ep": ep}
    moe = fields.get("moe") or {}
    counts = [n for n in moe.get("num_experts", [1]) if n > 1]
    if any(n % ep for n in counts) or dp % ep:
        raise CheckpointError(f"--moe-expert-parallel-size {ep} must divide the experts ({counts}) and DP {dp}")
    it = int(progress["iteration"])
    step = os.path.join(out, f"global_step{it}")
    os.makedirs(step, exist_ok=True)
    full = pad_vocab(full, padded_vocab)
    if moments is not None:
        if not progress.get("lr_scheduler"):
            raise CheckpointError("the checkpoint keeps no LR scheduler state: upstream's optimizer files need the lr")
        moments = {k: pad_vocab(_pick(moments, k), padded_vocab) for k in ("exp_avg", "exp_avg_sq")}
    per_layer = experts_per_layer(full)
    moe_ids = {prefix: i for i, prefix in enumerate(sorted(per_layer, key=layer_index))}
    layer_counts = [per_layer[p] for p in sorted(moe_ids, key=moe_ids.get)]  # DeepSpeed's engine.num_experts
    args = argparse.Namespace(**upstream_args(fields, padded_vocab, tp, dp, progress, run_flags))
    for rank in range(tp):
        module: dict = {}
        expert_files: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        shards = {name: tp_shard(name, t, fields, tp, rank) for name, t in full.items()}
        for name, shard in shards.items():
            if (prefix := expert_layer_key(name)) is not None:
                key = (moe_ids[prefix], expert_index(name))
                expert_files.setdefault(key, {})[upstream_flat(name)] = shard
                continue
            *outer, leaf = upstream_nested(name)
            node = module
            for i, k in enumerate(outer):
                node = node.setdefault(k, OrderedDict() if i == len(outer) - 1 else {})
            node[leaf] = shard
        for (mid, e), tensors in sorted(expert_files.items()):
            torch.save(tensors, os.path.join(step, f"layer_{mid}_expert_{e}_mp_rank_{rank:02d}_model_states.pt"))
        shapes = None
        if moments is not None:
            m_shards = {n: {k: tp_shard(n, moments[k][n], fields, tp, rank) for k in moments} for n in full}
            h = {**hyper, "ds_version": deepspeed.__version__}
            for d, zs in enumerate(writer_zero.zero_states(
                    shards, m_shards, optimizer_step, dp=dp, ep=ep, per_layer=per_layer,
                    scheduler=progress["lr_scheduler"], hyper=h, stage=int(hyper["zero_stage"]),
                    ds_config=hyper["ds_config"])):
                torch.save(zs, os.path.join(step, f"zero_pp_rank_{d}_mp_rank_{rank:02d}_optim_states.pt"))
            shapes = writer_zero.param_shapes(shards, ep, per_layer)
        state = {"module": module, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
                 "lr_scheduler": progress.get("lr_scheduler"), "skipped_steps": 0, "global_steps": it,
                 "global_samples": int(progress["consumed_samples"]), "dp_world_size": dp, "mp_world_size": tp,
                 "ds_version": deepspeed.__version__, "num_experts": layer_counts or [1],
                 "ds_config": (hyper or {}).get("ds_config"),
                 "args": args, "checkpoint_version": 3.0, "iteration": it,
                 "tokens": int(progress["consumed_samples"]) * int(run_flags.get("seq_length", 0) or 0)}
        torch.save(state, os.path.join(step, f"mp_rank_{rank:02d}_model_states.pt"))
    for marker, text in ((LATEST, f"global_step{it}"), (TRACKER, str(it))):  # after the files they name
        with open(os.path.join(out, marker), "w") as f:
            f.write(text)
    return step


def _pick(moments: dict[str, dict[str, torch.Tensor]], key: str) -> dict[str, torch.Tensor]:
    return {n: m[key] for n, m in moments.items()}
