"""What would waste a Frontier job: reads an sbatch script and the environment its job step will get (this process's,
plus what the script and the files it sources, such as examples/frontier/env.sh, export: tools/shell_env.py), and
prints one line per problem. Run it by hand before submitting, or inside the job as every script of
examples/frontier/ does before srun. Exit 0 when clean, 1 otherwise; the scripts only warn.

    python tools/check_job.py examples/frontier/gpt22b.sbatch --save runs/gpt22b/checkpoints

Checks (facts in shared FRONTIER.md): walltime over the node-count bin's limit (or the partition's / QOS's; also
at ``CAMPAIGN_MIN_NODES``, the fewest nodes a successor may get), a job chain under ``-q debug``, a signal lead
shorter than the run's measured save, ``memhooks``, ``disable_rdzv_get`` without ``FI_CXI_RDZV_PROTO=alt_read``
(or the reverse), ``NCCL_NET=OFI`` on one node,
``--save`` on NFS or home, torchrun instead of srun, a training srun without ``-c7`` or ``--gpu-bind=closest``,
MIOpen caches on Lustre or home. Stdlib only: it starts in well under a second.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Collection, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.resilience.run_files import read_save_time  # noqa: E402
from tools.shell_env import script_environment  # noqa: E402

# (first node count, last node count, walltime limit in hours): OLCF's Frontier batch bins (shared FRONTIER.md)
BINS = ((1, 91, 2), (92, 183, 6), (184, 1881, 12), (1882, 5644, 12), (5645, 9472, 12))
EXTENDED_NODES, EXTENDED_HOURS, DEBUG_HOURS = 64, 24, 2
KILL_WAIT_S = 30  # what a job without --signal gets between SIGTERM and SIGKILL (a common KillWait)
NFS_PREFIXES = ("/ccs/home/", "/ccs/proj/", "/autofs/nccs-svm1_home1/", "/autofs/nccs-svm1_home2/",
                "/autofs/nccs-svm1_proj/")


def sbatch_options(text: str) -> dict[str, str]:
    """The script's ``#SBATCH`` options up to its first command (as sbatch reads them), by long name."""
    short = {"-N": "nodes", "-t": "time", "-q": "qos", "-p": "partition", "-J": "job-name", "-d": "dependency",
             "-C": "constraint", "-S": "core-spec", "-A": "account", "-o": "output"}
    out: dict[str, str] = {}
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("#SBATCH"):
            if not s or s.startswith("#"):
                continue
            break
        words = shlex.split(s[len("#SBATCH"):], comments=False)
        i = 0
        while i < len(words):
            w = words[i]
            if w.startswith("--"):
                name, _, value = w[2:].partition("=")
                out[name] = value
            elif w[:2] in short:
                value = w[2:] or (words[i + 1] if i + 1 < len(words) else "")
                i += 0 if w[2:] else 1
                out[short[w[:2]]] = value
            i += 1
    return out


def walltime_hours(value: str) -> float | None:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        return None
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:
        hours, minutes, seconds = a, b or 0, c or 0
    elif c is not None:
        hours, minutes, seconds = a, b, c
    elif b is not None:
        hours, minutes, seconds = 0, a, b
    else:
        hours, minutes, seconds = 0, a, 0
    return (days or 0) * 24 + hours + minutes / 60 + seconds / 3600


