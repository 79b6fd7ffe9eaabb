// multi_tensor_sgd: one SGD step per element (sgd_element in amp_C_host_device.h) over
// [grads, weights, momentum_bufs], [grads, fp32 weights, fp32 momentum_bufs, model_copies] or
// [grads, bf16 weights, fp32 momentum_bufs, remainders]; a block whose noop_flag is set returns
// before writing anything. CPU twin: cpu/multi_tensor_sgd_cpu.cpp.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

// kMomentum: the buffer is read and written only with momentum; depth 4 adds the model copies
// (copy_t; unused at depth 3), or with copy_t Remainders the remainders of bf16 weights in list
// 1, whose fp32 masters (weight_t float) are stepped.
template <int depth, typename grad_t, typename weight_t, typename copy_t, bool kMomentum>
struct SgdFunctor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<depth>& meta, Flag flag,
                             SgdArgs args) {
    if (flag_is_set(flag)) return;  // a skipped step writes nothing
    constexpr bool kRemainders = std::is_same_v<copy_t, Remainders>;
    const Chunk<depth> chunk(meta, chunk_size);
    const grad_t* grad = chunk.template base<grad_t>(0);
    weight_t* weight = nullptr;
    weight_t* buf = chunk.template base<weight_t>(2);
    copy_t* copy = nullptr;
    MasterParts masters{};
    if constexpr (kRemainders) {
      masters = master_parts(chunk, 1, 3);
    } else {
      weight = chunk.template base<weight_t>(1);
      if constexpr (depth == 4) copy = chunk.template base<copy_t>(3);
    }
    const float scale = read_scalar(args.scale);
    const bool aligned = is_aligned(grad) && is_aligned(buf) &&
                         (kRemainders ? is_aligned(masters.weight) && is_aligned(masters.low)
                                      : is_aligned(weight) && (depth == 3 || is_aligned(copy)));
    for_each_step(chunk.n, aligned, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float g[W];
      float w[W];
      float b[W] = {};
      load<W>(g, grad + i);
      if constexpr (kRemainders) {
        load_masters<W>(w, masters, i);
      } else {
        load<W>(w, weight + i);
      }
      if constexpr (kMomentum) load<W>(b, buf + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        // Uniform branches: every thread of the launch takes the same one.
        visit_sgd_options(args, [&](auto options) {
          sgd_element<decltype(options)>(g[k], w[k], b[k], args, scale);
        });
      }
      if constexpr (kRemainders) {
        store_masters<W>(masters, i, w);
      } else {
        store<W>(weight + i, w);
        if constexpr (depth == 4) store<W>(copy + i, w);
      }
      if constexpr (kMomentum) store<W>(buf + i, b);
    });
  }
};

template <int depth, typename grad_t, typename weight_t, typename copy_t>
void launch_sgd(int64_t chunk_size, Flag flag, const TensorLists& lists, const SgdArgs& args,
                void* stream) {
  if (args.momentum != 0.f) {
    multi_tensor_apply<depth, SgdFunctor<depth, grad_t, weight_t, copy_t, true>>(
        chunk_size, lists, stream, flag, args);
  } else {
    multi_tensor_apply<depth, SgdFunctor<depth, grad_t, weight_t, copy_t, false>>(
        chunk_size, lists, stream, flag, args);
  }
}

}  // namespace

void multi_tensor_sgd_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                           const SgdArgs& args, void* stream) {
  dispatch_float_types(lists.dtype[0], "multi_tensor_sgd", [&](auto g) {
    using grad_t = decltype(g);
    if (lists.depth == 3) {  // one dtype for every list (checked by the caller)
      launch_sgd<3, grad_t, grad_t, float>(chunk_size, flag, lists, args, stream);
    } else if (lists.dtype[3] == DType::Int16) {
      launch_sgd<4, grad_t, float, Remainders>(chunk_size, flag, lists, args, stream);
    } else if (lists.dtype[3] == DType::Float16) {
      launch_sgd<4, grad_t, float, __half>(chunk_size, flag, lists, args, stream);
    } else {
      launch_sgd<4, grad_t, float, __nv_bfloat16>(chunk_size, flag, lists, args, stream);
    }
  });
}

}  // namespace amp_C
