"""A snapshot of one rank's checkpoint state in host memory (--async-save): taken at the save, so a background writer
can write it while training changes the originals; and how much host memory is free for it."""

from __future__ import annotations

import copy
import os

import torch
from deepspeed.accelerator import get_accelerator

_MEMINFO = "/proc/meminfo"
_CGROUP_V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
_CGROUP_V1 = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")


class HostCopier:
    """Copies state dicts into host memory, one tensor storage at a time. Views and aliases are rebuilt on the copied
    storage with their offsets and strides, so ``torch.save`` of the copy writes the very bytes it writes of the
    original (on a CPU run; from a GPU only the storages' location tag reads "cpu"). Storages on an accelerator go
    into pinned buffers, reused from one save to the next (pinning costs far more than copying); CPU storages are
    plain copies, dropped after the write.

    The writer of one save must be done before the next copy: the buffers are overwritten (at most one save is in
    flight, async_save.py)."""

    def __init__(self) -> None:
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}
        """(file name, storage ordinal in that file) -> a pinned uint8 host buffer of exactly that storage's bytes."""

    def bytes_needed(self, state, name: str) -> int:
        """Host bytes ``copy(state, name)`` would allocate now (storages without a reusable pinned buffer)."""
        return sum(s.nbytes() for i, s in enumerate(_storages(state)) if self._reusable(name, i, s) is None)

    @staticmethod
    def bytes_of(state) -> int:
        """Bytes of every tensor storage in ``state`` (each once): what the copy holds."""
        return sum(s.nbytes() for s in _storages(state))

    def copy(self, state, name: str):
        """``state`` with every tensor copied to host memory (containers rebuilt, other objects deep-copied, so a
        later change to the live state reaches neither). ``name``: the file it is for (keys the pinned buffers)."""
        hosts: dict[int, torch.UntypedStorage] = {}
        on_device = False
        for i, storage in enumerate(_storages(state)):
            src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # (nbytes,) over it
            if storage.device.type == "cpu":
                host = src.clone()
            else:
                on_device = True
                host = self._reusable(name, i, storage)
                if host is None:
                    host = get_accelerator().pin_memory(torch.empty(storage.nbytes(), dtype=torch.uint8))
                    self._pinned[(name, i)] = host
                host.copy_(src, non_blocking=True)
            hosts[storage._cdata] = host.untyped_storage()
        if on_device:  # the non-blocking copies must land before the writer reads the buffers
            get_accelerator().synchronize()
        return _rebuild(state, hosts)

    def _reusable(self, name: str, i: int, storage: torch.UntypedStorage) -> torch.Tensor | None:
        if storage.device.type == "cpu":
            return None
        buf = self._pinned.get((name, i))
        return buf if buf is not None and buf.numel() == storage.nbytes() else None


def _plain(t) -> bool:
    """A dense tensor whose bytes live in one storage (sparse, quantized or meta tensors are deep-copied instead)."""
    return (isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and not t.is_quantized and t.device.type != "meta")


def _tensors(obj):
    if _plain(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storages(state) -> list[torch.UntypedStorage]:
    """Every distinct storage under ``state``, in the order ``torch.save`` meets them."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in _tensors(state):
        s = t.untyped_storage()
        seen.setdefault(s._cdata, s)
    return list(seen.values())


def _rebuild(obj, hosts: dict[int, torch.UntypedStorage]):
    if _plain(obj):
        t = torch.empty(0, dtype=obj.dtype).set_(hosts[obj.untyped_storage()._cdata], obj.storage_offset(),
                                                 obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter(t, requires_grad=obj.requires_grad)
        return t.requires_grad_(obj.requires_grad)  # torch.save keeps the flag: the same bytes
    if isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict) and key order
        for k, v in obj.items():
            new[k] = _rebuild(v, hosts)
        return new
    if isinstance(obj, list):
        new = copy.copy(obj)
        new[:] = [_rebuild(v, hosts) for v in obj]
        return new
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        items = [_rebuild(v, hosts) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)  # numbers, strings, loss scalers, enums: nothing a later step may change in place


def host_available_bytes() -> int | None:
    """Host memory this process may still take: the kernel's MemAvailable, lowered to the cgroup's limit (a Slurm
    job's memory) where one is set. None: unknown."""
    avail = None
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in (_CGROUP_V2, _CGROUP_V1):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" or v1's huge number: no limit
            room = max(0, int(limit) - usage)
            avail = room if avail is None else min(avail, room)
        break
    return avail


def host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
