// Binds the amp_C operations (amp_C_ops.h) to Python: the argument conversions and the module's
// definitions, nothing else. The GIL is released while the operations run.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <string>

#include "amp_C_ops.h"

namespace amp_C {

// chunk_size as the Python caller gave it. pybind11's int64 conversion accepts a bool (an int
// subclass) as 1 and reports an int beyond int64 as a signature mismatch; this refuses both with an
// error that names the argument, as the pure-torch fallback does. The ops check the sign.
struct ChunkSize {
  int64_t value;
};

}  // namespace amp_C

namespace pybind11::detail {

template <>
struct type_caster<amp_C::ChunkSize> {
  PYBIND11_TYPE_CASTER(amp_C::ChunkSize, const_name("int"));

  bool load(handle src, bool /*convert*/) {
    if (PyBool_Check(src.ptr()) || !PyIndex_Check(src.ptr())) {
      throw type_error(std::string("chunk_size must be an int, got ") +
                       Py_TYPE(src.ptr())->tp_name);
    }
    const object index = reinterpret_steal<object>(PyNumber_Index(src.ptr()));
    if (!index) throw error_already_set();
    int overflow = 0;
    value.value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0) {
      throw value_error("chunk_size must be a positive int below 2**63, got " +
                        std::string(str(index)));
    }
    return true;
  }
};

// Any Python object, as the contract needs to see it (amp_C::HostNumber).
template <>
struct type_caster<amp_C::HostNumber> {
  PYBIND11_TYPE_CASTER(amp_C::HostNumber, const_name("number"));

  bool load(handle src, bool /*convert*/) {
    using Kind = amp_C::HostNumber::Kind;
    PyObject* o = src.ptr();
    value = {};
    // The exact types by name; a subclass or anything else by its own.
    value.type_name = PyBool_Check(o)         ? "bool"
                      : PyLong_CheckExact(o)  ? "int"
                      : PyFloat_CheckExact(o) ? "float"
                                              : std::string(str(type::handle_of(src).attr("__name__")));
    if (PyBool_Check(o)) {
      value.kind = Kind::Bool;
      value.integer = o == Py_True ? 1 : 0;
      value.fits_int64 = true;
    } else if (PyLong_Check(o)) {
      value.kind = Kind::Int;
      int overflow = 0;
      value.integer = PyLong_AsLongLongAndOverflow(o, &overflow);
      value.fits_int64 = overflow == 0;
      value.real = PyLong_AsDouble(o);
      if (value.real == -1.0 && PyErr_Occurred()) {  // beyond a double: OverflowError
        PyErr_Clear();
        value.fits_double = false;
      }
      value.text = value.fits_int64 ? std::to_string(value.integer) : std::string(str(src));
    } else if (PyFloat_Check(o)) {
      value.kind = Kind::Float;
      value.real = PyFloat_AS_DOUBLE(o);
      value.text = str(src);  // Python's own spelling, for messages
    }
    return true;
  }
};

}  // namespace pybind11::detail

