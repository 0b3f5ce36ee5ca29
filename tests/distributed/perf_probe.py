"""Measure what the performance model predicts, in real tiny CPU/gloo runs: bytes per collective and peak memory.

Workers for ``tests.launch.run_distributed`` (importable, so spawn can find them); the assertions live in
``test_perf_model_measured.py``. Nothing here is a test by itself.
"""

from __future__ import annotations

import functools
import gc
from collections import defaultdict

import torch

# torch.distributed entry points DeepSpeed and our comm module end in. DeepSpeed's torch backend captures
# all_gather_into_tensor / reduce_scatter_tensor when the process group is created, so the wrappers go in first.
_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
            "broadcast", "reduce", "send", "recv", "isend", "irecv")
BOOKKEEPING_MAX_ELEMENTS = 16
"""Calls this small (grad-norm partial sums, overflow flags, loss averages) are bookkeeping, outside the model."""
OBSERVER_BOOKKEEPING_MAX_BYTES = 8
"""Our own scalar bookkeeping: the float64 grad norm of megatron/training/step.py."""


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _numel(t) -> int:
    if isinstance(t, (list, tuple)):
        return max((_numel(x) for x in t), default=0)
    return t.numel() if isinstance(t, torch.Tensor) else 0


class TorchDistCounter:
    """Counts the bytes of every torch.distributed collective per (group ranks, op).

    Bytes are the *unsharded* tensor, as megatron/perf/comm.py counts payloads: an all-gather's gathered output,
    a reduce-scatter's full input, the tensor of an all-reduce / broadcast / send. ``dist.reduce`` (DeepSpeed's
    ZeRO-1/2 gradient reduction: one reduce per destination rank's slice) is recorded as itself; its slices over
    all destinations add up to the reduce-scatter payload the model predicts.
    """

    def __init__(self) -> None:
        self.bytes: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
        self.calls: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
        self.active = False
        self._orig = {}

    def install(self) -> None:
        import torch.distributed as td

        for name in _WRAPPED:
            self._orig[name] = getattr(td, name)
            setattr(td, name, self._wrap(name, self._orig[name]))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            if self.active:
                self._record(name, args, kwargs)
            return fn(*args, **kwargs)

        return wrapper

    def _record(self, name: str, args, kwargs) -> None:
        import torch.distributed as td

        if name in ("all_gather", "all_gather_into_tensor"):
            tensor = args[0] if args else kwargs.get("tensor_list", kwargs.get("output_tensor"))
        elif name == "reduce_scatter":
            tensor = args[1] if len(args) > 1 else kwargs["input_list"]
        elif name == "reduce_scatter_tensor":
            tensor = args[1] if len(args) > 1 else kwargs["input"]
        else:
            tensor = args[0] if args else kwargs["tensor"]
        if _numel(tensor) <= BOOKKEEPING_MAX_ELEMENTS:
            return
        group = kwargs.get("group")
        if group is None:
            for a in args[1:]:
                if isinstance(a, td.ProcessGroup):
                    group = a
        ranks = tuple(td.get_process_group_ranks(group)) if group is not None else tuple(range(td.get_world_size()))
        op = name.replace("_into_tensor", "").replace("_tensor", "").lstrip("i")
        self.bytes[(ranks, op)] += _nbytes(tensor)
        self.calls[(ranks, op)] += 1

    def by_op(self, ranks: list[int]) -> dict[str, int]:
        return {op: n for (r, op), n in self.bytes.items() if r == tuple(ranks)}


