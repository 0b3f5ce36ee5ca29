"""Merge several Megatron ``.bin/.idx`` datasets (same tokenizer) into one, documents kept in input order.

python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab_text_document
python tools/merge_datasets.py --input data/shards/ --output-prefix data/all_text_document   # every PREFIX.idx there
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.data.indexed_dataset import merge_datasets
from megatron.errors import ConfigError, DataError, run_cli


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, or one directory of them")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    return p.parse_args(argv)


def input_prefixes(inputs: list[str]) -> list[str]:
    """Expand a single directory into its datasets, sorted by name so the order is reproducible."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(f[: -len(".idx")] for f in os.listdir(inputs[0]) if f.endswith(".idx"))
        if not names:
            raise DataError(f"--input {inputs[0]} holds no .idx files")
        return [os.path.join(inputs[0], n) for n in names]
    return inputs


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    prefixes = input_prefixes(args.input)
    if os.path.abspath(args.output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise ConfigError(f"--output-prefix {args.output_prefix} is also an input; choose a new name")
    merged = merge_datasets(prefixes, args.output_prefix)
    print(
        f"merged {len(prefixes)} datasets: {merged.num_documents} documents, {int(merged.sizes.sum())} tokens "
        f"-> {args.output_prefix}.{{bin,idx}}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
