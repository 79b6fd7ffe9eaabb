// The amp_C operations as PyTorch sees them: the argument contract (amp_C_contract.h), then the
// CPU twin or the CUDA launcher for the tensors' device. Signatures are Apex's; float arguments
// also accept a 1-element float32 tensor.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

namespace amp_C {

using TensorListList = std::vector<std::vector<at::Tensor>>;

// A number argument as the Python caller passed it. The binding takes any object for these and
// records what it was; the contract (amp_C_contract.h) then checks its type and value with the
// messages of amp/_pytorch_ops/contract.py (pybind11's own conversions would take True for 1, and
// refuse a float where an int is due with a generic signature error).
struct HostNumber {
  enum class Kind { Int, Float, Bool, Other };
  Kind kind = Kind::Other;
  double real = 0.0;         // an int's or a float's value
  bool fits_double = true;   // false for an int beyond a double's range
  int64_t integer = 0;       // an int's (or a bool's) value, when it fits in int64
  bool fits_int64 = false;
  std::string text;          // str() of an int or a float, for messages
  std::string type_name;     // type(value).__name__, for messages
};

// A float argument: a number, or a 1-element float32 tensor (read by the kernel, so the sync-free
// path never calls .item()).
using FloatArg = std::variant<at::Tensor, HostNumber>;

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& scale);

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& a, const FloatArg& b,
                        const HostNumber& arg_to_check);

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

// Adam's step number: an int, or a 1-element int32, int64 or float32 tensor.
using StepValue = std::variant<at::Tensor, HostNumber>;

// Fused optimizer steps (see amp/_pytorch_ops/sgd.py and adam.py for the arithmetic); nothing is
// written when noop_flag is set.
void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListList& tensor_lists, const HostNumber& wd,
                      const HostNumber& momentum, const HostNumber& dampening,
                      const HostNumber& lr, bool nesterov, bool first_run, bool wd_after_momentum,
                      const FloatArg& scale);

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, const HostNumber& lr,
                       const HostNumber& beta1, const HostNumber& beta2,
                       const HostNumber& epsilon, const StepValue& step, const HostNumber& mode,
                       const HostNumber& bias_correction, const HostNumber& weight_decay,
                       const FloatArg& inv_scale);

// Apex's fused LAMB step, with amp's inv_scale; `use_nvlamb` None is False.
void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, const HostNumber& lr,
                       const HostNumber& beta1, const HostNumber& beta2,
                       const HostNumber& epsilon, const HostNumber& step,
                       const HostNumber& bias_correction, const HostNumber& weight_decay,
                       const HostNumber& grad_averaging, const HostNumber& mode,
                       const FloatArg& global_grad_norm, const HostNumber& max_grad_norm,
                       const std::optional<HostNumber>& use_nvlamb, const FloatArg& inv_scale);

at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, const HostNumber& growth_factor,
                                   const HostNumber& backoff_factor,
                                   const HostNumber& growth_interval, const HostNumber& hysteresis,
                                   const std::optional<HostNumber>& min_scale,
                                   const std::optional<HostNumber>& max_scale,
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
  std::string cuda_runtime;  // the CUDA runtime linked in statically ("13.0"); empty without CUDA
  bool cpu_x86_64_v3_clones;
  bool cpu_runs_x86_64_v3;
  bool cpu_f16c_stores;
};
BuildInfo build_info();

}  // namespace amp_C
