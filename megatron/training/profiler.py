"""--profile pt|pt-full, --profile_steps START,END, --profile-ranks R ...: upstream Megatron-DeepSpeed's PyTorch
profiler window (megatron/profiler.py there). Steps count the iterations this process runs, from 1 (as upstream's,
so a resumed run profiles its own 2nd and 3rd iterations by default). The trace of the chosen ranks goes to
--tensorboard-dir through ``torch.profiler.tensorboard_trace_handler`` (gzip); ``pt-full`` adds Python stacks.
Device activity comes from the accelerator: CUDA/HIP builds of torch report both as CUDA.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from megatron.errors import ConfigError


def profile_window(args: argparse.Namespace) -> tuple[int, int] | None:
    """(first, last) step to profile, checked before any process group; None without --profile."""
    if getattr(args, "profile", None) is None:
        return None
    try:
        start, end = (int(x) for x in str(args.profile_steps).split(","))
    except ValueError:
        raise ConfigError(f"--profile_steps {args.profile_steps!r}: give START,END (e.g. 2,3)") from None
    if not 1 <= start <= end:
        raise ConfigError(f"--profile_steps {start},{end}: need 1 <= START <= END (steps count from 1)")
    if not args.tensorboard_dir:
        raise ConfigError("--profile writes its trace to --tensorboard-dir, as upstream: give --tensorboard-dir DIR")
    return start, end


class StepProfiler:
    """Call ``begin()`` before and ``end()`` after every training step; does nothing off the window or rank."""

    def __init__(self, args: argparse.Namespace, rank: int, device_name: str) -> None:
        window = profile_window(args)
        ranks = getattr(args, "profile_ranks", None)
        self.window = window if window is not None and (ranks is None or rank in ranks) else None
        self.step, self._prof = 0, None
        if self.window is None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_name.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        start, end = self.window
        with warnings.catch_warnings():  # no warm-up step: the trace holds exactly the steps asked for, as upstream's
            warnings.simplefilter("ignore", UserWarning)
            schedule = torch.profiler.schedule(wait=0, warmup=0, active=end - start + 1, repeat=1)
        self._prof = torch.profiler.profile(
            activities=activities, with_stack=args.profile == "pt-full", schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir, use_gzip=True))

    def begin(self) -> None:
        if self._prof is None:
            return
        self.step += 1
        if self.step == self.window[0]:
            self._prof.start()

    def end(self) -> None:
        if self._prof is None or not self.window[0] <= self.step <= self.window[1]:
            return
        self._prof.step()
        if self.step == self.window[1]:
            self._prof.stop()
            self._prof = None