def commands(text: str) -> list[str]:
    """The script's command lines with continuations joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.rstrip()
        if not cur and s.lstrip().startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def file_system(path: str, mounts_file: str = "/proc/mounts") -> str | None:
    """The type of the file system holding ``path`` (longest mount point that prefixes it)."""
    path = os.path.abspath(path)
    best, kind = "", None
    try:
        with open(mounts_file) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


def _on_home_or_nfs(path: str, env: Mapping[str, str], mounts_file: str) -> str | None:
    full = os.path.abspath(path)
    home = env.get("HOME")
    if home and (full == home or full.startswith(home.rstrip("/") + "/")):
        return "your home directory"
    if full.startswith(NFS_PREFIXES):
        return "NFS (/ccs/home, /ccs/proj)"
    if (file_system(full, mounts_file) or "").startswith("nfs"):
        return "NFS"
    return None


def _on_lustre(path: str, mounts_file: str) -> bool:
    return os.path.abspath(path).startswith("/lustre/") or file_system(path, mounts_file) == "lustre"


def problems(script: str, text: str, env: Mapping[str, str], save: str | None = None, nodes: int | None = None,
             time: str | None = None, mounts_file: str = "/proc/mounts", maybe: Collection[str] = ()) -> list[str]:
    """One line per problem of ``script`` (its ``text``) whose job step gets ``env`` (the values known before it
    runs); ``maybe``: variables it may get, or get with a value known only then (set under a condition, from
    ``$(...)``): they pass the "unset" checks and are not judged by value."""
    opts = sbatch_options(text)
    cmds = commands(text)
    trains = any("pretrain_gpt.py" in c for c in cmds)
    saves = trains and any("--save" in c for c in cmds)  # a run with checkpoints to lose at the time limit
    out = []
    n = nodes or _int(env.get("SLURM_JOB_NUM_NODES")) or _int(opts.get("nodes", "").split("-")[0]) or 1
    qos = env.get("SLURM_JOB_QOS") or opts.get("qos", "")
    partition = env.get("SLURM_JOB_PARTITION") or opts.get("partition", "")
    t = time or opts.get("time")
    hours = walltime_hours(t) if t else None

    # walltime: the partition's or QOS's limit, else the node-count bin's
    if partition == "extended":
        if n > EXTENDED_NODES:
            out.append(f"{n} nodes in the extended partition, which takes at most {EXTENDED_NODES}: use the batch "
                       "partition")
        if hours is not None and hours > EXTENDED_HOURS:
            out.append(f"walltime {t} is over the extended partition's {EXTENDED_HOURS} h: the job will not start; "
                       f"ask for -t {EXTENDED_HOURS}:00:00 or less")
    elif qos == "debug":
        if hours is not None and hours > DEBUG_HOURS:
            out.append(f"walltime {t} is over -q debug's {DEBUG_HOURS} h: ask for -t 02:00:00 or less")
    elif hours is not None:
        limit = next((h for lo, hi, h in BINS if lo <= n <= hi), None)
        fewest = _int(env.get("CAMPAIGN_MIN_NODES"))  # the fewest nodes a successor may get (campaign.sh: -N MIN-n)
        low = next((h for lo, hi, h in BINS if lo <= fewest <= hi), None) if fewest and fewest < n else None
        if limit is not None and hours > limit:
            out.append(f"walltime {t} is over the {limit} h limit of {n} nodes (OLCF's bin for {_bin(n)} nodes): "
                       f"the job will not start; ask for -t {limit:02d}:00:00 or less, and let the job chain "
                       "(examples/frontier/campaign.sh) do the rest")
        elif low is not None and hours > low:
            out.append(f"CAMPAIGN_MIN_NODES={fewest}: a successor granted {fewest} nodes would ask for walltime {t}, "
                       f"over the {low} h limit of OLCF's bin for {_bin(fewest)} nodes: keep CAMPAIGN_MIN_NODES in "
                       f"this job's bin ({_bin(n)} nodes), or ask for -t {low:02d}:00:00")

    # chaining under -q debug: prohibited by OLCF
    chains = "dependency" in opts or any(re.search(r"\bsbatch\b.*(--dependency|\s-d\s)", c) for c in cmds)
    if qos == "debug" and (chains or env.get("CAMPAIGN_PREV")):
        out.append("a job chain under -q debug (OLCF prohibits chaining there): submit without -q debug, or run "
                   "one job alone (CAMPAIGN_CHAIN=0)")

    # signal lead vs the run's measured save
    lead_m = re.search(r"@(\d+)", opts.get("signal", ""))
    lead = int(lead_m.group(1)) if lead_m else None
    last = read_save_time(save)
    if saves and lead is None:
        out.append(f"no #SBATCH --signal: at the time limit Slurm sends SIGTERM and kills ~{KILL_WAIT_S} s later; "
                   "add #SBATCH --signal=B:USR1@300 (the script forwards it to the ranks, which save and exit)")
    elif saves and lead is not None and last is not None and float(last["save_secs"]) > lead:
        secs = float(last["save_secs"])
        out.append(f"signal lead {lead} s is shorter than this run's last save ({secs:.0f} s, job "
                   f"{last.get('job', '?')}): ask for #SBATCH --signal=B:USR1@{30 * (int(1.2 * secs + 15) // 30 + 1)}")

    # libfabric
    script_env = " ".join(cmds)
    if env.get("FI_MR_CACHE_MONITOR") == "memhooks" or "FI_MR_CACHE_MONITOR=memhooks" in script_env:
        out.append("FI_MR_CACHE_MONITOR=memhooks deadlocks RCCL on Slingshot: use kdreg2 (the default) or "
                   "userfaultfd")
    no_get = "disable_rdzv_get" in opts.get("network", "")
    alt_read = env.get("FI_CXI_RDZV_PROTO") == "alt_read"
    if no_get and not alt_read and "FI_CXI_RDZV_PROTO" not in maybe:
        out.append("#SBATCH --network=disable_rdzv_get without FI_CXI_RDZV_PROTO=alt_read: export both (env.sh does)")
    elif alt_read and not no_get:
        out.append("FI_CXI_RDZV_PROTO=alt_read without #SBATCH --network=disable_rdzv_get: request both, or unset "
                   "FI_CXI_RDZV_PROTO")
    if env.get("NCCL_NET") == "OFI" and n == 1:
        out.append("NCCL_NET=OFI on one node: the network plugin never initialises there and RCCL fails; use "
                   "NCCL_NET=Socket (env.sh sets it by node count)")

    # where things are written
    if save:
        where = _on_home_or_nfs(save, env, mounts_file)
        if where:
            out.append(f"--save {save} is on {where}: slow and small for checkpoints; use Lustre "
                       "(/lustre/orion/<project>/...)")
    if trains:
        for name in ("MIOPEN_USER_DB_PATH", "MIOPEN_CUSTOM_CACHE_DIR"):
            value = env.get(name)
            if not value and name not in maybe:
                out.append(f"{name} is unset: MIOpen keeps its cache in $HOME, which thousands of ranks lock; set "
                           "it to a node-local folder such as /tmp/$USER-miopen-cache (env.sh does)")
            elif value and (_on_lustre(value, mounts_file) or _on_home_or_nfs(value, env, mounts_file)):
                out.append(f"{name}={value} is on a shared file system: MIOpen's database locks fail there; use a "
                           "node-local folder such as /tmp/$USER-miopen-cache")

    # launch
    if any(re.search(r"\btorchrun\b|torch\.distributed\.(run|launch)", c) for c in cmds):
        out.append("torchrun: launch with srun, one task per GCD (OLCF measured minutes of start-up under "
                   "torchrun, and it does not forward SIGUSR1)")
    for c in cmds:
        if not re.search(r"\bsrun\b", c) or "pretrain_gpt.py" not in c or "torchrun" in c:
            continue  # (a torchrun line is reported above, once)
        words = c.split()
        if not ({"-c7", "--cpus-per-task=7"} & set(words) or re.search(r"(-c|--cpus-per-task)\s+7\b", c)):
            out.append("srun without -c7: each rank needs its 7 cores of the GCD's L3 region (srun -c7)")
        if "--gpu-bind=closest" not in words:
            out.append("srun without --gpu-bind=closest: ranks land on far GCDs (srun --gpu-bind=closest)")
    return [f"check_job: {os.path.basename(script)}: {p}" for p in out]


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _bin(n: int) -> str:
    lo, hi, _ = next(b for b in BINS if b[0] <= n <= b[1])
    return f"{lo}-{hi}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="the sbatch script (inside a job: $0)")
    p.add_argument("--save", default=None, help="the run's --save folder (default: $CKPT_DIR)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the job's, else the script's -N)")
    p.add_argument("--time", default=None, help="walltime (default: the script's -t)")
    a = p.parse_args(argv)
    try:
        with open(a.script) as f:
            text = f.read()
    except OSError as e:
        print(f"check_job: cannot read {a.script}: {e.strerror}", file=sys.stderr)
        return 2
    env = script_environment(a.script, text, os.environ, os.getcwd())
    found = problems(a.script, text, env, a.save or os.environ.get("CKPT_DIR"), a.nodes, a.time, maybe=env.maybe)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
