// Scalar logic shared by the CPU twins and the CUDA kernels, written once.
//
// AMP_HOST_DEVICE makes a function callable from host and device code under nvcc and is empty in
// the C++ compile, so these helpers must only use what both sides have (<cfloat>, <cmath>'s
// fabsf, double arithmetic, which rounds to nearest even on both).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amp_C_kernels.h"

#if defined(__CUDACC__)
#define AMP_HOST_DEVICE __host__ __device__
#else
#define AMP_HOST_DEVICE
#endif

namespace amp_C {

// Chunks of `chunk_size` elements in `numel` elements, for any positive int64 chunk_size (the
// usual (numel + chunk_size - 1) / chunk_size overflows near 2^63).
AMP_HOST_DEVICE inline int64_t chunks_of(int64_t numel, int64_t chunk_size) {
  return numel == 0 ? 0 : (numel - 1) / chunk_size + 1;
}

// NaN fails the comparison, so this is false for inf and NaN; a form the CPU vectoriser accepts.
AMP_HOST_DEVICE inline bool is_finite(float x) { return fabsf(x) <= FLT_MAX; }

AMP_HOST_DEVICE inline float read_scalar(Scalar s) { return s.ptr ? *s.ptr : s.value; }

// A blind store of 1 by whoever saw a non-finite value: the flag is only ever set, never cleared.
AMP_HOST_DEVICE inline void raise_flag(Flag flag) {
  if (flag.dtype == DType::Int32) {
    *static_cast<int32_t*>(flag.ptr) = 1;
  } else {
    *static_cast<float*>(flag.ptr) = 1.f;
  }
}

// Volatile: on the GPU other blocks of the same launch may raise the flag while this one runs.
AMP_HOST_DEVICE inline bool flag_is_set(Flag flag) {
  return flag.dtype == DType::Int32 ? *static_cast<volatile int32_t*>(flag.ptr) != 0
                                    : *static_cast<volatile float*>(flag.ptr) != 0.f;
}

// One step of Apex's dynamic loss-scale update with hysteresis. As in Apex, the fp32 scale is
// multiplied by a double factor and the product rounded once to fp32. `extras` adds amp's clamp
// and outputs (ScaleUpdateExtras), so that amp's scaler needs no other op per update.
AMP_HOST_DEVICE inline void update_scale_hysteresis_step(float* current_scale,
                                                         int32_t* growth_tracker,
                                                         int32_t* hysteresis_tracker,
                                                         const float* found_inf,
                                                         double growth_factor,
                                                         double backoff_factor,
                                                         int32_t growth_interval,
                                                         int32_t hysteresis,
                                                         ScaleUpdateExtras extras) {
  const bool overflow = *found_inf > 0.f;
  if (extras.should_skip) *extras.should_skip = overflow ? 1.f : 0.f;
  if (overflow) {
    // Hysteresis: tolerate this overflow without backing off while the tracker stays positive.
    *hysteresis_tracker -= 1;
    if (*hysteresis_tracker <= 0) {
      *current_scale = static_cast<float>(static_cast<double>(*current_scale) * backoff_factor);
    }
    *growth_tracker = 0;
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const auto grown = static_cast<float>(static_cast<double>(*current_scale) * growth_factor);
      if (is_finite(grown)) *current_scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
    *hysteresis_tracker = hysteresis;
  }
  if (extras.clamp) {
    // torch.clamp's order (the upper bound wins if the bounds cross); a NaN scale stays NaN.
    if (*current_scale < extras.min_scale) *current_scale = extras.min_scale;
    if (*current_scale > extras.max_scale) *current_scale = extras.max_scale;
  }
  if (extras.inv_scale) {
    *extras.inv_scale = static_cast<float>(1.0 / static_cast<double>(*current_scale));
  }
}

// ---- fused optimizer steps ------------------------------------------------------------------
//
// Every fp32 operation rounds on its own except the explicit fma_rn (one rounding), placed where
// torch.optim's CPU kernels fuse (add(alpha=), lerp, addcmul); see amp/_pytorch_ops/exact.py. The host
// side is compiled with -ffp-contract=off; on the device the _rn intrinsics forbid contraction.

AMP_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

AMP_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

AMP_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

AMP_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

AMP_HOST_DEVICE inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// a * b + c rounded once.
AMP_HOST_DEVICE inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

AMP_HOST_DEVICE inline double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// SGD's options as compile-time flags, so that the CPU loops have no branches: weight decay
// (wd != 0) before or after the momentum, momentum (momentum != 0), its first step (first_run) and
// Nesterov. A flag that cannot matter is false (kFirstRun and kNesterov without kMomentum,
// kWdAfterMomentum without kWd), so that a call picks one of 15 combinations.
template <bool kWd, bool kWdAfterMomentum, bool kMomentum, bool kFirstRun, bool kNesterov>
struct SgdOptions {
  static constexpr bool wd = kWd;
  static constexpr bool wd_after_momentum = kWdAfterMomentum;
  static constexpr bool momentum = kMomentum;
  static constexpr bool first_run = kFirstRun;
  static constexpr bool nesterov = kNesterov;
};

// Calls f(SgdOptions<...>{}) with the options of `a`: `wd != 0` and `momentum != 0` as the
// kernels always tested them (NaN counts as non-zero, -0 as zero).
template <bool kWd, bool kWdAfterMomentum, typename F>
AMP_HOST_DEVICE inline void visit_sgd_momentum(const SgdArgs& a, F&& f) {
  if (a.momentum == 0.f) {
    f(SgdOptions<kWd, kWdAfterMomentum, false, false, false>{});
  } else if (a.first_run) {
    if (a.nesterov) {
      f(SgdOptions<kWd, kWdAfterMomentum, true, true, true>{});
    } else {
      f(SgdOptions<kWd, kWdAfterMomentum, true, true, false>{});
    }
  } else if (a.nesterov) {
    f(SgdOptions<kWd, kWdAfterMomentum, true, false, true>{});
  } else {
    f(SgdOptions<kWd, kWdAfterMomentum, true, false, false>{});
  }
}

template <typename F>
AMP_HOST_DEVICE inline void visit_sgd_options(const SgdArgs& a, F&& f) {
  if (a.wd == 0.f) {
    visit_sgd_momentum<false, false>(a, f);
  } else if (a.wd_after_momentum) {
    visit_sgd_momentum<true, true>(a, f);
  } else {
    visit_sgd_momentum<true, false>(a, f);
  }
}

// One SGD step of one element, in fp32: `grad` as stored (already widened), `w` and `buf` updated
// in place (`buf` untouched without momentum). The arithmetic of torch.optim.SGD; `Options` is
// the SgdOptions of `a` (visit_sgd_options).
template <typename Options>
AMP_HOST_DEVICE inline void sgd_element(float grad, float& w, float& buf, const SgdArgs& a,
                                        float scale) {
  float g = mul_rn(grad, scale);
  if (Options::wd && !Options::wd_after_momentum) g = fma_rn(a.wd, w, g);
  if (Options::momentum) {
    buf = Options::first_run ? g : fma_rn(a.dc, g, mul_rn(buf, a.momentum));
    g = Options::nesterov ? fma_rn(a.momentum, buf, g) : buf;
  }
  if (Options::wd && Options::wd_after_momentum) g = fma_rn(a.wd, w, g);
  w = fma_rn(-a.lr, g, w);
}

// base ** step in fp64 by a fixed sequence of IEEE multiplies (the same bits everywhere, unlike a
// libm pow): base ** 2**k for the step's low 31 bits, multiplied pairwise over five levels.
AMP_HOST_DEVICE inline double power_of_step(double base, int64_t step) {
  double factors[32];
  double power = base;
  for (int k = 0; k < 32; ++k) {
    factors[k] = k < 31 && ((step >> k) & 1) ? power : 1.0;
    power = dmul_rn(power, power);
  }
  for (int width = 16; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) factors[j] = dmul_rn(factors[2 * j], factors[2 * j + 1]);
  }
  return factors[0];
}

