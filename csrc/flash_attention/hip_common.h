// Device helpers shared by the flash-attention kernels: 16-bit storage types and wavefront-64 reductions.
// 16-bit values travel as raw uint16_t so LDS arrays stay trivially constructible on every ROCm version.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>

namespace mf_flash {

constexpr int kWave = 64;  // gfx90a wavefront size: every reduction below spans 64 lanes, not 32

struct Fp16 {
  using Storage = uint16_t;
  __device__ static inline float load(uint16_t b) { return static_cast<float>(__builtin_bit_cast(_Float16, b)); }
  __device__ static inline uint16_t store(float f) { return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f)); }
};

struct Bf16 {
  using Storage = uint16_t;
  __device__ static inline float load(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  // Round to nearest even, as torch does; NaN stays a quiet NaN instead of rounding into infinity.
  __device__ static inline uint16_t store(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

__device__ inline float wave_sum(float v) {
#pragma unroll
  for (int off = kWave / 2; off > 0; off >>= 1) v += __shfl_xor(v, off, kWave);
  return v;
}

__device__ inline float wave_max(float v) {
#pragma unroll
  for (int off = kWave / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor(v, off, kWave));
  return v;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ inline float neg_inf() { return -__builtin_huge_valf(); }

}  // namespace mf_flash
