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
import sys

import pytest

from tests.launch import MPI_AND_SLURM, PRETRAIN, clean_env, free_port, losses, run_command, run_pretrain
from tests.models import TINY_GPT

ARGS = TINY_GPT + ["--tensor-model-parallel-size", "2"]


def _mpirun() -> str | None:
    """The mpirun next to the venv's python (mpich + mpi4py live there), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


@pytest.mark.timeout(600)
def test_mpirun_tp2_discovers_ranks_via_mpi_and_matches_torchrun():
    mpirun = _mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (neither next to the venv's python nor on PATH)")
    cmd = [mpirun, "-n", "2", sys.executable, PRETRAIN, *ARGS]
    proc = run_command(cmd, 300, env=clean_env({"MASTER_PORT": str(free_port())}, drop=MPI_AND_SLURM))
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "> ranks discovered via mpi (2 ranks, 2 per node)" in proc.stdout, proc.stdout[-3000:]
    got = losses(proc.stdout)
    ref = losses(run_pretrain(2, ARGS).stdout)  # torchrun, same flags
    assert 10 in got and 10 in ref, (got, ref)
    assert got[10] == ref[10], (got[10], ref[10])
    assert len({round(v, 4) for v in got.values()}) > 5  # it trains: the loss moves
