// Argument checks and device dispatch for the amp_C operations (declared in amp_C_ops.h).
//
// Apex checked only the first tensor of each list; here every tensor's dtype, device, density and
// size is checked, and the error names the list and index. Like Apex and the pure-torch fallback,
// tensors are walked as flat storage: elements pair up in memory order, whatever the layout. The CUDA path is compiled only when
// amp_C has CUDA kernels (AMP_WITH_CUDA_KERNELS) and PyTorch has CUDA (AMP_WITH_TORCH_CUDA):
// the current stream must come from PyTorch, whose CUDA headers a CPU-only build lacks.
#include "amp_C_ops.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "amp_C_host_device.h"

#if defined(AMP_WITH_CUDA_KERNELS) && defined(AMP_WITH_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#define AMP_CUDA_ENABLED 1
#else
#define AMP_CUDA_ENABLED 0
#endif

namespace amp_C {
namespace {

DType float_dtype(const at::Tensor& t, const char* op, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default:
      TORCH_CHECK_VALUE(false, op, ": ", what, " has dtype ", t.scalar_type(),
                  "; amp_C supports float32, float16 and bfloat16");
  }
}

std::string where(size_t list, size_t index) {
  return "tensor_lists[" + std::to_string(list) + "][" + std::to_string(index) + "]";
}

// Checked before anything is written: autograd refuses the version bump of an inference tensor
// outside inference mode, and by then the kernel would already have run.
void check_writable(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
              " is an inference tensor, which cannot be updated in place outside "
              "torch.inference_mode(); pass a tensor created outside inference mode (or a clone)");
}

// Autograd must see what the kernels wrote, as it sees the fallback's in-place torch ops: a tensor
// saved for backward and then overwritten makes backward() fail instead of using stale values.
void bump_versions(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) t.unsafeGetTensorImpl()->bump_version();
}

// A tensor's bytes, and where it sits in tensor_lists; ordered by address first.
struct Range {
  uintptr_t begin;
  uintptr_t end;
  size_t list;
  size_t index;
  bool operator<(const Range& o) const {
    return std::tie(begin, end, list, index) < std::tie(o.begin, o.end, o.list, o.index);
  }
  bool same_bytes(const Range& o) const { return begin == o.begin && end == o.end; }
};

