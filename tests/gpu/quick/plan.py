"""The steps of tests/gpu/quick.sh in run order (most valuable first), and which of them one run takes.

build, train, kernels and speed are the issue's items 1-3; variants, speed2, kbench and suite its item 4, which a
default run reaches only when the budget still holds their ``min_s`` (a second run names them).
Pure logic (no torch): tests/unit/test_gpu_quick.py checks it on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_S = 330
"""Seconds for a whole GPU run from quick.sh's start: the issue's 6 minutes on one H100, less half a minute for
the device tool's transfers and the summary (the lead's `run` call has timeout 420)."""


@dataclass(frozen=True)
class Step:
    name: str
    module: str
    """tests.gpu.quick.<module> runs it (``python -m``), with ``--step <name>``."""
    what: str
    gpu_s: int
    """Its own timeout on one GPU; the remaining budget lowers it."""
    min_s: int = 0
    """The least time worth starting it with; less remaining budget skips it."""
    background: bool = False
    """Started first and run alongside the next steps (it needs CPUs, they need the GPU); joined before the
    first step that uses what it makes."""


STEPS = (
    Step("build", "build", "csrc kernels built for the device (nvcc through csrc/common/wave64.h, or hipcc) and the "
         "data helpers, out of tree, alongside train; installed in place after it", 240, background=True),
    Step("train", "train", "pretrain_gpt.py, GPT ~125M (gpt2-small), bf16, ZeRO-1, 30 iterations: loss falls, "
         "tokens/s, MFU, memory; save at 15 and resume to 30 against the straight run", 150, min_s=60),
    Step("kernels", "kernels", "Triton attention (bf16, d 64/128, seq 2048) and norms, and the csrc kernels, "
         "forward and backward against float64; ZB-H1's deferred weight gradient against F.linear (tests/gpu)", 110,
         min_s=30),
    Step("speed", "speed", "GPT-2 1.3B, seq 2048, bf16, ZeRO-1, mbs 4, gbs 8: ours auto, ours torch kernels, "
         "HF + torch.compile (bench/gpu_throughput.py)", 200, min_s=90),
    Step("variants", "extra", "tests/gpu/test_pretrain_gpu.py: bf16 ZeRO-3, fp16, full recompute, Llama, each "
         "against its reference", 300, min_s=150),
    Step("speed2", "speed", "the speed comparison's other contenders: ours --compile, HF eager", 240, min_s=120),
    Step("kbench", "extra", "bench/gpu_kernels.py --quick: each kernel backend's time against torch", 150, min_s=60),
    Step("suite", "extra", "the rest of tests/gpu on one GPU (multi-GPU cases skip)", 600, min_s=240),
)
BY_NAME = {s.name: s for s in STEPS}
CPU_STEP_S = 900
"""Each CPU twin's timeout (tiny sizes; a loaded 2-core machine); a CPU run has no overall budget."""
USES_BUILD = ("kernels", "speed", "variants", "speed2", "kbench", "suite")
"""Steps that run the csrc kernels when built: on a GPU naming one of them rebuilds (a no-op when nothing changed),
so a fix to csrc/ is what the repeat measures."""


class PlanError(ValueError):
    """A bad step name on quick.sh's command line."""


@dataclass(frozen=True)
class Plan:
    chosen: tuple[Step, ...]
    """The steps to run, in STEPS order."""
    notes: dict[str, str]
    """step name -> why it was added or left out, for the summary."""


def plan(names: list[str], gpu: bool) -> Plan:
    """The steps a run takes: all of them by default, else the named ones (any order, each once) in run order; on a
    GPU the build joins any step that uses it. Unknown names raise PlanError with the valid ones."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise PlanError(f"unknown step {', '.join(unknown)}: choose from {' '.join(BY_NAME)}")
    wanted = set(names) if names else set(BY_NAME)
    notes = {}
    if gpu and "build" not in wanted and wanted & set(USES_BUILD):
        wanted.add("build")
        notes["build"] = "added: " + ", ".join(n for n in USES_BUILD if n in wanted) + " use the csrc kernels"
    for s in STEPS:
        if s.name not in wanted:
            notes[s.name] = "not named"
    return Plan(tuple(s for s in STEPS if s.name in wanted), notes)


def step_timeout(step: Step, remaining_s: float, gpu: bool) -> tuple[int, str | None]:
    """(timeout in seconds, None) to start ``step`` with ``remaining_s`` of the budget left, or (0, why not).
    ``min_s`` is a GPU figure: a CPU twin needs only a second (a CPU run has no budget unless one is given)."""
    need = max(step.min_s if gpu else 0, 1)
    if remaining_s < need:
        return 0, f"budget: {max(remaining_s, 0):.0f} s left, it needs at least {need} s"
    return int(min(step.gpu_s if gpu else CPU_STEP_S, remaining_s)), None
