// The amp_C operations (declared in amp_C_ops.h): each checks its arguments against the contract
// (amp_C_contract.h), turns them into the kernels' plain arguments, and runs the CPU twin or the
// CUDA launcher for the tensors' device. The CUDA path is compiled only when amp_C has CUDA
// kernels (AMP_WITH_CUDA_KERNELS) and PyTorch has CUDA (AMP_WITH_TORCH_CUDA): the current stream
// must come from PyTorch, whose CUDA headers a CPU-only build lacks.
#include "amp_C_ops.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "amp_C_contract.h"
#include "amp_C_host_device.h"

#if defined(AMP_WITH_CUDA_KERNELS) && defined(AMP_WITH_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#define AMP_CUDA_ENABLED 1
#else
#define AMP_CUDA_ENABLED 0
#endif

namespace amp_C {
namespace {

const std::vector<ListNames> kSgdLists = {{"grads", "weights", "momentum_bufs"},
                                          {"grads", "weights", "momentum_bufs", "model_copies"},
                                          {"grads", "weights", "momentum_bufs", "remainders"}};
const std::vector<ListNames> kAdamLists = {
    {"grads", "params", "exp_avgs", "exp_avg_sqs"},
    {"grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies"},
    {"grads", "weights", "exp_avgs", "exp_avg_sqs", "remainders"}};
const std::vector<ListNames> kLambLists = {
    {"grads", "params", "exp_avgs", "exp_avg_sqs"},
    {"grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies"}};

// Autograd must see what the kernels wrote, as it sees the fallback's in-place torch ops: a tensor
// saved for backward and then overwritten makes backward() fail instead of using stale values.
void bump_versions(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) t.unsafeGetTensorImpl()->bump_version();
}

void bump_written_versions(const TensorListList& tensor_lists, size_t first_written) {
  for (size_t k = first_written; k < tensor_lists.size(); ++k) bump_versions(tensor_lists[k]);
}

Flag flag_of(const at::Tensor& noop_flag) {
  return {noop_flag.data_ptr(),
          noop_flag.scalar_type() == at::kInt ? DType::Int32 : DType::Float32};
}

#if AMP_CUDA_ENABLED
void* current_stream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}
#endif

[[noreturn]] void no_cuda(const char* op) {
#if defined(AMP_WITH_CUDA_KERNELS)
  TORCH_CHECK(false, op, ": amp_C was built without a CUDA-enabled PyTorch, so it cannot run "
              "on CUDA tensors; rebuild it (AMP_CUDA_EXT=1) with a CUDA PyTorch installed");
#else
  TORCH_CHECK(false, op, ": amp_C was built without CUDA kernels; rebuild it with "
              "AMP_CUDA_EXT=1 to run on CUDA tensors");
#endif
}

// Runs cpu() or cuda(stream) for the device, under a guard for it.
template <typename Cpu, typename Cuda>
void on_device(const at::Device& device, const char* op, Cpu&& cpu, Cuda&& cuda) {
  if (device.is_cpu()) {
    cpu();
    return;
  }
#if AMP_CUDA_ENABLED
  const c10::DeviceGuard guard(device);
  cuda(current_stream(device));
#else
  (void)cuda;
  no_cuda(op);
#endif
}

