"""Out of memory before allocating: the memory model's estimate per rank (megatron/perf/memory.py, the layout report's
"est. memory") against what a rank can hold, before the model is built. Clearly over: one line with the estimate, the
capacity and the changes that would fit, exit 2 (--skip-memory-check tries anyway); close: a warning.

What a rank can hold: its device's memory (the estimate then includes the framework overhead); on CPU, the smallest of
its share of the host's RAM and of its cgroup's limit (less what it already uses) and its address-space limit (ulimit
-v, less what it already maps).
"""

from __future__ import annotations

import os
import resource

import torch
from deepspeed.accelerator import get_accelerator

from megatron.config import RunConfig
from megatron.core import comm
from megatron.core.parallel_state import ParallelState
from megatron.errors import ConfigError
from megatron.perf.layout import Layout
from megatron.perf.memory import FRAMEWORK_OVERHEAD_BYTES, GIB, estimate_memory
from megatron.perf.memory_fit import fitting_changes
from megatron.progress import PROGRESS

REFUSE_RATIO = 1.25
"""Estimate / capacity above which the run stops: the model's terms are estimates (the overhead an assumption), so a
model estimated just over the line may still run; 25% over does not."""
WARN_RATIO = 0.9


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _status_bytes(field: str) -> int:
    """VmRSS / VmSize of this process (/proc/self/status, kB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2**60:  # v1 reports "no limit" as a huge number, v2 as "max"
            return int(value)
    return None


def host_capacity(local_ranks: int) -> tuple[float, str]:
    """(bytes this process can still allocate on the host, what bounds it)."""
    rss = _status_bytes("VmRSS")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [(total / local_ranks - rss, f"RAM {_gib(total)} / {local_ranks} rank(s) on the host, less "
                                          f"{_gib(rss)} in use")]
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append((cgroup / local_ranks - rss, f"cgroup limit {_gib(cgroup)} / {local_ranks} rank(s), less "
                                                   f"{_gib(rss)} in use"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = _status_bytes("VmSize")
        limits.append((soft - mapped, f"ulimit -v {_gib(soft)}, less {_gib(mapped)} already mapped"))
    return min(limits)


def device_capacity() -> tuple[float, str]:
    acc = get_accelerator()
    total = acc.total_memory(acc.current_device())
    return float(total), f"{acc.device_name()} memory {_gib(total)}"


def check_memory(run: RunConfig, pstate: ParallelState, local_ranks: int) -> None:
    """Collective (two small all-reduces; an all-gather only when close or over). Raises ConfigError on every rank
    when the estimate is clearly over the smallest capacity of the job."""
    on_cpu = get_accelerator().device_name() == "cpu"
    overhead = 0.0 if on_cpu else FRAMEWORK_OVERHEAD_BYTES  # on CPU the process's own use is taken off the capacity
    layout = Layout.from_run(run)
    est = estimate_memory(run.model, layout, overhead)
    capacity, what = host_capacity(max(1, local_ranks)) if on_cpu else device_capacity()
    capacity = max(capacity, 1.0)
    smallest = -comm.reduce_host([-capacity], op=torch.distributed.ReduceOp.MAX)[0]
    ratio = est.total / smallest
    if ratio <= WARN_RATIO:
        return
    # Who holds the least (only now: an all-gather of one line per rank).
    mine = (capacity, what, str(PROGRESS.identity))
    cap, what, who = min(comm.all_gather_object(mine), key=lambda x: x[0])
    acts = est.terms["activations"] + est.terms["embedding_activations"] + est.terms["logits"]
    head = (f"the memory model estimates {_gib(est.total)} per rank (worst pipeline stage {est.stage}: model states "
            f"{_gib(est.model_states)}, activations {_gib(acts)}, the rest {_gib(est.total - est.model_states - acts)})"
            f" and {who} can hold {_gib(cap)} ({what})")
    if ratio <= REFUSE_RATIO or run.runtime.skip_memory_check:
        if pstate.global_rank == 0:
            print(f"> WARNING: {head}: {ratio:.0%} of it, {'over' if ratio > 1 else 'close to'} the limit; an "
                  "out-of-memory error would name the rank and phase", flush=True)
        return
    changes = fitting_changes(run.model, layout, cap, overhead)
    advice = ("would fit: " + "; or ".join(changes)) if changes else (
        f"no single or paired change of ZeRO stage, recompute, micro-batch, TP or PP fits on {pstate.world_size} "
        "rank(s): use more nodes")
    raise ConfigError(f"the model does not fit: {head}; {advice} (--skip-memory-check builds it anyway)")
