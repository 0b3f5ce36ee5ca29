"""Helpers for the checkpoint tests: run pretrain_gpt.py's providers through ``pretrain`` on fresh
spawned ranks and get the exact per-iteration losses back (the log prints only 7 digits)."""

from __future__ import annotations

from tests.launcher import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1",
        "--mock-data", "--vocab-size", "200", "--make-vocab-size-divisible-by", "32", "--log-interval", "1",
        "--eval-iters", "0", "--use-cpu-initialization", "--seed", "7", "--distributed-backend", "gloo"]
LLAMA = ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--num-key-value-heads", "2"]


def _pretrain(argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron.training.pretrain import Providers

    return pretrain_gpt.pretrain_from_flags(argv, Providers(pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                                                            pretrain_gpt.forward_step, pretrain_gpt.tokenizer_provider))


def pretrain_on(world: int, argv: list[str], timeout: float = 240.0) -> dict:
    """Rank 0's summary of one pretrain run on ``world`` fresh processes."""
    return run_distributed(_pretrain, world, timeout=timeout, argv=argv)[0]


def check_resume_exact(world: int, args: list[str], save_dir: str, n: int = 2) -> dict[int, float]:
    """2n straight iterations == n, save and exit (--exit-interval), resume n, bit for bit, on ``world`` fresh
    ranks. Shared by the CPU suite and tests/gpu (same code path, the device's backend). Returns the straight
    run's losses."""
    args = args + ["--train-iters", str(2 * n)]
    straight = pretrain_on(world, args)["losses"]
    first = pretrain_on(world, args + ["--exit-interval", str(n), "--save", save_dir])
    assert first["exit_reason"] == f"--exit-interval {n}" and list(first["losses"]) == list(range(1, n + 1)), first
    resumed = pretrain_on(world, args + ["--save", save_dir, "--load", save_dir])["losses"]
    assert resumed == {i: straight[i] for i in range(n + 1, 2 * n + 1)}, (resumed, straight)
    assert len(set(straight.values())) == 2 * n, straight  # the loss moves: equality is not trivial
    return straight


# Slow down one file write of the step-4 save, so the test can kill the process in the middle of it.
SLOW_SAVE = """
import sys, time
from megatron.checkpointing import safe_io
orig = safe_io.SafeCheckpointEngine.save
def slow(self, state_dict, path):
    orig(self, state_dict, path)
    if "global_step4.tmp-" in path:
        print("SAVING", path, flush=True)
        time.sleep(60)
safe_io.SafeCheckpointEngine.save = slow
import pretrain_gpt
sys.exit(pretrain_gpt.run_cli(pretrain_gpt.main, sys.argv[1:]))
"""
