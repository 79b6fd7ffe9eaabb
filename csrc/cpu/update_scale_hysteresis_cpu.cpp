// CPU twin of update_scale_hysteresis.cu: the same step (amp_C_host_device.h), run on the host.
#include "../amp_C_host_device.h"

namespace amp_C {

void update_scale_hysteresis_cpu(float* current_scale, int32_t* growth_tracker,
                                 int32_t* hysteresis_tracker, const float* found_inf,
                                 double growth_factor, double backoff_factor,
                                 int32_t growth_interval, int32_t hysteresis,
                                 ScaleUpdateExtras extras) {
  update_scale_hysteresis_step(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                               growth_factor, backoff_factor, growth_interval, hysteresis, extras);
}

}  // namespace amp_C
