"""The GPT index cache is keyed by content: a data set rewritten with the same sizes rebuilds its indices (and says
so once), an unchanged one reuses them."""

import os

import numpy as np

from megatron.data.fingerprint import content_fingerprint
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SEQ, DOCS, LEN = 16, 40, 25


def _write(prefix: str, seed: int) -> np.ndarray:
    """DOCS documents of LEN tokens each (so every rewrite has the same .idx and .bin sizes); returns the tokens."""
    tokens = np.random.RandomState(seed).randint(0, 1000, size=(DOCS, LEN))
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in tokens:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return tokens


def _dataset(prefix: str, cache: str, logs: list, split: str = "train", docs=(0, 30)) -> GPTDataset:
    return GPTDataset(split, IndexedDataset(prefix), docs[0], docs[1], num_samples=20, seq_length=SEQ, seed=3,
                      cache_dir=cache, log=logs.append)


def test_same_size_rewrite_rebuilds_once_and_serves_new_tokens(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    old_tokens = _write(prefix, seed=1)
    sizes = (os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx"))
    logs: list[str] = []
    first = _dataset(prefix, cache, logs)
    assert len(logs) == 1 and logs[0].startswith("built train indices")
    _dataset(prefix, cache, logs)
    assert len(logs) == 1  # unchanged content: the cache is reused

    new_tokens = _write(prefix, seed=2)
    assert (os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx")) == sizes
    assert not np.array_equal(old_tokens, new_tokens)
    second = _dataset(prefix, cache, logs)
    changed = [m for m in logs if "changed since its cached indices were built" in m]
    assert len(changed) == 1 and prefix in changed[0], logs
    assert logs[-1].startswith("built train indices")
    assert second.hash != first.hash
    # The rebuilt indices serve the new tokens: sample 0 is a window of the new document stream.
    stream = np.concatenate([new_tokens[int(d)] for d in second.doc_idx]).astype(np.int64)
    s = int(second.shuffle_idx[0])
    np.testing.assert_array_equal(second[0]["text"], stream[s * SEQ:s * SEQ + SEQ + 1])

    # Said once per data set: the valid split of the same rewritten set rebuilds silently.
    n_logs = len(logs)
    _dataset(prefix, cache, logs, split="valid", docs=(30, 40))
    assert len(logs) == n_logs + 1 and logs[-1].startswith("built valid indices")
    _dataset(prefix, cache, logs)  # and the new content's cache is reused from now on
    assert len(logs) == n_logs + 1


def test_fingerprint_sees_the_bin_edges_and_the_idx(tmp_path):
    prefix = str(tmp_path / "d")
    _write(prefix, seed=1)
    base = content_fingerprint(prefix)
    data = bytearray(open(prefix + ".bin", "rb").read())
    data[-1] ^= 1  # last token changed, same size
    with open(prefix + ".bin", "wb") as f:
        f.write(data)
    edited = content_fingerprint(prefix)
    assert edited["bin_bytes"] == base["bin_bytes"] and edited["idx_md5"] == base["idx_md5"]
    assert edited["bin_edges_md5"] != base["bin_edges_md5"]
