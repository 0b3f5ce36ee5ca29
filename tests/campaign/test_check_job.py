"""tools/check_job.py: each mistake that wastes a Frontier job is one line; a clean script and environment are
silent with exit 0. (That every example script passes in the environment env.sh gives it is checked in
tests/unit/test_launch_scripts.py, where the scripts run check_job themselves.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools import check_job, shell_env

CLEAN = """#!/bin/bash
#SBATCH -J run
#SBATCH -N 4
#SBATCH -t 02:00:00
#SBATCH --signal=B:USR1@300
#SBATCH -S 8
#SBATCH --network=disable_rdzv_get
set -euo pipefail
campaign_run srun -N 4 -n 32 -c7 --gpus-per-task=1 --gpu-bind=closest \\
    "$PYTHON" pretrain_gpt.py --save "$CKPT_DIR" --load "$CKPT_DIR"
"""
ENV = {"FI_CXI_RDZV_PROTO": "alt_read", "FI_MR_CACHE_MONITOR": "kdreg2", "NCCL_NET": "OFI",
       "MIOPEN_USER_DB_PATH": "/tmp/u-miopen", "MIOPEN_CUSTOM_CACHE_DIR": "/tmp/u-miopen", "HOME": "/ccs/home/u"}
SAVE = "/lustre/orion/abc123/scratch/u/run/checkpoints"


SWAPS = {"nodes": "#SBATCH -N 4", "time": "#SBATCH -t 02:00:00", "signal": "#SBATCH --signal=B:USR1@300",
         "network": "#SBATCH --network=disable_rdzv_get", "set": "set -euo pipefail",
         "srun": "campaign_run srun -N 4 -n 32 -c7 --gpus-per-task=1 --gpu-bind=closest \\"}
"""Lines of CLEAN a case may replace (by key) with its own lines, or drop (an empty replacement)."""


# name -> (script edits, environment changes, keyword arguments, the words the one line must hold)
CASES = {
    "walltime over the 1-91 node bin": ({"time": "#SBATCH -t 03:00:00"}, {}, {}, "over the 2 h limit of 4 nodes"),
    "walltime over the 92-183 node bin": ({"nodes": "#SBATCH -N 100", "time": "#SBATCH -t 07:00:00"},
                                          {"NCCL_NET": "OFI"}, {}, "over the 6 h limit of 100 nodes"),
    "a successor's fewest nodes in a shorter bin": (
        {"nodes": "#SBATCH -N 100", "time": "#SBATCH -t 06:00:00"}, {"CAMPAIGN_MIN_NODES": "80"}, {},
        "CAMPAIGN_MIN_NODES=80: a successor granted 80 nodes would ask for walltime 06:00:00, over the 2 h limit of "
        "OLCF's bin for 1-91"),
    "extended partition, too many nodes": ({"nodes": "#SBATCH -N 80\n#SBATCH -p extended"}, {}, {},
                                           "80 nodes in the extended partition"),
    "debug QOS over 2 h": ({"time": "#SBATCH -t 03:00:00\n#SBATCH -q debug"}, {}, {}, "over -q debug's 2 h"),
    "a chain under -q debug": ({"time": "#SBATCH -t 01:00:00\n#SBATCH -q debug",
                                "set": 'set -euo pipefail\nsbatch --dependency=afterany:"$SLURM_JOB_ID" "$0"'}, {}, {},
                               "a job chain under -q debug"),
    "a successor running in -q debug": ({}, {"SLURM_JOB_QOS": "debug", "CAMPAIGN_PREV": "1234"}, {},
                                        "a job chain under -q debug"),
    "no signal lead": ({"signal": ""}, {}, {}, "no #SBATCH --signal"),
    "signal lead shorter than the save": ({}, {}, {"save_secs": 400.0}, "signal lead 300 s is shorter than this "
                                                                        "run's last save (400 s"),
    "memhooks": ({}, {"FI_MR_CACHE_MONITOR": "memhooks"}, {}, "memhooks deadlocks"),
    "disable_rdzv_get without alt_read": ({}, {"FI_CXI_RDZV_PROTO": ""}, {},
                                          "disable_rdzv_get without FI_CXI_RDZV_PROTO=alt_read"),
    "alt_read without disable_rdzv_get": ({"network": ""}, {}, {}, "alt_read without #SBATCH --network"),
    "NCCL_NET=OFI on one node": ({"nodes": "#SBATCH -N 1", "srun": "campaign_run srun -N 1 -n 8 -c7 "
                                 "--gpus-per-task=1 --gpu-bind=closest \\"}, {}, {}, "NCCL_NET=OFI on one node"),
    "--save in home": ({}, {}, {"save": "/ccs/home/u/run/checkpoints"}, "is on your home directory"),
    "--save on NFS project space": ({}, {}, {"save": "/ccs/proj/abc123/run/checkpoints"}, "is on NFS"),
    "--save on an NFS mount": ({}, {}, {"save": "/mnt/nfs/run", "mounts": "srv:/x /mnt/nfs nfs4 rw 0 0\n"},
                               "is on NFS"),
    "torchrun": ({"srun": "srun -N 4 -n 4 -c56 torchrun --nproc-per-node 8 \\"}, {}, {}, "torchrun: launch with srun"),
    "no -c7": ({"srun": "campaign_run srun -N 4 -n 32 --gpus-per-task=1 --gpu-bind=closest \\"}, {}, {},
               "srun without -c7"),
    "no --gpu-bind=closest": ({"srun": "campaign_run srun -N 4 -n 32 -c 7 --gpus-per-task=1 \\"}, {}, {},
                              "srun without --gpu-bind=closest"),
    "MIOpen cache on Lustre": ({}, {"MIOPEN_USER_DB_PATH": "/lustre/orion/abc123/scratch/u/miopen"}, {},
                               "MIOPEN_USER_DB_PATH=/lustre/orion/abc123/scratch/u/miopen is on a shared file system"),
    "MIOpen cache unset (home)": ({}, {"MIOPEN_CUSTOM_CACHE_DIR": ""}, {}, "MIOPEN_CUSTOM_CACHE_DIR is unset"),
}


def _problems(tmp_path, edits: dict, env_changes: dict, kw: dict) -> list[str]:
    text = CLEAN
    for key, new in edits.items():
        text = text.replace(SWAPS[key] + "\n", new + "\n" if new else "")
    env = {k: v for k, v in {**ENV, **env_changes}.items() if v}
    if edits.get("nodes", "").split("\n")[0] == "#SBATCH -N 1":
        env["SLURM_JOB_NUM_NODES"] = "1"
    save = kw.get("save", SAVE)
    if "save_secs" in kw:
        save = str(tmp_path / "ckpt")
        os.makedirs(save)
        with open(os.path.join(save, "save_time.json"), "w") as f:
            json.dump({"save_secs": kw["save_secs"], "job": "1233", "iteration": 500}, f)
    mounts = tmp_path / "mounts"
    mounts.write_text(kw.get("mounts", "/dev/sda1 / ext4 rw 0 0\n"))
    return check_job.problems("job.sbatch", text, env, save, mounts_file=str(mounts))


def test_a_clean_job_is_silent(tmp_path):
    assert _problems(tmp_path, {}, {}, {}) == []


def test_a_variable_the_script_may_set_is_not_judged(tmp_path):
    """Set under a condition or from ``$(...)`` (shell_env's ``maybe``): no "unset" line, and no value to judge."""
    env = {k: v for k, v in ENV.items() if not k.startswith(("MIOPEN", "FI_CXI"))}
    maybe = {"MIOPEN_USER_DB_PATH", "MIOPEN_CUSTOM_CACHE_DIR", "FI_CXI_RDZV_PROTO"}
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n")
    assert check_job.problems("job.sbatch", CLEAN, env, SAVE, mounts_file=str(mounts), maybe=maybe) == []
    assert len(check_job.problems("job.sbatch", CLEAN, env, SAVE, mounts_file=str(mounts))) == 3


@pytest.mark.parametrize("name", list(CASES))
def test_each_mistake_is_one_line(tmp_path, name):
    edits, env_changes, kw, words = CASES[name]
    got = _problems(tmp_path, edits, env_changes, kw)
    assert len(got) == 1, got
    assert got[0].startswith("check_job: job.sbatch: ") and words in got[0], got[0]


def test_walltime_formats():
    assert check_job.walltime_hours("02:00:00") == 2 and check_job.walltime_hours("1-00:00:00") == 24
    assert check_job.walltime_hours("90") == 1.5 and check_job.walltime_hours("1-6") == 30
    assert check_job.walltime_hours("45:30") == pytest.approx(45.5 / 60) and check_job.walltime_hours("x") is None


def test_the_command_line_exit_codes(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(CLEAN)
    env = {**ENV, "PATH": os.environ.get("PATH", "/usr/bin"), "HOME": str(tmp_path / "home")}
    run = lambda *a: subprocess.run([sys.executable, "tools/check_job.py", str(script), *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, cwd=check_job.os.path.dirname(
                                        check_job.os.path.dirname(check_job.__file__)))
    clean = run("--save", SAVE)
    assert clean.returncode == 0 and clean.stderr == ""
    bad = run("--save", str(tmp_path / "home" / "ckpt"), "--time", "04:00:00")
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 2, bad.stderr


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORDINARY = """#!/bin/bash
#SBATCH -N 8
#SBATCH -t 02:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --network=disable_rdzv_get
set -euo pipefail
export FI_CXI_RDZV_PROTO=alt_read
export MIOPEN_USER_DB_PATH=/tmp/$USER-miopen MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"
srun -N 8 -n 64 -c7 --gpus-per-task=1 --gpu-bind=closest python pretrain_gpt.py --save "$CKPT_DIR"
"""


def _by_hand(script: str, cwd: str, home: str, **env: str) -> subprocess.CompletedProcess:
    """tools/check_job.py run by hand as docs/campaigns.md says: outside a job, in a bare login environment."""
    bare = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "USER": "u", **env}
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "check_job.py"), script], env=bare, cwd=cwd,
                          capture_output=True, text=True)


