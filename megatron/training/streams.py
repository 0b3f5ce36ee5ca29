"""The loop's data: the run's splits from the datasets provider (in upstream's sample counts) and this DP rank's
micro-batch streams of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.ulysses import sequence_slices
from megatron.data.num_samples import train_valid_test_num_samples
from megatron.optim.microbatches import MicroBatchPlan
from megatron.training.batches import eod_loss_mask, microbatches
from megatron.training.pipe_step import pipe_microbatches


@dataclass(frozen=True)
class Streams:
    train: Iterator
    """This DP rank's training micro-batches from the resumed sample on (the pipeline engine's tuples when
    pipelined)."""
    valid: Any
    """The validation split (None: none)."""
    test: Any
    """The test split (None: none)."""
    batches: Callable[[Any, int], Iterator[dict]]
    """``batches(dataset, start)``: this DP rank's micro-batches of ``dataset`` from sample ``start`` (evaluation
    reads its splits through it)."""


def data_streams(run: RunConfig, pstate: ParallelState, datasets: Callable, tokenizer, plan: MicroBatchPlan,
                 start: int, eod: int | None, pipelined: bool) -> Streams:
    """The splits from ``datasets(run, tokenizer, train_valid_test_num_samples)`` and the training stream from
    sample ``start``. ``eod``: the end-of-document token --eod-mask-loss masks (None: no mask)."""
    t, dp = run.training, pstate.dp
    # Upstream's sample counts: train (--train-samples, else iterations x global batch, and never fewer than the
    # iterations consume: upstream's ramp arithmetic can overshoot a tiny --train-samples), every evaluation's valid
    # batches, and one evaluation's test batches.
    num_samples = train_valid_test_num_samples(t.train_iters, max(plan.samples_after(t.train_iters),
                                                                  t.train_samples or 0), t.global_batch_size,
                                               t.eval_interval, t.eval_iters)
    train_ds, valid_ds, test_ds = (*datasets(run, tokenizer, num_samples), None)[:3]
    loading = {"num_workers": run.data.num_workers, "dataloader_type": run.data.dataloader_type, "seed": t.seed,
               "data_sharding": run.data.data_sharding}

    def batches(dataset, first: int) -> Iterator[dict]:
        """This DP rank's micro-batches of ``dataset`` from sample ``first`` (--eod-mask-loss masks added); SP
        peers load the same micro-batches (same DP rank), then each keeps its slice of the sequence."""
        got = microbatches(dataset, first, t.micro_batch_size, dp.rank, dp.size, **loading)
        return sequence_slices(got if eod is None else eod_loss_mask(got, eod), pstate.ulysses)

    train = batches(train_ds, start)
    if pipelined:  # the engine pulls (tokens, (labels, mask)) micro-batches itself, gas of them per step
        train = pipe_microbatches(train, sample_index=run.model.moe.enabled)
    return Streams(train, valid_ds, test_ds, batches)
