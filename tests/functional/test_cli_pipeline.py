"""pretrain_gpt.py through torchrun: the lm loss at iteration 10, and the valid and test losses of the evaluation at
the end, are the same for PP=1 on 1 process, PP=2 on 2 processes and TP=2 x PP=2 on 4 processes (mock data, dropout
0, clipping active; the pipeline engine's eval_batch). TP=2 x PP=2 x DP=2 on 8 processes is checked against one
process in tests/distributed/test_pipeline.py."""

import re

import pytest

from tests.launch import TIMED_OUT, run_pretrain
from tests.models import TINY_GPT, replaced

FLAGS = replaced(TINY_GPT, {"--eval-iters": "1"}) + ["--eval-interval", "100"]
LOSS = re.compile(r"iteration\s+10/\s+10 \|.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")
END = re.compile(r"validation loss at iteration 10 on 8-sample draw from (validation|test) set \| lm loss value: (\S+)")


def _end_losses(stdout: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in END.finditer(stdout)}


def _torchrun(nproc: int, *extra: str) -> tuple[float, float, str]:
    out = run_pretrain(nproc, [*FLAGS, *extra], timeout=240, check=False, torchrun=True)
    assert out.returncode != TIMED_OUT, f"{nproc} processes {extra}: timed out\n{out.stdout}"
    m = LOSS.search(out.stdout)
    assert m, f"{nproc} processes {extra}: no iteration-10 line (exit {out.returncode})\n{out.stdout}\n{out.stderr}"
    return float(m.group(1)), float(m.group(2)), out.stdout


@pytest.mark.timeout(800)
def test_lm_loss_at_iteration_10_matches_across_layouts():
    ref, ref_norm, ref_out = _torchrun(1)
    ref_end = _end_losses(ref_out)
    assert set(ref_end) == {"validation", "test"} and ref_end["validation"] != ref_end["test"], ref_out
    for nproc, extra in ((2, ("--pipeline-model-parallel-size", "2")),
                         (4, ("--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"))):
        loss, norm, stdout = _torchrun(nproc, *extra)
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"{nproc} processes {extra}: lm loss {loss} vs {ref}"
        assert abs(norm - ref_norm) <= 1e-2, f"{nproc} processes {extra}: grad norm {norm} vs {ref_norm}"
        assert "stages (pipeline engine (GPTModelPipe)" in stdout and "stage 1 (ranks" in stdout
        end = _end_losses(stdout)
        assert set(end) == set(ref_end), stdout
        for split, value in end.items():
            assert abs(value - ref_end[split]) <= 1e-4 * abs(ref_end[split]), (nproc, extra, split, value, ref_end)
