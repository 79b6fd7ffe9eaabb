// multi_tensor_axpby: out = (out_t)(a*(float)x + b*(float)y) over [x, y, out] lists, each product
// rounded to fp32 before the add (no FMA) so that the CPU twin and the torch fallback give the
// same bits. arg_to_check -1 flags non-finite x or y, 0 only x, 1 only y, anything else nothing.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

template <typename x_t, typename y_t, typename out_t>
struct AxpbyFunctor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<3>& meta, Flag flag,
                             Scalar a_arg, Scalar b_arg, int arg_to_check) {
    const Chunk<3> chunk(meta, chunk_size);
    const x_t* x = chunk.base<x_t>(0);
    const y_t* y = chunk.base<y_t>(1);
    out_t* out = chunk.base<out_t>(2);
    const float a = read_scalar(a_arg);
    const float b = read_scalar(b_arg);
    const bool check_x = arg_to_check == -1 || arg_to_check == 0;
    const bool check_y = arg_to_check == -1 || arg_to_check == 1;
    bool non_finite = false;
    const bool aligned = is_aligned(x) && is_aligned(y) && is_aligned(out);
    for_each_step(chunk.n, aligned, [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float xv[W];
      float yv[W];
      load<W>(xv, x + i);
      load<W>(yv, y + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        non_finite |= (check_x && !is_finite(xv[k])) || (check_y && !is_finite(yv[k]));
        xv[k] = __fadd_rn(__fmul_rn(a, xv[k]), __fmul_rn(b, yv[k]));
      }
      store<W>(out + i, xv);
    });
    if (non_finite) raise_flag(flag);
  }
};

}  // namespace

void multi_tensor_axpby_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                             Scalar b, int arg_to_check, void* stream) {
  dispatch_float_types(lists.dtype[0], "multi_tensor_axpby", [&](auto x) {
    dispatch_float_types(lists.dtype[1], "multi_tensor_axpby", [&](auto y) {
      dispatch_float_types(lists.dtype[2], "multi_tensor_axpby", [&](auto out) {
        using Functor = AxpbyFunctor<decltype(x), decltype(y), decltype(out)>;
        multi_tensor_apply<3, Functor>(chunk_size, lists, stream, flag, a, b, arg_to_check);
      });
    });
  });
}

}  // namespace amp_C
