// Which code paths the CPU twins hold and which of them this CPU takes, so that a report
// (amp_C.build_info(), printed by `python -m amp.check`) can say what a bug report's kernels ran.
#include "multi_tensor_apply_cpu.h"

namespace amp_C {

CpuPaths cpu_paths() {
  CpuPaths paths{};
  paths.x86_64_v3_clones = AMP_CPU_HAS_CLONES != 0;
#if AMP_CPU_HAS_CLONES
  // The question the clones' resolver asks (GCC picks the x86-64-v3 clone on such a CPU).
  __builtin_cpu_init();
  paths.runs_x86_64_v3 = __builtin_cpu_supports("x86-64-v3") != 0;
#endif
  paths.f16c_stores = cpu::to_half_uses_f16c();
  return paths;
}

}  // namespace amp_C
