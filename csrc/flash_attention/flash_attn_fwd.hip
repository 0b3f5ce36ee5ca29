// Flash-attention forward for gfx90a (MI250X GCD): online softmax over 64-key tiles held in LDS,
// fp32 accumulation, log-sum-exp saved for the backward pass. No torch headers: see flash_attn.cpp.
//
// Work split (one block = 4 wavefronts = 256 threads, one (batch, query head, query tile) per block):
//  * scores: lane j of a wavefront owns key j of the 64-key tile, so each score row's max and sum
//    are a single wavefront-64 shuffle reduction, with no LDS round trip;
//  * P V: lane l owns output columns l, l + 64 (head dim 64 or 128), reading P from LDS as a broadcast.
#include "flash_attn.h"
#include "flash_attn_tiles.h"
#include "hip_common.h"

namespace mf_flash {

template <class T, int D, bool kCausal>
__global__ __launch_bounds__(kThreads) void flash_fwd_kernel(const uint16_t* __restrict__ q,
                                                             const uint16_t* __restrict__ k,
                                                             const uint16_t* __restrict__ v, uint16_t* __restrict__ o,
                                                             float* __restrict__ lse, int heads_q, int group,
                                                             int seqlen, float scale_log2) {
  using Tile = FwdTile<D>;
  constexpr int R = Tile::kRowsPerWave;
  constexpr int BM = Tile::kBlockM;
  constexpr int C = D / kWave;  // output columns per lane
  constexpr int KP = D + 2;     // pad K rows by 4 bytes: lane j reads row j, 64 rows then hit 64 distinct banks

  __shared__ uint16_t q_s[BM][D];
  __shared__ uint16_t kv_s[kBlockN][KP];  // K tile, then the V tile of the same keys
  __shared__ float p_s[BM][kBlockN];     // fp32 probabilities: keeps fp32 accuracy in the P V product

  const int tid = threadIdx.x;
  const int lane = tid % kWave;
  const int wave = tid / kWave;
  const int bh = blockIdx.y;  // b * heads_q + h
  const int b = bh / heads_q;
  const int h = bh % heads_q;
  const int heads_kv = heads_q / group;
  const int m0 = blockIdx.x * BM;

  const uint16_t* qh = q + static_cast<size_t>(bh) * seqlen * D;
  const size_t kv_off = static_cast<size_t>(b * heads_kv + h / group) * seqlen * D;
  const uint16_t* kh = k + kv_off;
  const uint16_t* vh = v + kv_off;

  for (int i = tid; i < BM * D; i += kThreads) {
    const int r = i / D, c = i % D;
    q_s[r][c] = (m0 + r < seqlen) ? qh[static_cast<size_t>(m0 + r) * D + c] : uint16_t{0};
  }

  float m_i[R], l_i[R], acc[R][C];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m_i[r] = neg_inf();
    l_i[r] = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
  }

  // Causal: key tiles wholly above the diagonal of this query tile contribute nothing; skip them.
  const int n_end = kCausal ? min(seqlen, m0 + BM) : seqlen;
  for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
    __syncthreads();  // the previous V tile (and, first time, q_s) is complete / consumed
    for (int i = tid; i < kBlockN * D; i += kThreads) {
      const int r = i / D, c = i % D;
      kv_s[r][c] = (n0 + r < seqlen) ? kh[static_cast<size_t>(n0 + r) * D + c] : uint16_t{0};
    }
    __syncthreads();

    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row_l = wave * R + r;
      float dot = 0.f;
#pragma unroll 8
      for (int c = 0; c < D; ++c) dot += T::load(q_s[row_l][c]) * T::load(kv_s[lane][c]);
      const bool visible = key < seqlen && (!kCausal || key <= m0 + row_l);
      const float s = visible ? dot * scale_log2 : neg_inf();

      const float m_new = fmaxf(m_i[r], wave_max(s));
      // A row with no visible key yet (only padding rows past seqlen) keeps a finite reference,
      // so exp2 never sees (-inf) - (-inf).
      const float m_ref = m_new == neg_inf() ? 0.f : m_new;
      const float p = exp2f(s - m_ref);
      const float alpha = exp2f(m_i[r] - m_ref);
      l_i[r] = l_i[r] * alpha + wave_sum(p);
      m_i[r] = m_new;
      p_s[row_l][lane] = p;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] *= alpha;
    }
    __syncthreads();  // every wavefront is done with K before V overwrites it
    for (int i = tid; i < kBlockN * D; i += kThreads) {
      const int r = i / D, c = i % D;
      kv_s[r][c] = (n0 + r < seqlen) ? vh[static_cast<size_t>(n0 + r) * D + c] : uint16_t{0};
    }
    __syncthreads();

    for (int j = 0; j < kBlockN; ++j) {
      float vj[C];
#pragma unroll
      for (int c = 0; c < C; ++c) vj[c] = T::load(kv_s[j][lane + kWave * c]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = p_s[wave * R + r][j];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] += p * vj[c];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = m0 + wave * R + r;
    if (row >= seqlen) continue;
    // Every real row sees key 0, so l_i > 0 here.
    const float inv_l = 1.f / l_i[r];
    uint16_t* orow = o + (static_cast<size_t>(bh) * seqlen + row) * D;
#pragma unroll
    for (int c = 0; c < C; ++c) orow[lane + kWave * c] = T::store(acc[r][c] * inv_l);
    if (lane == 0) lse[static_cast<size_t>(bh) * seqlen + row] = (m_i[r] + log2f(l_i[r])) * kLn2;
  }
}

template <class T, int D, bool kCausal>
static int launch_fwd(const AttnParams& p, hipStream_t stream) {
  const dim3 grid((p.seqlen + FwdTile<D>::kBlockM - 1) / FwdTile<D>::kBlockM, p.batch * p.heads_q);
  hipLaunchKernelGGL((flash_fwd_kernel<T, D, kCausal>), grid, dim3(kThreads), 0, stream,
                     static_cast<const uint16_t*>(p.q), static_cast<const uint16_t*>(p.k),
                     static_cast<const uint16_t*>(p.v), static_cast<uint16_t*>(p.o), p.lse, p.heads_q,
                     p.heads_q / p.heads_kv, p.seqlen, p.scale * kLog2e);
  return static_cast<int>(hipGetLastError());
}

template <class T, int D>
static int dispatch_causal(const AttnParams& p, hipStream_t s) {
  return p.causal ? launch_fwd<T, D, true>(p, s) : launch_fwd<T, D, false>(p, s);
}

template <class T>
static int dispatch_dim(const AttnParams& p, hipStream_t s) {
  if (p.head_dim == 64) return dispatch_causal<T, 64>(p, s);
  if (p.head_dim == 128) return dispatch_causal<T, 128>(p, s);
  return -1;
}

int flash_attn_fwd(const AttnParams& p, void* stream) {
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return -1;
  if (p.seqlen == 0 || p.batch == 0) return 0;
  const auto s = static_cast<hipStream_t>(stream);
  return p.dtype == DType::kFloat16 ? dispatch_dim<Fp16>(p, s) : dispatch_dim<Bf16>(p, s);
}

}  // namespace mf_flash
