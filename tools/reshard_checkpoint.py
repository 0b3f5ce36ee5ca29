"""Convert a checkpoint saved at one TP/PP/ZeRO layout into a full-state directory that ``--load`` reads at
any other layout. Carried over: weights, Adam moments (exp_avg, exp_avg_sq, step; from hierarchical ZeRO,
ZeRO-1/2 and ZeRO-0 checkpoints; under pipeline ZeRO-0 when its names were recorded), iteration, consumed samples, LR
schedule position. Restarted: RNG states (they are partitioned by layout), and the moments of ZeRO-3 checkpoints (said
when so).
See docs/checkpoints.md#resharding-full-state-conversion.

    python tools/reshard_checkpoint.py --load CHECKPOINTS [--tag global_step100] --save FULL_STATE_DIR
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    from megatron.checkpointing.hf.convert import read_any, read_moments, write_full_state

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--tag", default=None, help="default: the one 'latest' names")
    p.add_argument("--save", required=True, help="output full-state directory")
    args = p.parse_args(argv)
    full, model, progress = read_any(args.load, args.tag)
    moments, step, why = read_moments(args.load, args.tag)
    write_full_state(args.save, full, model, progress, args.load, moments, step)
    print(f"> Adam moments (step {step}) carried over" if moments else f"> Adam moments not carried ({why}): "
          "they restart when this full state is loaded")
    print(f"> wrote full state of iteration {progress['iteration']} to {args.save}: pass --load {args.save} "
          "at any layout")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
