"""Data errors come before any process group (issue 13, items 2 and 3): a missing or damaged prefix, a
directory as --data-path, a bad --split, missing tokenizer files, a corpus too small for --seq-length;
many epochs are warned about once per job. The same for every file of the per-split paths (issue 44)."""

import os
import shutil

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDatasetBuilder
from tests.unit.preflight_common import BASE, assert_one_line_error, run_until_process_group, with_flag



def _argv(prefix: str, gpt2_flags: list[str], *extra: str) -> list[str]:
    argv = [a for a in BASE if a != "--mock-data"]
    i = argv.index("--vocab-size")
    del argv[i:i + 2]
    return argv + ["--data-path", prefix, *gpt2_flags, *extra]


@pytest.fixture
def tiny_prefix(tmp_path) -> str:
    """252 tokens in 3 documents (ids below the fixture tokenizer's 600)."""
    b = IndexedDatasetBuilder(str(tmp_path / "tiny.bin"), dtype=np.uint16)
    for n in (100, 100, 52):
        b.add_document(np.arange(n) % 250)
    b.finalize(str(tmp_path / "tiny.idx"))
    return str(tmp_path / "tiny")


def test_bad_prefixes_and_split(dataset_prefix, gpt2_flags, tmp_path, monkeypatch, capsys):
    cases = [
        (str(tmp_path / "nope"), [], [f"{tmp_path / 'nope'}.idx not found", "tools/preprocess_data.py"]),
        (os.path.dirname(dataset_prefix), [], ["is a directory", f"e.g. --data-path {dataset_prefix}"]),
        (dataset_prefix, ["--split", "a,b"], ["--split 'a,b' must be up to three numbers"]),
        (dataset_prefix, ["--split", "0,50,50"], ["--split 0,50,50 leaves the train split", "with no documents"]),
    ]
    for prefix, extra, needles in cases:
        rc, err, out = run_until_process_group(_argv(prefix, gpt2_flags, *extra), monkeypatch, capsys)
        assert_one_line_error(rc, err, out, *needles)


def test_damaged_files_and_tokenizer(dataset_prefix, gpt2_flags, tmp_path, monkeypatch, capsys):
    copy = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(dataset_prefix + ext, copy + ext)
    os.truncate(copy + ".bin", os.path.getsize(copy + ".bin") - 2)
    rc, err, out = run_until_process_group(_argv(copy, gpt2_flags), monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"{copy}.bin is truncated")
    with open(copy + ".idx", "r+b") as f:
        f.write(b"NOTMEGA")
    rc, err, out = run_until_process_group(_argv(copy, gpt2_flags), monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"{copy}.idx is not a Megatron MMIDIDX index")
    flags = with_flag(gpt2_flags, "--vocab-file", str(tmp_path / "vocab.json"))
    rc, err, out = run_until_process_group(_argv(dataset_prefix, flags), monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"--vocab-file {tmp_path / 'vocab.json'} not found")


def test_corpus_too_small_for_seq_length(tiny_prefix, gpt2_flags, monkeypatch, capsys):
    argv = _argv(tiny_prefix, gpt2_flags, "--seq-length", "4096", "--max-position-embeddings", "4096")
    argv = with_flag(with_flag(argv, "--global-batch-size", "2"), "--micro-batch-size", "1")
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys)
    assert_one_line_error(rc, err, out, f"--data-path {tiny_prefix}: its train split holds 252 tokens",
                          "(2 samples x (--seq-length 4096 + 1) = 8194)")


def test_many_epochs_warned_once_per_job(tiny_prefix, gpt2_flags, monkeypatch, capsys):
    # 8 samples x 17 tokens fit one iteration; 10 iterations x 8 x 16 tokens need ceil(1281/252) = 6 epochs.
    argv = with_flag(with_flag(_argv(tiny_prefix, gpt2_flags), "--seq-length", "16"), "--train-iters", "10")
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys)
    assert rc is None and err == ""
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert warnings == [f"> WARNING: --data-path {tiny_prefix}: --train-iters needs 6 epochs over its train split "
                        "of 252 tokens; every sample repeats 6 times (more data, or fewer --train-iters, if "
                        "unintended)"], out
    rc, err, out = run_until_process_group(argv, monkeypatch, capsys, world_size=2, rank=1)
    assert rc is None and "WARNING" not in out
    rc, err, out = run_until_process_group(with_flag(argv, "--train-iters", "2"), monkeypatch, capsys)
    assert rc is None and "WARNING" not in out  # 2 epochs: not worth a warning


def test_per_epoch_doc_shuffle_without_data_path_is_refused(monkeypatch, capsys):
    # Mock data has no documents to order: the flag would be silently ignored, so it is refused before any group.
    rc, err, out = run_until_process_group([*BASE, "--per-epoch-doc-shuffle"], monkeypatch, capsys)
    assert_one_line_error(rc, err, out, "--per-epoch-doc-shuffle orders the documents of --data-path")
    rc, err, out = run_until_process_group(list(BASE), monkeypatch, capsys)
    assert rc is None  # the same flags without it reach the process group


def _per_split_argv(gpt2_flags: list[str], *paths: str) -> list[str]:
    argv = _argv("x", gpt2_flags)
    i = argv.index("--data-path")
    del argv[i:i + 2]
    return argv + list(paths)


def test_per_split_paths_checked_before_the_process_group(dataset_prefix, tiny_prefix, gpt2_flags, tmp_path,
                                                          monkeypatch, capsys):
    """Every file of every split opens and fits the tokenizer; the train corpora (whole, not --split's share) must
    fill one iteration; the flag named is the one that holds the file."""
    ok = ["--train-data-path", "0.3", dataset_prefix, "0.7", dataset_prefix, "--valid-data-path", dataset_prefix,
          "--test-data-path", dataset_prefix]
    rc, err, out = run_until_process_group(_per_split_argv(gpt2_flags, *ok), monkeypatch, capsys)
    assert rc is None and err == "", err
    missing = str(tmp_path / "nope")
    small = {"--seq-length": "4096", "--max-position-embeddings": "4096", "--global-batch-size": "2",
             "--micro-batch-size": "1"}
    cases = [
        (ok[:-1] + [missing], {}, [f"{missing}.idx not found"]),
        (ok[:5] + ["--valid-data-path", os.path.dirname(dataset_prefix)], {},
         ["--valid-data-path", "is a directory", f"e.g. --valid-data-path {dataset_prefix}"]),
        (["--train-data-path", "0.5", dataset_prefix, "0.5"], {}, ["--train-data-path has 3 entries"]),
        (["--train-data-path", tiny_prefix], small, [f"--train-data-path {tiny_prefix}: its train split holds 252"]),
        (["--data-path", dataset_prefix, "--test-data-path", dataset_prefix], {},
         ["--data-path and --test-data-path are both given", "upstream reads --data-path"]),
        (["--valid-data-path", dataset_prefix], {}, ["--valid-data-path / --test-data-path without --train-data"]),
    ]
    for paths, overrides, needles in cases:
        argv = _per_split_argv(gpt2_flags)
        for flag, value in overrides.items():
            argv = with_flag(argv, flag, value)
        rc, err, out = run_until_process_group(argv + paths, monkeypatch, capsys)
        assert_one_line_error(rc, err, out, *needles)
