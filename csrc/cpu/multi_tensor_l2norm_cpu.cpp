// CPU twin of multi_tensor_l2norm.cu: per-chunk sums of squares in parallel, then fixed-order
// per-tensor and total reductions (in fp64), so the result does not depend on the thread count.
// As in the CUDA kernel, a sum of squares beyond fp32's range makes the norm inf (even when the
// norm would fit). The flag is set when the total is not finite.
#include <cmath>

#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// Independent partial sums the vectoriser can keep in registers (a single float accumulator
// would serialise the loop, since float addition is not associative).
constexpr int kLanes = 16;

template <typename T>
AMP_INLINE float sum_squares_loop(const T* x, int64_t n, float inv_scale) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float u = to_float(x[i + k]) * inv_scale;
      lanes[k] += u * u;
    }
  }
  for (int k = 0; i < n; ++i, ++k) {
    const float u = to_float(x[i]) * inv_scale;
    lanes[k] += u * u;
  }
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

AMP_CPU_CLONES float sum_squares_piece(const TensorLists& lists, const Piece& p, float inv_scale) {
  float sum = 0.f;
  dispatch_float_types(lists.dtype[0], "multi_tensor_l2norm", [&](auto x) {
    using T = decltype(x);
    sum = sum_squares_loop(static_cast<const T*>(lists.ptr[0][p.tensor]) + p.begin,
                           p.end - p.begin, inv_scale);
  });
  return sum;
}

// The norm of an fp64 sum of squares, inf when the sum itself does not fit in fp32 (as the CUDA
// kernel's fp32 sums do not).
float fp32_norm(double sum_of_squares) {
  const auto sum = static_cast<float>(sum_of_squares);
  return is_finite(sum) ? static_cast<float>(std::sqrt(sum_of_squares)) : sum;
}

}  // namespace
}  // namespace cpu

void multi_tensor_l2norm_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                             Scalar inv_scale, bool respect_flag, NormOutputs out) {
  using namespace cpu;
  if (respect_flag && flag_is_set(flag)) return;
  const int64_t ntensors = static_cast<int64_t>(lists.numel.size());
  std::vector<int64_t> first_chunk(ntensors + 1, 0);
  for (int64_t t = 0; t < ntensors; ++t) {
    first_chunk[t + 1] = first_chunk[t] + chunks_of(lists.numel[t], chunk_size);
  }
  const float s = read_scalar(inv_scale);
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    out.chunk_sums[first_chunk[p.tensor] + p.begin / chunk_size] = sum_squares_piece(lists, p, s);
  });
  double total = 0.0;
  for (int64_t t = 0; t < ntensors; ++t) {
    double tensor_sum = 0.0;
    for (int64_t c = first_chunk[t]; c < first_chunk[t + 1]; ++c) tensor_sum += out.chunk_sums[c];
    out.tensor_sums[t] = static_cast<float>(tensor_sum);
    if (out.per_tensor != nullptr) out.per_tensor[t] = fp32_norm(tensor_sum);
    total += tensor_sum;
  }
  *out.total = fp32_norm(total);
  if (!is_finite(*out.total)) raise_flag(flag);
}

}  // namespace amp_C