// Adam's step number: the checked value, or read from the step tensor on the device, where the
// binding could not check it without a synchronisation; 0 when that value is not a whole number
// from 1 to 2**31 - 1 (the kernel then skips the step and raises the flag).
AMP_HOST_DEVICE inline int64_t adam_step_of(StepArg step) {
  if (step.ptr == nullptr) return step.value;
  double value;
  if (step.dtype == DType::Float32) {
    value = *static_cast<const float*>(step.ptr);
  } else if (step.dtype == DType::Int32) {
    value = *static_cast<const int32_t*>(step.ptr);
  } else {
    const int64_t wide = *static_cast<const int64_t*>(step.ptr);
    value = wide >= 1 && wide <= INT32_MAX ? static_cast<double>(wide) : 0.0;
  }
  const bool valid = value >= 1.0 && value <= static_cast<double>(INT32_MAX) && value == floor(value);
  return valid ? static_cast<int64_t>(value) : 0;
}

// The per-call factors of Adam's bias correction: -fp32(lr / (1 - beta1**step)) and
// fp32(sqrt(1 - beta2**step)), both computed in fp64.
struct AdamStepFactors {
  float neg_step_size;
  float bc2_sqrt;
};

AMP_HOST_DEVICE inline AdamStepFactors adam_step_factors(const AdamArgs& a, int64_t step) {
  if (!a.bias_correction) return {-static_cast<float>(a.lr), 1.f};
#if defined(__CUDA_ARCH__)
  const double bc1 = __dsub_rn(1.0, power_of_step(a.beta1_d, step));
  const double bc2 = __dsub_rn(1.0, power_of_step(a.beta2_d, step));
  return {-static_cast<float>(__ddiv_rn(a.lr, bc1)), static_cast<float>(__dsqrt_rn(bc2))};
#else
  const double bc1 = 1.0 - power_of_step(a.beta1_d, step);
  const double bc2 = 1.0 - power_of_step(a.beta2_d, step);
  return {-static_cast<float>(a.lr / bc1), static_cast<float>(std::sqrt(bc2))};
#endif
}

