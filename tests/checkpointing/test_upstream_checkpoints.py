"""Checkpoints written by upstream Megatron-DeepSpeed itself (tests/fixtures/upstream_ckpt, commit 4efb479d):
read, converted and resumed here, checked against upstream's own recorded losses, lrs and batches."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from tests.launch import REPO, free_port, losses, run_pretrain

FIX = os.path.join(REPO, "tests", "fixtures", "upstream_ckpt")
# The checkpoints record the absolute vocab path of the machine that wrote them; the tests name the copy here.
VOCAB = os.path.join(FIX, "data", "vocab.json")
LAYOUTS = ("tp2_zero1", "pp2_zero1", "megatron_tp2")
_LR = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| learning rate: ([0-9.E+-]+)")


def _recorded(layout: str) -> dict:
    with open(os.path.join(FIX, layout, "upstream_run.json")) as f:
        return json.load(f)


def _flags(data_cache: str) -> list[str]:
    """make_fixtures.sh's flags in ours (upstream's tanh GeLU under --bias-gelu-fusion is our --openai-gelu)."""
    d = os.path.join(FIX, "data")
    return ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--weight-decay", "0",
            "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--openai-gelu",
            "--data-path", os.path.join(d, "tiny_text_document"), "--split", "100,0,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(d, "vocab.json"),
            "--merge-file", os.path.join(d, "merges.txt"), "--make-vocab-size-divisible-by", "64",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
            "--zero-stage", "1", "--distributed-backend", "gloo", "--data-cache-path", data_cache]


LAYOUT_FLAGS = {"tp2_zero1": ["--tensor-model-parallel-size", "2"],
                "pp2_zero1": ["--pipeline-model-parallel-size", "2"],
                "megatron_tp2": ["--tensor-model-parallel-size", "2", "--clip-grad", "0"], "dp2": []}


def _model(vocab_divisible: int):
    from megatron.config import ModelConfig
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=64,
                      vocab_size=320, make_vocab_size_divisible_by=vocab_divisible, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.0, openai_gelu=True)
    return GPTModel(cfg, tp=single_process_state().tp, init_seed=1), cfg


def _loss_on(model, batches) -> float:
    from megatron.training.step import gpt_forward_step

    model.eval()
    with torch.no_grad():
        return sum(gpt_forward_step(model, {"text": torch.tensor(b)}).item() for b in batches) / len(batches)


# --------------------------------------------------------------------------------------------- in one process
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_weights_give_upstreams_loss_on_upstreams_batch(layout):
    """Upstream's weights in our model (TP=1, upstream's padded vocabulary) score upstream's iteration-4
    micro-batches exactly as upstream logged: name mapping, QKV [Q|K|V] -> per-group order, TP/PP merge."""
    from megatron.checkpointing import upstream
    from megatron.checkpointing.full_state.shard import load_into_model
    from megatron.checkpointing.upstream import vocab_rows

    conv = upstream.read(upstream.find(os.path.join(FIX, layout)), trust=True)
    assert conv.iteration == 3 and conv.consumed_samples == 12 and conv.lr_num_steps == 3
    model, cfg = _model(conv.padded_vocab_size)  # one TP rank pads to exactly upstream's row count
    load_into_model(model, vocab_rows(conv, 320, cfg.padded_vocab_size(1)), 2, 1, 0, layout)
    rec = _recorded(layout)
    assert _loss_on(model, rec["resumed_micro_batches"]["4"]) == pytest.approx(rec["resumed_run"]["4"]["lm_loss"],
                                                                                abs=1e-5)
    if layout != "megatron_tp2":  # ZeRO-1 files: Adam moments of every parameter, at upstream's step
        assert conv.optimizer_step == 3 and set(conv.moments) == set(conv.weights)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_upstream_files_need_trust(tmp_path):
    from megatron.checkpointing import upstream
    from megatron.errors import CheckpointError

    for layout in ("tp2_zero1", "megatron_tp2"):
        with pytest.raises(CheckpointError, match="--trust-checkpoint"):
            upstream.read(upstream.find(os.path.join(FIX, layout)), trust=False)
    evil = str(tmp_path / "evil.pt")  # trust unpickles upstream's objects, not anything
    torch.save({"args": _Evil()}, evil)
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        upstream.load_file(evil, trust=True)


def test_converter_writes_a_full_state_with_upstreams_loss(tmp_path):
    """tools/convert_megatron_checkpoint.py: the PP=2 checkpoint as a full state (vocabulary cut to the tokenizer's
    320 rows, as upstream's TP=1 run padded none) scores upstream's batch like upstream; moments carried."""
    import tools.convert_megatron_checkpoint as tool
    from megatron.checkpointing.full_state.files import read_full_moments, read_full_state
    from megatron.checkpointing.full_state.shard import load_into_model
    from megatron.errors import ConfigError

    out = str(tmp_path / "full")
    assert tool.main(["--load", os.path.join(FIX, "pp2_zero1"), "--save", out, "--trust-checkpoint",
                      "--vocab-file", VOCAB]) == 0
    full, meta = read_full_state(out)
    assert (meta["iteration"], meta["consumed_samples"], meta["lr_num_steps"]) == (3, 12, 3)
    assert meta["model"]["vocab_size"] == 320 and full["embedding.word_embeddings.weight"].shape[0] == 320
    model, _ = _model(64)
    load_into_model(model, full, 2, 1, 0, out)
    rec = _recorded("pp2_zero1")
    assert _loss_on(model, rec["resumed_micro_batches"]["4"]) == pytest.approx(rec["resumed_run"]["4"]["lm_loss"],
                                                                                abs=1e-5)
    moments, step = read_full_moments(out)
    assert step == 3 and set(moments) == set(full)
    mout = str(tmp_path / "meg")  # plain Megatron: weights and progress, Adam restarts (no parameter names)
    assert tool.main(["--load", os.path.join(FIX, "megatron_tp2"), "--save", mout, "--trust-checkpoint",
                      "--vocab-file", VOCAB]) == 0
    assert read_full_moments(mout) is None and read_full_state(mout)[1]["iteration"] == 3
    # The recorded vocab path is another machine's: with no vocab given, one line naming --vocab-file.
    with pytest.raises(ConfigError, match="--vocab-file is needed"):
        tool.main(["--load", os.path.join(FIX, "megatron_tp2"), "--save", mout, "--trust-checkpoint"])
    with pytest.raises(ConfigError, match="--vocab-file .*missing.json"):
        tool.main(["--load", os.path.join(FIX, "megatron_tp2"), "--save", mout, "--trust-checkpoint",
                   "--vocab-file", str(tmp_path / "missing.json")])


def test_layouts_recognised_and_unknown_ones_named(tmp_path):
    from megatron.checkpointing import upstream
    from megatron.checkpointing.upstream import unknown_layout_message

    assert upstream.find(os.path.join(FIX, "tp2_zero1")).kind == "deepspeed"
    assert upstream.find(os.path.join(FIX, "megatron_tp2")).kind == "megatron"
    assert unknown_layout_message(str(tmp_path)) is None  # empty: a fresh start is fine
    (tmp_path / "tensorboard").mkdir()
    assert unknown_layout_message(str(tmp_path)) is None
    (tmp_path / "global_step5").mkdir()  # a checkpoint without any marker we read
    assert "global_step5" in unknown_layout_message(str(tmp_path))


@pytest.mark.parametrize("layout,universal", [("tp2_zero1", "universal_tp2"), ("pp2_zero1", "universal_pp2")])
def test_universal_checkpoint_reads_as_the_global_step_it_came_from(layout, universal):
    """DeepSpeed's ds_to_universal.py output of upstream's global_step3 (fixtures/upstream_ckpt/make_universal.py)
    reads to the same weights, Adam moments and progress as global_step3 itself; only the vocabulary padding
    rows (TP=2 pads 320 tokens to 384) come back as zeros, as DeepSpeed's universal loader pads them."""
    from megatron.checkpointing import upstream
    from megatron.model.param_names import VOCAB_PARAMS

    plain = upstream.read(upstream.find(os.path.join(FIX, layout)), trust=True)
    uni_found = upstream.find(os.path.join(FIX, universal), universal=True)
    assert (uni_found.kind, os.path.basename(uni_found.path)) == ("universal", "global_step3_universal")
    uni = upstream.read(uni_found, trust=True)
    for key in ("iteration", "consumed_samples", "lr_num_steps", "optimizer_step", "padded_vocab_size", "layout",
                "model"):
        assert getattr(uni, key) == getattr(plain, key), key
    assert set(uni.weights) == set(plain.weights) and uni.moments and set(uni.moments) == set(plain.moments)
    vocab, padded = 320, plain.padded_vocab_size
    for name, t in plain.weights.items():
        u, rows = uni.weights[name], vocab if name in VOCAB_PARAMS else None
        assert torch.equal(u[:rows], t[:rows]), name
        if rows is not None:
            assert not u[vocab:].any() and (padded == vocab or t[vocab:].any()), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(uni.moments[name][k][:rows], plain.moments[name][k][:rows]), (name, k)
    assert padded == (384 if layout == "tp2_zero1" else 320)


def test_universal_tensors_split_back_into_the_writers_tp_shards():
    """upstream.universal.tp_shards inverts DeepSpeed's merge (ds_to_universal.merge_tp_slices) for each kind of
    tensor: TP-split along cat_dim, replicated (no cat_dim), a GLU weight's two halves merged apart
    (param_n_sub_params 2: what upstream's --swiglu checkpoints record), and vocabulary rows cut to the tokenizer
    (zero rows back up to the padded size)."""
    from megatron.checkpointing.upstream.universal import tp_shards

    torch.manual_seed(0)
    slices = [torch.randn(6, 4), torch.randn(6, 4)]  # two TP ranks' [gate_i; up_i] of a GLU weight
    halves = [s.chunk(2) for s in slices]
    merged = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])  # DeepSpeed's
    got = tp_shards({"param": merged, "cat_dim": 0, "param_n_sub_params": 2}, 2, 0, "glu")
    assert all(torch.equal(a, b) for a, b in zip(got, slices, strict=True))
    row = [torch.randn(4, 3), torch.randn(4, 3)]
    got = tp_shards({"param": torch.cat(row, dim=1), "cat_dim": 1}, 2, 0, "row")
    assert all(torch.equal(a, b) for a, b in zip(got, row, strict=True))
    norm = torch.randn(4)
    assert all(t is norm for t in tp_shards({"param": norm}, 2, 0, "norm"))
    emb = torch.randn(5, 2)  # 5 tokens, padded to 8 rows at TP 2: ranks hold 4 rows each
    got = tp_shards({"param": emb, "cat_dim": 0, "vocab_tensor": True}, 2, 8, "emb")
    assert torch.equal(torch.cat(got)[:5], emb) and not torch.cat(got)[5:].any() and got[0].shape == (4, 2)


