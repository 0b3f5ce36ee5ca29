"""Start a run: discover ranks (torchrun | Slurm | MPI), create the process group through DeepSpeed,
build the TP/PP/DP groups and seed every RNG."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from megatron import ds_seams, rendezvous, topology
from megatron.core import parallel_state
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import set_seeds
from megatron.core import tracking
from megatron.errors import DistributedError
from megatron.progress import PROGRESS, Identity, this_gcd, this_host
from megatron.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, rendezvous_store


def _discover(master_addr: str | None = None, master_port: int | None = None):
    """This rank's RankInfo from the launcher's environment, with rank 0's address as the run will use it
    (--master-addr / --master-port, checked against the Slurm job: see megatron/rendezvous.py)."""

    info, note = rendezvous.resolve_master(topology.discover_ranks(os.environ), os.environ, master_addr, master_port)
    if note and info.rank == 0:
        print(f"> {note}", flush=True)
    return info


def quiet_deepspeed() -> None:
    """DeepSpeed logs INFO on every rank; keep its warnings and errors only."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def initialize_distributed(backend: str | None = None, timeout_minutes: float = 10.0, master_addr: str | None = None,
                           master_port: int | None = None,
                           rendezvous_timeout_secs: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
                           track_collectives: bool = True) -> tuple[int, int]:
    """Create the default process group (idempotent). Returns (rank, world_size).

    ``backend`` None means the accelerator's own (gloo on CPU, nccl = RCCL on ROCm). The timeout
    bounds every collective, so a dead or stuck peer becomes an error instead of a hang. Meeting rank 0
    (the c10d store at master_addr:master_port) is bounded by ``rendezvous_timeout_secs`` instead: an
    address where nothing listens is one line within that time, not torch's 10 minutes of retries.

    Every later process group (ours and DeepSpeed's) gets the same timeout, and with ``track_collectives`` every
    collective records where this rank waits (megatron/core/tracking.py, read by the hang watchdog).
    """
    quiet_deepspeed()
    if dist.is_initialized():
        tracking.install(timedelta(minutes=timeout_minutes), track_collectives)
        return dist.get_rank(), dist.get_world_size()
    info = _discover(master_addr, master_port)
    rank, world_size, local_rank = info.rank, info.world_size, info.local_rank
    addr, port = info.master_addr, str(info.master_port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=addr, MASTER_PORT=port)
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        # One process per GCD: under `--gpus-per-task=1` each sees one device, index 0.
        acc.set_device(local_rank % max(1, acc.device_count()))
    backend = usable_backend(backend, acc.communication_backend_name(), rank)
    timeout = timedelta(minutes=timeout_minutes)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = rendezvous_store(info, rendezvous_timeout_secs, timeout, agent_store)
    try:
        # The group is created on our bounded store; DeepSpeed then adopts it (init_distributed wraps an
        # initialised torch.distributed instead of creating a second group).
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                             **_device_id_kwargs(acc, local_rank, world_size))
        ds_seams.skip_shm_comm_op()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, distributed_port=int(port),
                                   timeout=timeout, rank=rank, world_size=world_size)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"could not create the {backend} process group at {addr}:{port} as rank {rank}/{world_size} ({e}); "
            "check MASTER_ADDR/MASTER_PORT and that every rank was launched",
            every_rank=True,  # the ranks that could not join may not include rank 0
        ) from e
    tracking.install(timeout, track_collectives)
    gcd = "-" if acc.device_name() == "cpu" else this_gcd(local_rank, acc.device_count())
    PROGRESS.identity = Identity(rank, this_host(), gcd)
    return rank, world_size


def usable_backend(requested: str | None, accelerator_backend: str, rank: int = 0) -> str:
    """The backend to create: the requested one, or the accelerator's own when none is requested or when
    ``nccl`` is requested from a torch without NCCL (a CPU build): upstream's job scripts pass
    ``--distributed-backend nccl`` (its default), which on CPU can only mean the accelerator's collective library
    (gloo), with the same collectives. Said once, by rank 0."""
    if requested is None:
        return accelerator_backend
    if requested == "nccl" and not torch.distributed.is_nccl_available() and accelerator_backend != "nccl":
        if rank == 0:
            print(f"> --distributed-backend nccl: this torch has no NCCL; using {accelerator_backend}, the "
                  "accelerator's own backend (the same collectives)", flush=True)
        return accelerator_backend
    return requested


def _device_id_kwargs(acc, local_rank: int, world_size: int) -> dict:
    """What DeepSpeed's own init_process_group passes: the bound device on CUDA/ROCm for a multi-rank job (torch
    then builds later groups with ncclCommSplit), except on the torch releases where that hangs (2.6 < v < 2.7.1)."""
    import inspect

    from packaging import version

    v = version.parse(torch.__version__)
    if (world_size == 1 or acc.device_name() != "cuda" or version.parse("2.6.0") < v < version.parse("2.7.1")
            or "device_id" not in inspect.signature(torch.distributed.init_process_group).parameters):
        return {}
    return {"device_id": acc.device(local_rank % max(1, acc.device_count()))}


def initialize_megatron(tp: int = 1, pp: int = 1, seed: int = 1234, backend: str | None = None,
                        timeout_minutes: float = 10.0, master_addr: str | None = None, master_port: int | None = None,
                        rendezvous_timeout_secs: float = DEFAULT_RENDEZVOUS_TIMEOUT_S, ulysses: int = 1,
                        track_collectives: bool = True, ep: int | None = None) -> ParallelState:
    """Process group + parallel groups + seeds; registers and returns the ParallelState. ``ep``: the expert-parallel
    size of a model with experts (None: no expert groups)."""
    initialize_distributed(backend, timeout_minutes, master_addr, master_port, rendezvous_timeout_secs,
                           track_collectives)
    state = ParallelState.build(tp, pp, ulysses_size=ulysses, ep_size=ep)
    parallel_state.set_parallel_state(state)
    set_seeds(seed, tp_rank=state.tp.rank, pp_rank=state.pp.rank)
    return state


def shutdown(barrier: bool = True) -> None:
    """Barrier then destroy the process group: exiting without it aborts ~1 run in 5 under gloo. ``barrier=False``
    after an error: the peers may be gone or stuck, and a failing barrier would replace the error being raised."""
    if dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    parallel_state.set_parallel_state(None)
