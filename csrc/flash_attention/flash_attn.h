// Host-side launch interface of the flash-attention kernels. Plain C++ types only, so the torch binding
// (flash_attn.cpp) and the device code (*.hip) share it without either including the other's headers.
#pragma once

#include <cstdint>

namespace mf_flash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// All tensors are contiguous: q, o, dout, dq [b, nq, s, d]; k, v, dk, dv [b, nkv, s, d];
// lse and delta [b, nq, s] in fp32. nq % nkv == 0; query head h reads kv head h / (nq / nkv).
struct AttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // natural-log log-sum-exp of each score row, saved by forward for backward
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* delta = nullptr;  // rowsum(dout * o): workspace of the backward pass
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int seqlen = 0;
  int head_dim = 0;  // 64 or 128
  float scale = 1.0f;
  bool causal = false;
  DType dtype = DType::kBFloat16;
};

// Return 0 on success, -1 for an unsupported head_dim/dtype, else the hipError_t of the launch.
int flash_attn_fwd(const AttnParams& p, void* stream);
int flash_attn_bwd(const AttnParams& p, void* stream);

}  // namespace mf_flash
