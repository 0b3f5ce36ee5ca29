// Flash-attention backward for gfx90a, in the FlashAttention-2 split: one kernel owns a 64-key tile and
// accumulates dK, dV over every query tile (and every query head of its GQA group, so no atomics), a
// second owns a query tile and accumulates dQ over the key tiles. Probabilities are recomputed from the
// saved log-sum-exp; nothing of size s x s touches HBM. Deterministic: no floating-point atomics.
#include "flash_attn.h"
#include "flash_attn_tiles.h"
#include "hip_common.h"

namespace mf_flash {

// delta[row] = sum_d dout[row, d] * o[row, d], one wavefront per row.
template <class T, int D>
__global__ __launch_bounds__(kThreads) void flash_bwd_delta_kernel(const uint16_t* __restrict__ dout,
                                                                   const uint16_t* __restrict__ o,
                                                                   float* __restrict__ delta, size_t rows) {
  const size_t row = static_cast<size_t>(blockIdx.x) * kWaves + threadIdx.x / kWave;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWave;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < D / kWave; ++i) {
    const size_t idx = row * D + lane + kWave * i;
    acc += T::load(dout[idx]) * T::load(o[idx]);
  }
  acc = wave_sum(acc);
  if (lane == 0) delta[row] = acc;
}

template <int ROWS, int D>
__device__ inline void load_rows(uint16_t (*dst)[D], const uint16_t* src, int r0, int seqlen) {
  for (int i = threadIdx.x; i < ROWS * D; i += kThreads) {
    const int r = i / D, c = i % D;
    dst[r][c] = (r0 + r < seqlen) ? src[static_cast<size_t>(r0 + r) * D + c] : uint16_t{0};
  }
}

// LDS of the dK/dV kernel, one struct because at d=128 it is 49.8 KB: over CUDA's 48 KB of static shared
// memory, so under nvcc MF_BLOCK_SHARED places it in dynamic shared memory (same layout on both platforms).
template <int D>
struct DkdvShared {
  static constexpr int BM = BwdTile<D>::kBlockM;
  static constexpr int KP = D + 2;  // bank-conflict padding, as in the forward kernel
  // 16-byte alignment, as the compiler gives separate __shared__ arrays: it lets LDS accesses vectorise.
  alignas(16) uint16_t k_s[kBlockN][KP];
  alignas(16) uint16_t v_s[kBlockN][KP];
  alignas(16) uint16_t q_s[BM][D];
  alignas(16) uint16_t do_s[BM][D];
  alignas(16) float p_s[BM][kBlockN];
  alignas(16) float ds_s[BM][kBlockN];
  alignas(16) float lse_s[BM];
  alignas(16) float delta_s[BM];
};
static_assert(sizeof(DkdvShared<128>) <= 64 * 1024, "a gfx90a CU has 64 KB of LDS");

