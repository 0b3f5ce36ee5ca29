"""Megatron-DeepSpeed's learning-rate schedule, step for step.

Upstream (megatron/optimizer_param_scheduler.py at 4efb479d) counts its position in *samples*: every optimizer
step adds the step's global batch (num_microbatches x micro-batch x DP), whether the run is iteration-, sample-
or token-based; the token count it reads is the trainer's consumed tokens *before* the step (its
``args.consumed_train_tokens`` is raised after ``train_step`` returns). The schedule is first applied at
construction (position 0), so the first update under warmup uses lr 0, and the lr the log prints after
iteration k is the one iteration k+1 applies.

``schedule_shape`` turns the flags into upstream's lengths (``get_optimizer_param_scheduler``) and refuses in one
line what upstream would only assert on (or crash on) once the model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.errors import CheckpointError, ConfigError

STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass
class ScheduleShape:
    """Upstream's scheduler arguments. Steps are samples; ``warmup_steps`` is a float with --lr-warmup-fraction,
    as upstream's (fraction x decay samples, never rounded)."""

    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: float
    style: str
    warmup_tokens: int | None = None
    decay_tokens: int | None = None
    # Weight decay from start_wd to end_wd over wd_incr_steps samples (upstream's --start-weight-decay,
    # --end-weight-decay, --weight-decay-incr-style; constant: both are --weight-decay). None: the scheduler
    # leaves the groups' weight decay as the optimizer has it (a shape built without the flags).
    start_wd: float | None = None
    end_wd: float | None = None
    wd_incr_steps: int = 1
    wd_incr_style: str = "constant"


def schedule_shape(o, t) -> ScheduleShape:
    """``o``: OptimizerConfig, ``t``: TrainingConfig (with ``train_iters`` already derived for --train-samples).
    The global batch here is the final one (--global-batch-size), also under --rampup-batch-size, as upstream."""
    gbs = t.global_batch_size
    if t.train_samples is None:  # iteration-based
        decay = (t.train_iters if o.lr_decay_iters is None else o.lr_decay_iters) * gbs
        warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else o.lr_warmup_iters * gbs
        wd_incr = t.train_iters * gbs
    else:
        decay = t.train_samples if o.lr_decay_samples is None else o.lr_decay_samples
        warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else o.lr_warmup_samples
        wd_incr = t.train_samples
    start_wd, end_wd = o.weight_decay_range()
    return ScheduleShape(float(o.lr), o.min_lr, warmup, decay, o.lr_decay_style, o.lr_warmup_tokens,
                         o.lr_decay_tokens, start_wd, end_wd, wd_incr, o.weight_decay_incr_style)


def _unit(t) -> tuple[str, int]:
    return ("iterations", t.global_batch_size) if t.train_samples is None else ("samples", 1)


def check_shape(shape: ScheduleShape, t, step_samples) -> None:
    """Upstream's assertions, as one-line ConfigErrors. ``step_samples``: the samples position after each of
    the first steps (an iterable, e.g. ``micro_batch_plan(t).positions()``), to prove that a token-based decay
    after a step-counted warmup gets its start (see below)."""
    unit, per = _unit(t)
    decay_flag = "--lr-decay-iters (default --train-iters)" if unit == "iterations" else \
        "--lr-decay-samples (default --train-samples)"
    if shape.style not in STYLES:
        raise ConfigError(f"--lr-decay-style {shape.style!r}: choose one of {', '.join(STYLES)}")
    if shape.min_lr < 0 or shape.min_lr > shape.max_lr:
        raise ConfigError(f"--min-lr {shape.min_lr:g} must be in [0, --lr {shape.max_lr:g}]")
    if shape.decay_steps <= 0:
        raise ConfigError(f"{decay_flag} gives a decay length of {shape.decay_steps / per:g} {unit}: it must be > 0")
    if shape.warmup_steps >= shape.decay_steps:
        raise ConfigError(f"the lr warmup ({shape.warmup_steps / per:g} {unit}) must be shorter than the decay "
                          f"length ({shape.decay_steps / per:g} {unit}, {decay_flag}): shorten the warmup or "
                          "lengthen the decay")
    if shape.decay_tokens is None or shape.warmup_tokens is not None:
        return
    if shape.style in ("constant", "inverse-square-root"):
        return  # these never read the warmup's token count
    # Token-based decay after a step-counted warmup: upstream records the token count at the step whose position
    # equals the warmup length exactly, and starts the decay from it; without such a step it has no start.
    if shape.warmup_steps <= 0:
        raise ConfigError(f"--lr-decay-tokens {shape.decay_tokens} with --lr-decay-style {shape.style} needs a "
                          "warmup: give --lr-warmup-tokens (or a warmup in iterations/samples)")
    for pos in step_samples:
        if pos >= shape.warmup_steps:
            if pos == shape.warmup_steps:
                return
            break
    raise ConfigError(f"--lr-decay-tokens with a warmup of {shape.warmup_steps / per:g} {unit}: no optimizer step "
                      "ends exactly at the warmup's end, so the decay has no start (upstream fails there); give "
                      "--lr-warmup-tokens, or a warmup that is a whole number of global batches")


