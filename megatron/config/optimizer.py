"""The optimizer, its LR and weight-decay schedule, and the numeric precision (with fp16's loss scaling)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_decay_iters: int | None = None
    weight_decay: float = 0.01
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    """constant (--weight-decay throughout), or linear / cosine from --start-weight-decay to --end-weight-decay
    over the run's samples (upstream's OptimizerParamScheduler.get_wd)."""
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"
    """'adam' (AdamW, as upstream's default FusedAdam with adam_w_mode) or 'sgd' (with ``sgd_momentum``)."""
    sgd_momentum: float = 0.9
    cpu_optimizer: bool = False
    """--cpu-optimizer: DeepSpeed's CPU Adam (AdamW mode), as upstream; also used for ZeRO-Offload JSONs."""
    cpu_torch_adam: bool = False
    """--cpu_torch_adam: with --cpu-optimizer, torch's AdamW instead of DeepSpeed's CPU Adam (as upstream)."""
    # Sample- and token-based schedule lengths and checkpoint semantics (megatron/optim/lr_schedule.py).
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None
    lr_warmup_tokens: int | None = None
    lr_decay_tokens: int | None = None
    override_opt_param_scheduler: bool = False
    """On resume, the schedule's shape comes from the flags (upstream's --override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, the schedule's shape comes from the checkpoint. Neither flag: they must agree."""

    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) of the weight decay; both --weight-decay when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        return self.start_weight_decay, self.end_weight_decay

    def _validate_weight_decay(self) -> None:
        """Upstream's rules (validate_args and the scheduler's assertions), as one line each."""
        style, start, end = self.weight_decay_incr_style, self.start_weight_decay, self.end_weight_decay
        if style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"--weight-decay-incr-style {style!r}: choose constant, linear or cosine")
        given = [f for f, v in (("--start-weight-decay", start), ("--end-weight-decay", end)) if v is not None]
        if style == "constant":
            if given:
                raise ConfigError(f"{' and '.join(given)} with --weight-decay-incr-style constant: a constant decay "
                                  "is --weight-decay; add --weight-decay-incr-style linear (or cosine) to ramp it")
            return
        missing = [f for f in ("--start-weight-decay", "--end-weight-decay") if f not in given]
        if missing:
            raise ConfigError(f"--weight-decay-incr-style {style} needs {' and '.join(missing)}")
        check_fields(self, {"start_weight_decay": "--start-weight-decay", "end_weight_decay": "--end-weight-decay"})
        if end < start:
            raise ConfigError(f"--start-weight-decay {start:g} and --end-weight-decay {end:g}: need "
                              "start <= end (the decay only increases, as upstream's)")

    def validate(self) -> None:
        """Refuse what torch's AdamW would only refuse after the model is built (a traceback, then)."""
        self._validate_weight_decay()
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose adam or sgd")
        if self.cpu_optimizer and self.optimizer != "adam":
            raise ConfigError("--cpu-optimizer with --optimizer sgd: CPU offloading is for Adam (as upstream); "
                              "drop one of them")
        if self.cpu_torch_adam and not self.cpu_optimizer:
            raise ConfigError("--cpu_torch_adam without --cpu-optimizer: add --cpu-optimizer or drop it")
        check_fields(self, {f: "--" + f.replace("_", "-") for f in (
            "lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "sgd_momentum", "clip_grad",
            "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_iters", "lr_warmup_samples", "lr_decay_samples",
            "lr_warmup_tokens", "lr_decay_tokens")})


@dataclass(frozen=True)
class PrecisionConfig:
    """The loss-scale fields are the flags as given (None: not on the command line). Under --fp16 they fill
    what the DeepSpeed JSON leaves out (megatron/engine.py); with bf16/fp32 they have no effect."""

    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None
    """--loss-scale: a static loss scale (None: dynamic)."""
    initial_loss_scale: float | None = None
    loss_scale_window: int | None = None
    hysteresis: int | None = None
    min_loss_scale: float | None = None

    def validate(self) -> None:
        check_fields(self, {f: "--" + f.replace("_", "-") for f in (
            "loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")})
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 are both set: pick one (bf16 is advised on MI250X)")

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