template <class T, int D, bool kCausal>
__global__ __launch_bounds__(kThreads) void flash_bwd_dkdv_kernel(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
    const uint16_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    uint16_t* __restrict__ dk, uint16_t* __restrict__ dv, int heads_q, int group, int seqlen, float scale) {
  using Tile = BwdTile<D>;
  constexpr int BM = Tile::kBlockM;
  constexpr int KW = Tile::kKeysPerWave;
  constexpr int C = D / kWave;

  MF_BLOCK_SHARED(DkdvShared<D>, lds);
  auto& k_s = lds.k_s;
  auto& v_s = lds.v_s;
  auto& q_s = lds.q_s;
  auto& do_s = lds.do_s;
  auto& p_s = lds.p_s;
  auto& ds_s = lds.ds_s;
  auto& lse_s = lds.lse_s;
  auto& delta_s = lds.delta_s;

  const int tid = threadIdx.x, lane = tid % kWave, wave = tid / kWave;
  const int heads_kv = heads_q / group;
  const int bhk = blockIdx.y;  // b * heads_kv + kv head
  const int b = bhk / heads_kv, hk = bhk % heads_kv;
  const int n0 = blockIdx.x * kBlockN;
  const float scale_log2 = scale * kLog2e;

  for (int i = tid; i < kBlockN * D; i += kThreads) {
    const int r = i / D, c = i % D;
    const size_t off = (static_cast<size_t>(bhk) * seqlen + n0 + r) * D + c;
    k_s[r][c] = (n0 + r < seqlen) ? k[off] : uint16_t{0};
    v_s[r][c] = (n0 + r < seqlen) ? v[off] : uint16_t{0};
  }

  float dk_acc[KW][C], dv_acc[KW][C];
#pragma unroll
  for (int t = 0; t < KW; ++t)
#pragma unroll
    for (int c = 0; c < C; ++c) dk_acc[t][c] = dv_acc[t][c] = 0.f;

  // Causal: query tiles that end before this key tile's first key cannot see it.
  const int m_start = kCausal ? (n0 / BM) * BM : 0;
  const int key = n0 + lane;
  for (int g = 0; g < group; ++g) {
    const size_t bh = static_cast<size_t>(b) * heads_q + hk * group + g;
    const uint16_t* qh = q + bh * seqlen * D;
    const uint16_t* doh = dout + bh * seqlen * D;
    for (int m0 = m_start; m0 < seqlen; m0 += BM) {
      __syncthreads();  // the previous tile's P, dS and rows are consumed
      load_rows<BM, D>(q_s, qh, m0, seqlen);
      load_rows<BM, D>(do_s, doh, m0, seqlen);
      for (int r = tid; r < BM; r += kThreads) {
        const bool real = m0 + r < seqlen;
        lse_s[r] = real ? lse[bh * seqlen + m0 + r] * kLog2e : 0.f;
        delta_s[r] = real ? delta[bh * seqlen + m0 + r] : 0.f;
      }
      __syncthreads();

      // Phase 1: lane = key. P from the saved LSE; dS = P * (dO . V - delta).
      for (int r = wave; r < BM; r += kWaves) {
        float qk = 0.f, dov = 0.f;
#pragma unroll 8
        for (int c = 0; c < D; ++c) {
          qk += T::load(q_s[r][c]) * T::load(k_s[lane][c]);
          dov += T::load(do_s[r][c]) * T::load(v_s[lane][c]);
        }
        const int row = m0 + r;
        const bool visible = row < seqlen && key < seqlen && (!kCausal || key <= row);
        const float p = visible ? exp2f(qk * scale_log2 - lse_s[r]) : 0.f;
        p_s[r][lane] = p;
        ds_s[r][lane] = p * (dov - delta_s[r]);
      }
      __syncthreads();

      // Phase 2: wavefront w owns keys [w*KW, (w+1)*KW); lane owns head-dim columns lane + 64c.
      for (int r = 0; r < BM; ++r) {
        float do_rc[C], q_rc[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          do_rc[c] = T::load(do_s[r][lane + kWave * c]);
          q_rc[c] = T::load(q_s[r][lane + kWave * c]);
        }
#pragma unroll
        for (int t = 0; t < KW; ++t) {
          const float p = p_s[r][wave * KW + t];
          const float ds = ds_s[r][wave * KW + t];
#pragma unroll
          for (int c = 0; c < C; ++c) {
            dv_acc[t][c] += p * do_rc[c];
            dk_acc[t][c] += ds * q_rc[c];
          }
        }
      }
    }
  }

#pragma unroll
  for (int t = 0; t < KW; ++t) {
    const int kr = n0 + wave * KW + t;
    if (kr >= seqlen) continue;
    const size_t off = (static_cast<size_t>(bhk) * seqlen + kr) * D;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      dk[off + lane + kWave * c] = T::store(dk_acc[t][c] * scale);
      dv[off + lane + kWave * c] = T::store(dv_acc[t][c]);
    }
  }
}

