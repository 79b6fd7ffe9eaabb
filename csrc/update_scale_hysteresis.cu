// update_scale_hysteresis: Apex's device-side loss-scale update, one thread, no host sync.
// As in Apex, the fp32 scale is multiplied by a double factor and the product rounded once to fp32.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

__global__ void update_scale_hysteresis_kernel(float* current_scale, int32_t* growth_tracker,
                                               int32_t* hysteresis_tracker, const float* found_inf,
                                               double growth_factor, double backoff_factor,
                                               int32_t growth_interval, int32_t hysteresis) {
  const bool overflow = *found_inf > 0.f;
  if (overflow) {
    // Hysteresis: tolerate this overflow without backing off while the tracker stays positive.
    *hysteresis_tracker -= 1;
    if (*hysteresis_tracker > 0) {
      *growth_tracker = 0;
      return;
    }
    *current_scale = __double2float_rn(__dmul_rn(*current_scale, backoff_factor));
    *growth_tracker = 0;
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const float grown = __double2float_rn(__dmul_rn(*current_scale, growth_factor));
      if (isfinite(grown)) *current_scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
    *hysteresis_tracker = hysteresis;
  }
}

}  // namespace

void update_scale_hysteresis_cuda(float* current_scale, int32_t* growth_tracker,
                                  int32_t* hysteresis_tracker, const float* found_inf,
                                  double growth_factor, double backoff_factor,
                                  int32_t growth_interval, int32_t hysteresis, void* stream) {
  update_scale_hysteresis_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis);
  check_cuda(cudaGetLastError(), "update_scale_hysteresis kernel launch");
}

}  // namespace amp_C
