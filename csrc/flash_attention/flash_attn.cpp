// Torch binding of the HIP flash-attention kernels: checks inputs, allocates outputs, forwards raw
// pointers. Uses only device-agnostic c10 stream APIs, so it needs no CUDA/HIP headers (and no hipify).
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <vector>

#include "flash_attn.h"

namespace {

void* current_stream(const at::Tensor& t) {
  return c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()).native_handle();
}

mf_flash::DType dtype_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "flash attention (HIP) takes float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? mf_flash::DType::kFloat16 : mf_flash::DType::kBFloat16;
}

mf_flash::AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                 double scale) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash attention (HIP) needs GPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [b, heads, s, d]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "q and k must share batch, sequence length and head dim");
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "head dim must be 64 or 128, got ", q.size(3));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "query heads must be a multiple of kv heads");
  mf_flash::AttnParams p;
  p.batch = static_cast<int>(q.size(0));
  p.heads_q = static_cast<int>(q.size(1));
  p.heads_kv = static_cast<int>(k.size(1));
  p.seqlen = static_cast<int>(q.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = dtype_of(q);
  return p;
}

std::vector<at::Tensor> fwd(at::Tensor q, at::Tensor k, at::Tensor v, bool causal, double scale) {
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  mf_flash::AttnParams p = make_params(q, k, v, causal, scale);
  c10::DeviceGuard guard(q.device());
  at::Tensor o = at::empty_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  const int err = mf_flash::flash_attn_fwd(p, current_stream(q));
  TORCH_CHECK(err == 0, "flash_attn_fwd failed with code ", err);
  return {o, lse};
}

std::vector<at::Tensor> bwd(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor o, at::Tensor lse,
                            bool causal, double scale) {
  dout = dout.contiguous();
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  o = o.contiguous();
  lse = lse.contiguous();
  mf_flash::AttnParams p = make_params(q, k, v, causal, scale);
  TORCH_CHECK(dout.sizes() == q.sizes() && o.sizes() == q.sizes(), "dout and o must have q's shape");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "lse must be float32");
  c10::DeviceGuard guard(q.device());
  at::Tensor dq = at::empty_like(q);
  at::Tensor dk = at::empty_like(k);
  at::Tensor dv = at::empty_like(v);
  at::Tensor delta = at::empty_like(lse);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.delta = delta.data_ptr<float>();
  const int err = mf_flash::flash_attn_bwd(p, current_stream(q));
  TORCH_CHECK(err == 0, "flash_attn_bwd failed with code ", err);
  return {dq, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Flash attention for gfx90a (wavefront 64): forward returns (o, lse), backward (dq, dk, dv)";
  m.def("fwd", &fwd, "flash attention forward", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"),
        py::arg("scale"));
  m.def("bwd", &bwd, "flash attention backward", py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("o"), py::arg("lse"), py::arg("causal"), py::arg("scale"));
}
