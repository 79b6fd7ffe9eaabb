// CPU twin of multi_tensor_sgd.cu: one SGD step per element (sgd_element), over
// [grads, weights, momentum_bufs] or [grads, fp32 weights, fp32 momentum_bufs, model_copies].
#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// kMomentum: the buffer is read and written only with momentum; kCopy: a model-copy list exists
// (copy_t is then its element type).
// The lists never overlap (checked by the caller), hence __restrict; `a` is a local copy so that
// the stores cannot alias it: both let the loop vectorise.
template <bool kMomentum, bool kCopy, typename grad_t, typename weight_t, typename copy_t>
AMP_INLINE void sgd_loop(const grad_t* __restrict grad, weight_t* __restrict weight,
                         weight_t* __restrict buf, copy_t* __restrict copy, int64_t n,
                         const SgdArgs& args, float scale) {
  const SgdArgs a = args;
  for (int64_t i = 0; i < n; ++i) {
    float w = to_float(weight[i]);
    float b = kMomentum ? to_float(buf[i]) : 0.f;
    sgd_element(to_float(grad[i]), w, b, a, scale);
    weight[i] = from_float<weight_t>(w);
    if (kMomentum) buf[i] = from_float<weight_t>(b);
    if (kCopy) copy[i] = from_float<copy_t>(w);
  }
}

// The weights', buffers' and copies' types for grads of type grad_t (the caller checked the
// combination: one dtype at depth 3, fp32 weights and buffers with fp16/bf16 copies at depth 4).
// No lambdas: everything must inline into the clones of sgd_piece to be compiled for them.
template <bool kMomentum, typename grad_t>
AMP_INLINE void sgd_typed(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                          float scale) {
  const int64_t t = p.tensor;
  const int64_t n = p.end - p.begin;
  const grad_t* grad = static_cast<const grad_t*>(lists.ptr[0][t]) + p.begin;
  if (lists.depth == 3) {
    sgd_loop<kMomentum, false>(grad, static_cast<grad_t*>(lists.ptr[1][t]) + p.begin,
                               static_cast<grad_t*>(lists.ptr[2][t]) + p.begin,
                               static_cast<float*>(nullptr), n, args, scale);
    return;
  }
  float* weight = static_cast<float*>(lists.ptr[1][t]) + p.begin;
  float* buf = static_cast<float*>(lists.ptr[2][t]) + p.begin;
  if (lists.dtype[3] == DType::Float16) {
    sgd_loop<kMomentum, true>(grad, weight, buf, static_cast<half_t*>(lists.ptr[3][t]) + p.begin,
                              n, args, scale);
  } else {
    sgd_loop<kMomentum, true>(grad, weight, buf, static_cast<bf16_t*>(lists.ptr[3][t]) + p.begin,
                              n, args, scale);
  }
}

template <bool kMomentum>
AMP_INLINE void sgd_momentum(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                             float scale) {
  switch (lists.dtype[0]) {
    case DType::Float32: sgd_typed<kMomentum, float>(lists, p, args, scale); break;
    case DType::Float16: sgd_typed<kMomentum, half_t>(lists, p, args, scale); break;
    default: sgd_typed<kMomentum, bf16_t>(lists, p, args, scale); break;
  }
}

AMP_CPU_CLONES void sgd_piece(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                              float scale) {
  if (args.momentum != 0.f) {
    sgd_momentum<true>(lists, p, args, scale);
  } else {
    sgd_momentum<false>(lists, p, args, scale);
  }
}

}  // namespace
}  // namespace cpu

void multi_tensor_sgd_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                          const SgdArgs& args) {
  using namespace cpu;
  if (flag_is_set(flag)) return;  // a skipped step writes nothing
  const float scale = read_scalar(args.scale);
  for_each_piece(lists, chunk_size, [&](const Piece& p) { sgd_piece(lists, p, args, scale); });
}

}  // namespace amp_C
