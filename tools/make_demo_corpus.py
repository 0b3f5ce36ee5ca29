"""Write the embedded default corpus (Python standard-library docstrings) as jsonl, offline.

    python tools/make_demo_corpus.py --output build/demo/corpus.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.demo_corpus import write_demo_jsonl  # noqa: E402
from megatron.errors import run_cli  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    n = write_demo_jsonl(args.output, args.max_bytes)
    print(f"wrote {n} documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
