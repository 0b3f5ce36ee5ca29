"""Helpers for the checkpoint tests: pretrain_gpt.py's providers through ``pretrain`` on function ranks, with the
exact per-iteration losses back (the log prints only 7 digits), and pretrain_gpt.py as rank processes that print
each logged loss exactly. Faults come from MEGATRON_FAULT (docs/faults.md, "Injecting faults in tests")."""

from __future__ import annotations

import sys

from tests.launch import Ranks, run_distributed, start_ranks

FAULT = "MEGATRON_FAULT"


def _pretrain(argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron.training.pretrain import Providers

    return pretrain_gpt.pretrain_from_flags(argv, Providers(pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                                                            pretrain_gpt.forward_step, pretrain_gpt.tokenizer_provider))


def pretrain_on(world: int, argv: list[str], timeout: float = 240.0) -> dict:
    """Rank 0's summary of one pretrain run on ``world`` fresh processes."""
    return run_distributed(_pretrain, world, timeout=timeout, argv=argv)[0]


def check_resume_exact(world: int, args: list[str], save_dir: str, n: int = 2) -> dict[int, float]:
    """2n straight iterations == n, save and exit (--exit-interval), resume n, bit for bit, on ``world`` fresh
    ranks. Shared by the CPU suite and tests/gpu (same code path, the device's backend). Returns the straight
    run's losses."""
    args = args + ["--train-iters", str(2 * n)]
    straight = pretrain_on(world, args)["losses"]
    first = pretrain_on(world, args + ["--exit-interval", str(n), "--save", save_dir])
    assert first["exit_reason"] == f"--exit-interval {n}" and list(first["losses"]) == list(range(1, n + 1)), first
    resumed = pretrain_on(world, args + ["--save", save_dir, "--load", save_dir])["losses"]
    assert resumed == {i: straight[i] for i in range(n + 1, 2 * n + 1)}, (resumed, straight)
    assert len(set(straight.values())) == 2 * n, straight  # the loss moves: equality is not trivial
    return straight


# pretrain_gpt.py's command line, every rank printing each logged loss exactly ("EXACT <iteration> <loss>"), so that
# runs compare bit for bit: an observer of the public TrainingLogger.iteration (it injects nothing).
EXACT = """
import sys
from megatron.training import log
logged = log.TrainingLogger.iteration
def exact(self, it, loss, res, consumed, *rest):
    if loss is not None:
        print(f"EXACT {it} {loss!r}", flush=True)
    return logged(self, it, loss, res, consumed, *rest)
log.TrainingLogger.iteration = exact
import pretrain_gpt
sys.exit(pretrain_gpt.run_cli(pretrain_gpt.main, sys.argv[1:]))
"""


def start_exact(world: int, argv: list[str], out_dir: str, fault: str | None = None) -> Ranks:
    """``world`` rank processes of ``EXACT`` (each its own pid and exit code, for signals and kill -9); ``fault``:
    their MEGATRON_FAULT. Output of rank r: ``out_dir/rank{r}.out`` / ``.err``."""
    return start_ranks(world, [sys.executable, "-c", EXACT, *argv], out_dir, env={FAULT: fault} if fault else None)


def exact_losses(text: str) -> dict[int, float]:
    return {int(w[1]): float(w[2]) for w in (line.split() for line in text.splitlines()) if w and w[0] == "EXACT"}


def _observed_pretrain(argv: list[str]) -> dict:
    """``_pretrain`` whose summary gains ``events``: ("iteration", it) as each is logged, ("commit", tag) as rank 0
    commits, ("say", line) for the save's log lines (observers: each calls the original unchanged)."""
    from megatron.checkpointing.live import async_save
    from megatron.training import log

    events = []
    commit, logged, say = async_save.commit, log.TrainingLogger.iteration, async_save.say

    def committing(save_dir, tmp_tag, tag, *rest):
        events.append(("commit", tag))
        return commit(save_dir, tmp_tag, tag, *rest)

    def iteration(self, it, *rest):
        events.append(("iteration", it))
        return logged(self, it, *rest)

    def saying(msg):
        events.append(("say", msg))
        say(msg)

    async_save.commit, log.TrainingLogger.iteration, async_save.say = committing, iteration, saying
    return {**_pretrain(argv), "events": events}


def slow_async_pretrain(world: int, argv: list[str], slow_tag: str, slow_s: float, sigterm_at: int | None = None,
                        timeout: float = 240.0) -> dict:
    """Rank 0's summary (with ``events``, see ``_observed_pretrain``) of a run on ``world`` function ranks whose
    checkpoint writer sleeps ``slow_s`` before each file of the save named by ``slow_tag`` and whose rank 0 sends
    itself SIGTERM (as Slurm does) once iteration ``sigterm_at`` is logged: both through MEGATRON_FAULT."""
    faults = [f"phase=write,file={slow_tag},action=sleep:{slow_s}"]
    if sigterm_at is not None:
        faults.append(f"rank=0,phase=log,iteration={sigterm_at},action=signal:TERM")
    return run_distributed(_observed_pretrain, world, timeout=timeout, env={FAULT: ";".join(faults)}, argv=argv)[0]
