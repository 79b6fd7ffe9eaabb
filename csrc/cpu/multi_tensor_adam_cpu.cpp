// CPU twin of multi_tensor_adam.cu: one Adam/AdamW step per element (adam_element), over
// [grads, params, exp_avgs, exp_avg_sqs], [grads, fp32 params, fp32 exp_avgs,
// fp32 exp_avg_sqs, model_copies] or [grads, bf16 weights, fp32 exp_avgs, fp32 exp_avg_sqs,
// remainders].
#include <type_traits>

#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// kCopy: a model-copy list exists (copy_t is then its element type, or fp32 for a staging block);
// param_t is also the state's; kL2, kSmallW1: see adam_element. The lists never overlap (checked
// by the caller), hence __restrict; `a` is a local copy so that the stores cannot alias it: both
// let the loop vectorise.
template <bool kCopy, bool kL2, bool kSmallW1, typename grad_t, typename param_t, typename copy_t>
AMP_INLINE void adam_loop(const grad_t* __restrict grad, param_t* __restrict param,
                          param_t* __restrict exp_avg, param_t* __restrict exp_avg_sq,
                          copy_t* __restrict copy, int64_t n, const AdamArgs& args,
                          AdamStepFactors factors, float inv_scale) {
  const AdamArgs a = args;
  for (int64_t i = 0; i < n; ++i) {
    float p = to_float(param[i]);
    float m = to_float(exp_avg[i]);
    float v = to_float(exp_avg_sq[i]);
    adam_element<kL2, kSmallW1>(to_float(grad[i]), p, m, v, a, factors, inv_scale);
    param[i] = from_float<param_t>(p);
    exp_avg[i] = from_float<param_t>(m);
    exp_avg_sq[i] = from_float<param_t>(v);
    if (kCopy) copy[i] = from_float<copy_t>(p);
  }
}

// fp16 model copies: the loop writes them as fp32 into a block in L1, which to_half() stores
// eight at a time (a per-element fp32 -> fp16 conversion would cost the loop most of its speed).
template <bool kL2, bool kSmallW1, typename grad_t, typename param_t>
AMP_INLINE void adam_loop_half_copy(const grad_t* grad, param_t* param, param_t* exp_avg,
                                    param_t* exp_avg_sq, half_t* copy, int64_t n,
                                    const AdamArgs& args, AdamStepFactors factors,
                                    float inv_scale) {
  store_half_in_blocks(copy, n, [&](float* block, int64_t i, int64_t m) {
    adam_loop<true, kL2, kSmallW1>(grad + i, param + i, exp_avg + i, exp_avg_sq + i, block, m,
                                   args, factors, inv_scale);
    return false;
  });
}

// Every list fp16 (depth 4): the fp32 loop over fp32 blocks of them (in_fp32_blocks).
template <bool kL2, bool kSmallW1>
AMP_INLINE void adam_loop_half_params(const half_t* grad, half_t* param, half_t* exp_avg,
                                      half_t* exp_avg_sq, int64_t n, const AdamArgs& args,
                                      AdamStepFactors factors, float inv_scale) {
  const HalfList lists[] = {{grad, nullptr}, {param, param}, {exp_avg, exp_avg},
                            {exp_avg_sq, exp_avg_sq}};
  in_fp32_blocks(lists, n, [&](float* const (&block)[4], int64_t m) {
    adam_loop<false, kL2, kSmallW1>(block[0], block[1], block[2], block[3],
                                    static_cast<float*>(nullptr), m, args, factors, inv_scale);
  });
}

