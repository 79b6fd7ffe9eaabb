// The argument contract of the amp_C operations (amp_C_contract.h): the mirror of
// amp/_pytorch_ops/contract.py and contract_coefficients.py, function for function, message for
// message.
#include "amp_C_contract.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <tuple>

#include "amp_C_host_device.h"

namespace amp_C {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxAdamStep = kInt32Max;
const double kFp32Max = std::numeric_limits<float>::max();

// A dtype as Python prints it: torch.float32, torch.int64, ...
std::string torch_name(at::ScalarType type) {
  switch (type) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {
      // The others' Python names are c10's in lower case (torch.bfloat16, torch.float8_e4m3fn...).
      std::string name = c10::toString(type);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      return "torch." + name;
    }
  }
}

std::string where(size_t list, size_t index, const ListNames& names) {
  return "tensor_lists[" + std::to_string(list) + "][" + std::to_string(index) + "] (" +
         names[list] + ")";
}

int64_t chunks_of_tensor(int64_t numel, int64_t chunk_size) {
  return numel == 0 ? 0 : (numel - 1) / chunk_size + 1;
}

// The kernels' tag of a checked list's dtype: a float dtype, or int16 for remainders.
DType kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kShort: return DType::Int16;
    default: return DType::Float32;
  }
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::Int16: return "int16";
    default: return "bfloat16";
  }
}

// remainder.packed_numel: the int16 elements of n elements' remainders (amp_C_host_device.h).
int64_t packed_numel(int64_t n) { return carry_offset(n) + 2 * ((n + 31) / 32); }

// Whether a last list is remainders: its first tensor is int16.
bool holds_remainders(const std::vector<at::Tensor>& tensors) {
  return !tensors.empty() && tensors[0].scalar_type() == at::kShort;
}

bool is_supported(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// Whether `t` stores its elements in the order `ref` stores its own (equal numels).
bool same_layout(const at::Tensor& t, const at::Tensor& ref) {
  if (t.numel() == 0) return true;
  if (t.sizes() != ref.sizes()) return t.is_contiguous() && ref.is_contiguous();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != ref.stride(d)) return false;
  }
  return true;
}

// Rule 5 for a tensor of remainders: int16, on its device, 4-byte aligned, contiguous and packed
// for `ref`'s numel.
void check_remainders(const char* op, const at::Tensor& t, const at::Tensor& ref,
                      const std::string& here, const at::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kShort, op, ": ", here, " has dtype ",
                    torch_name(t.scalar_type()), "; remainders are int16");
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", here, " is on ", t.device(),
                    " but tensor_lists[0][0] is on ", device,
                    "; group the tensors by device and call once per device");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, op, ": ", here,
                    " starts at an address that is not a multiple of 4 bytes; its carry words are "
                    "int32: give the remainders a tensor of their own (remainder.new_remainders)");
  const int64_t expected = packed_numel(ref.numel());
  TORCH_CHECK_VALUE(t.numel() == expected && t.is_contiguous(), op, ": ", here, " has ",
                    t.numel(), " elements", t.is_contiguous() ? "" : " (not contiguous)",
                    "; the remainders of ", ref.numel(),
                    " elements are a contiguous int16 tensor of ", expected,
                    " (amp._pytorch_ops.remainder.packed_numel)");
}