class ObserverCounter:
    """Our own collectives (megatron/core/comm.py observers), as logical ops: an emulated reduce-scatter counts as
    one. The observer reports the input tensor, so an all-gather's payload is the input times the group size."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
        self.calls: dict[tuple[tuple[int, ...], str], int] = defaultdict(int)
        self.active = False

    def __call__(self, op: str, nbytes: int, group) -> None:
        import torch.distributed as td

        if not self.active:
            return
        ranks = tuple(td.get_process_group_ranks(group)) if group is not None else tuple(range(td.get_world_size()))
        if op == "all_gather":
            nbytes *= len(ranks)
        if nbytes <= OBSERVER_BOOKKEEPING_MAX_BYTES:
            return
        self.bytes[(ranks, op)] += nbytes
        self.calls[(ranks, op)] += 1

    def by_op(self, ranks: list[int]) -> dict[str, int]:
        return {op: n for (r, op), n in self.bytes.items() if r == tuple(ranks)}


def build_run(tp: int, zero: int, seq_par: bool, mbs: int, gbs: int, model_kw: dict, recompute: str | None = None,
              reduce_bucket_size: int | None = None):
    """(engine, data iterator, grad-accumulation steps, ParallelState, RunConfig) for a tiny fp32 GPT."""
    import deepspeed.comm as dist

    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model import GPTModel
    from megatron.config.sizes import named_model
    from megatron.training.batches import microbatches

    world = dist.get_world_size()
    kw = {"use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
          "make_vocab_size_divisible_by": 64, "recompute_granularity": recompute} | model_kw
    model_cfg = named_model("debug", **kw)
    run = RunConfig(model=model_cfg,
                    parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, zero_stage=zero,
                                            sequence_parallel=seq_par),
                    optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, clip_grad=1.0),
                    training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=10,
                                            seed=3))
    state = ParallelState.build(tp)
    model = GPTModel(run.model, tp=state.tp, sequence_parallel=seq_par, init_seed=3)
    ds = build_ds_config(run)
    # Partition every parameter under ZeRO-3, as the model assumes (the default keeps small ones whole).
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if reduce_bucket_size is not None:
        ds["zero_optimization"]["reduce_bucket_size"] = reduce_bucket_size
    engine = initialize_engine(model, run, state, ds)
    data = microbatches(MockGPTDataset(1000, model_cfg.seq_length, model_cfg.vocab_size, seed=9), 0, mbs,
                        state.dp.rank, state.dp.size, "cpu")
    return engine, data, run.training.grad_accumulation_steps(state.dp.size), state, run


# ------------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------------


def live_storages() -> dict[int, int]:
    """{storage pointer: bytes} of every tensor reachable from Python (gc census; views counted once)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                st = obj.untyped_storage()
                if st.nbytes():
                    seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage hold nothing of ours
            pass
    return seen


def peak_over(fn) -> tuple[int, int, object]:
    """(highest rise of allocated CPU bytes above the starting point while ``fn`` runs, net change at its end,
    fn's result).

    Uses torch.profiler's memory records: every allocation and free through c10's CPU allocator, in time order,
    made on a profiled thread.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    cur = peak = 0
    for _, n in records:
        cur += n
        peak = max(peak, cur)
    return peak, cur, result


def step_peak(step, steps: int = 6, slack: int = 16 * 1024) -> int:
    """Peak rise of one steady-state training step whose allocation record is complete.

    Why not simply one step: c10's CPU allocator reports a free to the profiler only from a profiled thread. When
    one of gloo's worker threads happens to drop the last reference to a DeepSpeed communication buffer (ZeRO-2/3
    reductions; it depends on thread timing), that free is missing from the record and the buffer seems to live
    to the end of the step: seen as +0.2 to +0.8 MB on ZeRO-3 in about one step in four, on either rank. A
    steady-state step frees what it allocates, so a record whose net change exceeds ``slack`` lost frees and is
    discarded. Every complete record gives the same peak (the ops and sizes do not change from step to step).
    ``steps`` is fixed, the same on every rank: the steps are collectives, so no rank may retry alone. Should no
    record be complete (about 0.3**6 per rank), the smallest peak is still an upper bound of the true one."""
    peaks, complete = [], []
    for _ in range(steps):
        peak, net, _ = peak_over(step)
        peaks.append(peak)
        if abs(net) <= slack:
            complete.append(peak)
    return min(complete or peaks)


def saved_activation_bytes(engine, batch) -> int:
    """Bytes autograd keeps for backward during one micro-batch's forward (parameters excluded, storages once)."""
    from megatron.training.step import gpt_forward_step

    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters() if p.numel()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gpt_forward_step(engine, batch)
    engine.backward(loss)  # DeepSpeed needs the backward before the next forward; the step happens later
    return sum(seen.values())


