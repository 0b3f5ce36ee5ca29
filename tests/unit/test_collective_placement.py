"""The collective placement rule (megatron/core/comm.py) and the step's host syncs, on CPU.

NCCL/RCCL take device tensors only. Here the comm layer is made to believe its backend is NCCL and that the
accelerator is the ``meta`` device; the underlying collectives are replaced by recorders. Every caller that
issues a collective in the training loop, the checkpoint code and the hierarchical ZeRO engine then runs for
real, and every tensor reaching a collective must be on ``meta``: a host tensor there is what crashed the first
GPU run ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch

from megatron.core import comm
from megatron.training.step import StepResult

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = torch.device("meta")  # stands for the accelerator: never the host


class _FakeAccelerator:
    def current_device_name(self) -> str:
        return str(DEVICE)


@pytest.fixture
def nccl(monkeypatch):
    """Pretend NCCL: returns the list of (op, device) of every tensor handed to a collective."""
    seen: list[tuple[str, torch.device]] = []

    def recorder(op, pos=0):
        def fn(*args, **kwargs):
            seen.append((op, args[pos].device))
        return fn

    monkeypatch.setattr(comm, "_gloo", lambda group: False)
    monkeypatch.setattr(comm, "get_accelerator", lambda: _FakeAccelerator())
    monkeypatch.setattr(comm, "_readback", lambda t: [0] * t.numel())  # meta tensors hold no data
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    for name, pos in (("all_reduce", 0), ("all_gather_into_tensor", 1), ("reduce_scatter_tensor", 1),
                      ("all_to_all_single", 1), ("broadcast", 0)):
        monkeypatch.setattr(comm.dist, name, recorder(name, pos))
    monkeypatch.setattr(comm.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "get_rank", lambda group=None: 0)
    return seen


def _pstate(tp_rank=0, dp=2, mp=2):
    g = lambda size, rank=0: SimpleNamespace(size=size, rank=rank, group=None)  # noqa: E731
    return SimpleNamespace(tp=g(2, tp_rank), dp=g(dp), mp=g(mp), pp=g(1))


def _all_on_device(seen):
    assert seen, "no collective was issued: the test exercised nothing"
    assert all(dev == DEVICE for _, dev in seen), seen


def test_guard_refuses_a_host_tensor_on_nccl(nccl):
    with pytest.raises(RuntimeError, match="NCCL/RCCL take device tensors only"):
        comm.all_reduce(torch.zeros(3))
    assert nccl == []  # refused before reaching the backend


def test_run_control_flags_and_step_values(nccl):
    from megatron.resilience.control import RunControl

    control = RunControl(None, None, None, max_nonfinite=3, saving=False)
    try:
        assert control.after_iteration(1, 2.5).exit is False  # a host float
        res = StepResult(torch.zeros((), device=DEVICE), torch.ones(1, device=DEVICE), False, 1e-3, None)
        control.exchange(res)  # device values: flags and the loss/norm read back together
    finally:
        control.close()
    _all_on_device(nccl)
    assert res.loss == 0.0 and res.grad_norm == 0.0  # filled by the exchange's read-back


def test_kill_switch_file_is_agreed_through_the_flags_all_reduce(monkeypatch, tmp_path):
    """--kill-switch-file: rank 0 looks for the file, the flags' MAX all-reduce tells every rank (no per-rank
    stat each iteration); the decision is save and exit, naming the file. One rank: the all-reduce is identity."""
    import os

    from megatron.resilience.control import RunControl

    sent = []
    monkeypatch.setattr(comm, "reduce_host", lambda values, *a, **k: sent.append(list(values)) or list(values))
    kill = str(tmp_path / "STOP")
    control = RunControl(None, None, None, max_nonfinite=3, saving=True, kill_switch_file=kill)
    other = RunControl(None, None, None, max_nonfinite=3, saving=True, kill_switch_file=kill, checks_files=False)
    try:
        assert control.decide(1, control.exchange(1.0)).exit is False
        open(kill, "w").close()
        flags = control.exchange(1.0)
        assert flags[3] is True and other.exchange(1.0)[3] is False  # only the checking rank contributes it
        d = control.decide(2, flags)
        assert (d.save, d.exit, d.reason) == (True, True, f"kill switch {kill}")
        os.remove(kill)
    finally:
        control.close()
        other.close()
    assert [v[3] for v in sent] == [0.0, 1.0, 0.0]  # the flag travels in the one flags all-reduce


def test_dp_mean_and_checkpoint_id(nccl, monkeypatch):
    from megatron.checkpointing.live import directory
    from megatron.training.pretrain import _dp_mean

    _dp_mean(1.25, _pstate())
    _dp_mean(torch.ones((), device=DEVICE), _pstate())
    monkeypatch.setattr(directory, "rank0", lambda: True)
    directory._agreed_id()
    _all_on_device(nccl)
    assert len(nccl) == 3


def test_grad_norm_reduction_on_device(nccl):
    from megatron.optim.grad_norm import grad_norm

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    grad_norm([p], _pstate())  # gradients on the host, the reduction must still be staged on the device
    _all_on_device(nccl)


def test_hierarchical_zero_clip_on_device(nccl):
    from megatron.core.hierarchical_zero.engine import HierarchicalZeroEngine

    fake = SimpleNamespace(counted=torch.ones(8, dtype=torch.bool, device=DEVICE), h=SimpleNamespace(dp_size=2),
                           mpu=_pstate(), clip_grad=1.0)
    norm = HierarchicalZeroEngine._clip(fake, torch.ones(8, device=DEVICE))
    assert norm.device == DEVICE
    _all_on_device(nccl)
    assert [op for op, _ in nccl] == ["all_reduce", "all_reduce"]  # over DP, then over TP x PP


def test_initialize_sets_the_device_before_the_process_group(monkeypatch):
    """all_gather_object on NCCL stages its pickle on the current device: it must be this rank's own."""
    from megatron import initialize
    from megatron.topology import RankInfo

    calls = []
    acc = SimpleNamespace(device_name=lambda: "cuda", device_count=lambda: 4, communication_backend_name=lambda: "nccl",
                          set_device=lambda i: calls.append(("set_device", i)), device=lambda i: f"cuda:{i}")
    monkeypatch.setattr(initialize, "get_accelerator", lambda: acc)
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize, "_discover", lambda *a: RankInfo(5, 8, 5, 8, 0, "127.0.0.1", 29500, "torchrun"))
    monkeypatch.setattr(initialize, "rendezvous_store", lambda *a: calls.append(("store",)))
    monkeypatch.setattr(initialize.torch.distributed, "init_process_group",
                        lambda backend, **kw: calls.append(("group", backend)))
    monkeypatch.setattr(initialize.deepspeed, "init_distributed",
                        lambda **kw: calls.append(("init", kw["dist_backend"])))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, os.environ.get(k, ""))  # restored after the test
    initialize.initialize_distributed()
    # local rank 5 of 4 visible devices -> device 1, set before the store and the group exist
    assert calls == [("set_device", 1), ("store",), ("group", "nccl"), ("init", "nccl")]