// The l2norm family; `inv_scale` is null for the ops that take none.
std::tuple<at::Tensor, at::Tensor> l2norm(const char* op, int64_t chunk_size,
                                          const at::Tensor& noop_flag,
                                          const TensorListList& tensor_lists,
                                          const FloatArg* inv_scale, bool respect_flag,
                                          std::optional<bool> per_tensor_arg) {
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, {{"x"}});
  const TensorLists lists = check_tensors(op, chunk_size, tensor_lists, names, true);
  const bool per_tensor = per_tensor_arg.value_or(false);
  const int64_t ntensors = static_cast<int64_t>(lists.numel.size());
  const auto options = noop_flag.options().dtype(at::kFloat);
  if (ntensors == 0) return {at::zeros({1}, options), at::zeros({0}, options)};
  check_writes(op, noop_flag, tensor_lists, names, 1);
  const at::Device device = noop_flag.device();
  const Scalar s =
      inv_scale != nullptr ? scalar(op, "inv_scale", *inv_scale, device) : Scalar{1.f, nullptr};
  at::Tensor total = at::zeros({1}, options);
  at::Tensor per_tensor_norms = at::zeros({per_tensor ? ntensors : 0}, options);
  int64_t chunks = 0;
  for (int64_t numel : lists.numel) chunks += chunks_of(numel, chunk_size);
  at::Tensor scratch = at::zeros({chunks + ntensors}, options);
  const NormOutputs out{total.data_ptr<float>(),
                        per_tensor ? per_tensor_norms.data_ptr<float>() : nullptr,
                        scratch.data_ptr<float>(),
                        scratch.data_ptr<float>() + (scratch.numel() - ntensors)};
  const Flag flag = flag_of(noop_flag);
  on_device(
      device, op, [&] { multi_tensor_l2norm_cpu(chunk_size, flag, lists, s, respect_flag, out); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_l2norm_cuda(chunk_size, flag, lists, s, respect_flag, out, stream);
#endif
      });
  bump_versions({noop_flag});
  return {total, per_tensor_norms};
}

}  // namespace

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& scale) {
  const char* op = "multi_tensor_scale";
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, {{"in", "out"}});
  const TensorLists lists = check_tensors(op, chunk_size, tensor_lists, names);
  if (lists.numel.empty()) return;
  check_outputs(op, noop_flag, tensor_lists, names);
  const Scalar s = scalar(op, "scale", scale, noop_flag.device());
  const Flag flag = flag_of(noop_flag);
  on_device(
      noop_flag.device(), op, [&] { multi_tensor_scale_cpu(chunk_size, flag, lists, s); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_scale_cuda(chunk_size, flag, lists, s, stream);
#endif
      });
  bump_written_versions(tensor_lists, 1);
  bump_versions({noop_flag});
}

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& a, const FloatArg& b,
                        const HostNumber& arg_to_check) {
  const char* op = "multi_tensor_axpby";
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, {{"x", "y", "out"}});
  integer(op, "arg_to_check", arg_to_check);
  const TensorLists lists = check_tensors(op, chunk_size, tensor_lists, names);
  if (lists.numel.empty()) return;
  check_outputs(op, noop_flag, tensor_lists, names);
  const Scalar sa = scalar(op, "a", a, noop_flag.device());
  const Scalar sb = scalar(op, "b", b, noop_flag.device());
  const Flag flag = flag_of(noop_flag);
  // -1, 0 and 1 select the checked inputs; any other int, however large, checks nothing.
  const bool selects = arg_to_check.fits_int64 && arg_to_check.integer >= -1 &&
                       arg_to_check.integer <= 1;
  const int check = selects ? static_cast<int>(arg_to_check.integer) : 2;
  on_device(
      noop_flag.device(), op,
      [&] { multi_tensor_axpby_cpu(chunk_size, flag, lists, sa, sb, check); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_axpby_cuda(chunk_size, flag, lists, sa, sb, check, stream);
#endif
      });
  bump_written_versions(tensor_lists, 2);
  bump_versions({noop_flag});
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(int64_t chunk_size,
                                                       const at::Tensor& noop_flag,
                                                       const TensorListList& tensor_lists,
                                                       std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, nullptr, false,
                per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_mp(int64_t chunk_size,
                                                          const at::Tensor& noop_flag,
                                                          const TensorListList& tensor_lists,
                                                          std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, nullptr, true,
                per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
    const FloatArg& inv_scale, std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, &inv_scale,
                false, per_tensor);
}

