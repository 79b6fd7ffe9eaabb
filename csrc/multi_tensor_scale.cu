// multi_tensor_scale: out = (out_t)((float)in * scale) over [in, out] lists; flags non-finite input.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

template <typename in_t, typename out_t>
struct ScaleFunctor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<2>& meta, Flag flag,
                             Scalar scale_arg) {
    const Chunk<2> chunk(meta, chunk_size);
    const in_t* in = chunk.base<in_t>(0);
    out_t* out = chunk.base<out_t>(1);
    const float scale = read_scalar(scale_arg);
    bool non_finite = false;
    for_each_step(chunk.n, is_aligned(in) && is_aligned(out), [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float x[W];
      load<W>(x, in + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        non_finite |= !is_finite(x[k]);
        x[k] = __fmul_rn(x[k], scale);
      }
      store<W>(out + i, x);
    });
    if (non_finite) raise_flag(flag);
  }
};

}  // namespace

void multi_tensor_scale_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale,
                             void* stream) {
  dispatch_float_types(lists.dtype[0], "multi_tensor_scale", [&](auto in) {
    dispatch_float_types(lists.dtype[1], "multi_tensor_scale", [&](auto out) {
      using Functor = ScaleFunctor<decltype(in), decltype(out)>;
      multi_tensor_apply<2, Functor>(chunk_size, lists, stream, flag, scale);
    });
  });
}

}  // namespace amp_C