class _Counter:
    """Counts host syncs made from Python: Tensor.item / .cpu / .tolist / float() / comm read-backs."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("item", "cpu", "tolist", "__float__"):
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))
        orig_read = comm._readback
        monkeypatch.setattr(comm, "_readback", self._wrap("readback", orig_read))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return wrapped


class _PlainEngine:
    """The slice of DeepSpeed's engine train_step drives, plain fp32 (ZeRO-0): train_step measures the norm."""

    def __init__(self, model, pstate):
        self.module, self.mpu = model, pstate
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.skipped_steps = 0

    def __call__(self, tokens, labels):
        return self.module(tokens, labels)

    def backward(self, loss):
        (loss / 2).backward()

    def step(self, lr_kwargs=None):
        self.optimizer.step()

    def get_lr(self):
        return [0.1]

    def gradient_accumulation_steps(self):  # the tests drive 2 micro-batches per step
        return 2

    def train_batch_size(self):
        return 2

    def get_global_grad_norm(self):
        return None

    def zero_optimization(self):
        return False

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return False


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))  # many parameters

    def forward(self, tokens, labels):  # [b, s] -> per-token loss [b, s]
        h = self.emb(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = self.out(h)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def test_train_step_makes_one_host_sync_per_iteration(monkeypatch):
    """No sync per parameter or per micro-batch inside the step; the control exchange reads everything back once."""
    from megatron.resilience.control import RunControl
    from megatron.training.step import train_step

    torch.manual_seed(0)
    model = _TinyLM()
    single = SimpleNamespace(tp=SimpleNamespace(size=1, rank=0, group=None), mp=SimpleNamespace(size=1, group=None))
    engine = _PlainEngine(model, single)
    batches = iter([{"text": torch.randint(0, 16, (2, 9))} for _ in range(2)])
    monkeypatch.setattr(comm, "all_reduce", lambda t, group=None, op=None: t)  # one process, no process group
    monkeypatch.setattr(comm, "_gloo", lambda group: True)
    counter = _Counter(monkeypatch)
    res = train_step(engine, batches, num_microbatches=2)
    assert counter.calls == [], counter.calls  # 15 parameters, 2 micro-batches: not one sync
    control = RunControl(None, None, None, max_nonfinite=3, saving=False)
    try:
        control.exchange(res)
    finally:
        control.close()
    assert counter.calls.count("readback") == 1, counter.calls
    loss, norm = res.loss, res.grad_norm
    assert counter.calls.count("readback") == 1, counter.calls  # already on the host

    # The values themselves: the norm equals a float64 reference over every gradient.
    ref = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm()
    assert norm == pytest.approx(ref.item(), rel=1e-12)
    assert loss > 0


def test_grad_norm_counts_replicated_weights_once_per_tp_group():
    from megatron.optim.grad_norm import grad_norm

    sharded, replicated = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    sharded.tensor_model_parallel = True
    sharded.grad, replicated.grad = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([3.0, 4.0])
    one = SimpleNamespace(size=1, group=None)
    assert grad_norm([sharded, replicated], SimpleNamespace(tp=SimpleNamespace(rank=0), mp=one)).item() == \
        pytest.approx((9 + 25) ** 0.5)
    assert grad_norm([sharded, replicated], SimpleNamespace(tp=SimpleNamespace(rank=1), mp=one)).item() == \
        pytest.approx(3.0)


_DEVICE_LITERAL = re.compile(r"""\.cuda\(|(?:device\s*=\s*|torch\.device\(|\.to\()\s*["']cuda""")
_RAW_COLLECTIVE = re.compile(r"\b(?:dist|tdist|torch\.distributed)\.(?:all_reduce|all_gather\w*|reduce_scatter\w*|"
                             r"broadcast\w*|all_to_all\w*|reduce|gather_object|scatter_object_list)\(")


def _sources():
    for root, _, files in os.walk(os.path.join(REPO, "megatron")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, REPO), f.read()


def test_no_hard_coded_cuda_and_no_collective_outside_comm():
    """Device-agnostic (get_accelerator / the run's device), and every collective passes comm.py's guard."""
    cuda = [f"{p}: {m.group(0)}" for p, src in _sources() for m in _DEVICE_LITERAL.finditer(src)]
    assert cuda == [], cuda
    raw = [f"{p}: {m.group(0)}" for p, src in _sources() if p != os.path.join("megatron", "core", "comm.py")
           for m in _RAW_COLLECTIVE.finditer(src)]
    assert raw == [], raw
    assert _DEVICE_LITERAL.search('x.to("cuda")') and _RAW_COLLECTIVE.search("tdist.all_gather_object(a, b)")
