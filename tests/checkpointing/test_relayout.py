"""Resuming at another layout in place (issue 43; megatron/checkpointing/relayout/): a run of 10 steps saved at
step 5 at one TP x PP x DP x EP x ZeRO layout, resumed from global_step5 at another through ``--load`` alone (no
offline step), logs steps 6-10 within 1e-5 relative of the straight run at the source layout (fp32: only the
order of float sums differs) and says "layout changed from X to Y". One straight run per source serves every
resume from it; the Adam moments are checked equal to the source's right after two loads (into ZeRO-1, into ZeRO-3),
and a resume without them (--no-load-optim) misses step 7, so the check can fail."""

from __future__ import annotations

import pytest

from tests.checkpointing.common import _pretrain, pretrain_on
from tests.checkpointing.test_moe_checkpoint import ARGS as MOE_ARGS
from tests.checkpointing.test_resume import _point_latest
from tests.models import CKPT_GPT, LLAMA, replaced

BASE = CKPT_GPT + ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10",
                   "--vocab-size", "256"]  # 256: no padded vocabulary rows at TP 1 or 2, so TP moves are exact
Z1, Z2, Z3 = ["--zero-stage", "1"], ["--zero-stage", "2"], ["--zero-stage", "3"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
MOE = replaced(MOE_ARGS, {"--train-iters": "10"})  # ZeRO-2, EP 2 on 2 ranks
# Hierarchical ZeRO with 2 ranks per node (``TWO_PER_NODE`` becomes a DeepSpeed JSON saying so): 4 ranks are 2 nodes
# (package and network tiers), 2 ranks one node (package tier only).
TWO_PER_NODE = "@two-ranks-per-node"
HZ = Z3 + ["--zero-hierarchy", "package,node,network", "--deepspeed_config", TWO_PER_NODE]

SOURCES = {  # name -> (ranks, flags) of the straight run that writes global_step5
    "dp2-z1": (2, BASE + Z1), "dp1-z1": (1, BASE + Z1), "dp2-z2": (2, BASE + Z2), "dp1-z2": (1, BASE + Z2),
    "tp2-pp2": (4, BASE + LLAMA + Z1 + TP2 + PP2), "ep2": (2, MOE), "dp2-z3": (2, BASE + Z3),
    "hz-dp4": (4, BASE + HZ),
}
# case -> (source, ranks, flags of the resumed run).
CASES = {
    "dp2to1-z1": ("dp2-z1", 1, BASE + Z1), "dp1to2-z1": ("dp1-z1", 2, BASE + Z1),
    "dp2to1-z2": ("dp2-z2", 1, BASE + Z2), "dp1to2-z2": ("dp1-z2", 2, BASE + Z2),
    "tp2to1": ("tp2-pp2", 2, BASE + LLAMA + Z1 + PP2), "pp2to1": ("tp2-pp2", 2, BASE + LLAMA + Z1 + TP2),
    "pp1to2": ("dp1-z1", 2, BASE + Z1 + PP2),
    "ep2to1": ("ep2", 2, replaced(MOE, {"--moe-expert-parallel-size": "1"})),
    "z1toz2": ("dp2-z1", 2, BASE + Z2),
    # ZeRO-3 keeps its weights in its optimizer files: read by its chunk arithmetic, filled through safe_set_local_*.
    "dp2to1-z3toz2": ("dp2-z3", 1, BASE + Z2), "dp1to2-z1toz3": ("dp1-z1", 2, BASE + Z3),
    # Hierarchical ZeRO's shards by their bucket arithmetic (relayout/hzero_source.py); its master and AdamW state
    # filled chunk by chunk, the secondary shards rebuilt from the masters; also from and to DeepSpeed's engine.
    "hz-dp4to2": ("hz-dp4", 2, BASE + HZ), "z1tohz-dp2to4": ("dp2-z1", 4, BASE + HZ),
}
MOMENTS_CHECKED = ("dp2to1-z1", "dp1to2-z1toz3", "hz-dp4to2")
LAYOUT = {  # the log's name of each layout
    "dp2-z1": "TP 1 x PP 1 x DP 2 x EP 1, ZeRO-1 (2 ranks)", "dp1-z1": "TP 1 x PP 1 x DP 1 x EP 1, ZeRO-1 (1 rank)",
    "dp1-z2": "TP 1 x PP 1 x DP 1 x EP 1, ZeRO-2 (1 rank)", "dp2-z2": "TP 1 x PP 1 x DP 2 x EP 1, ZeRO-2 (2 ranks)",
    "tp2-pp2": "TP 2 x PP 2 x DP 1 x EP 1, ZeRO-1 (4 ranks)", "ep2": "TP 1 x PP 1 x DP 2 x EP 2, ZeRO-2 (2 ranks)",
    "tp1-pp2": "TP 1 x PP 2 x DP 1 x EP 1, ZeRO-1 (2 ranks)", "tp2-pp1": "TP 2 x PP 1 x DP 1 x EP 1, ZeRO-1 (2 ranks)",
    "ep1": "TP 1 x PP 1 x DP 2 x EP 1, ZeRO-2 (2 ranks)", "dp2-z3": "TP 1 x PP 1 x DP 2 x EP 1, ZeRO-3 (2 ranks)",
    "hz-dp4": "TP 1 x PP 1 x DP 4 x EP 1, hierarchical ZeRO package,node,network (4 ranks)",
    "hz-dp2": "TP 1 x PP 1 x DP 2 x EP 1, hierarchical ZeRO package,node,network (2 ranks)"}
NOW = {"dp2to1-z1": "dp1-z1", "dp1to2-z1": "dp2-z1", "dp2to1-z2": "dp1-z2", "dp1to2-z2": "dp2-z2",
       "tp2to1": "tp1-pp2", "pp2to1": "tp2-pp1", "pp1to2": "tp1-pp2", "ep2to1": "ep1", "z1toz2": "dp2-z2",
       "dp2to1-z3toz2": "dp1-z2", "dp1to2-z1toz3": "dp2-z3", "hz-dp4to2": "hz-dp2", "z1tohz-dp2to4": "hz-dp4"}


def _resumed(argv: list[str], check_moments: bool = False) -> dict:
    """``_pretrain`` whose summary gains ``said`` (the relayout's log lines) and, with ``check_moments``, ``moments``:
    right after the load, every parameter's full Adam moments and fp32 master weights as DeepSpeed's public
    safe_get_full_* return them, against an independent offline reader of the source (full_state.merge)."""
    from megatron.checkpointing.relayout import format as relayout

    said, checked = [], {}
    say, resume = relayout.say, relayout.RelayoutFormat.resume

    def saying(msg: str) -> None:
        said.append(msg)
        say(msg)

    def checking(self, engine):
        out = resume(self, engine)
        if check_moments:
            checked.update(_compare_moments(self.ckpt_dir, self.meta, engine, self.run.model.num_layers))
        return out

    relayout.say, relayout.RelayoutFormat.resume = saying, checking
    return {**_pretrain(argv), "said": said, "moments": checked}


def _compare_moments(ckpt_dir: str, meta: dict, engine, num_layers: int) -> dict:
    """This rank's fp32 master weights and Adam moments as the ZeRO optimizer holds them right after the load (ZeRO-1:
    each parameter's slice of its flat partition, where DeepSpeed's link says it is; ZeRO-3: its partition, as
    DeepSpeed's public safe_get_local_* return it), against an independent offline reader of the source's files
    (full_state.merge); ``covered``: elements found on this rank, of ``total`` in the ``params`` parameters."""
    import math

    import torch
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    from megatron import ds_seams
    from megatron.checkpointing.full_state.merge import merge_checkpoint, merge_moments
    from megatron.checkpointing.relayout.fill import named_parameters

    moments, step, why = merge_moments(ckpt_dir, meta)
    weights = merge_checkpoint(ckpt_dir, meta)
    if not hasattr(engine.optimizer, "optimizer"):  # hierarchical ZeRO: torch AdamW over one flat master shard
        return _compare_hzero(engine, moments, weights, step, why, num_layers)
    base = engine.optimizer.optimizer
    bad, n, covered, total = [], 0, 0, 0
    for name, p in named_parameters(engine.module, num_layers):
        n += 1
        part = ds_seams.zero3_part(p)
        if part is None:
            hp = ds_seams.hp_mapping(p)
            flat = base.param_groups[hp.param_group_index]["params"][0]
            start, numel, at = hp.lp_fragment_address.start, hp.lp_fragment_address.numel, hp.hp_fragment_address
            held = {"exp_avg": base.state[flat]["exp_avg"], "exp_avg_sq": base.state[flat]["exp_avg_sq"], "fp32": flat}
            held = {k: v.narrow(0, at.start, at.numel) for k, v in held.items()}
            total += p.numel()
        else:
            full_numel = math.prod(part.shape)
            start, numel = part.start, max(0, min(part.size, full_numel - part.start))
            held = {k: safe_get_local_optimizer_state(p, k).narrow(0, 0, numel) for k in ("exp_avg", "exp_avg_sq")}
            held["fp32"] = safe_get_local_fp32_param(p).narrow(0, 0, numel)
            total += full_numel
        covered += numel
        for k, full in (("exp_avg", moments[name]["exp_avg"]), ("exp_avg_sq", moments[name]["exp_avg_sq"]),
                        ("fp32", weights[name])):
            if not torch.equal(held[k], full.reshape(-1).narrow(0, start, numel)):
                bad.append(f"{name} {k}")
    return {"params": n, "step": step, "why": why, "bad": bad, "covered": covered, "total": total}


def _compare_hzero(engine, moments: dict, weights: dict, step: int, why: str, num_layers: int) -> dict:
    """``_compare_moments`` for the hierarchical ZeRO engine: its master shard and AdamW state, chunk by chunk of
    each bucket (shards.primary_ranges), against the offline reader's full tensors; the secondary shards (rebuilt
    from the masters) against the same weights."""
    import torch

    from megatron.checkpointing.hzero.shards import primary_ranges
    from megatron.checkpointing.relayout.fill import named_parameters

    names = {id(p): n for n, p in named_parameters(engine.module, num_layers)}
    state = engine.optimizer.state[engine.master]
    held = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "fp32": engine.master.detach()}
    bad, n, covered, total, pos = [], 0, 0, 0, 0
    for b, (start, length) in zip(engine.buckets, primary_ranges(engine), strict=True):
        full = {k: torch.zeros(b.padded) for k in held}
        off = 0
        for p, shape in zip(b.params, b.shapes, strict=True):
            name, k = names[id(p)], shape.numel()
            n, total = n + 1, total + k
            for key, src in (("exp_avg", moments[name]["exp_avg"]), ("exp_avg_sq", moments[name]["exp_avg_sq"]),
                             ("fp32", weights[name])):
                full[key][off:off + k] = src.reshape(-1)
            covered += max(0, min(off + k, start - b.offset + length) - max(off, start - b.offset))
            off += k
        mine = slice(start - b.offset, start - b.offset + length)
        bad += [f"bucket {b.offset} {k}" for k in held if not torch.equal(held[k][pos:pos + length], full[k][mine])]
        count, idx = engine.h.shard_count(engine.weight_levels), engine.h.shard_index(engine.weight_levels)
        per = b.padded // count  # the secondary shard: this rank's chunk over the weights tier (fp32 run: exact)
        if not torch.equal(b.secondary.float(), full["fp32"][idx * per:(idx + 1) * per]):
            bad.append(f"bucket {b.offset} secondary")
        pos += length
    return {"params": n, "step": step, "why": why, "bad": bad, "covered": covered, "total": total}


