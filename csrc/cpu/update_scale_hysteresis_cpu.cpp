// CPU twin of update_scale_hysteresis.cu (same steps, same double products rounded to fp32).
#include <cmath>

#include "../amp_C_kernels.h"

namespace amp_C {

void update_scale_hysteresis_cpu(float* current_scale, int32_t* growth_tracker,
                                 int32_t* hysteresis_tracker, const float* found_inf,
                                 double growth_factor, double backoff_factor,
                                 int32_t growth_interval, int32_t hysteresis) {
  if (*found_inf > 0.f) {
    // Hysteresis: tolerate this overflow without backing off while the tracker stays positive.
    *hysteresis_tracker -= 1;
    if (*hysteresis_tracker > 0) {
      *growth_tracker = 0;
      return;
    }
    *current_scale = static_cast<float>(*current_scale * backoff_factor);
    *growth_tracker = 0;
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const auto grown = static_cast<float>(*current_scale * growth_factor);
      if (std::isfinite(grown)) *current_scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
    *hysteresis_tracker = hysteresis;
  }
}

}  // namespace amp_C