def test_universal_checkpoint_needs_its_flag_and_its_marker(tmp_path):
    from megatron.checkpointing import upstream
    from megatron.checkpointing.upstream import unknown_layout_message
    from megatron.errors import CheckpointError

    uni = os.path.join(FIX, "universal_tp2")
    assert upstream.find(uni) is None and "--universal-checkpoint" in unknown_layout_message(uni)
    with pytest.raises(CheckpointError, match="no 'latest_universal'.*ds_to_universal"):
        upstream.find(os.path.join(FIX, "tp2_zero1"), universal=True)
    (tmp_path / "latest_universal").write_text("global_step9_universal")
    with pytest.raises(CheckpointError, match="not a universal checkpoint"):
        upstream.find(str(tmp_path), universal=True)


# --------------------------------------------------------------------------------------------- resumed runs
def _resume(tmp_path, layout: str, extra: list[str] | None = None, nproc: int = 2, load: str | None = None):
    if load is None:
        load = str(tmp_path / layout)
        shutil.copytree(os.path.join(FIX, layout), load)
    args = _flags(str(tmp_path / "cache")) + LAYOUT_FLAGS[layout] + ["--load", load, "--trust-checkpoint"]
    proc = run_pretrain(nproc, args + (extra or []), timeout=400)
    lrs = {int(m.group(1)): float(m.group(2)) for m in _LR.finditer(proc.stdout)}
    return losses(proc.stdout), lrs, proc


