"""Upstream Megatron-DeepSpeed's DeepSpeed-MoE checkpoints (tests/fixtures/upstream_ckpt/moe_ep2, moe_pp2_ep2,
written by upstream itself): read (per-expert files, expert Adam moments), resumed here at EP=2 and on our pipeline with
upstream's lm loss and MoE loss, converted to a full state, and written back in upstream's layout."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from tests.checkpointing.test_upstream_checkpoints import FIX, VOCAB, _flags, _recorded
from tests.launch import losses, run_pretrain
from tests.models import TINY_MOE

_MOE_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?\| moe loss: ([0-9.E+-]+)")
# make_fixtures.sh's MOE flags in ours (on top of the dense fixtures' flags)
MOE = TINY_MOE


def _moe_model(ep_size: int = 1, ep_rank: int = 0):
    from megatron.config import ModelConfig
    from megatron.config.moe import MoEConfig
    from megatron.core.parallel_state import GroupInfo, single_process_state
    from megatron.model.gpt_model import GPTModel

    moe = MoEConfig(num_experts=(4,), expert_interval=2, topk=2, moe_top2_2nd_expert_sampling=False,
                    moe_train_capacity_factor=2.0, moe_loss_coeff=0.01)
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=64,
                      vocab_size=320, make_vocab_size_divisible_by=64, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.0, openai_gelu=True, moe=moe)
    st = single_process_state()
    return GPTModel(cfg, tp=st.tp, ep=GroupInfo(list(range(ep_size)), ep_rank, None), init_seed=1), cfg


def _losses_on(model, batches) -> tuple[float, float]:
    """(lm loss, MoE loss) of ``model`` on ``batches``, averaged over them (one per DP rank: upstream's log)."""
    from megatron.training.step import gpt_forward_step

    model.train()  # upstream logs training losses: the train capacity factor (2, nothing dropped)
    lm = moe = 0.0
    with torch.no_grad():
        for b in batches:
            lm += gpt_forward_step(model, {"text": torch.tensor(b)}).item()
            moe += model.take_moe_loss().item()
    return lm / len(batches), moe / len(batches)


def _rank_batches(layout: str, it: str) -> list:
    """Every data-parallel rank's micro-batch of iteration ``it``: global ranks 0 and 1 (DP ranks 0, 1 of the first
    stage with the pipeline; its last stage feeds the same batches)."""
    per_rank = _recorded(layout)["resumed_micro_batches_per_rank"]
    return [mb for r in ("0", "1") for mb in per_rank[r][it]]


@pytest.mark.parametrize("layout", ["moe_ep2", "moe_pp2_ep2"])
def test_upstream_moe_checkpoint_reads_whole(layout):
    """Both MoE layouts (without pipeline: experts beside the model file; DeepSpeed's pipeline engine: each stage's
    module in its mp_rank file, per-expert files per stage) read into every parameter of our model, experts by
    global index, with Adam moments of every parameter at upstream's step and its progress."""
    from megatron.checkpointing import upstream

    conv = upstream.read(upstream.find(os.path.join(FIX, layout)), trust=True)
    assert (conv.iteration, conv.consumed_samples, conv.lr_num_steps, conv.optimizer_step) == (3, 12, 3, 3)
    assert conv.layout["ep"] == 2 and conv.model["moe"]["num_experts"] == [4]
    model, _ = _moe_model()
    assert set(conv.weights) == {n for n, _ in model.named_parameters()}
    assert len([n for n in conv.weights if ".deepspeed_experts." in n]) == 2 * 4 * 4  # 2 layers x 4 experts x 4
    assert set(conv.moments) == set(conv.weights)
    for name, t in conv.weights.items():
        assert conv.moments[name]["exp_avg"].shape == t.shape, name


@pytest.mark.parametrize("layout", ["moe_ep2", "moe_pp2_ep2"])
def test_loaded_moe_weights_give_upstreams_losses_on_upstreams_batches(layout):
    """Upstream's MoE weights (its per-expert files, global expert order; with the pipeline the first stage's copy of
    the tied embedding) in our one-process model score upstream's iteration-4 micro-batches (each DP rank's) with
    upstream's lm loss (averaged over DP) and MoE loss: each rank's own without the pipeline, the DP mean with it."""
    from megatron.checkpointing import upstream
    from megatron.checkpointing.full_state.shard import load_into_model
    from megatron.checkpointing.upstream import vocab_rows

    conv = upstream.read(upstream.find(os.path.join(FIX, layout)), trust=True)
    model, cfg = _moe_model()
    load_into_model(model, vocab_rows(conv, 320, cfg.padded_vocab_size(1)), 4, 1, 0, layout)
    rec = _recorded(layout)["resumed_run"]["4"]  # the loaded weights are those iteration 4 ran with
    per_rank = _rank_batches(layout, "4")
    assert len(per_rank) == 2
    lm, moe = _losses_on(model, per_rank)
    assert lm == pytest.approx(rec["lm_loss"], abs=1e-5)
    assert moe == pytest.approx(rec["moe_loss"], abs=1e-6)
    if layout == "moe_ep2":
        for r, mb in enumerate(per_rank):
            assert _losses_on(model, [mb])[1] == pytest.approx(rec["moe_loss_per_rank"][str(r)], abs=1e-6), r


def test_converter_writes_upstreams_moe_run_as_a_full_state(tmp_path):
    """tools/convert_megatron_checkpoint.py on upstream's MoE checkpoint: a full state with every expert (global
    index) and its moments, which scores upstream's iteration-4 batches with upstream's losses in one process."""
    import tools.convert_megatron_checkpoint as tool
    from megatron.checkpointing.full_state.files import read_full_moments, read_full_state
    from megatron.checkpointing.full_state.shard import load_into_model

    out = str(tmp_path / "full")
    assert tool.main(["--load", os.path.join(FIX, "moe_ep2"), "--save", out, "--trust-checkpoint",
                      "--vocab-file", VOCAB]) == 0
    full, meta = read_full_state(out)
    assert meta["model"]["moe"]["num_experts"] == [4] and (meta["iteration"], meta["consumed_samples"]) == (3, 12)
    moments, step = read_full_moments(out)
    assert step == 3 and set(moments) == set(full)
    model, _ = _moe_model()
    load_into_model(model, full, 4, 1, 0, out)
    rec = _recorded("moe_ep2")["resumed_run"]["4"]
    lm, moe = _losses_on(model, _rank_batches("moe_ep2", "4"))
    assert lm == pytest.approx(rec["lm_loss"], abs=1e-5) and moe == pytest.approx(rec["moe_loss"], abs=1e-6)


def test_upstream_expert_moments_sit_where_their_weights_do():
    """The expert placement (local index on DP rank d -> global expert (d % EP) x local + i, partition over the
    replicas) checked on DeepSpeed's own fp32 master partitions: read through the same placement they equal the
    per-expert files' weights for every expert, so the moments (the same slices) land on the right experts."""
    from megatron.checkpointing import upstream
    from megatron.checkpointing.ds_layout.files import place
    from megatron.checkpointing.live.safe_io import safe_load
    from megatron.model.param_names import expert_index, experts_per_layer, from_upstream

    path = os.path.join(FIX, "moe_ep2", "global_step3")
    conv = upstream.read(upstream.find(os.path.join(FIX, "moe_ep2")), trust=True)
    per_layer = experts_per_layer(conv.weights)
    checked = 0
    for dp in (0, 1):
        osd = safe_load(os.path.join(path, f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
        for group, flat in zip(osd["param_slice_mappings"], osd["single_partition_of_fp32_groups"], strict=True):
            for name, addr in group.items():
                ours = from_upstream(name)
                if expert_index(ours) is None:
                    continue
                full, _ = place(ours, dp, 2, per_layer)
                got = flat[addr.start:addr.start + addr.numel]
                assert torch.equal(got, conv.weights[full].reshape(-1)), (dp, name, full)
                checked += 1
    assert checked == 2 * 4 * 4


# (moe_ep2 resumed at EP=1 gives the same within the same tolerances, checked by hand: the placement of upstream's
# experts and their moments at any EP is checked in-process by test_upstream_expert_moments_sit_where_their_weights_do
# and resharding over EP by tests/checkpointing/test_moe_checkpoint.py; one launch fewer in CI.)
@pytest.mark.parametrize("layout, ep, pp", [("moe_ep2", 2, 1), ("moe_pp2_ep2", 2, 2)])
def test_resume_continues_upstreams_moe_run(tmp_path, layout, ep, pp, monkeypatch, capsys):
    """Acceptance (issue 34): --load of upstream's MoE global_step3 (DP=2, EP=2, ZeRO-1) goes on at iterations 4-6
    with upstream's lm loss within 1e-4 and MoE loss within 1e-6 at upstream's EP=2, and so does upstream's
    pipeline-engine run (PP=2 x DP=2) resumed here on our pipeline (PP=2 x EP=2, 4 ranks). From moe_ep2 at EP=2
    the run goes on to 9 and saves global_step6: tools/convert_to_upstream.py writes it in upstream's
    layout, which reads back to our own checkpoint's weights and moments; upstream itself resumed that conversion
    (moe_ep2/ours_back.json, recorded by make_fixtures.sh) with the losses this run logs at 7-9."""
    load = str(tmp_path / layout)
    shutil.copytree(os.path.join(FIX, layout), load)
    args = _flags(str(tmp_path / "cache")) + MOE + ["--moe-expert-parallel-size", str(ep), "--load", load,
                                                     "--trust-checkpoint", "--pipeline-model-parallel-size", str(pp)]
    back = (layout, ep) == ("moe_ep2", 2)
    if back:
        args += ["--train-iters", "9", "--save", load, "--save-interval", "6"]
    proc = run_pretrain(2 * pp, args, timeout=400)
    assert "Adam moments loaded" in proc.stdout
    got, moe = losses(proc.stdout), {int(m.group(1)): float(m.group(2)) for m in _MOE_LOSS.finditer(proc.stdout)}
    rec = _recorded(layout)["resumed_run"]
    assert sorted(got)[:3] == [4, 5, 6] and sorted(moe)[:3] == [4, 5, 6], proc.stdout[-2000:]
    for it in (4, 5, 6):
        assert got[it] == pytest.approx(rec[str(it)]["lm_loss"], abs=1e-4), (it, got, rec)
        assert moe[it] == pytest.approx(rec[str(it)]["moe_loss"], abs=1e-6), (it, moe, rec)  # ~0.02: tighter
    if back:
        _check_ours_goes_back(tmp_path, load, got, moe)
        # Our own MoE checkpoint (ZeRO partitions follow EP) at another EP: resumed in place (relayout/), so every
        # check before the process group passes (tests/checkpointing/test_relayout.py runs such a resume).
        from tests.unit.preflight_common import run_until_process_group

        rc, err, _ = run_until_process_group(args[:args.index("--moe-expert-parallel-size")] + [
            "--moe-expert-parallel-size", "1", "--load", load], monkeypatch, capsys, 2)
        assert rc is None, err


def _check_ours_goes_back(tmp_path, load: str, got: dict, moe: dict) -> None:
    import tools.convert_to_upstream as tool
    from megatron.checkpointing import upstream
    from megatron.checkpointing.hf.convert import read_any, read_moments

    with open(os.path.join(FIX, "moe_ep2", "ours_back.json")) as f:
        back = json.load(f)["upstream_on_ours"]
    for it in (7, 8, 9):  # upstream, resumed from the conversion of this very checkpoint, logged these
        assert got[it] == pytest.approx(back[str(it)]["lm_loss"], abs=1e-5), (it, got, back)
        assert moe[it] == pytest.approx(back[str(it)]["moe_loss"], abs=1e-6), (it, moe, back)
    out = str(tmp_path / "to_upstream")
    assert tool.main(["--load", load, "--tag", "global_step6", "--save", out]) == 0
    assert sorted(f for f in os.listdir(os.path.join(out, "global_step6")) if "optim" in f) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    conv = upstream.read(upstream.find(out), trust=True)
    full, _, progress = read_any(load, "global_step6")
    moments, step, _ = read_moments(load, "global_step6")
    assert (conv.iteration, conv.consumed_samples, conv.optimizer_step, step) == (6, 24, 6, 6)
    assert set(conv.weights) == set(full) and set(conv.moments) == set(moments)
    for n, t in full.items():
        assert torch.equal(conv.weights[n], t), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(conv.moments[n][k], moments[n][k]), (n, k)


def _nested_equal(ours, theirs, where: str) -> int:
    """Key-by-key equality of two nested dicts of tensors (same keys at every level, equal tensors)."""
    assert isinstance(ours, dict) and isinstance(theirs, dict), where
    assert list(ours) == list(theirs), (where, list(ours), list(theirs))
    n = 0
    for k, v in theirs.items():
        if isinstance(v, dict):
            n += _nested_equal(ours[k], v, f"{where}.{k}")
        else:
            assert torch.is_tensor(ours[k]) and ours[k].dtype == v.dtype and torch.equal(ours[k], v), f"{where}.{k}"
            n += 1
    return n


def _fields_equal(ours, theirs, where: str) -> None:
    """Equality of DeepSpeed's file contents: tensors exactly, containers item by item, objects by their fields."""
    if torch.is_tensor(theirs):
        assert torch.is_tensor(ours) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (where, list(ours), list(theirs))
        for k in theirs:
            _fields_equal(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, (list, tuple)) and not hasattr(theirs, "_fields"):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), (where, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _fields_equal(a, b, f"{where}[{i}]")
    elif hasattr(theirs, "__dict__") and not isinstance(theirs, type):
        assert type(ours) is type(theirs) and vars(ours) == vars(theirs), (where, ours, theirs)
    else:
        assert ours == theirs and type(ours) is type(theirs), (where, ours, theirs)


def test_writer_reproduces_upstreams_moe_files(tmp_path):
    """Round trip without upstream: its moe_ep2 checkpoint read into our names (QKV reordered, experts by global
    index, moments merged over DP and the experts' replicas) and written back by upstream/writer.py gives upstream's
    own files key by key: the nested ``module`` (order, names, values), every per-expert file, the fields upstream's
    loader reads, and both DP ranks' ZeRO-1 files (fp32 partitions, Adam state, param groups, slice mappings)."""
    from megatron.checkpointing import upstream
    from megatron.checkpointing.upstream.writer import write_upstream

    src = os.path.join(FIX, "moe_ep2", "global_step3")
    found = upstream.find(os.path.join(FIX, "moe_ep2"))
    conv = upstream.read(found, trust=True)
    a = upstream.first_args(found, True)
    their_state = upstream.load_file(os.path.join(src, "mp_rank_00_model_states.pt"), True)
    out = str(tmp_path / "up")
    progress = {"iteration": conv.iteration, "consumed_samples": conv.consumed_samples,
                "lr_scheduler": their_state["lr_scheduler"]}
    hyper = {"betas": (a["adam_beta1"], a["adam_beta2"]), "eps": a["adam_eps"], "weight_decay": a["weight_decay"],
             "clip_grad": a["clip_grad"], "zero_stage": a["zero_stage"], "ds_config": their_state["ds_config"]}
    step = write_upstream(out, conv.weights, conv.model, progress, tp=1, dp=2, ep=2,
                          padded_vocab=conv.padded_vocab_size, run_flags=a, moments=conv.moments,
                          optimizer_step=conv.optimizer_step, hyper=hyper)
    assert sorted(os.listdir(step)) == sorted(os.listdir(src))
    ours_state = upstream.load_file(os.path.join(step, "mp_rank_00_model_states.pt"), True)
    # embeddings 2, dense layers 2 x 12, MoE layers 2 x (8 without the MLP + the gate), final norm 2
    assert _nested_equal(ours_state["module"], their_state["module"], "module") == 2 + 2 * 12 + 2 * 9 + 2
    for key in ("iteration", "num_experts", "dp_world_size", "mp_world_size", "global_steps", "global_samples",
                "checkpoint_version", "tokens", "lr_scheduler", "ds_config", "param_shapes"):
        _fields_equal(ours_state[key], their_state[key], key)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "consumed_train_samples", "num_experts", "expert_interval",
                "moe_expert_parallel_size"):
        assert getattr(ours_state["args"], key) == getattr(their_state["args"], key), key
    for f in (f for f in os.listdir(src) if f.startswith("layer_")):
        got, want = (upstream.load_file(os.path.join(d, f), True) for d in (step, src))
        assert _nested_equal(got, want, f) == 4
    for d in (0, 1):
        f = f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt"
        got, want = (upstream.load_file(os.path.join(x, f), True) for x in (step, src))
        _fields_equal(got, want, f)
    assert open(os.path.join(out, "latest")).read() == "global_step3"
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read() == "3"
    # And back: our reader reads the written files to the same weights and moments.
    again = upstream.read(upstream.find(out), trust=True)
    assert set(again.weights) == set(conv.weights) and set(again.moments) == set(conv.moments)
    assert all(torch.equal(again.weights[k], v) for k, v in conv.weights.items())
    assert all(torch.equal(again.moments[n][k], v) for n, m in conv.moments.items() for k, v in m.items())


@pytest.mark.parametrize("extra, needles", [
    (["--num-experts", "2"], ["--num-experts ([4] in the checkpoint, [2] now)"]),  # other tensors: refused
    (["--expert-interval", "1"], ["--expert-interval (2 in the checkpoint, 1 now)"]),
    (["--universal-checkpoint"], ["universal checkpoint", "experts", "global_stepN"]),
])
def test_moe_load_mismatches_are_one_line(tmp_path, extra, needles, monkeypatch, capsys):
    """What still cannot load into a model with experts is refused in one line before any process group."""
    from tests.unit.test_moe_config import _run

    load = str(tmp_path / "moe_ep2")
    shutil.copytree(os.path.join(FIX, "moe_ep2"), load)
    if "--universal-checkpoint" in extra:
        load = os.path.join(FIX, "universal_tp2")
    argv = _flags(str(tmp_path / "cache")) + MOE + ["--load", load, "--trust-checkpoint"] + extra
    rc, err = _run(argv, monkeypatch, capsys, 2)
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} missing from {err!r}"
