"""A cheap content fingerprint of a ``PREFIX.bin/.idx`` pair, part of the GPT index cache key.

The cache used to be keyed by file sizes, so a data set rewritten with the same size silently reused indices built
for the old documents. Hashing the whole .bin would cost minutes on Frontier-sized data, so the fingerprint is:
the md5 of the whole .idx (document sizes and offsets; small), the .bin size, and the md5 of the .bin's first and
last MiB. A rewrite that changes any document length changes the .idx; one that keeps every length changes the
tokens, which the first/last MiB catch unless the change is confined to the middle of an unchanged-length file.
"""

from __future__ import annotations

import hashlib
import os

from megatron.data.indexed_dataset import data_file_path, index_file_path

EDGE_BYTES = 1 << 20
_memo: dict[tuple, dict] = {}


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns, st.st_ino)


def content_fingerprint(prefix: str) -> dict:
    """{"idx_md5", "bin_bytes", "bin_edges_md5"}; memoised per process on (size, mtime, inode) of both files, so
    train/valid/test of one data set hash it once."""
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    key = (_stat_key(idx_path), _stat_key(bin_path))
    if key in _memo:
        return _memo[key]
    idx = hashlib.md5()
    with open(idx_path, "rb") as f:
        while chunk := f.read(1 << 24):
            idx.update(chunk)
    size = os.path.getsize(bin_path)
    edges = hashlib.md5()
    with open(bin_path, "rb") as f:
        edges.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            edges.update(f.read(EDGE_BYTES))
    _memo[key] = {"idx_md5": idx.hexdigest(), "bin_bytes": size, "bin_edges_md5": edges.hexdigest()}
    return _memo[key]
