"""Measure DeepSpeed-Ulysses in real gloo runs: all-to-all bytes through megatron/core/comm.py's observer, and the
activation bytes each rank keeps for backward (megatron/perf/saved_tensors.py). Workers for
``tests.launch.run_distributed``, used by tests/distributed/test_ulysses_perf.py and bench/ulysses_memory.py."""

from __future__ import annotations

import gc

import torch


def count_all_to_all(configs: list[dict], steps: int = 2) -> list[int]:
    """For each config ({"tp", "ulysses", "recompute"}): bytes this rank sends into all-to-alls over its SP group
    during ``steps`` optimizer steps after a warm-up step, on the tiny Llama of tests/distributed/test_ulysses.py."""
    import dataclasses

    import deepspeed.comm as dist

    from megatron.core import comm
    from megatron.core.parallel_state import ParallelState
    from megatron.core.ulysses import sequence_slices
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.initialize import initialize_distributed
    from megatron.model.gpt_model import GPTModel
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step
    from tests.distributed.test_ulysses import MBS, SEQ, _run_config

    initialize_distributed("gloo")
    out = []
    for cfg in configs:
        run = _run_config(dist.get_world_size(), cfg["ulysses"], 1, cfg.get("recompute"), cfg["tp"])
        run = dataclasses.replace(run, training=dataclasses.replace(  # 2 micro-batches per step
            run.training, global_batch_size=2 * MBS * run.parallel.dp))
        state = ParallelState.build(cfg["tp"], ulysses_size=cfg["ulysses"])
        model = GPTModel(run.model, tp=state.tp, init_seed=run.training.seed, ulysses=state.ulysses)
        engine = initialize_engine(model, run, state, build_ds_config(run))
        data = sequence_slices(microbatches(MockGPTDataset(100, SEQ, 250, seed=9), 0, MBS, state.dp.rank,
                                            state.dp.size, "cpu"), state.ulysses)
        gas = run.training.grad_accumulation_steps(state.dp.size)
        train_step(engine, data, gas)
        sent = [0]
        ranks = state.ulysses.ranks

        def observe(op: str, nbytes: int, group, ranks=ranks, sent=sent) -> None:
            if op == "all_to_all" and group is not None and dist.get_all_ranks_from_group(group) == ranks:
                sent[0] += nbytes

        remove = comm.add_observer(observe)
        for _ in range(steps):
            train_step(engine, data, gas)
        remove()
        out.append(sent[0])
    return out


def measure(configs: list[dict], ulysses_sizes: list[int], model_kw: dict, steps: int = 2) -> tuple[list[int], dict]:
    """Both measurements in one set of processes (``count_all_to_all``, then ``saved_bytes``)."""
    return count_all_to_all(configs, steps), saved_bytes(ulysses_sizes, model_kw)


def _models(ulysses_sizes: list[int], model_kw: dict, micro_batch: int):
    """(SP, a GPT-2 with ``model_kw`` over an SP group of that size, this rank's slice of one micro-batch) per SP;
    each model is dropped before the next is built. SP=1 runs on every rank alone (no collective)."""
    from megatron.core.parallel_state import GroupInfo, ParallelState
    from megatron.core.ulysses import slice_batch
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model

    cfg = named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                      make_vocab_size_divisible_by=64, **model_kw)
    gen = torch.Generator().manual_seed(1)
    batch = {"text": torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length + 1), generator=gen)}
    for ulysses in ulysses_sizes:
        group = GroupInfo([0], 0, None) if ulysses == 1 else ParallelState.build(1, ulysses_size=ulysses).ulysses
        model = GPTModel(cfg, tp=GroupInfo([0], 0, None), init_seed=3, ulysses=group)
        yield ulysses, model, slice_batch(batch, group)
        del model
        gc.collect()


def saved_bytes(ulysses_sizes: list[int], model_kw: dict, micro_batch: int = 1) -> dict[int, int]:
    """{SP: bytes of the activations this rank keeps for backward in one micro-batch's forward} of a GPT-2
    (learned positions) with ``model_kw``."""
    from megatron.initialize import initialize_distributed
    from megatron.perf.saved_tensors import saved_activation_bytes
    from megatron.training.step import gpt_forward_step

    initialize_distributed("gloo")
    return {ulysses: saved_activation_bytes(model, lambda m=model, p=part: gpt_forward_step(m, p))
            for ulysses, model, part in _models(ulysses_sizes, model_kw, micro_batch)}


def activation_memory(ulysses_sizes: list[int], model_kw: dict, micro_batch: int = 1) -> dict[int, tuple[int, int]]:
    """{SP: (saved activation bytes, peak rise of allocated CPU bytes over one forward + backward)} on this rank;
    the peak comes from torch.profiler's allocation records (tests/distributed/perf_probe.py peak_over)."""
    from megatron.training.step import gpt_forward_step
    from tests.distributed.perf_probe import peak_over

    saved = saved_bytes(ulysses_sizes, model_kw, micro_batch)
    out = {}
    for ulysses, model, part in _models(ulysses_sizes, model_kw, micro_batch):
        gpt_forward_step(model, part).backward()  # warm-up: .grad buffers exist before the measured pass
        peak, _, _ = peak_over(lambda m=model, p=part: gpt_forward_step(m, p).backward())
        out[ulysses] = (saved[ulysses], peak)
    return out
