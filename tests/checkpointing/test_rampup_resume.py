"""--rampup-batch-size through pretrain_gpt.py on 2 gloo ranks (fp32, tiny model), all in one spawn, with ZeRO-2
over DP=2 and with DeepSpeed's pipeline engine (PP=2, ZeRO-1):

1. the ramp's global batches and every applied / printed lr are upstream's (tests/fixtures/lr_schedule, case
   "rampup-cosine", from upstream's own calculator and scheduler);
2. a run stopped in the middle of the ramp (--exit-interval) and resumed is bit-exact against the straight run
   (losses, lrs, batches, consumed samples, validation losses): the data order, the validation stream's
   position (each evaluation draws at its step's batch) and the LR position survive the checkpoint;
3. a ramp step of n micro-batches is the update DeepSpeed makes with n accumulation steps configured up front:
   the ramp's first steps (4 of 8 samples) equal a constant --global-batch-size 4 run bit for bit.
"""

import json
import os

import pytest

from tests.launch import free_port, run_distributed
from tests.models import CKPT_MODEL

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "lr_schedule", "upstream_lr.json")
TINY = CKPT_MODEL
LAYOUTS = {"zero2-dp2": ["--zero-stage", "2"],
           "pipeline-pp2": ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"]}
STOP = 5  # mid-ramp: the fixture's batches are 2, 2, 2, 2, 4, 4, 6, 6, 8, ...


def _runs(root: str, ports: list[int], ramp_flags: list[str], layout: list[str]) -> dict:
    from tests.checkpointing.common import _pretrain

    def run(argv: list[str]) -> dict:
        os.environ["MASTER_PORT"] = str(ports.pop())  # a fresh rendezvous port per run
        return _pretrain(TINY + layout + argv)

    save = f"{root}/ckpt"
    ramp_flags = ramp_flags + ["--eval-iters", "1", "--eval-interval", "2"]
    out = {"straight": run(ramp_flags), "first": run(ramp_flags + ["--exit-interval", str(STOP), "--save", save]),
           "resumed": run(ramp_flags + ["--load", save])}
    const = ["--lr", "1e-3", "--lr-decay-style", "constant", "--micro-batch-size", "1"]
    out["ramp4"] = run(const + ["--global-batch-size", "8", "--rampup-batch-size", "4", "4", "16",
                                "--train-samples", "24"])
    out["const4"] = run(const + ["--global-batch-size", "4", "--train-iters", "4"])
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rampup_resume_mid_ramp_is_exact_and_upstreams(tmp_path, layout):
    with open(FIXTURE) as f:
        case = json.load(f)["cases"]["rampup-cosine"]
    # Upstream's case runs DP=2 with micro-batch 1; PP=2 leaves DP=1: the same global batches (every one a
    # multiple of micro-batch x DP either way), so the same schedule.
    ports: set[int] = set()
    while len(ports) < 5:
        ports.add(free_port())
    out = run_distributed(_runs, 2, timeout=400, root=str(tmp_path), ports=sorted(ports), ramp_flags=case["flags"],
                          layout=LAYOUTS[layout])[0]
    straight, first, resumed = out["straight"], out["first"], out["resumed"]
    n = case["iterations"]
    assert straight["batch_sizes"] == {i + 1: b for i, b in enumerate(case["global_batch"])}
    assert straight["lrs"] == {i + 1: lr for i, lr in enumerate(case["applied"])}
    assert straight["printed_lrs"] == {i + 1: lr for i, lr in enumerate(case["printed"])}
    assert straight["consumed_samples"] == case["states"][-1]["consumed_samples"]
    assert first["exit_reason"] == f"--exit-interval {STOP}" and list(first["losses"]) == list(range(1, STOP + 1))
    assert 2 < case["global_batch"][STOP] < case["global_batch"][-1]  # the resume is in the middle of the ramp
    for key in ("losses", "lrs", "printed_lrs", "batch_sizes", "valid_losses"):
        assert resumed[key] == {i: v for i, v in straight[key].items() if i > STOP}, key
    assert first["losses"] == {i: v for i, v in straight["losses"].items() if i <= STOP}
    assert resumed["consumed_samples"] == straight["consumed_samples"] and resumed["iterations"] == n
    assert len(set(straight["losses"].values())) == n  # the model learns: equality is not trivial
    assert len(straight["valid_losses"]) == n // 2 and resumed["valid_losses"]
    # A ramp step with 2 micro-batches per rank == a step of an engine configured for 2 from the start.
    assert [out["ramp4"]["batch_sizes"][i] for i in range(1, 6)] == [4, 4, 4, 4, 8]
    assert {i: out["ramp4"]["losses"][i] for i in range(1, 5)} == out["const4"]["losses"]
