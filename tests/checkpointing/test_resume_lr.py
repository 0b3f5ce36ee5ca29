"""A resume with a longer --train-iters and --override-opt_param-scheduler (upstream's way to change the schedule
on resume): the first resumed iteration uses the *current* schedule's lr.

DeepSpeed restores ZeRO optimizer partitions (their param_groups' lr included) after the LR scheduler, so
before the fix iteration N+1 ran at the lr the old N-iteration schedule gave that position (min-lr: 0).
Each engine saves at N of N and resumes with 3N, on the same two spawned ranks (one spawn for all). Without the
override flag (or --use-checkpoint-opt_param-scheduler) the changed schedule is refused before any process group.
"""

import pytest

from megatron.optim.lr_schedule import OptimizerParamScheduler, ScheduleShape
from tests.launch import free_port, run_distributed
from tests.models import CKPT_GPT

N = 2
ENGINES = {  # name -> layout flags on 2 ranks. The pipeline engine's resumed lr is checked against upstream's in
    # tests/checkpointing/test_rampup_resume.py (PP=2, resume mid-ramp); ZeRO-0 never showed the restored-lr bug.
    "zero1-dp2": ["--zero-stage", "1"],
    "zero3-dp2": ["--zero-stage", "3"],
    "hierarchical-zero3": ["--zero-stage", "3", "--zero-hierarchy", "package,node,network"],
}


def _save_then_resume(root: str, ports: list[int]) -> dict:
    import os

    from tests.checkpointing.common import _pretrain

    def run(argv: list[str]) -> dict:
        # A fresh rendezvous port per run: re-creating a process group on the port of a destroyed one hangs.
        os.environ["MASTER_PORT"] = str(ports.pop())
        return _pretrain(argv)["lrs"]

    out = {"straight": run(CKPT_GPT + ENGINES["zero1-dp2"] + ["--train-iters", str(3 * N)])}
    for name, flags in ENGINES.items():
        save = f"{root}/{name}"
        run(CKPT_GPT + flags + ["--train-iters", str(N), "--save", save])
        out[name] = run(CKPT_GPT + flags + ["--train-iters", str(3 * N), "--load", save,
                                            "--override-opt_param-scheduler"])
    return out


def _schedule_lr(iteration: int, train_iters: int) -> float:
    """The lr CKPT_GPT's schedule (--lr 2e-3, 1 warmup iteration, linear decay to 0, global batch 4) applies at
    ``iteration``: upstream's position before that update, (iteration - 1) x 4 samples."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, ScheduleShape(2e-3, 0.0, 1 * 4, train_iters * 4, "linear"))
    sched.step((iteration - 1) * 4)
    return sched.current_lr


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
    # Without the flag the changed schedule is one line before any process group (upstream: an assertion).
    from megatron.arguments import parse_args, run_config_from_args
    from megatron.errors import CheckpointError
    from megatron.preflight.checkpoints import check_load

    save = str(tmp_path / "zero1-dp2")
    for extra, refused in (([], True), (["--use-checkpoint-opt_param-scheduler"], False),
                           (["--override-opt_param-scheduler"], False)):
        args = parse_args(CKPT_GPT + ENGINES["zero1-dp2"] + ["--train-iters", str(3 * N), "--load", save] + extra)
        run = run_config_from_args(args, 2, 200)
        if refused:
            with pytest.raises(CheckpointError, match="decay length \\(samples\\) 8 in the checkpoint, 24 "):
                check_load(run.checkpoint, run)
        else:
            check_load(run.checkpoint, run)
