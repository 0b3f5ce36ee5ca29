"""The embedded default corpus: docstrings of the Python standard library on this machine.

Built offline from source files every Python install ships (parsed with ``ast``, never imported),
in sorted order, so every machine with the same Python version builds the same corpus.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterator

import numpy as np


def demo_documents(max_bytes: int = 4_000_000, min_chars: int = 200) -> Iterator[str]:
    """Docstrings of at least ``min_chars`` characters, up to ``max_bytes`` of text in total."""
    root = sysconfig.get_paths()["stdlib"]
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        yield doc
                        total += len(doc.encode("utf-8"))
                        if total >= max_bytes:
                            return


def write_demo_jsonl(path: str, max_bytes: int = 4_000_000) -> int:
    """Write the corpus as jsonl ({"text": ...} per line); returns the number of documents."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in demo_documents(max_bytes):
            f.write(json.dumps({"text": doc}) + "\n")
            n += 1
    return n


BYTE_VOCAB = 257  # 256 byte values + end-of-document
BYTE_EOD = 256


class ByteWindowDataset:
    """Fixed windows of seq_length+1 byte tokens over the concatenated corpus, in a seeded shuffled
    order; ``part`` 'train', 'valid' or 'test' takes disjoint windows (the first 5% of that order are validation,
    the last 1% test). ``num_samples``: a length to report instead of the window count (an evaluation split
    repeats its windows, as Megatron's GPTDataset repeats epochs); ``tokens``: the corpus, when already built."""

    def __init__(self, seq_length: int, seed: int, part: str = "train", max_bytes: int = 4_000_000,
                 num_samples: int | None = None, tokens: np.ndarray | None = None) -> None:
        if tokens is None:
            chunks = []
            for doc in demo_documents(max_bytes):
                chunks.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int64))
                chunks.append(np.array([BYTE_EOD], dtype=np.int64))
            tokens = np.concatenate(chunks)
        self.tokens = tokens
        self.seq = seq_length
        n_windows = (len(self.tokens) - 1) // seq_length
        order = np.random.default_rng(seed).permutation(n_windows)
        n_valid = max(1, n_windows // 20)
        n_test = max(1, n_windows // 100)  # out of train's tail: train's first windows keep their order
        self.windows = {"train": order[n_valid:-n_test], "valid": order[:n_valid], "test": order[-n_test:]}[part]
        self.num_samples = num_samples

    @classmethod
    def splits(cls, seq_length: int, seed: int, eval_samples: tuple[int, int] = (0, 0)) -> tuple:
        """(train, valid, test) over one read of the corpus; valid/test at least ``eval_samples`` long."""
        train = cls(seq_length, seed, "train")
        return (train, *(cls(seq_length, seed, part, num_samples=n or None, tokens=train.tokens)
                         for part, n in zip(("valid", "test"), eval_samples, strict=True)))

    def __len__(self) -> int:
        return max(len(self.windows), self.num_samples or 0)

    def __getitem__(self, idx: int) -> dict:
        start = int(self.windows[idx % len(self.windows)]) * self.seq
        return {"text": self.tokens[start:start + self.seq + 1]}
