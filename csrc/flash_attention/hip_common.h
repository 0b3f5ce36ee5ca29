// Device helpers shared by the flash-attention kernels: 16-bit storage types and wavefront-64 reductions.
// 16-bit values travel as raw uint16_t so LDS arrays stay trivially constructible on every ROCm version.
// The runtime and the wave-64 helpers come from ../common/wave64.h, which also makes this compile with nvcc.
#pragma once

#include <cstdint>

#include "../common/wave64.h"

namespace mf_flash {

constexpr int kWave = mf_gpu::kWaveSize;  // gfx90a wavefront: every reduction spans 64 lanes, not 32
using mf_gpu::wave_max;
using mf_gpu::wave_sum;

struct Fp16 {
  using Storage = uint16_t;
  __device__ static inline float load(uint16_t b) { return mf_gpu::half_bits_to_float(b); }
  __device__ static inline uint16_t store(float f) { return mf_gpu::float_to_half_bits(f); }
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

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ inline float neg_inf() { return -__builtin_huge_valf(); }

}  // namespace mf_flash
