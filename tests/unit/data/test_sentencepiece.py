"""SentencePiece tokenizers (GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer) on a model trained
here by tools/train_tokenizer.py, against sentencepiece itself, preprocess_data and a 2-iteration training run; against
upstream's own classes on the model of tests/fixtures/upstream_tokenizer; and upstream's default --tokenizer-type
GPT2BPETokenizer."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset
from megatron.errors import ConfigError, DataError
from megatron.tokenizer import build_tokenizer
from tests.launch import run_pretrain

spm = pytest.importorskip("sentencepiece")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# A SentencePiece model and what upstream's own tokenizer classes make of some texts with it (README.md there).
UPSTREAM_FIXTURE = os.path.join(REPO, "tests", "fixtures", "upstream_tokenizer")
TEXTS = ["Frontier trains a GPT on 9408 nodes.", "hello <EOD> world </s> and <s>", "", "  spaces   kept  ",
         "<MASK><CLS>"]


@pytest.fixture(scope="module")
def sp_model(corpus, load_tool, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("sp"))
    load_tool("train_tokenizer").main(["--input", corpus[0], "--format", "sentencepiece", "--vocab-size", "400",
                                       "--output-dir", out])
    return os.path.join(out, "tokenizer.model")


def test_gpt_sentencepiece_is_the_models_own_ids(sp_model):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (sp.get_piece_size(), sp.eos_id(), sp.bos_id(), -1)
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)  # train_tokenizer's Llama layout
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text) and tok.detokenize(ids) == sp.decode(ids)


def test_llama2_prepends_bos_and_eod_is_eos(sp_model):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert (tok.vocab_size, tok.eod, tok.bos) == (gpt.vocab_size, 2, 1)
    for text in TEXTS:
        assert tok.tokenize(text) == [1] + gpt.tokenize(text)
    assert tok.tokenize("abc", bos=False, eos=True) == gpt.tokenize("abc") + [2]


def test_sentencepiece_tokenizer_adds_upstreams_special_tokens(sp_model):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    n = sp.get_piece_size()
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    # <CLS> n, <SEP> n+1, <EOD> n+2, <MASK> n+3, <PAD> n+4 (the model has none); <s>/</s> are the model's.
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (n + 5, n + 2, 1, n + 4)
    assert tok.tokenize("a<EOD>b</s>") == sp.encode("a") + [n + 2] + sp.encode("b") + [2]


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_same_as_upstream(kind):
    with open(os.path.join(UPSTREAM_FIXTURE, "upstream_tokenizers.json"), encoding="utf-8") as f:
        fixture = json.load(f)
    up = fixture[kind]
    ours = build_tokenizer(kind, tokenizer_model=os.path.join(UPSTREAM_FIXTURE, "tokenizer.model"))
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == (up["vocab_size"], up["eod"], up["bos"], up["pad"])
    for text, ids, text_back in zip(fixture["texts"], up["ids"], up["detokenized"], strict=True):
        assert ours.tokenize(text) == ids, text
        assert ours.detokenize(ids) == text_back, text


def test_one_line_errors(tmp_path, sp_model, corpus, load_tool):
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"):
        with pytest.raises(ConfigError, match=f"--tokenizer-type {kind} needs --tokenizer-model"):
            build_tokenizer(kind)
        with pytest.raises(ConfigError, match=r"--tokenizer-model .*none\.model not found"):
            build_tokenizer(kind, tokenizer_model=str(tmp_path / "none.model"))
    with pytest.raises(ConfigError, match=r"--vocab-size 100 is too small for --format sentencepiece"):
        load_tool("train_tokenizer").main(["--input", corpus[0], "--format", "sentencepiece", "--vocab-size", "100",
                                           "--output-dir", str(tmp_path / "small")])
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"bad\.model is not a SentencePiece model") as e:
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind,first", [("GPTSentencePieceTokenizer", []), ("Llama2Tokenizer", [1])])
def test_preprocess_data_accepts_sentencepiece_types(kind, first, sp_model, load_tool, tmp_path):
    texts = ["first document here", "a second, longer document for the tiny model"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    load_tool("preprocess_data").main(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
                                       kind, "--tokenizer-model", sp_model, "--append-eod"])
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    ds = IndexedDataset(str(tmp_path / "d_text_document"))
    assert [list(ds[i]) for i in range(len(ds))] == [first + sp.encode(t) + [2] for t in texts]


def test_pretrain_two_iterations_on_gpt_sentencepiece_data(corpus, sp_model, load_tool, tmp_path):
    prefix = tmp_path / "sp"
    load_tool("preprocess_data").main(["--input", corpus[0], "--output-prefix", str(prefix), "--tokenizer-type",
                                       "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod"])
    args = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--data-path", f"{prefix}_text_document", "--split", "98,2,0",
            "--data-cache-path", str(tmp_path / "cache"), "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", sp_model]
    proc = run_pretrain(1, args, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in proc.stdout.splitlines() if "lm loss:" in line]
    assert len(losses) == 2 and all(np.isfinite(losses)), proc.stdout[-2000:]


def _pretrain_data(**kw):
    from megatron.arguments import data_config_from_args, parse_args

    return data_config_from_args(parse_args(["--data-path", "x", *sum((["--" + k.replace("_", "-"), v]
                                                                       for k, v in kw.items()), [])]))


def test_default_tokenizer_type_is_gpt2_bpe(tokenizer_dir, load_tool):
    spec = importlib.util.spec_from_file_location("pretrain_gpt_entry", os.path.join(REPO, "pretrain_gpt.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    vocab, merges = os.path.join(tokenizer_dir, "vocab.json"), os.path.join(tokenizer_dir, "merges.txt")
    data = _pretrain_data(vocab_file=vocab, merge_file=merges)
    assert entry.tokenizer_provider(data).vocab_size == len(json.load(open(vocab))) and \
        data.tokenizer_type == "GPT2BPETokenizer"
    with pytest.raises(ConfigError, match=r"without --tokenizer-type uses GPT2BPETokenizer .* needs --merge-file"):
        entry.tokenizer_provider(_pretrain_data(vocab_file=vocab))
    with pytest.raises(ConfigError, match=r"--vocab-file .*nope\.json not found"):
        entry.tokenizer_provider(_pretrain_data(vocab_file=vocab + ".nope.json", merge_file=merges))
