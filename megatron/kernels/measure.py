"""``auto`` by measurement: the first time a kernel call's key is seen, time every backend that can take
the inputs, on those inputs, and keep the fastest for the rest of the run.

Why measure instead of a fixed preference: on an H100 our Triton attention is ~1.6-2x slower than torch's
SDPA (cuDNN) and LayerNorm at 12288 columns was 5.8x slower, while on MI250X the HIP kernels may win.
No fixed order is right on every device, and torch is always a candidate, so ``auto`` never runs a
backend that measured slower than torch.

- The key is (op, input shapes, dtypes, whether gradients are needed, extra flags, device name).
- Each candidate runs forward (+ backward when the call needs gradients) on detached copies of the
  real inputs; the gradients go to ``torch.autograd.grad``, so no ``.grad`` is touched and no RNG is drawn.
- Timing uses the accelerator's events and ``synchronize`` (deepspeed's ``get_accelerator()``); tests
  inject a fake timer (``set_timer``), so nothing here is asserted on real time.
- The choice and every timing are logged once. With ``MEGATRON_KERNEL_CACHE_DIR`` set, choices persist in
  ``<dir>/kernel_choices.json`` under a section per (device name, torch, triton, HIP-extension) versions,
  so a second run skips the timing; a section for other versions is never read.
- Only accelerator tensors are measured. A CPU run keeps ``select.choose``'s fixed preference (Triton
  there means the interpreter, a test mode) and never imports triton unless TRITON_INTERPRET=1.
- ``MEGATRON_KERNEL_SELECT=static`` turns measuring off (then ``auto`` = the fixed preference);
  ``=torch`` makes ``auto`` mean torch everywhere (the "torch kernels" run of bench/gpu_throughput.py).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import statistics
from collections.abc import Callable

import torch
from megatron.kernels import hip_ops
from megatron.core import comm
from megatron.core.parallel_state import get_parallel_state

log = logging.getLogger(__name__)

Timer = Callable[[str, Callable[[], object]], float]
"""(backend name, thunk) -> the thunk's time in milliseconds, warm-up included. The name lets a test's
fake timer charge each backend a known cost."""

# The choice is logged at WARNING on purpose: pretrain_gpt.py configures no INFO handler, and a user must
# see which kernel a run uses and why (once per key and rank).
CHOICE_LEVEL = logging.WARNING
_choices: dict[str, str] = {}
_timer: Timer | None = None
CACHE_FILE = "kernel_choices.json"


class AcceleratorTimer:
    """Median of ``reps`` timed runs after ``warmup`` untimed ones, with accelerator events."""

    def __init__(self, warmup: int = 2, reps: int = 5) -> None:
        self.warmup, self.reps = warmup, reps

    def __call__(self, name: str, fn: Callable[[], object]) -> float:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        for _ in range(self.warmup):  # the first calls compile/autotune Triton kernels: never timed
            fn()
        acc.synchronize()
        pairs = []
        for _ in range(self.reps):
            start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        acc.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs)


def set_timer(timer: Timer | None) -> None:
    """Replace the timer (tests: a fake clock); None restores the accelerator timer."""
    global _timer
    _timer = timer


def reset() -> None:
    """Forget every in-process choice (tests)."""
    _choices.clear()


def enabled(device: torch.device) -> bool:
    """Whether ``auto`` measures on this device (accelerators only; see the module doc)."""
    return device.type != "cpu" and os.environ.get("MEGATRON_KERNEL_SELECT", "measure") == "measure"


def resolve(backend: str) -> str:
    """``auto`` -> "torch" when MEGATRON_KERNEL_SELECT=torch; anything else unchanged."""
    if backend == "auto" and os.environ.get("MEGATRON_KERNEL_SELECT") == "torch":
        return "torch"
    return backend


def device_name(device: torch.device) -> str:
    return _device_name(device.type, device.index)


@functools.cache
def _device_name(kind: str, index: int | None) -> str:
    device = torch.device(kind, index) if index is not None else torch.device(kind)
    if kind == "cpu":
        return "cpu"
    try:
        return torch.get_device_module(device.type).get_device_name(device)
    except (AttributeError, RuntimeError, AssertionError):
        return device.type


def key_of(op: str, tensors: tuple[torch.Tensor | None, ...], extra: str = "") -> str:
    """The cache key of one call: op, shapes and dtypes, whether it needs gradients, flags, device."""
    present = [t for t in tensors if t is not None]
    shapes = ";".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in present)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in present)
    return f"{op}|{shapes}|grad={int(grad)}|{extra}|{device_name(present[0].device)}"


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor | None) -> Callable[[], object]:
    """A thunk running ``fn`` on detached copies of ``inputs``: forward, then backward when they need it."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    copies = [None if t is None else t.detach().requires_grad_(grad and t.requires_grad) for t in inputs]
    leaves = [t for t in copies if t is not None and t.requires_grad]

    def run() -> object:
        with torch.enable_grad() if grad else torch.no_grad():
            out = fn(*copies)
            if leaves:
                # ones, not randn: timing must not move the RNG stream the run's dropout draws from.
                return torch.autograd.grad(out, leaves, torch.ones_like(out))
            return out

    return run