def test_a_correct_script_run_by_hand_is_clean(tmp_path):
    """What the script and env.sh export counts: gpt22b.sbatch from the checkout and from elsewhere (its
    "$MEGATRON_DIR/examples/frontier/env.sh" is then found in the checkout), and a script that exports the variables
    itself, print nothing."""
    gpt22b = os.path.join(REPO, "examples", "frontier", "gpt22b.sbatch")
    for cwd in (REPO, str(tmp_path)):
        got = _by_hand(gpt22b, cwd, str(tmp_path / "home"))
        assert (got.returncode, got.stderr) == (0, ""), (cwd, got.stderr)
    script = tmp_path / "ordinary.sbatch"
    script.write_text(ORDINARY)
    got = _by_hand(str(script), str(tmp_path), str(tmp_path / "home"))
    assert (got.returncode, got.stderr) == (0, ""), got.stderr
    # what the caller exports still counts where env.sh keeps it, and a script without env.sh is judged as before
    memhooks = _by_hand(gpt22b, REPO, str(tmp_path / "home"), FI_MR_CACHE_MONITOR="memhooks")
    assert memhooks.returncode == 1 and memhooks.stderr.count("\n") == 1 and "memhooks deadlocks" in memhooks.stderr
    script.write_text(ORDINARY.replace("export FI_CXI_RDZV_PROTO=alt_read\n", ""))
    bare = _by_hand(str(script), str(tmp_path), str(tmp_path / "home"))
    assert "disable_rdzv_get without FI_CXI_RDZV_PROTO=alt_read" in bare.stderr and bare.stderr.count("\n") == 1


