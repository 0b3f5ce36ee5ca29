"""A resume with a longer --train-iters: the first resumed iteration uses the *current* schedule's lr.

DeepSpeed restores ZeRO optimizer partitions (their param_groups' lr included) after the LR scheduler, so
before the fix iteration N+1 ran at the lr the old N-iteration schedule gave step N+1 (min-lr: 0).
Each engine saves at N of N and resumes with 3N, on the same two spawned ranks (one spawn for all).
"""

import pytest

from megatron.config import OptimizerConfig
from megatron.training.lr_schedule import OptimizerParamScheduler
from tests.checkpointing.common import BASE
from tests.launcher import free_port, run_distributed

N = 2
ENGINES = {  # name -> layout flags on 2 ranks
    "zero0-dp2": ["--zero-stage", "0"],
    "zero1-dp2": ["--zero-stage", "1"],
    "zero3-dp2": ["--zero-stage", "3"],
    "pipeline-pp2-zero1": ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"],
    "hierarchical-zero3": ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"],
}


def _save_then_resume(root: str, ports: list[int]) -> dict:
    import os

    from tests.checkpointing.common import _pretrain

    def run(argv: list[str]) -> dict:
        # A fresh rendezvous port per run: re-creating a process group on the port of a destroyed one hangs.
        os.environ["MASTER_PORT"] = str(ports.pop())
        return _pretrain(argv)["lrs"]

    out = {"straight": run(BASE + ENGINES["zero1-dp2"] + ["--train-iters", str(3 * N)])}
    for name, flags in ENGINES.items():
        save = f"{root}/{name}"
        run(BASE + flags + ["--train-iters", str(N), "--save", save])
        out[name] = run(BASE + flags + ["--train-iters", str(3 * N), "--load", save])
    return out


def _schedule_lr(step: int, train_iters: int) -> float:
    """The lr BASE's schedule (--lr 2e-3, 2 warmup iterations, linear decay to 0) gives ``step``."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(opt, OptimizerConfig(lr=2e-3, min_lr=0.0, lr_decay_style="linear",
                                                        lr_warmup_iters=2), train_iters).get_lr(step)


@pytest.mark.timeout(400)
def test_first_resumed_iteration_uses_the_new_schedule(tmp_path):
    ports: set[int] = set()
    while len(ports) < 1 + 2 * len(ENGINES):
        ports.add(free_port())
    lrs = run_distributed(_save_then_resume, 2, timeout=400, root=str(tmp_path), ports=sorted(ports))[0]
    want = _schedule_lr(N + 1, 3 * N)
    assert want != _schedule_lr(N + 1, N)  # the old schedule's value differs, so the test can fail
    assert lrs["straight"][N + 1] == pytest.approx(want, rel=1e-9)
    for name in ENGINES:
        assert list(lrs[name]) == list(range(N + 1, 3 * N + 1)), (name, lrs[name])
        assert lrs[name] == pytest.approx({i: lrs["straight"][i] for i in lrs[name]}, rel=1e-9), (name, lrs[name])