// The output list is the last one. Its tensors are written in parallel with the reads of all the
// lists, so an output may share memory only with the inputs at its own index, and only exactly (in
// place, as Apex's scale(x, x)). The same walk as the fallback's, so the same pair is named: byte
// ranges sorted, identical ranges grouped, then each group checked against the earlier ones.
void check_outputs(const char* op, const TensorListList& tensor_lists) {
  const size_t out_list = tensor_lists.size() - 1;
  for (size_t i = 0; i < tensor_lists[out_list].size(); ++i) {
    check_writable(tensor_lists[out_list][i], op, where(out_list, i));
  }
  std::vector<Range> ranges;
  for (size_t k = 0; k < tensor_lists.size(); ++k) {
    for (size_t i = 0; i < tensor_lists[k].size(); ++i) {
      const at::Tensor& t = tensor_lists[k][i];
      if (t.numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.push_back({begin, begin + t.nbytes(), k, i});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  const auto refuse = [&](const Range& a, const Range& b) {
    TORCH_CHECK_VALUE(false, op, ": ", where(a.list, a.index), " overlaps ", where(b.list, b.index),
                      " in memory; an output may share memory only with its own inputs at the "
                      "same index (in place), so pass separate tensors");
  };
  const Range* widest = nullptr;      // the earlier group reaching furthest
  const Range* widest_out = nullptr;  // the same among groups holding an output
  for (size_t g = 0; g < ranges.size();) {
    size_t end = g;
    const Range* out = nullptr;
    for (; end < ranges.size() && ranges[end].same_bytes(ranges[g]); ++end) {
      if (out == nullptr && ranges[end].list == out_list) out = &ranges[end];
    }
    for (size_t m = g; out != nullptr && m < end; ++m) {
      const Range& r = ranges[m];
      if (&r != out && (r.list == out_list || r.index != out->index)) refuse(r, *out);
    }
    const Range& group = out != nullptr ? *out : ranges[g];
    const Range* earlier = out != nullptr ? widest : widest_out;
    if (earlier != nullptr && group.begin < earlier->end) refuse(group, *earlier);
    if (widest == nullptr || group.end > widest->end) widest = &group;
    if (out != nullptr && (widest_out == nullptr || group.end > widest_out->end)) {
      widest_out = &group;
    }
    g = end;
  }
}

// Checks `tensor_lists` and returns its raw view. Zero tensors give an empty view (a no-op).
TensorLists view_lists(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, size_t depth, const char* lists_doc) {
  TORCH_CHECK_VALUE(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
  TORCH_CHECK_VALUE(tensor_lists.size() == depth, op, " expects ", depth, " tensor lists ", lists_doc,
              ", got ", tensor_lists.size());
  TensorLists lists;
  lists.depth = static_cast<int>(depth);
  const size_t n = tensor_lists[0].size();
  for (size_t k = 1; k < depth; ++k) {
    TORCH_CHECK_VALUE(tensor_lists[k].size() == n, op, ": tensor_lists[", k, "] has ",
                tensor_lists[k].size(), " tensors but tensor_lists[0] has ", n,
                "; every list needs one tensor per parameter");
  }
  TORCH_CHECK_VALUE(noop_flag.numel() == 1 && (noop_flag.scalar_type() == at::kInt ||
                                         noop_flag.scalar_type() == at::kFloat),
              op, ": noop_flag must be a 1-element int32 or float32 tensor, got ",
              noop_flag.scalar_type(), " with ", noop_flag.numel(), " elements");
  if (n == 0) return lists;
  const at::Tensor& first = tensor_lists[0][0];
  TORCH_CHECK_VALUE(first.device().is_cpu() || first.device().is_cuda(), op,
              ": tensors must be on CPU or CUDA, got ", first.device());
  TORCH_CHECK_VALUE(noop_flag.device() == first.device(), op, ": noop_flag is on ", noop_flag.device(),
              " but the tensors are on ", first.device(), "; create the flag on their device");
  TORCH_CHECK_VALUE(noop_flag.is_contiguous(), op, ": noop_flag must be contiguous");
  check_writable(noop_flag, op, "noop_flag");
  lists.numel.resize(n);
  for (size_t k = 0; k < depth; ++k) {
    lists.dtype[k] = float_dtype(tensor_lists[k][0], op, where(k, 0));
    lists.ptr[k].resize(n);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = tensor_lists[k][i];
      const at::Tensor& t0 = tensor_lists[0][i];
      TORCH_CHECK_VALUE(t.device() == first.device(), op, ": ", where(k, i), " is on ", t.device(),
                  " but ", where(0, 0), " is on ", first.device(),
                  "; call once per device");
      TORCH_CHECK_VALUE(float_dtype(t, op, where(k, i)) == lists.dtype[k], op, ": ", where(k, i),
                  " has dtype ", t.scalar_type(), " but ", where(k, 0), " has ",
                  tensor_lists[k][0].scalar_type(), "; a list must hold one dtype (group the "
                  "tensors by dtype and call once per group)");
      TORCH_CHECK_VALUE(t.numel() == t0.numel(), op, ": ", where(k, i), " has ", t.numel(),
                  " elements but ", where(0, i), " has ", t0.numel());
      TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.is_non_overlapping_and_dense(), op, ": ",
                  where(k, i), " is not dense (a view with gaps or overlaps); pass .contiguous()");
      lists.ptr[k][i] = t.data_ptr();
    }
  }
  for (size_t i = 0; i < n; ++i) lists.numel[i] = tensor_lists[0][i].numel();
  return lists;
}

Flag flag_of(const at::Tensor& noop_flag) {
  return {noop_flag.data_ptr(),
          noop_flag.scalar_type() == at::kInt ? DType::Int32 : DType::Float32};
}

// A float argument for tensors on `device`: a number, or a 1-element float32 tensor on `device`
// (read by the kernel) or on the CPU (read here, which costs no device synchronisation).
Scalar scalar_of(const FloatArg& arg, const at::Device& device, const char* op,
                 const char* name) {
  if (const double* value = std::get_if<double>(&arg)) return {static_cast<float>(*value), nullptr};
  const at::Tensor& t = std::get<at::Tensor>(arg);
  TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a float or a 1-element float32 tensor, got a ", t.scalar_type(),
              " tensor with ", t.numel(), " elements");
  if (t.device().is_cpu()) return {t.item<float>(), nullptr};
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but the tensors are on ", device);
  return {0.f, t.data_ptr<float>()};
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

std::tuple<at::Tensor, at::Tensor> l2norm(const char* op, int64_t chunk_size,
                                          const at::Tensor& noop_flag,
                                          const TensorListList& tensor_lists,
                                          const FloatArg& inv_scale, bool respect_flag,
                                          std::optional<bool> per_tensor_arg) {
  const TensorLists lists = view_lists(op, chunk_size, noop_flag, tensor_lists, 1, "[x]");
  const bool per_tensor = per_tensor_arg.value_or(false);
  const int64_t ntensors = static_cast<int64_t>(lists.numel.size());
  const auto options = noop_flag.options().dtype(at::kFloat);
  at::Tensor total = at::zeros({1}, options);
  at::Tensor per_tensor_norms = at::zeros({per_tensor ? ntensors : 0}, options);
  if (ntensors == 0) return {total, per_tensor_norms};
  const at::Device device = noop_flag.device();
  int64_t chunks = 0;
  for (int64_t numel : lists.numel) chunks += chunks_of(numel, chunk_size);
  at::Tensor scratch = at::zeros({chunks + ntensors}, options);
  const NormOutputs out{total.data_ptr<float>(),
                        per_tensor ? per_tensor_norms.data_ptr<float>() : nullptr,
                        scratch.data_ptr<float>(),
                        scratch.data_ptr<float>() + (scratch.numel() - ntensors)};
  const Scalar s = scalar_of(inv_scale, device, op, "inv_scale");
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

// ---- fused optimizer steps: the same checks as amp/_torch_ops.py, in the same order ----------

// Every tensor of a fused optimizer op is written except the grads, and they are all read and
// written in parallel, so no two may share a byte. Names the first overlapping pair by address.
void check_no_shared_memory(const char* op, const TensorListList& tensor_lists) {
  std::vector<Range> ranges;
  for (size_t k = 0; k < tensor_lists.size(); ++k) {
    for (size_t i = 0; i < tensor_lists[k].size(); ++i) {
      const at::Tensor& t = tensor_lists[k][i];
      if (t.nbytes() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      ranges.push_back({begin, begin + t.nbytes(), k, i});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t r = 1; r < ranges.size(); ++r) {
    TORCH_CHECK_VALUE(ranges[r].begin >= ranges[r - 1].end, op, ": ",
                      where(ranges[r - 1].list, ranges[r - 1].index), " and ",
                      where(ranges[r].list, ranges[r].index),
                      " share memory; every grad, weight, state and model-copy tensor must be a "
                      "separate tensor");
  }
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    default: return "int32";
  }
}

// The accepted dtype combinations (see _check_fused_dtypes in amp/_torch_ops.py).
void check_fused_dtypes(const char* op, const TensorLists& lists,
                        const std::vector<std::string>& names, bool is_adam) {
  const bool has_copies = names.back() == "model_copies";
  const int masters_end = lists.depth - (has_copies ? 1 : 0);
  bool fp32_masters = true;
  bool one_dtype = true;
  for (int k = 1; k < lists.depth; ++k) {
    if (k < masters_end) fp32_masters &= lists.dtype[k] == DType::Float32;
    one_dtype &= lists.dtype[k] == lists.dtype[0];
  }
  const bool low_grads = lists.dtype[0] != DType::Float32;
  bool ok = one_dtype;
  if (has_copies) {
    ok = fp32_masters && lists.dtype[lists.depth - 1] != DType::Float32;
  } else if (is_adam && low_grads && fp32_masters) {
    ok = true;
  }
  if (ok) return;
  std::string combination;
  for (int k = 0; k < lists.depth; ++k) {
    combination += (k ? ", " : "") + names[k] + " " + dtype_name(lists.dtype[k]);
  }
  TORCH_CHECK_VALUE(false, op, ": unsupported dtype combination (", combination,
                    "); supported: one dtype for every list",
                    is_adam ? ", fp16/bf16 grads with fp32 params and state" : "",
                    ", or with a model_copies list fp32 weights and state and fp16/bf16 copies");
}

// Checks the lists of a fused optimizer op; `forms` holds the accepted list counts and names.
TensorLists view_fused_lists(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                             const TensorListList& tensor_lists,
                             const std::vector<std::vector<std::string>>& forms, bool is_adam) {
  TORCH_CHECK_VALUE(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
  const std::vector<std::string>* names = nullptr;
  std::string expected;
  for (const auto& form : forms) {
    if (form.size() == tensor_lists.size()) names = &form;
    std::string joined;
    for (const auto& name : form) joined += (joined.empty() ? "" : ", ") + name;
    expected += (expected.empty() ? "" : " or ") + std::to_string(form.size()) + " [" + joined + "]";
  }
  TORCH_CHECK_VALUE(names != nullptr, op, " expects ", expected, " tensor lists, got ",
                    tensor_lists.size());
  const TensorLists lists =
      view_lists(op, chunk_size, noop_flag, tensor_lists, names->size(), expected.c_str());
  if (lists.numel.empty()) return lists;
  check_fused_dtypes(op, lists, *names, is_adam);
  check_no_shared_memory(op, tensor_lists);
  for (size_t k = 1; k < tensor_lists.size(); ++k) {
    for (size_t i = 0; i < tensor_lists[k].size(); ++i) {
      check_writable(tensor_lists[k][i], op, where(k, i) + " (" + (*names)[k] + ")");
    }
  }
  return lists;
}

void bump_written_versions(const TensorListList& tensor_lists) {
  for (size_t k = 1; k < tensor_lists.size(); ++k) bump_versions(tensor_lists[k]);
}

}  // namespace

void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListList& tensor_lists, double wd, double momentum,
                      double dampening, double lr, bool nesterov, bool first_run,
                      bool wd_after_momentum, const FloatArg& scale) {
  const char* op = "multi_tensor_sgd";
  const TensorLists lists = view_fused_lists(
      op, chunk_size, noop_flag, tensor_lists,
      {{"grads", "weights", "momentum_bufs"}, {"grads", "weights", "momentum_bufs", "model_copies"}},
      false);
  if (lists.numel.empty()) return;
  const at::Device device = noop_flag.device();
  const SgdArgs args{static_cast<float>(wd),
                     static_cast<float>(momentum),
                     static_cast<float>(1.0 - dampening),
                     static_cast<float>(lr),
                     nesterov,
                     first_run,
                     wd_after_momentum,
                     scalar_of(scale, device, op, "scale")};
  const Flag flag = flag_of(noop_flag);
  on_device(
      device, op, [&] { multi_tensor_sgd_cpu(chunk_size, flag, lists, args); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_sgd_cuda(chunk_size, flag, lists, args, stream);
#endif
      });
  bump_written_versions(tensor_lists);
}

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListList& tensor_lists, double lr, double beta1, double beta2,
                       double epsilon, const StepValue& step, int64_t mode,
                       int64_t bias_correction, double weight_decay, const FloatArg& inv_scale) {
  const char* op = "multi_tensor_adam";
  const TensorLists lists = view_fused_lists(
      op, chunk_size, noop_flag, tensor_lists,
      {{"grads", "params", "exp_avgs", "exp_avg_sqs"},
       {"grads", "params", "exp_avgs", "exp_avg_sqs", "model_copies"}},
      true);
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW), got ", mode);
  if (lists.numel.empty()) return;
  const at::Device device = noop_flag.device();
  const Scalar s = scalar_of(inv_scale, device, op, "inv_scale");
  // The step as an int64 the kernel reads (converted on the device's stream: no synchronisation).
  at::Tensor step_tensor;
  StepArg step_arg{0, nullptr};
  if (const int64_t* value = std::get_if<int64_t>(&step)) {
    TORCH_CHECK_VALUE(*value >= 1 && *value <= std::numeric_limits<int32_t>::max(), op,
                      ": step is the step number after this update, 1 to ",
                      std::numeric_limits<int32_t>::max(), "; got ", *value);
    step_arg.value = *value;
  } else {
    const at::Tensor& t = std::get<at::Tensor>(step);
    TORCH_CHECK_VALUE(t.numel() == 1 &&
                          (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong ||
                           t.scalar_type() == at::kFloat) &&
                          t.device() == device,
                      op, ": step must be a Python int or a 1-element int32, int64 or float32 "
                      "tensor on ", device, ", got a ", t.scalar_type(), " tensor of ", t.numel(),
                      " elements on ", t.device());
    step_tensor = t.reshape({1}).to(at::kLong).contiguous();
    step_arg.ptr = step_tensor.data_ptr<int64_t>();
  }
  AdamArgs args{};
  args.wd = static_cast<float>(weight_decay);
  args.l2 = mode == 0 && args.wd != 0.f;
  args.decay = mode == 1 && args.wd != 0.f ? static_cast<float>(1.0 - lr * weight_decay) : 1.f;
  args.w1 = static_cast<float>(1.0 - beta1);
  args.w1_minus_1 = static_cast<float>(static_cast<double>(args.w1) - 1.0);
  args.small_w1 = std::fabs(args.w1) < 0.5f;
  args.w2 = static_cast<float>(1.0 - beta2);
  args.beta2 = static_cast<float>(beta2);
  args.eps = static_cast<float>(epsilon);
  args.bias_correction = bias_correction != 0;
  args.lr = lr;
  args.beta1_d = beta1;
  args.beta2_d = beta2;
  args.inv_scale = s;
  args.step = step_arg;
  const Flag flag = flag_of(noop_flag);
  on_device(
      device, op, [&] { multi_tensor_adam_cpu(chunk_size, flag, lists, args); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_adam_cuda(chunk_size, flag, lists, args, stream);
#endif
      });
  bump_written_versions(tensor_lists);
}

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& scale) {
  const char* op = "multi_tensor_scale";
  const TensorLists lists = view_lists(op, chunk_size, noop_flag, tensor_lists, 2, "[in, out]");
  if (lists.numel.empty()) return;
  check_outputs(op, tensor_lists);
  const Scalar s = scalar_of(scale, noop_flag.device(), op, "scale");
  const Flag flag = flag_of(noop_flag);
  on_device(
      noop_flag.device(), op, [&] { multi_tensor_scale_cpu(chunk_size, flag, lists, s); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_scale_cuda(chunk_size, flag, lists, s, stream);
#endif
      });
  bump_versions(tensor_lists[1]);
  bump_versions({noop_flag});
}

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListList& tensor_lists, const FloatArg& a, const FloatArg& b,
                        int64_t arg_to_check) {
  const char* op = "multi_tensor_axpby";
  const TensorLists lists = view_lists(op, chunk_size, noop_flag, tensor_lists, 3, "[x, y, out]");
  if (lists.numel.empty()) return;
  check_outputs(op, tensor_lists);
  const Scalar sa = scalar_of(a, noop_flag.device(), op, "a");
  const Scalar sb = scalar_of(b, noop_flag.device(), op, "b");
  const Flag flag = flag_of(noop_flag);
  // -1, 0 and 1 select the checked inputs; any other value, however large, checks nothing.
  const int check = arg_to_check >= -1 && arg_to_check <= 1 ? static_cast<int>(arg_to_check) : 2;
  on_device(
      noop_flag.device(), op, [&] { multi_tensor_axpby_cpu(chunk_size, flag, lists, sa, sb, check); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        multi_tensor_axpby_cuda(chunk_size, flag, lists, sa, sb, check, stream);
#endif
      });
  bump_versions(tensor_lists[2]);
  bump_versions({noop_flag});
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(int64_t chunk_size,
                                                       const at::Tensor& noop_flag,
                                                       const TensorListList& tensor_lists,
                                                       std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, 1.0, false,
                per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_mp(int64_t chunk_size,
                                                          const at::Tensor& noop_flag,
                                                          const TensorListList& tensor_lists,
                                                          std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, 1.0, true,
                per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
    const FloatArg& inv_scale, std::optional<bool> per_tensor) {
  return l2norm("multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, inv_scale,
                false, per_tensor);
}

at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis, std::optional<double> min_scale,
                                   std::optional<double> max_scale,
                                   const std::optional<at::Tensor>& inv_scale,
                                   const std::optional<at::Tensor>& should_skip) {
  const char* op = "update_scale_hysteresis";
  const auto check = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() == dtype, op, ": ", name, " must be a 1-element ",
                dtype, " tensor, got ", t.scalar_type(), " with ", t.numel(), " elements");
    TORCH_CHECK_VALUE(t.device() == current_scale.device(), op, ": ", name, " is on ", t.device(),
                " but current_scale is on ", current_scale.device());
  };
  const auto check_int32 = [&](int64_t value, const char* name) {
    TORCH_CHECK_VALUE(value >= std::numeric_limits<int32_t>::min() &&
                          value <= std::numeric_limits<int32_t>::max(),
                      op, ": ", name, " must fit in int32 (the trackers' dtype), got ", value);
  };
  check(current_scale, at::kFloat, "current_scale");
  check(growth_tracker, at::kInt, "growth_tracker");
  check(hysteresis_tracker, at::kInt, "hysteresis_tracker");
  check(found_inf, at::kFloat, "found_inf");
  check_int32(growth_interval, "growth_interval");
  check_int32(hysteresis, "hysteresis");
  // A bound is rounded to fp32 as torch.clamp rounds it, so it must be one fp32 can hold.
  const auto check_bound = [&](std::optional<double> value, const char* name) {
    TORCH_CHECK_VALUE(!value || std::isinf(*value) || std::fabs(*value) <= FLT_MAX, op, ": ", name,
                      " must be None, inf or a number within fp32's range, got ", *value);
  };
  check_bound(min_scale, "min_scale");
  check_bound(max_scale, "max_scale");
  check_writable(current_scale, op, "current_scale");
  check_writable(growth_tracker, op, "growth_tracker");
  check_writable(hysteresis_tracker, op, "hysteresis_tracker");
  std::vector<at::Tensor> written = {current_scale, growth_tracker, hysteresis_tracker};
  const auto output = [&](const std::optional<at::Tensor>& t, const char* name) -> float* {
    if (!t) return nullptr;
    check(*t, at::kFloat, name);
    check_writable(*t, op, name);
    written.push_back(*t);
    return t->data_ptr<float>();
  };
  // Braced initialisers run left to right: the outputs are checked in argument order.
  const ScaleUpdateExtras extras{min_scale.has_value() || max_scale.has_value(),
                                 static_cast<float>(min_scale.value_or(-INFINITY)),
                                 static_cast<float>(max_scale.value_or(INFINITY)),
                                 output(inv_scale, "inv_scale"), output(should_skip, "should_skip")};
  float* scale = current_scale.data_ptr<float>();
  int32_t* growth = growth_tracker.data_ptr<int32_t>();
  int32_t* hyst = hysteresis_tracker.data_ptr<int32_t>();
  const float* inf = found_inf.data_ptr<float>();
  const double gf = growth_factor;
  const double bf = backoff_factor;
  const auto gi = static_cast<int32_t>(growth_interval);
  const auto h = static_cast<int32_t>(hysteresis);
  on_device(
      current_scale.device(), op,
      [&] { update_scale_hysteresis_cpu(scale, growth, hyst, inf, gf, bf, gi, h, extras); },
      [&](void* stream) {
#if AMP_CUDA_ENABLED
        update_scale_hysteresis_cuda(scale, growth, hyst, inf, gf, bf, gi, h, extras, stream);
#endif
      });
  bump_versions(written);
  return current_scale;
}

bool cuda_available() {
#if AMP_CUDA_ENABLED
  return at::hasCUDA();
#else
  return false;
#endif
}

// setup.py passes the images as -DAMP_CUDA_IMAGES=sm_80,compute_90 (no quotes: they would have
// to survive ninja's shell); the tokens are turned into one string here.
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
  const CpuPaths cpu = cpu_paths();
  info.cpu_x86_64_v3_clones = cpu.x86_64_v3_clones;
  info.cpu_runs_x86_64_v3 = cpu.runs_x86_64_v3;
  info.cpu_f16c_stores = cpu.f16c_stores;
  return info;
}

}  // namespace amp_C
