"""A real MPI launch: ``mpirun -n 2 python pretrain_gpt.py ... --mock-data`` with TP=2 trains for real.

Ranks come from mpi4py (megatron/topology.py ``discover_ranks``, source "mpi"), which pretrain.py reports on rank 0
as "> ranks discovered via mpi (...)". The child environment carries no RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / Slurm variables, so neither the torchrun nor the Slurm branch of discovery can win; only
MASTER_PORT is set, to a free port (so concurrent runs do not collide on the default 29500; a port alone does not
select a launcher). The lm loss at iteration 10 must equal the torchrun TP=2 run's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.functional.cli import REPO, TINY, losses, run_pretrain
from tests.launcher import free_port

ARGS = TINY + ["--tensor-model-parallel-size", "2"]
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID")


def _mpirun() -> str | None:
    """The mpirun next to the venv's python (mpich + mpi4py live there), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_"))}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    return env


@pytest.mark.timeout(600)
def test_mpirun_tp2_discovers_ranks_via_mpi_and_matches_torchrun():
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (neither next to the venv's python nor on PATH)")
    cmd = [mpirun, "-n", "2", sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=_clean_env())
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "> ranks discovered via mpi (2 ranks, 2 per node)" in proc.stdout, proc.stdout[-3000:]
    got = losses(proc.stdout)
    ref = losses(run_pretrain(2, ARGS).stdout)  # torchrun, same flags
    assert 10 in got and 10 in ref, (got, ref)
    assert got[10] == ref[10], (got[10], ref[10])
    assert len({round(v, 4) for v in got.values()}) > 5  # it trains: the loss moves
