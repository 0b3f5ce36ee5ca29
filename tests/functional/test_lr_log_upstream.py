"""End to end: the learning rate our pretrain_gpt.py logs at every iteration is upstream Megatron-DeepSpeed's for
the same warmup + cosine flags (tests/fixtures/lr_schedule, computed by upstream's own scheduler), in upstream's
format ("learning rate: %.3E"), including the first iteration's (upstream prints the lr of the next update)."""

import json
import os
import re

from tests.launch import REPO, run_pretrain
from tests.models import SCHEDULE_GPT

FIXTURE = os.path.join(REPO, "tests", "fixtures", "lr_schedule", "upstream_lr.json")
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| learning rate: ([0-9.E+-]+) \| global batch size:\s+(\d+) \|")


TINY = SCHEDULE_GPT


def _logged(case: dict, seq_length: str) -> tuple[dict, dict, str]:
    out = run_pretrain(1, TINY + ["--seq-length", seq_length] + case["flags"], timeout=240)
    logged = {int(m.group(1)): (m.group(2), int(m.group(3))) for m in _LINE.finditer(out.stdout)}
    want = {i + 1: (f"{lr:.3E}", gbs) for i, (lr, gbs) in enumerate(zip(case["printed"], case["global_batch"],
                                                                       strict=True))}
    return logged, want, out.stdout


def test_logged_lr_equals_upstream_warmup_cosine():
    with open(FIXTURE) as f:
        case = json.load(f)["cases"]["iters-cosine"]
    # Upstream's flags for the case (its global batch 4 on DP 2); here one rank with 4 micro-batches of 1: the
    # schedule counts samples per step, so it is the same schedule.
    logged, want, stdout = _logged(case, "8")
    assert logged == want, stdout[-3000:]
    assert logged[1][0] != "0.000E+00" and case["applied"][0] == 0.0  # printed: the next update's lr


def test_train_samples_and_train_tokens_stop_where_upstream_does():
    """--train-samples 40 (20 iterations, as upstream's update_train_iters) with --train-tokens 200 at seq 16:
    upstream stops once 200 tokens are consumed, after 7 iterations."""
    with open(FIXTURE) as f:
        case = json.load(f)["cases"]["samples-train-tokens"]
    assert case["seq_length"] == 16 and case["iterations"] < case["train_iters"]
    logged, want, stdout = _logged(case, "16")
    assert logged == want, stdout[-3000:]
    assert f"--train-tokens 200 consumed after iteration {case['iterations']}" in stdout
