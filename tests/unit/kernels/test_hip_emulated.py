"""The csrc HIP kernel sources executed on the CPU emulator (csrc/common/cpu_emulation.h) vs float64.

g++ compiles the unchanged *.hip files with -DMF_GPU_EMULATE; every GPU thread of a block runs as a fiber,
one after the other between barriers. Twice: with AMD's 64-lane shuffle, and with the two-warp helpers
that nvcc compiles (warp shuffles and a named-barrier swap, emulated). This executes the kernels' own
indexing, masking, LDS tiling, barrier placement (run in increasing and in decreasing thread order, so a
read not ordered after its write by a barrier goes stale in one of them), wave-64 xor reductions and
fp16/bf16 conversions; the emulator reports a barrier or wave helper that not every thread reaches, or
reaches divergently. It says nothing about code generation by hipcc/nvcc; tests/gpu/test_hip_kernels.py
runs them on a GPU.

Buffers sit between NaN guard zones: an out-of-bounds write changes a guard, an unmasked out-of-bounds
read turns an output NaN; outputs start NaN, so an element never written fails too.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess

import pytest
import torch

from tests.unit.kernels.reference import TOL, attention_ref, dtype_id, layer_norm_ref, record_errors, rel_err, within

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SOURCES = ["csrc/flash_attention/flash_attn_fwd.hip", "csrc/flash_attention/flash_attn_bwd.hip",
           "csrc/fused_layernorm/fused_norm.hip"]
GUARD = 1 << 12  # elements of NaN on each side of every buffer
EPS = 1e-5

_i, _i64, _f, _p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


# wave64: the AMD semantics (one 64-lane xor shuffle); two_warps: the helpers nvcc compiles (csrc/common/
# wave64.h: 32-lane warp shuffles, and a shared-memory swap between named barriers for lane mask 32).
@pytest.fixture(scope="module", params=["wave64", "two_warps"])
def emu(request, tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) to build the CPU emulation of the csrc kernels")
    lib = tmp_path_factory.mktemp(f"hip_emu_{request.param}") / "libmf_emu.so"
    mode = ["-DMF_GPU_EMULATE_TWO_WARPS"] if request.param == "two_warps" else []
    # -O1: the run time is dominated by fiber switches, not by the arithmetic.
    cmd = [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-DMF_GPU_EMULATE", *mode, "-Wall", "-Wextra",
           "-Wno-unknown-pragmas", "-Werror", "-x", "c++", *(os.path.join(REPO, s) for s in SOURCES), "-x", "none",
           os.path.join(REPO, "tests/unit/kernels/hip_emu_shim.cpp"), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"building the emulated kernels failed:\n{done.stderr[-4000:]}"
    so = ctypes.CDLL(str(lib))
    so.emu_attn_fwd.argtypes = [_p] * 5 + [_i] * 5 + [_f, _i, _i]
    so.emu_attn_bwd.argtypes = [_p] * 10 + [_i] * 5 + [_f, _i, _i]
    so.emu_norm_fwd.argtypes = [_p] * 6 + [_i64, _i64, _f, _i, _i]
    so.emu_norm_bwd.argtypes = [_p] * 9 + [_i64, _i64, _i, _i]
    so.emu_norm_bwd_chunks.argtypes = [_i64]
    so.emu_norm_bwd_chunks.restype = _i64
    so.emu_set_reverse_order.argtypes = [_i]
    so.emu_selftest.argtypes = [_i, _p, _f]
    return so


def test_emulator_reports_broken_contracts(emu):
    """The checks the kernel tests rely on: a broken contract is an error, a missing barrier shows."""
    out = torch.zeros(256)
    for which, what in enumerate(("divergent wave_sum", "mixed lane masks", "half of each wave skips __syncthreads")):
        assert emu.emu_selftest(which, out.data_ptr(), 0.0) != 0, what
    expected = lambda seed: seed + (torch.arange(256) + 1) % 256  # noqa: E731
    stale = False
    for reverse in (0, 1):
        emu.emu_set_reverse_order(reverse)
        seed = 1000.0 * (reverse + 1)  # shared memory is a static here: each launch writes new values
        assert emu.emu_selftest(3, out.data_ptr(), seed) == 0
        stale = stale or not torch.equal(out, expected(seed))
        assert emu.emu_selftest(4, out.data_ptr(), seed + 500) == 0
        assert torch.equal(out, expected(seed + 500)), "with the barrier every order must read the new values"
    emu.emu_set_reverse_order(0)
    assert stale, "a read of shared memory not ordered by a barrier went unnoticed in both thread orders"


class Guarded:
    """A contiguous tensor inside a NaN-filled allocation with GUARD elements on either side."""

    def __init__(self, shape, dtype, data: torch.Tensor | None = None):
        n = math.prod(shape)
        self.full = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype)
        self.t = self.full[GUARD:GUARD + n].view(shape)
        if data is not None:
            self.t.copy_(data)

    @property
    def ptr(self) -> int:
        return self.t.data_ptr()

    def check(self, name: str, written: bool = True) -> None:
        assert self.full[:GUARD].isnan().all() and self.full[-GUARD:].isnan().all(), f"{name}: out-of-bounds write"
        if written:
            assert not self.t.isnan().any(), f"{name}: an element was never written (still NaN)"


def _attn_inputs(b, nq, nkv, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, s, d, generator=g).to(dtype)
    k = torch.randn(b, nkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, nkv, s, d, generator=g).to(dtype)
    do = torch.randn(b, nq, s, d, generator=g).to(dtype)
    return q, k, v, do


# (b, nq, nkv, s, d, causal, dtype, reverse thread order): ragged last tiles, GQA and MHA, both head dims.
ATTN_CASES = [
    (1, 2, 1, 70, 64, True, torch.float16, False),
    (1, 2, 1, 70, 64, True, torch.float16, True),
    (2, 2, 2, 45, 128, False, torch.bfloat16, False),
    (1, 4, 1, 33, 128, True, torch.bfloat16, True),
    (1, 1, 1, 129, 64, False, torch.bfloat16, False),
]


@pytest.mark.parametrize("b,nq,nkv,s,d,causal,dtype,reverse", ATTN_CASES, ids=dtype_id)
def test_attention_emulated_matches_float64(emu, b, nq, nkv, s, d, causal, dtype, reverse, record_property):
    q, k, v, do = _attn_inputs(b, nq, nkv, s, d, dtype, seed=s * 7 + d)
    scale = 1.0 / math.sqrt(d)
    bf16 = int(dtype == torch.bfloat16)
    gq, gk, gv, gdo = (Guarded(t.shape, dtype, t) for t in (q, k, v, do))
    go, glse = Guarded(q.shape, dtype), Guarded((b, nq, s), torch.float32)
    gdq, gdk, gdv = Guarded(q.shape, dtype), Guarded(k.shape, dtype), Guarded(v.shape, dtype)
    gdelta = Guarded((b, nq, s), torch.float32)

    emu.emu_set_reverse_order(int(reverse))
    dims = (b, nq, nkv, s, d, scale, int(causal), bf16)
    assert emu.emu_attn_fwd(gq.ptr, gk.ptr, gv.ptr, go.ptr, glse.ptr, *dims) == 0
    assert emu.emu_attn_bwd(gdo.ptr, gq.ptr, gk.ptr, gv.ptr, go.ptr, glse.ptr, gdq.ptr, gdk.ptr, gdv.ptr, gdelta.ptr,
                            *dims) == 0
    emu.emu_set_reverse_order(0)
    for name, g in dict(o=go, lse=glse, dq=gdq, dk=gdk, dv=gdv, delta=gdelta).items():
        g.check(name)
    for name, g in dict(q=gq, k=gk, v=gv, do=gdo).items():
        g.check(name)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = attention_ref(q64, k64, v64, causal, scale)
    o_ref.backward(do.double())
    tol = TOL[dtype]
    floor = 0.1 * do.double().pow(2).mean().sqrt().item()
    record_errors(record_property, within({
        "o": (rel_err(go.t, o_ref), tol),
        "lse": (rel_err(glse.t, lse_ref), 1e-5),
        "delta": (rel_err(gdelta.t, (do.double() * go.t.double()).sum(-1)), 1e-5),  # rowsum(dO * O) of the stored O
        "dq": (rel_err(gdq.t, q64.grad, floor), tol),
        "dk": (rel_err(gdk.t, k64.grad, floor), tol),
        "dv": (rel_err(gdv.t, v64.grad, floor), tol)}))


# (rows, cols, rms, bias, dtype, reverse): a row shorter than a wave, ragged columns, more rows than the
# 256 first-stage chunks of the dgamma reduction.
NORM_CASES = [
    (5, 33, False, True, torch.float32, False),
    (5, 33, False, True, torch.float32, True),
    (9, 257, True, False, torch.bfloat16, True),
    (3, 1000, False, False, torch.float16, False),
    (300, 70, False, True, torch.bfloat16, False),
]


@pytest.mark.parametrize("rows,cols,rms,bias,dtype,reverse", NORM_CASES, ids=dtype_id)
def test_norm_emulated_matches_float64(emu, rows, cols, rms, bias, dtype, reverse, record_property):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 2 + 5).to(dtype)  # offset mean: catches E[x^2] - E[x]^2
    w = (1 + 0.5 * torch.randn(cols, generator=g)).to(dtype)
    b = torch.randn(cols, generator=g).to(dtype) if bias else None
    dy = torch.randn(rows, cols, generator=g).to(dtype)
    code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    gx, gw, gdy = Guarded(x.shape, dtype, x), Guarded(w.shape, dtype, w), Guarded(dy.shape, dtype, dy)
    gb = Guarded(w.shape, dtype, b) if bias else None
    gy, gmean, grstd = Guarded(x.shape, dtype), Guarded((rows,), torch.float32), Guarded((rows,), torch.float32)
    gdx, gdw = Guarded(x.shape, dtype), Guarded(w.shape, dtype)
    gdb = Guarded(w.shape, dtype) if bias else None
    chunks = emu.emu_norm_bwd_chunks(rows)
    gws = Guarded((2 if bias else 1, chunks, cols), torch.float32)

    emu.emu_set_reverse_order(int(reverse))
    assert emu.emu_norm_fwd(gx.ptr, gw.ptr, gb.ptr if bias else None, gy.ptr, None if rms else gmean.ptr, grstd.ptr,
                            rows, cols, EPS, int(rms), code) == 0
    assert emu.emu_norm_bwd(gdy.ptr, gx.ptr, gw.ptr, None if rms else gmean.ptr, grstd.ptr, gdx.ptr, gdw.ptr,
                            gdb.ptr if bias else None, gws.ptr, rows, cols, int(rms), code) == 0
    emu.emu_set_reverse_order(0)
    for name, gg in dict(y=gy, rstd=grstd, dx=gdx, dw=gdw, ws=gws, db=gdb).items():
        if gg is not None:
            gg.check(name)
    gmean.check("mean", written=not rms)
    for name, gg in dict(x=gx, w=gw, dy=gdy, b=gb).items():
        if gg is not None:
            gg.check(name)

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if bias else None
    y_ref, mean_ref, rstd_ref = layer_norm_ref(x64, w64, b64, EPS, rms)
    y_ref.backward(dy.double())
    tol = TOL[dtype]
    errors = {"y": (rel_err(gy.t, y_ref), tol), "rstd": (rel_err(grstd.t, rstd_ref.detach()), 1e-5)}
    if not rms:
        errors["mean"] = (rel_err(gmean.t, mean_ref.detach()), 1e-5)
    errors["dx"] = (rel_err(gdx.t, x64.grad), tol)
    errors["dw"] = (rel_err(gdw.t, w64.grad), tol)
    if bias:
        errors["db"] = (rel_err(gdb.t, b64.grad), tol)
    record_errors(record_property, within(errors))
