"""Shared fixtures for the data-pipeline tests: a docstring corpus, a locally trained BPE, a preprocessed dataset.

Everything is made in a temporary directory from the Python standard library's own source (parsed with ast, never
imported), so the tests need no network and no downloaded tokenizer.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _load_tool(name: str):
    """Import tools/<name>.py once (tools/ is a folder of scripts, not a package)."""
    key = f"tools_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(REPO, "tools", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses in the tool look their module up here
        spec.loader.exec_module(mod)
    return sys.modules[key]


def stdlib_docstrings(max_files: int = 40) -> list[str]:
    docs = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]:
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                tree = ast.parse(f.read())
            except SyntaxError:
                continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return docs


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("preprocess_data")`` -> the tools/preprocess_data.py module."""
    return _load_tool


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[str, list[str]]:
    """(path of a jsonl corpus, its texts in order)."""
    texts = stdlib_docstrings()
    assert len(texts) > 300
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "id": len(t)}) + "\n" for t in texts)
    return str(path), texts


@pytest.fixture(scope="session")
def tokenizer_dir(corpus, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tok"))
    _load_tool("train_tokenizer").main(["--input", corpus[0], "--vocab-size", "600", "--output-dir", out])
    return out


@pytest.fixture(scope="session")
def gpt2_flags(tokenizer_dir) -> list[str]:
    return [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", os.path.join(tokenizer_dir, "vocab.json"),
        "--merge-file", os.path.join(tokenizer_dir, "merges.txt"),
    ]  # fmt: skip


@pytest.fixture(scope="session")
def dataset_prefix(corpus, gpt2_flags, tmp_path_factory) -> str:
    """``PREFIX`` of the preprocessed corpus (GPT-2 BPE, --append-eod, one worker)."""
    out = tmp_path_factory.mktemp("data") / "corpus"
    _load_tool("preprocess_data").main(["--input", corpus[0], "--output-prefix", str(out), "--append-eod", *gpt2_flags])
    return f"{out}_text_document"
