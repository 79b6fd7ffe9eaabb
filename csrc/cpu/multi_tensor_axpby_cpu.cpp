// CPU twin of multi_tensor_axpby.cu: out = (out_t)(a*(float)x + b*(float)y), each product rounded
// to fp32 before the add (this file is compiled with -ffp-contract=off, so no FMA).
#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

struct AxpbyArgs {
  float a;
  float b;
  bool check_x;
  bool check_y;
};

template <typename x_t, typename y_t, typename out_t>
AMP_INLINE bool axpby_loop(const x_t* x, const y_t* y, out_t* out, int64_t n, AxpbyArgs args) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float xv = to_float(x[i]);
    const float yv = to_float(y[i]);
    bad |= (args.check_x & !is_finite(xv)) | (args.check_y & !is_finite(yv));
    const float ax = args.a * xv;
    const float by = args.b * yv;
    out[i] = from_float<out_t>(ax + by);
  }
  return bad;
}

template <typename x_t, typename y_t>
AMP_INLINE bool axpby_loop(const x_t* x, const y_t* y, half_t* out, int64_t n, AxpbyArgs args) {
  return store_half_in_blocks(out, n, [&](float* block, int64_t i, int64_t m) {
    return axpby_loop(x + i, y + i, block, m, args);
  });
}

AMP_CPU_CLONES bool axpby_piece(const TensorLists& lists, const Piece& p, AxpbyArgs args) {
  bool bad = false;
  dispatch_float_types(lists.dtype[0], "multi_tensor_axpby", [&](auto x) {
    dispatch_float_types(lists.dtype[1], "multi_tensor_axpby", [&](auto y) {
      dispatch_float_types(lists.dtype[2], "multi_tensor_axpby", [&](auto out) {
        using x_t = decltype(x);
        using y_t = decltype(y);
        using out_t = decltype(out);
        bad = axpby_loop(static_cast<const x_t*>(lists.ptr[0][p.tensor]) + p.begin,
                         static_cast<const y_t*>(lists.ptr[1][p.tensor]) + p.begin,
                         static_cast<out_t*>(lists.ptr[2][p.tensor]) + p.begin, p.end - p.begin,
                         args);
      });
    });
  });
  return bad;
}

}  // namespace
}  // namespace cpu

void multi_tensor_axpby_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                            Scalar b, int arg_to_check) {
  using namespace cpu;
  const AxpbyArgs args{read_scalar(a), read_scalar(b), arg_to_check == -1 || arg_to_check == 0,
                       arg_to_check == -1 || arg_to_check == 1};
  std::atomic<bool> bad{false};
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    if (axpby_piece(lists, p, args)) bad = true;
  });
  if (bad) raise_flag(flag);
}

}  // namespace amp_C
