"""A small GPT-2 BPE corpus for the real job-script cases: a tokenizer trained here and a preprocessed .bin/.idx,
made once per session from the Python standard library's docstrings (no network, no downloaded vocab)."""

from __future__ import annotations

import json
import os

import pytest

from tests.compat.cases_io import REPO
from tests.unit.data.conftest import _load_tool, stdlib_docstrings


@pytest.fixture(scope="session")
def compat_data(tmp_path_factory) -> dict[str, str]:
    """The placeholders a case may name: $VOCAB_FILE, $MERGE_FILE, $DATA_PATH (and $DATA_PATH2 for blends)."""
    root = tmp_path_factory.mktemp("compat")
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in stdlib_docstrings(max_files=25))
    tok = str(root / "tok")
    _load_tool("train_tokenizer").main(["--input", str(corpus), "--vocab-size", "400", "--output-dir", tok])
    vocab, merges = os.path.join(tok, "vocab.json"), os.path.join(tok, "merges.txt")
    prefix = str(root / "corpus")
    _load_tool("preprocess_data").main(["--input", str(corpus), "--tokenizer-type", "GPT2BPETokenizer",
                                        "--vocab-file", vocab, "--merge-file", merges, "--append-eod",
                                        "--output-prefix", prefix])
    return {"VOCAB_FILE": vocab, "MERGE_FILE": merges, "DATA_PATH": f"{prefix}_text_document", "REPO": REPO,
            "CORPUS": str(corpus)}


@pytest.fixture(scope="session")
def compat_sp_data(compat_data, tmp_path_factory) -> dict[str, str]:
    """$TOKENIZER_MODEL (a SentencePiece model trained here, standing for Llama's tokenizer.model) and
    $SP_DATA_PATH (the corpus preprocessed with GPTSentencePieceTokenizer)."""
    import sentencepiece as spm

    root, corpus = tmp_path_factory.mktemp("compat_sp"), compat_data["CORPUS"]
    texts = root / "sp_corpus.txt"
    with open(corpus, encoding="utf-8") as src, open(texts, "w", encoding="utf-8") as dst:
        dst.writelines(json.loads(line)["text"].replace("\n", " ") + "\n" for line in src)
    model_prefix = str(root / "sp")
    spm.SentencePieceTrainer.train(input=str(texts), model_prefix=model_prefix, vocab_size=300, model_type="bpe",
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    prefix = str(root / "sp_corpus")
    _load_tool("preprocess_data").main(["--input", str(corpus), "--tokenizer-type", "GPTSentencePieceTokenizer",
                                        "--tokenizer-model", f"{model_prefix}.model", "--append-eod",
                                        "--output-prefix", prefix])
    return {"TOKENIZER_MODEL": f"{model_prefix}.model", "SP_DATA_PATH": f"{prefix}_text_document"}
