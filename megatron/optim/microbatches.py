"""How many micro-batches each step runs: constant, or Megatron's --rampup-batch-size START INCR SAMPLES.

Upstream (megatron/microbatches.py, RampupBatchsizeNumMicroBatches) sets the global batch of a step from the
samples consumed before it: START + INCR x floor(consumed / (SAMPLES / n)), n = (GBS - START) / INCR, and GBS
once more than SAMPLES samples are consumed. The data order does not change with it: the sampler hands out
blocks of micro-batch x DP samples in order, and only the number of blocks per step varies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megatron.errors import ConfigError

RAMP_FLAG = "--rampup-batch-size START INCR SAMPLES"


@dataclass(frozen=True)
class MicroBatchPlan:
    global_batch_size: int
    micro_batch_size: int
    dp: int
    rampup: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.rampup is None:
            return
        if len(self.rampup) != 3:
            raise ConfigError(f"{RAMP_FLAG}: expected 3 integers, got {len(self.rampup)}")
        start, incr, samples = self.rampup
        block = self.micro_batch_size * self.dp
        gbs = self.global_batch_size
        if start >= gbs:
            raise ConfigError(f"{RAMP_FLAG}: START {start} must be below --global-batch-size {gbs} (the batch it "
                              "ramps up to); drop the flag for a constant batch")
        if (gbs - start) % incr:
            raise ConfigError(f"{RAMP_FLAG}: --global-batch-size {gbs} - START {start} = {gbs - start} is not a "
                              f"multiple of INCR {incr}")
        if start % block or incr % block:
            raise ConfigError(f"{RAMP_FLAG}: START {start} and INCR {incr} must be multiples of --micro-batch-size "
                              f"x data-parallel size = {block}, so every global batch of the ramp is whole "
                              "micro-batches")

    @property
    def samples_per_increment(self) -> float:
        start, incr, samples = self.rampup
        return samples / ((self.global_batch_size - start) // incr)

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        if self.rampup is None or consumed_samples > self.rampup[2]:
            return self.global_batch_size
        start, incr, _ = self.rampup
        return start + int(consumed_samples / self.samples_per_increment) * incr

    def num_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches per DP rank for that step (DeepSpeed's gradient accumulation steps)."""
        return self.global_batch(consumed_samples) // (self.micro_batch_size * self.dp)

    def positions(self, consumed_samples: int = 0) -> Iterator[int]:
        """Samples consumed after each step from ``consumed_samples`` on (endless)."""
        while True:
            consumed_samples += self.global_batch(consumed_samples)
            yield consumed_samples

    def samples_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Samples consumed after ``iterations`` more steps (stepping only through the ramp)."""
        done = 0
        while done < iterations and self.rampup is not None and consumed_samples <= self.rampup[2]:
            consumed_samples += self.global_batch(consumed_samples)
            done += 1
        return consumed_samples + (iterations - done) * self.global_batch_size

    def valid_samples_before(self, iteration: int, eval_interval: int, eval_iters: int) -> int:
        """Validation samples the evaluations up to ``iteration`` drew: each takes --eval-iters batches of the
        global batch of the step just done (upstream evaluates with that step's micro-batch count). Upstream
        keeps this count in its checkpoint (consumed_valid_samples); a straight run reaches the same."""
        if self.rampup is None:
            return (iteration // eval_interval) * eval_iters * self.global_batch_size
        total, consumed, done = 0, 0, 0
        for k in range(1, iteration // eval_interval + 1):
            consumed = self.samples_after(k * eval_interval - 1 - done, consumed)
            done = k * eval_interval - 1
            total += eval_iters * self.global_batch(consumed)
        return total

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a --train-samples run, as upstream's update_train_iters: with a ramp, every step
        while the consumed count is at most SAMPLES, then whole final batches (a partial last one is dropped)."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iters, consumed = 0, 0
        while consumed <= self.rampup[2]:
            consumed += self.global_batch(consumed)
            iters += 1
        return iters + (train_samples - consumed) // self.global_batch_size
