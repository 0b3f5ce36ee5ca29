"""The performance model (megatron/perf) against real tiny CPU/gloo training runs: communication bytes and peak memory.

What "measured" means here (see tests/distributed/perf_probe.py):

* Communication: every collective this rank issues during 2 optimizer steps after a warm-up step. Our own TP
  collectives are counted by megatron/core/comm.py's observer as logical ops (gloo emulates reduce-scatter with an
  all-reduce; it is counted once, as a reduce-scatter); DeepSpeed's ZeRO/DP traffic by wrappers installed on
  torch.distributed (all_reduce, all_gather[_into_tensor], reduce_scatter[_tensor], reduce, broadcast, send/recv)
  before the process group exists, which is where deepspeed.comm ends up. Calls of <= 16 elements (grad-norm
  partial sums, flags) are bookkeeping the model leaves out. TP must match exactly, ZeRO within 5%.
* Memory: CPU has no caching allocator statistics, so the peak of one training step is measured as the bytes of
  every tensor storage of this run alive at the step's start (a gc census, each storage once) plus the highest
  rise of allocated bytes during the step, from torch.profiler's allocation/free records of c10's CPU allocator
  (of a step whose record is complete: a free made on one of gloo's threads is not recorded, which made ZeRO-3
  look up to 0.8 MB bigger in some runs; see perf_probe.step_peak).
  Not included: gloo's and Python's own buffers, the allocator's slack; this is the model's "framework overhead",
  which Frontier runs assume to be 3 GiB and which is set to 0 here. DeepSpeed's gradient bucket is modelled (it is
  set to 1e5 elements so it does not dwarf the tiny model). Within 15%. The bytes autograd saves for backward
  (saved-tensor hooks on one micro-batch's forward) are checked against the activation terms, also within 15%.
* Pipeline (PP=2, DP=1, fp32, ZeRO-0 and ZeRO-1, DeepSpeed's pipeline engine): every torch.distributed call of 2
  steps after a warm-up step (perf_probe.pipe_probe_worker). deepspeed/runtime/pipe/p2p.py ends in
  torch.distributed.send/recv. Counted exactly against estimate_comm's "pp" sends per stage: stage 0 sends one
  [s, b, h] activation per micro-batch, stage 1 one gradient of that shape; each rank's recvs equal the other
  stage's sends. Tied embeddings: one all-reduce of the word-embedding gradient per step between the first and
  last stage (the "embedding" group) - exact too; untied: none. Extra messages and how they are counted: the
  tensor meta-data (int32 shape/dtype, sent before the first activation only) falls in the warm-up step and is
  not counted; the loss broadcast over the pipe group (2 floats) and grad-norm sums are <= 16 elements and left
  out as bookkeeping; the engine's start-up "send a 0" and tied-weight broadcast happen at construction. So the
  window holds exactly the activation/gradient payload and the tied all-reduce.
"""

from __future__ import annotations

import pytest

from megatron.config.sizes import named_model
from megatron.perf.comm import estimate_comm
from megatron.perf.layout import Layout
from megatron.perf.memory import estimate_memory
from tests.distributed.perf_probe import pipe_probe_worker, probe_worker
from tests.launch import run_distributed

MODEL_KW = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 64, "vocab_size": 512}
MBS, BUCKET = 2, 100_000


def _model():
    return named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                       make_vocab_size_divisible_by=64, **MODEL_KW)


def _cfg(tp: int, zero: int, seq_par: bool = False, recompute: str | None = None, dp: int = 1) -> dict:
    # 2 micro-batches per step: accumulated gradients live through the second forward, as in real training.
    return {"tp": tp, "zero": zero, "seq_par": seq_par, "mbs": MBS, "gbs": 2 * MBS * dp, "model_kw": MODEL_KW,
            "recompute": recompute, "reduce_bucket_size": BUCKET}


def _layout(cfg: dict, world: int) -> Layout:
    return Layout.of(tp=cfg["tp"], pp=1, dp=world // cfg["tp"], micro_batch_size=cfg["mbs"],
                     global_batch_size=cfg["gbs"], zero_stage=cfg["zero"], sequence_parallel=cfg["seq_par"],
                     recompute_granularity=cfg["recompute"], flash_attention=True, dtype="fp32")


def _predicted_comm(layout: Layout, steps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"tp": {}, "dp": {}}
    for c in estimate_comm(_model(), layout, 0).collectives:
        out[c.group][c.op] = out[c.group].get(c.op, 0.0) + c.payload_per_step * steps
    return out


