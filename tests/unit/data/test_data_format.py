"""Round trip and format compatibility: jsonl -> preprocess_data -> .bin/.idx -> the same ids as the tokenizer."""

from __future__ import annotations

import json
import os
import signal
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, merge_datasets
from megatron.tokenizer import build_tokenizer


def read_mmidx_independently(prefix: str) -> list[list[int]]:
    """A reader written only from the format spec, sharing no code with megatron.data."""
    codes = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
    with open(prefix + ".idx", "rb") as f:
        blob = f.read()
    assert blob[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", blob[9:17]) == (1,)
    dtype = np.dtype(codes[blob[17]])
    n, m = struct.unpack("<QQ", blob[18:34])
    sizes = struct.unpack(f"<{n}i", blob[34 : 34 + 4 * n])
    pointers = struct.unpack(f"<{n}q", blob[34 + 4 * n : 34 + 12 * n])
    doc_idx = struct.unpack(f"<{m}q", blob[34 + 12 * n : 34 + 12 * n + 8 * m])
    assert len(blob) == 34 + 12 * n + 8 * m
    assert doc_idx == tuple(range(n + 1))  # one sequence per document
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    return [np.frombuffer(data, dtype, count=s, offset=p).tolist() for s, p in zip(sizes, pointers, strict=True)]


def test_roundtrip_ids_equal_tokenizer(corpus, tokenizer_dir, dataset_prefix):
    _, texts = corpus
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=os.path.join(tokenizer_dir, "vocab.json"),
        merge_file=os.path.join(tokenizer_dir, "merges.txt"),
    )
    hf = build_tokenizer("HFTokenizer", tokenizer_model=tokenizer_dir)
    assert gpt2.vocab_size == hf.vocab_size == 600
    assert gpt2.eod == hf.eod == 0  # <|endoftext|> is the first special token
    ds = IndexedDataset(dataset_prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(texts) and ds.num_documents == len(texts)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        expected = gpt2.tokenize(texts[i]) + [gpt2.eod]
        assert ds[i].tolist() == expected
        assert hf.tokenize(texts[i]) + [hf.eod] == expected
        assert gpt2.detokenize(expected[:-1]) == texts[i]
    assert int(ds.sizes.sum()) == sum(len(gpt2.tokenize(t)) + 1 for t in texts)


def test_independent_reader_gets_identical_ids(corpus, tokenizer_dir, dataset_prefix):
    _, texts = corpus
    hf = build_tokenizer("HFTokenizer", tokenizer_model=os.path.join(tokenizer_dir, "tokenizer.json"))
    docs = read_mmidx_independently(dataset_prefix)
    assert docs == [hf.tokenize(t) + [hf.eod] for t in texts]


def test_workers_and_partitions_give_identical_files(load_tool, corpus, gpt2_flags, dataset_prefix, tmp_path):
    out = tmp_path / "par"
    tool = load_tool("preprocess_data")
    argv = ["--input", corpus[0], "--output-prefix", str(out), "--append-eod", "--workers", "2", "--partitions", "3"]
    stats = tool.preprocess(tool.get_args([*argv, *gpt2_flags]))
    assert stats.documents == len(corpus[1]) and stats.workers == 2
    for ext in (".bin", ".idx"):
        with open(f"{out}_text_document{ext}", "rb") as a, open(dataset_prefix + ext, "rb") as b:
            assert a.read() == b.read()
    assert sorted(os.listdir(tmp_path)) == ["par_text_document.bin", "par_text_document.idx"]  # parts removed


def test_pool_workers_end_on_sigterm_whatever_handler_the_caller_installed(load_tool, tokenizer_dir):
    # A forked pool worker keeps the caller's Python SIGTERM handler (a training process's graceful stop), so
    # Pool.terminate() could not end it and preprocess() hung in join(): the initializer restores the defaults.
    tool = load_tool("preprocess_data")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for s in before:
            signal.signal(s, lambda *_: None)
        tool._init_worker({"tokenizer_type": "HFTokenizer",
                           "tokenizer_model": os.path.join(tokenizer_dir, "tokenizer.json")}, ["text"], True, np.uint16)
        assert all(signal.getsignal(s) is signal.SIG_DFL for s in before)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_int32_tokens_and_merge(load_tool, tmp_path):
    parts = []
    for k, docs in enumerate([[[70000, 1, 2], [5]], [[65535, 99999, 0, 7]]]):
        b = IndexedDatasetBuilder(str(tmp_path / f"p{k}.bin"), dtype=np.int32)
        for d in docs:
            b.add_document(d)
        b.finalize(str(tmp_path / f"p{k}.idx"))
        parts.append(str(tmp_path / f"p{k}"))
    load_tool("merge_datasets").main(["--input", *parts, "--output-prefix", str(tmp_path / "m")])
    merged = IndexedDataset(str(tmp_path / "m"))
    assert merged.dtype == np.int32 and merged.doc_idx.tolist() == [0, 1, 2, 3]
    assert read_mmidx_independently(str(tmp_path / "m")) == [[70000, 1, 2], [5], [65535, 99999, 0, 7]]
    assert merge_datasets(parts[::-1], str(tmp_path / "r"))[0].tolist() == [65535, 99999, 0, 7]


def test_bad_lines_skip_keeps_the_rest(load_tool, tmp_path, gpt2_flags, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "hello world"}) + "\n{oops\n\n" + json.dumps({"text": "def f(): pass"}) + "\n")
    load_tool("preprocess_data").main(
        ["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--bad-lines", "skip", *gpt2_flags]
    )
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert len(ds) == 2 and ds.sizes.tolist()[0] > 0


def test_null_tokenizer_roundtrip(load_tool, tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(map(str, range(i, i + 5)))}) + "\n" for i in range(4)))
    load_tool("preprocess_data").main(
        ["--input", str(path), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--append-eod"]
    )  # fmt: skip
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert [ds[i].tolist() for i in range(4)] == [list(range(i, i + 5)) + [100] for i in range(4)]


@pytest.mark.parametrize("key", ["text", "id"])
def test_json_keys_selects_field(load_tool, tmp_path, gpt2_flags, key):
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"text": "alpha", "id": "beta"}) + "\n")
    load_tool("preprocess_data").main(
        ["--input", str(path), "--output-prefix", str(tmp_path / "k"), "--json-keys", key, *gpt2_flags]
    )
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_flags[3], merge_file=gpt2_flags[5])
    assert IndexedDataset(str(tmp_path / f"k_{key}_document"))[0].tolist() == tok.tokenize(
        "alpha" if key == "text" else "beta"
    )
