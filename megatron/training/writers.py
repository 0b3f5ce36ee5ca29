"""The scalar writers one rank owns, behind the SummaryWriter methods the loop calls: TensorBoard on rank 0,
Weights & Biases on the last rank (upstream's), both on a single process. Every value they are given is the same on
all ranks (losses and norms are reduced, the pipeline engine broadcasts the loss), except the memory series, which
are each writer's own rank's."""

from __future__ import annotations

from megatron.config.log import LogOptions
from megatron.training.tensorboard import open_writer
from megatron.training.wandb_writer import open_wandb


class ScalarWriters:
    def __init__(self, tensorboard=None, wandb=None) -> None:
        self.tensorboard, self.wandb = tensorboard, wandb
        self._all = [w for w in (tensorboard, wandb) if w is not None]

    def set_iteration(self, it: int) -> None:
        """The iteration being written: W&B logs the series over samples and tokens at its step."""
        if self.wandb is not None:
            self.wandb.set_iteration(it)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for w in self._all:
            w.add_scalar(tag, value, step)

    def add_histogram(self, tag: str, values, step: int) -> None:
        for w in self._all:
            w.add_histogram(tag, values, step)

    def close(self) -> None:
        for w in self._all:
            w.close()


def open_writers(opts: LogOptions, rank: int, world_size: int, flags: dict, iteration: int) -> ScalarWriters | None:
    """This rank's writers, or None when it owns none (also under --skip-train: upstream writes nothing then)."""
    if opts.skip_train:
        return None
    tb, wb = open_writer(opts, rank, flags, iteration), open_wandb(opts, flags, rank, world_size)
    return ScalarWriters(tb, wb) if tb is not None or wb is not None else None