void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListList& tensor_lists, const HostNumber& wd,
                      const HostNumber& momentum, const HostNumber& dampening,
                      const HostNumber& lr, bool nesterov, bool first_run, bool wd_after_momentum,
                      const FloatArg& scale) {
  const char* op = "multi_tensor_sgd";
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, kSgdLists);
  const double wd_d = real(op, "wd", wd);
  const double momentum_d = real(op, "momentum", momentum);
  const double dampening_d = real(op, "dampening", dampening);
  const double lr_d = real(op, "lr", lr);
  const TensorLists lists = check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names);
  if (lists.numel.empty()) return;
  const at::Device device = noop_flag.device();
  const SgdArgs args{static_cast<float>(wd_d),
                     static_cast<float>(momentum_d),
                     static_cast<float>(1.0 - dampening_d),
                     static_cast<float>(lr_d),
                     nesterov,
                     first_run,
                     wd_after_momentum,
                     scalar(op, "scale", scale, device)};
  const Flag flag = flag_of(noop_flag);
  on_device(
      device, op, [&] { multi_tensor_sgd_cpu(chunk_size, flag, lists, args); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_sgd_cuda(chunk_size, flag, lists, args, stream);
#endif
      });
  bump_written_versions(tensor_lists, 1);
}

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, const HostNumber& lr,
                       const HostNumber& beta1, const HostNumber& beta2,
                       const HostNumber& epsilon, const StepValue& step, const HostNumber& mode,
                       const HostNumber& bias_correction, const HostNumber& weight_decay,
                       const FloatArg& inv_scale) {
  const char* op = "multi_tensor_adam";
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, kAdamLists);
  const double lr_d = real(op, "lr", lr);
  const double beta1_d = real(op, "beta1", beta1);
  const double beta2_d = real(op, "beta2", beta2);
  const double epsilon_d = real(op, "epsilon", epsilon);
  check_adam_mode(op, mode);
  const bool corrected = on_off(op, "bias_correction", bias_correction);
  const double weight_decay_d = real(op, "weight_decay", weight_decay);
  const TensorLists lists = check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names);
  if (lists.numel.empty()) return;
  const at::Device device = noop_flag.device();
  AdamArgs args{};
  args.step = adam_step(op, step, device);
  args.inv_scale = scalar(op, "inv_scale", inv_scale, device);
  const bool adam_w = mode.integer == 1;
  args.wd = static_cast<float>(weight_decay_d);
  args.l2 = !adam_w && args.wd != 0.f;
  args.decay = adam_w && args.wd != 0.f ? static_cast<float>(1.0 - lr_d * weight_decay_d) : 1.f;
  args.w1 = static_cast<float>(1.0 - beta1_d);
  args.w1_minus_1 = static_cast<float>(static_cast<double>(args.w1) - 1.0);
  args.small_w1 = std::fabs(args.w1) < 0.5f;
  args.w2 = static_cast<float>(1.0 - beta2_d);
  args.beta2 = static_cast<float>(beta2_d);
  args.eps = static_cast<float>(epsilon_d);
  args.bias_correction = corrected;
  args.lr = lr_d;
  args.beta1_d = beta1_d;
  args.beta2_d = beta2_d;
  const Flag flag = flag_of(noop_flag);
  on_device(
      device, op, [&] { multi_tensor_adam_cpu(chunk_size, flag, lists, args); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_adam_cuda(chunk_size, flag, lists, args, stream);
#endif
      });
  bump_written_versions(tensor_lists, 1);
  if (args.step.ptr != nullptr) bump_versions({noop_flag});  // raised for a step out of range
}

namespace {

// fp32(1 - beta ** step), computed in fp64 (power_of_step: the same bits on every path).
float bias_correction_of(double beta, int64_t step) {
  return static_cast<float>(1.0 - power_of_step(beta, step));
}

// A 1-D view of `t` in storage order (the contract made sure it is dense), as the fallback takes.
at::Tensor flat(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}); }

// The L2 norm of each tensor, in fp32, by PyTorch: the fallback computes the same with the same op.
at::Tensor norms_of(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> norms;
  norms.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    norms.push_back(at::linalg_vector_norm(flat(t), 2, {}, false, at::kFloat));
  }
  return at::stack(norms);
}

}  // namespace

