// update_scale_hysteresis: Apex's device-side loss-scale update (amp_C_host_device.h), run by one
// thread so that the host never synchronises.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

__global__ void update_scale_hysteresis_kernel(float* current_scale, int32_t* growth_tracker,
                                               int32_t* hysteresis_tracker, const float* found_inf,
                                               double growth_factor, double backoff_factor,
                                               int32_t growth_interval, int32_t hysteresis,
                                               ScaleUpdateExtras extras) {
  update_scale_hysteresis_step(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                               growth_factor, backoff_factor, growth_interval, hysteresis, extras);
}

}  // namespace

void update_scale_hysteresis_cuda(float* current_scale, int32_t* growth_tracker,
                                  int32_t* hysteresis_tracker, const float* found_inf,
                                  double growth_factor, double backoff_factor,
                                  int32_t growth_interval, int32_t hysteresis,
                                  ScaleUpdateExtras extras, void* stream) {
  update_scale_hysteresis_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, extras);
  check_cuda(cudaGetLastError(), "update_scale_hysteresis kernel launch");
}

}  // namespace amp_C
