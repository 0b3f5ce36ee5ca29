"""tools/tune_layout.py: real short runs of the planner's top layouts; the table is ranked by what was measured.

The end-to-end test runs 6 single-process layouts (micro-batch 1/2/4, with and without full recompute) of a tiny
model, 4 iterations each. On an idle 2-core machine it takes about a minute; the timing of each run is whatever the
machine gives, so it checks the tool's bookkeeping (parsing, the log's formula, the order), not which layout wins.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import tune_layout  # noqa: E402

from megatron.perf.flops import iteration_flops  # noqa: E402
from megatron.perf.layout import Layout  # noqa: E402
from tests.models import GPT_H64  # noqa: E402

LINE = (" iteration        4/       6 | consumed samples:           32 | consumed tokens:           2048 | "
        "elapsed time per iteration (ms): 40.7 | learning rate: 0.000E+00 | global batch size:     8 | "
        "lm loss: 6.2E+00 | loss scale: 1.0 | grad norm: 0.776 | number of skipped iterations:   0 | "
        "number of nan iterations: 0 | samples per second: 107.051 | tokens per second: 6851.3 | "
        "tokens per gpu per second (tgs): 3425.6 | TFLOPs: 0.01 | MFU: 8.20% | recompute: none | mem (GB): 0.49 |")


def test_parse_log_and_the_logs_formula():
    assert tune_layout.parse_log("noise\n" + LINE + "\n") == [(4, 40.7, 0.01)]
    m = GPT_H64.config(seq_length=64, vocab_size=512)
    lay = Layout.of(tp=1, pp=1, dp=2, micro_batch_size=2, global_batch_size=8, zero_stage=1, dtype="fp32")
    want = iteration_flops(m, 8, m.padded_vocab_size(1)).total / 0.0407 / 2 / 1e12
    assert tune_layout.measured_tflops(m, lay, 40.7) == pytest.approx(want, rel=1e-12)


def test_rank_agreement_and_order():
    t = [tune_layout.Trial("a", 3.0, 1, measured_tflops=1.0), tune_layout.Trial("b", 2.0, 2, measured_tflops=2.0),
         tune_layout.Trial("c", 1.0, 3, measured_tflops=3.0), tune_layout.Trial("d", 0.5, 4, error="boom")]
    assert [x.layout for x in tune_layout.ranked(t)] == ["c", "b", "a", "d"]
    assert tune_layout.rank_agreement(t) == -1.0
    t[0].measured_tflops = 4.0  # a > c > b measured vs a > b > c predicted: 2 of 3 pairs agree
    assert tune_layout.rank_agreement(t) == pytest.approx(1 / 3)


@pytest.mark.timeout(600)
def test_tuner_runs_three_layouts_and_ranks_by_measurement(tmp_path):
    out = tmp_path / "trials.json"
    shape = replace(GPT_H64, seq_length=64, vocab_size=256)
    cmd = [sys.executable, str(ROOT / "tools" / "tune_layout.py"), *shape.flags(), "--gcds", "1",
           "--global-batch-size", "8", "--top-k", "3", "--micro-batch-sizes", "2", "4", "--train-iters", "4",
           "--log-interval", "2", "--timeout", "240", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = json.loads(out.read_text())
    assert len(trials) == 3 and all(t["error"] is None for t in trials), trials
    measured = [t["measured_tflops"] for t in trials]
    assert measured == sorted(measured, reverse=True)  # reported ranking == measured ranking
    assert sorted(t["predicted_rank"] for t in trials) == list(range(1, 4))
    m = shape.config()
    for t in trials:
        lay = re.match(r"TP=1 PP=1 DP=1 MBS=(\d) ZeRO=(\d)( \(recompute=full\))?", t["layout"])
        layout = Layout.of(tp=1, pp=1, dp=1, micro_batch_size=int(lay[1]), global_batch_size=8, zero_stage=int(lay[2]),
                           recompute_granularity="full" if lay[3] else None, dtype="fp32")
        # The full-precision figure is the log's own formula on the logged time, and rounds to the log's figure.
        assert t["measured_tflops"] == pytest.approx(tune_layout.measured_tflops(m, layout, t["iteration_ms"]))
        # (the log rounds each line to 0.01; the mean of times vs the mean of rates adds a little more)
        assert abs(t["measured_tflops"] - t["log_tflops"]) <= 0.005 + 0.05 * t["measured_tflops"]
    # The printed table lists the layouts in the same (measured) order.
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^\s+\d+\s+TP=", line)]
    assert [re.search(r"(TP=.*?)\s{2,}", r)[1] for r in rows] == [t["layout"] for t in trials]
