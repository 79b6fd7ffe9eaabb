// CPU twin of multi_tensor_scale.cu: out = (out_t)((float)in * scale), flagging non-finite input.
#include "multi_tensor_apply_cpu.h"

namespace amp_C {
namespace cpu {
namespace {

template <typename in_t, typename out_t>
AMP_INLINE bool scale_loop(const in_t* in, out_t* out, int64_t n, float scale) {
  int bad = 0;  // an int, not a bool: an OR-reduction the vectoriser accepts
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_float(in[i]);
    bad |= !is_finite(x);
    out[i] = from_float<out_t>(x * scale);
  }
  return bad;
}

template <typename in_t>
AMP_INLINE bool scale_loop(const in_t* in, half_t* out, int64_t n, float scale) {
  return store_half_in_blocks(out, n, [&](float* block, int64_t i, int64_t m) {
    return scale_loop(in + i, block, m, scale);
  });
}

AMP_CPU_CLONES bool scale_piece(const TensorLists& lists, const Piece& p, float scale) {
  bool bad = false;
  dispatch_float_types(lists.dtype[0], "multi_tensor_scale", [&](auto in) {
    dispatch_float_types(lists.dtype[1], "multi_tensor_scale", [&](auto out) {
      using in_t = decltype(in);
      using out_t = decltype(out);
      bad = scale_loop(static_cast<const in_t*>(lists.ptr[0][p.tensor]) + p.begin,
                       static_cast<out_t*>(lists.ptr[1][p.tensor]) + p.begin, p.end - p.begin,
                       scale);
    });
  });
  return bad;
}

}  // namespace
}  // namespace cpu

void multi_tensor_scale_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale) {
  using namespace cpu;
  const float s = read_scalar(scale);
  std::atomic<bool> bad{false};
  for_each_piece(lists, chunk_size, [&](const Piece& p) {
    if (scale_piece(lists, p, s)) bad = true;
  });
  if (bad) raise_flag(flag);
}

}  // namespace amp_C