namespace {

// Binds `op` with its leading int64 chunk_size taken as a ChunkSize.
template <typename R, typename... Rest>
auto with_chunk_size(R (*op)(int64_t, Rest...)) {
  return [op](amp_C::ChunkSize chunk_size, Rest... rest) { return op(chunk_size.value, rest...); };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The tensor arguments are converted through the Python types that `import torch` registers, so a
  // bare `import amp_C` imports torch first (setup.py's rpath let the loader find its libraries).
  py::module_::import("torch");
  m.doc() = "Fused multi-tensor kernels for amp (CPU, and CUDA when built with AMP_CUDA_EXT=1)";
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("multi_tensor_scale", with_chunk_size(&amp_C::multi_tensor_scale),
        "out = in * scale over [in, out] lists; flags non-finite input", py::arg("chunk_size"),
        py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("scale"), release());
  m.def("multi_tensor_axpby", with_chunk_size(&amp_C::multi_tensor_axpby),
        "out = a * x + b * y over [x, y, out] lists; flags non-finite x (0), y (1) or both (-1)",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("a"),
        py::arg("b"), py::arg("arg_to_check"), release());
  m.def("multi_tensor_l2norm", with_chunk_size(&amp_C::multi_tensor_l2norm),
        "(total L2 norm [1], per-tensor norms [n] or [0])", py::arg("chunk_size"),
        py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("per_tensor") = py::none(),
        release());
  m.def("multi_tensor_l2norm_mp", with_chunk_size(&amp_C::multi_tensor_l2norm_mp),
        "multi_tensor_l2norm that does nothing (returns zeros) when noop_flag is already set",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("per_tensor") = py::none(), release());
  m.def("multi_tensor_unscale_l2norm", with_chunk_size(&amp_C::multi_tensor_unscale_l2norm),
        "L2 norms of the values times inv_scale (the tensors are not modified)",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("inv_scale"), py::arg("per_tensor") = py::none(), release());
  m.def("multi_tensor_sgd", with_chunk_size(&amp_C::multi_tensor_sgd),
        "fused SGD step over [grads, weights, momentum_bufs(, model_copies)] or [grads, bf16 "
        "weights, momentum_bufs, int16 remainders]; a no-op when noop_flag is set",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("wd"),
        py::arg("momentum"), py::arg("dampening"), py::arg("lr"), py::arg("nesterov"),
        py::arg("first_run"), py::arg("wd_after_momentum"), py::arg("scale"), release());
  m.def("multi_tensor_adam", with_chunk_size(&amp_C::multi_tensor_adam),
        "fused Adam (mode 0) / AdamW (mode 1) step over [grads, params, exp_avgs, exp_avg_sqs"
        "(, model_copies)] or [grads, bf16 weights, exp_avgs, exp_avg_sqs, int16 remainders]; a "
        "no-op when noop_flag is set",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("epsilon"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale") = 1.0,
        release());
  m.def("multi_tensor_lamb", with_chunk_size(&amp_C::multi_tensor_lamb),
        "fused LAMB step (Apex's) over [grads, params, exp_avgs, exp_avg_sqs(, model_copies)]: "
        "global-norm clipping, per-tensor trust ratio; a no-op when noop_flag is set",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("epsilon"), py::arg("step"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("grad_averaging"),
        py::arg("mode"), py::arg("global_grad_norm"), py::arg("max_grad_norm"),
        py::arg("use_nvlamb") = py::none(), py::arg("inv_scale") = 1.0, release());
  m.def("update_scale_hysteresis", &amp_C::update_scale_hysteresis,
        "device-side dynamic loss-scale update with hysteresis; returns current_scale. Optional: "
        "clamp the scale into [min_scale, max_scale]; write 1/scale into inv_scale and the skip "
        "decision (1.0 or 0.0) into should_skip",
        py::arg("current_scale"), py::arg("growth_tracker"), py::arg("hysteresis_tracker"),
        py::arg("found_inf"), py::arg("growth_factor"), py::arg("backoff_factor"),
        py::arg("growth_interval"), py::arg("hysteresis"), py::arg("min_scale") = py::none(),
        py::arg("max_scale") = py::none(), py::arg("inv_scale") = py::none(),
        py::arg("should_skip") = py::none(), release());
  m.def("cuda_available", &amp_C::cuda_available,
        "whether amp_C has CUDA kernels built against a CUDA PyTorch and a GPU is present");
  m.def(
      "build_info",
      [] {
        const amp_C::BuildInfo info = amp_C::build_info();
        py::dict out;
        out["cuda_kernels"] = info.cuda_kernels;
        out["torch_cuda"] = info.torch_cuda;
        out["cuda_images"] = info.cuda_images;
        out["cuda_runtime"] = info.cuda_runtime.empty() ? py::object(py::none()) : py::str(info.cuda_runtime);
        out["cpu_x86_64_v3_clones"] = info.cpu_x86_64_v3_clones;
        out["cpu_runs_x86_64_v3"] = info.cpu_runs_x86_64_v3;
        out["cpu_f16c_stores"] = info.cpu_f16c_stores;
        return out;
      },
      "what this build holds: cuda_kernels, torch_cuda, cuda_images (sm_XY / compute_XY), "
      "cuda_runtime (the CUDA runtime linked in statically, None without CUDA kernels), and "
      "the CPU paths: cpu_x86_64_v3_clones (loops also built for AVX2/FMA/F16C), "
      "cpu_runs_x86_64_v3 (this CPU takes them), cpu_f16c_stores (fp16 stores through F16C)");
}