// LAMB: stage 1 (the moments and each element's update, into an fp32 scratch), then the norms of
// every param and update and each tensor's ratio by PyTorch ops (those of the fallback, so both
// paths give the same bits), then stage 2 (the step along the update times the ratio).
void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, const HostNumber& lr,
                       const HostNumber& beta1, const HostNumber& beta2,
                       const HostNumber& epsilon, const HostNumber& step,
                       const HostNumber& bias_correction, const HostNumber& weight_decay,
                       const HostNumber& grad_averaging, const HostNumber& mode,
                       const FloatArg& global_grad_norm, const HostNumber& max_grad_norm,
                       const std::optional<HostNumber>& use_nvlamb, const FloatArg& inv_scale) {
  const char* op = "multi_tensor_lamb";
  const ListNames names = check_call(op, chunk_size, noop_flag, tensor_lists, kLambLists);
  const double lr_d = real(op, "lr", lr);
  const double beta1_d = real(op, "beta1", beta1);
  const double beta2_d = real(op, "beta2", beta2);
  const double epsilon_d = real(op, "epsilon", epsilon);
  const int64_t step_n = step_number(op, step);
  const bool corrected = on_off(op, "bias_correction", bias_correction);
  const double weight_decay_d = real(op, "weight_decay", weight_decay);
  const bool averaging = on_off(op, "grad_averaging", grad_averaging);
  check_adam_mode(op, mode);
  const double max_grad_norm_d = real(op, "max_grad_norm", max_grad_norm);
  const bool nvlamb = use_nvlamb.has_value() && on_off(op, "use_nvlamb", *use_nvlamb);
  const TensorLists lists = check_fused_tensors(op, chunk_size, noop_flag, tensor_lists, names);
  if (lists.numel.empty()) return;
  const at::Device device = noop_flag.device();
  LambArgs args{};
  args.global_grad_norm = scalar(op, "global_grad_norm", global_grad_norm, device);
  args.inv_scale = scalar(op, "inv_scale", inv_scale, device);
  args.beta1 = static_cast<float>(beta1_d);
  args.beta3 = averaging ? static_cast<float>(1.0 - beta1_d) : 1.f;
  args.beta2 = static_cast<float>(beta2_d);
  args.w2 = static_cast<float>(1.0 - beta2_d);
  args.eps = static_cast<float>(epsilon_d);
  args.bc1 = corrected ? bias_correction_of(beta1_d, step_n) : 1.f;
  args.bc2 = corrected ? bias_correction_of(beta2_d, step_n) : 1.f;
  args.wd = static_cast<float>(weight_decay_d);
  args.l2 = mode.integer == 0 && args.wd != 0.f;
  args.decoupled = mode.integer == 1 && args.wd != 0.f;
  args.max_grad_norm = static_cast<float>(max_grad_norm_d);
  const Flag flag = flag_of(noop_flag);
  // A skipped step on the CPU stops here (as the fallback does); elsewhere the kernels skip.
  if (device.is_cpu() && flag_is_set(flag)) return;
  const size_t n = lists.numel.size();

  int64_t total = 0;
  for (int64_t numel : lists.numel) total += numel;
  const at::Tensor updates = at::empty({total}, noop_flag.options().dtype(at::kFloat));
  std::vector<at::Tensor> update_views;
  TensorLists stage1 = lists;
  stage1.depth = 5;
  stage1.dtype[4] = DType::Float32;
  stage1.ptr[4].resize(n);
  for (size_t i = 0, offset = 0; i < n; offset += lists.numel[i], ++i) {
    update_views.push_back(updates.narrow(0, static_cast<int64_t>(offset), lists.numel[i]));
    stage1.ptr[4][i] = update_views.back().data_ptr();
  }
  on_device(
      device, op, [&] { multi_tensor_lamb_stage1_cpu(chunk_size, flag, stage1, args); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_lamb_stage1_cuda(chunk_size, flag, stage1, args, stream);
#endif
      });

  at::Tensor ratios = at::full({static_cast<int64_t>(n)}, static_cast<float>(lr_d),
                               noop_flag.options().dtype(at::kFloat));
  if (nvlamb || args.wd != 0.f) {  // Apex's rule: the trust ratio where decayed (or NVLAMB)
    const at::Tensor param_norms = norms_of(tensor_lists[1]);
    const at::Tensor update_norms = norms_of(update_views);
    const at::Tensor trusted = param_norms.ne(0).logical_and(update_norms.ne(0));
    ratios = at::where(trusted, param_norms.div(update_norms).mul(ratios), ratios);
  }
  TensorLists stage2;
  stage2.depth = lists.depth == 5 ? 3 : 2;
  stage2.numel = lists.numel;
  stage2.dtype[0] = DType::Float32;
  stage2.ptr[0] = stage1.ptr[4];
  stage2.dtype[1] = lists.dtype[1];
  stage2.ptr[1] = lists.ptr[1];
  if (lists.depth == 5) {
    stage2.dtype[2] = lists.dtype[4];
    stage2.ptr[2] = lists.ptr[4];
  }
  on_device(
      device, op,
      [&] { multi_tensor_lamb_stage2_cpu(chunk_size, flag, stage2, ratios.data_ptr<float>()); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        // The CUDA blocks know their chunk, not their tensor's index: a ratio per chunk.
        std::vector<int64_t> chunks(n);
        int64_t total_chunks = 0;
        for (size_t i = 0; i < n; ++i) {
          chunks[i] = chunks_of(lists.numel[i], chunk_size);
          total_chunks += chunks[i];
        }
        const at::Tensor repeats = at::tensor(chunks, at::kLong).to(device);
        const at::Tensor chunk_ratios = ratios.repeat_interleave(repeats, 0, total_chunks).contiguous();
        multi_tensor_lamb_stage2_cuda(chunk_size, flag, stage2, chunk_ratios.data_ptr<float>(),
                                      stream);
#endif
      });
  bump_written_versions(tensor_lists, 1);
}