def test_the_script_environment_walk():
    text = """
export A=1 B="${A}2" C=${UNSET:-x} D=${SET-y} E=${EMPTY:-z} F=${EMPTY-w}
G=plain
export G
H=hidden
if [[ -n ${X:-} ]]; then export COND=1; fi
[[ -n ${X:-} ]] && export AFTER_AND=1 || true
export SAME=${SAME:-v}
if true; then export SAME=v; fi
export DYN=$(hostname) TICK=`date` ARG=$1
f() {
    export INSIDE_FUNCTION=1
}
( export IN_SUBSHELL=1 )
echo x | export IN_PIPE=1
case $X in
    a) export IN_CASE=1 ;;
esac
export GONE=1
unset GONE
"""
    env = shell_env.script_environment("job.sbatch", text, {"SET": "s", "EMPTY": ""}, "/work")
    assert {k: env[k] for k in "ABCDEFG"} == {"A": "1", "B": "12", "C": "x", "D": "s", "E": "z", "F": "", "G": "plain"}
    assert env["SAME"] == "v" and "H" not in env and "GONE" not in env
    assert env.maybe == {"COND", "AFTER_AND", "DYN", "TICK", "ARG", "IN_CASE"}
    assert not {"INSIDE_FUNCTION", "IN_SUBSHELL", "IN_PIPE"} & (set(env) | env.maybe)
