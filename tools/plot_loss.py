"""Plot the lm loss curve from a Megatron-format training log, and optionally check that it fell.

    python tools/plot_loss.py --log train.log --output loss.png [--check-drop 0.30]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.errors import DataError, run_cli  # noqa: E402

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: ([0-9.E+-]+)")
_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def parse_log(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    if not os.path.isfile(path):
        raise DataError(f"--log {path}: file not found")
    train, valid = [], []
    with open(path, errors="replace") as f:
        for line in f:
            if m := _ITER.search(line):
                train.append((int(m.group(1)), float(m.group(2))))
            elif m := _VALID.search(line):
                valid.append((int(m.group(1)), float(m.group(2))))
    return train, valid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True)
    p.add_argument("--output", default=None, help="PNG path (needs matplotlib)")
    p.add_argument("--check-drop", type=float, default=None,
                   help="fail unless the last logged loss is this fraction below the first")
    args = p.parse_args(argv)
    train, valid = parse_log(args.log)
    if not train:
        raise DataError(f"--log {args.log}: no 'iteration ... | lm loss:' lines found")
    first, last = train[0][1], train[-1][1]
    drop = 1.0 - last / first
    print(f"lm loss: first logged {first:.4f} (iteration {train[0][0]}), last {last:.4f} "
          f"(iteration {train[-1][0]}): {100 * drop:.1f}% lower")
    if args.output:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(*zip(*train, strict=True), label="train lm loss")
        if valid:
            ax.plot(*zip(*valid, strict=True), "o-", label="validation lm loss")
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.set_title(os.path.basename(args.log))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.output, dpi=100)
        print(f"loss curve written to {args.output}")
    if args.check_drop is not None and drop < args.check_drop:
        print(f"error: the loss fell {100 * drop:.1f}%, less than the required {100 * args.check_drop:.0f}%",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
