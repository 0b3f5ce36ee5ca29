"""Whether a checkpoint may be resumed under this run's flags, decided from its metadata alone (the preflight and
every loader ask the same functions): model shape, experts, precision when the optimizer is loaded, and whether
another TP x PP x DP x EP x ZeRO layout (hierarchical ZeRO's tiers and engine included) is resumed in place
(``LayoutChange``) or refused (hierarchical ZeRO shards at another TP; a data order that depends on DP)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
    "add_bias_linear": "--disable-bias-linear", "squared_relu": "--squared-relu",
    "apply_layernorm_1p": "--apply-layernorm-1p",
    "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
}
# Fields a checkpoint written before they existed does not record: it was trained without them.
_RECORDED_LATER = {"squared_relu": False, "apply_layernorm_1p": False,
                   "apply_residual_connection_post_layernorm": False}

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


@dataclass(frozen=True)
class Layout:
    """How a run's ranks hold the model: what a checkpoint written at one layout needs to be read at another.
    ``hzero``: hierarchical ZeRO's tiers (and int8 stage), empty for DeepSpeed's engine."""

    tp: int
    pp: int
    dp: int
    sp: int
    ep: int
    zero: int
    hzero: str = ""

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp * self.sp

    def __str__(self) -> str:
        sp = f" x SP {self.sp}" if self.sp > 1 else ""
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        zero = f"hierarchical ZeRO {self.hzero}" if self.hzero else f"ZeRO-{self.zero}"
        return f"TP {self.tp} x PP {self.pp} x DP {self.dp}{sp} x EP {self.ep}, {zero} ({ranks})"


def _tiers(levels, int8: bool) -> str:
    return ",".join(levels) + (" + int8" if int8 else "")


def saved_layout(saved: dict) -> Layout:
    """The layout of the run that wrote the checkpoint described by ``saved`` (its metadata)."""
    p, moe = saved["run"]["parallel"], saved["run"]["model"].get("moe") or {}
    tp, pp = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]
    sp = p.get("ds_sequence_parallel_size", 1)
    ep = p.get("moe_expert_parallel_size", 1) if any(n > 1 for n in moe.get("num_experts") or [1]) else 1
    h = saved.get("hierarchy") if saved.get("format") == HZERO_FORMAT else None
    return Layout(tp, pp, p["world_size"] // (tp * pp * sp), sp, ep, p["zero_stage"],
                  _tiers(h["levels"], h["int8"]) if h else "")


def run_layout(run: RunConfig) -> Layout:
    p = run.parallel
    return Layout(p.tp, p.pp, p.dp, p.ulysses, p.ep if run.model.moe.enabled else 1, p.zero_stage,
                  _tiers(parse_levels(p.zero_hierarchy), p.zero_hierarchy_int8) if p.zero_hierarchy else "")


@dataclass(frozen=True)
class LayoutChange:
    """A checkpoint of ours resumed at another layout in place (megatron/checkpointing/relayout/), and the lines that
    say what does not carry over exactly."""

    saved: Layout
    now: Layout
    notes: tuple[str, ...] = ()


def check_resume(saved: dict, run: RunConfig, load_optim: bool, where: str) -> LayoutChange | None:
    """Refuse a checkpoint whose model shape differs from this run's, or whose layout this run cannot read; allow
    the rest (train-iters, LR schedule, intervals, batch size) to change. ``saved`` is a checkpoint's metadata.
    Returns the layout change when the checkpoint is resumed at another TP x PP x DP x EP x ZeRO layout in place
    (DeepSpeed's ZeRO 0-3 or hierarchical ZeRO on either side), None when the layouts are the same."""
    check_model_shape(saved["run"]["model"], run, where)
    check_experts(saved["run"]["model"].get("moe") or {}, run, where)
    before, now = saved_layout(saved), run_layout(run)
    if load_optim:
        check_precision(saved["run"]["precision"], run, where)
    if before == now and not _weights_tier_changed(saved, run):
        return None
    refuse_hzero_tp_change(before, now, where)
    v_saved, v_now = saved_virtual_stages(saved, run), run.parallel.virtual_stages(run.model.num_layers)
    if max(v_saved, v_now) > 1:  # relayout/ reads stages of consecutive layers, not interleaved chunks
        raise ConfigError(f"--load {where}: another layout ({before} -> {now}) together with "
                          f"the interleaved schedule ({v_saved} -> {v_now} model chunks per rank) is not read in "
                          "place: change one at a time (resume at the saved layout without "
                          "--num-layers-per-virtual-pipeline-stage and save, then change the layout)")
    check_data_order(saved, run, before, now, where)
    return LayoutChange(before, now, tuple(_notes(saved, run)))


def _weights_tier_changed(saved: dict, run: RunConfig) -> bool:
    """Hierarchical ZeRO shards resumed with another --zero-hierarchy-weights: the secondary shards are rebuilt."""
    w = run.parallel.zero_hierarchy_weights
    return saved.get("format") == HZERO_FORMAT and bool(w) and saved["hierarchy"]["weights"] != w


def refuse_hzero_tp_change(before: Layout, now: Layout, where: str) -> None:
    """Hierarchical ZeRO shards are read at another DP size, tiers and engine in place; another TP size is not
    exercised there and goes through a full state."""
    if before.hzero and before.tp != now.tp:
        raise ConfigError(f"--load {where}: hierarchical ZeRO shards saved with --tensor-model-parallel-size "
                          f"{before.tp}, now {now.tp}: read in place at another DP size or tiers only. Keep TP "
                          f"{before.tp}, or {_CONVERT.format(where=where)} (see {RESHARD_DOC})")


def check_precision(prec: dict, run: RunConfig, where: str) -> None:
    for name in ("fp16", "bf16"):
        if prec[name] != getattr(run.precision, name):
            raise ConfigError(f"--load {where}: saved with --{name} {'on' if prec[name] else 'off'}, now "
                              f"{'on' if getattr(run.precision, name) else 'off'}. Use the same precision, or "
                              "pass --no-load-optim")


def check_data_order(saved: dict, run: RunConfig, before: Layout, now: Layout, where: str) -> None:
    """At another data-parallel size the next samples must be the straight run's: the global batch and the order."""
    if before.dp == now.dp:
        return
    if run.data.dataloader_type == "cyclic":
        raise ConfigError(f"--load {where}: saved at data-parallel size {before.dp}, now {now.dp}, with "
                          "--dataloader-type cyclic, whose sample order depends on the data-parallel size: keep DP "
                          f"{before.dp} ({before.dp * now.tp * now.pp * now.sp} ranks at TP {now.tp} x PP {now.pp}), "
                          "or use --dataloader-type single")
    was, gbs = saved["run"]["training"]["global_batch_size"], run.training.global_batch_size
    if run.flags.get("global_batch_size") is None and was != gbs:
        mbs = saved["run"]["training"]["micro_batch_size"]
        raise ConfigError(f"--load {where}: --global-batch-size was not given; it was {was} (micro-batch {mbs} x DP "
                          f"{before.dp}) and would now be {gbs}: pass --global-batch-size {was} to keep the run's "
                          "batch")


def _notes(saved: dict, run: RunConfig) -> list[str]:
    """What carries over only approximately, one line each."""
    out = []
    m, p = saved["run"]["model"], saved["run"]["parallel"]
    divisible = m.get("make_vocab_size_divisible_by", run.model.make_vocab_size_divisible_by) * p[
        "tensor_model_parallel_size"]
    was, now = -(-m["vocab_size"] // divisible) * divisible, run.model.padded_vocab_size(run.parallel.tp)
    if was != now:
        out.append(f"> layout change: the padded vocabulary goes from {was} to {now} rows "
                   f"(--make-vocab-size-divisible-by {run.model.make_vocab_size_divisible_by} x TP): "
                   + (f"rows {was}-{now - 1} start at zero" if now > was else f"rows {now}-{was - 1} are dropped")
                   + "; the loss continues close to, not exactly, the straight run's")
    return out


def saved_virtual_stages(saved: dict, run: RunConfig) -> int:
    """Model chunks per pipeline rank of the checkpoint described by ``saved`` (1 under 1F1B and zero-bubble H1)."""
    p = saved["run"]["parallel"]
    n, pp = p.get("num_layers_per_virtual_pipeline_stage"), p["pipeline_model_parallel_size"]
    return saved["run"]["model"].get("num_layers", run.model.num_layers) // (pp * n) if n and pp > 1 else 1


def chunks_changed(saved: dict, run: RunConfig) -> bool:
    """Whether the checkpoint described by ``saved`` placed the layers on its pipeline ranks otherwise than this run
    does: 1F1B and zero-bubble H1 place them alike, interleaving with v chunks per rank otherwise. Each rank's
    optimizer files then hold other layers' moments: they are carried by name (full_state/format.carry_moments)."""
    return saved_virtual_stages(saved, run) != run.parallel.virtual_stages(run.model.num_layers)


_MOE_FIELDS = {"num_experts": "--num-experts", "expert_interval": "--expert-interval", "mlp_type": "--mlp-type",
               "enable_expert_tensor_parallelism": "--enable-expert-tensor-parallelism"}


def check_experts(saved_moe: dict, run: RunConfig, where: str) -> None:
    """Refuse a checkpoint whose experts are laid out otherwise: other MoE layers, counts, PR-MoE or expert TP (its
    per-expert files hold other tensors). Another expert-parallel size is a layout change (LayoutChange)."""
    now = dataclasses.asdict(run.model.moe)
    default = dataclasses.asdict(type(run.model.moe)())
    changed = [f"{flag} ({_shown(saved_moe.get(k, default[k]))} in the checkpoint, {_shown(now[k])} now)"
               for k, flag in _MOE_FIELDS.items() if _shown(saved_moe.get(k, default[k])) != _shown(now[k])]
    if changed:
        raise ConfigError(f"--load {where}: the checkpoint's experts differ: {'; '.join(changed)}. Use the "
                          "checkpoint's values for these flags")


def _shown(v):
    return list(v) if isinstance(v, list | tuple) else v


def check_model_shape(model: dict, run: RunConfig, where: str) -> None:
    """Refuse a checkpoint whose model fields in ``SHAPE_FIELDS`` differ from this run's, naming them."""
    now, model = dataclasses.asdict(run.model), {**_RECORDED_LATER, **model}
    changed = [f"{flag} ({model[k]} in the checkpoint, {now[k]} now)" for k, flag in SHAPE_FIELDS.items()
               if k in model and model[k] != now[k]]
    if changed:
        raise ConfigError(f"--load {where}: the checkpoint was trained with a different model shape: "
                          f"{'; '.join(changed)}. Use the checkpoint's values for these flags")
