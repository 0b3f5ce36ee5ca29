"""Every bad input a user can give the data pipeline ends in one line that names the file or flag and the fix."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.gpt_builder import build_train_valid_test_datasets, parse_data_path
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.errors import ConfigError, DataError, run_cli
from megatron.tokenizer import build_tokenizer


@pytest.fixture
def copy_of(dataset_prefix, tmp_path):
    """A private copy of the preprocessed dataset that a test may damage."""
    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(dataset_prefix + ext, prefix + ext)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file(copy_of, missing):
    os.remove(copy_of + missing)
    with pytest.raises(DataError, match=rf"copy\{missing} not found: a dataset is named by the prefix"):
        IndexedDataset(copy_of)


def test_wrong_magic(copy_of):
    _patch(copy_of + ".idx", 0, b"NOTMEGA")
    with pytest.raises(DataError, match=r"copy\.idx is not a Megatron MMIDIDX index \(wrong magic bytes\)"):
        IndexedDataset(copy_of)


def test_wrong_version(copy_of):
    _patch(copy_of + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"copy\.idx has index version 2, only version 1 .*preprocess_data"):
        IndexedDataset(copy_of)


def test_unknown_dtype_code(copy_of):
    _patch(copy_of + ".idx", 17, bytes([42]))
    with pytest.raises(DataError, match="unknown dtype code 42"):
        IndexedDataset(copy_of)


def test_truncated_bin(copy_of):
    size = os.path.getsize(copy_of + ".bin")
    os.truncate(copy_of + ".bin", size - 3)
    with pytest.raises(DataError, match=rf"copy\.bin is truncated: {size - 3} bytes but .* indexes {size}"):
        IndexedDataset(copy_of)


def test_truncated_idx(copy_of):
    os.truncate(copy_of + ".idx", os.path.getsize(copy_of + ".idx") - 8)
    with pytest.raises(DataError, match=r"copy\.idx is truncated"):
        IndexedDataset(copy_of)


def test_vocab_larger_than_dtype(copy_of):
    with pytest.raises(DataError, match=r"stores uint16 token ids but the tokenizer has 70000 entries"):
        IndexedDataset(copy_of).check_vocab(70000)


def test_token_ids_beyond_vocab(copy_of):
    top = int(np.max(np.fromfile(copy_of + ".bin", dtype=np.uint16)))
    with pytest.raises(DataError, match=rf"holds token id {top} but the tokenizer has only 300 entries"):
        build_train_valid_test_datasets([copy_of], "1", 16, 1, (10, 0, 0), None, 300)


def test_empty_corpus(tmp_path, gpt2_flags, load_tool, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    argv = ["--input", str(empty), "--output-prefix", str(tmp_path / "e"), *gpt2_flags]
    assert run_cli(load_tool("preprocess_data").main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --input ") and "produced no documents (empty corpus" in err[0]
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".bin", ".idx"))]
    assert run_cli(load_tool("train_tokenizer").main, ["--input", str(empty), "--output-dir", str(tmp_path)]) == 2
    assert "holds no text to train on (empty corpus)" in capsys.readouterr().err


def test_non_json_line_reports_line_number(tmp_path, gpt2_flags, load_tool, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "fine"}) + "\n{'text': 'single'}\n")
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "c"), "--workers", "2", *gpt2_flags]
    assert run_cli(load_tool("preprocess_data").main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: {path}:3: not valid JSON") and err[0].endswith("or pass --bad-lines skip")
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".bin", ".idx"))]  # no half-written dataset


def test_missing_json_key(tmp_path, gpt2_flags, load_tool):
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"k\.jsonl:1: no key 'text' \(keys: content\); choose it with --json-keys"):
        load_tool("preprocess_data").main(["--input", str(path), "--output-prefix", str(tmp_path / "k"), *gpt2_flags])


@pytest.mark.parametrize(
    ("data_path", "message"),
    [
        (["0.5", "a", "zero.3", "b"], r"'zero\.3' is not a weight; give 'W1 PREFIX1 W2 PREFIX2 \.\.\.'"),
        (["0.5", "a", "b"], r"has 3 entries: to blend, give pairs"),
        (["-1", "a", "2", "b"], r"weight '-1' for a must be a non-negative number"),
        (["0", "a", "0", "b"], r"the weights sum to 0"),
        ([], r"--data-path is empty"),
    ],
)
def test_unparsable_data_path(data_path, message):
    with pytest.raises(ConfigError, match=message):
        parse_data_path(data_path)


def test_split_leaving_train_empty(dataset_prefix):
    with pytest.raises(ConfigError, match=r"--split 0,50,50 leaves the train split of .* with no documents"):
        build_train_valid_test_datasets([dataset_prefix], "0,50,50", 16, 1, (10, 1, 1), None, 600)
    with pytest.raises(ConfigError, match=r"--split 'a,b' must be up to three numbers"):
        build_train_valid_test_datasets([dataset_prefix], "a,b", 16, 1, (10, 1, 1), None, 600)


def test_dataset_without_tokens(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "z.bin"), dtype=np.uint16)
    b.add_document([])
    b.finalize(str(tmp_path / "z.idx"))
    with pytest.raises(DataError, match=r"the train split of .*z .* holds 0 tokens, too few for one sample"):
        build_train_valid_test_datasets([str(tmp_path / "z")], "1", 16, 1, (10, 0, 0), str(tmp_path), None)


def test_missing_extension_says_how_to_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.data._helpers", None)  # makes the import fail
    with pytest.raises(
        DataError, match=r"not built: run `pip install -e \.` or `python setup\.py build_ext --inplace`"
    ):
        helpers.build_sample_idx(np.array([4], np.int32), np.array([0]), 2, 1)


def test_stale_extension_says_how_to_rebuild(monkeypatch):
    # A build from before the blending index became upstream's has no VERSION: refused, not silently used.
    import types

    monkeypatch.setitem(sys.modules, "megatron.data._helpers", types.ModuleType("megatron.data._helpers"))
    with pytest.raises(DataError, match=r"is stale \(version 1, the sources are at 2\): rebuild it with `python "
                                        r"setup\.py build_ext --inplace`"):
        helpers.build_blending_indices(np.array([0.5, 0.5]), 4)


def test_tokenizer_flags(tmp_path):
    with pytest.raises(ConfigError, match=r"--vocab-file .*nope\.json not found; make one with tools/train_tokenizer"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file="m.txt")
    with pytest.raises(ConfigError, match=r"needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(ConfigError, match=r"--tokenizer-type 'BertWordPiece' is not one of GPT2BPETokenizer"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(ConfigError, match=r"--tokenizer-model .* not found"):
        build_tokenizer("HFTokenizer", tokenizer_model=str(tmp_path / "none"))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(DataError, match=r"cannot read tokenizer .*tokenizer\.json"):
        build_tokenizer("HFTokenizer", tokenizer_model=str(tmp_path))


def test_resume_past_the_end():
    with pytest.raises(ConfigError, match=r"consumed samples 64 is not below the dataset's 64 samples"):
        MegatronPretrainingSampler(64, 64, 2, 0, 1)
