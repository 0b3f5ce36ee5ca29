"""The one way tests start ranks (docs/verification.md, "How the CPU suite runs"): one way to pick a port, set a
rank's environment, bound the wait (every child killed at the end) and collect output and results.

- ``env``: ``free_port``, ``rank_env`` (torchrun's variables), ``clean_env`` (a child's environment), ``REPO``;
- ``functions``: function ranks forked from a forkserver (``run_distributed``: results; ``run_to_exit``: exit
  codes, output and results of ranks that may exit);
- ``cli``: pretrain_gpt.py on one process or through torchrun (``run_pretrain``), its log's ``losses``;
- ``processes``: any command, bounded (``run_command``), and background rank processes (``start_ranks``: each its
  own pid and exit code, for signals and kill -9).

Nothing here imports torch at import time: tests/gpu/quick's orchestrator uses it on a bare GPU machine.
"""

from tests.launch.cli import losses, pretrain_command, run_pretrain
from tests.launch.env import MPI_AND_SLURM, PRETRAIN, REPO, clean_env, free_port, rank_env
from tests.launch.functions import Outcome, run_distributed, run_to_exit
from tests.launch.processes import TIMED_OUT, Ranks, run_command, start_ranks

__all__ = ["MPI_AND_SLURM", "PRETRAIN", "REPO", "TIMED_OUT", "Outcome", "Ranks", "clean_env", "free_port", "losses",
           "pretrain_command", "rank_env", "run_command", "run_distributed", "run_pretrain", "run_to_exit",
           "start_ranks"]
