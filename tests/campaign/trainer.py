"""pretrain_gpt.py as the campaign tests run it (the scripts' ``"$PYTHON" pretrain_gpt.py ...`` lands here through
the fake interpreter of tests/campaign/common.py): slower steps and saves come from MEGATRON_FAULT (docs/faults.md),
and the environment adds:

- TEST_FAIL_AT_START: exit 1 at once (a job that dies before training);
- TEST_RESULTS: folder for each rank's summary ``<job>.rank<r>.json``: the exact per-iteration losses (the log
  prints 7 digits), the validation losses (periodic, and the end of training's), the last iteration and the exit
  reason.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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
                       "valid_losses": {str(k): v for k, v in summary.get("valid_losses", {}).items()},
                       "final_eval": summary.get("final_eval", {}), "iterations": summary.get("iterations"),
                       "exit_reason": summary.get("exit_reason")}, f)


if __name__ == "__main__":
    if os.environ.get("TEST_FAIL_AT_START"):
        print("error: TEST_FAIL_AT_START: this job dies before training", file=sys.stderr)
        sys.exit(1)
    from megatron.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
