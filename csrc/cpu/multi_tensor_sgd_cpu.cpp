// CPU twin of multi_tensor_sgd.cu: one SGD step per element (sgd_element), over
// [grads, weights, momentum_bufs], [grads, fp32 weights, fp32 momentum_bufs, model_copies] or
// [grads, bf16 weights, fp32 momentum_bufs, remainders].
#include <type_traits>

#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// Options: the SgdOptions of the call, fixed at compile time so that the loop has no branches;
// the buffer is read only with momentum after the first run, written only with momentum.
// kCopy: a model-copy list exists (copy_t is then its element type, or fp32 for a staging block).
// The lists never overlap (checked by the caller), hence __restrict; `a` is a local copy so that
// the stores cannot alias it: both let the loop vectorise.
template <typename Options, bool kCopy, typename grad_t, typename weight_t, typename copy_t>
AMP_INLINE void sgd_loop(const grad_t* __restrict grad, weight_t* __restrict weight,
                         weight_t* __restrict buf, copy_t* __restrict copy, int64_t n,
                         const SgdArgs& args, float scale) {
  constexpr bool kReadBuf = Options::momentum && !Options::first_run;
  const SgdArgs a = args;
  for (int64_t i = 0; i < n; ++i) {
    float w = to_float(weight[i]);
    float b = kReadBuf ? to_float(buf[i]) : 0.f;
    sgd_element<Options>(to_float(grad[i]), w, b, a, scale);
    weight[i] = from_float<weight_t>(w);
    if (Options::momentum) buf[i] = from_float<weight_t>(b);
    if (kCopy) copy[i] = from_float<copy_t>(w);
  }
}

// fp16 model copies: the loop writes them as fp32 into a block in L1, which to_half() stores
// eight at a time (a per-element fp32 -> fp16 conversion would halve the loop's speed).
template <typename Options, typename grad_t>
AMP_INLINE void sgd_loop_half_copy(const grad_t* grad, float* weight, float* buf, half_t* copy,
                                   int64_t n, const SgdArgs& args, float scale) {
  store_half_in_blocks(copy, n, [&](float* block, int64_t i, int64_t m) {
    sgd_loop<Options, true>(grad + i, weight + i, buf + i, block, m, args, scale);
    return false;
  });
}

// Every list fp16 (depth 3): the fp32 loop over fp32 blocks of them (in_fp32_blocks); the buffer
// is read only with momentum after the first run, written only with momentum.
template <typename Options>
AMP_INLINE void sgd_loop_half_weights(const half_t* grad, half_t* weight, half_t* buf, int64_t n,
                                      const SgdArgs& args, float scale) {
  constexpr bool kReadBuf = Options::momentum && !Options::first_run;
  const HalfList lists[] = {{grad, nullptr},
                            {weight, weight},
                            {kReadBuf ? buf : nullptr, Options::momentum ? buf : nullptr}};
  in_fp32_blocks(lists, n, [&](float* const (&block)[4], int64_t m) {
    sgd_loop<Options, false>(block[0], block[1], block[2], static_cast<float*>(nullptr), m, args,
                             scale);
  });
}

// The weights', buffers' and copies' types for grads of type grad_t (the caller checked the
// combination: one dtype at depth 3, fp32 weights and buffers with fp16/bf16 copies at depth 4,
// or bf16 weights, whose masters the loop steps a carry word at a time (in_master_words), with
// fp32 buffers and remainders).
template <typename Options, typename grad_t>
AMP_INLINE void sgd_typed(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                          float scale) {
  const int64_t t = p.tensor;
  const int64_t n = p.end - p.begin;
  const grad_t* grad = static_cast<const grad_t*>(lists.ptr[0][t]) + p.begin;
  if (lists.depth == 3) {
    grad_t* weight = static_cast<grad_t*>(lists.ptr[1][t]) + p.begin;
    grad_t* buf = static_cast<grad_t*>(lists.ptr[2][t]) + p.begin;
    if constexpr (std::is_same_v<grad_t, half_t>) {
      sgd_loop_half_weights<Options>(grad, weight, buf, n, args, scale);
    } else {
      sgd_loop<Options, false>(grad, weight, buf, static_cast<float*>(nullptr), n, args, scale);
    }
    return;
  }
  float* buf = static_cast<float*>(lists.ptr[2][t]) + p.begin;
  if (lists.dtype[3] == DType::Int16) {
    in_master_words(lists, p, [&](float* master, int64_t i, int64_t m) {
      sgd_loop<Options, false>(grad + i, master, buf + i, static_cast<float*>(nullptr), m, args,
                               scale);
    });
    return;
  }
  float* weight = static_cast<float*>(lists.ptr[1][t]) + p.begin;
  if (lists.dtype[3] == DType::Float16) {
    sgd_loop_half_copy<Options>(grad, weight, buf,
                                static_cast<half_t*>(lists.ptr[3][t]) + p.begin, n, args, scale);
  } else {
    sgd_loop<Options, true>(grad, weight, buf, static_cast<bf16_t*>(lists.ptr[3][t]) + p.begin, n,
                            args, scale);
  }
}

template <typename Options>
AMP_INLINE void sgd_grads(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                          float scale) {
  switch (lists.dtype[0]) {
    case DType::Float32: sgd_typed<Options, float>(lists, p, args, scale); break;
    case DType::Float16: sgd_typed<Options, half_t>(lists, p, args, scale); break;
    default: sgd_typed<Options, bf16_t>(lists, p, args, scale); break;
  }
}

// The options are dispatched here, once per piece; flatten inlines the lambda and everything
// below it into each clone.
AMP_CPU_CLONES void sgd_piece(const TensorLists& lists, const Piece& p, const SgdArgs& args,
                              float scale) {
  visit_sgd_options(args, [&](auto options) {
    sgd_grads<decltype(options)>(lists, p, args, scale);
  });
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
