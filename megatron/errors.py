"""User-facing errors: one line that names the flag or file and the fix, printed once per job, exit 2."""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron.progress import describe_out_of_memory, is_out_of_memory

# Where each launcher puts a process's global rank, in the order topology.discover_ranks trusts them:
# torchrun, then MPI (mpirun inside a Slurm allocation leaves every task with SLURM_PROCID=0), then Slurm.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


class MegatronError(Exception):
    """An error the user can fix. Entry points print its message on one line and exit with code 2.

    Validation errors are the same on every rank (they come from the flags and a shared file system),
    so only the job's rank 0 prints them; ``every_rank=True`` marks one that a rank may hit alone.
    """

    exit_code = 2
    every_rank = False

    def __init__(self, message: str = "", *, every_rank: bool | None = None) -> None:
        super().__init__(message)
        if every_rank is not None:
            self.every_rank = every_rank


class ConfigError(MegatronError):
    """An impossible or inconsistent set of flags / ds_config keys."""


class DataError(MegatronError):
    """A missing, corrupt or mismatched data file."""


class CheckpointError(MegatronError):
    """A missing, corrupt or incompatible checkpoint."""


class TrainingError(MegatronError):
    """Training cannot go on (e.g. a persistent NaN/Inf loss)."""


class DistributedError(MegatronError):
    """A lost peer, a collective timeout, or a rank layout that cannot be discovered."""


OUT_OF_MEMORY_EXIT_CODE = 3
"""An allocation failed (host or device): a fault of the run, like the watchdog's verdicts (exit 3)."""


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank from the launcher's environment alone (no process group, no mpi4py):
    usable by the very first error. An unset or unparsable variable counts as rank 0 (a single process)."""
    env = os.environ if environ is None else environ
    for name in _RANK_VARS:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


def warn_once(message: str) -> None:
    """A warning about the job as a whole: printed by rank 0 only (stdout, with the run's log)."""
    if launcher_rank() == 0:
        print(f"> WARNING: {message}", flush=True)


def run_cli(main, argv=None) -> int:
    """Call ``main(argv)``; turn a MegatronError into one line on stderr (once per job) and its exit code
    on every rank, and an out-of-memory error (host or device) into one line naming the rank, host, GCD and phase
    (on each rank that hit it), without a traceback."""
    import sys

    try:
        rc = main(argv)
    except MegatronError as e:
        if e.every_rank or launcher_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        print(f"error: {describe_out_of_memory(e)}", file=sys.stderr, flush=True)
        return OUT_OF_MEMORY_EXIT_CODE
    return 0 if rc is None else int(rc)
