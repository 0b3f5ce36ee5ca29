"""Upstream's model variants through pretrain_gpt.py: one process against TP=2 x PP=2 on 4 processes, all seven
flags at once (they compose; --fp32-residual-connection needs --bf16): the lm loss and grad norm at iteration 10
agree within bf16's tolerance, the 4-process run puts the embedding alone on stage 0 and sends the fp32 residual
stream between stages. Each variant's arithmetic is checked against upstream's own module in
tests/unit/test_model_variants.py."""

import re

import pytest

from tests.launch import TIMED_OUT, run_pretrain
from tests.models import TINY_GPT

VARIANTS = ["--apply-layernorm-1p", "--squared-relu", "--apply-residual-connection-post-layernorm",
            "--fp32-residual-connection", "--embedding-weights-in-fp32", "--init-method-xavier-uniform",
            "--standalone-embedding-stage", "--bf16"]
LOSS = re.compile(r"iteration\s+10/\s+10 \|.*? lm loss: (\S+) \|.*? grad norm: (\S+) \|")
FEATURES = ("> model features: layernorm-1p, squared-relu MLP, 4 heads (MHA), learned positions, fp32 embedding "
            "lookup, post-norm residuals, fp32 residual stream, tied output layer, linear biases")


def _run(nproc: int, *extra: str) -> tuple[float, float, str]:
    out = run_pretrain(nproc, [*TINY_GPT, *VARIANTS, *extra], timeout=240, check=False, torchrun=True)
    assert out.returncode != TIMED_OUT, f"{nproc} processes: timed out\n{out.stdout}"
    m = LOSS.search(out.stdout)
    assert m, f"{nproc} processes: no iteration-10 line (exit {out.returncode})\n{out.stdout}\n{out.stderr}"
    return float(m.group(1)), float(m.group(2)), out.stdout


@pytest.mark.timeout(600)
def test_variants_train_the_same_on_tp2_pp2_as_on_one_process():
    ref, ref_norm, ref_out = _run(1)
    assert FEATURES in ref_out, ref_out
    assert "> --standalone-embedding-stage has no effect with --pipeline-model-parallel-size 1" in ref_out
    loss, norm, out = _run(4, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert re.search(r"stage 0 \(ranks 0,1\): embedding \|", out) and "stage 1 (ranks 2,3): layers 0-1, norm" in out
    assert abs(loss - ref) <= 1e-3 * abs(ref), f"TP=2 x PP=2: lm loss {loss} vs {ref}"
    assert abs(norm - ref_norm) <= 2e-2 * ref_norm, f"TP=2 x PP=2: grad norm {norm} vs {ref_norm}"