// param_t is also the state's type (fp32 with remainders, whose masters the loop steps a carry
// word at a time: in_master_words); the caller checked the combination. No lambdas but those of
// the block helpers: everything must inline into the clones of adam_piece to be compiled for them.
template <bool kL2, bool kSmallW1, typename grad_t, typename param_t>
AMP_INLINE void adam_options(const TensorLists& lists, const Piece& p, const AdamArgs& args,
                             AdamStepFactors factors, float inv_scale) {
  const int64_t t = p.tensor;
  const int64_t n = p.end - p.begin;
  const grad_t* grad = static_cast<const grad_t*>(lists.ptr[0][t]) + p.begin;
  param_t* exp_avg = static_cast<param_t*>(lists.ptr[2][t]) + p.begin;
  param_t* exp_avg_sq = static_cast<param_t*>(lists.ptr[3][t]) + p.begin;
  if constexpr (std::is_same_v<param_t, float>) {
    if (lists.dtype[lists.depth - 1] == DType::Int16) {
      in_master_words(lists, p, [&](float* master, int64_t i, int64_t m) {
        adam_loop<false, kL2, kSmallW1>(grad + i, master, exp_avg + i, exp_avg_sq + i,
                                        static_cast<float*>(nullptr), m, args, factors, inv_scale);
      });
      return;
    }
  }
  param_t* param = static_cast<param_t*>(lists.ptr[1][t]) + p.begin;
  if (lists.depth == 4) {
    if constexpr (std::is_same_v<param_t, half_t>) {  // then the grads are fp16 too
      adam_loop_half_params<kL2, kSmallW1>(grad, param, exp_avg, exp_avg_sq, n, args, factors,
                                           inv_scale);
    } else {
      adam_loop<false, kL2, kSmallW1>(grad, param, exp_avg, exp_avg_sq,
                                      static_cast<float*>(nullptr), n, args, factors, inv_scale);
    }
  } else if (lists.dtype[4] == DType::Float16) {
    adam_loop_half_copy<kL2, kSmallW1>(grad, param, exp_avg, exp_avg_sq,
                                       static_cast<half_t*>(lists.ptr[4][t]) + p.begin, n, args,
                                       factors, inv_scale);
  } else {
    adam_loop<true, kL2, kSmallW1>(grad, param, exp_avg, exp_avg_sq,
                                   static_cast<bf16_t*>(lists.ptr[4][t]) + p.begin, n, args,
                                   factors, inv_scale);
  }
}

template <typename grad_t, typename param_t>
AMP_INLINE void adam_typed(const TensorLists& lists, const Piece& p, const AdamArgs& args,
                           AdamStepFactors factors, float inv_scale) {
  if (args.l2) {
    if (args.small_w1) {
      adam_options<true, true, grad_t, param_t>(lists, p, args, factors, inv_scale);
    } else {
      adam_options<true, false, grad_t, param_t>(lists, p, args, factors, inv_scale);
    }
  } else if (args.small_w1) {
    adam_options<false, true, grad_t, param_t>(lists, p, args, factors, inv_scale);
  } else {
    adam_options<false, false, grad_t, param_t>(lists, p, args, factors, inv_scale);
  }
}

// Params and state are fp32 or the grads' dtype; with remainders, the state is fp32.
template <typename grad_t>
AMP_INLINE void adam_grads(const TensorLists& lists, const Piece& p, const AdamArgs& args,
                           AdamStepFactors factors, float inv_scale) {
  if (lists.dtype[1] == DType::Float32 || lists.dtype[lists.depth - 1] == DType::Int16) {
    adam_typed<grad_t, float>(lists, p, args, factors, inv_scale);
  } else {
    adam_typed<grad_t, grad_t>(lists, p, args, factors, inv_scale);
  }
}

AMP_CPU_CLONES void adam_piece(const TensorLists& lists, const Piece& p, const AdamArgs& args,
                               AdamStepFactors factors, float inv_scale) {
  switch (lists.dtype[0]) {
    case DType::Float32: adam_grads<float>(lists, p, args, factors, inv_scale); break;
    case DType::Float16: adam_grads<half_t>(lists, p, args, factors, inv_scale); break;
    default: adam_grads<bf16_t>(lists, p, args, factors, inv_scale); break;
  }
}

}  // namespace
}  // namespace cpu

void multi_tensor_adam_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                           const AdamArgs& args) {
  using namespace cpu;
  if (flag_is_set(flag)) return;  // a skipped step writes nothing
  const float inv_scale = read_scalar(args.inv_scale);
  // The binding read a CPU step tensor on the host, so the step is a checked value here.
  const AdamStepFactors factors = adam_step_factors(args, args.step.value);
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    adam_piece(lists, p, args, factors, inv_scale);
  });
}

}  // namespace amp_C
