"""The valid range of every numeric setting, as data, in one place: the parser checks each numeric flag against it
right after parsing and the config dataclasses check their fields against the same rows (``check_fields``), so the
two can never disagree. A value out of range is one line naming the flag and its range, before anything is built.

``Bound(lo, hi, special, open)``: ``lo``/``hi`` inclusive (None: unbounded) unless ``open`` names the end as
exclusive ("lo", "hi" or "lo,hi"); ``special``: values outside the range with their documented meaning (e.g. 0
disables). Maxima marked "sanity" are far above anything that fits Frontier (9,408 nodes x 8 GCDs of 64 GB):
they turn a typo (an extra digit, a value for another flag) into a one-line error instead of an out-of-memory
crash minutes later. Relations between flags (heads divide hidden, TP x PP divides the world, ...) stay in the
config dataclasses' ``validate`` (megatron/config/).

tests/unit/test_flag_bounds.py tries every int/float flag of ``build_parser()`` with 0, -1 and 10**12 and fails
for a flag without an entry here: a new numeric flag needs its row.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from megatron.errors import ConfigError


class Bound(NamedTuple):
    lo: float | None
    hi: float | None
    special: dict | None = None
    open: str = ""

    def allows(self, v) -> bool:
        if self.special and v in self.special:
            return True
        lo_ok = self.lo is None or (v > self.lo if "lo" in self.open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if "hi" in self.open else v <= self.hi)
        return lo_ok and hi_ok

    def describe(self) -> str:
        lo = "" if self.lo is None else f"{_num(self.lo)} {'<' if 'lo' in self.open else '<='} "
        hi = "" if self.hi is None else f" {'<' if 'hi' in self.open else '<='} {_num(self.hi)}"
        text = f"{lo}value{hi}" if lo or hi else "any value"
        if self.special:
            text += "; " + "; ".join(f"{_num(k)} {m}" for k, m in self.special.items())
        return text


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x:,}".replace(",", "_") if abs(x) >= 10**5 else str(x)


SIZE = 2**20          # sanity cap of a model dimension
ITERS = None          # iteration counts: any positive number is a valid (if long) run
WEEK_MIN, WEEK_S = 7 * 24 * 60, 7 * 24 * 3600

BOUNDS: dict[str, Bound] = {
    # parallelism
    "tensor_model_parallel_size": Bound(1, 2**16),                     # sanity; divides the world (ParallelConfig)
    "pipeline_model_parallel_size": Bound(1, 2**16),                   # sanity; <= --num-layers (ParallelConfig)
    "num_layers_per_virtual_pipeline_stage": Bound(1, SIZE),           # divides --num-layers / PP (RunConfig)
    "virtual_pipeline_model_parallel_size": Bound(1, SIZE),            # divides --num-layers / PP (configure)
    "distributed_timeout_minutes": Bound(0, WEEK_MIN, open="lo"),      # timedelta and gloo need a finite timeout
    "local_rank": Bound(0, 2**16, {-1: "means unset (the launcher's environment decides)"}),
    # model
    "num_layers": Bound(1, 2**14),
    "hidden_size": Bound(1, SIZE),
    "ffn_hidden_size": Bound(1, 4 * SIZE),                             # 0 would build a model without an MLP
    "num_attention_heads": Bound(1, 2**14),
    "num_key_value_heads": Bound(1, 2**14),
    "seq_length": Bound(1, 2**24),
    "max_position_embeddings": Bound(1, 2**24),
    "make_vocab_size_divisible_by": Bound(1, 2**16),
    "layernorm_epsilon": Bound(0, 1, open="lo"),
    "rotary_base": Bound(1, None, open="lo"),                           # base^(-2i/d) must fall with i
    "hidden_dropout": Bound(0, 1, open="hi"),                          # 1 would zero every activation
    "attention_dropout": Bound(0, 1, open="hi"),
    "init_method_std": Bound(0, 1, open="lo"),
    "recompute_num_layers": Bound(1, 2**14),
    # batch, optimiser, schedule
    "micro_batch_size": Bound(1, 2**16),
    "global_batch_size": Bound(1, 2**26),
    "train_iters": Bound(1, ITERS),
    "eval_interval": Bound(1, ITERS),
    "eval_iters": Bound(0, ITERS),                                     # 0: no evaluation
    "lr": Bound(0, None, open="lo"),              # a diverging lr is caught by --max-nonfinite-loss-iters (tested)
    "min_lr": Bound(0, None),
    "lr_warmup_iters": Bound(0, ITERS),
    "lr_warmup_fraction": Bound(0, 1),
    "lr_decay_iters": Bound(1, ITERS),
    "weight_decay": Bound(0, 1),                                       # AdamW scales weights by 1 - lr * wd
    "start_weight_decay": Bound(0, 1),
    "profile_ranks": Bound(0, 2**20),                                  # rank ids (a rank above the world: none)
    "end_weight_decay": Bound(0, 1),
    "clip_grad": Bound(0, None, {0: "disables clipping"}, open="lo"),
    "adam_beta1": Bound(0, 1, open="hi"),
    "adam_beta2": Bound(0, 1, open="hi"),
    "adam_eps": Bound(0, 1, open="lo"),
    "seed": Bound(0, 2**32 - 1),                                       # numpy's seed range
    # precision
    "initial_loss_scale": Bound(0, 2.0**64, open="lo"),
    "min_loss_scale": Bound(0, 2.0**64, open="lo"),
    "loss_scale_window": Bound(1, ITERS),
    "hysteresis": Bound(1, ITERS),
    # logging
    "log_interval": Bound(1, ITERS),
    "peak_tflops": Bound(0, 10**6, open="lo"),                         # sanity: an MI250X GCD peaks at 191.5
    # DeepSpeed, data, dry run
    "zero_stage": Bound(0, 3),
    "vocab_size": Bound(1, 2**26),
    "num_workers": Bound(0, 1024),
    "world_size": Bound(1, 2**20),                                     # sanity: Frontier has 75,264 GCDs
    "nodes": Bound(1, 2**17),
    # checkpointing, exits, faults
    "save_interval": Bound(1, ITERS),
    "keep_last_n_checkpoints": Bound(1, None),
    "exit_interval": Bound(1, ITERS),
    "exit_duration_in_mins": Bound(0, None, open="lo"),
    "job_end_margin_secs": Bound(0, WEEK_S),
    "max_nonfinite_loss_iters": Bound(1, ITERS),
    "watchdog_timeout_secs": Bound(0, WEEK_S, {0: "disables the watchdog"}, open="lo"),
    "hang_timeout": Bound(0, WEEK_S, {0: "disables hang detection"}, open="lo"),  # < the collective timeout
    "hang_timeout_save": Bound(0, WEEK_S, open="lo"),
    "hang_timeout_startup": Bound(0, WEEK_S, open="lo"),
    "straggler_interval": Bound(1, ITERS, {0: "disables straggler reports"}),
    "straggler_factor": Bound(1, 1000, open="lo"),                    # 1 would name half of a healthy job
    "straggler_reports": Bound(1, 10**6),
    # flags added with the upstream-compatibility work
    "ds_sequence_parallel_size": Bound(1, 2**16),                     # sanity; divides the world and the heads
    "master_port": Bound(1, 65535),
    "rendezvous_timeout_secs": Bound(0, WEEK_S, open="lo"),
    "encoder_num_layers": Bound(1, 2**14),                             # = --num-layers
    "encoder_seq_length": Bound(1, 2**24),                             # = --seq-length
    "rotary_percent": Bound(0, 1, open="lo"),                          # the fraction of each head that rotates
    "checkpoint_num_layers": Bound(1, 2**14),
    "train_samples": Bound(1, ITERS),
    "train_tokens": Bound(1, ITERS),
    "lr_warmup_samples": Bound(0, ITERS),
    "lr_decay_samples": Bound(1, ITERS),
    "lr_warmup_tokens": Bound(0, ITERS),
    "lr_decay_tokens": Bound(1, ITERS),
    "rampup_batch_size": Bound(1, ITERS),                              # START, INCR, SAMPLES: each >= 1
    "sgd_momentum": Bound(0, 1, open="hi"),
    "loss_scale": Bound(0, 2.0**64, open="lo"),                        # a static fp16 loss scale
    "tensorboard_log_interval": Bound(1, ITERS),
    "tensorboard_queue_size": Bound(1, 2**31),
    "timing_log_level": Bound(0, 2),
    # mixture of experts (megatron/config/moe.py)
    "num_experts": Bound(1, 2**16),                                    # sanity; 1 = a dense layer
    "expert_interval": Bound(1, 2**14),                                # <= --num-layers for any MoE layer
    "topk": Bound(1, 2**16),                                           # <= the experts (MoEConfig)
    "moe_train_capacity_factor": Bound(0, None, open="lo"),            # 0 would give every expert no slot
    "moe_eval_capacity_factor": Bound(0, None, open="lo"),
    "moe_min_capacity": Bound(0, None),
    "moe_loss_coeff": Bound(0, None),                                  # 0: the balancing loss is only logged
    "moe_expert_parallel_size": Bound(1, 2**16),                       # sanity; divides DP and the experts
}


def out_of_range(flag: str, value, name: str | None = None) -> str | None:
    """The one-line complaint about ``value`` for the setting ``name`` (default: the flag's own name), or None
    when its row allows it (or it has none, or the value is unset)."""
    bound = BOUNDS.get(name or flag.lstrip("-").replace("-", "_"))
    values = value if isinstance(value, list | tuple) else [value]  # nargs flags (--rampup-batch-size): each value
    bad = next((v for v in values if v is not None and bound is not None and not bound.allows(v)), None)
    if bad is None:
        return None
    return f"{flag} {_num(bad)}: out of range; valid: {bound.describe()}"


def check_fields(obj, fields: dict[str, str]) -> None:
    """Check config fields against their rows. ``fields``: field name -> (flag, or "flag=row" when the row has
    another name than the field, e.g. ``"--checkpoint-num-layers=checkpoint_num_layers"``)."""
    for field, flag in fields.items():
        flag, _, row = flag.partition("=")
        msg = out_of_range(flag, getattr(obj, field), row or None)
        if msg:
            raise ConfigError(msg)


def numeric_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Our numeric flags; upstream's flags that we only accept as no-ops or refuse (megatron/compat/flags.py) are
    classed there, not here."""
    return [a for a in parser._actions if a.type in (int, float) and not a.dest.startswith("upstream__")]


def check_bounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise one ConfigError for the first numeric flag outside its range (flags without a row pass: a tool's
    own flags)."""
    for action in numeric_actions(parser):
        flag = max(action.option_strings, key=lambda s: (s.startswith("--"), -len(s)))
        flag = next((s for s in action.option_strings if s.replace("-", "_").strip("_") == action.dest), flag)
        msg = out_of_range(flag, getattr(args, action.dest, None), action.dest)
        if msg:
            raise ConfigError(msg)