def _check(results: list, world: int) -> list[str]:
    report = []
    for res in results[0]:  # every rank is symmetric here; rank 0 is the model's reference rank
        cfg = res["cfg"]
        layout = _layout(cfg, world)
        name = layout.describe()
        pred = _predicted_comm(layout, res["steps"])
        # TP: exact, op by op (bytes of the unsharded tensor).
        assert res["tp"] == pytest.approx(pred["tp"], rel=0, abs=0), (name, res["tp"], pred["tp"])
        # DP / ZeRO: within 5% per op; DeepSpeed pads partitions. ZeRO-1/2's reduction is an all-reduce.
        if layout.dp > 1:
            assert set(res["dp"]) == set(pred["dp"]), (name, res["dp"], pred["dp"])
            for op, want in pred["dp"].items():
                assert res["dp"][op] == pytest.approx(want, rel=0.05), (name, op, res["dp"][op], want)
        est = estimate_memory(_model(), layout, overhead_bytes=0, reduce_bucket_size=BUCKET)
        t = est.terms
        saved_pred = t["activations"] + t["embedding_activations"] + t["logits"] + t["zero3_gathered"]
        report.append(f"{name}: peak {res['peak'] / 1e6:.2f} MB vs model {est.total / 1e6:.2f} MB; saved "
                      f"activations {res['saved_activations'] / 1e6:.2f} MB vs {saved_pred / 1e6:.2f} MB; "
                      f"tp {res['tp']}; dp {res['dp']}")
        if layout.recompute_granularity is None:
            assert res["peak"] == pytest.approx(est.total, rel=0.15), report[-1]
            assert res["saved_activations"] == pytest.approx(saved_pred, rel=0.15), report[-1]
        else:
            # Known gap, not hidden: under full recompute the measured peak varies run to run (5.3-5.8 MB seen
            # against 4.76 MB predicted) because the backward's recompute working set is allocated and freed
            # layer by layer; the model counts one layer's working set only. Bounded, not equated.
            assert est.total <= res["peak"] <= 1.35 * est.total, report[-1]
    print("\n".join(report))
    return report


@pytest.mark.timeout(600)
def test_single_process_zero0():
    _check(run_distributed(probe_worker, 1, configs=[_cfg(1, 0)]), 1)


@pytest.mark.timeout(600)
def test_dp2_zero_0_1_2_3():
    _check(run_distributed(probe_worker, 2, configs=[_cfg(1, z, dp=2) for z in (0, 1, 2, 3)]), 2)


@pytest.mark.timeout(600)
def test_tp2_with_and_without_sequence_parallel():
    configs = [_cfg(2, 0), _cfg(2, 1, seq_par=True), _cfg(2, 0, seq_par=True, recompute="full")]
    _check(run_distributed(probe_worker, 2, configs=configs), 2)


def _pipe_cfg(zero: int, untie: bool) -> dict:
    # 3 micro-batches per step (1F1B has a steady phase), so p2p bytes differ from the tied all-reduce's.
    return {"pp": 2, "zero": zero, "mbs": MBS, "gbs": 3 * MBS, "model_kw": MODEL_KW | {
        "untie_embeddings_and_output_weights": untie}}


@pytest.mark.timeout(600)
def test_pp2_point_to_point_bytes_exact():
    results = run_distributed(pipe_probe_worker, 2, configs=[_pipe_cfg(0, False), _pipe_cfg(1, True)])
    pair = (0, 1)  # the world group: p2p sends and the first <-> last stage tied group
    report = []
    for rank_results in results:
        for res in rank_results:
            cfg, steps, stage = res["cfg"], res["steps"], res["stage"]
            model = named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                make_vocab_size_divisible_by=64, **cfg["model_kw"])
            layout = Layout.of(tp=1, pp=2, dp=1, micro_batch_size=cfg["mbs"], global_batch_size=cfg["gbs"],
                               zero_stage=cfg["zero"], flash_attention=True, dtype="fp32")
            mine, other = (estimate_comm(model, layout, st).collectives for st in (stage, 1 - stage))
            want = {"send": sum(c.payload_per_step for c in mine if c.group == "pp") * steps,
                    "recv": sum(c.payload_per_step for c in other if c.group == "pp") * steps,
                    "all_reduce": sum(c.payload_per_step for c in mine if c.group == "embedding") * steps}
            want = {op: n for op, n in want.items() if n}
            got = {op: n for (ranks, op), n in res["bytes"].items() if ranks == pair}
            report.append(f"{layout.describe()} untied={cfg['model_kw']['untie_embeddings_and_output_weights']} "
                          f"stage {stage}: measured {got} predicted {want} calls "
                          f"{ {op: n for (r, op), n in res['calls'].items() if r == pair} }")
            assert got == want, report[-1]
            # Nothing else crossed the wire in the window (DP=1: no DP traffic on single-rank groups counts).
            assert all(ranks == pair or len(ranks) == 1 for ranks, _ in res["bytes"]), res["bytes"]
    print("\n".join(report))
