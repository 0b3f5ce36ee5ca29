// Host-side launch interface of the fused LayerNorm / RMSNorm kernels. Plain C++ types only, shared by
// the torch binding (fused_norm.cpp) and the device code (fused_norm.hip).
#pragma once

#include <cstdint>

namespace mf_norm {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// x, y, dy, dx: contiguous [rows, cols]; w, b, dw, db: [cols] in the same dtype as x.
// mean, rstd: [rows] fp32 (mean is unused for RMSNorm). workspace: fp32 [2, norm_bwd_chunks(rows), cols].
struct NormParams {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* b = nullptr;  // null: no bias (RMSNorm, or LayerNorm without beta)
  void* y = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  const void* dy = nullptr;
  void* dx = nullptr;
  void* dw = nullptr;
  void* db = nullptr;  // null: no beta gradient
  float* workspace = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  float eps = 1e-5f;
  bool rms = false;
  DType dtype = DType::kBFloat16;
};

// Number of row chunks the gamma/beta gradient is first reduced into (the workspace's middle dim).
int64_t norm_bwd_chunks(int64_t rows);

// Return 0 on success, else the hipError_t of the failing launch.
int norm_fwd(const NormParams& p, void* stream);
int norm_bwd(const NormParams& p, void* stream);

}  // namespace mf_norm