# The fields the flags set and a checkpoint also records: (state key, ScheduleShape field, name in messages).
_SHAPE_KEYS = (("max_lr", "max_lr", "--lr"), ("min_lr", "min_lr", "--min-lr"),
               ("lr_warmup_steps", "warmup_steps", "warmup length (samples)"),
               ("lr_warmup_tokens", "warmup_tokens", "--lr-warmup-tokens"),
               ("lr_decay_steps", "decay_steps", "decay length (samples)"),
               ("lr_decay_tokens", "decay_tokens", "--lr-decay-tokens"),
               ("lr_decay_style", "style", "--lr-decay-style"))
# Upstream's weight-decay keys, compared only where a state has them (ours before they existed has not). The
# length is compared only when it is used: a constant decay never reads it (upstream would still refuse a resume
# with another --train-iters there).
_WD_KEYS = (("start_wd", "start_wd", "--start-weight-decay (or --weight-decay)"),
            ("end_wd", "end_wd", "--end-weight-decay (or --weight-decay)"),
            ("wd_incr_style", "wd_incr_style", "--weight-decay-incr-style"),
            ("wd_incr_steps", "wd_incr_steps", "weight-decay length (samples: --train-iters x global batch)"))
# Older spellings upstream still reads (first found wins), and ours before the samples-based schedule.
_ALIASES = {"max_lr": ("start_lr", "max_lr"), "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "lr_warmup_tokens": ("warmup_tokens", "lr_warmup_tokens"),
            "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
            "lr_decay_tokens": ("decay_tokens", "lr_decay_tokens"), "lr_decay_style": ("decay_style", "lr_decay_style")}


def is_legacy_state(sd: dict) -> bool:
    """Our schedule before it counted samples: {num_steps (iterations), max_lr, min_lr, warmup_steps,
    decay_steps, style}, or a full-state checkpoint's bare {num_steps}."""
    return "style" in sd or set(sd) == {"num_steps"}


def saved_shape_value(sd: dict, key: str):
    for name in _ALIASES.get(key, (key,)):
        if name in sd:
            return sd[name]
    return None


def shape_mismatches(shape: ScheduleShape, sd: dict) -> list[str]:
    """Fields where the flags' schedule and a saved (upstream-format) state differ, each as 'NAME SAVED in the
    checkpoint, MINE from the flags'."""
    out = []
    for key, attr, name in _SHAPE_KEYS:
        mine, saved = getattr(shape, attr), saved_shape_value(sd, key)
        if key == "lr_warmup_tokens" and mine is None and shape.decay_tokens is not None:
            # Recorded by the schedule itself at the end of a step-counted warmup, not set by a flag (upstream
            # compares it with the flag's None and fails to resume such a run without one of the two flags).
            continue
        if mine != saved:
            out.append(f"{name} {saved} in the checkpoint, {mine} from the flags")
    if sd.get("start_wd") is not None and shape.start_wd is not None:
        for key, attr, name in _WD_KEYS:
            if key == "wd_incr_steps" and shape.wd_incr_style == "constant" == sd.get("wd_incr_style"):
                continue
            mine, saved = getattr(shape, attr), sd[key]
            if mine != saved:
                out.append(f"{name} {saved} in the checkpoint, {mine} from the flags")
    return out


def mismatch_message(where: str, mismatches: list[str]) -> str:
    return (f"--load {where}: the LR schedule differs from the checkpoint's ({'; '.join(mismatches)}): pass "
            "--override-opt_param-scheduler to use the flags' schedule, or --use-checkpoint-opt_param-scheduler "
            "to keep the checkpoint's")