void check_tensor(const char* op, const TensorListList& tensor_lists, const ListNames& names,
                  size_t k, size_t i) {
  const at::Tensor& t = tensor_lists[k][i];
  const at::Tensor& first = tensor_lists[k][0];
  const at::Tensor& ref = tensor_lists[0][i];
  const std::string here = where(k, i, names);
  if (names[k] == "remainders") {
    check_remainders(op, t, ref, here, tensor_lists[0][0].device());
    return;
  }
  TORCH_CHECK_VALUE(i != 0 || is_supported(t.scalar_type()), op, ": ", here, " has dtype ",
                    torch_name(t.scalar_type()),
                    "; only float32, float16 and bfloat16 are supported");
  TORCH_CHECK_VALUE(t.scalar_type() == first.scalar_type(), op, ": ", here, " has dtype ",
                    torch_name(t.scalar_type()), " but tensor_lists[", k, "][0] has ",
                    torch_name(first.scalar_type()),
                    "; a list must hold one dtype: group the tensors by dtype and call once per "
                    "group");
  const at::Device device = tensor_lists[0][0].device();
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", here, " is on ", t.device(),
                    " but tensor_lists[0][0] is on ", device,
                    "; group the tensors by device and call once per device");
  TORCH_CHECK_VALUE(t.numel() == ref.numel(), op, ": ", here, " has ", t.numel(),
                    " elements but ", where(0, i, names), " has ", ref.numel(),
                    "; the tensors of one index must have the same numel");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided && t.is_non_overlapping_and_dense(), op, ": ", here,
                    " is not dense (a slice with gaps, or an expanded view?); pass t.contiguous() "
                    "instead");
  TORCH_CHECK_VALUE(k == 0 || same_layout(t, ref), op, ": ", here,
                    " stores its elements in another order than ", where(0, i, names), " (shape ",
                    t.sizes(), ", strides ", t.strides(), " against shape ", ref.sizes(),
                    ", strides ", ref.strides(),
                    "); the ops pair the elements of one index in memory order, so give both one "
                    "memory format (.contiguous() on both, or both torch.channels_last)");
}

void check_chunk_counts(const char* op, int64_t chunk_size, const std::vector<at::Tensor>& tensors,
                        const ListNames& names, bool in_all) {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t chunks = chunks_of_tensor(tensors[i].numel(), chunk_size);
    TORCH_CHECK_VALUE(chunks <= kInt32Max, op, ": ", where(0, i, names), " has ",
                      tensors[i].numel(), " elements, ", chunks, " chunks of chunk_size ",
                      chunk_size, ", but the CUDA launcher numbers chunks in int32 (at most ",
                      kInt32Max, " per tensor); pass a larger chunk_size");
    total += chunks;  // at most 2**31 per tensor: no overflow below 2**32 tensors
  }
  TORCH_CHECK_VALUE(!in_all || total <= kInt32Max, op, ": the tensors make ", total,
                    " chunks of chunk_size ", chunk_size,
                    " in all, but the CUDA launcher numbers them in int32 (at most ", kInt32Max,
                    "); pass a larger chunk_size or fewer tensors per call");
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

std::vector<Range> ranges_of(const TensorListList& tensor_lists) {
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
  return ranges;
}

// "grads float16, params float32, ...": each list's name and dtype, for messages.
std::string combination(const TensorLists& lists, const ListNames& names) {
  std::string text;
  for (int k = 0; k < lists.depth; ++k) {
    text += (k ? ", " : "") + names[k] + " " + dtype_name(lists.dtype[k]);
  }
  return text;
}

// A step value as both implementations print it: an int as one, a float with 9 digits.
std::string show_step(double value) {
  if (std::isnan(value)) return "nan";
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", value);
  return text;
}

[[noreturn]] void refuse_step(const char* op, const std::string& shown) {
  TORCH_CHECK_VALUE(false, op, ": step is the step number after this update, 1 to ", kMaxAdamStep,
                    "; got ", shown);
}

}  // namespace

// ---- rules 1 to 4: the call --------------------------------------------------------------------