at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, const HostNumber& growth_factor,
                                   const HostNumber& backoff_factor,
                                   const HostNumber& growth_interval, const HostNumber& hysteresis,
                                   const std::optional<HostNumber>& min_scale,
                                   const std::optional<HostNumber>& max_scale,
                                   const std::optional<at::Tensor>& inv_scale,
                                   const std::optional<at::Tensor>& should_skip) {
  const char* op = "update_scale_hysteresis";
  const at::Device device = current_scale.device();
  check_state_tensor(op, "current_scale", current_scale, at::kFloat, device);
  check_state_tensor(op, "growth_tracker", growth_tracker, at::kInt, device);
  check_state_tensor(op, "hysteresis_tracker", hysteresis_tracker, at::kInt, device);
  check_state_tensor(op, "found_inf", found_inf, at::kFloat, device);
  const double gf = real(op, "growth_factor", growth_factor);
  const double bf = real(op, "backoff_factor", backoff_factor);
  const int32_t gi = int32(op, "growth_interval", growth_interval);
  const int32_t h = int32(op, "hysteresis", hysteresis);
  const std::optional<double> low = scale_bound(op, "min_scale", min_scale);
  const std::optional<double> high = scale_bound(op, "max_scale", max_scale);
  std::vector<std::pair<const char*, at::Tensor>> written = {{"current_scale", current_scale},
                                                             {"growth_tracker", growth_tracker},
                                                             {"hysteresis_tracker",
                                                              hysteresis_tracker}};
  for (const auto& [name, output] : {std::pair{"inv_scale", &inv_scale},
                                     std::pair{"should_skip", &should_skip}}) {
    if (!*output) continue;
    check_state_tensor(op, name, **output, at::kFloat, device);
    written.emplace_back(name, **output);
  }
  std::vector<at::Tensor> bumped;
  for (const auto& [name, t] : written) {
    check_writable(t, op, name);
    bumped.push_back(t);
  }
  const ScaleUpdateExtras extras{low.has_value() || high.has_value(),
                                 static_cast<float>(low.value_or(-INFINITY)),
                                 static_cast<float>(high.value_or(INFINITY)),
                                 inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                                 should_skip ? should_skip->data_ptr<float>() : nullptr};
  float* scale = current_scale.data_ptr<float>();
  int32_t* growth = growth_tracker.data_ptr<int32_t>();
  int32_t* hyst = hysteresis_tracker.data_ptr<int32_t>();
  const float* inf = found_inf.data_ptr<float>();
  on_device(
      device, op,
      [&] { update_scale_hysteresis_cpu(scale, growth, hyst, inf, gf, bf, gi, h, extras); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        update_scale_hysteresis_cuda(scale, growth, hyst, inf, gf, bf, gi, h, extras, stream);
#endif
      });
  bump_versions(bumped);
  return current_scale;
}

bool cuda_available() {
#if AMP_CUDA_ENABLED
  return at::hasCUDA();
#else
  return false;
#endif
}

// setup.py passes the images as -DAMP_CUDA_IMAGES=sm_80,compute_90 and the runtime's version as
// -DAMP_CUDA_RUNTIME=13.0 (no quotes: they would have to survive ninja's shell); the tokens are
// turned into strings here.
#define AMP_STRINGIFY_TOKENS(...) #__VA_ARGS__
#define AMP_STRINGIFY(...) AMP_STRINGIFY_TOKENS(__VA_ARGS__)

BuildInfo build_info() {
  BuildInfo info{};
#if defined(AMP_WITH_CUDA_KERNELS)
  info.cuda_kernels = true;
#endif
  info.torch_cuda = AMP_CUDA_ENABLED != 0;
#if defined(AMP_CUDA_IMAGES)
  const std::string images = AMP_STRINGIFY(AMP_CUDA_IMAGES);
  for (size_t begin = 0; begin < images.size();) {
    const size_t end = std::min(images.find(',', begin), images.size());
    info.cuda_images.push_back(images.substr(begin, end - begin));
    begin = end + 1;
  }
#endif
#if defined(AMP_CUDA_RUNTIME)
  info.cuda_runtime = AMP_STRINGIFY(AMP_CUDA_RUNTIME);
#endif
  const CpuPaths cpu = cpu_paths();
  info.cpu_x86_64_v3_clones = cpu.x86_64_v3_clones;
  info.cpu_runs_x86_64_v3 = cpu.runs_x86_64_v3;
  info.cpu_f16c_stores = cpu.f16c_stores;
  return info;
}

}  // namespace amp_C
