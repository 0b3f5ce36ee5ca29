// Fused LayerNorm / RMSNorm forward and backward for gfx90a. One wavefront (64 lanes) per row, statistics
// in fp32 (Welford for the variance), per-row mean and rstd saved for the backward pass. The gamma/beta
// gradients are reduced across rows in two deterministic stages (row chunks, then chunks), no atomics.
// No torch headers: see fused_norm.cpp for the binding.
#include <cstdint>

#include "../common/wave64.h"  // the HIP runtime on AMD, its CUDA equivalents and a 64-lane wave on nvcc
#include "fused_norm.h"

namespace mf_norm {

constexpr int kWave = mf_gpu::kWaveSize;  // gfx90a wavefront size
constexpr int kWaves = 4;
constexpr int kThreads = kWave * kWaves;
constexpr int64_t kMaxChunks = 256;  // first-stage row chunks of the gamma/beta reduction

struct F32 {
  using Storage = float;
  __device__ static inline float load(float v) { return v; }
  __device__ static inline float store(float f) { return f; }
};

struct F16 {
  using Storage = uint16_t;
  __device__ static inline float load(uint16_t b) { return mf_gpu::half_bits_to_float(b); }
  __device__ static inline uint16_t store(float f) { return mf_gpu::float_to_half_bits(f); }
};

struct BF16 {
  using Storage = uint16_t;
  __device__ static inline float load(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ static inline uint16_t store(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

using mf_gpu::wave_sum;

// Chan et al.'s pairwise merge of (count, mean, M2) across the 64 lanes: numerically safe for rows
// whose mean is large compared with their spread, where sum(x^2) - n mean^2 would cancel.
__device__ inline void wave_welford(float& n, float& mean, float& m2) {
#pragma unroll
  for (int off = kWave / 2; off > 0; off >>= 1) {
    const float n_b = mf_gpu::wave_shfl_xor(n, off);
    const float mean_b = mf_gpu::wave_shfl_xor(mean, off);
    const float m2_b = mf_gpu::wave_shfl_xor(m2, off);
    const float n_ab = n + n_b;
    if (n_ab > 0.f) {
      const float d = mean_b - mean;
      mean += d * (n_b / n_ab);
      m2 += m2_b + d * d * (n * n_b / n_ab);
    }
    n = n_ab;
  }
}

template <class T, bool kRms>
__global__ __launch_bounds__(kThreads) void norm_fwd_kernel(const typename T::Storage* __restrict__ x,
                                                            const typename T::Storage* __restrict__ w,
                                                            const typename T::Storage* __restrict__ b,
                                                            typename T::Storage* __restrict__ y,
                                                            float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                            int64_t rows, int64_t cols, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWaves + threadIdx.x / kWave;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWave;
  const auto* xr = x + row * cols;

  float mean = 0.f, var;
  if (kRms) {
    float ss = 0.f;
    for (int64_t c = lane; c < cols; c += kWave) {
      const float v = T::load(xr[c]);
      ss += v * v;
    }
    var = wave_sum(ss) / static_cast<float>(cols);
  } else {
    float n = 0.f, m2 = 0.f;
    for (int64_t c = lane; c < cols; c += kWave) {
      const float v = T::load(xr[c]);
      n += 1.f;
      const float d = v - mean;
      mean += d / n;
      m2 += d * (v - mean);
    }
    wave_welford(n, mean, m2);
    var = m2 / static_cast<float>(cols);
  }
  const float rstd = rsqrtf(var + eps);
  if (lane == 0) {
    if (!kRms) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  // Second read of the row: at Megatron hidden sizes it is still in L2 from the statistics pass.
  auto* yr = y + row * cols;
  for (int64_t c = lane; c < cols; c += kWave) {
    float v = (T::load(xr[c]) - mean) * rstd * T::load(w[c]);
    if (b != nullptr) v += T::load(b[c]);
    yr[c] = T::store(v);
  }
}

// dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)); RMSNorm drops the mean(w*dy) term.
template <class T, bool kRms>
__global__ __launch_bounds__(kThreads) void norm_bwd_dx_kernel(const typename T::Storage* __restrict__ dy,
                                                               const typename T::Storage* __restrict__ x,
                                                               const typename T::Storage* __restrict__ w,
                                                               const float* __restrict__ mean_in,
                                                               const float* __restrict__ rstd_in,
                                                               typename T::Storage* __restrict__ dx, int64_t rows,
                                                               int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWaves + threadIdx.x / kWave;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWave;
  const auto* xr = x + row * cols;
  const auto* dyr = dy + row * cols;
  const float mean = kRms ? 0.f : mean_in[row];
  const float rstd = rstd_in[row];

  float sum_wdy = 0.f, sum_wdy_xhat = 0.f;
  for (int64_t c = lane; c < cols; c += kWave) {
    const float wdy = T::load(w[c]) * T::load(dyr[c]);
    sum_wdy += wdy;
    sum_wdy_xhat += wdy * (T::load(xr[c]) - mean) * rstd;
  }
  const float inv_n = 1.f / static_cast<float>(cols);
  const float c1 = wave_sum(sum_wdy_xhat) * inv_n;
  const float c2 = kRms ? 0.f : wave_sum(sum_wdy) * inv_n;

  auto* dxr = dx + row * cols;
  for (int64_t c = lane; c < cols; c += kWave) {
    const float xhat = (T::load(xr[c]) - mean) * rstd;
    const float wdy = T::load(w[c]) * T::load(dyr[c]);
    dxr[c] = T::store((wdy - xhat * c1 - c2) * rstd);
  }
}

// Stage 1 of dgamma = sum_rows dy * xhat (and dbeta = sum_rows dy): block (column tile, row chunk);
// lane = column so global reads are coalesced, the 4 wavefronts stride the chunk's rows and meet in LDS.
template <class T, bool kRms>
__global__ __launch_bounds__(kThreads) void norm_bwd_partial_kernel(const typename T::Storage* __restrict__ dy,
                                                                    const typename T::Storage* __restrict__ x,
                                                                    const float* __restrict__ mean_in,
                                                                    const float* __restrict__ rstd_in,
                                                                    float* __restrict__ part_w,
                                                                    float* __restrict__ part_b, int64_t rows,
                                                                    int64_t cols, int64_t rows_per_chunk) {
  __shared__ float red_w[kWaves][kWave];
  __shared__ float red_b[kWaves][kWave];
  const int lane = threadIdx.x % kWave, wave = threadIdx.x / kWave;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWave + lane;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;

  float acc_w = 0.f, acc_b = 0.f;
  if (col < cols) {
    for (int64_t r = r0 + wave; r < r1; r += kWaves) {
      const float g = T::load(dy[r * cols + col]);
      const float mean = kRms ? 0.f : mean_in[r];
      acc_w += g * (T::load(x[r * cols + col]) - mean) * rstd_in[r];
      acc_b += g;
    }
  }
  red_w[wave][lane] = acc_w;
  red_b[wave][lane] = acc_b;
  __syncthreads();
  if (wave == 0 && col < cols) {
    float sw = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < kWaves; ++i) {
      sw += red_w[i][lane];
      sb += red_b[i][lane];
    }
    part_w[chunk * cols + col] = sw;
    if (part_b != nullptr) part_b[chunk * cols + col] = sb;
  }
}

// Stage 2: sum the chunk partials of each column in a fixed order and store in the parameter dtype.
template <class T>
__global__ __launch_bounds__(kThreads) void norm_bwd_final_kernel(const float* __restrict__ part, int64_t chunks,
                                                                  int64_t cols, typename T::Storage* __restrict__ out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= cols) return;
  float s = 0.f;
  for (int64_t i = 0; i < chunks; ++i) s += part[i * cols + col];
  out[col] = T::store(s);
}

int64_t norm_bwd_chunks(int64_t rows) { return rows < kMaxChunks ? (rows > 0 ? rows : 1) : kMaxChunks; }

template <class T, bool kRms>
static int fwd(const NormParams& p, hipStream_t s) {
  using S = typename T::Storage;
  const dim3 grid(static_cast<unsigned>((p.rows + kWaves - 1) / kWaves));
  hipLaunchKernelGGL((norm_fwd_kernel<T, kRms>), grid, dim3(kThreads), 0, s, static_cast<const S*>(p.x),
                     static_cast<const S*>(p.w), static_cast<const S*>(p.b), static_cast<S*>(p.y), p.mean, p.rstd,
                     p.rows, p.cols, p.eps);
  return static_cast<int>(hipGetLastError());
}

template <class T, bool kRms>
static int bwd(const NormParams& p, hipStream_t s) {
  using S = typename T::Storage;
  const auto* dy = static_cast<const S*>(p.dy);
  const auto* x = static_cast<const S*>(p.x);
  const dim3 grid_rows(static_cast<unsigned>((p.rows + kWaves - 1) / kWaves));
  hipLaunchKernelGGL((norm_bwd_dx_kernel<T, kRms>), grid_rows, dim3(kThreads), 0, s, dy, x,
                     static_cast<const S*>(p.w), p.mean, p.rstd, static_cast<S*>(p.dx), p.rows, p.cols);

  const int64_t chunks = norm_bwd_chunks(p.rows);
  const int64_t rows_per_chunk = (p.rows + chunks - 1) / chunks;
  float* part_w = p.workspace;
  float* part_b = p.db != nullptr ? p.workspace + chunks * p.cols : nullptr;
  const dim3 grid_part(static_cast<unsigned>((p.cols + kWave - 1) / kWave), static_cast<unsigned>(chunks));
  hipLaunchKernelGGL((norm_bwd_partial_kernel<T, kRms>), grid_part, dim3(kThreads), 0, s, dy, x, p.mean, p.rstd,
                     part_w, part_b, p.rows, p.cols, rows_per_chunk);

  const dim3 grid_cols(static_cast<unsigned>((p.cols + kThreads - 1) / kThreads));
  hipLaunchKernelGGL((norm_bwd_final_kernel<T>), grid_cols, dim3(kThreads), 0, s, part_w, chunks, p.cols,
                     static_cast<S*>(p.dw));
  if (part_b != nullptr)
    hipLaunchKernelGGL((norm_bwd_final_kernel<T>), grid_cols, dim3(kThreads), 0, s, part_b, chunks, p.cols,
                       static_cast<S*>(p.db));
  return static_cast<int>(hipGetLastError());
}

template <class T>
static int dispatch(const NormParams& p, hipStream_t s, bool backward) {
  if (backward) return p.rms ? bwd<T, true>(p, s) : bwd<T, false>(p, s);
  return p.rms ? fwd<T, true>(p, s) : fwd<T, false>(p, s);
}

static int dispatch_dtype(const NormParams& p, void* stream, bool backward) {
  if (p.rows == 0 || p.cols == 0) return 0;
  const auto s = static_cast<hipStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return dispatch<F32>(p, s, backward);
    case DType::kFloat16: return dispatch<F16>(p, s, backward);
    case DType::kBFloat16: return dispatch<BF16>(p, s, backward);
  }
  return -1;
}

int norm_fwd(const NormParams& p, void* stream) { return dispatch_dtype(p, stream, false); }
int norm_bwd(const NormParams& p, void* stream) { return dispatch_dtype(p, stream, true); }

}  // namespace mf_norm
