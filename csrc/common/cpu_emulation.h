// A CPU emulator for the csrc kernels, for tests only: `g++ -x c++ -DMF_GPU_EMULATE` compiles the *.hip
// files unchanged into host code whose launches run every GPU thread of a block as a cooperative fiber.
// Included by wave64.h; see tests/unit/kernels/test_hip_emulated.py.
//
// What it executes: the kernels' own indexing, masking, LDS layout, __syncthreads placement, fp16/bf16
// conversions and wave-64 reductions (as AMD defines them: a 64-lane xor shuffle). What it checks:
//  * synchronisation contracts: a __syncthreads or a wave helper that some live threads never reach (a
//    deadlock on hardware), a __syncthreads passed by only some lanes of a wave, and a wave helper called
//    with different lane masks or call counts within a wave (divergence) are reported as launch errors
//    through hipGetLastError. Threads that have exited do not hold a barrier, as on hardware;
//  * missing barriers: a block runs its threads one after the other between barriers, in increasing or
//    (set_reverse_order) decreasing thread order, so a read of shared memory that is not ordered after
//    its write by a barrier sees a stale value in at least one of the two orders.
// What it cannot check: anything about the real compilers' code generation, timing, LDS banks, or a wave
// executing in lockstep on hardware. One block runs at a time, so __shared__ objects are plain statics.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

using hipStream_t = void*;
using hipError_t = int;

namespace mf_emu {

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  dim3 tid;
  unsigned linear = 0;
  enum State { kRunnable, kBlockBarrier, kWaveBarrier, kWarpBarrier, kDone } state = kRunnable;
  long block_barriers = 0;  // calls so far: all threads of a block must agree at each release
  long wave_calls = 0;      // wave barriers (AMD shuffles or named barriers), and warp shuffles, so far
  long warp_calls = 0;
  int lane_mask = 0;   // of the shuffle in progress
  unsigned bar_id = 0; // named barrier in progress (two-warp mode)
};

struct Emulator {
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  ucontext_t scheduler;
  std::function<void()> body;
  dim3 block_idx, block_dim, grid_dim;
  bool reverse = false;
  std::string error;  // first failure of the last launches, cleared by hipGetLastError
  std::vector<std::vector<float>> exchange;  // [wave][64] for wave_shfl_xor and warp_shfl_xor
};

inline Emulator& emu() {
  static Emulator e;
  return e;
}

inline void fail(const std::string& msg) {
  if (emu().error.empty()) emu().error = msg;
}

inline void yield() { swapcontext(&emu().current->ctx, &emu().scheduler); }

inline void fiber_entry() {
  emu().body();
  emu().current->state = Fiber::kDone;
  yield();
}

// Releases the block barrier once every live thread has reached it; checks they agree on the call.
inline bool release_block_barrier() {
  Emulator& e = emu();
  size_t live = 0, waiting = 0;
  for (auto& f : e.fibers) {
    if (f.state != Fiber::kDone) ++live;
    if (f.state == Fiber::kBlockBarrier) ++waiting;
  }
  if (waiting == 0 || waiting != live) return false;
  long n = -1;
  for (auto& f : e.fibers) {
    if (f.state != Fiber::kBlockBarrier) continue;
    if (n >= 0 && f.block_barriers != n) fail("__syncthreads reached from different call counts (divergent barrier)");
    n = f.block_barriers;
    f.state = Fiber::kRunnable;
  }
  return true;
}

// Releases wave w's barrier once all its 64 lanes have reached it; checks they agree on the call.
inline bool release_wave_barrier(size_t w) {
  Emulator& e = emu();
  Fiber* lanes = &e.fibers[w * 64];
  for (size_t l = 0; l < 64; ++l)
    if (lanes[l].state != Fiber::kWaveBarrier) return false;
  for (size_t l = 0; l < 64; ++l) {
    if (lanes[l].wave_calls != lanes[0].wave_calls || lanes[l].lane_mask != lanes[0].lane_mask ||
        lanes[l].bar_id != lanes[0].bar_id)
      fail("a wave helper was called divergently (lanes disagree on the call or its lane mask)");
    lanes[l].state = Fiber::kRunnable;
  }
  return true;
}

// Two-warp mode: releases the shuffle of warp h (0, 1) of wave w once its 32 lanes have reached it.
inline bool release_warp_barrier(size_t w, size_t h) {
  Emulator& e = emu();
  Fiber* lanes = &e.fibers[w * 64 + h * 32];
  for (size_t l = 0; l < 32; ++l)
    if (lanes[l].state != Fiber::kWarpBarrier) return false;
  for (size_t l = 0; l < 32; ++l) {
    if (lanes[l].warp_calls != lanes[0].warp_calls || lanes[l].lane_mask != lanes[0].lane_mask)
      fail("a warp shuffle was called divergently (lanes disagree on the call or its lane mask)");
    lanes[l].state = Fiber::kRunnable;
  }
  return true;
}