def probe_worker(configs: list[dict], steps: int = 2) -> list[dict]:
    """For each config (``build_run`` keywords), after one warm-up step (ZeRO-3 traces its fetch order then):

    * comm: bytes and calls per op over ``steps`` optimizer steps, on this rank's TP group (our observer, logical
      ops) and DP group (torch.distributed wrapper);
    * memory: the peak of one more step = tensors alive at its start that belong to this engine (gc census) + the
      highest rise of allocated CPU bytes during it (torch.profiler memory records); and the bytes autograd saves
      for backward in one micro-batch's forward (saved-tensor hooks).
    """
    from megatron.core import comm
    from megatron.initialize import initialize_distributed
    from megatron.training.step import train_step

    counter = TorchDistCounter()
    counter.install()
    initialize_distributed("gloo")
    out = []
    for cfg in configs:
        gc.collect()
        before = live_storages()  # earlier engines linger in DeepSpeed's globals: count only this one's tensors
        engine, data, gas, state, _ = build_run(**cfg)
        counter.bytes.clear(), counter.calls.clear()
        observer = ObserverCounter()
        remove = comm.add_observer(observer)
        train_step(engine, data, gas)
        counter.active = observer.active = True
        for _ in range(steps):
            train_step(engine, data, gas)
        counter.active = observer.active = False
        remove()
        tp, dp = tuple(state.tp.ranks), tuple(state.dp.ranks)
        res = {"cfg": cfg, "steps": steps, "tp": observer.by_op(tp), "dp": counter.by_op(dp),
               "tp_calls": {op: n for (r, op), n in observer.calls.items() if r == tp},
               "dp_calls": {op: n for (r, op), n in counter.calls.items() if r == dp}}
        gc.collect()
        res["baseline"] = sum(n for ptr, n in live_storages().items() if ptr not in before)
        res["rise"] = step_peak(functools.partial(train_step, engine, data, gas))
        res["peak"] = res["baseline"] + res["rise"]
        res["saved_activations"] = saved_activation_bytes(engine, next(data))
        out.append(res)
        del engine
        gc.collect()
    return out


# ------------------------------------------------------------------------------------------------------------------
# Pipeline point-to-point
# ------------------------------------------------------------------------------------------------------------------


def pipe_probe_worker(configs: list[dict], steps: int = 2) -> list[dict]:
    """DeepSpeed pipeline engine runs (GPTModelPipe, fp32): bytes per (group ranks, op) over ``steps`` steps.

    Each config: ``pp``, ``zero``, ``mbs``, ``gbs``, ``model_kw`` (``named_model`` keywords, e.g. untying). One
    warm-up step first: the engine sends its tensor meta-data (shape/dtype, int32) before the first activation
    only, and that step is outside the window. Every torch.distributed call goes through ``TorchDistCounter``, so
    p2p.send/recv (torch.distributed.send/recv), the tied-weight all-reduce and the loss broadcast are all seen;
    the <= 16-element ones (loss broadcast, grad-norm sums) are dropped as bookkeeping.
    """
    import deepspeed.comm as dist

    from megatron.config import OptimizerConfig, ParallelConfig, RunConfig, TrainingConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.initialize import initialize_distributed
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.config.sizes import named_model
    from megatron.training.batches import microbatches
    from megatron.training.pipe_step import pipe_microbatches, pipe_train_step

    counter = TorchDistCounter()
    counter.install()
    initialize_distributed("gloo")
    out = []
    for cfg in configs:
        kw = {"use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "make_vocab_size_divisible_by": 64} | cfg["model_kw"]
        model_cfg = named_model("debug", **kw)
        run = RunConfig(model=model_cfg,
                        parallel=ParallelConfig(world_size=dist.get_world_size(), zero_stage=cfg["zero"],
                                                pipeline_model_parallel_size=cfg["pp"]),
                        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, clip_grad=1.0),
                        training=TrainingConfig(micro_batch_size=cfg["mbs"], global_batch_size=cfg["gbs"],
                                                train_iters=10, seed=3))
        state = ParallelState.build(1, cfg["pp"])
        engine = initialize_engine(GPTModelPipe(run.model, state, init_seed=3), run, state, build_ds_config(run))
        data = pipe_microbatches(microbatches(MockGPTDataset(1000, model_cfg.seq_length, model_cfg.vocab_size,
                                                             seed=9), 0, cfg["mbs"], state.dp.rank, state.dp.size,
                                              "cpu"))
        pipe_train_step(engine, data)
        counter.bytes.clear(), counter.calls.clear()
        counter.active = True
        losses = [pipe_train_step(engine, data).loss for _ in range(steps)]
        counter.active = False
        out.append({"cfg": cfg, "steps": steps, "stage": state.pp.rank, "rank": dist.get_rank(),
                    "bytes": dict(counter.bytes), "calls": dict(counter.calls), "losses": losses})
        del engine
        gc.collect()
    return out