def test_resume_universal_checkpoint_at_another_layout(tmp_path):
    """--universal-checkpoint: upstream's PP=2 run in DeepSpeed's universal form, resumed as DP=2 without a
    pipeline, goes on with upstream's loss and lr. (At TP=2 the vocabulary would pad to 384 rows: zero rows enter
    the softmax there, here as under upstream's own universal load, and the loss shifts by about ln(384/320).)"""
    load = str(tmp_path / "universal_pp2")
    shutil.copytree(os.path.join(FIX, "universal_pp2"), load)
    got, lrs, proc = _resume(tmp_path, "dp2", ["--universal-checkpoint"], load=load)
    assert "upstream universal checkpoint" in proc.stdout
    rec = _recorded("pp2_zero1")["resumed_run"]
    assert sorted(got) == [4, 5, 6], got
    for it in (4, 5, 6):
        assert got[it] == pytest.approx(rec[str(it)]["lm_loss"], abs=1e-4), (it, got, rec)
        assert lrs[it] == pytest.approx(rec[str(it)]["lr"], rel=1e-3), (it, lrs, rec)


@pytest.mark.parametrize("layout", ["tp2_zero1", "pp2_zero1"])
def test_resume_continues_upstreams_run(tmp_path, layout):
    """Acceptance (issue 21): --load of upstream's global_step3 at its layout goes on at iteration 4 with upstream's
    loss (same data, flags), and the printed lr is upstream's at every logged iteration."""
    got, lrs, _ = _resume(tmp_path, layout)
    rec = _recorded(layout)["resumed_run"]
    assert sorted(got) == [4, 5, 6], got
    assert got[4] == pytest.approx(rec["4"]["lm_loss"], abs=1e-4)  # weights + data order
    for it in (4, 5, 6):  # the log prints 4 digits
        assert lrs[it] == pytest.approx(rec[str(it)]["lr"], rel=1e-3), (it, lrs, rec)
    for it in (5, 6):  # optimizer state + the lr each update applies
        assert got[it] == pytest.approx(rec[str(it)]["lm_loss"], abs=1e-4), (it, got, rec)


