"""Same data, same order as upstream Megatron-DeepSpeed: every index array, the first 1,000 samples of each split,
the blend, the per-split paths (--train/--valid/--test-data-path) and the global batches equal arrays that upstream's
own code made (tests/fixtures/upstream_data, see its README for the script and upstream's commit); and upstream's
index cache is reused, or refused in one log line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from megatron.data import index_build
from megatron.data.gpt_builder import build_per_split_datasets, build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.num_samples import train_valid_test_num_samples
from megatron.training.batches import microbatches

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                        "upstream_data")
META = json.load(open(os.path.join(FIXTURES, "meta.json")))
SPLITS = ("train", "valid", "test")


def _build(name: str, cache: str, log=None):
    m = META[name]
    paths = m["data_path"]
    if isinstance(paths, dict):  # upstream's per-split paths
        return build_per_split_datasets(tuple(paths.get(s) for s in SPLITS), m["split"], m["seq_length"], m["seed"],
                                        tuple(m["num_samples"]), cache, 1000, log=log or (lambda _: None))
    return build_train_valid_test_datasets(paths, m["split"], m["seq_length"], m["seed"],
                                           tuple(m["num_samples"]), cache, 1000, log=log or (lambda _: None))


@pytest.fixture
def in_fixtures(monkeypatch, tmp_path):
    """The corpora (no upstream cache: these arrays must be built) in a folder where their relative data paths,
    as upstream was given them, resolve."""
    for c in ("a", "b", "c", "d"):
        for ext in (".bin", ".idx"):
            shutil.copy(os.path.join(FIXTURES, f"corpus_{c}{ext}"), tmp_path / f"corpus_{c}{ext}")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", ["one_epoch", "few_epochs_separate_last", "many_epochs", "blend", "per_split"])
def test_indices_and_first_samples_equal_upstreams(name, in_fixtures, tmp_path):
    want = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    for split, ds in zip(SPLITS, _build(name, str(tmp_path / "cache")), strict=True):
        assert all(getattr(p, "index_source", "ours") == "ours" for p in getattr(ds, "datasets", [ds]))
        assert len(ds) == META[name][f"{split}_len"]
        parts = ds.datasets if hasattr(ds, "datasets") else [ds]
        for k, part in enumerate(parts):
            tag = f"{split}{k}" if len(parts) > 1 else split
            assert part.num_epochs == META[name][f"{tag}_epochs"]
            for key in ("doc_idx", "sample_idx", "shuffle_idx"):
                np.testing.assert_array_equal(np.asarray(getattr(part, key)), want[f"{tag}_{key}"], err_msg=tag + key)
        if hasattr(ds, "dataset_index"):  # upstream's blending index (its greedy rule, its 0.5% margin)
            np.testing.assert_array_equal(ds.dataset_index, want[f"{split}_dataset_index"])
            np.testing.assert_array_equal(ds.dataset_sample_index, want[f"{split}_dataset_sample_index"])
        samples = want[f"{split}_samples"]
        got = np.stack([ds[i]["text"] for i in range(len(samples))])
        np.testing.assert_array_equal(got, samples.astype(np.int64), err_msg=split)


def test_per_split_fixture_reads_whole_corpora_of_each_split():
    """What the per_split scenario checks: train blends corpus_a and corpus_b (weights 0.3/0.7, every document, not
    --split's share), valid is corpus_c alone and test corpus_d alone."""
    m, want = META["per_split"], np.load(os.path.join(FIXTURES, "per_split.npz"))
    assert m["data_path"] == {"train": ["0.3", "corpus_a", "0.7", "corpus_b"], "valid": ["corpus_c"],
                              "test": ["corpus_d"]}
    for tag, corpus in (("train0", "corpus_a"), ("train1", "corpus_b"), ("valid", "corpus_c"), ("test", "corpus_d")):
        docs = IndexedDataset(os.path.join(FIXTURES, corpus)).num_documents
        assert sorted(set(want[f"{tag}_doc_idx"].tolist())) == list(range(docs)), tag
    assert len(want["train_samples"]) == 1000


def test_data_path_train_cache_is_not_taken_for_a_per_split_run(tmp_path, monkeypatch):
    """Upstream's cache description has no document range: its --data-path train cache of corpus_a (the --split
    share, 3 epochs) has the md5 a --train-data-path corpus_a run of the same count looks for (all documents, also 3
    epochs). The arrays do not fit the documents, so it is refused in one line and ours are built."""
    _copy_fixture_cache(tmp_path)
    monkeypatch.chdir(tmp_path)
    m, logs = META["few_epochs_separate_last"], []
    train, valid, test = build_per_split_datasets((["corpus_a"], None, None), m["split"], m["seq_length"], m["seed"],
                                                  (m["num_samples"][0], 10, 10), str(tmp_path / "ours"), 1000,
                                                  log=logs.append)
    assert valid is None and test is None  # no path, no split
    refused = [x for x in logs if "not reusing upstream's train index cache" in x]
    assert len(refused) == 1 and "not 3 epochs x 293 documents" in refused[0], logs
    assert train.index_source == "ours" and len(train.documents) == 293


def test_fixture_scenarios_cover_the_epoch_cases():
    """The fixtures are worth what they cover: one epoch, a separate last epoch, many epochs without one."""
    def separate(name, split):
        m, tokens = META[name], _split_tokens(split)
        n = m["num_samples"][SPLITS.index(split)]
        epochs = index_build.num_epochs(tokens, m["seq_length"], n)
        return epochs, index_build.separate_last_epoch(epochs, tokens, m["seq_length"], n)

    assert separate("one_epoch", "train") == (1, False)
    assert separate("few_epochs_separate_last", "train") == (3, True)
    epochs, sep = separate("many_epochs", "train")
    assert epochs >= 6 and not sep


def _split_tokens(split: str) -> int:
    from megatron.data.split import split_boundaries

    ds = IndexedDataset(os.path.join(FIXTURES, "corpus_a"))
    b = split_boundaries(META["one_epoch"]["split"], ds.num_documents)
    i = SPLITS.index(split)
    return int(ds.sizes[b[i]:b[i + 1]].astype(np.int64).sum())


def _global_batches(ds, kind: str, dp: int, consumed: int, sharding: bool, iterations: int):
    """[dp, gas * mbs, seq + 1] tokens per iteration, each rank's stream stepped as training steps it."""
    mbs, gbs = 2, 8
    streams = [microbatches(ds, consumed, mbs, r, dp, device="cpu", dataloader_type=kind, data_sharding=sharding)
               for r in range(dp)]
    gas = gbs // (mbs * dp)
    for _ in range(iterations):
        yield np.stack([np.concatenate([next(s)["text"].numpy() for _ in range(gas)]) for s in streams])


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["single", "cyclic", "cyclic_nosharding"])
def test_global_batches_equal_upstreams(kind, dp, in_fixtures, tmp_path):
    want = np.load(os.path.join(FIXTURES, "batches.npz"))
    train, valid, _ = _build("one_epoch", str(tmp_path / "cache"))
    ds = train if kind == "single" else valid  # valid: 123 samples, so cyclic epochs wrap before iteration 50
    loader_kind, sharding = ("single", True) if kind == "single" else ("cyclic", kind == "cyclic")
    got = list(_global_batches(ds, loader_kind, dp, 0, sharding, 50))
    for it in (1, 2, 50):
        np.testing.assert_array_equal(got[it - 1], want[f"{kind}_dp{dp}_it{it}_tokens"].astype(np.int64),
                                      err_msg=f"iteration {it}")
    # A resume at consumed = done x 8 samples (within and across cyclic epochs of 15 iterations) gives what upstream's
    # resumed sampler gives, which for these sizes is also what the uninterrupted run reads next.
    for done in META["batches"]["resume_at"]:
        resumed = next(_global_batches(ds, loader_kind, dp, done * 8, sharding, 1))
        index = want[f"{kind}_dp{dp}_resume{done}_index"]
        np.testing.assert_array_equal(resumed, np.stack([[ds[int(i)]["text"] for i in row] for row in index]))
        np.testing.assert_array_equal(resumed, got[done])