// One Adam/AdamW step of one element, in fp32: `p`, `m`, `v` updated in place. The arithmetic of
// torch.optim.Adam / AdamW (lerp for exp_avg, addcmul for exp_avg_sq, addcdiv for the update).
// kL2: Adam's weight decay (mode 0, wd != 0); kSmallW1: |1 - beta1| < 0.5 (torch's lerp rule).
// Compile-time so that the CPU loops have no branches; AdamW's decay is a multiply by `decay`,
// which is exactly 1 when there is none.
template <bool kL2, bool kSmallW1>
AMP_HOST_DEVICE inline void adam_element(float grad, float& p, float& m, float& v,
                                         const AdamArgs& a, AdamStepFactors f, float inv_scale) {
  float g = mul_rn(grad, inv_scale);
  if (kL2) g = fma_rn(a.wd, p, g);
  p = mul_rn(p, a.decay);
  const float diff = sub_rn(g, m);
  m = kSmallW1 ? fma_rn(a.w1, diff, m) : fma_rn(a.w1_minus_1, diff, g);
  v = fma_rn(mul_rn(a.w2, g), g, mul_rn(v, a.beta2));
  const float denom = add_rn(div_rn(sqrt_rn(v), f.bc2_sqrt), a.eps);
  p = add_rn(p, div_rn(mul_rn(f.neg_step_size, m), denom));
}

