// Torch binding of the fused LayerNorm / RMSNorm HIP kernels over the last dim. Device-agnostic c10
// stream APIs only, so it needs no CUDA/HIP headers (and no hipify).
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "fused_norm.h"

namespace {

void* current_stream(const at::Tensor& t) {
  return c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()).native_handle();
}

mf_norm::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return mf_norm::DType::kFloat32;
    case at::kHalf: return mf_norm::DType::kFloat16;
    case at::kBFloat16: return mf_norm::DType::kBFloat16;
    default: TORCH_CHECK(false, "fused norm takes float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

mf_norm::NormParams make_params(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                                double eps, bool rms) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda(), "fused norm (HIP) needs GPU tensors");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, cols]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1), "weight must be [cols]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight dtype must equal x dtype");
  if (b) TORCH_CHECK(b->sizes() == w.sizes() && b->scalar_type() == x.scalar_type(), "bias must match weight");
  mf_norm::NormParams p;
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  p.dtype = dtype_of(x);
  return p;
}

// Returns (y, mean, rstd); mean is an empty tensor for RMSNorm.
std::vector<at::Tensor> fwd(at::Tensor x, at::Tensor w, std::optional<at::Tensor> b, double eps, bool rms) {
  x = x.contiguous();
  w = w.contiguous();
  if (b) b = b->contiguous();
  mf_norm::NormParams p = make_params(x, w, b, eps, rms);
  c10::DeviceGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rms ? 0 : x.size(0)}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.b = b ? b->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  const int err = mf_norm::norm_fwd(p, current_stream(x));
  TORCH_CHECK(err == 0, "norm_fwd failed with code ", err);
  return {y, mean, rstd};
}

// Returns (dx, dw, db); db is an empty tensor when has_bias is false.
std::vector<at::Tensor> bwd(at::Tensor dy, at::Tensor x, at::Tensor w, at::Tensor mean, at::Tensor rstd,
                            bool has_bias, bool rms) {
  dy = dy.contiguous();
  x = x.contiguous();
  w = w.contiguous();
  mf_norm::NormParams p = make_params(x, w, std::nullopt, 0.0, rms);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy must match x");
  c10::DeviceGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dw = at::empty_like(w);
  at::Tensor db = has_bias ? at::empty_like(w) : at::empty({0}, w.options());
  at::Tensor ws = at::empty({has_bias ? 2 : 1, mf_norm::norm_bwd_chunks(p.rows), p.cols}, x.options().dtype(at::kFloat));
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.dy = dy.data_ptr();
  p.dx = dx.data_ptr();
  p.dw = dw.data_ptr();
  p.db = has_bias ? db.data_ptr() : nullptr;
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.workspace = ws.data_ptr<float>();
  const int err = mf_norm::norm_bwd(p, current_stream(x));
  TORCH_CHECK(err == 0, "norm_bwd failed with code ", err);
  return {dx, dw, db};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused LayerNorm / RMSNorm for gfx90a: fwd -> (y, mean, rstd), bwd -> (dx, dw, db)";
  m.def("fwd", &fwd, "norm forward", py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("rms"));
  m.def("bwd", &bwd, "norm backward", py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("mean"),
        py::arg("rstd"), py::arg("has_bias"), py::arg("rms"));
}
