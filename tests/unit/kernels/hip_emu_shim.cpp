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

// Self-test of the emulator's checks: kernels that break the contracts of csrc/common/wave64.h.
namespace selftest {

__global__ void divergent_wave_sum(float* out) {  // half a wave skips the reduction: a deadlock on hardware
  float v = 1.f;
  if (threadIdx.x % 64 < 32) v = mf_gpu::wave_sum(v);
  out[threadIdx.x] = v;
}

__global__ void mixed_lane_masks(float* out) {  // lanes of one wave disagree on the shuffle
  out[threadIdx.x] = mf_gpu::wave_shfl_xor(1.f, threadIdx.x % 2 ? 1 : 2);
}

__global__ void partial_syncthreads(float* out) {  // half of every wave skips the barrier
  if (threadIdx.x % 64 < 32) __syncthreads();
  out[threadIdx.x] = 1.f;
}

// Each thread reads its neighbour's shared-memory slot: correct only with the barrier between.
template <bool kBarrier>
__global__ void neighbour_read(float* out, float seed) {
  __shared__ float s[256];
  s[threadIdx.x] = seed + threadIdx.x;
  if (kBarrier) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % 256];
}

}  // namespace selftest

extern "C" {

// which: 0 divergent wave_sum, 1 mixed lane masks, 2 partial __syncthreads, 3 neighbour read without and
// 4 with a barrier. Returns hipGetLastError() of the launch (one block of 256 threads).
int emu_selftest(int which, float* out, float seed) {
  const dim3 grid(1), block(256);
  switch (which) {
    case 0: hipLaunchKernelGGL(selftest::divergent_wave_sum, grid, block, 0, nullptr, out); break;
    case 1: hipLaunchKernelGGL(selftest::mixed_lane_masks, grid, block, 0, nullptr, out); break;
    case 2: hipLaunchKernelGGL(selftest::partial_syncthreads, grid, block, 0, nullptr, out); break;
    case 3: hipLaunchKernelGGL(selftest::neighbour_read<false>, grid, block, 0, nullptr, out, seed); break;
    default: hipLaunchKernelGGL(selftest::neighbour_read<true>, grid, block, 0, nullptr, out, seed); break;
  }
  return hipGetLastError();
}

}  // extern "C"
