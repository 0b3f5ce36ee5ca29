"""The straggler report's arithmetic on given tables (megatron/resilience/stragglers.py): the slowest ranks against the
median, a rank named once after K reports in a row, the per-rank TensorBoard view, the automatic interval."""

import json

import numpy as np

from megatron.config.runtime import RuntimeConfig
from megatron.resilience.failure_record import FailureLog
from megatron.resilience.stragglers import COLUMNS, StragglerDetector


class Writer:
    def __init__(self):
        self.scalars, self.histograms = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars.setdefault(tag, []).append((step, value))

    def add_histogram(self, tag, values, step):
        self.histograms.setdefault(tag, []).append((step, list(values)))


def table(work_ms: list[float], iters: int = 5, gather_s: float = 0.001, wall_ms: float = 50.0) -> np.ndarray:
    """[world, columns]: each rank's work split evenly over data/forward/backward/optimizer."""
    rows = []
    for w in work_ms:
        rows.append([w / 4e3 * iters] * 4 + [0.01, iters, wall_ms / 1e3 * iters, gather_s])
    return np.array(rows)


def test_named_once_after_k_reports_with_the_per_rank_view(tmp_path, capsys):
    writer = Writer()
    idents = [(r, f"node{r // 2}", str(r % 2)) for r in range(4)]
    det = StragglerDetector(RuntimeConfig(straggler_interval=5), 0, 4, 1, writer, FailureLog.in_folder(str(tmp_path)),
                            idents=idents)
    assert det.enabled and det.next_at == 7 and len(COLUMNS) == 8
    det._report(7, table([20, 21, 45, 19]))   # rank 2 at 2.2x: one report
    det._report(12, table([20, 21, 19, 19]))  # back to normal: the streak restarts
    for it in (17, 22, 27, 32):
        det._report(it, table([20, 21, 45, 19]))
    out = capsys.readouterr().out
    named = [x for x in out.splitlines() if "straggler: rank" in x]
    assert named == [x for x in out.splitlines() if x.startswith("> WARNING: straggler: rank 2 (host node1, GCD 0): "
                                                                  "its own work took 2.20x the median")]
    assert len(named) == 1 and det.named == {2: 27}
    assert "> stragglers, iterations 3-7: median own work 20.5 ms per iteration; slowest: rank 2 (host node1, GCD 0) " \
           "2.20x (data 11.2, forward 11.2, backward 11.2, optimizer 11.2, waits 2.0 ms)" in out
    assert [s for s, _ in writer.scalars["stragglers/rank 00002 vs median"]] == [7, 12, 17, 22, 27, 32]
    assert writer.histograms["stragglers/own work vs median"][0][1][2] > 2
    record = json.loads(open(tmp_path / "failures.jsonl").read())
    assert (record["rank"], record["host"], record["cause"]) == (2, "node1", "straggler")


def test_uniform_ranks_name_nobody_and_the_automatic_interval_bounds_the_cost(capsys):
    det = StragglerDetector(RuntimeConfig(), 1, 3, 1, idents=[(r, "h", "-") for r in range(3)])
    assert det.interval == 100 and det.next_at == 102
    rng = np.random.default_rng(0)
    for k in range(40):
        det._report(102 + 100 * k, table(list(20 * (1 + 0.2 * rng.random(3)))))
    assert not det.named and det.interval == 100
    assert capsys.readouterr().out == ""  # only rank 0 prints
    # A 1 s all-gather against 50 ms steps: 1 / (0.005 x 0.05) = 4,000 iterations between reports.
    det._report(5000, table([20, 20, 20], gather_s=1.0))
    assert det.interval == 4000 and det.next_at == 9000
