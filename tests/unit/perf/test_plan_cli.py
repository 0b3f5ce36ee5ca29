"""tools/plan_parallelism.py: table, plot, ds_config, and the exact last line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import plan_parallelism  # noqa: E402

from megatron.errors import run_cli  # noqa: E402

BEST = re.compile(r"^best: TP=(\d+) PP=(\d+) DP=(\d+) MBS=(\d+) ZeRO=([0-3]) \| TFLOPs per GCD: (\d+\.\d) \| "
                  r"percent of peak: (\d+\.\d\d)$")


def run(argv, capsys):
    rc = run_cli(plan_parallelism.main, argv)
    out = capsys.readouterr()
    return rc, out.out.strip().splitlines(), out.err


def test_search_prints_table_plot_config_and_best_line(tmp_path, capsys):
    png, cfg = tmp_path / "plan.png", tmp_path / "ds.json"
    rc, lines, _ = run(["--num-layers", "48", "--hidden-size", "6144", "--num-attention-heads", "48",
                        "--seq-length", "2048", "--nodes", "2", "--global-batch-size", "640", "--top", "5",
                        "--plot", str(png), "--write-ds-config", str(cfg)], capsys)
    assert rc == 0
    match = BEST.match(lines[-1])
    assert match, lines[-1]
    tp, pp, dp, _mbs, zero = map(int, match.groups()[:5])
    assert tp * pp * dp == 16
    assert float(match.group(7)) == pytest.approx(float(match.group(6)) / 191.5 * 100, abs=0.06)
    assert lines[-2].startswith("sbatch: sbatch -N 2 ") and f"--tensor-model-parallel-size {tp} " in lines[-2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ds = json.loads(cfg.read_text())
    per_replica = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    assert ds["train_batch_size"] == 640 == per_replica * dp
    assert ds["zero_optimization"]["stage"] == zero and ds["bf16"]["enabled"]
    assert sum(1 for line in lines if re.match(r"^\s+\d+ TP=", line)) == 5


def test_explicit_layout_is_the_calibration_point(capsys):
    rc, lines, _ = run(["--model-size", "gpt-22b", "--gcds", "16", "--global-batch-size", "640",
                        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "8",
                        "--micro-batch-size", "1", "--zero-stage", "1", "--recompute-granularity", "full"], capsys)
    assert rc == 0
    assert lines[-1] == "best: TP=1 PP=8 DP=2 MBS=1 ZeRO=1 | TFLOPs per GCD: 73.5 | percent of peak: 38.38"


@pytest.mark.parametrize("argv, message", [
    (["--gcds", "16", "--global-batch-size", "64"], "--model-size"),
    (["--model-size", "gpt-22b", "--global-batch-size", "64"], "--nodes"),
    (["--model-size", "gpt-22b", "--gcds", "16", "--global-batch-size", "64", "--zero-stage", "1"], "missing"),
    (["--model-size", "gpt-22b", "--gcds", "16", "--global-batch-size", "64", "--tensor-model-parallel-size", "5",
      "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1", "--zero-stage", "1"], "divisible"),
    (["--model-size", "gpt-1t", "--gcds", "8", "--global-batch-size", "64"], "no layout fits"),
])
def test_user_errors_are_one_line(argv, message, capsys):
    rc, _, err = run(argv, capsys)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_cli_process_exit_code():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plan_parallelism.py"), "--model-size", "gpt-22b",
                           "--gcds", "1024", "--global-batch-size", "7"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


SENT = re.compile(r"^sent per step by one GCD \(GB, by link tier\): package (\S+), node (\S+), network (\S+) \| "
                  r"MoE all-to-alls: package (\S+), node (\S+), network (\S+)$", re.M)


def test_moe_plan_counts_all_to_all_bytes_per_tier_and_searches_ep(capsys):
    from megatron.perf.comm import estimate_comm
    from megatron.perf.layout import Layout

    moe = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--num-experts", "16", "--topk", "2", "--nodes", "2", "--global-batch-size", "64"]
    explicit = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "2",
                "--zero-stage", "1"]
    for ep, tier in ((4, "node"), (8, "network")):  # TP=2 x EP=4 fills a node; EP=8 leaves it
        rc, lines, _ = run([*moe, *explicit, "--moe-expert-parallel-size", str(ep)], capsys)
        assert rc == 0
        text = "\n".join(lines)
        assert f"(EP={ep})" in text and f"--moe-expert-parallel-size {ep}" in text
        sent = [float(x) for x in SENT.search(text).groups()]
        model = plan_parallelism.model_from_args(plan_parallelism.get_args(moe))
        comm = estimate_comm(model, Layout.of(tp=2, pp=1, dp=8, micro_batch_size=2, global_batch_size=64, zero_stage=1,
                                              moe_expert_parallel_size=ep))
        every = comm.wire_bytes_by_tier()
        a2a = sum(c.wire_bytes for c in comm.collectives if c.group == "ep" and c.op == "all_to_all")
        assert sent[:3] == pytest.approx([every[t] / 1e9 for t in ("package", "node", "network")], abs=6e-4)
        assert sent[3:] == pytest.approx([a2a / 1e9 if t == tier else 0 for t in ("package", "node", "network")],
                                         abs=6e-4) and a2a > 1e8
    # The search: EP sizes; pipelines only where every stage holds an MoE layer (--expert-interval 4: layers 4 and 8
    # have experts, so PP=2 but not PP=4 or 8), never ZeRO-3 with experts.
    rc, lines, _ = run([*moe, "--expert-interval", "4", "--top", "2000"], capsys)
    rows = [line for line in lines if re.match(r"^\s*\d+ TP=", line)]
    pps = {int(re.search(r" PP=(\d+) ", r).group(1)) for r in rows}
    assert rc == 0 and rows and all("ZeRO=3" not in r for r in rows)
    assert pps == {1, 2}, pps
    assert {re.search(r"EP=(\d+)", r).group(1) for r in rows if "EP=" in r} >= {"2", "4", "8", "16"}
