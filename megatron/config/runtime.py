"""How the run meets its processes and its end: rendezvous and collective timeouts, run control (exit interval,
wall time, kill switch, persistent NaN), the dead-rank watchdog, and the DeepSpeed JSON the engine starts from."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass
class RuntimeConfig:
    distributed_backend: str | None = None
    """None: the accelerator's own (gloo on CPU, nccl = RCCL on ROCm)."""
    distributed_timeout_minutes: float = 10.0
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_timeout_secs: float = 60.0
    allow_tp_across_nodes: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    job_end_margin_secs: float | None = None
    """Under Slurm: kept free beyond the next step and a save before the job's end (megatron/training/deadline.py);
    None: max(2 step times, 20% of the predicted save, 15 s)."""
    kill_switch_file: str | None = None
    max_nonfinite_loss_iters: int = 3
    watchdog_timeout_secs: float = 60.0
    """0 disables the watchdog."""

    def validate(self) -> RuntimeConfig:
        check_fields(self, {f: "--" + f.replace("_", "-") for f in (
            "distributed_timeout_minutes", "master_port", "rendezvous_timeout_secs", "exit_interval",
            "exit_duration_in_mins", "job_end_margin_secs", "max_nonfinite_loss_iters", "watchdog_timeout_secs")})
        if self.distributed_backend not in (None, "nccl", "gloo", "ccl", "mpi"):
            raise ConfigError(f"--distributed-backend {self.distributed_backend!r}: choose nccl, gloo, ccl or mpi")
        return self


@dataclass
class DeepSpeedSettings:
    """The DeepSpeed JSON the engine's config starts from (megatron/engine.py build_ds_config fills and checks it)."""

    config: str | None = None
    """--deepspeed_config PATH; None: the template for --zero-stage and the precision (deepspeed_configs/)."""
    zero_stage_given: bool = True
    """--zero-stage was on the command line (otherwise the JSON's stage wins, as upstream)."""
    clip_grad_given: bool = True
    """--clip-grad was on the command line (otherwise the JSON's gradient_clipping wins, as upstream)."""