template <class T, int D, bool kCausal>
__global__ __launch_bounds__(kThreads) void flash_bwd_dq_kernel(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
    const uint16_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    uint16_t* __restrict__ dq, int heads_q, int group, int seqlen, float scale) {
  using Tile = BwdTile<D>;
  constexpr int BM = Tile::kBlockM;
  constexpr int R = Tile::kRowsPerWave;
  constexpr int C = D / kWave;
  constexpr int KP = D + 2;

  __shared__ uint16_t q_s[BM][D];
  __shared__ uint16_t do_s[BM][D];
  __shared__ uint16_t k_s[kBlockN][KP];
  __shared__ uint16_t v_s[kBlockN][KP];
  __shared__ float ds_s[BM][kBlockN];

  const int tid = threadIdx.x, lane = tid % kWave, wave = tid / kWave;
  const int bh = blockIdx.y;
  const int b = bh / heads_q, h = bh % heads_q;
  const int heads_kv = heads_q / group;
  const int m0 = blockIdx.x * BM;
  const float scale_log2 = scale * kLog2e;
  const size_t kv_off = static_cast<size_t>(b * heads_kv + h / group) * seqlen * D;

  load_rows<BM, D>(q_s, q + static_cast<size_t>(bh) * seqlen * D, m0, seqlen);
  load_rows<BM, D>(do_s, dout + static_cast<size_t>(bh) * seqlen * D, m0, seqlen);
  float lse_r[R], delta_r[R], acc[R][C];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = m0 + wave * R + r;
    lse_r[r] = row < seqlen ? lse[static_cast<size_t>(bh) * seqlen + row] * kLog2e : 0.f;
    delta_r[r] = row < seqlen ? delta[static_cast<size_t>(bh) * seqlen + row] : 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
  }

  const int n_end = kCausal ? min(seqlen, m0 + BM) : seqlen;
  for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
    __syncthreads();
    for (int i = tid; i < kBlockN * D; i += kThreads) {
      const int r = i / D, c = i % D;
      const size_t off = kv_off + static_cast<size_t>(n0 + r) * D + c;
      k_s[r][c] = (n0 + r < seqlen) ? k[off] : uint16_t{0};
      v_s[r][c] = (n0 + r < seqlen) ? v[off] : uint16_t{0};
    }
    __syncthreads();

    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row_l = wave * R + r;
      float qk = 0.f, dov = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; ++c) {
        qk += T::load(q_s[row_l][c]) * T::load(k_s[lane][c]);
        dov += T::load(do_s[row_l][c]) * T::load(v_s[lane][c]);
      }
      const int row = m0 + row_l;
      const bool visible = row < seqlen && key < seqlen && (!kCausal || key <= row);
      const float p = visible ? exp2f(qk * scale_log2 - lse_r[r]) : 0.f;
      ds_s[row_l][lane] = p * (dov - delta_r[r]);
    }
    __syncthreads();

    for (int j = 0; j < kBlockN; ++j) {
      float kj[C];
#pragma unroll
      for (int c = 0; c < C; ++c) kj[c] = T::load(k_s[j][lane + kWave * c]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float ds = ds_s[wave * R + r][j];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] += ds * kj[c];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = m0 + wave * R + r;
    if (row >= seqlen) continue;
    uint16_t* dqrow = dq + (static_cast<size_t>(bh) * seqlen + row) * D;
#pragma unroll
    for (int c = 0; c < C; ++c) dqrow[lane + kWave * c] = T::store(acc[r][c] * scale);
  }
}

template <class T, int D, bool kCausal>
static int launch_bwd(const AttnParams& p, hipStream_t stream) {
  const auto* q = static_cast<const uint16_t*>(p.q);
  const auto* k = static_cast<const uint16_t*>(p.k);
  const auto* v = static_cast<const uint16_t*>(p.v);
  const auto* dout = static_cast<const uint16_t*>(p.dout);
  const int group = p.heads_q / p.heads_kv;
  const size_t rows = static_cast<size_t>(p.batch) * p.heads_q * p.seqlen;

  hipLaunchKernelGGL((flash_bwd_delta_kernel<T, D>), dim3((rows + kWaves - 1) / kWaves), dim3(kThreads), 0, stream,
                     dout, static_cast<const uint16_t*>(p.o), p.delta, rows);
  const dim3 grid_kv((p.seqlen + kBlockN - 1) / kBlockN, p.batch * p.heads_kv);
  const size_t dkdv_shared = mf_gpu::block_shared_bytes<DkdvShared<D>>(flash_bwd_dkdv_kernel<T, D, kCausal>);
  hipLaunchKernelGGL((flash_bwd_dkdv_kernel<T, D, kCausal>), grid_kv, dim3(kThreads), dkdv_shared, stream, q, k, v,
                     dout, p.lse, p.delta, static_cast<uint16_t*>(p.dk), static_cast<uint16_t*>(p.dv), p.heads_q,
                     group, p.seqlen, p.scale);
  const dim3 grid_q((p.seqlen + BwdTile<D>::kBlockM - 1) / BwdTile<D>::kBlockM, p.batch * p.heads_q);
  hipLaunchKernelGGL((flash_bwd_dq_kernel<T, D, kCausal>), grid_q, dim3(kThreads), 0, stream, q, k, v, dout, p.lse,
                     p.delta, static_cast<uint16_t*>(p.dq), p.heads_q, group, p.seqlen, p.scale);
  return static_cast<int>(hipGetLastError());
}

template <class T, int D>
static int dispatch_causal(const AttnParams& p, hipStream_t s) {
  return p.causal ? launch_bwd<T, D, true>(p, s) : launch_bwd<T, D, false>(p, s);
}

template <class T>
static int dispatch_dim(const AttnParams& p, hipStream_t s) {
  if (p.head_dim == 64) return dispatch_causal<T, 64>(p, s);
  if (p.head_dim == 128) return dispatch_causal<T, 128>(p, s);
  return -1;
}

int flash_attn_bwd(const AttnParams& p, void* stream) {
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return -1;
  if (p.seqlen == 0 || p.batch == 0) return 0;
  const auto s = static_cast<hipStream_t>(stream);
  return p.dtype == DType::kFloat16 ? dispatch_dim<Fp16>(p, s) : dispatch_dim<Bf16>(p, s);
}

}  // namespace mf_flash
