"""Fused LayerNorm / RMSNorm (forward + backward) in Triton, wrapped as autograd Functions.

Same algorithm as csrc/fused_layernorm: fp32 statistics, per-row mean and rstd saved for backward, and
the gamma/beta gradients reduced across rows in two deterministic stages (per-program partial sums, then
a sum over programs). Checked on CPU under TRITON_INTERPRET=1 against a float64 reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A row lives in one program's registers; 32768 covers Megatron hidden sizes up to the 1T model's 25600.
MAX_COLS = 32768


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here, so tests can poison it (NaN) and prove it is fully written."""
    return torch.empty(shape, dtype=dtype, device=device)


# Rows wider than this take the two-kernel backward: dx alone (no per-program dgamma/dbeta accumulators in
# registers), then a column-tiled dgamma/dbeta pass. At 12288 columns the fused kernel's two extra fp32
# rows of accumulators spilled registers: LayerNorm ran 5.8x slower than torch there while RMSNorm (one
# accumulator) was at parity. Tests lower it to exercise the split path on small rows.
SPLIT_BLOCK = 8192


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    """Autotune candidates: rows per tile x warps (pruned per row width by _prune).

    Under the interpreter: one config (16 rows, 1 warp), so nothing is benchmarked: every tile costs
    Python time there, so many rows at once. On ROCm (MI250X, unmeasured) the same candidates: a warp is
    a 64-lane wavefront there, so the pruning's 32-lane count is conservative; no AMD-only knob, since
    these kernels are bandwidth-bound and hold little state (waves_per_eu pays off for the register-heavy
    attention tiles, triton_attention._configs).
    """
    if _interpreting():
        return [triton.Config({"ROWS": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"ROWS": r}, num_warps=w, num_stages=1) for r in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)]


def _prune(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    # A tile of ROWS x BLOCK fp32 values lives in registers: keep it between 1K and 16K elements (a wide
    # row alone may exceed that), with at least 32 elements per thread-lane group of a warp.
    block = kwargs.get("BLOCK", nargs.get("BLOCK"))
    keep = [c for c in configs if (c.kwargs["ROWS"] == 1 or 1024 <= c.kwargs["ROWS"] * block <= 16384)
            and c.num_warps * 32 * 4 <= max(128, c.kwargs["ROWS"] * block)]
    return keep or configs[:1]


_AUTOTUNE = dict(configs=_configs(), key=["n_cols"], prune_configs_by={"early_config_prune": _prune})


@triton.autotune(**_AUTOTUNE)
@triton.jit
def _norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_rows, n_cols, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    # A tile of ROWS whole rows per program: (ROWS, BLOCK), reductions along the row (axis 1).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, 1) / n_cols
        # Two-pass variance on rows held in registers: no sum(x^2) - n mean^2 cancellation.
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(DY, X, MEAN, RSTD, stride_x, stride_dy, r0, row_end, cols, col_ok, ROWS: tl.constexpr,
               RMS: tl.constexpr):
    # One (ROWS, cols) tile of the backward's inputs in fp32: (rows, mask, dy, xhat, rstd[:, None]); both
    # backward kernels read their rows this way, so x-hat is computed identically in both.
    rows = r0 + tl.arange(0, ROWS)
    row_ok = rows < row_end
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
    if RMS:
        xhat = x * rstd
    else:
        xhat = tl.where(mask, (x - tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]) * rstd, 0.0)
    return rows, mask, dy, xhat, rstd


@triton.autotune(**_AUTOTUNE)
@triton.jit
def _norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, stride_x, stride_dy, stride_dx,
                     n_rows, n_cols, rows_per_prog,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACC_W: tl.constexpr):
    # Each program owns a strip of rows_per_prog rows, walked ROWS at a time: it writes their dx and, with
    # ACC_W, one partial row of dgamma/dbeta (stage 1 of the row reduction; the wrapper sums the partials).
    # Without ACC_W (wide rows) dgamma/dbeta come from _norm_dwdb_kernel instead.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for r0 in range(row_start, row_end, ROWS):
        rows, mask, dy, xhat, rstd = _load_tile(DY, X, MEAN, RSTD, stride_x, stride_dy, r0, row_end, cols, col_ok,
                                                ROWS, RMS)
        wdy = w * dy
        c1 = (tl.sum(xhat * wdy, 1) / n_cols)[:, None]
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = (tl.sum(wdy, 1) / n_cols)[:, None]
            dx = (wdy - xhat * c1 - c2) * rstd
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if ACC_W:
            dw_acc += tl.sum(dy * xhat, 0)
            if HAS_BIAS:
                db_acc += tl.sum(dy, 0)
    if ACC_W:
        tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_ok)
        if HAS_BIAS:
            tl.store(DB_PART + pid * n_cols + cols, db_acc, mask=col_ok)