def test_num_samples_per_split_are_upstreams():
    # train_iters x gbs (or --train-samples), (train_iters // eval_interval + 1) x eval_iters x gbs, eval_iters x gbs
    assert train_valid_test_num_samples(100, None, 8, 30, 5) == (800, 4 * 5 * 8, 40)
    assert train_valid_test_num_samples(100, 1234, 8, 30, 5) == (1234, 160, 40)
    assert train_valid_test_num_samples(10, None, 4, 10, 0) == (40, 0, 0)
    # Each evaluation reads on where the last one stopped (upstream's one validation iterator).


def _copy_fixture_cache(tmp_path, folder: str = "index-cache") -> str:
    for f in ("corpus_a.bin", "corpus_a.idx"):
        shutil.copy(os.path.join(FIXTURES, f), tmp_path / f)
    shutil.copytree(os.path.join(FIXTURES, "index-cache"), tmp_path / folder)
    return str(tmp_path / folder)


def _upstream_train(logs, monkeypatch, tmp_path, data_cache_path: str | None = None):
    monkeypatch.chdir(tmp_path)
    return _build("few_epochs_separate_last", data_cache_path or str(tmp_path / "ours"), log=logs.append)[0]


@pytest.mark.parametrize("where", ["index-cache", "--data-cache-path"])
def test_upstream_index_cache_is_reused_read_only(where, tmp_path, monkeypatch):
    """Upstream looks in dirname(PREFIX)/index-cache, then in --data-cache-path: both are found; ours are written
    beside upstream's files (in --data-cache-path) without touching them."""
    cache = _copy_fixture_cache(tmp_path, "index-cache" if where == "index-cache" else "shared")
    ours = str(tmp_path / "ours") if where == "index-cache" else cache
    before = {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}
    built = []
    real = index_build.build_upstream_order
    monkeypatch.setattr("megatron.data.gpt_dataset.build_upstream_order",
                        lambda *a: built.append(a) or real(*a))
    logs: list[str] = []
    train = _upstream_train(logs, monkeypatch, tmp_path, ours)
    assert train.index_source == "upstream"
    assert len(built) == 2  # valid and test were built; train came from upstream's files
    assert [m for m in logs if "reusing upstream's train indices" in m], logs
    want = np.load(os.path.join(FIXTURES, "few_epochs_separate_last.npz"))
    for key in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(np.asarray(getattr(train, key)), want[f"train_{key}"])
        assert os.path.dirname(getattr(train, key).filename) == cache  # memory-mapped in place, not copied
    after = {f: open(os.path.join(cache, f), "rb").read() for f in before}
    assert after == before  # untouched
    if cache == ours:  # valid and test were built beside them, under our own names
        assert len([f for f in os.listdir(cache) if f not in before and f.endswith(".npy")]) == 6
    # A rank that does not build finds the same files after the barrier.
    from megatron.data.gpt_dataset import GPTDataset

    m = META["few_epochs_separate_last"]
    other = GPTDataset("train", train.indexed, 0, len(train.documents), m["num_samples"][0], m["seq_length"],
                       m["seed"], cache_dir=ours, build_on_this_rank=False, log=logs.append, split=m["split"])
    assert other.index_source == "upstream"


