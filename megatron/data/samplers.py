"""Batch samplers that give each data-parallel rank its micro-batches and resume exactly at consumed_samples."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megatron.errors import ConfigError


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if total_samples <= 0:
        raise ConfigError(f"the dataset has {total_samples} samples; nothing to train on")
    if micro_batch_size <= 0:
        raise ConfigError(f"--micro-batch-size {micro_batch_size} must be positive")
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"data-parallel rank {dp_rank} is outside [0, {dp_size})")
    if not 0 <= consumed_samples < total_samples:
        raise ConfigError(
            f"consumed samples {consumed_samples} is not below the dataset's {total_samples} samples: the "
            f"checkpoint has already seen every sample; raise --train-samples / --train-iters"
        )


class MegatronPretrainingSampler:
    """Sequential order: global batch k is samples ``[k*G, (k+1)*G)`` (G = micro_batch_size * dp_size) counted
    from 0, and this rank takes its slice of each. Starting at ``consumed_samples`` skips exactly what a run
    already saw, so a restart continues the same stream."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.rank, self.dp_size = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        global_mb = self.micro_batch_size * self.dp_size
        lo, hi = self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size
        start = self.consumed_samples
        while start + global_mb <= self.total_samples:
            yield list(range(start + lo, start + hi))
            start += global_mb
        if not self.drop_last and start < self.total_samples:
            # Split the remainder evenly; trailing ranks may get an empty batch, which is skipped.
            tail = list(range(start, self.total_samples))
            per = -(-len(tail) // self.dp_size)
            if mine := tail[self.rank * per : (self.rank + 1) * per]:
                yield mine


class MegatronPretrainingRandomSampler:
    """Random order within each epoch (Megatron's --dataloader-type cyclic): each rank owns a contiguous bucket
    of the dataset and walks a permutation of it seeded by ``seed + epoch``; the epoch and the position inside
    it both follow from ``consumed_samples``, so a restart resumes the same permutation at the same place."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int = 0,
    ) -> None:
        _check(total_samples, 0, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.global_mb = micro_batch_size * data_parallel_size
        if total_samples < self.global_mb:
            raise ConfigError(f"the dataset's {total_samples} samples do not fill one batch of {self.global_mb}")
        self.total_samples, self.consumed_samples, self.seed = total_samples, consumed_samples, seed
        self.micro_batch_size, self.rank, self.dp_size = micro_batch_size, data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.total_samples - self.total_samples % self.global_mb
        epoch, in_epoch = divmod(self.consumed_samples, per_epoch)
        bucket = per_epoch // self.dp_size
        order = np.random.RandomState(self.seed + epoch).permutation(bucket) + self.rank * bucket
        # Every rank has taken in_epoch / dp_size samples of its own bucket so far.
        for pos in range(in_epoch // self.dp_size, bucket, self.micro_batch_size):
            # Counted as consumed before the yield, so iterating again (a cyclic loader) starts the next epoch.
            self.consumed_samples += self.global_mb
            yield order[pos : pos + self.micro_batch_size].tolist()
