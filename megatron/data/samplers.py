"""Batch samplers that give each data-parallel rank its micro-batches and resume exactly at consumed_samples."""

from __future__ import annotations

from collections.abc import Iterator

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
    """Sequential order (--dataloader-type single), upstream Megatron's: global batch k is samples
    ``[consumed + k*G, consumed + (k+1)*G)`` (G = micro_batch_size * dp_size) and this rank takes its contiguous
    slice of each. Starting at ``consumed_samples`` skips exactly what a run already saw, so a restart continues the
    same stream."""

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
        if not self.drop_last:
            # Upstream's tail: the same slice of the partial last batch (empty for trailing ranks: skipped here).
            if mine := list(range(start, self.total_samples))[lo:hi]:
                yield mine


class MegatronPretrainingRandomSampler:
    """Random order per epoch (--dataloader-type cyclic), upstream Megatron's: the epoch and the position inside it
    follow from ``consumed_samples`` (so a restart resumes the same permutation at the same place), and the order
    is ``torch.randperm`` seeded with the epoch number (not --seed: upstream's choice, kept so the batches match).

    With ``data_sharding`` (upstream's default) each rank owns a contiguous bucket of the samples and walks a
    permutation of it; without, all ranks walk one permutation of the whole and rank r takes every dp_size-th
    sample. Iterating again (a cyclic loader) starts the next epoch, as ``consumed_samples`` advances per batch."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ) -> None:
        _check(total_samples, 0, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.global_mb = micro_batch_size * data_parallel_size
        if total_samples < self.global_mb:
            raise ConfigError(f"the dataset's {total_samples} samples do not fill one batch of {self.global_mb}")
        if consumed_samples % self.global_mb:
            raise ConfigError(f"consumed samples {consumed_samples} is not a multiple of micro batch x data-parallel "
                              f"size {self.global_mb}: --dataloader-type cyclic resumes only at a batch boundary")
        self.total_samples, self.consumed_samples, self.data_sharding = total_samples, consumed_samples, data_sharding
        self.micro_batch_size, self.rank, self.dp_size = micro_batch_size, data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        import torch

        per_epoch = self.total_samples - self.total_samples % self.global_mb
        epoch, in_epoch = divmod(self.consumed_samples, per_epoch)
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.data_sharding:
            bucket = self.total_samples // self.global_mb * self.micro_batch_size
            # Every rank has taken in_epoch / dp_size samples of its own bucket so far.
            order = torch.randperm(bucket, generator=g).numpy()[in_epoch // self.dp_size:] + self.rank * bucket
        else:
            whole = self.total_samples // self.micro_batch_size * self.micro_batch_size
            order = torch.randperm(whole, generator=g).numpy()[in_epoch:][self.rank:: self.dp_size]
        for pos in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            # Counted as consumed before the yield, so iterating again starts the next epoch.
            self.consumed_samples += self.global_mb
            yield order[pos: pos + self.micro_batch_size].tolist()