def test_stale_upstream_cache_is_rebuilt_with_one_log_line(tmp_path, monkeypatch):
    _copy_fixture_cache(tmp_path)
    # Same document count and tokens per split, so upstream's description (which names no content) still matches,
    # but two documents of the train split swap places: upstream's sample_idx no longer fits the sizes.
    ds = IndexedDataset(str(tmp_path / "corpus_a"))
    docs = [np.array(ds[i]) for i in range(ds.num_documents)]
    assert len(docs[0]) != len(docs[1])
    docs[0], docs[1] = docs[1], docs[0]
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus_a.bin"), ds.dtype)
    for d in docs:
        builder.add_document(d)
    builder.finalize(str(tmp_path / "corpus_a.idx"))
    logs: list[str] = []
    train = _upstream_train(logs, monkeypatch, tmp_path)
    refused = [m for m in logs if "not reusing upstream's train index cache" in m]
    assert len(refused) == 1 and "sample_idx does not match the document sizes" in refused[0], logs
    assert train.index_source == "ours"
    m = META["few_epochs_separate_last"]
    fresh = index_build.build_upstream_order(train.documents, train.indexed.sizes, m["num_samples"][0],
                                             m["seq_length"], m["seed"])
    for key in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(np.asarray(getattr(train, key)), fresh[key])
    # A .dsc that describes another data set under the expected name is refused too.
    logs.clear()
    shutil.rmtree(tmp_path / "ours")
    shutil.copy(os.path.join(FIXTURES, "corpus_a.idx"), tmp_path / "corpus_a.idx")
    shutil.copy(os.path.join(FIXTURES, "corpus_a.bin"), tmp_path / "corpus_a.bin")
    dsc = next(f for f in os.listdir(tmp_path / "index-cache") if f.endswith(".dsc"))
    with open(tmp_path / "index-cache" / dsc, "a") as f:
        f.write("something else\n")
    train = _upstream_train(logs, monkeypatch, tmp_path)
    refused = [m for m in logs if "not reusing upstream's train index cache" in m]
    assert len(refused) == 1 and "describes another data set" in refused[0], logs
    assert train.index_source == "ours"


def test_upstream_default_split_spelling_is_looked_for_too():
    from megatron.data.upstream_cache import split_spellings

    # Upstream's default --split is "969, 30, 1" (spaces), ours "969,30,1": a run that never passed --split hashed
    # the former, so both are tried; other proportions only as given.
    assert split_spellings("969,30,1") == ["969,30,1", "969, 30, 1"]
    assert split_spellings("969, 30, 1") == ["969, 30, 1"]
    assert split_spellings("90,7,3") == ["90,7,3"]
