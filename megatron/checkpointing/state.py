"""What a checkpoint records besides weights: RNG states, the run's arguments as plain data, the checks that decide
whether a checkpoint may be resumed under the current flags, and ``Resume``: what a load hands to the loop."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from megatron.checkpointing.hierarchical_zero import check_saved_layout
from megatron.config import CheckpointSettings, RunConfig
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.errors import CheckpointError, ConfigError

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


def rng_state() -> dict:
    """This rank's RNG states as tensors and plain Python data (safe for weights_only loading)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    get_rng_tracker().set_states(state["tracker"])


def _tuples(x):
    """random.setstate wants tuples; a round trip through some serialisers gives lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def plain_args(flags: dict) -> dict:
    """The parsed flags (``RunConfig.flags``) as JSON-able data, as upstream's checkpoints keep its ``args``
    (no pickled objects in checkpoints)."""
    return {k: v for k, v in flags.items() if v is None or isinstance(v, (bool, int, float, str))}


def plain_run(run: RunConfig) -> dict:
    """The validated settings as plain data (the record of the flags is kept apart, as 'args')."""
    return {k: v for k, v in dataclasses.asdict(run).items() if k != "flags"}


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
        raise ConfigError(f"--load {where}: saved with {' and '.join(changed)}. Keep the layout, or convert it "
                          f"first: python tools/reshard_checkpoint.py --load {where} --save NEW_DIR and --load "
                          f"NEW_DIR (see {RESHARD_DOC})")
    # Engine kind, DP size and tier layout of hierarchical ZeRO shards: weights live in them too, so these hold
    # even without the optimizer.

    check_saved_layout(saved, run, where)
    if not load_optim:
        return
    # ZeRO partitions over every rank of the data-parallel dimension, DeepSpeed-Ulysses' SP ranks included.
    saved_dp = p["world_size"] // (p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"])
    now_dp = run.parallel.dp * run.parallel.sp
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
                          "keep the expert-parallel size, or convert it first: python tools/reshard_checkpoint.py "
                          f"--load {where} --save NEW_DIR and --load NEW_DIR")


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


def rng_for_rank(states: list, dp_rank: int, dp_size: int) -> dict | None:
    """The saved RNG state of this DP index, or None (with the reason) when the DP size changed."""
    if len(states) != dp_size:
        return None
    if not 0 <= dp_rank < len(states):
        raise CheckpointError(f"RNG state list has {len(states)} entries, no entry for DP rank {dp_rank}")
    return states[dp_rank]


@dataclass
class Resume:
    iteration: int = 0
    consumed_samples: int = 0
    path: str | None = None
    lr_num_steps: int = 0
    lr_state: dict | None = None
    """The LR schedule's state_dict (samples and tokens); None in checkpoints older than it (lr_num_steps then)."""
    rng: dict | None = None
    """Saved RNG states of this rank; applied by ``restore_rng`` right before the first iteration, because
    set-up work between loading and training (e.g. the peak-FLOPs probe) draws random numbers."""

    moments: tuple | None = None
    """(Adam moments by name, step) read along with the weights (an upstream checkpoint), for load_checkpoint."""

    def restore_rng(self) -> None:
        if self.rng is not None:
            set_rng_state(self.rng)
