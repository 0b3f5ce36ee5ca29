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
    the last 0.1% test)."""

    def __init__(self, seq_length: int, seed: int, part: str = "train", max_bytes: int = 4_000_000) -> None:
        chunks = []
        for doc in demo_documents(max_bytes):
            chunks.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int64))
            chunks.append(np.array([BYTE_EOD], dtype=np.int64))
        self.tokens = np.concatenate(chunks)
        self.seq = seq_length
        n_windows = (len(self.tokens) - 1) // seq_length
        order = np.random.default_rng(seed).permutation(n_windows)
        n_valid = max(1, n_windows // 20)
        n_test = max(1, n_windows // 1000)  # the last 0.1% (--split's default test share), out of train's tail
        self.windows = {"train": order[n_valid:-n_test], "valid": order[:n_valid], "test": order[-n_test:]}[part]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, idx: int) -> dict:
        start = int(self.windows[idx % len(self.windows)]) * self.seq
        return {"text": self.tokens[start:start + self.seq + 1]}
