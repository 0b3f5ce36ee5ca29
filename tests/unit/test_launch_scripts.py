"""examples/frontier/: run every sbatch script under fake srun / scontrol / sbatch / sbcast / module and check
the final srun command line and the environment it runs in; plus bash -n and shellcheck."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config.sizes import named_model
from megatron.perf.layout import Layout
from megatron.perf.memory import GIB, estimate_memory

ROOT = Path(__file__).resolve().parents[2]
FRONTIER = ROOT / "examples" / "frontier"
SCRIPTS = sorted(p.name for p in FRONTIER.glob("*.sbatch")) + ["env.sh"]

# The fake srun records its argv, cwd and environment as one JSON line; for a pretrain_gpt.py trial it prints a
# TFLOPs figure made from the layout (10*TP + PP + MBS/10), so the tuning script has something to rank, or fails
# like an out-of-memory trial for the layout named in FAKE_FAIL.
FAKE_SRUN = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}}) + "\\n")
if "pretrain_gpt.py" in sys.argv:
    a = sys.argv
    v = lambda flag: int(a[a.index(flag) + 1])
    tp, pp, mbs = v("--tensor-model-parallel-size"), v("--pipeline-model-parallel-size"), v("--micro-batch-size")
    if os.environ.get("FAKE_FAIL") == f"{{tp}},{{pp}},{{mbs}}":
        sys.exit("out of memory")
    print(f"iteration 1/10 | TFLOPs: {{10 * tp + pp + mbs / 10:.1f}} |")
"""
# sbatch: read the script's #SBATCH -N, set what Slurm sets in a batch job, copy the script to a spool folder
# (a real sbatch does too, so scripts must not rely on their own path) and run it. A submission with
# --dependency (the job chain's successor, examples/frontier/campaign.sh) is recorded in FAKE_SBATCH_LOG instead.
FAKE_SBATCH = f"""#!{sys.executable}
import json, os, re, shutil, sys, tempfile
args = sys.argv[1:]
if any(a.startswith("--dependency") for a in args):
    with open(os.environ["FAKE_SBATCH_LOG"], "a") as f:
        f.write(json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}}) + "\\n")
    print("4243")
    sys.exit(0)
nodes, qos = None, None
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "-N":
        nodes = int(args.pop(0))
    elif opt == "-q":
        qos = args.pop(0)
    elif opt in ("-A", "-t", "-J"):
        args.pop(0)
script, rest = args[0], args[1:]
text = open(script).read()
m = re.search(r"^#SBATCH -N (\\d+)", text, re.MULTILINE)
nodes = nodes or (int(m.group(1)) if m else 1)
spool = tempfile.mkdtemp()
copy = shutil.copy(script, os.path.join(spool, "slurm_script"))
os.environ.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
                  SLURM_JOB_NODELIST=f"frontier[{{1:05d}}-{{nodes:05d}}]" if nodes > 1 else "frontier00001",
                  SLURM_SUBMIT_DIR=os.getcwd(), SLURM_JOB_NAME=os.path.basename(script).split(".")[0])
if qos:
    os.environ["SLURM_JOB_QOS"] = qos
os.execvp("bash", ["bash", copy, *rest])
"""
FAKE_SCONTROL = f"""#!{sys.executable}
import sys
sys.path.insert(0, {str(ROOT)!r})
from megatron.topology import parse_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(parse_nodelist(sys.argv[3])))
"""
FAKE_RECORDER = """#!/bin/bash
echo "$*" >> "$FAKE_{name}_LOG"
"""

