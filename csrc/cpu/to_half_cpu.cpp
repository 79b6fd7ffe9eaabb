// fp32 <-> fp16 conversions of whole blocks for the CPU loops. Compilers convert fp32 -> fp16 one
// element at a time (GCC 12 emits a scalar vcvtps2ph per element even for x86-64-v3), which halves
// the speed of a loop that writes fp16; F16C converts eight floats per instruction, so x86-64 CPUs
// that have it use it. fp16 -> fp32 vectorises without it (to_float), but costs a dozen
// instructions per vector where F16C takes one, which shows in loops that read several fp16 lists.
#include "multi_tensor_apply_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AMP_HAVE_F16C_PATH 1
#else
#define AMP_HAVE_F16C_PATH 0
#endif

namespace amp_C {
namespace cpu {
namespace {

#if AMP_HAVE_F16C_PATH
// Explicit round-to-nearest-even (not MXCSR's mode): the same bits as c10::Half, with inf for
// values beyond fp16's range, subnormals where they belong and NaN kept NaN.
constexpr int kRoundToNearestEven = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

__attribute__((target("avx,f16c"))) void to_half_f16c(half_t* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), kRoundToNearestEven);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  if (i < n) {  // the tail through a zero-padded vector, so every element takes the same path
    float tail[8] = {};
    uint16_t halves[8];
    std::memcpy(tail, in + i, (n - i) * sizeof(float));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(halves),
                     _mm256_cvtps_ph(_mm256_loadu_ps(tail), kRoundToNearestEven));
    std::memcpy(out + i, halves, (n - i) * sizeof(uint16_t));
  }
}

// fp16 -> fp32 is exact, so F16C gives the values of to_float(half_t) (a signalling NaN comes out
// quiet, which the loops' first arithmetic operation on it would do anyway).
__attribute__((target("avx,f16c"))) void from_half_f16c(float* out, const half_t* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  if (i < n) {  // the tail through a zero-padded vector, so every element takes the same path
    uint16_t tail[8] = {};
    float floats[8];
    std::memcpy(tail, in + i, (n - i) * sizeof(uint16_t));
    _mm256_storeu_ps(floats, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i*>(tail))));
    std::memcpy(out + i, floats, (n - i) * sizeof(float));
  }
}

#endif

}  // namespace

bool to_half_uses_f16c() {
#if AMP_HAVE_F16C_PATH
  static const bool has_f16c = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  }();
  return has_f16c;
#else
  return false;
#endif
}

void to_half(half_t* out, const float* in, int64_t n) {
#if AMP_HAVE_F16C_PATH
  if (to_half_uses_f16c()) {
    to_half_f16c(out, in, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<half_t>(in[i]);
}

void from_half(float* out, const half_t* in, int64_t n) {
#if AMP_HAVE_F16C_PATH
  if (to_half_uses_f16c()) {
    from_half_f16c(out, in, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]);
}

}  // namespace cpu
}  // namespace amp_C
