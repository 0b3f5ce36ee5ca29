"""Whether a checkpoint may be resumed under this run's flags, decided from its metadata alone (the preflight and
every loader ask the same functions): model shape, experts, TP/PP layout, engine kind and hierarchical ZeRO tiers,
and, when the optimizer is loaded, ZeRO stage, data-parallel size and precision."""

from __future__ import annotations

import dataclasses

from megatron.checkpointing.state import HZERO_FORMAT
from megatron.config import CheckpointSettings, RunConfig
from megatron.core.hierarchical_zero.config import parse_levels
from megatron.errors import ConfigError

# Model fields that change a parameter's shape or meaning: a checkpoint cannot be resumed across them.
SHAPE_FIELDS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_key_value_heads": "--num-key-value-heads",
    "max_position_embeddings": "--max-position-embeddings", "vocab_size": "--vocab-size/tokenizer",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by", "normalization": "--normalization",
    "swiglu": "--swiglu", "openai_gelu": "--openai-gelu", "position_embedding_type": "--position-embedding-type",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear",
}

# A real heading of docs/checkpoints.md (tests/unit/test_preflight.py checks that the anchor exists).
RESHARD_DOC = "docs/checkpoints.md#resharding-full-state-conversion"

_CONVERT = "convert it first: python tools/reshard_checkpoint.py --load {where} --save NEW_DIR and --load NEW_DIR"
"""The fix for a layout a checkpoint of ours cannot resume at directly (TP, PP, EP): a full state loads at any."""

HZERO_RESHARD = ("Launch the same layout, or convert: python tools/reshard_checkpoint.py --load {where} --save FULL, "
                 "then --load FULL (weights and Adam moments carry over)")
"""The fix for hierarchical ZeRO shards that do not fit this run (also hzero/shards.py's check after the engine)."""


def loads_optimizer(settings: CheckpointSettings, meta: dict) -> bool:
    """Whether resuming the checkpoint described by ``meta`` restores its optimizer state under these flags."""
    return not (settings.finetune or settings.no_load_optim) and meta.get("has_optimizer", True)


def check_resume(saved: dict, run: RunConfig, load_optim: bool, where: str) -> None:
    """Refuse a checkpoint whose model shape or layout differs from this run's; allow the rest
    (train-iters, LR schedule, intervals, batch size) to change. ``saved`` is a checkpoint's metadata."""
    check_model_shape(saved["run"]["model"], run, where)
    p = saved["run"]["parallel"]
    check_experts(saved["run"]["model"].get("moe") or {}, p.get("moe_expert_parallel_size", 1), run, where)
    changed = [f"{flag} {p[key]}, now {getattr(run.parallel, key)}"
               for key, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                                 ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"))
               if p[key] != getattr(run.parallel, key)]
    if changed:  # every changed flag is named: fixing one at a time would cost a launch each
        raise ConfigError(f"--load {where}: saved with {' and '.join(changed)}. Keep the layout, or "
                          f"{_CONVERT.format(where=where)} (see {RESHARD_DOC})")
    # Engine kind, DP size and tier layout of hierarchical ZeRO shards: weights live in them too, so these hold
    # even without the optimizer.

    check_saved_layout(saved, run, where)
    if not load_optim:
        return
    # ZeRO partitions over every rank of the data-parallel dimension, DeepSpeed-Ulysses' SP ranks included.
    saved_dp = p["world_size"] // (p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"])
    now_dp = run.parallel.dp * run.parallel.ulysses
    if p["zero_stage"] > 0 and saved_dp != now_dp:
        raise ConfigError(f"--load {where}: ZeRO-{p['zero_stage']} optimizer state is partitioned over "
                          f"data-parallel size {saved_dp}, now {now_dp}. Launch the same DP size, or pass "
                          "--no-load-optim to restart the optimizer from the saved weights")
    if p["zero_stage"] != run.parallel.zero_stage:
        raise ConfigError(f"--load {where}: saved with --zero-stage {p['zero_stage']}, now "
                          f"{run.parallel.zero_stage}. Use the same stage, or pass --no-load-optim")
    prec = saved["run"]["precision"]
    for name in ("fp16", "bf16"):
        if prec[name] != getattr(run.precision, name):
            raise ConfigError(f"--load {where}: saved with --{name} {'on' if prec[name] else 'off'}, now "
                              f"{'on' if getattr(run.precision, name) else 'off'}. Use the same precision, or "
                              "pass --no-load-optim")


