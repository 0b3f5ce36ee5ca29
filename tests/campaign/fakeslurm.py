"""A stand-in Slurm for the campaign tests: ``sbatch``, ``squeue``, ``scontrol``, ``scancel`` and ``srun`` that record
every call and run jobs on this machine, one at a time, with the environment real Slurm gives them.

State lives in ``$FAKE_SLURM_DIR``: ``jobs/<id>.json`` (one record per job), ``calls.jsonl`` (every command call),
``spool/<id>/slurm_script`` (sbatch's copy of the script), ``logs/<name>-<id>.out`` (the job's output) and
``steps/<id>.json`` (the pids and hosts of the ranks of the job's last step). ``install(bin_dir)`` writes the five
commands; ``Scheduler`` runs the queue: the next pending job whose ``afterany`` dependency has ended, on nodes of a
fake machine (``$FAKE_SLURM_NODES`` of them in the submitter's environment, default 8) minus its excluded ones (a
range ``-N MIN-MAX`` gets as many as are left, up to MAX; fewer than MIN: the job stays pending), with
``SLURM_JOB_END_TIME`` = start + its time limit, SIGTERM to the whole job at that time and SIGKILL ``kill_wait``
seconds later (what Slurm does at the limit). ``--signal`` is recorded, not sent: tests send their signals
themselves, at the moment they choose (a 45 s job and a 120 s lead would signal at once). ``scontrol update``
changes a pending job's ExcNodeList, TimeLimit and NumNodes (N or MIN-MAX). ``srun`` starts
``$FAKE_SRUN_RANKS`` ranks (else ``$FAKE_SRUN_RANKS_PER_NODE`` per node, else its ``-n``) over its ``-N`` nodes,
block distribution, with the variables megatron/topology.py discover_ranks reads (started through tests/launch/),
and forwards the signals it receives to every rank. Stdlib only (plus megatron/topology.py's hostlist parser and tests/launch/).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.topology import parse_nodelist  # noqa: E402
from tests.launch import TIMED_OUT, start_ranks  # noqa: E402

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "srun")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
NODES = [f"frontier{i:05d}" for i in range(1, 9)]
# sbatch options that take a value, short -> long
_SHORT = {"-N": "nodes", "-t": "time", "-J": "job-name", "-A": "account", "-p": "partition", "-q": "qos",
          "-d": "dependency", "-x": "exclude", "-o": "output", "-C": "constraint", "-S": "core-spec",
          "-D": "chdir", "-e": "error", "-n": "ntasks", "-c": "cpus-per-task"}
_FLAGS = {"parsable"}  # long options without a value


def _state() -> str:
    return os.environ["FAKE_SLURM_DIR"]


def _path(*parts: str) -> str:
    return os.path.join(_state(), *parts)


@contextlib.contextmanager
def _locked():
    os.makedirs(_state(), exist_ok=True)
    with open(_path("lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _record_call(argv: list[str]) -> None:
    with _locked(), open(_path("calls.jsonl"), "a") as f:
        f.write(json.dumps({"cmd": os.path.basename(argv[0]), "args": argv[1:], "time": time.time(),
                            "from_job": os.environ.get("SLURM_JOB_ID")}) + "\n")


def load_job(job_id: str) -> dict | None:
    try:
        with open(_path("jobs", f"{job_id}.json")) as f:
            return json.load(f)
    except OSError:
        return None


def save_job(job: dict) -> None:
    os.makedirs(_path("jobs"), exist_ok=True)
    tmp = _path("jobs", f"{job['id']}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(job, f, indent=1, sort_keys=True)
    os.replace(tmp, _path("jobs", f"{job['id']}.json"))


def all_jobs() -> list[dict]:
    d = _path("jobs")
    if not os.path.isdir(d):
        return []
    jobs = [load_job(n[:-5]) for n in os.listdir(d) if n.endswith(".json")]
    return sorted((j for j in jobs if j), key=lambda j: int(j["id"]))


def calls(cmd: str | None = None) -> list[dict]:
    try:
        with open(_path("calls.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    except OSError:
        return []
    return [r for r in rows if cmd is None or r["cmd"] == cmd]


def seconds(limit: str) -> int:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days = 0
    if "-" in limit:
        d, limit = limit.split("-", 1)
        days = int(d)
        parts = [int(p) for p in limit.split(":")] + [0, 0]
        return days * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    parts = [int(p) for p in limit.split(":")]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def clock(secs: int) -> str:
    h, rest = divmod(int(secs), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _parse_options(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """sbatch's options (long names) and the rest (script, its arguments)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i].startswith("-"):
        w = words[i]
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            if not eq and name not in _FLAGS:
                i += 1
                value = words[i]
            opts[name] = value
        else:
            key = w[:2]
            value = w[2:] or words[i + 1]
            i += 0 if w[2:] else 1
            opts[_SHORT.get(key, key)] = value
        i += 1
    return opts, words[i:]