ListNames check_call(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                     const TensorListList& tensor_lists, const std::vector<ListNames>& forms) {
  TORCH_CHECK_VALUE(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
  std::string expected;
  const ListNames* names = nullptr;         // the first form with as many lists
  const ListNames* last_fitting = nullptr;  // the last one
  for (const ListNames& form : forms) {
    if (form.size() == tensor_lists.size()) {
      if (names == nullptr) names = &form;
      last_fitting = &form;
    }
    std::string joined;
    for (const std::string& name : form) joined += (joined.empty() ? "" : ", ") + name;
    expected += (expected.empty() ? "" : " or ") + std::to_string(form.size()) + " [" + joined + "]";
  }
  // The remainders form has as many lists as the model-copy form: int16 tensors choose it.
  if (names != last_fitting && holds_remainders(tensor_lists.back())) names = last_fitting;
  TORCH_CHECK_VALUE(names != nullptr, op, " expects ", expected, " tensor lists, got ",
                    tensor_lists.size());
  std::string lengths;
  for (const auto& tensors : tensor_lists) {
    lengths += (lengths.empty() ? "[" : ", ") + std::to_string(tensors.size());
  }
  lengths += "]";
  for (size_t k = 0; k < tensor_lists.size(); ++k) {
    TORCH_CHECK_VALUE(tensor_lists[k].size() == tensor_lists[0].size(), op, ": tensor_lists[", k,
                      "] has ", tensor_lists[k].size(), " tensors but tensor_lists[0] has ",
                      tensor_lists[0].size(), " (lengths ", lengths,
                      "); every list needs one tensor per index");
  }
  TORCH_CHECK_VALUE(noop_flag.numel() == 1 && (noop_flag.scalar_type() == at::kInt ||
                                               noop_flag.scalar_type() == at::kFloat),
                    op, ": noop_flag must be a 1-element int32 or float32 tensor, got ",
                    torch_name(noop_flag.scalar_type()), " with ", noop_flag.numel(), " elements");
  return *names;
}

double real(const char* op, const char* name, const HostNumber& value) {
  TORCH_CHECK_TYPE(value.kind == HostNumber::Kind::Int || value.kind == HostNumber::Kind::Float,
                   op, ": ", name, " must be a Python float, got ", value.type_name);
  TORCH_CHECK_VALUE(value.fits_double, op, ": ", name, " is beyond a float's range, got ",
                    value.text);
  return value.real;
}

const HostNumber& integer(const char* op, const char* name, const HostNumber& value) {
  TORCH_CHECK_TYPE(value.kind == HostNumber::Kind::Int, op, ": ", name,
                   " must be a Python int, got ", value.type_name);
  return value;
}

bool on_off(const char* op, const char* name, const HostNumber& value) {
  TORCH_CHECK_TYPE(value.kind == HostNumber::Kind::Int || value.kind == HostNumber::Kind::Bool,
                   op, ": ", name, " must be a Python int or bool, got ", value.type_name);
  return !value.fits_int64 || value.integer != 0;
}

void check_adam_mode(const char* op, const HostNumber& mode) {
  integer(op, "mode", mode);
  TORCH_CHECK_VALUE(mode.fits_int64 && (mode.integer == 0 || mode.integer == 1), op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW), got ", mode.text);
}

// ---- rules 5 and 6: each tensor ------------------------------------------------------------------

TensorLists check_tensors(const char* op, int64_t chunk_size, const TensorListList& tensor_lists,
                          const ListNames& names, bool chunks_in_all) {
  TensorLists lists;
  lists.depth = static_cast<int>(tensor_lists.size());
  const size_t n = tensor_lists[0].size();
  if (n == 0) return lists;
  for (size_t k = 0; k < tensor_lists.size(); ++k) {
    for (size_t i = 0; i < n; ++i) check_tensor(op, tensor_lists, names, k, i);
  }
  TORCH_CHECK_VALUE(names.back() != "remainders" || chunk_size % 32 == 0, op,
                    ": chunk_size must be a multiple of 32 with remainders (a carry word holds 32 "
                    "elements' bits), got ", chunk_size);
  check_chunk_counts(op, chunk_size, tensor_lists[0], names, chunks_in_all);
  const at::Device device = tensor_lists[0][0].device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), op,
                    ": amp_C runs on CPU and CUDA tensors, got tensors on ", device);
  lists.numel.resize(n);
  for (size_t i = 0; i < n; ++i) lists.numel[i] = tensor_lists[0][i].numel();
  for (size_t k = 0; k < tensor_lists.size(); ++k) {
    lists.dtype[k] = kernel_dtype(tensor_lists[k][0].scalar_type());
    lists.ptr[k].resize(n);
    for (size_t i = 0; i < n; ++i) lists.ptr[k][i] = tensor_lists[k][i].data_ptr();
  }
  return lists;
}

// ---- rule 7: across lists ------------------------------------------------------------------------

