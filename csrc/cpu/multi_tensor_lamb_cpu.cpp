// CPU twin of multi_tensor_lamb.cu: LAMB's stage 1 (lamb_update) over [grads, params, exp_avgs,
// exp_avg_sqs, updates] and stage 2 (lamb_apply) over [updates, params(, model_copies)].
#include <type_traits>

#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// param_t is also the state's type. The lists never overlap (checked by the caller), hence
// __restrict; `a` is a local copy so that the stores cannot alias it.
template <typename grad_t, typename param_t>
AMP_INLINE void lamb_stage1_loop(const grad_t* __restrict grad, const param_t* __restrict param,
                                 param_t* __restrict exp_avg, param_t* __restrict exp_avg_sq,
                                 float* __restrict update, int64_t n, const LambArgs& args,
                                 float inv_scale, float clip) {
  const LambArgs a = args;
  for (int64_t i = 0; i < n; ++i) {
    float m = to_float(exp_avg[i]);
    float v = to_float(exp_avg_sq[i]);
    update[i] = lamb_update(to_float(grad[i]), to_float(param[i]), m, v, a, inv_scale, clip);
    exp_avg[i] = from_float<param_t>(m);
    exp_avg_sq[i] = from_float<param_t>(v);
  }
}

template <typename grad_t, typename param_t>
AMP_INLINE void lamb_stage1_typed(const TensorLists& lists, const Piece& p, const LambArgs& args,
                                  float inv_scale, float clip) {
  const int64_t t = p.tensor;
  const int64_t n = p.end - p.begin;
  const grad_t* grad = static_cast<const grad_t*>(lists.ptr[0][t]) + p.begin;
  const param_t* param = static_cast<const param_t*>(lists.ptr[1][t]) + p.begin;
  param_t* exp_avg = static_cast<param_t*>(lists.ptr[2][t]) + p.begin;
  param_t* exp_avg_sq = static_cast<param_t*>(lists.ptr[3][t]) + p.begin;
  float* update = static_cast<float*>(lists.ptr[4][t]) + p.begin;
  if constexpr (std::is_same_v<grad_t, half_t> && !std::is_same_v<param_t, half_t>) {
    // fp16 grads: widened eight at a time into an fp32 block in L1 (a per-element conversion
    // would cost the loop most of its speed).
    float block[kHalfBlock];
    for (int64_t i = 0; i < n; i += kHalfBlock) {
      const int64_t m = std::min(kHalfBlock, n - i);
      from_half(block, grad + i, m);
      lamb_stage1_loop(static_cast<const float*>(block), param + i, exp_avg + i, exp_avg_sq + i,
                       update + i, m, args, inv_scale, clip);
    }
  } else {
    lamb_stage1_loop(grad, param, exp_avg, exp_avg_sq, update, n, args, inv_scale, clip);
  }
}

// Params and state are fp32 or the grads' dtype (checked by the caller).
template <typename grad_t>
AMP_INLINE void lamb_stage1_grads(const TensorLists& lists, const Piece& p, const LambArgs& args,
                                  float inv_scale, float clip) {
  if (lists.dtype[1] == DType::Float32) {
    lamb_stage1_typed<grad_t, float>(lists, p, args, inv_scale, clip);
  } else {
    lamb_stage1_typed<grad_t, grad_t>(lists, p, args, inv_scale, clip);
  }
}

AMP_CPU_CLONES void lamb_stage1_piece(const TensorLists& lists, const Piece& p,
                                      const LambArgs& args, float inv_scale, float clip) {
  switch (lists.dtype[0]) {
    case DType::Float32: lamb_stage1_grads<float>(lists, p, args, inv_scale, clip); break;
    case DType::Float16: lamb_stage1_grads<half_t>(lists, p, args, inv_scale, clip); break;
    default: lamb_stage1_grads<bf16_t>(lists, p, args, inv_scale, clip); break;
  }
}

// kCopy: a model-copy list exists (copy_t is then its element type).
template <bool kCopy, typename param_t, typename copy_t>
AMP_INLINE void lamb_stage2_loop(const float* __restrict update, param_t* __restrict param,
                                 copy_t* __restrict copy, int64_t n, float ratio) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = lamb_apply(to_float(param[i]), update[i], ratio);
    param[i] = from_float<param_t>(p);
    if (kCopy) copy[i] = from_float<copy_t>(p);
  }
}

template <typename param_t>
AMP_INLINE void lamb_stage2_typed(const TensorLists& lists, const Piece& p, float ratio) {
  const int64_t t = p.tensor;
  const int64_t n = p.end - p.begin;
  const float* update = static_cast<const float*>(lists.ptr[0][t]) + p.begin;
  param_t* param = static_cast<param_t*>(lists.ptr[1][t]) + p.begin;
  if (lists.depth == 2) {
    lamb_stage2_loop<false>(update, param, static_cast<float*>(nullptr), n, ratio);
  } else if (lists.dtype[2] == DType::Float16) {
    // fp16 copies: fp32 blocks in L1 that to_half() stores eight at a time (a per-element
    // conversion would cost the loop most of its speed).
    store_half_in_blocks(static_cast<half_t*>(lists.ptr[2][t]) + p.begin, n,
                         [&](float* block, int64_t i, int64_t m) {
                           lamb_stage2_loop<true>(update + i, param + i, block, m, ratio);
                           return false;
                         });
  } else {
    lamb_stage2_loop<true>(update, param, static_cast<bf16_t*>(lists.ptr[2][t]) + p.begin, n,
                           ratio);
  }
}

AMP_CPU_CLONES void lamb_stage2_piece(const TensorLists& lists, const Piece& p, float ratio) {
  switch (lists.dtype[1]) {
    case DType::Float32: lamb_stage2_typed<float>(lists, p, ratio); break;
    case DType::Float16: lamb_stage2_typed<half_t>(lists, p, ratio); break;
    default: lamb_stage2_typed<bf16_t>(lists, p, ratio); break;
  }
}

}  // namespace
}  // namespace cpu

void multi_tensor_lamb_stage1_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                  const LambArgs& args) {
  using namespace cpu;
  if (flag_is_set(flag)) return;  // a skipped step writes nothing
  const float inv_scale = read_scalar(args.inv_scale);
  const float clip = lamb_clip(args);
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    lamb_stage1_piece(lists, p, args, inv_scale, clip);
  });
}

void multi_tensor_lamb_stage2_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                  const float* ratios) {
  using namespace cpu;
  if (flag_is_set(flag)) return;
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    lamb_stage2_piece(lists, p, ratios[p.tensor]);
  });
}

}  // namespace amp_C