def _versions(device: torch.device) -> str:
    parts = [device_name(device), f"torch {torch.__version__}"]
    for dist in ("triton", "pytorch-triton-rocm"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass

    parts.append("hip ext " + ("built" if hip_ops.built("attention") or hip_ops.built("norm") else "absent"))
    return " | ".join(parts)


def _cache_path() -> str | None:
    d = os.environ.get("MEGATRON_KERNEL_CACHE_DIR")
    return os.path.join(d, CACHE_FILE) if d else None


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}  # a missing or damaged cache only costs a re-measure


def _cached(key: str, section: str, names: set[str]) -> str | None:
    path = _cache_path()
    if path is None:
        return None
    hit = _load(path).get(section, {}).get(key)
    return hit["backend"] if isinstance(hit, dict) and hit.get("backend") in names else None


def _store(key: str, section: str, backend: str, times: dict[str, float]) -> None:
    path = _cache_path()
    if path is None:
        return
    data = _load(path)
    data.setdefault(section, {})[key] = {"backend": backend, "ms": times}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: ranks sharing the directory never read half a file


def fastest(key: str, make_candidates: Callable[[], dict[str, Callable[[], object]]], device: torch.device) -> str:
    """The backend to use for ``key``: measured once per process (or read from the cache), then remembered.

    ``make_candidates()`` maps backend name -> a thunk running that backend on the call's inputs (built
    only on a miss, to keep the per-call host cost low); "torch" must be one of them, so the choice is
    never slower than torch by the measurement.
    """
    if key in _choices:
        return _choices[key]
    # Timing syncs the device: keep it out of any compiled graph. Wrapped here, not with a decorator,
    # because torch.compiler.disable imports dynamo and with it triton, which a CPU run must not import.
    return torch.compiler.disable(_measure)(key, make_candidates, device)


def _measure(key: str, make_candidates: Callable[[], dict[str, Callable[[], object]]], device: torch.device) -> str:
    candidates = make_candidates()
    if "torch" not in candidates:
        raise ValueError("torch must always be a candidate")
    if len(candidates) == 1:
        _choices[key] = "torch"
        return "torch"
    section = _versions(device)
    hit = _cached(key, section, set(candidates))
    if hit is not None:
        hit = _agree_in_tp_group(hit, candidates)
        log.log(CHOICE_LEVEL, "kernel %s: %r from the cache (%s)", key, hit, _cache_path())
        _choices[key] = hit
        return hit
    timer = _timer or AcceleratorTimer()
    times = {name: float(timer(name, thunk)) for name, thunk in candidates.items()}
    # Ties go to torch: a kernel of ours must be strictly faster to earn its place.
    best = _agree_in_tp_group(min(times, key=lambda n: (times[n], n != "torch")), candidates)
    _choices[key] = best
    log.log(CHOICE_LEVEL, "kernel %s: using %r (%s)", key, best,
            ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()))
    _store(key, section, best, times)
    return best


def _agree_in_tp_group(best: str, candidates: dict) -> str:
    """The tensor-parallel group's first rank decides for the whole group.

    Why: TP ranks compute replicated tensors (the norms, and attention under TP=1 heads) that Megatron assumes
    bit-identical across the group; replicated weights (norm gamma/beta, row-parallel biases) get no TP
    all-reduce. Per-rank timings are noisy, and a cache file can be hit by one rank and missed by another, so
    two TP ranks could pick different kernels and let those weights drift apart. Every TP rank reaches this
    point for the same key in the same order (same layers, same shapes), so the broadcast cannot deadlock.
    Its tensor lives on ``comm.collective_device`` (NCCL/RCCL take device tensors only)."""

    try:
        tp = get_parallel_state().tp
    except RuntimeError:  # no parallel state: a single process (tests, benchmarks)
        return best
    if tp.size <= 1 or tp.group is None:
        return best
    order = sorted(candidates)  # the same on every rank: the same build offers the same backends
    t = torch.tensor([order.index(best)], dtype=torch.int64).to(comm.collective_device(tp.group))
    comm.broadcast(t, src=tp.ranks[0], group=tp.group)
    return order[int(t.item())]