// The output list is the last one. Its tensors are written in parallel with the reads of all the
// lists, so an output may share memory only with the inputs at its own index, and only exactly.
// Byte ranges sorted, identical ranges grouped, each group checked against the earlier ones.
void check_output_overlap(const char* op, const TensorListList& tensor_lists) {
  const size_t out_list = tensor_lists.size() - 1;
  const std::vector<Range> ranges = ranges_of(tensor_lists);
  const auto refuse = [&](const Range& a, const Range& b) {
    TORCH_CHECK_VALUE(false, op, ": tensor_lists[", a.list, "][", a.index, "] overlaps tensor_lists[",
                      b.list, "][", b.index,
                      "] in memory; an output may share memory only with its own inputs at the "
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

void check_fused_dtypes(const char* op, const TensorLists& lists, const ListNames& names) {
  if (names.back() == "remainders") {
    bool ok = lists.dtype[1] == DType::BFloat16;
    for (int k = 2; k < lists.depth - 1; ++k) ok &= lists.dtype[k] == DType::Float32;
    TORCH_CHECK_VALUE(ok, op, ": unsupported dtype combination (", combination(lists, names),
                      "); with remainders the weights are bfloat16 and the state float32 (the "
                      "grads: any)");
    return;
  }
  // adam and lamb also take low-precision grads with fp32 params and state.
  const bool is_adam = std::string(op) == "multi_tensor_adam" || std::string(op) == "multi_tensor_lamb";
  const bool has_copies = names.back() == "model_copies";
  const int masters_end = lists.depth - (has_copies ? 1 : 0);
  bool fp32_masters = true;
  bool one_dtype = true;
  for (int k = 1; k < lists.depth; ++k) {
    if (k < masters_end) fp32_masters &= lists.dtype[k] == DType::Float32;
    one_dtype &= lists.dtype[k] == lists.dtype[0];
  }
  bool ok = one_dtype;
  if (has_copies) {
    ok = fp32_masters && lists.dtype[lists.depth - 1] != DType::Float32;
  } else if (is_adam && lists.dtype[0] != DType::Float32 && fp32_masters) {
    ok = true;
  }
  TORCH_CHECK_VALUE(ok, op, ": unsupported dtype combination (", combination(lists, names),
                    "); supported: one dtype for every list",
                    is_adam ? ", fp16/bf16 grads with fp32 params and state" : "",
                    ", or with a model_copies list fp32 weights and state and fp16/bf16 copies");
}

void check_no_shared_memory(const char* op, const TensorListList& tensor_lists) {
  const std::vector<Range> ranges = ranges_of(tensor_lists);
  for (size_t r = 1; r < ranges.size(); ++r) {
    TORCH_CHECK_VALUE(ranges[r].begin >= ranges[r - 1].end, op, ": tensor_lists[",
                      ranges[r - 1].list, "][", ranges[r - 1].index, "] and tensor_lists[",
                      ranges[r].list, "][", ranges[r].index,
                      "] share memory; every grad, weight, state and model-copy tensor must be a "
                      "separate tensor");
  }
}

// ---- rule 8: writes ------------------------------------------------------------------------------

// Checked before anything is written: autograd refuses the version bump of an inference tensor
// outside inference mode, and by then the kernel would already have run.
void check_writable(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
              " is an inference tensor, which cannot be updated in place outside "
              "torch.inference_mode(); pass a tensor created outside inference mode (or a clone)");
}

void check_writes(const char* op, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
                  const ListNames& names, size_t first_written) {
  const at::Device device = tensor_lists[0][0].device();
  TORCH_CHECK_VALUE(noop_flag.device() == device, op, ": noop_flag is on ", noop_flag.device(),
                    " but the tensors are on ", device,
                    "; create the flag on the tensors' device");
  check_writable(noop_flag, op, "noop_flag");
  for (size_t k = first_written; k < tensor_lists.size(); ++k) {
    for (size_t i = 0; i < tensor_lists[k].size(); ++i) {
      check_writable(tensor_lists[k][i], op, where(k, i, names));
    }
  }
}

void check_outputs(const char* op, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
                   const ListNames& names) {
  check_output_overlap(op, tensor_lists);
  check_writes(op, noop_flag, tensor_lists, names, tensor_lists.size() - 1);
}

TensorLists check_fused_tensors(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                                const TensorListList& tensor_lists, const ListNames& names) {
  TensorLists lists = check_tensors(op, chunk_size, tensor_lists, names);
  if (!lists.numel.empty()) {
    check_fused_dtypes(op, lists, names);
    check_no_shared_memory(op, tensor_lists);
    check_writes(op, noop_flag, tensor_lists, names, 1);
  }
  return lists;
}

// ---- rule 9: coefficients that may be tensors ----------------------------------------------------

Scalar scalar(const char* op, const char* name, const FloatArg& value, const at::Device& device) {
  if (const HostNumber* number = std::get_if<HostNumber>(&value)) {
    return {static_cast<float>(real(op, name, *number)), nullptr};
  }
  const at::Tensor& t = std::get<at::Tensor>(value);
  TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() == at::kFloat &&
                        (t.device() == device || t.device().is_cpu()),
                    op, ": ", name, " must be a Python number or a 1-element float32 tensor on ",
                    device, " or the CPU, got a ", torch_name(t.scalar_type()), " tensor of ",
                    t.numel(), " elements on ", t.device());
  if (t.device().is_cpu()) return {t.item<float>(), nullptr};  // no device to wait for
  return {0.f, t.data_ptr<float>()};
}

int64_t step_number(const char* op, const HostNumber& step) {
  integer(op, "step", step);
  if (!step.fits_int64 || step.integer < 1 || step.integer > kMaxAdamStep) {
    refuse_step(op, step.text);
  }
  return step.integer;
}

StepArg adam_step(const char* op, const StepValue& step, const at::Device& device) {
  if (const HostNumber* number = std::get_if<HostNumber>(&step)) {
    return {step_number(op, *number), nullptr, DType::Int64};
  }
  const at::Tensor& t = std::get<at::Tensor>(step);
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK_VALUE(t.numel() == 1 && (type == at::kInt || type == at::kLong || type == at::kFloat) &&
                        t.device() == device,
                    op, ": step must be a Python int or a 1-element int32, int64 or float32 "
                    "tensor on ", device, ", got a ", torch_name(type), " tensor of ", t.numel(),
                    " elements on ", t.device());
  if (device.is_cpu()) {  // read here: there is no device to wait for
    if (type == at::kFloat) {
      const double value = t.item<float>();
      if (!(value >= 1 && value <= kMaxAdamStep && value == std::floor(value))) {
        refuse_step(op, show_step(value));
      }
      return {static_cast<int64_t>(value), nullptr, DType::Int64};
    }
    const int64_t value = t.item<int64_t>();
    if (value < 1 || value > kMaxAdamStep) refuse_step(op, std::to_string(value));
    return {value, nullptr, DType::Int64};
  }
  const DType dtype = type == at::kFloat ? DType::Float32
                                          : type == at::kInt ? DType::Int32 : DType::Int64;
  return {0, t.data_ptr(), dtype};  // checked by the kernel (adam_step_of)
}

// ---- update_scale_hysteresis -----------------------------------------------------------------------

void check_state_tensor(const char* op, const char* name, const at::Tensor& t,
                        at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() == dtype && t.device() == device, op, ": ",
                    name, " must be a 1-element ", torch_name(dtype), " tensor on ", device,
                    " (the device of current_scale), got a ", torch_name(t.scalar_type()),
                    " tensor of ", t.numel(), " elements on ", t.device());
}

int32_t int32(const char* op, const char* name, const HostNumber& value) {
  integer(op, name, value);
  TORCH_CHECK_VALUE(value.fits_int64 && value.integer >= std::numeric_limits<int32_t>::min() &&
                        value.integer <= kInt32Max,
                    op, ": ", name, " must fit in int32 (the trackers' dtype), got ", value.text);
  return static_cast<int32_t>(value.integer);
}

std::optional<double> scale_bound(const char* op, const char* name,
                                  const std::optional<HostNumber>& value) {
  if (!value) return std::nullopt;
  const double bound = real(op, name, *value);
  TORCH_CHECK_VALUE(std::isinf(bound) || std::fabs(bound) <= kFp32Max, op, ": ", name,
                    " must be None, inf or a number within fp32's range, got ", value->text);
  return bound;
}

}  // namespace amp_C