// LAMB (Apex's multi_tensor_lamb, "Large Batch Optimization for Deep Learning", You et al.): the
// first stage of one element, every fp32 operation rounded on its own (no fma), in Apex's order.
// `clip` is lamb_clip of the call. Updates `m` and `v` in place and returns the update, computed
// from them before they are stored (the second stage subtracts it times the tensor's ratio).
AMP_HOST_DEVICE inline float lamb_update(float grad, float p, float& m, float& v, const LambArgs& a,
                                         float inv_scale, float clip) {
  float g = div_rn(mul_rn(grad, inv_scale), clip);
  if (a.l2) g = add_rn(g, mul_rn(a.wd, p));
  m = add_rn(mul_rn(m, a.beta1), mul_rn(a.beta3, g));
  v = add_rn(mul_rn(v, a.beta2), mul_rn(mul_rn(a.w2, g), g));
  const float denom = add_rn(sqrt_rn(div_rn(v, a.bc2)), a.eps);
  float update = div_rn(div_rn(m, a.bc1), denom);
  if (a.decoupled) update = add_rn(update, mul_rn(a.wd, p));
  return update;
}

// The factor the gradients are divided by: the global gradient norm over max_grad_norm where it
// exceeds it, else 1 (a NaN norm fails the comparison, as in Apex).
AMP_HOST_DEVICE inline float lamb_clip(const LambArgs& a) {
  const float norm = read_scalar(a.global_grad_norm);
  return norm > a.max_grad_norm ? div_rn(norm, a.max_grad_norm) : 1.f;
}

// The second stage of one element: the step along the update, scaled by the tensor's ratio.
AMP_HOST_DEVICE inline float lamb_apply(float p, float update, float ratio) {
  return sub_rn(p, mul_rn(ratio, update));
}

// ---- fp32 masters as bf16 weights plus remainders (amp/_pytorch_ops/remainder.py) ----------
//
// The master's top half, rounded to nearest even, is the bf16 weight; its low half and a carry bit
// (set where the rounding went up) are kept beside it. A tensor of n elements keeps them in one
// int16 buffer: n low halves, padding to an even count (carry_offset), then ceil(n / 32) uint32
// carry words, bit j of word w for element 32 w + j.

AMP_HOST_DEVICE inline uint32_t bits_of_float(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

AMP_HOST_DEVICE inline float float_of_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// PyTorch's fp32 -> bf16 rounding (c10): to nearest even, a NaN to 0x7fc0. A select, not a
// branch, so that the CPU loops vectorise.
AMP_HOST_DEVICE inline uint16_t bf16_bits_rounded(float x) {
  const uint32_t bits = bits_of_float(x);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// Where the carry words of n elements' remainders begin, in int16 elements.
AMP_HOST_DEVICE inline int64_t carry_offset(int64_t n) { return 2 * ((n + 1) / 2); }

// The master of a bf16 weight (its bits), low half and carry bit (0 or 1); a NaN weight's is NaN.
AMP_HOST_DEVICE inline float master_from_parts(uint16_t weight, uint16_t low, uint32_t carry) {
  if ((weight & 0x7fffu) > 0x7f80u) return float_of_bits(static_cast<uint32_t>(weight) << 16);
  return float_of_bits(((static_cast<uint32_t>(weight) - carry) << 16) | low);
}

// A master's parts: returns the bf16 weight's bits; sets its low half and carry bit (0 for a NaN).
AMP_HOST_DEVICE inline uint16_t master_to_parts(float master, uint16_t& low, uint32_t& carry) {
  const uint32_t bits = bits_of_float(master);
  const uint16_t weight = bf16_bits_rounded(master);
  const bool nan = master != master;  // no payload kept: devices make NaNs differently
  low = nan ? uint16_t{0} : static_cast<uint16_t>(bits & 0xffffu);
  carry = (!nan && weight != (bits >> 16)) ? 1u : 0u;
  return weight;
}

}  // namespace amp_C
