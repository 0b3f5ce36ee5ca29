"""Issue 44's per-split data and checkpoint-argument acceptance on one straight run: --train-data-path 0.3 A 0.7 B
--valid-data-path C --test-data-path D trains and evaluates both held-out corpora (their samples are upstream's:
tests/unit/data/test_upstream_order.py), and its checkpoint resumed from a named tag with --use-checkpoint-args and
no model flag goes on with the straight run's losses."""

from __future__ import annotations

import os

import pytest

from tests.checkpointing.common import pretrain_on

CORPORA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream_data")
# A model nothing of which is a default: each of these must come back from the checkpoint.
MODEL = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4", "--num-key-value-heads", "2",
         "--seq-length", "16", "--normalization", "rmsnorm", "--swiglu", "--use-rotary-position-embeddings",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--make-vocab-size-divisible-by", "64"]


def _run(cache: str) -> list[str]:
    """The data and training flags (both jobs give them)."""
    a, b, c, d = (os.path.join(CORPORA, f"corpus_{x}") for x in "abcd")
    return ["--train-data-path", "0.3", a, "0.7", b, "--valid-data-path", c, "--test-data-path", d,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-cache-path", cache,
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "2e-3",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--seed", "7", "--distributed-backend", "gloo"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 iterations, checkpoints at 3 and 6 ('latest' names global_step6)."""
    tmp = tmp_path_factory.mktemp("straight")
    save = str(tmp / "ckpt")
    summary = pretrain_on(1, MODEL + _run(str(tmp / "cache")) + ["--save", save, "--save-interval", "3"])
    return save, str(tmp / "cache"), summary


def test_per_split_paths_train_and_evaluate_each_corpus(straight):
    _, _, summary = straight
    assert sorted(summary["losses"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(summary["valid_losses"]) == [3, 6]  # --valid-data-path's corpus, every --eval-interval
    assert set(summary["final_eval"]) == {"valid", "test"}  # and at the end, --test-data-path's too
    assert summary["final_eval"]["valid"] != summary["final_eval"]["test"]


def test_use_checkpoint_args_resumes_a_tag_with_the_straight_runs_losses(straight):
    save, cache, summary = straight
    assert open(os.path.join(save, "latest")).read() == "global_step6"
    resumed = pretrain_on(1, _run(cache) + ["--load", save, "--load-tag", "global_step3", "--use-checkpoint-args"])
    assert resumed["losses"] == {i: summary["losses"][i] for i in (4, 5, 6)}, (resumed["losses"], summary["losses"])
    assert len(set(summary["losses"].values())) == 6  # the loss moves: equality is not trivial
