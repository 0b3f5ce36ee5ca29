"""How the run meets its processes and its end: rendezvous and collective timeouts, run control (exit interval,
wall time, kill switch, persistent NaN), the watchdog (dead and stuck ranks), straggler reports, the memory check
before the model is built, and the DeepSpeed JSON the engine starts from."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields


@dataclass(frozen=True)
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
    """Under Slurm: kept free beyond the next step and a save before the job's end (megatron/resilience/deadline.py);
    None: max(2 step times, 20% of the predicted save, 15 s)."""
    kill_switch_file: str | None = None
    max_nonfinite_loss_iters: int = 3
    watchdog_timeout_secs: float = 60.0
    """0 disables the watchdog (dead ranks and stuck ranks alike)."""
    hang_timeout: float | None = None
    """--hang-timeout: seconds without any rank moving (phase or collective) before the hang verdict. None: automatic
    (5 x the slowest recent step, at least 30 s, below the collective timeout); 0: no hang detection."""
    hang_timeout_save: float | None = None
    """--hang-timeout-save: the allowance while saving a checkpoint (None: the collective timeout)."""
    hang_timeout_startup: float | None = None
    """--hang-timeout-startup: the allowance while building, loading and for the first iterations (compile, warm-up);
    None: the collective timeout."""
    straggler_interval: int | None = None
    """--straggler-interval: iterations between straggler reports (one small all-gather). None: automatic (100, or
    more when the all-gather would cost 0.5% of the steps); 0: off."""
    straggler_factor: float = 1.5
    """A rank whose own work per iteration (data, forward, backward, optimizer; not its waits) exceeds this x the
    median in ``straggler_reports`` reports in a row is named a straggler, once."""
    straggler_reports: int = 3
    skip_memory_check: bool = False
    """--skip-memory-check: build the model even when the memory model says it cannot fit."""

    @property
    def collective_timeout_s(self) -> float:
        return 60.0 * self.distributed_timeout_minutes

    def validate(self) -> RuntimeConfig:
        check_fields(self, {f: "--" + f.replace("_", "-") for f in (
            "distributed_timeout_minutes", "master_port", "rendezvous_timeout_secs", "exit_interval",
            "exit_duration_in_mins", "job_end_margin_secs", "max_nonfinite_loss_iters", "watchdog_timeout_secs",
            "hang_timeout",
            "hang_timeout_save", "hang_timeout_startup", "straggler_interval", "straggler_factor",
            "straggler_reports")})
        if self.distributed_backend not in (None, "nccl", "gloo", "ccl", "mpi"):
            raise ConfigError(f"--distributed-backend {self.distributed_backend!r}: choose nccl, gloo, ccl or mpi")
        if self.hang_timeout and self.hang_timeout >= self.collective_timeout_s:
            raise ConfigError(f"--hang-timeout {self.hang_timeout:g}: must be below the collective timeout "
                              f"(--distributed-timeout-minutes {self.distributed_timeout_minutes:g} = "
                              f"{self.collective_timeout_s:g} s), or the collectives time out first; lower it or "
                              "raise --distributed-timeout-minutes")
        return self


@dataclass(frozen=True)
class DeepSpeedSettings:
    """A user's DeepSpeed JSON as read, and what it decided for the run (megatron/arguments/deepspeed_json.py merges
    it into the flags' settings before validation; megatron/engine.py build_ds_config fills and checks the rest)."""

    config: str | None = None
    """--deepspeed_config PATH; None: the template for --zero-stage and the precision (deepspeed_configs/)."""
    user_json: str | None = None
    """The JSON object read from ``config``, as text (immutable: each build_ds_config parses its own copy)."""
    zero_stage_from_json: bool = False
    """The ZeRO stage is the JSON's zero_optimization.stage (no --zero-stage, as upstream)."""
    hierarchy_from_json: bool = False
    """Hierarchical ZeRO is on from the JSON's megatron_frontier section, not --zero-hierarchy."""
    precision_from_json: str | None = None
    """'fp16' or 'bf16': the JSON enables it and neither --fp16 nor --bf16 is given (upstream's engine trains in it)."""
    recompute_from_json: tuple[str, ...] = ()
    """activation_checkpointing keys that are true in the JSON and turned on a recompute option the flags left off."""

    @property
    def source(self) -> str:
        """How messages name the JSON the ds_config starts from."""
        return f"--deepspeed_config {self.config}" if self.config else "template"
