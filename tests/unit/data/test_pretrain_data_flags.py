"""pretrain() honours the data-loading flags: the sample counts it asks for are upstream's, --num-workers,
--dataloader-type, --no-data-sharding, --eod-mask-loss and --per-epoch-doc-shuffle reach the loaders and datasets
(the orders they give are upstream's: test_upstream_order.py), and validation reads one stream for
the whole run."""

from __future__ import annotations

import os
import shutil

from tests.launch import run_distributed
from tests.models import GPT_L1

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                        "upstream_ckpt", "data")  # documents of the demo corpus, GPT-2 BPE with <|endoftext|>
EOD = 0  # <|endoftext|> in that vocab.json


def _pretrain_recording(argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron.training import pretrain as pt
    from megatron.training import streams

    calls, asked, masks = [], [], []
    real_microbatches, real_datasets = streams.microbatches, pretrain_gpt.datasets_provider

    def forward_step(model, batch):  # what --eod-mask-loss put beside the tokens: (mask, upstream's mask)
        masks.append((batch.get("loss_mask"), (batch["text"][:, :-1] != EOD).float()))
        return pretrain_gpt.forward_step(model, batch)

    def microbatches(dataset, consumed, *args, **kwargs):
        calls.append({"consumed": consumed, "len": len(dataset), "per_epoch": dataset.per_epoch_order, **kwargs})
        return real_microbatches(dataset, consumed, *args, device="cpu", **kwargs)

    def datasets(run, tokenizer, num_samples):
        asked.append(tuple(num_samples))
        return real_datasets(run, tokenizer, num_samples)

    streams.microbatches = microbatches
    summary = pretrain_gpt.pretrain_from_flags(argv, pt.Providers(pretrain_gpt.model_provider, datasets, forward_step,
                                                                  pretrain_gpt.tokenizer_provider))
    return {"calls": calls, "asked": asked, "iterations": summary["iterations"], "masks": masks}


def test_pretrain_passes_loader_flags_and_reads_validation_on(tmp_path):
    for f in ("tiny_text_document.bin", "tiny_text_document.idx"):
        shutil.copy(os.path.join(FIXTURES, f), tmp_path / f)
    argv = GPT_L1.flags() + [
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters",
        "4", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--use-cpu-initialization", "--seed",
        "7", "--distributed-backend", "gloo", "--data-path", str(tmp_path / "tiny_text_document"), "--split",
        "90,7,3", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(FIXTURES, "vocab.json"),
        "--merge-file", os.path.join(FIXTURES, "merges.txt"), "--data-cache-path", str(tmp_path / "cache"),
        "--dataloader-type", "cyclic", "--num-workers", "1", "--per-epoch-doc-shuffle", "--no-data-sharding",
        "--eod-mask-loss"]
    out = run_distributed(_pretrain_recording, 1, timeout=240, argv=argv)[0]
    assert out["iterations"] == 4
    # Upstream's counts: 4 x 4 train samples, (4 // 2 + 1) evaluations x 1 x 4 valid, 1 x 4 test.
    assert out["asked"] == [(16, 12, 4)]
    train, valid, test = out["calls"]  # one validation stream for the whole run, then the test split once
    loading = {"num_workers": 1, "dataloader_type": "cyclic", "seed": 7, "data_sharding": False}
    assert train == {"consumed": 0, "len": train["len"], "per_epoch": True, **loading}
    assert (valid["consumed"], test["consumed"]) == (0, 0) and valid["len"] != test["len"]
    assert all({k: v[k] for k in loading} == loading and v["per_epoch"] for v in (valid, test))
    # --eod-mask-loss: every training and evaluation micro-batch carries upstream's mask (no loss where the input
    # token is the end-of-document token), and the data has some.
    masks = out["masks"]
    # 4 iterations, 2 evaluations during training and valid + test at the end: 8 passes of 2 micro-batches
    assert len(masks) == 8 * 2 and all(m is not None and m.equal(want) for m, want in masks)
    assert any(not want.all() for _, want in masks)


def test_eod_mask_loss_without_documents_is_refused_in_one_line():
    import pretrain_gpt
    import pytest

    from megatron.config import DataConfig
    from megatron.errors import ConfigError

    with pytest.raises(ConfigError, match="--eod-mask-loss needs data made of documents.*--mock-data has none"):
        DataConfig(eod_mask_loss=True, mock_data=True, vocab_size=8).validate()
    assert pretrain_gpt.tokenizer_provider(DataConfig(eod_mask_loss=True, demo_corpus=True).validate()).eod == 256
    assert pretrain_gpt.tokenizer_provider(DataConfig(mock_data=True, vocab_size=8).validate()).eod is None