# name -> (nodes, TP, PP, (layers, hidden, heads), micro-batch, global batch, recompute)
TRAINING = {
    "smoke_1node.sbatch": (1, 2, 2, (24, 2048, 16), 2, 32, None),
    "gpt22b.sbatch": (4, 2, 8, (48, 6144, 48), 1, 128, None),
    "gpt175b.sbatch": (16, 4, 16, (96, 12288, 96), 1, 256, "full"),
    "gpt1t.sbatch": (128, 8, 64, (128, 25600, 128), 1, 1024, "full"),
}
# OLCF's current PyTorch-on-Frontier recipe (shared FRONTIER.md); NCCL_NET depends on the node count
EXPECTED_ENV = {
    "MASTER_ADDR": "frontier00001", "MASTER_PORT": "29500", "NCCL_SOCKET_IFNAME": "hsn0", "NCCL_CROSS_NIC": "1",
    "HSA_FORCE_FINE_GRAIN_PCIE": "1", "FI_MR_CACHE_MONITOR": "kdreg2", "FI_CXI_DEFAULT_CQ_SIZE": "131072",
    "FI_CXI_DEFAULT_TX_SIZE": "2048", "FI_CXI_RX_MATCH_MODE": "hybrid", "FI_CXI_RDZV_PROTO": "alt_read",
    "FI_CXI_DISABLE_HOST_REGISTER": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "7",
}
OLD_RECIPE = ("FI_CXI_ATS", "NCCL_NET_GDR_LEVEL")


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fake_slurm(tmp_path):
    """Fake Slurm + Lmod on PATH; returns run(script, *args, sbatch_opts=(), **env) -> (proc, sruns, modules)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir / "srun", FAKE_SRUN)
    _write(bin_dir / "sbatch", FAKE_SBATCH)
    _write(bin_dir / "scontrol", FAKE_SCONTROL)
    _write(bin_dir / "sbcast", FAKE_RECORDER.format(name="SBCAST"))
    _write(bin_dir / "module", FAKE_RECORDER.format(name="MODULE"))
    logs = {k: tmp_path / f"{k}.log" for k in ("srun", "module", "sbcast", "sbatch")}
    (tmp_path / "home").mkdir()

    def run(script: str, *args: str, sbatch_opts: tuple[str, ...] = (), **env: str):
        for log in logs.values():
            log.unlink(missing_ok=True)
        full_env = {
            "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path / "home"),
            "USER": "tester", "FAKE_SRUN_LOG": str(logs["srun"]), "FAKE_MODULE_LOG": str(logs["module"]),
            "FAKE_SBCAST_LOG": str(logs["sbcast"]), "FAKE_SBATCH_LOG": str(logs["sbatch"]),
            "RUN_DIR": str(tmp_path / "run"),
            "MIOPEN_CACHE_ROOT": str(tmp_path / "miopen"), "PYTHON": sys.executable, **env,
        }
        proc = subprocess.run(["sbatch", *sbatch_opts, str(FRONTIER / script), *args], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=300, check=False)
        sruns = [json.loads(line) for line in logs["srun"].read_text().splitlines()] if logs["srun"].exists() else []
        modules = logs["module"].read_text().splitlines() if logs["module"].exists() else []
        sbcasts = logs["sbcast"].read_text().splitlines() if logs["sbcast"].exists() else []
        run.successors = ([json.loads(line) for line in logs["sbatch"].read_text().splitlines()]
                          if logs["sbatch"].exists() else [])
        return proc, sruns, modules, sbcasts

    return run


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """--flag v1 v2 ... -> {"--flag": ["v1", "v2"]} for the part after pretrain_gpt.py."""
    out: dict[str, list[str]] = {}
    key = None
    for tok in argv:
        if tok.startswith("--"):
            key = tok
            out[key] = []
        elif key is not None:
            out[key].append(tok)
    return out


def _srun_prefix(nodes: int) -> list[str]:
    return ["-N", str(nodes), "-n", str(nodes * 8), "-c7", "--gpus-per-task=1", "--gpu-bind=closest"]


@pytest.mark.parametrize("script", list(TRAINING))
def test_training_script_final_srun(fake_slurm, tmp_path, script):
    nodes, tp, pp, (layers, hidden, heads), mbs, gbs, recompute = TRAINING[script]
    proc, sruns, modules, _ = fake_slurm(script)
    assert proc.returncode == 0, proc.stderr
    assert modules == ["load PrgEnv-gnu rocm craype-accel-amd-gfx90a", "load rccl-net-plugin"]
    assert "check_job:" not in proc.stderr  # tools/check_job.py finds nothing to say about the script as shipped
    assert len(sruns) == 1
    argv = sruns[0]["argv"]
    assert Path(argv[0]).name == "srun"
    assert argv[1:8] == _srun_prefix(nodes)
    assert argv[8:10] == [sys.executable, "pretrain_gpt.py"]
    assert sruns[0]["cwd"] == str(ROOT)
    f = _flags(argv[10:])
    expected = {
        "--tensor-model-parallel-size": [str(tp)], "--pipeline-model-parallel-size": [str(pp)],
        "--num-layers": [str(layers)], "--hidden-size": [str(hidden)], "--num-attention-heads": [str(heads)],
        "--seq-length": ["2048"], "--max-position-embeddings": ["2048"], "--micro-batch-size": [str(mbs)],
        "--global-batch-size": [str(gbs)], "--zero-stage": ["1"], "--bf16": [], "--deepspeed": [],
        "--use-flash-attn-v2": [], "--mock-data": [], "--save": [str(tmp_path / "run" / "checkpoints")],
        "--load": [str(tmp_path / "run" / "checkpoints")], "--tensorboard-dir": [str(tmp_path / "run" / "tensorboard")],
    }
    for flag, value in expected.items():
        assert f.get(flag) == value, (flag, f.get(flag))
    assert f.get("--recompute-granularity") == ([recompute] if recompute else None)
    assert "--deepspeed_config" not in f and "--data-path" not in f
    env = sruns[0]["env"]
    for key, value in EXPECTED_ENV.items():
        assert env.get(key) == value, key
    assert env["NCCL_NET"] == ("Socket" if nodes == 1 else "OFI")  # the plugin initialises only across nodes
    assert not any(k in env for k in OLD_RECIPE)
    assert env["MEGATRON_SIGNAL_LEAD_SECS"] == re.search(r"#SBATCH --signal=B:USR1@(\d+)",
                                                         (FRONTIER / script).read_text()).group(1)
    # The chain: one successor, the same script and arguments, after this job, submitted before env.sh ran.
    successor, = fake_slurm.successors
    assert "--dependency=afterany:4242" in successor["argv"] and "--export=ALL,CAMPAIGN_PREV=4242" in successor["argv"]
    assert successor["argv"][-1].endswith("slurm_script") and successor["cwd"] == str(ROOT)
    assert "MASTER_ADDR" not in successor["env"] and "NCCL_NET" not in successor["env"]
    assert env["MIOPEN_USER_DB_PATH"] == env["MIOPEN_CUSTOM_CACHE_DIR"] == str(tmp_path / "miopen")
    assert (tmp_path / "miopen").is_dir()

    # The dry run printed before srun agrees with the memory model, and with the figure in the script's header.
    layout = Layout.of(tp=tp, pp=pp, dp=nodes * 8 // (tp * pp), micro_batch_size=mbs, global_batch_size=gbs,
                       zero_stage=1, recompute_granularity=recompute, flash_attention=True, dtype="bf16")
    est = estimate_memory(named_model("gpt-22b", num_layers=layers, hidden_size=hidden, num_attention_heads=heads),
                          layout)
    assert est.fits()
    m = re.search(r"total\s+([\d.]+) GiB of 64 GiB HBM per GCD: fits", proc.stdout)
    assert m and float(m.group(1)) == pytest.approx(est.total / GIB, abs=0.01)
    header = re.search(r"~([\d.]+) GiB of 64", (FRONTIER / script).read_text())
    assert header and float(header.group(1)) == pytest.approx(est.total / GIB, abs=0.05)


def test_overrides_extra_flags_and_real_data(fake_slurm, tmp_path):
    proc, sruns, _, _ = fake_slurm("gpt22b.sbatch", "--seed", "7", sbatch_opts=("-N", "8"), TP="4", PP="4",
                                   GBS="256", DATA_PATH="0.7 /d/a_text_document 0.3 /d/b_text_document",
                                   DATA_DIR="/d", DS_CONFIG="/cfg/ds.json", SHOW_LAYOUT="0",
                                   FRONTIER_NET_MODULE="aws-ofi-rccl/1.4", MASTER_PORT="3442")
    assert proc.returncode == 0, proc.stderr
    argv = sruns[-1]["argv"]
    assert argv[1:8] == _srun_prefix(8)
    f = _flags(argv[10:])
    assert (f["--tensor-model-parallel-size"], f["--pipeline-model-parallel-size"]) == (["4"], ["4"])
    assert f["--global-batch-size"] == ["256"]
    assert f["--data-path"] == ["0.7", "/d/a_text_document", "0.3", "/d/b_text_document"]
    assert (f["--vocab-file"], f["--merge-file"]) == (["/d/gpt2-vocab.json"], ["/d/gpt2-merges.txt"])
    assert f["--deepspeed_config"] == ["/cfg/ds.json"] and "--mock-data" not in f
    assert argv[-2:] == ["--seed", "7"]
    env = sruns[-1]["env"]
    assert env["MASTER_PORT"] == "3442" and env["NCCL_NET"] == "OFI"
    assert "Memory per GCD" not in proc.stdout  # SHOW_LAYOUT=0
    assert fake_slurm.successors[0]["argv"][-2:] == ["--seed", "7"]  # the successor gets the same extra flags


def test_bad_layout_stops_before_srun(fake_slurm):
    proc, sruns, _, _ = fake_slurm("gpt22b.sbatch", TP="16")
    assert proc.returncode == 2
    assert sruns == []
    assert "--tensor-model-parallel-size 16" in proc.stderr


def test_sbcast_python_env_to_nvme(fake_slurm, tmp_path):
    proc, sruns, _, sbcasts = fake_slurm("gpt1t.sbatch", FRONTIER_ENV_TARBALL="/lustre/me/env.tar.gz", SHOW_LAYOUT="0")
    assert proc.returncode == 0, proc.stderr
    assert sbcasts == ["--force --preserve /lustre/me/env.tar.gz /mnt/bb/tester/python-env.tar.gz"]
    assert len(sruns) == 2
    unpack = sruns[0]["argv"]
    assert unpack[1:4] == ["-N", "128", "--ntasks-per-node=1"]
    assert unpack[-2:] == ["/mnt/bb/tester/python-env", "/mnt/bb/tester/python-env.tar.gz"]
    assert sruns[1]["argv"][8:10] == ["/mnt/bb/tester/python-env/bin/python", "pretrain_gpt.py"]


def test_preprocess(fake_slurm, tmp_path):
    proc, sruns, _, _ = fake_slurm("preprocess.sbatch")
    assert proc.returncode != 0 and "set INPUT" in proc.stderr and sruns == []
    prefix = tmp_path / "out" / "corpus"
    proc, sruns, _, _ = fake_slurm("preprocess.sbatch", INPUT="/lustre/corpus.jsonl", OUTPUT_PREFIX=str(prefix))
    assert proc.returncode == 0, proc.stderr
    assert "check_job:" not in proc.stderr
    argv = sruns[-1]["argv"]
    assert argv[1:8] == ["-N", "1", "-n", "1", "-c", "56", "--gpus-per-task=0"]
    assert argv[8:10] == [sys.executable, "tools/preprocess_data.py"]
    f = _flags(argv[10:])
    assert (f["--input"], f["--output-prefix"], f["--workers"]) == (["/lustre/corpus.jsonl"], [str(prefix)], ["54"])
    assert f["--tokenizer-type"] == ["GPT2BPETokenizer"] and "--append-eod" in f
    assert prefix.parent.is_dir()


def test_tune_layout_runs_only_feasible_layouts_and_ranks_them(fake_slurm, tmp_path):
    choices = {"tp": [1, 2, 8], "pp": [1, 8], "mbs": [1, 2]}
    proc, sruns, _, _ = fake_slurm("tune_layout.sbatch", TP_CHOICES="1 2 8", PP_CHOICES="1 8", MBS_CHOICES="1 2",
                                   FAKE_FAIL="2,8,2")
    assert proc.returncode == 0, proc.stderr
    assert "check_job:" not in proc.stderr
    model = named_model("gpt-22b")
    feasible = []
    for tp in choices["tp"]:
        for pp in choices["pp"]:
            for mbs in choices["mbs"]:
                if 32 % (tp * pp):
                    continue
                layout = Layout.of(tp=tp, pp=pp, dp=32 // (tp * pp), micro_batch_size=mbs, global_batch_size=128,
                                   zero_stage=1, flash_attention=True, dtype="bf16")
                if estimate_memory(model, layout).fits():
                    feasible.append((tp, pp, mbs))
    assert 0 < len(feasible) < 12  # the test must exercise both skipping and running
    ran = [tuple(int(_flags(s["argv"])[k][0]) for k in ("--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--micro-batch-size")) for s in sruns]
    assert sorted(ran) == sorted(feasible)
    for s in sruns:
        assert s["argv"][1:8] == _srun_prefix(4)
    rows = (tmp_path / "run" / "summary.tsv").read_text().splitlines()
    assert rows[0] == "tp\tpp\tmbs\ttflops_per_gcd"
    got = [tuple(r.split("\t")) for r in rows[1:]]
    # A crashed trial does not stop the sweep; it is listed last as "failed".
    want = sorted((c for c in feasible if c != (2, 8, 2)), key=lambda c: -(10 * c[0] + c[1] + c[2] / 10))
    assert (2, 8, 2) in feasible
    assert got == [(str(t), str(p), str(m), f"{10 * t + p + m / 10:.1f}") for t, p, m in want] + [
        ("2", "8", "2", "failed")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(FRONTIER / script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-s", "bash", str(FRONTIER / script)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".sbatch")])
def test_script_conventions(script):
    text = (FRONTIER / script).read_text()
    assert "set -euo pipefail" in text
    assert re.search(r"^#SBATCH -S 8$", text, re.MULTILINE)
    assert "#SBATCH -A" not in text  # the account comes from the environment (SBATCH_ACCOUNT) or sbatch -A


def test_debug_qos_runs_one_job_without_a_successor(fake_slurm):
    proc, sruns, _, _ = fake_slurm("smoke_1node.sbatch", sbatch_opts=("-q", "debug"), SHOW_LAYOUT="0")
    assert proc.returncode == 0, proc.stderr
    assert len(sruns) == 1 and fake_slurm.successors == []
    assert proc.stderr.count("campaign: -q debug: OLCF prohibits job chains there") == 1


def test_a_finished_run_exits_zero_at_once(fake_slurm, tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "finished").write_text('{"iteration": 20, "job": "4241"}\n')
    proc, sruns, modules, _ = fake_slurm("smoke_1node.sbatch")
    assert proc.returncode == 0, proc.stderr
    assert sruns == [] and modules == [] and fake_slurm.successors == []  # nothing loaded, run or submitted
    assert "campaign: run smoke_1node is finished at iteration 20" in proc.stderr


def test_campaign_min_nodes_asks_slurm_for_a_range_or_stops_in_one_line(fake_slurm, tmp_path):
    """CAMPAIGN_MIN_NODES: the successor asks for -N MIN-<this job's nodes>; a value that is not a node count from 1
    to this job's stops the job before it trains or submits anything, in one line."""
    for minimum, asked in (("2", "2-4"), ("4", "4")):
        proc, sruns, _, _ = fake_slurm("smoke_1node.sbatch", sbatch_opts=("-N", "4"), SHOW_LAYOUT="0",
                                       CAMPAIGN_MIN_NODES=minimum, RUN_DIR=str(tmp_path / minimum))  # a new run
        assert proc.returncode == 0 and len(sruns) == 1, proc.stderr
        argv, = [s["argv"] for s in fake_slurm.successors]
        assert argv[argv.index("-N") + 1] == asked, argv
    for bad in ("5", "0", "two"):
        proc, sruns, _, _ = fake_slurm("smoke_1node.sbatch", sbatch_opts=("-N", "4"), SHOW_LAYOUT="0",
                                       CAMPAIGN_MIN_NODES=bad)
        assert proc.returncode == 1 and sruns == [] and fake_slurm.successors == [], proc.stderr
        assert proc.stderr.strip() == (
            f"campaign: CAMPAIGN_MIN_NODES={bad} is not a node count from 1 to this job's 4: set it to one (the "
            "successor then asks for -N MIN-4) or unset it; job 4242 exits without training or a successor")
