"""pretrain_gpt.py as the campaign tests run it (the scripts' ``"$PYTHON" pretrain_gpt.py ...`` lands here through
the fake interpreter of tests/campaign/common.py), with test hooks from the environment:

- TEST_STEP_SLEEP: seconds added to every training step (a slower step without burning the shared CPU);
- TEST_SAVE_SLEEP: seconds added to every checkpoint save (the writer of the manifest, rank 0, once per save);
- TEST_FAIL_AT_START: exit 1 at once (a job that dies before training);
- TEST_RESULTS: folder for each rank's summary ``<job>.rank<r>.json``: the exact per-iteration losses (the log
  prints 7 digits), the last iteration and the exit reason.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _hooks() -> None:
    """Patch only what the environment asks for (imports here on purpose: torch loads only in a job that trains)."""
    step_sleep = float(os.environ.get("TEST_STEP_SLEEP") or 0)
    save_sleep = float(os.environ.get("TEST_SAVE_SLEEP") or 0)
    if step_sleep:
        from megatron.training import pretrain

        real_step = pretrain.train_step

        def slow_step(*args, **kwargs):
            time.sleep(step_sleep)
            return real_step(*args, **kwargs)

        pretrain.train_step = slow_step
    if save_sleep:
        from megatron.checkpointing.live import integrity

        real_manifest = integrity.write_manifest

        def slow_manifest(*args, **kwargs):
            time.sleep(save_sleep)
            return real_manifest(*args, **kwargs)

        integrity.write_manifest = slow_manifest


def main(argv: list[str]) -> None:
    import pretrain_gpt  # here, after the repository went on sys.path
    from megatron.training.pretrain import Providers

    providers = Providers(pretrain_gpt.model_provider, pretrain_gpt.datasets_provider, pretrain_gpt.forward_step,
                          pretrain_gpt.tokenizer_provider)
    summary = pretrain_gpt.pretrain_from_flags(argv, providers)
    out = os.environ.get("TEST_RESULTS")
    if out:
        rank = os.environ.get("SLURM_PROCID", "0")
        with open(os.path.join(out, f"{os.environ.get('SLURM_JOB_ID', '-')}.rank{rank}.json"), "w") as f:
            json.dump({"losses": {str(k): v for k, v in summary.get("losses", {}).items()},
                       "iterations": summary.get("iterations"), "exit_reason": summary.get("exit_reason")}, f)


if __name__ == "__main__":
    if os.environ.get("TEST_FAIL_AT_START"):
        print("error: TEST_FAIL_AT_START: this job dies before training", file=sys.stderr)
        sys.exit(1)
    _hooks()
    from megatron.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
