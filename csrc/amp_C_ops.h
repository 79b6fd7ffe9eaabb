// The amp_C operations as PyTorch sees them: argument checks, then the CPU twin or the CUDA
// launcher for the tensors' device. Signatures are Apex's; float arguments also accept a
// 1-element float32 tensor (read by the kernel, so the sync-free path never calls .item()).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

namespace amp_C {

using TensorListList = std::vector<std::vector<at::Tensor>>;
using FloatArg = std::variant<at::Tensor, double>;

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& scale);

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& a, const FloatArg& b,
                        int64_t arg_to_check);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(int64_t chunk_size,
                                                       const at::Tensor& noop_flag,
                                                       const TensorListList& tensor_lists,
                                                       std::optional<bool> per_tensor);

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_mp(int64_t chunk_size,
                                                          const at::Tensor& noop_flag,
                                                          const TensorListList& tensor_lists,
                                                          std::optional<bool> per_tensor);

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
    const FloatArg& inv_scale, std::optional<bool> per_tensor);

using StepValue = std::variant<at::Tensor, int64_t>;

// Fused optimizer steps (see amp/_torch_ops.py for the arithmetic); nothing is written when
// noop_flag is set.
void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListList& tensor_lists, double wd, double momentum,
                      double dampening, double lr, bool nesterov, bool first_run,
                      bool wd_after_momentum, const FloatArg& scale);

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, double lr, double beta1, double beta2,
                       double epsilon, const StepValue& step, int64_t mode,
                       int64_t bias_correction, double weight_decay, const FloatArg& inv_scale);

at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis, std::optional<double> min_scale,
                                   std::optional<double> max_scale,
                                   const std::optional<at::Tensor>& inv_scale,
                                   const std::optional<at::Tensor>& should_skip);

// True when amp_C holds the CUDA kernels, was built against a CUDA PyTorch and a GPU is present.
bool cuda_available();

// What this build holds, for reports (`python -m amp.check`): CUDA kernels or not, whether they
// can serve CUDA tensors (built against a CUDA PyTorch), the GPU code they were compiled to
// (SASS "sm_90", PTX "compute_90"; setup.py records them), and the CPU twins' code paths here.
struct BuildInfo {
  bool cuda_kernels;
  bool torch_cuda;
  std::vector<std::string> cuda_images;
  bool cpu_x86_64_v3_clones;
  bool cpu_runs_x86_64_v3;
  bool cpu_f16c_stores;
};
BuildInfo build_info();

}  // namespace amp_C
