"""--use-checkpoint-args: the model's shape taken from the --load checkpoint, as upstream's
load_args_from_checkpoint, from every format --load reads (ours, a full state, upstream's Megatron-DeepSpeed and
Megatron checkpoints; upstream reads only the last). A shape flag given that disagrees is named, all in one line."""

from __future__ import annotations

import argparse
import json
import os

from megatron.config import CheckpointSettings, named_model
from megatron.errors import ConfigError, launcher_rank

MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_key_value_heads": "--num-key-value-heads",
    "seq_length": "--seq-length", "max_position_embeddings": "--max-position-embeddings",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by", "normalization": "--normalization",
    "layernorm_epsilon": "--layernorm-epsilon", "swiglu": "--swiglu", "openai_gelu": "--openai-gelu",
    "position_embedding_type": "--position-embedding-type", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear", "apply_layernorm_1p": "--apply-layernorm-1p",
    "squared_relu": "--squared-relu",
    "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
}
"""ModelConfig fields taken from the checkpoint, and the flag that sets each: upstream's list (its _set_arg calls)
and what else changes a weight's shape or the arithmetic here. The vocabulary stays the tokenizer's (the data
flags), checked against the checkpoint's as on every resume."""
MOE_FLAGS = {"num_experts": "--num-experts", "expert_interval": "--expert-interval", "topk": "--topk",
             "mlp_type": "--mlp-type", "enable_expert_tensor_parallelism": "--enable-expert-tensor-parallelism"}
"""MoEConfig fields taken: which layers have experts, how many, how they are gated and split."""
LAYOUT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                "pipeline_model_parallel_size": "--pipeline-model-parallel-size"}
"""Taken from a checkpoint of ours only (as upstream forces them): it resumes at its own TP and PP; a full state
and upstream's checkpoints load at any layout, so the command line's stands."""
# The fields --model-size does not set: the command line's flags fill them (model_config_from_args's ``common``).
_NOT_NAMED = ("make_vocab_size_divisible_by", "layernorm_epsilon", "rotary_base", "rotary_percent")
_DEST = {"add_bias_linear": "disable_bias_linear"}


def take_checkpoint_args(args: argparse.Namespace, given: set[str]) -> None:
    """Set every model flag of ``args`` not in ``given`` (the dests the command line gives) from the --load
    checkpoint; a given one that disagrees with it is a ConfigError naming each (one line). Says on rank 0 what was
    taken."""
    if not args.load:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint whose model to take), as upstream")
    model, layout, where = checkpoint_record(CheckpointSettings(
        load=args.load, load_tag=args.load_tag, universal_checkpoint=args.universal_checkpoint,
        trust_checkpoint=args.trust_checkpoint))
    named = named_model(args.model_size) if "model_size" in given else None
    wanted = [(f, flag, model[f]) for f, flag in MODEL_FLAGS.items() if f in model]
    moe = model.get("moe") or {}
    wanted += [(f, flag, moe[f]) for f, flag in MOE_FLAGS.items() if f in moe]
    wanted += [(f, flag, layout[f]) for f, flag in LAYOUT_FLAGS.items() if f in layout]
    disagree, taken = [], []
    for field, flag, value in wanted:
        if _given(field, given):
            if _same(_command_line(args, field), value):
                continue
            disagree.append(f"{flag} given, the checkpoint was trained without it" if isinstance(value, bool) else
                            f"{flag} {_shown(_command_line(args, field))} given, the checkpoint has {_shown(value)}")
        elif named is not None and field in MODEL_FLAGS and field not in _NOT_NAMED and \
                not _same(getattr(named, field), value):
            disagree.append(f"--model-size {args.model_size} gives {flag} {_shown(getattr(named, field))}, the "
                            f"checkpoint has {_shown(value)}")
        elif not _same(_command_line(args, field), value):
            _set(args, field, value)
            taken.append(_as_flag(flag, value))
    if disagree:
        raise ConfigError(f"--use-checkpoint-args: {'; '.join(disagree)} ({where}): drop these flags to take the "
                          "checkpoint's, or load a checkpoint of this model")
    if launcher_rank() == 0:
        print(f"> --use-checkpoint-args: the model of {where}: {' '.join(taken) or 'as the flags give it'}",
              flush=True)


def checkpoint_record(settings: CheckpointSettings) -> tuple[dict, dict, str]:
    """(model fields under ModelConfig's names, with the MoEConfig's under 'moe'; TP and PP under ParallelConfig's
    names (a checkpoint of ours only); the checkpoint's directory) of what ``settings.load`` holds."""
    # The checkpointing package brings torch: imported only when the flag is given, so that a refused flag or
    # --help on a login node stays fast.
    from megatron.checkpointing import classify_load
    from megatron.checkpointing.full_state.files import FULL_STATE_META
    from megatron.checkpointing.live.markers import read_meta
    from megatron.checkpointing.upstream import first_args
    from megatron.checkpointing.upstream.mapping import model_fields

    target = classify_load(settings)
    if target.kind in ("none", "empty"):
        raise ConfigError(f"--use-checkpoint-args: --load {settings.load} holds no checkpoint to take the model "
                          "from; point --load at a checkpoint, or give the model flags and drop the flag")
    if target.kind == "ours":
        run = read_meta(target.path).get("run", {})
        return run.get("model", {}), {k: v for k, v in run.get("parallel", {}).items() if k in LAYOUT_FLAGS}, \
            target.path
    if target.kind == "full_state":
        with open(os.path.join(target.path, FULL_STATE_META)) as f:
            return json.load(f).get("model", {}), {}, target.path
    a = first_args(target.found, settings.trust_checkpoint)
    model = model_fields(a)
    model.update({k: a[k] for k in ("seq_length", "rotary_percent") if a.get(k) is not None})
    return model, {}, target.found.path


def _given(field: str, given: set[str]) -> bool:
    if field == "position_embedding_type":  # either flag sets it
        return bool({"position_embedding_type", "use_rotary_position_embeddings"} & given)
    return _DEST.get(field, field) in given


def _command_line(args: argparse.Namespace, field: str):
    """The field's value as the parsed flags give it (before the model config resolves its defaults)."""
    if field == "position_embedding_type":
        return args.position_embedding_type or ("rope" if args.use_rotary_position_embeddings else "learned_absolute")
    if field == "add_bias_linear":
        return not args.disable_bias_linear
    if field == "num_experts":
        return tuple(args.num_experts)
    value = getattr(args, field)
    return bool(value) if field in ("swiglu", "openai_gelu", "untie_embeddings_and_output_weights") else value


def _set(args: argparse.Namespace, field: str, value) -> None:
    if field == "add_bias_linear":
        args.disable_bias_linear = not value
    elif field == "num_experts":
        args.num_experts = list(value)
    else:
        setattr(args, field, value)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return a is not None and b is not None and list(a) == list(b)
    return a == b


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return "(unset)" if value is None else str(value)


def _as_flag(flag: str, value) -> str:
    """A taken value as its flag: a switch is taken only when on (--disable-bias-linear: when the bias is off)."""
    return flag if isinstance(value, bool) else f"{flag} {_shown(value)}"
