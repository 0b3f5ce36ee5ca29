"""Where rank 0 listens (--master-addr / --master-port / MASTER_ADDR, checked against the Slurm job) and a
rendezvous that ends in one line within --rendezvous-timeout-secs instead of torch's 10 minutes of retries.

The ORNL/OLCF Frontier launchers export ``MASTER_ADDR=$SLURM_SUBMIT_HOST`` (a login node, where nothing listens);
the ORNL fork never noticed because it replaced the address by rank 0's own. Here an address that is not a node
of the job is replaced by the node rank 0 runs on, with one log line, so those scripts run as written.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

from megatron.errors import DistributedError
from megatron.topology import RankInfo, parse_nodelist

DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0
_PROBE_INTERVAL_S = 0.5
_LOOPBACK = "127.0.0.1"


def _short(name: str) -> str:
    """``frontier00012.frontier.olcf.ornl.gov`` / ``frontier00012-hsn0`` -> ``frontier00012``."""
    return re.sub(r"-hsn\d+$", "", name.split(".")[0])


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


def _same_host(addr: str, host: str) -> bool:
    """Whether the IP literal ``addr`` is one of ``host``'s addresses (False when ``host`` does not resolve)."""
    try:
        return addr in socket.gethostbyname_ex(host)[2]
    except OSError:
        return False


def _job_nodes(env: Mapping[str, str]) -> tuple[list[str], list[str]] | None:
    """(the job's nodes, the step's nodes: rank 0 runs on its first) from Slurm's variables, or None outside Slurm."""
    job = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    step = env.get("SLURM_STEP_NODELIST") or job
    if not job:
        return None
    return parse_nodelist(job), parse_nodelist(step)


def _not_a_job_node(addr: str, info: RankInfo, nodes: list[str], env: Mapping[str, str]) -> bool:
    """True when ``addr`` certainly is not where rank 0 runs. An IP literal is only judged when it is loopback
    (wrong across nodes) or the submit host's address: any other IP may be a node's network interface."""
    if _is_ip(addr):
        if ipaddress.ip_address(addr).is_loopback:
            return info.local_world_size < info.world_size
        submit = env.get("SLURM_SUBMIT_HOST")
        return bool(submit) and _short(submit) not in {_short(n) for n in nodes} and _same_host(addr, submit)
    if addr == "localhost":
        return info.local_world_size < info.world_size
    return _short(addr) not in {_short(n) for n in nodes}


def resolve_master(info: RankInfo, env: Mapping[str, str], master_addr: str | None = None,
                   master_port: int | None = None) -> tuple[RankInfo, str | None]:
    """``info`` with rank 0's address and port as this run will use them, and a log line when one was changed.

    Precedence: --master-addr / --master-port, then MASTER_ADDR / MASTER_PORT (already in ``info``). Under
    torchrun the launcher's values stay (its agent's store listens there). Under a Slurm step with more than one
    rank, an address that is not a node of the job becomes the first node of the step (where srun puts rank 0).
    """
    notes = []
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun itself, not just RANK/WORLD_SIZE variables
        given = [f"{flag} {v}" for flag, v, cur in (("--master-addr", master_addr, info.master_addr),
                                                     ("--master-port", master_port, info.master_port))
                 if v is not None and str(v) != str(cur)]
        if given:
            notes.append(f"{' and '.join(given)} not used: torchrun already set MASTER_ADDR={info.master_addr} "
                         f"MASTER_PORT={info.master_port} (its own store listens there)")
        return info, "; ".join(notes) or None
    if master_addr:
        info = replace(info, master_addr=master_addr)
    if master_port is not None:
        info = replace(info, master_port=master_port)
    nodes = _job_nodes(env) if "SLURM_PROCID" in env and info.world_size > 1 else None
    if nodes is not None:
        job_nodes, step_nodes = nodes
        if step_nodes and _not_a_job_node(info.master_addr, info, job_nodes, env):
            origin = "--master-addr" if master_addr else "MASTER_ADDR"
            job = env.get("SLURM_JOB_ID", "?")
            notes.append(f"{origin}={info.master_addr} is not a node of Slurm job {job} "
                         f"({env.get('SLURM_JOB_NODELIST') or env.get('SLURM_NODELIST')}): rank 0 listens on "
                         f"{step_nodes[0]}, the step's first node; using that")
            info = replace(info, master_addr=step_nodes[0])
    return info, "; ".join(notes) or None


def _wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Poll rank 0's port with plain connects (silent, unlike torch's client, which logs every retry)."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as e:  # refused, unreachable, unresolvable, timed out: rank 0 may simply be late
            last = e.strerror or type(e).__name__
        if time.monotonic() + _PROBE_INTERVAL_S > deadline:
            raise DistributedError(
                f"cannot reach rank 0's rendezvous at {addr}:{port} within {timeout_s:g} s "
                f"(--rendezvous-timeout-secs; last error: {last}): set --master-addr/MASTER_ADDR to the node "
                "running rank 0 and check that rank 0 started", every_rank=True)
        time.sleep(_PROBE_INTERVAL_S)


def rendezvous_store(info: RankInfo, timeout_s: float, pg_timeout: timedelta, agent_store: bool = False):
    """The c10d store every rank meets on, created within ``timeout_s`` or a one-line DistributedError.

    Rank 0 hosts it (unless a torchrun agent does: ``agent_store``) and waits at most ``timeout_s`` for the
    other ranks; they wait at most ``timeout_s`` for it to listen. Its timeout is then raised to the process
    group's, which bounds every later store operation as before.
    """
    from torch.distributed import HashStore, TCPStore

    addr, port, rank, world = info.master_addr, info.master_port, info.rank, info.world_size
    if world == 1 and not agent_store:
        return HashStore()  # nobody to meet: no port to bind, so concurrent single-process runs never collide
    server = rank == 0 and not agent_store
    if not server:
        _wait_until_listening(addr, port, timeout_s)
    try:
        # The server listens on every interface whatever the host name; rank 0's own client reaches it over
        # loopback, so a MASTER_ADDR that rank 0 cannot resolve fails on the ranks that need it, in one line each.
        # wait_for_workers: every client counts itself in, and the server returns once all have (or times out).
        store = TCPStore(_LOOPBACK if server else addr, port, world, is_master=server,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=True)
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError subclass RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if server and ("listen" in first or "EADDRINUSE" in first):
            raise DistributedError(f"rank 0 cannot listen on port {port} for the rendezvous ({first}): pick a free "
                                   "--master-port / MASTER_PORT", every_rank=True) from None
        who = "the other ranks did not all reach" if server else "cannot join"
        raise DistributedError(
            f"{who} the rendezvous at {addr}:{port} within {timeout_s:g} s (--rendezvous-timeout-secs; {first}): "
            "check that every rank was launched and that --master-addr/MASTER_ADDR is rank 0's node",
            every_rank=True) from None
    store.set_timeout(pg_timeout)
    return store