def test_plain_megatron_checkpoint_resumes_not_restarts(tmp_path):
    """A plain Megatron iter_0000003/ (latest_checkpointed_iteration.txt, no 'latest') resumes at iteration 4 with
    upstream's loss; before, preflight only warned and training silently restarted at iteration 1."""
    got, _, proc = _resume(tmp_path, "megatron_tp2", ["--train-iters", "4"])
    assert sorted(got) == [4], proc.stdout[-2000:]
    assert got[4] == pytest.approx(_recorded("megatron_tp2")["resumed_run"]["4"]["lm_loss"], abs=1e-4)


def _one_line_refusal(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "initializing" not in proc.stdout and "process group" not in proc.stdout  # before any process group
    for n in needles:
        assert n in err[0], err[0]


def test_untrusted_upstream_checkpoint_refused_in_preflight(tmp_path):
    load = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIX, "tp2_zero1"), load)
    args = _flags(str(tmp_path / "cache")) + ["--load", load]
    _one_line_refusal(run_pretrain(1, args, check=False), "--trust-checkpoint", "mp_rank_00_model_states.pt")


def test_unknown_layout_refused_in_preflight(tmp_path):
    """A --load directory holding a checkpoint in a layout we do not read: one line, exit 2, no silent restart."""
    load = tmp_path / "ckpt"
    (load / "checkpoint-100").mkdir(parents=True)
    (load / "checkpoint-100" / "model.pt").write_bytes(b"")
    (load / "model.pt").write_bytes(b"")
    args = _flags(str(tmp_path / "cache")) + ["--load", str(load)]
    _one_line_refusal(run_pretrain(1, args, check=False), "model.pt", "no checkpoint layout")


def test_save_writes_megatron_tracker(tmp_path):
    """latest_checkpointed_iteration.txt beside 'latest', holding the iteration as upstream writes it."""
    from tests.models import TINY_GPT

    save = tmp_path / "save"
    run_pretrain(1, TINY_GPT + ["--train-iters", "2", "--save", str(save), "--save-interval", "1"],
                 env={"MASTER_PORT": str(free_port())})  # one process still makes a gloo group: a port of its own
    assert (save / "latest").read_text() == "global_step2"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_qkv_rows_reordered_per_kv_group():
    """Upstream's per-rank [Q | K | V] rows -> ours [q_1 .. q_g, k, v] per KV group, by hand (head dim 1)."""
    from megatron.checkpointing.upstream import qkv_to_ours

    # GQA: 4 query heads, 2 KV heads. Rows named by value: q0..q3 = 0..3, k0, k1 = 10, 11, v0, v1 = 20, 21.
    rows = torch.tensor([0.0, 1, 2, 3, 10, 11, 20, 21])
    assert qkv_to_ours(rows, 4, 2, 1).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    # MHA with a [rows, hidden] weight: per head q, k, v.
    w = torch.tensor([0.0, 1, 10, 11, 20, 21]).repeat_interleave(2).view(6, 2)
    assert qkv_to_ours(w, 2, 2, 1)[:, 0].tolist() == [0, 10, 20, 1, 11, 21]


