// CPU twin of multi_tensor_sgd.cu: one SGD step per element (sgd_element), over
// [grads, weights, momentum_bufs] or [grads, fp32 weights, fp32 momentum_bufs, model_copies].
#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// kMomentum: the buffer is read and written only with momentum; kCopy: a model-copy list exists
// (copy_t is then its element type).
template <bool kMomentum, bool kCopy, typename grad_t, typename weight_t, typename copy_t>
AMP_INLINE void sgd_loop(const grad_t* grad, weight_t* weight, weight_t* buf, copy_t* copy,
                         int64_t n, const SgdArgs& args, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    float w = to_float(weight[i]);
    float b = kMomentum ? to_float(buf[i]) : 0.f;
    sgd_element(to_float(grad[i]), w, b, args, scale);
    weight[i] = from_float<weight_t>(w);
    if (kMomentum) buf[i] = from_float<weight_t>(b);
    if (kCopy) copy[i] = from_float<copy_t>(w);
  }
}

template <bool kMomentum>
AMP_CPU_CLONES void sgd_piece(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                              float scale) {
  const auto at = [&](int k) { return lists.ptr[k][p.tensor]; };
  const int64_t n = p.end - p.begin;
  dispatch_float_types(lists.dtype[0], "multi_tensor_sgd", [&](auto g) {
    using grad_t = decltype(g);
    const grad_t* grad = static_cast<const grad_t*>(at(0)) + p.begin;
    if (lists.depth == 3) {
      // One dtype for every list (checked by the caller).
      auto* weight = static_cast<grad_t*>(at(1)) + p.begin;
      auto* buf = static_cast<grad_t*>(at(2)) + p.begin;
      sgd_loop<kMomentum, false>(grad, weight, buf, static_cast<float*>(nullptr), n, args, scale);
      return;
    }
    auto* weight = static_cast<float*>(at(1)) + p.begin;
    auto* buf = static_cast<float*>(at(2)) + p.begin;
    if (lists.dtype[3] == DType::Float16) {
      sgd_loop<kMomentum, true>(grad, weight, buf, static_cast<half_t*>(at(3)) + p.begin, n, args,
                                scale);
    } else {
      sgd_loop<kMomentum, true>(grad, weight, buf, static_cast<bf16_t*>(at(3)) + p.begin, n, args,
                                scale);
    }
  });
}

}  // namespace
}  // namespace cpu

void multi_tensor_sgd_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                          const SgdArgs& args) {
  using namespace cpu;
  if (flag_is_set(flag)) return;  // a skipped step writes nothing
  const float scale = read_scalar(args.scale);
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    if (args.momentum != 0.f) {
      sgd_piece<true>(lists, p, args, scale);
    } else {
      sgd_piece<false>(lists, p, args, scale);
    }
  });
}

}  // namespace amp_C
