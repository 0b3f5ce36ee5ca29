"""tools/show_layout.py: the dry run's table, group tiers and memory terms, as numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.arguments.dry_run import configure_dry_run
from megatron.errors import ConfigError, DataError, run_cli
from megatron.config.sizes import named_model
from megatron.perf.layout import Layout
from megatron.perf.memory import GIB, estimate_memory
from tests.models import GPT_H64

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import show_layout  # noqa: E402  (tools/ is not a package: imported from its folder)

CORPUS, CORPUS_B = (str(ROOT / "tests" / "fixtures" / "upstream_data" / c) for c in ("corpus_a", "corpus_b"))
ONE_T = ["--world-size", "1024", "--model-size", "gpt-1t", "--tensor-model-parallel-size", "8",
         "--pipeline-model-parallel-size", "64", "--zero-stage", "1", "--bf16", "--use-flash-attn-v2",
         "--recompute-granularity", "full", "--global-batch-size", "1024"]
TERM_LINE = re.compile(r"^  (\w+)\s+([\d.]+) GiB$", re.MULTILINE)
TOTAL_LINE = re.compile(r"^  total\s+([\d.]+) GiB of 64 GiB HBM per GCD: (fits|DOES NOT FIT)", re.MULTILINE)


def run(capsys, argv):
    rc = run_cli(show_layout.main, argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_1t_dry_run_prints_terms_under_64_gb(capsys):
    rc, out, _ = run(capsys, ONE_T)
    assert rc == 0
    want = estimate_memory(named_model("gpt-1t"), Layout.of(tp=8, pp=64, dp=2, micro_batch_size=1,
                                                             global_batch_size=1024, zero_stage=1,
                                                             recompute_granularity="full", flash_attention=True))
    terms = {k: float(v) for k, v in TERM_LINE.findall(out)}
    assert terms == pytest.approx({k: v / GIB for k, v in want.terms.items() if v}, abs=0.006)
    assert {"weights", "gradients", "optimizer_states", "activations", "framework_overhead"} <= set(terms)
    total, verdict = TOTAL_LINE.search(out).groups()
    assert float(total) == pytest.approx(want.total / GIB, abs=0.006)
    assert float(total) * GIB < 64e9 and verdict == "fits"
    assert "TP=8 PP=64 DP=2" in out and "1024 ranks on 128 node(s)" in out
    assert "TP: 128 groups of 8; tiers: 128 node" in out
    assert "DP: 512 groups of 2; tiers: 512 network" in out
    assert "PP: 16 groups of 64; tiers: 16 network" in out


def test_1t_without_recompute_does_not_fit_and_require_fit_exits_3(capsys):
    argv = [a for a in ONE_T if a not in ("--recompute-granularity", "full")]
    rc, out, _ = run(capsys, argv)
    assert rc == 0 and TOTAL_LINE.search(out).group(2) == "DOES NOT FIT"
    assert "try: --recompute-granularity full; --sequence-parallel" in out
    rc, _, err = run(capsys, [*argv, "--require-fit"])
    assert rc == show_layout.EXIT_DOES_NOT_FIT and err.startswith("does not fit:")


def test_table_cells_follow_megatron_order_and_closest_binding(capsys):
    rc, out, _ = run(capsys, ["--nodes", "2", "--model-size", "gpt-1.3b", "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--bf16"])
    assert rc == 0
    rows = {line.split("|")[0].strip(): line.split("|")[1].split() for line in out.splitlines() if "|" in line}
    assert rows["GCD"] == ["4", "5", "2", "3", "6", "7", "0", "1"]
    assert rows["MI250X"] == ["2", "2", "1", "1", "3", "3", "0", "0"]
    assert rows["NUMA"] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert rows["cores"] == ["1-7", "9-15", "17-23", "25-31", "33-39", "41-47", "49-55", "57-63"]
    assert rows["SMT"][0] == "65-71"
    # TP innermost, then DP, then PP: 16 ranks = TP 2 x DP 4 x PP 2.
    assert rows["node 0"] == ["0:t0p0d0", "1:t1p0d0", "2:t0p0d1", "3:t1p0d1", "4:t0p0d2", "5:t1p0d2",
                              "6:t0p0d3", "7:t1p0d3"]
    assert rows["node 1"][2] == "10:t0p1d1"
    assert "TP: 8 groups of 2; tiers: 8 package" in out
    assert "DP: 4 groups of 4; tiers: 4 node" in out


def test_large_tables_elide_middle_nodes(capsys):
    _, out, _ = run(capsys, ONE_T)
    nodes = re.findall(r"^node (\d+)\s", out, re.MULTILINE)
    assert nodes == [str(i) for i in [*range(8), *range(120, 128)]]
    _, out, _ = run(capsys, [*ONE_T, "--all-nodes"])
    assert len(re.findall(r"^node \d+\s", out, re.MULTILINE)) == 128
    _, out, _ = run(capsys, [*ONE_T, "--summary-only"])
    assert "node 0" not in out and "total" in out


def test_explicit_shape_flags_and_ignored_training_flags(capsys):
    rc, out, _ = run(capsys, ["--world-size", "8", "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--seq-length", "32", "--tensor-model-parallel-size", "2",
                              "--lr", "1e-4", "--data-path", CORPUS, "--mock-data"])
    assert rc == 0
    params = GPT_H64.config(vocab_size=50257).num_parameters(2)
    assert f"{params / 1e9:.2f}B parameters" in out
    assert "fp32" in out and "flash" not in out.splitlines()[0]
    assert "data: 1 file(s) checked (.bin/.idx header and sizes)" in out  # the data files are checked, not ignored
    assert out.rstrip().endswith("(ignored training flags: --lr --mock-data)")


def test_dry_run_checks_every_data_file(capsys, tmp_path):
    shape = ["--world-size", "1", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    rc, out, _ = run(capsys, [*shape, "--train-data-path", "0.3", CORPUS, "0.7", CORPUS_B, "--valid-data-path",
                              CORPUS, "--test-data-path", CORPUS_B])
    assert rc == 0 and "data: 4 file(s) checked (.bin/.idx header and sizes, token ids < 1001)" in out
    with pytest.raises(DataError, match="test.idx"):
        configure_dry_run([*shape, "--train-data-path", CORPUS, "--test-data-path", str(tmp_path / "test")], 8)
    with pytest.raises(DataError, match="--valid-data-path .* is a directory"):
        configure_dry_run([*shape, "--train-data-path", CORPUS, "--valid-data-path", str(tmp_path)], 8)
    with pytest.raises(DataError, match="holds token id 9.. but the tokenizer has only 501 entries"):
        configure_dry_run([*shape[:-1], "500", "--train-data-path", CORPUS], 8)


def test_model_size_overrides(capsys):
    _, out, _ = run(capsys, ["--nodes", "1", "--model-size", "gpt-22b", "--seq-length", "4096",
                             "--max-position-embeddings", "4096", "--summary-only"])
    assert "48 layers, hidden 6144, 48 heads, seq 4096" in out


@pytest.mark.parametrize("argv,needle", [
    (["--nodes", "4", "--model-size", "gpt-22b", "--tensor-model-parallel-size", "16"],
     "--tensor-model-parallel-size 16 puts 2 of 2 TP groups across nodes"),
    (["--nodes", "1", "--model-size", "gpt-22b", "--tensor-model-parallel-size", "3"], "divisible"),
    (["--model-size", "gpt-22b"], "--world-size N"),
    (["--nodes", "1", "--num-layers", "2"], "--hidden-size, --num-attention-heads, --seq-length not given: pass the "
                                            "model shape or --model-size NAME"),
    (["--nodes", "2", "--model-size", "gpt-22b", "--pipeline-model-parallel-size", "2", "--zero-stage", "3"],
     "ZeRO-3 with --pipeline-model-parallel-size 2"),
])
def test_errors_are_one_line(capsys, argv, needle):
    rc, _, err = run(capsys, argv)
    assert rc == ConfigError.exit_code
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_allow_tp_across_nodes_warns(capsys, caplog):
    rc, out, _ = run(capsys, ["--nodes", "4", "--model-size", "gpt-22b", "--tensor-model-parallel-size", "16",
                              "--allow-tp-across-nodes", "--summary-only"])
    assert rc == 0 and "TP: 2 groups of 16; tiers: 2 network" in out
    assert "span nodes" in caplog.text


def test_plot_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    png = tmp_path / "layout.png"
    rc, out, _ = run(capsys, ["--nodes", "2", "--model-size", "gpt-1.3b", "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--plot", str(png)])
    assert rc == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (13 * 110, int(4.5 * 110))  # figsize (13, 4.5) at 110 dpi


def test_script_entry_point_exits_0():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "show_layout.py"), *ONE_T, "--summary-only"],
                          capture_output=True, text=True, timeout=120, check=False, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert TOTAL_LINE.search(proc.stdout).group(2) == "fits"


MOE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
       "--num-experts", "16", "--expert-interval", "2", "--topk", "2", "--zero-stage", "2", "--bf16"]


def test_moe_dry_run_shows_ep_groups_and_warns_when_they_leave_the_node(capsys):
    # 2 nodes, TP=2, EP=4: each EP group is 4 DP ranks of one TP rank, i.e. ranks 0,2,4,6 (inside node 0).
    rc, out, _ = run(capsys, ["--nodes", "2", "--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "4",
                              *MOE])
    assert rc == 0
    assert "EP: 4 groups of 4; tiers: 4 node; e.g. [0, 2, 4, 6]" in out
    assert "EDP: 8 groups of 2; tiers: 8 network; e.g. [0, 8]" in out
    assert " 6:t0p0d3e0.3 " in out and "10:t0p0d5e1.1" in out  # rank 6: EP group 0, EP rank 3; rank 10: group 1
    assert "2 MoE layers of 16 experts (top-2, EP=4)" in out and "WARNING" not in out
    model = configure_dry_run(["--nodes", "2", "--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "4",
                               *MOE], 8).run.model
    want = estimate_memory(model, Layout.of(tp=2, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, zero_stage=2,
                                            dtype="bf16", flash_attention=False, moe_expert_parallel_size=4))
    assert float(TERM_LINE.search(out).group(2)) == pytest.approx(want.terms["weights"] / GIB, abs=0.006)
    # EP=8 with TP=2 spans 16 ranks: every EP group crosses the node boundary, in one line.
    rc, out, _ = run(capsys, ["--nodes", "2", "--tensor-model-parallel-size", "2", "--moe-expert-parallel-size", "8",
                              *MOE])
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert rc == 0 and warnings == ["  WARNING: 2 of 2 EP groups cross nodes: every MoE layer's token all-to-alls go "
                                    "over Slingshot; use --moe-expert-parallel-size x --tensor-model-parallel-size "
                                    "<= 8"], out
    rc, _, err = run(capsys, ["--nodes", "2", "--moe-expert-parallel-size", "3", *MOE])
    assert rc != 0 and "--moe-expert-parallel-size 3" in err
