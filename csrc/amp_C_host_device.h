// Scalar logic shared by the CPU twins and the CUDA kernels, written once.
//
// AMP_HOST_DEVICE makes a function callable from host and device code under nvcc and is empty in
// the C++ compile, so these helpers must only use what both sides have (<cfloat>, <cmath>'s
// fabsf, double arithmetic, which rounds to nearest even on both).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

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

}  // namespace amp_C
