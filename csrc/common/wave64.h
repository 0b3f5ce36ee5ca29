// One kernel source, two compilers: the portability layer of every csrc/**/*.hip file.
//
// The kernels are written for AMD gfx90a, whose wavefront has 64 lanes: lane j owns key j of a 64-key
// tile, and row reductions are 64-lane shuffles. This header lets the same source compile unchanged
//  * with hipcc for AMD: it includes <hip/hip_runtime.h> and every helper below is the native wave-64
//    instruction sequence (the code generated is the same as with the helpers written inline);
//  * with nvcc for NVIDIA (no defines needed: the compiler is detected): it maps the few HIP runtime
//    names the kernels use to CUDA, and emulates a 64-lane wavefront with the two 32-lane warps of
//    threads [64w, 64w + 64) of the block. Lane ownership, tiles, LDS layout and masking then run
//    exactly as written for gfx90a; only the helpers here differ per platform.
//  * with a host C++ compiler and -DMF_GPU_EMULATE (tests only): cpu_emulation.h runs every GPU thread
//    as a fiber on the CPU and checks the synchronisation contracts below.
// Debian's HIP-for-NVIDIA headers (ROCm 5.2) are not used: they do not compile under CUDA 13.
//
// Contract of the wave-level helpers (wave_shfl_xor, wave_sum, wave_max), on both platforms:
//  * every one of the 64 lanes of the wave calls the helper, with the same lane_mask: on AMD an
//    inactive lane's shuffle source is undefined; on NVIDIA the two warps meet at a named barrier,
//    which deadlocks if a lane of the wave never arrives. Whole waves may skip a call (a wave-uniform
//    early return is fine), because each wave has a barrier of its own and the rest of the block is
//    not involved;
//  * blocks are made of whole waves (blockDim.x * blockDim.y * blockDim.z a multiple of 64) and, on
//    NVIDIA, hold at most kMaxWavesPerBlock of them (one named barrier and 256 bytes of shared memory
//    each).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(MF_GPU_EMULATE)  // tests only: a host compiler runs the kernels on the CPU (cpu_emulation.h)
#define MF_GPU_CUDA 0
#define MF_GPU_EMU 1
#elif defined(__NVCC__) || (defined(__CUDACC__) && !defined(__HIP__))
#define MF_GPU_CUDA 1
#define MF_GPU_EMU 0
#elif defined(__HIP__) || defined(__HIPCC__)
#define MF_GPU_CUDA 0
#define MF_GPU_EMU 0
#else
#error "csrc/common/wave64.h: compile the kernels with hipcc (AMD) or nvcc (NVIDIA)"
#endif

#if MF_GPU_EMU

#include "cpu_emulation.h"

#elif MF_GPU_CUDA

#include <cuda_fp16.h>
#include <cuda_runtime.h>

// The HIP runtime names the kernels' launch code uses, and nothing more.
using hipStream_t = cudaStream_t;
using hipError_t = cudaError_t;
inline hipError_t hipGetLastError() { return cudaGetLastError(); }
#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
  (kernel)<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)

#else

#include <hip/hip_runtime.h>

#endif