@triton.jit
def _norm_dwdb_kernel(DY, X, MEAN, RSTD, DW_PART, DB_PART, stride_x, stride_dy, n_rows, n_cols, rows_per_prog,
                      ROWS: tl.constexpr, BLOCK_C: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Stage 1 of dgamma/dbeta for wide rows: program (column tile, row strip) sums dy * xhat (and dy) over
    # its strip for BLOCK_C columns; a (ROWS, BLOCK_C) tile at a time keeps registers small at any width.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    strip = tl.program_id(1)
    col_ok = cols < n_cols
    dw_acc = tl.zeros([BLOCK_C], tl.float32)
    db_acc = tl.zeros([BLOCK_C], tl.float32)
    row_start = strip * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    for r0 in range(row_start, row_end, ROWS):
        rows, mask, dy, xhat, rstd = _load_tile(DY, X, MEAN, RSTD, stride_x, stride_dy, r0, row_end, cols, col_ok,
                                                ROWS, RMS)
        dw_acc += tl.sum(dy * xhat, 0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, 0)
    tl.store(DW_PART + strip * n_cols + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + strip * n_cols + cols, db_acc, mask=col_ok)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the fused norm cannot run these inputs (the seam then falls back to torch), or None."""
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {x.dtype}"
    # Mixed dtypes change the output dtype under torch's promotion rules; keep the torch path for them.
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"weight/bias dtype differs from input dtype {x.dtype}"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or (bias is not None and bias.shape != weight.shape):
        return f"weight shape {tuple(weight.shape)} for input {tuple(x.shape)}"
    if x.shape[-1] > MAX_COLS:
        return f"hidden size {x.shape[-1]} > {MAX_COLS}"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                 rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y shaped like x, mean [rows] fp32 (empty for RMSNorm), rstd [rows] fp32)."""
    x2 = _rows(x)
    rows, cols = x2.shape
    y = _alloc((rows, cols), x.dtype, x.device)
    mean = _alloc((0 if rms else rows,), torch.float32, x.device)
    rstd = _alloc((rows,), torch.float32, x.device)
    block = triton.next_power_of_2(cols)
    if rows:
        _norm_fwd_kernel[lambda m: (triton.cdiv(rows, m["ROWS"]),)](
            x2, weight, bias if bias is not None else weight, y, mean if not rms else rstd, rstd, x2.stride(0),
            y.stride(0), rows, cols, eps, BLOCK=block, RMS=rms, HAS_BIAS=bias is not None)
    return y.view(x.shape), mean, rstd


def norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                  has_bias: bool, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (dx shaped like x, dweight, dbias or None)."""
    x2, dy2 = _rows(x), _rows(dy)
    rows, cols = x2.shape
    dx = _alloc((rows, cols), x.dtype, x.device)
    block = triton.next_power_of_2(cols)
    split = block >= SPLIT_BLOCK
    # Enough programs to fill a GPU; few under the interpreter, where each program costs Python time.
    progs = max(1, min(rows, 2 if _interpreting() else (2048 if split else 512)))
    rows_per_prog = triton.cdiv(max(rows, 1), progs)
    # Partial dgamma/dbeta rows: one per program of the fused kernel, or one per row strip when split.
    strips = max(1, min(rows, 2 if _interpreting() else 256)) if split else progs
    dw_part = _alloc((strips, cols), torch.float32, x.device)
    db_part = _alloc((strips, cols), torch.float32, x.device) if has_bias else dw_part
    if rows:
        _norm_bwd_kernel[(progs,)](dy2, x2, weight, mean if not rms else rstd, rstd, dx, dw_part, db_part,
                                   x2.stride(0), dy2.stride(0), dx.stride(0), rows, cols, rows_per_prog,
                                   BLOCK=block, RMS=rms, HAS_BIAS=has_bias, ACC_W=not split)
        if split:
            block_c = 64 if _interpreting() else 256
            _norm_dwdb_kernel[(triton.cdiv(cols, block_c), strips)](
                dy2, x2, mean if not rms else rstd, rstd, dw_part, db_part, x2.stride(0), dy2.stride(0), rows, cols,
                triton.cdiv(rows, strips), ROWS=16 if _interpreting() else 32, BLOCK_C=block_c, RMS=rms,
                HAS_BIAS=has_bias, num_warps=1 if _interpreting() else 4)
    else:
        dw_part.zero_()
        db_part.zero_()
    # Second stage of the row reduction: a fixed-order fp32 sum over the programs' partial rows.
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(weight.dtype) if has_bias else None
    return dx.view(x.shape), dw, db


class TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        y, mean, rstd = norm_forward(x, weight, bias, eps, rms=False)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(dy, x, weight, mean, rstd, ctx.has_bias, rms=False)
        return dx, dw, db, None


class TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, mean, rstd = norm_forward(x, weight, None, eps, rms=True)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, _ = norm_backward(dy, x, weight, mean, rstd, has_bias=False, rms=True)
        return dx, dw, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return TritonLayerNorm.apply(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return TritonRMSNorm.apply(x, weight, eps)