// Runs one block. Waves are scheduled one at a time, each as far as it can go (through its own wave
// barriers) before the next starts, so waves are maximally out of step, as nothing but __syncthreads
// orders them on hardware; likewise the two 32-lane halves of a wave (warps, in two-warp mode) between
// wave barriers; lanes run one after the other between barriers.
inline void run_block() {
  Emulator& e = emu();
  const size_t waves = e.fibers.size() / 64;
  for (;;) {
    bool progress = false, all_done = true;
    for (size_t k = 0; k < waves; ++k) {
      const size_t w = e.reverse ? waves - 1 - k : k;
      for (;;) {
        bool moved = false;
        for (size_t k2 = 0; k2 < 2; ++k2) {
          const size_t h = e.reverse ? 1 - k2 : k2;
          for (;;) {  // this half as far as it goes
            bool ran = false;
            for (size_t j = 0; j < 32; ++j) {
              Fiber& f = e.fibers[w * 64 + h * 32 + (e.reverse ? 31 - j : j)];
              if (f.state != Fiber::kRunnable) continue;
              e.current = &f;
              swapcontext(&e.scheduler, &f.ctx);  // runs f up to its next barrier or its end
              ran = true;
            }
            const bool released = release_warp_barrier(w, h);
            moved = moved || ran || released;
            if (!ran && !released) break;
          }
        }
        const bool released = release_wave_barrier(w);
        moved = moved || released;
        progress = progress || moved;
        if (!moved) break;
      }
      for (size_t l = 0; l < 64; ++l) all_done = all_done && e.fibers[w * 64 + l].state == Fiber::kDone;
    }
    if (all_done) {
      // Both platforms need __syncthreads in wave-uniform control flow (AMD executes s_barrier once per wave
      // whatever its lanes do; NVIDIA counts warps): lanes of one wave must have passed the same number.
      for (size_t w = 0; w < waves; ++w)
        for (size_t l = 1; l < 64; ++l)
          if (e.fibers[w * 64 + l].block_barriers != e.fibers[w * 64].block_barriers)
            fail("__syncthreads reached by only some lanes of a wave (divergent barrier)");
      return;
    }
    if (release_block_barrier()) continue;
    if (!progress) {
      fail("deadlock: threads wait at a barrier that other threads of the block or wave never reach");
      return;  // the fibers are abandoned; their stacks are reused by the next block
    }
  }
}

constexpr size_t kStackBytes = 64 * 1024;  // the kernels keep a few hundred bytes of registers per thread

inline void launch(dim3 grid, dim3 block, std::function<void()> body) {
  Emulator& e = emu();
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads % 64 != 0) {
    fail("block size must be a non-zero multiple of the 64-lane wave");
    return;
  }
  e.body = std::move(body);
  e.grid_dim = grid;
  e.block_dim = block;
  e.fibers.resize(threads);
  e.exchange.assign(threads / 64, std::vector<float>(64, 0.f));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        e.block_idx = dim3(bx, by, bz);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = e.fibers[t];
          if (f.stack.size() < kStackBytes) f.stack.resize(kStackBytes);  // allocated once, reused by every block
          f.state = Fiber::kRunnable;
          f.block_barriers = f.wave_calls = f.warp_calls = 0;
          f.lane_mask = 0;
          f.bar_id = 0;
          f.linear = t;
          f.tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        run_block();
        if (!e.error.empty()) return;
      }
}

inline void block_barrier() {
  Fiber& f = *emu().current;
  ++f.block_barriers;
  f.state = Fiber::kBlockBarrier;
  yield();
}

inline void wave_barrier(int lane_mask) {
  Fiber& f = *emu().current;
  f.lane_mask = lane_mask;
  f.state = Fiber::kWaveBarrier;
  yield();
}

// Two-warp mode: CUDA's barrier.sync id, count, as wave64.h uses it: the 64 threads of one wave, id 1 + wave.
inline void named_barrier(unsigned id, unsigned count) {
  Fiber& f = *emu().current;
  if (count != 64 || id != f.linear / 64 + 1) fail("named barrier: expected id 1 + wave over 64 threads");
  ++f.wave_calls;
  f.bar_id = id;
  f.lane_mask = 0;
  f.state = Fiber::kWaveBarrier;
  yield();
}

// Two-warp mode: __shfl_xor_sync(full mask, v, lane_mask) within a 32-lane warp.
inline float warp_shfl_xor(float v, int lane_mask) {
  Fiber& f = *emu().current;
  if (lane_mask <= 0 || lane_mask >= 32) fail("warp shuffle: lane mask outside the 32-lane warp");
  ++f.warp_calls;
  const unsigned wave = f.linear / 64, lane = f.linear % 64;
  auto& x = emu().exchange[wave];
  x[lane] = v;
  f.lane_mask = lane_mask;
  f.state = Fiber::kWarpBarrier;
  yield();
  const float other = x[lane ^ static_cast<unsigned>(lane_mask & 31)];
  f.state = Fiber::kWarpBarrier;  // the partner reads this lane's slot before it is reused
  yield();
  return other;
}

// AMD's semantics: lane l receives lane (l ^ lane_mask)'s value; every lane of the wave must take part.
inline float wave_shfl_xor(float v, int lane_mask) {
  Fiber& f = *emu().current;
  ++f.wave_calls;
  const unsigned wave = f.linear / 64, lane = f.linear % 64;
  auto& x = emu().exchange[wave];
  x[lane] = v;
  wave_barrier(lane_mask);
  const float other = x[lane ^ static_cast<unsigned>(lane_mask)];
  wave_barrier(lane_mask);
  return other;
}

inline void set_reverse_order(bool reverse) { emu().reverse = reverse; }

}  // namespace mf_emu

#define threadIdx (mf_emu::emu().current->tid)
#define blockIdx (mf_emu::emu().block_idx)
#define blockDim (mf_emu::emu().block_dim)
#define gridDim (mf_emu::emu().grid_dim)

inline void __syncthreads() { mf_emu::block_barrier(); }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }

inline hipError_t hipGetLastError() {
  if (mf_emu::emu().error.empty()) return 0;
  std::fprintf(stderr, "mf_emu: %s\n", mf_emu::emu().error.c_str());
  mf_emu::emu().error.clear();
  return 1;
}

// The kernel runs once per thread; arguments are captured by value, as a launch copies them.
#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
  ((void)(shared_bytes), (void)(stream), mf_emu::launch(dim3(grid), dim3(block), [=]() { (kernel)(__VA_ARGS__); }))
