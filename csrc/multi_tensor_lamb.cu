// multi_tensor_lamb's two element-wise passes (the binding computes the per-tensor norms and
// ratios between them with PyTorch, as the fallback does). Stage 1 over [grads, params, exp_avgs,
// exp_avg_sqs, updates]: the moments, and the fp32 update of each element (lamb_update in
// amp_C_host_device.h). Stage 2 over [updates, params(, model_copies)]: each element steps along
// its update times the ratio of its tensor, read per chunk. A block whose noop_flag is set returns
// before writing anything. CPU twin: cpu/multi_tensor_lamb_cpu.cpp.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

// param_t is also the state's dtype; the updates are fp32.
template <typename grad_t, typename param_t>
struct LambStage1Functor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<5>& meta, Flag flag,
                             LambArgs args) {
    if (flag_is_set(flag)) return;  // a skipped step writes nothing
    const Chunk<5> chunk(meta, chunk_size);
    const grad_t* grad = chunk.template base<grad_t>(0);
    const param_t* param = chunk.template base<param_t>(1);
    param_t* exp_avg = chunk.template base<param_t>(2);
    param_t* exp_avg_sq = chunk.template base<param_t>(3);
    float* update = chunk.template base<float>(4);
    const float inv_scale = read_scalar(args.inv_scale);
    const float clip = lamb_clip(args);
    const bool aligned = is_aligned(grad) && is_aligned(param) && is_aligned(exp_avg) &&
                         is_aligned(exp_avg_sq) && is_aligned(update);
    for_each_step(chunk.n, aligned, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float g[W];
      float p[W];
      float m[W];
      float v[W];
      float u[W];
      load<W>(g, grad + i);
      load<W>(p, param + i);
      load<W>(m, exp_avg + i);
      load<W>(v, exp_avg_sq + i);
#pragma unroll
      for (int k = 0; k < W; ++k) u[k] = lamb_update(g[k], p[k], m[k], v[k], args, inv_scale, clip);
      store<W>(exp_avg + i, m);
      store<W>(exp_avg_sq + i, v);
      store<W>(update + i, u);
    });
  }
};

// depth 3 adds the model copies (copy_t; unused at depth 2).
template <int depth, typename param_t, typename copy_t>
struct LambStage2Functor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<depth>& meta, Flag flag,
                             const float* chunk_ratios) {
    if (flag_is_set(flag)) return;
    const Chunk<depth> chunk(meta, chunk_size);
    const float* update = chunk.template base<float>(0);
    param_t* param = chunk.template base<param_t>(1);
    copy_t* copy = nullptr;
    if constexpr (depth == 3) copy = chunk.template base<copy_t>(2);
    const float ratio = chunk_ratios[meta.chunk_base[chunk.slot] + chunk.chunk_idx];
    const bool aligned = is_aligned(update) && is_aligned(param) && (depth == 2 || is_aligned(copy));
    for_each_step(chunk.n, aligned, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float u[W];
      float p[W];
      load<W>(u, update + i);
      load<W>(p, param + i);
#pragma unroll
      for (int k = 0; k < W; ++k) p[k] = lamb_apply(p[k], u[k], ratio);
      store<W>(param + i, p);
      if constexpr (depth == 3) store<W>(copy + i, p);
    });
  }
};

}  // namespace

void multi_tensor_lamb_stage1_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                   const LambArgs& args, void* stream) {
  dispatch_float_types(lists.dtype[0], "multi_tensor_lamb", [&](auto g) {
    using grad_t = decltype(g);
    // The caller checked the combination: params and state are fp32 or the grads' dtype.
    if (lists.dtype[1] == DType::Float32) {
      multi_tensor_apply<5, LambStage1Functor<grad_t, float>>(chunk_size, lists, stream, flag, args);
    } else {
      multi_tensor_apply<5, LambStage1Functor<grad_t, grad_t>>(chunk_size, lists, stream, flag,
                                                                args);
    }
  });
}

void multi_tensor_lamb_stage2_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                   const float* chunk_ratios, void* stream) {
  dispatch_float_types(lists.dtype[1], "multi_tensor_lamb", [&](auto w) {
    using param_t = decltype(w);
    if (lists.depth == 2) {
      multi_tensor_apply<2, LambStage2Functor<2, param_t, float>>(chunk_size, lists, stream, flag,
                                                                  chunk_ratios);
    } else if (lists.dtype[2] == DType::Float16) {
      multi_tensor_apply<3, LambStage2Functor<3, param_t, __half>>(chunk_size, lists, stream, flag,
                                                                   chunk_ratios);
    } else {
      multi_tensor_apply<3, LambStage2Functor<3, param_t, __nv_bfloat16>>(chunk_size, lists,
                                                                          stream, flag,
                                                                          chunk_ratios);
    }
  });
}

}  // namespace amp_C