@pytest.fixture(scope="module")
def two_per_node(tmp_path_factory) -> str:
    """A DeepSpeed JSON with 2 ranks per node (hierarchical ZeRO's tiers on the CPU ranks)."""
    import json

    path = str(tmp_path_factory.mktemp("ds") / "ds.json")
    with open(path, "w") as f:
        json.dump({"zero_optimization": {"stage": 3}, "megatron_frontier": {"ranks_per_node": 2}}, f)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, two_per_node):
    """source name -> (its --save directory, latest pointing at global_step5; the straight run's losses)."""
    done: dict[str, tuple[str, dict[int, float]]] = {}

    def get(name: str) -> tuple[str, dict[int, float]]:
        if name not in done:
            world, flags = SOURCES[name]
            save = str(tmp_path_factory.mktemp(name))
            flags = [two_per_node if f == TWO_PER_NODE else f for f in flags]
            losses = pretrain_on(world, flags + ["--save", save, "--save-interval", "5"])["losses"]
            assert sorted(losses) == list(range(1, 11)) and len(set(losses.values())) == 10, losses  # it moves
            _point_latest(save, "global_step5")
            done[name] = save, losses
        return done[name]

    return get


def _close(got: dict[int, float], ref: dict[int, float]) -> list[tuple[int, float]]:
    """Steps whose loss is off by more than 1e-5 relative."""
    return [(i, got[i] / ref[i] - 1) for i in got if abs(got[i] / ref[i] - 1) > 1e-5]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_resumes_at_another_layout_in_place(case, straight, two_per_node):
    source, world, flags = CASES[case]
    save, ref = straight(source)
    flags = [two_per_node if f == TWO_PER_NODE else f for f in flags]
    ranks = _run(world, flags + ["--load", save], check_moments=case in MOMENTS_CHECKED)
    out = ranks[0]
    assert sorted(out["losses"]) == [6, 7, 8, 9, 10], out["losses"]
    assert not _close(out["losses"], ref), (out["losses"], ref)
    line = [s for s in out["said"] if s.startswith("> layout changed from ")]
    want = (f"> layout changed from {LAYOUT[source]} to {LAYOUT[NOW[case]]}: resumed global_step5 in place (weights, "
            "fp32 master weights, Adam moments at step 5;")
    assert len(line) == 1 and line[0].startswith(want), out["said"]
    assert "RNG states restart" in line[0] and "global batch" in line[0]
    if case in MOMENTS_CHECKED:  # the Adam moments and fp32 masters as they are right after the load, on every rank
        m = [r["moments"] for r in ranks]
        assert all(x["params"] == 28 and x["step"] == 5 and x["bad"] == [] for x in m), m
        assert sum(x["covered"] for x in m) == m[0]["total"], m  # the ranks' partitions hold every element once


def _run(world: int, argv: list[str], check_moments: bool) -> list[dict]:
    """Every rank's summary of a resumed run (rank 0 first)."""
    from tests.launch import run_distributed

    return run_distributed(_resumed, world, timeout=240, argv=argv, check_moments=check_moments)


@pytest.mark.timeout(300)
def test_without_the_moments_step_7_misses(straight):
    """The same move with --no-load-optim (weights only) matches step 6 and misses step 7: the checks above can fail."""
    save, ref = straight("dp2-z1")
    out = _run(1, BASE + Z1 + ["--load", save, "--no-load-optim"], False)[0]
    assert abs(out["losses"][6] / ref[6] - 1) < 1e-5 and abs(out["losses"][7] / ref[7] - 1) > 1e-4, (out, ref)
    assert any("(weights; " in s for s in out["said"]), out["said"]