def _script_options(path: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s.startswith("#SBATCH"):
                o, _ = _parse_options(s[len("#SBATCH"):].split())
                opts.update(o)
            elif s and not s.startswith("#"):
                break
    return opts


def sbatch(argv: list[str]) -> int:
    opts, rest = _parse_options(argv)
    if not rest:
        print("sbatch: error: no script", file=sys.stderr)
        return 1
    script, args = rest[0], rest[1:]
    merged = {**_script_options(script), **opts}
    with _locked():
        n = int(open(_path("next_id")).read()) if os.path.exists(_path("next_id")) else 1001
        open(_path("next_id"), "w").write(str(n + 1))
    job_id = str(n)
    spool = _path("spool", job_id)
    os.makedirs(spool, exist_ok=True)
    copy = shutil.copy(script, os.path.join(spool, "slurm_script"))
    env = dict(os.environ)
    export = merged.get("export", "ALL")
    for item in export.split(",")[1:] if export.startswith("ALL") else []:
        k, _, v = item.partition("=")
        env[k] = v
    dep = merged.get("dependency", "")
    job = {"id": job_id, "name": merged.get("job-name") or os.path.basename(script), "script": copy,
           "submitted_script": os.path.abspath(script), "args": args, "env": env,
           "cwd": merged.get("chdir") or os.getcwd(), "dependency": dep,
           **_node_range(str(merged.get("nodes", "1"))), "time": merged.get("time", "1:00:00"),
           "qos": merged.get("qos", "normal"), "partition": merged.get("partition", "batch"),
           "account": merged.get("account", ""), "exclude": merged.get("exclude", ""),
           "signal": merged.get("signal", ""), "state": "PENDING", "submitted": time.time(),
           "submitted_by": os.environ.get("SLURM_JOB_ID"), "options": merged}
    save_job(job)
    print(job_id if "parsable" in merged else f"Submitted batch job {job_id}")
    return 0


def _node_range(value: str) -> dict[str, int]:
    """``-N N`` or ``-N MIN-MAX``: ``nodes`` is the most a job takes, ``min_nodes`` the fewest it starts on."""
    low, _, high = value.partition("-")
    return {"min_nodes": int(low), "nodes": int(high or low)}


def hosts_for(job: dict) -> list[str]:
    """The nodes the job would start on now: the machine's, less the excluded ones, up to its node count."""
    excluded = set(filter(None, job["exclude"].split(",")))
    machine = NODES[:int(job["env"].get("FAKE_SLURM_NODES") or len(NODES))]
    return [h for h in machine if h not in excluded][:job["nodes"]]


def squeue(argv: list[str]) -> int:
    job_id = argv[argv.index("-j") + 1] if "-j" in argv else None
    fmt = argv[argv.index("-o") + 1] if "-o" in argv else "%i %T"
    for job in all_jobs():
        if job_id is not None and job["id"] != job_id:
            continue
        if job_id is None and job["state"] in FINAL:
            continue
        end = job.get("end_time")
        values = {"%i": job["id"], "%T": job["state"], "%j": job["name"], "%l": clock(seconds(job["time"])),
                  "%e": datetime.datetime.fromtimestamp(end).strftime("%Y-%m-%dT%H:%M:%S") if end else "N/A",
                  "%L": clock(max(0, end - time.time())) if end and job["state"] == "RUNNING" else "N/A"}
        line = fmt
        for k, v in values.items():
            line = line.replace(k, str(v))
        print(line)
    return 0


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(parse_nodelist(argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"])))
        return 0
    if argv and argv[0] == "update":
        fields = dict(a.split("=", 1) for a in argv[1:])
        job = load_job(fields.pop("JobId", ""))
        if job is None:
            print("scontrol: error: Invalid job id specified", file=sys.stderr)
            return 1
        if job["state"] != "PENDING":
            print(f"scontrol: error: Job {job['id']} is not pending", file=sys.stderr)
            return 1
        for k, v in fields.items():
            if k == "ExcNodeList":
                job["exclude"] = v
            elif k == "TimeLimit":
                job["time"] = v
            elif k == "NumNodes":
                job.update(_node_range(v))
            else:
                job.setdefault("updates", {})[k] = v
        save_job(job)
        return 0
    print(f"scontrol (fake): unsupported: {argv}", file=sys.stderr)
    return 1


def scancel(argv: list[str]) -> int:
    for job_id in (a for a in argv if not a.startswith("-")):
        job = load_job(job_id)
        if job is None:
            print(f"scancel: error: Invalid job id {job_id}", file=sys.stderr)
            return 1
        if job["state"] == "PENDING":
            job["state"] = "CANCELLED"
            save_job(job)
        elif job["state"] == "RUNNING":
            job["cancel_requested"] = True
            save_job(job)
    return 0


def srun(argv: list[str]) -> int:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        w = argv[i]
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            if not eq:
                i += 1
                value = argv[i]
            opts[name] = value
        else:
            key = {"-N": "nodes", "-n": "ntasks", "-c": "cpus-per-task", "-t": "time"}.get(w[:2], w[:2])
            value = w[2:] or argv[i + 1]
            i += 0 if w[2:] else 1
            opts[key] = value
        i += 1
    cmd = argv[i:]
    hosts = parse_nodelist(os.environ.get("SLURM_JOB_NODELIST", "localhost"))
    nnodes = int(opts.get("nodes", len(hosts)))
    hosts = hosts[:nnodes]
    per_node = os.environ.get("FAKE_SRUN_RANKS_PER_NODE")  # ranks follow the job's node count (grow / shrink)
    ntasks = int(os.environ.get("FAKE_SRUN_RANKS") or (per_node and int(per_node) * nnodes) or opts.get("ntasks")
                 or nnodes)
    if "ntasks-per-node" in opts and "ntasks" not in opts:
        ntasks = nnodes * int(opts["ntasks-per-node"])
    per = -(-ntasks // nnodes)
    counts = [min(per, ntasks - k * per) for k in range(nnodes) if ntasks - k * per > 0]
    def slurm_vars(rank: int, world: int, port: int) -> dict[str, str]:
        node = rank // per
        return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank - node * per), "SLURM_NODEID": str(node),
                "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
                "SLURM_STEP_TASKS_PER_NODE": ",".join(str(c) for c in counts), "SLURM_STEP_NODELIST": ",".join(hosts),
                "SLURM_STEP_NUM_NODES": str(len(counts)), "SLURMD_NODENAME": hosts[node],
                "SLURM_CPUS_PER_TASK": opts.get("cpus-per-task", "1")}

    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    ranks = start_ranks(ntasks, cmd, environ=environ, rank_vars=slurm_vars, cwd=os.getcwd())
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    os.makedirs(_path("steps"), exist_ok=True)
    with open(_path("steps", f"{job_id}.json"), "w") as f:
        json.dump([{"rank": r, "pid": p.pid, "host": hosts[r // per]} for r, p in enumerate(ranks.procs)], f)

    def forward(signum, frame):
        for p in ranks.procs:
            with contextlib.suppress(OSError):
                p.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    # The job's end bounds the step, as under Slurm (the scheduler kills the whole job a little later).
    end = float(os.environ.get("SLURM_JOB_END_TIME") or time.time() + 3600)
    codes = [TIMED_OUT if c is None else c for c in ranks.wait(max(1.0, end - time.time() + 60))]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # what the ranks cost, for the tests' CPU budget
    with open(_path("steps", f"{job_id}.cpu"), "a") as f:
        f.write(f"{usage.ru_utime + usage.ru_stime:.2f}\n")
    bad = [c if c > 0 else 128 - c for c in codes if c != 0]
    return bad[0] if bad else 0


def main(argv: list[str]) -> int:
    """``argv``: the command's name, then its arguments."""
    name = argv[0]
    _record_call(argv)
    return {"sbatch": sbatch, "squeue": squeue, "scontrol": scontrol, "scancel": scancel, "srun": srun}[name](argv[1:])


def install(bin_dir: str, python: str = sys.executable) -> None:
    """Write the five commands into ``bin_dir`` (put it first on PATH)."""
    os.makedirs(bin_dir, exist_ok=True)
    for cmd in COMMANDS:
        path = os.path.join(bin_dir, cmd)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {python} {os.path.abspath(__file__)} {cmd} \"$@\"\n")
        os.chmod(path, 0o755)


@dataclass
class RunningJob:
    job: dict
    proc: subprocess.Popen
    log: str
    started: float
    end_time: float
    sent: list = field(default_factory=list)

    def output(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def ranks(self) -> list[dict]:
        """The ranks of the job's current step: [{"rank", "pid", "host"}] (empty before srun started them)."""
        try:
            with open(_path("steps", f"{self.job['id']}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return []

    def signal_batch_shell(self, sig: int) -> None:
        """What ``--signal=B:SIG`` does: the batch shell only."""
        self.sent.append(("batch", sig))
        self.proc.send_signal(sig)

    def signal_rank(self, rank: int, sig: int) -> None:
        pid = next(r["pid"] for r in self.ranks() if r["rank"] == rank)
        self.sent.append((f"rank{rank}", sig))
        os.kill(pid, sig)


class Scheduler:
    """Runs the queue one job at a time. ``watch(running)`` is called every ``poll`` seconds while a job runs."""

    def __init__(self, state_dir: str, kill_wait: float = 5.0, poll: float = 0.2) -> None:
        self.state_dir, self.kill_wait, self.poll = state_dir, kill_wait, poll

    def runnable(self) -> dict | None:
        jobs = {j["id"]: j for j in all_jobs()}
        for job in jobs.values():
            if job["state"] != "PENDING":
                continue
            dep = job["dependency"]
            if dep.startswith("afterany:"):
                before = jobs.get(dep.split(":", 1)[1])
                if before is not None and before["state"] not in FINAL:
                    continue
            elif dep:
                raise AssertionError(f"fake Slurm knows only afterany dependencies, job {job['id']} has {dep}")
            if len(hosts_for(job)) < job["min_nodes"]:
                continue  # Slurm keeps it pending until enough nodes are up
            return job
        return None

    def run(self, max_jobs: int = 20, watch=None, stop=None) -> list[dict]:
        """Run jobs until none is runnable, ``max_jobs`` ran, or ``stop(job_record)`` is true after one."""
        os.environ["FAKE_SLURM_DIR"] = self.state_dir
        ran = []
        while len(ran) < max_jobs:
            job = self.runnable()
            if job is None:
                break
            done = self.run_job(job, watch)
            ran.append(done)
            if stop is not None and stop(done):
                break
        return ran

    def run_job(self, job: dict, watch=None) -> dict:
        hosts = hosts_for(job)
        start = time.time()
        end = int(start + seconds(job["time"]))
        env = {k: v for k, v in job["env"].items() if not k.startswith("SLURM")}
        env.update(SLURM_JOB_ID=job["id"], SLURM_JOBID=job["id"], SLURM_JOB_NAME=job["name"],
                   SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_NNODES=str(len(hosts)),
                   SLURM_JOB_NODELIST=",".join(hosts), SLURM_NODELIST=",".join(hosts), SLURM_SUBMIT_DIR=job["cwd"],
                   SLURM_JOB_QOS=job["qos"], SLURM_JOB_PARTITION=job["partition"], SLURM_JOB_END_TIME=str(end),
                   SLURM_JOB_START_TIME=str(int(start)), FAKE_SLURM_DIR=self.state_dir)
        if job["account"]:
            env["SLURM_JOB_ACCOUNT"] = job["account"]
        os.makedirs(os.path.join(self.state_dir, "logs"), exist_ok=True)
        log = os.path.join(self.state_dir, "logs", f"{job['name']}-{job['id']}.out")
        job.update(state="RUNNING", start=start, end_time=end, hosts=hosts, log=log)
        save_job(job)
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", job["script"], *job["args"]], cwd=job["cwd"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        running = RunningJob(job, proc, log, start, end)
        timed_out = False
        while proc.poll() is None:
            now = time.time()
            if now >= end and not timed_out:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # Slurm at the limit: every process of the job
            if timed_out and now >= end + self.kill_wait:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if watch is not None and not timed_out:
                watch(running)
            time.sleep(self.poll)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # no process of the job outlives it
        job = load_job(job["id"])
        rc = proc.returncode
        try:
            with open(os.path.join(self.state_dir, "steps", f"{job['id']}.cpu")) as f:
                job["rank_cpu_s"] = sum(float(x) for x in f.read().split())
        except OSError:
            job["rank_cpu_s"] = 0.0
        job.update(rc=rc, ended=time.time(), timed_out=timed_out, sent=running.sent,
                   state="TIMEOUT" if timed_out else "COMPLETED" if rc == 0 else "FAILED")
        save_job(job)
        return job


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
