"""--profile pt|pt-full, --profile_steps START,END, --profile-ranks R ...: upstream Megatron-DeepSpeed's PyTorch
profiler window (megatron/profiler.py there). Steps count the iterations this process runs, from 1 (as upstream's,
so a resumed run profiles its own 2nd and 3rd iterations by default). The trace of the chosen ranks goes to
--tensorboard-dir through ``torch.profiler.tensorboard_trace_handler`` (gzip); ``pt-full`` adds Python stacks.
Device activity comes from the accelerator: CUDA/HIP builds of torch report both as CUDA.
"""

from __future__ import annotations

import warnings

import torch

from megatron.config import ProfileConfig


class StepProfiler:
    """Call ``begin()`` before and ``end()`` after every training step; does nothing off the window or rank."""

    def __init__(self, profile: ProfileConfig, rank: int, device_name: str) -> None:
        window, ranks = profile.window, profile.ranks
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
            activities=activities, with_stack=profile.mode == "pt-full", schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(profile.tensorboard_dir, use_gzip=True))

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