def chunks_changed(saved: dict, run: RunConfig) -> bool:
    """Whether the checkpoint described by ``saved`` placed the layers on its pipeline ranks otherwise than this run
    does: 1F1B and zero-bubble H1 place them alike, interleaving with v chunks per rank otherwise. Each rank's
    optimizer files then hold other layers' moments: they are carried by name (full_state/format.carry_moments)."""
    p = saved["run"]["parallel"]
    n, pp = p.get("num_layers_per_virtual_pipeline_stage"), p["pipeline_model_parallel_size"]
    saved_v = saved["run"]["model"].get("num_layers", run.model.num_layers) // (pp * n) if n and pp > 1 else 1
    return saved_v != run.parallel.virtual_stages(run.model.num_layers)


def check_saved_layout(saved: dict, run, where: str) -> None:
    """Before any process group: a hierarchical checkpoint loads only into the same hierarchical layout, and a
    DeepSpeed checkpoint only into DeepSpeed (their shards mean different things). One line naming the fix."""
    p = run.parallel
    ours = saved.get("format") == HZERO_FORMAT
    if not ours and not p.zero_hierarchy:
        return
    if ours != bool(p.zero_hierarchy):
        was = "hierarchical ZeRO (--zero-hierarchy)" if ours else "DeepSpeed"
        now = "hierarchical ZeRO (--zero-hierarchy)" if p.zero_hierarchy else "DeepSpeed"
        raise ConfigError(f"--load {where}: saved by the {was} engine, this run uses the {now} engine. "
                          f"{HZERO_RESHARD.format(where=where)}")
    h = saved["hierarchy"]
    levels = list(parse_levels(p.zero_hierarchy))
    diffs = []
    if h["dp_size"] != p.dp:
        diffs.append(f"data-parallel size {h['dp_size']} (now {p.dp})")
    if h["levels"] != levels:
        diffs.append(f"--zero-hierarchy {','.join(h['levels'])} (now {','.join(levels)})")
    if p.zero_hierarchy_weights and h["weights"] != p.zero_hierarchy_weights:
        diffs.append(f"--zero-hierarchy-weights {h['weights']} (now {p.zero_hierarchy_weights})")
    if h["int8"] != p.zero_hierarchy_int8:
        diffs.append(f"--zero-hierarchy-int8 {'on' if h['int8'] else 'off'} (now "
                     f"{'on' if p.zero_hierarchy_int8 else 'off'})")
    if diffs:
        raise ConfigError(f"--load {where}: hierarchical ZeRO shards were saved with {'; '.join(diffs)}. "
                          f"{HZERO_RESHARD.format(where=where)}")


_MOE_FIELDS = {"num_experts": "--num-experts", "expert_interval": "--expert-interval", "mlp_type": "--mlp-type",
               "enable_expert_tensor_parallelism": "--enable-expert-tensor-parallelism"}


def check_experts(saved_moe: dict, saved_ep: int, run: RunConfig, where: str) -> None:
    """Refuse a checkpoint whose experts are laid out otherwise: other MoE layers, counts, PR-MoE or expert TP (its
    per-expert files hold other tensors), or, for a model with experts, another expert-parallel size (the ZeRO
    partitions of the experts follow it: resharding goes through a full state, tools/reshard_checkpoint.py)."""
    now = dataclasses.asdict(run.model.moe)
    default = dataclasses.asdict(type(run.model.moe)())
    changed = [f"{flag} ({_shown(saved_moe.get(k, default[k]))} in the checkpoint, {_shown(now[k])} now)"
               for k, flag in _MOE_FIELDS.items() if _shown(saved_moe.get(k, default[k])) != _shown(now[k])]
    if changed:
        raise ConfigError(f"--load {where}: the checkpoint's experts differ: {'; '.join(changed)}. Use the "
                          "checkpoint's values for these flags")
    if run.model.moe.enabled and saved_ep != run.parallel.ep:
        raise ConfigError(f"--load {where}: saved with --moe-expert-parallel-size {saved_ep}, now {run.parallel.ep}: "
                          f"keep the expert-parallel size, or {_CONVERT.format(where=where)}")


def _shown(v):
    return list(v) if isinstance(v, list | tuple) else v


def check_model_shape(model: dict, run: RunConfig, where: str) -> None:
    """Refuse a checkpoint whose model fields in ``SHAPE_FIELDS`` differ from this run's, naming them."""
    now = dataclasses.asdict(run.model)
    changed = [f"{flag} ({model[k]} in the checkpoint, {now[k]} now)" for k, flag in SHAPE_FIELDS.items()
               if k in model and model[k] != now[k]]
    if changed:
        raise ConfigError(f"--load {where}: the checkpoint was trained with a different model shape: "
                          f"{'; '.join(changed)}. Use the checkpoint's values for these flags")
