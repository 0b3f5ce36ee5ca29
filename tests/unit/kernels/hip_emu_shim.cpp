// C entry points over the csrc launch interfaces, for test_hip_emulated.py (ctypes): the same parameter
// set-up as the torch bindings (csrc/*/*.cpp), on host buffers, with the kernels compiled for the CPU
// emulator (csrc/common/cpu_emulation.h).
#include <cstdint>

#include "../../../csrc/common/wave64.h"
#include "../../../csrc/flash_attention/flash_attn.h"
#include "../../../csrc/fused_layernorm/fused_norm.h"

extern "C" {

void emu_set_reverse_order(int reverse) { mf_emu::set_reverse_order(reverse != 0); }

static mf_flash::AttnParams attn_params(int batch, int heads_q, int heads_kv, int seqlen, int head_dim, float scale,
                                        int causal, int bf16) {
  mf_flash::AttnParams p;
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.seqlen = seqlen;
  p.head_dim = head_dim;
  p.scale = scale;
  p.causal = causal != 0;
  p.dtype = bf16 ? mf_flash::DType::kBFloat16 : mf_flash::DType::kFloat16;
  return p;
}

int emu_attn_fwd(const void* q, const void* k, const void* v, void* o, float* lse, int batch, int heads_q,
                 int heads_kv, int seqlen, int head_dim, float scale, int causal, int bf16) {
  mf_flash::AttnParams p = attn_params(batch, heads_q, heads_kv, seqlen, head_dim, scale, causal, bf16);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  return mf_flash::flash_attn_fwd(p, nullptr);
}

int emu_attn_bwd(const void* dout, const void* q, const void* k, const void* v, void* o, float* lse, void* dq,
                 void* dk, void* dv, float* delta, int batch, int heads_q, int heads_kv, int seqlen, int head_dim,
                 float scale, int causal, int bf16) {
  mf_flash::AttnParams p = attn_params(batch, heads_q, heads_kv, seqlen, head_dim, scale, causal, bf16);
  p.dout = dout;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.delta = delta;
  return mf_flash::flash_attn_bwd(p, nullptr);
}

int64_t emu_norm_bwd_chunks(int64_t rows) { return mf_norm::norm_bwd_chunks(rows); }

// dtype: 0 float32, 1 float16, 2 bfloat16 (mf_norm::DType).
int emu_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd, int64_t rows,
                 int64_t cols, float eps, int rms, int dtype) {
  mf_norm::NormParams p;
  p.x = x;
  p.w = w;
  p.b = b;
  p.y = y;
  p.mean = mean;
  p.rstd = rstd;
  p.rows = rows;
  p.cols = cols;
  p.eps = eps;
  p.rms = rms != 0;
  p.dtype = static_cast<mf_norm::DType>(dtype);
  return mf_norm::norm_fwd(p, nullptr);
}

int emu_norm_bwd(const void* dy, const void* x, const void* w, const float* mean, const float* rstd, void* dx, void* dw,
                 void* db, float* workspace, int64_t rows, int64_t cols, int rms, int dtype) {
  mf_norm::NormParams p;
  p.dy = dy;
  p.x = x;
  p.w = w;
  p.mean = const_cast<float*>(mean);
  p.rstd = const_cast<float*>(rstd);
  p.dx = dx;
  p.dw = dw;
  p.db = db;
  p.workspace = workspace;
  p.rows = rows;
  p.cols = cols;
  p.rms = rms != 0;
  p.dtype = static_cast<mf_norm::DType>(dtype);
  return mf_norm::norm_bwd(p, nullptr);
}

}  // extern "C"
