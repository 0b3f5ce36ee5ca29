"""A user's --deepspeed_config, read once and merged into the flags' settings before the RunConfig is built, so that
what the JSON decides for the run (as upstream, where DeepSpeed reads it) is part of the config from its birth.

The JSON decides the ZeRO stage (without --zero-stage), gradient clipping (without --clip-grad), fp16/bf16 (without
--fp16/--bf16), recompute (pipeline.activation_checkpoint_interval: full; true activation_checkpointing keys: the
options the flags leave off) and hierarchical ZeRO (the megatron_frontier section, without --zero-hierarchy). The
rest of the JSON is filled from the config or checked against it by megatron/engine.py build_ds_config.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from megatron.compat import ds_json
from megatron.compat.ds_config_keys import OWN_SECTION
from megatron.config import DeepSpeedSettings, ModelConfig, OptimizerConfig, ParallelConfig, PrecisionConfig
from megatron.errors import ConfigError


def with_deepspeed_json(fields: dict, path: str | None, zero_stage_given: bool = True,
                        clip_grad_given: bool = True) -> dict:
    """RunConfig's keyword arguments ``fields`` (from the flags; a part left out is its default) with what the JSON at
    ``path`` decides merged in, and ``deepspeed`` filled. ``zero_stage_given`` / ``clip_grad_given``: --zero-stage /
    --clip-grad was on the command line (the JSON must then agree with it: build_ds_config checks)."""
    if path is None:
        return dict(fields, deepspeed=DeepSpeedSettings())
    raw = ds_json.load_ds_config(path)
    settings = DeepSpeedSettings(config=path, user_json=json.dumps(raw))
    source = settings.source
    parallel = fields.get("parallel", ParallelConfig())
    stage_from_json = not zero_stage_given and "stage" in raw.get("zero_optimization", {})
    if stage_from_json:
        parallel = dataclasses.replace(parallel, zero_stage=int(raw["zero_optimization"]["stage"]))
    cfg = copy.deepcopy(raw)
    ds_json.apply_table(cfg, source)  # unknown and refused keys stop here; its notes are build_ds_config's to say
    optimizer = _clipping(cfg, fields.get("optimizer", OptimizerConfig()), clip_grad_given, source)
    model, recompute = _recompute(cfg, fields["model"], source)
    precision, json_precision = _precision(cfg, fields.get("precision", PrecisionConfig()))
    parallel, hierarchy_from_json = _zero_hierarchy(cfg, parallel)
    settings = dataclasses.replace(settings, zero_stage_from_json=stage_from_json,
                                   hierarchy_from_json=hierarchy_from_json, precision_from_json=json_precision,
                                   recompute_from_json=recompute)
    return dict(fields, model=model, parallel=parallel, optimizer=optimizer, precision=precision, deepspeed=settings)


def _clipping(cfg: dict, o: OptimizerConfig, clip_grad_given: bool, source: str) -> OptimizerConfig:
    """Without --clip-grad the JSON's gradient_clipping is the run's, as upstream where DeepSpeed clips from the JSON
    (our own clip paths, e.g. the pipeline's in fp32, read it from the config)."""
    clip = cfg.get("gradient_clipping")
    if clip_grad_given or not isinstance(clip, int | float) or isinstance(clip, bool):
        return o
    if clip < 0:
        raise ConfigError(f"{source}: gradient_clipping={clip} must be >= 0 (0 disables clipping)")
    return dataclasses.replace(o, clip_grad=float(clip))


def _recompute(cfg: dict, m: ModelConfig, source: str) -> tuple[ModelConfig, tuple[str, ...]]:
    """DeepSpeed's activation-checkpointing keys, honoured through our own RNG-exact recompute:
    ``pipeline.activation_checkpoint_interval`` > 0 means full recompute; a true ``activation_checkpointing`` key
    turns on what DeepSpeed's checkpointing does with it (megatron/core/tensor_parallel/recompute.py), joined with
    the flags (upstream's ``deepspeed.checkpointing.configure`` overwrote them with the flags' defaults). Returns the
    model and the keys that turned an option on."""
    interval = int(cfg.get("pipeline", {}).get("activation_checkpoint_interval", 0) or 0)
    if interval > 0:
        if m.recompute_granularity == "selective":
            raise ConfigError(f"{source} sets pipeline.activation_checkpoint_interval={interval} (full recompute) "
                              "but --recompute-granularity is selective: drop one")
        m = dataclasses.replace(m, recompute_granularity="full")
    ac = cfg.get("activation_checkpointing") or {}
    turned_on = {key: attr for key, attr, _ in ds_json.ACTIVATION_CHECKPOINTING
                 if ac.get(key) and not getattr(m, attr)}
    return dataclasses.replace(m, **dict.fromkeys(turned_on.values(), True)), tuple(turned_on)


def _precision(cfg: dict, prec: PrecisionConfig) -> tuple[PrecisionConfig, str | None]:
    """Under --deepspeed upstream's engine takes the dtype from the JSON alone (its flags only shape Megatron's own
    optimizer, unused there): a JSON that enables fp16/bf16 with neither flag given trains in it, so this run does."""
    enabled = [n for n in ("fp16", "bf16") if bool(cfg.get(n, {}).get("enabled", False))]
    if not enabled or prec.fp16 or prec.bf16:
        return prec, None
    return dataclasses.replace(prec, **{enabled[0]: True}), enabled[0]


def _zero_hierarchy(cfg: dict, p: ParallelConfig) -> tuple[ParallelConfig, bool]:
    """Hierarchical ZeRO from the ``megatron_frontier`` section (megatron/core/hierarchical_zero/config.py): its tiers
    without --zero-hierarchy, its weights tier without --zero-hierarchy-weights, its int8 with the flag's. Returns
    the layout and whether the JSON turned the mode on."""
    section = cfg.get(OWN_SECTION) or {}
    if not isinstance(section, dict):
        return p, False  # build_ds_config refuses it in its words
    levels = section.get("zero_hierarchy")
    if isinstance(levels, list):
        levels = ",".join(map(str, levels))
    from_json = bool(levels) and isinstance(levels, str) and not p.zero_hierarchy
    if not (from_json or p.zero_hierarchy):
        return p, False
    changes = {"zero_hierarchy": levels} if from_json else {}
    if section.get("zero_hierarchy_weights") and not p.zero_hierarchy_weights:
        changes["zero_hierarchy_weights"] = section["zero_hierarchy_weights"]
    if section.get("zero_hierarchy_int8"):
        changes["zero_hierarchy_int8"] = True
    return dataclasses.replace(p, **changes), from_json