namespace mf_gpu {

constexpr int kWaveSize = 64;  // gfx90a wavefront; on NVIDIA, two warps

// ---- 16-bit float bit patterns. The kernels keep fp16 as raw uint16_t; nvcc has no _Float16. -------
__device__ __forceinline__ float half_bits_to_float(uint16_t b) {
#if MF_GPU_CUDA
  return __half2float(__ushort_as_half(b));
#else
  return static_cast<float>(__builtin_bit_cast(_Float16, b));
#endif
}

// Round to nearest even on both platforms.
__device__ __forceinline__ uint16_t float_to_half_bits(float f) {
#if MF_GPU_CUDA
  return __half_as_ushort(__float2half_rn(f));
#else
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#endif
}

// ---- 64-lane shuffle ----------------------------------------------------------------------------------
// MF_GPU_TWO_WARPS: a wave is two 32-lane warps (nvcc; or the CPU emulator's -DMF_GPU_EMULATE_TWO_WARPS,
// which runs this same composition over emulated warp shuffles and named barriers).
#if MF_GPU_CUDA || (MF_GPU_EMU && defined(MF_GPU_EMULATE_TWO_WARPS))
#define MF_GPU_TWO_WARPS 1
#else
#define MF_GPU_TWO_WARPS 0
#endif

#if MF_GPU_TWO_WARPS

// Named barriers 1..15 are free (0 is __syncthreads'): one per wave, so one wave never waits for another.
constexpr int kMaxWavesPerBlock = 8;
static_assert(kMaxWavesPerBlock <= 15, "CUDA has 16 named barriers and __syncthreads uses barrier 0");

// Warps are formed from the linear thread index, so a wave is 64 consecutive linear indices.
__device__ __forceinline__ unsigned linear_thread_index() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

#if MF_GPU_CUDA
__device__ __forceinline__ float warp_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Blocks until both warps of this wave arrive. barrier.sync (not bar.sync, which is .aligned) tolerates
// lanes of one warp arriving at different times, so a wave that diverged before the call (a ragged loop
// over columns) is still correct. The "memory" clobber keeps the shared-memory accesses on their side.
__device__ __forceinline__ void wave_barrier(unsigned wave) {
  asm volatile("barrier.sync %0, %1;" ::"r"(wave + 1u), "r"(kWaveSize) : "memory");
}
#else
__device__ __forceinline__ float warp_shfl_xor(float v, int lane_mask) { return mf_emu::warp_shfl_xor(v, lane_mask); }
__device__ __forceinline__ void wave_barrier(unsigned wave) { mf_emu::named_barrier(wave + 1u, kWaveSize); }
#endif

#endif

// The value of `v` held by lane (lane ^ lane_mask) of this wave, 0 < lane_mask < 64.
__device__ __forceinline__ float wave_shfl_xor(float v, int lane_mask) {
#if MF_GPU_TWO_WARPS
  // Partners in the same warp: a hardware shuffle (lane ^ m stays in the warp when m < 32, and a wave's
  // lane l is lane l % 32 of its warp because waves start at multiples of 64).
  if (lane_mask < 32) return warp_shfl_xor(v, lane_mask);
  // Partner in the other warp: swap through shared memory. The second barrier keeps the next call's
  // store from overwriting a value the other warp has not read yet.
  __shared__ float exchange[kMaxWavesPerBlock][kWaveSize];
  const unsigned t = linear_thread_index();
  const unsigned wave = t / kWaveSize, lane = t % kWaveSize;
  exchange[wave][lane] = v;
  wave_barrier(wave);
  const float other = exchange[wave][lane ^ static_cast<unsigned>(lane_mask)];
  wave_barrier(wave);
  return other;
#elif MF_GPU_EMU
  return mf_emu::wave_shfl_xor(v, lane_mask);
#else
  return __shfl_xor(v, lane_mask, kWaveSize);
#endif
}

// Butterfly reductions over the 64 lanes, in the same order on both platforms (mask 32 first), so
// every lane ends with the same bits and NVIDIA reproduces the AMD rounding of these sums.
__device__ __forceinline__ float wave_sum(float v) {
#pragma unroll
  for (int off = kWaveSize / 2; off > 0; off >>= 1) v += wave_shfl_xor(v, off);
  return v;
}

__device__ __forceinline__ float wave_max(float v) {
#pragma unroll
  for (int off = kWaveSize / 2; off > 0; off >>= 1) v = fmaxf(v, wave_shfl_xor(v, off));
  return v;
}

// ---- Block shared memory larger than CUDA's static limit ---------------------------------------------
// MF_BLOCK_SHARED(Type, name) declares the block's shared-memory struct `name`. On AMD it is an ordinary
// __shared__ object (LDS is 64 KB, all of it static). CUDA caps static shared memory at 48 KB per block,
// so there the struct lives in dynamic shared memory: launch with block_shared_bytes<Type>(kernel) bytes,
// which also raises the kernel's dynamic limit (0 on AMD, where nothing is dynamic).
#if MF_GPU_CUDA
#define MF_BLOCK_SHARED(Type, name)                                            \
  extern __shared__ __align__(16) unsigned char mf_gpu_dynamic_shared[];      \
  Type& name = *reinterpret_cast<Type*>(mf_gpu_dynamic_shared)
#else
#define MF_BLOCK_SHARED(Type, name) __shared__ Type name
#endif

template <class Shared, class Kernel>
inline size_t block_shared_bytes(Kernel* kernel) {
#if MF_GPU_CUDA
  // An error here (more than the device's opt-in maximum) is left for the launch's hipGetLastError.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sizeof(Shared)));
  return sizeof(Shared);
#else
  (void)kernel;
  return 0;
#endif
}

}  // namespace mf_gpu
