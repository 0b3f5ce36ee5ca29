"""An evaluation stopped by the job's end (megatron/resilience/eval_budget.py's verdict) and run by the next job:
the same validation batches as the straight run's, so the same number; no launch (a fake engine whose loss is the
first sample index of each micro-batch, so a number names the batches drawn)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.arguments import parse_args, run_config_from_args
from megatron.core import comm
from megatron.optim.microbatches import MicroBatchPlan
from megatron.training.evaluate import Evaluation
from tests.models import CONFIG_GPT


class _Engine:
    def eval(self) -> None:
        pass

    def train(self) -> None:
        pass


def _evaluation(start_iteration: int, logged: list):
    run = run_config_from_args(parse_args(CONFIG_GPT + ["--eval-interval", "2", "--eval-iters", "3"]), 1, 200)
    pstate = SimpleNamespace(global_rank=0, dp=SimpleNamespace(size=1, group=None))
    logger = SimpleNamespace(validation=lambda prefix, loss, it, consumed, **kw: logged.append((it, loss)))
    batches = lambda dataset, start: iter(range(start, len(dataset)))  # noqa: E731  one sample per micro-batch
    return Evaluation(_Engine(), run, pstate, lambda engine, sample: torch.tensor(float(sample)), False,
                      range(10_000), None, start_iteration, logger, batches, MicroBatchPlan(4, 1, 1))


def test_a_moved_evaluation_draws_the_straight_runs_batches(monkeypatch):
    monkeypatch.setattr(comm, "reduce_host", lambda values, *a, **k: [float(v) for v in values])
    straight: list = []
    ev = _evaluation(0, straight)
    assert ev.periodic(2, 8) and ev.periodic(4, 16)
    assert straight == [(2, 5.5), (4, 17.5)]  # samples 0-11, then 12-23
    asked, stopped = [], []
    ev = _evaluation(0, stopped)  # a job whose end comes during the evaluation of iteration 2
    assert not ev.periodic(2, 8, goes_on=lambda *a: asked.append(a) or False)
    assert stopped == [] and len(asked) == 1 and asked[0][2] == 1  # asked after 2 of 3 batches, unlogged
    moved: list = []
    ev = _evaluation(2, moved)  # the next job resumed from iteration 2 runs it first, then trains on
    assert ev.moved(2, 8, goes_on=lambda *a: True) and ev.periodic(4, 16)
    assert moved == straight
