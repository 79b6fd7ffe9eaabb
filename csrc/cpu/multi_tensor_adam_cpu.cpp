// CPU twin of multi_tensor_adam.cu: one Adam/AdamW step per element (adam_element), over
// [grads, params, exp_avgs, exp_avg_sqs] or [grads, fp32 params, fp32 exp_avgs,
// fp32 exp_avg_sqs, model_copies].
#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

// kCopy: a model-copy list exists (copy_t is then its element type); param_t is also the state's.
template <bool kCopy, typename grad_t, typename param_t, typename copy_t>
AMP_INLINE void adam_loop(const grad_t* grad, param_t* param, param_t* exp_avg,
                          param_t* exp_avg_sq, copy_t* copy, int64_t n, const AdamArgs& args,
                          AdamStepFactors factors, float inv_scale) {
  for (int64_t i = 0; i < n; ++i) {
    float p = to_float(param[i]);
    float m = to_float(exp_avg[i]);
    float v = to_float(exp_avg_sq[i]);
    adam_element(to_float(grad[i]), p, m, v, args, factors, inv_scale);
    param[i] = from_float<param_t>(p);
    exp_avg[i] = from_float<param_t>(m);
    exp_avg_sq[i] = from_float<param_t>(v);
    if (kCopy) copy[i] = from_float<copy_t>(p);
  }
}

AMP_CPU_CLONES void adam_piece(const TensorLists& lists, const Piece& p, const AdamArgs& args,
                               AdamStepFactors factors, float inv_scale) {
  const auto at = [&](int k) { return lists.ptr[k][p.tensor]; };
  const int64_t n = p.end - p.begin;
  dispatch_float_types(lists.dtype[0], "multi_tensor_adam", [&](auto g) {
    using grad_t = decltype(g);
    const grad_t* grad = static_cast<const grad_t*>(at(0)) + p.begin;
    const auto run = [&](auto w) {
      using param_t = decltype(w);
      auto* param = static_cast<param_t*>(at(1)) + p.begin;
      auto* exp_avg = static_cast<param_t*>(at(2)) + p.begin;
      auto* exp_avg_sq = static_cast<param_t*>(at(3)) + p.begin;
      if (lists.depth == 4) {
        adam_loop<false>(grad, param, exp_avg, exp_avg_sq, static_cast<float*>(nullptr), n, args,
                         factors, inv_scale);
      } else if (lists.dtype[4] == DType::Float16) {
        adam_loop<true>(grad, param, exp_avg, exp_avg_sq, static_cast<half_t*>(at(4)) + p.begin,
                        n, args, factors, inv_scale);
      } else {
        adam_loop<true>(grad, param, exp_avg, exp_avg_sq, static_cast<bf16_t*>(at(4)) + p.begin,
                        n, args, factors, inv_scale);
      }
    };
    // The caller checked the combination: params and state are fp32 or the grads' dtype.
    if (lists.dtype[1] == DType::Float32) {
      run(float{});
    } else {
      run(grad_t{});
    }
  });
}

}  // namespace
}  // namespace cpu

void multi_tensor_adam_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                           const AdamArgs& args) {
  using namespace cpu;
  if (flag_is_set(flag)) return;  // a skipped step writes nothing
  const float inv_scale = read_scalar(args.inv_scale);
  const AdamStepFactors factors =
      adam_step_factors(args, args.step.ptr ? *args.step.ptr : args.step.value);
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    adam_piece(lists, p, args, factors, inv_scale);
  });
}

}  // namespace amp_C