def check_resume_schedule(saved: dict | None, run, where: str) -> None:
    """Before any process group: upstream's rule for a resumed schedule (OptimizerParamScheduler.load_state_dict)
    on a checkpoint's saved state. Without --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler
    the flags must give the checkpoint's schedule (upstream asserts; here one line naming both fixes)."""
    o = run.optimizer
    if not saved or is_legacy_state(saved) or o.override_opt_param_scheduler or o.use_checkpoint_opt_param_scheduler:
        return
    mismatches = shape_mismatches(schedule_shape(o, run.training), saved)
    if mismatches:
        raise CheckpointError(mismatch_message(where, mismatches))


def check_resume_flags(override: bool, use_checkpoint: bool) -> None:
    """Where a resumed schedule's shape comes from: one of the two flags at most, as upstream."""
    if override and use_checkpoint:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are both set: "
                          "pick one (the flags' schedule or the checkpoint's)")


class OptimizerParamScheduler:
    """Upstream's scheduler: the learning rate and the weight decay of every parameter group (times the group's
    ``lr_mult`` / ``wd_mult``, as upstream's groups carry them). DeepSpeed calls
    ``step(increment=...)`` with the global batch of the step (``lr_kwargs``; the pipeline engine, which passes
    none, falls back to ``step(train_batch_size())``, the same number). The trainer keeps ``consumed_tokens``
    current, as upstream's ``args.consumed_train_tokens``."""

    def __init__(self, optimizer, shape: ScheduleShape, seq_length: int = 1, override: bool = False,
                 use_checkpoint: bool = False, legacy_samples_per_step: int = 1) -> None:
        check_resume_flags(override, use_checkpoint)
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(shape.max_lr), shape.min_lr
        self.lr_warmup_steps, self.lr_decay_steps = shape.warmup_steps, shape.decay_steps
        self.lr_warmup_tokens, self.lr_decay_tokens = shape.warmup_tokens, shape.decay_tokens
        self.lr_decay_style = shape.style
        if shape.wd_incr_style not in WD_STYLES:
            raise ConfigError(f"--weight-decay-incr-style {shape.wd_incr_style!r}: choose one of "
                              f"{', '.join(WD_STYLES)}")
        self.start_wd, self.end_wd = shape.start_wd, shape.end_wd
        self.wd_incr_steps, self.wd_incr_style = shape.wd_incr_steps, shape.wd_incr_style
        # Each group's multiplier, by position: a restored optimizer state replaces the group dicts (and one
        # written before groups carried ``wd_mult`` would otherwise decay biases and norms).
        self.wd_mults = [float(g.get("wd_mult", 1.0)) for g in optimizer.param_groups]
        self.current_wd = self.start_wd
        self.override, self.use_checkpoint = override, use_checkpoint
        self.seq_length = seq_length
        self.legacy_samples_per_step = legacy_samples_per_step
        """Samples per step of a legacy (iteration-counting) state: the saved run's global batch."""
        self.num_steps, self.num_tokens, self.consumed_tokens = 0, 0, 0
        self.engine_samples_per_sample = 1
        """> 1 where the engine counts each sample that often (the pipeline engine under Ulysses: its batch check
        counts every SP rank as a replica, and it steps the schedule by that count)."""
        self.step(0)

    @classmethod
    def from_run(cls, optimizer, run) -> OptimizerParamScheduler:
        """The schedule of a validated RunConfig (as upstream's get_optimizer_param_scheduler)."""
        o, t = run.optimizer, run.training
        return cls(optimizer, schedule_shape(o, t), run.model.seq_length, override=o.override_opt_param_scheduler,
                   use_checkpoint=o.use_checkpoint_opt_param_scheduler,
                   legacy_samples_per_step=t.global_batch_size)

    def get_lr(self) -> float:
        """The lr at the current position (upstream's formulas, in its order of cases)."""
        steps, tokens = self.num_steps, self.num_tokens
        if self.lr_warmup_tokens is None:
            if self.lr_warmup_steps > 0 and steps <= self.lr_warmup_steps:
                return self.max_lr * float(steps) / float(self.lr_warmup_steps)
        elif self.lr_warmup_tokens > 0 and tokens <= self.lr_warmup_tokens:
            return self.max_lr * float(tokens) / float(self.lr_warmup_tokens)
        if self.lr_decay_style == "constant":
            return self.max_lr
        if (steps > self.lr_decay_steps) if self.lr_decay_tokens is None else (tokens > self.lr_decay_tokens):
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            if self.lr_warmup_tokens is None:
                lr = self.max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / max(steps, 1) ** 0.5
            else:
                lr = self.max_lr * max(self.lr_warmup_tokens, 1) ** 0.5 / max(tokens, 1) ** 0.5
            return max(self.min_lr, lr)
        if self.lr_decay_tokens is None:
            ratio = float(steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        else:
            ratio = float(tokens - self.lr_warmup_tokens) / float(self.lr_decay_tokens - self.lr_warmup_tokens)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_wd(self) -> float:
        """The weight decay at the current position (upstream's get_wd)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd  # constant: start == end
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int, token_num: int | None = None) -> None:
        """Move on by ``increment`` samples; ``token_num``: the tokens consumed before this step (default: the
        trainer's count)."""
        self.num_tokens = self.consumed_tokens if token_num is None else token_num
        self.num_steps += increment // self.engine_samples_per_sample
        if (self.lr_warmup_tokens is None and self.lr_decay_tokens is not None and self.lr_warmup_steps > 0
                and self.num_steps == self.lr_warmup_steps):
            self.lr_warmup_tokens = self.num_tokens  # token-based decay starts where the step warmup ends
        self._apply(self.get_lr())

    def _apply(self, lr: float) -> None:
        self.current_wd = wd = None if self.start_wd is None else self.get_wd()
        for i, g in enumerate(self.optimizer.param_groups):
            g["lr"] = lr * g.get("lr_mult", 1.0)
            if wd is not None:
                g["wd_mult"] = mult = self.wd_mults[i] if i < len(self.wd_mults) else 1.0
                g["weight_decay"] = wd * mult

    @property
    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def apply_schedule(self) -> None:
        """Write the schedule's lr and weight decay for the next update into the optimizer, over whatever a
        restored optimizer state put there."""
        self._apply(self.get_lr())

    def shape(self) -> ScheduleShape:
        return ScheduleShape(self.max_lr, self.min_lr, self.lr_warmup_steps, self.lr_decay_steps,
                             self.lr_decay_style, self.lr_warmup_tokens, self.lr_decay_tokens, self.start_wd,
                             self.end_wd, self.wd_incr_steps, self.wd_incr_style)

    def state_dict(self) -> dict:
        """Upstream's keys, so either side reads the other's."""
        sd = {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.lr_warmup_steps,
              "lr_warmup_tokens": self.lr_warmup_tokens, "lr_decay_steps": self.lr_decay_steps,
              "lr_decay_tokens": self.lr_decay_tokens, "lr_decay_style": self.lr_decay_style,
              "num_steps": self.num_steps, "num_tokens": self.num_tokens}
        if self.start_wd is not None:  # a schedule built without the weight-decay flags leaves them out
            sd.update(start_wd=self.start_wd, end_wd=self.end_wd, wd_incr_style=self.wd_incr_style,
                      wd_incr_steps=self.wd_incr_steps)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if is_legacy_state(sd):
            # Counted iterations, and its shape always came from the flags: only the position carries over.
            self.num_steps = 0
            steps = int(sd["num_steps"]) * self.legacy_samples_per_step
            tokens = max(0, steps - self.legacy_samples_per_step) * self.seq_length
            self.step(steps, token_num=tokens)
            return
        mismatches = shape_mismatches(self.shape(), sd)
        if not self.override:
            if mismatches and not self.use_checkpoint:
                raise CheckpointError(mismatch_message("(checkpoint)", mismatches))
            for key, _, _ in _SHAPE_KEYS:  # upstream: the checkpoint's values (equal to the flags' unless told)
                setattr(self, key, saved_shape_value(sd, key))
            if sd.get("start_wd") is not None and self.start_wd is not None:
                for key, _, _ in _WD_KEYS:
                    setattr(self, key, sd[key])
        elif self.lr_warmup_tokens is None and self.lr_decay_tokens is not None:
            self.lr_warmup_tokens = saved_shape_value(sd, "lr_warmup_tokens")  # recorded, not a flag's value
        self.max_lr = float(self.max_lr)
        self.num_steps = 0
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        self.step(num_steps, token_num=sd.get("num_tokens", self.num_tokens))
