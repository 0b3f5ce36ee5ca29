// Index builders for megatron/data (pybind11 module megatron.data._helpers).
//
// They are sequential loops over every document or sample of a run (billions for a large corpus), too slow in
// Python; megatron/data/reference.py holds the numpy reference the unit tests compare them against.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

// sample_idx[i] = (position in doc_idx, token offset in that document) where sample i starts. Sample i spans
// seq_length + 1 tokens and ends on the first token of sample i + 1, so inputs and shifted labels both fit.
// Arithmetic is int64 throughout; T is only the storage type (int32 halves the cache when it is enough).
template <typename T>
py::array_t<T> build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style>& sizes_,
                                     const py::array_t<int64_t, py::array::c_style>& doc_idx_,
                                     int64_t seq_length, int64_t num_samples) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  if (num_samples < 0) throw std::invalid_argument("num_samples must be non-negative");
  auto sizes = sizes_.unchecked<1>();
  auto doc_idx = doc_idx_.unchecked<1>();
  const int64_t num_docs = doc_idx.shape(0);

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  auto out = result.template mutable_unchecked<2>();
  {
    py::gil_scoped_release release;
    int64_t doc_pos = 0;     // index into doc_idx
    int64_t doc_offset = 0;  // tokens of the current document already consumed
    out(0, 0) = 0;
    out(0, 1) = 0;
    for (int64_t s = 1; s <= num_samples; ++s) {
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_pos >= num_docs) {
          // Safe without the GIL: pybind11 converts the exception after the release guard has re-acquired it.
          throw std::out_of_range("doc_idx holds fewer tokens than num_samples * seq_length + 1");
        }
        const int64_t left = static_cast<int64_t>(sizes(doc_idx(doc_pos))) - doc_offset;
        remaining -= left;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts on its last token (the overlap).
          doc_offset += remaining + left - 1;
          remaining = 0;
        } else {
          ++doc_pos;
          doc_offset = 0;
        }
      }
      out(s, 0) = static_cast<T>(doc_pos);
      out(s, 1) = static_cast<T>(doc_offset);
    }
  }
  return result;
}

// Greedy interleaving: sample i goes to the dataset furthest behind its weighted share of max(i, 1) samples (the
// first dataset on a tie), which keeps every prefix of the blend within one sample of the target proportions and is
// deterministic (no RNG). max(i, 1), not i + 1, is upstream Megatron's arithmetic: the same flags must give the
// same blend there and here.
py::tuple build_blending_indices(const py::array_t<double, py::array::c_style>& weights_, int64_t size) {
  auto weights = weights_.unchecked<1>();
  const int64_t n = weights.shape(0);
  if (n <= 0 || n > std::numeric_limits<int16_t>::max())
    throw std::invalid_argument("need between 1 and 32767 datasets to blend");
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  auto di = dataset_index.mutable_unchecked<1>();
  auto dsi = dataset_sample_index.mutable_unchecked<1>();
  std::vector<int64_t> taken(n, 0);
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < size; ++i) {
      const double seen = i > 1 ? static_cast<double>(i) : 1.0;
      int64_t best = 0;
      double best_gap = weights(0) * seen - static_cast<double>(taken[0]);
      for (int64_t d = 1; d < n; ++d) {
        const double gap = weights(d) * seen - static_cast<double>(taken[d]);
        if (gap > best_gap) {
          best_gap = gap;
          best = d;
        }
      }
      di(i) = static_cast<int16_t>(best);
      dsi(i) = taken[best]++;
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "Index builders for Megatron GPT datasets (sample index, blending index).";
  // Bumped when a builder's result changes, so a stale build is refused (megatron/data/helpers.py) instead of
  // silently giving the old arrays. 2: blending index as upstream's (max(i, 1)).
  m.attr("VERSION") = 2;
  m.def("build_sample_idx_int32", &build_sample_idx_impl<int32_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_samples"),
        "Sample index stored as int32; valid while every document position and offset fits in int32.");
  m.def("build_sample_idx_int64", &build_sample_idx_impl<int64_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_samples"), "Sample index stored as int64.");
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
        "(dataset_index int16[size], dataset_sample_index int64[size]) for a weighted blend.");
}
