// multi_tensor_adam: one Adam (mode 0) / AdamW (mode 1) step per element (adam_element in
// amp_C_host_device.h) over [grads, params, exp_avgs, exp_avg_sqs], [grads, fp32 params,
// fp32 exp_avgs, fp32 exp_avg_sqs, model_copies] or [grads, bf16 weights, fp32 exp_avgs,
// fp32 exp_avg_sqs, remainders]; a block whose noop_flag is set, or whose step is out of range,
// returns before writing anything. CPU twin: cpu/multi_tensor_adam_cpu.cpp.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

// param_t is also the state's dtype; depth 5 adds the model copies (copy_t; unused at depth 4), or
// with copy_t Remainders the remainders of bf16 weights in list 1, whose fp32 masters (param_t
// float) are stepped.
template <int depth, typename grad_t, typename param_t, typename copy_t>
struct AdamFunctor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<depth>& meta, Flag flag,
                             AdamArgs args) {
    // Thread 0 reads the flag and the step once for the block; the bias-correction factors are a
    // few dozen fp64 operations, done once per block rather than once per thread. A step out of
    // range (read here from a device tensor) makes every block skip and raise the flag.
    __shared__ bool skip;
    __shared__ AdamStepFactors shared_factors;
    if (threadIdx.x == 0) {
      const int64_t step = adam_step_of(args.step);
      if (step == 0) raise_flag(flag);
      skip = step == 0 || flag_is_set(flag);
      if (!skip) shared_factors = adam_step_factors(args, step);
    }
    __syncthreads();
    if (skip) return;  // a skipped step writes nothing
    const AdamStepFactors factors = shared_factors;
    constexpr bool kRemainders = std::is_same_v<copy_t, Remainders>;
    const Chunk<depth> chunk(meta, chunk_size);
    const grad_t* grad = chunk.template base<grad_t>(0);
    param_t* param = nullptr;
    param_t* exp_avg = chunk.template base<param_t>(2);
    param_t* exp_avg_sq = chunk.template base<param_t>(3);
    copy_t* copy = nullptr;
    MasterParts masters{};
    if constexpr (kRemainders) {
      masters = master_parts(chunk, 1, 4);
    } else {
      param = chunk.template base<param_t>(1);
      if constexpr (depth == 5) copy = chunk.template base<copy_t>(4);
    }
    const float inv_scale = read_scalar(args.inv_scale);
    const bool aligned = is_aligned(grad) && is_aligned(exp_avg) && is_aligned(exp_avg_sq) &&
                         (kRemainders ? is_aligned(masters.weight) && is_aligned(masters.low)
                                      : is_aligned(param) && (depth == 4 || is_aligned(copy)));
    for_each_step(chunk.n, aligned, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float g[W];
      float p[W];
      float m[W];
      float v[W];
      load<W>(g, grad + i);
      if constexpr (kRemainders) {
        load_masters<W>(p, masters, i);
      } else {
        load<W>(p, param + i);
      }
      load<W>(m, exp_avg + i);
      load<W>(v, exp_avg_sq + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        // Uniform branches: every thread of the launch takes the same one.
        if (args.l2) {
          if (args.small_w1) {
            adam_element<true, true>(g[k], p[k], m[k], v[k], args, factors, inv_scale);
          } else {
            adam_element<true, false>(g[k], p[k], m[k], v[k], args, factors, inv_scale);
          }
        } else if (args.small_w1) {
          adam_element<false, true>(g[k], p[k], m[k], v[k], args, factors, inv_scale);
        } else {
          adam_element<false, false>(g[k], p[k], m[k], v[k], args, factors, inv_scale);
        }
      }
      if constexpr (kRemainders) {
        store_masters<W>(masters, i, p);
      } else {
        store<W>(param + i, p);
        if constexpr (depth == 5) store<W>(copy + i, p);
      }
      store<W>(exp_avg + i, m);
      store<W>(exp_avg_sq + i, v);
    });
  }
};

}  // namespace

void multi_tensor_adam_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                            const AdamArgs& args, void* stream) {
  dispatch_float_types(lists.dtype[0], "multi_tensor_adam", [&](auto g) {
    using grad_t = decltype(g);
    const auto run = [&](auto w) {
      using param_t = decltype(w);
      if (lists.depth == 4) {
        multi_tensor_apply<4, AdamFunctor<4, grad_t, param_t, float>>(chunk_size, lists, stream,
                                                                      flag, args);
      } else if (lists.dtype[4] == DType::Float16) {
        multi_tensor_apply<5, AdamFunctor<5, grad_t, param_t, __half>>(chunk_size, lists, stream,
                                                                       flag, args);
      } else {
        multi_tensor_apply<5, AdamFunctor<5, grad_t, param_t, __nv_bfloat16>>(
            chunk_size, lists, stream, flag, args);
      }
    };
    // The caller checked the combination: params and state are fp32 or the grads' dtype; with
    // remainders, the state is fp32.
    if (lists.dtype[lists.depth - 1] == DType::Int16) {
      multi_tensor_apply<5, AdamFunctor<5, grad_t, float, Remainders>>(chunk_size, lists, stream,
                                                                       flag, args);
    } else if (lists.dtype[1] == DType::Float32) {
      run(float{});
    } else {
      run(grad_t{});
    }
  });
}

}  // namespace amp_C