def test_model_variants_read_from_upstreams_args():
    """Upstream's variant flags become our fields, in upstream's activation order, 1p only on LayerNorm."""
    from megatron.checkpointing.upstream.mapping import model_fields

    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    fields = model_fields({**base, "squared_relu": True, "apply_layernorm_1p": True,
                           "apply_residual_connection_post_layernorm": True})
    assert (fields["squared_relu"], fields["apply_layernorm_1p"], fields["apply_residual_connection_post_layernorm"],
            fields["openai_gelu"]) == (True, True, True, False)
    assert not model_fields({**base, "squared_relu": True, "onnx_safe": True})["squared_relu"]  # erf GeLU wins
    assert not model_fields({**base, "apply_layernorm_1p": True, "normalization": "RMSNorm"})["apply_layernorm_1p"]


@pytest.mark.parametrize("layout,pipeline", [("pp2_zero1", True), ("universal_pp2", True), ("tp2_zero1", False)])
def test_layernorm_1p_checkpoint_keeps_the_final_norms_meaning(monkeypatch, layout, pipeline):
    """Upstream's GPTModelPipe builds its final norm without 1p: read from a pipeline checkpoint (or its universal
    conversion) of a 1p run, its weight w is our 1p weight w - 1; its GPTModel's (no pipeline) is 1p like every other
    norm, read as stored (the fixtures read as if their args had the flag)."""
    from megatron.checkpointing import upstream
    from megatron.checkpointing.upstream import reader, universal

    path = os.path.join(FIX, layout)
    plain = upstream.read(upstream.find(path, universal=layout.startswith("universal")), trust=True,
                          with_optimizer=False)
    for module in (reader, universal):
        monkeypatch.setattr(module, "args_of", lambda s, p, f=module.args_of: {**f(s, p), "apply_layernorm_1p": True})
    one_p = upstream.read(upstream.find(path, universal=layout.startswith("universal")), trust=True,
                          with_optimizer=False)
    assert one_p.model["apply_layernorm_1p"] and not plain.model["apply_layernorm_1p"]
    for name, w in plain.weights.items():
        want = w - 1 if name == "final_layernorm.weight" and pipeline else w
        assert torch.equal(one_p.weights[name], want), name


def test_standalone_embedding_stage_megatron_checkpoint_numbers_layers_from_stage_1(tmp_path):
    """A plain Megatron pipeline checkpoint of a --standalone-embedding-stage run: stage 0 holds the embedding only,
    stages 1.. number their layers from 0 (synthetic files, upstream's iter_N/mp_rank_00_00S layout)."""
    from megatron.checkpointing import upstream

    args = {"num_layers": 4, "hidden_size": 8, "num_attention_heads": 2, "padded_vocab_size": 16,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 3, "standalone_embedding_stage": True,
            "global_batch_size": 1}
    norm = "input_layernorm.weight"
    stages = [{"embedding": {"word_embeddings": {"weight": torch.zeros(16, 8)}}},
              {"encoder": {f"layers.{i}.{norm}": torch.full((8,), 10.0 + i) for i in range(2)}},
              {"encoder": {f"layers.{i}.{norm}": torch.full((8,), 20.0 + i) for i in range(2)}}]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    for stage, lm in enumerate(stages):
        d = tmp_path / "iter_0000001" / f"mp_rank_00_{stage:03d}"
        d.mkdir(parents=True)
        torch.save({"args": args, "iteration": 1, "model": {"language_model": lm}}, d / "model_optim_rng.pt")
    conv = upstream.read(upstream.find(str(tmp_path)), trust=True)
    got = {n: float(w[0]) for n, w in conv.weights.items() if n.endswith(norm)}
    assert got == {f"layers.{i}.{norm}": v for i, v in enumerate([10.0, 11.0, 20.0, 21.0])}
