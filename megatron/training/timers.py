"""--timing-log-level / --timing-log-option timers, reported as upstream Megatron-DeepSpeed's.

Level 1 times each iteration's forward-backward and its optimizer step (after a barrier over all ranks unless
--no-barrier-with-level-1-timing); level 2 adds batch-generator (loading each micro-batch). These are the timers
upstream reports under --deepspeed without a pipeline (run on CPU at 4efb479d, its level 2 prints forward-backward,
batch-generator and optimizer; tests/fixtures/upstream_tensorboard). Every timer synchronizes the device at start
and stop, so levels 1 and 2 slow the run down (as upstream warns). At level 0 no timer exists: iteration time alone
is measured (by the training log). DeepSpeed's pipeline engine runs its own schedule: there, as in upstream's
pipeline path, these timers do not exist.
"""

from __future__ import annotations

import time

import torch
from deepspeed.accelerator import get_accelerator

from megatron.core import comm

# Upstream's print order (training_log's timers_to_log), restricted to the timers this trainer has.
TIMERS_TO_LOG = ("forward-backward", "batch-generator", "optimizer")
LEVEL = {"forward-backward": 1, "optimizer": 1, "batch-generator": 2}


class _Timer:
    def __init__(self, barrier: bool) -> None:
        self.barrier, self.elapsed, self._start = barrier, 0.0, None

    def __enter__(self) -> _Timer:
        if self.barrier and torch.distributed.is_initialized():
            comm.barrier()
        get_accelerator().synchronize()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        get_accelerator().synchronize()
        self.elapsed += time.perf_counter() - self._start


class _Null:
    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc) -> None:
        return None


_NULL = _Null()


class Timers:
    def __init__(self, level: int = 0, option: str = "minmax", barrier_l1: bool = True) -> None:
        self.level, self.option, self.barrier_l1 = level, option, barrier_l1
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str):
        """A context manager timing ``name`` when --timing-log-level reaches its level, else a no-op."""
        lvl = LEVEL[name]
        if lvl > self.level:
            return _NULL
        if name not in self._timers:
            self._timers[name] = _Timer(barrier=lvl == 1 and self.barrier_l1)
        return self._timers[name]

    def start(self, name: str) -> None:
        self(name).__enter__()

    def stop(self, name: str) -> None:
        self(name).__exit__(None, None, None)

    def _all_ranks(self, reset: bool) -> torch.Tensor | None:
        """[world, len(TIMERS_TO_LOG)] seconds since the last reset, every rank's (collective over all ranks)."""
        if self.level == 0:
            return None  # no timer can exist: upstream prints and writes nothing either
        mine = torch.tensor([self._timers[n].elapsed if n in self._timers else 0.0 for n in TIMERS_TO_LOG],
                            dtype=torch.float64)
        if reset:
            for t in self._timers.values():
                t.elapsed = 0.0
        if not torch.distributed.is_initialized() or comm.world_size() == 1:
            return mine.reshape(1, -1)
        got = comm.all_gather(mine.to(comm.collective_device()).reshape(1, -1))
        return got.cpu()

    def write(self, writer, it: int, normalizer: float) -> None:
        """Collective. '<name>-time': the slowest rank's seconds per iteration (TensorBoard takes the max only)."""
        times = self._all_ranks(reset=False)
        if times is None or writer is None:
            return
        for i, name in enumerate(TIMERS_TO_LOG):
            col = times[:, i]
            if (col > 0).any():
                writer.add_scalar(f"{name}-time", col.max().item() / normalizer, it)

    def report(self, normalizer: float) -> str | None:
        """Collective; resets. Upstream's text: '(min, max) time across ranks (ms):' and one line per timer, or
        every rank's time with --timing-log-option all."""
        times = self._all_ranks(reset=True)
        if times is None:
            return None
        times = times * 1000.0 / normalizer
        lines = []
        for i, name in enumerate(TIMERS_TO_LOG):
            col = times[:, i]
            if self.option == "all":
                ranks = [(r, v) for r, v in enumerate(col.tolist()) if v > 0]
                if ranks:
                    lines.append(f"  {name}:" + "".join(f"\n     rank {r:2d}: {v:.2f}" for r, v in ranks))
                continue
            col = col[col > 0]
            if col.numel() == 0:
                continue
            label = (name + " ").ljust(48, ".")
            value = f"{col.max().item():.2f}" if self.option == "max" else \
                f"({col.min().item():.2f}, {col.max().item():.2f})"
            lines.append(f"    {label}: {value}")
        if not lines:
            return None
        head = "times across ranks (ms):" if self.option == "all" else "(min, max) time across ranks (ms):"
        return head + "\n" + "\n".join(lines)
