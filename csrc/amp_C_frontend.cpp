// Binds the amp_C operations; see amp_C_ops.h. The GIL is released while they run.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "amp_C_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused multi-tensor kernels for amp (CPU, and CUDA when built with AMP_CUDA_EXT=1)";
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("multi_tensor_scale", &amp_C::multi_tensor_scale,
        "out = in * scale over [in, out] lists; flags non-finite input", release());
  m.def("multi_tensor_axpby", &amp_C::multi_tensor_axpby,
        "out = a * x + b * y over [x, y, out] lists; flags non-finite x (0), y (1) or both (-1)",
        release());
  m.def("multi_tensor_l2norm", &amp_C::multi_tensor_l2norm,
        "(total L2 norm [1], per-tensor norms [n] or [0])", py::arg("chunk_size"),
        py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("per_tensor") = py::none(),
        release());
  m.def("multi_tensor_l2norm_mp", &amp_C::multi_tensor_l2norm_mp,
        "multi_tensor_l2norm that does nothing (returns zeros) when noop_flag is already set",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("per_tensor") = py::none(), release());
  m.def("multi_tensor_unscale_l2norm", &amp_C::multi_tensor_unscale_l2norm,
        "L2 norms of the values times inv_scale (the tensors are not modified)",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("inv_scale"), py::arg("per_tensor") = py::none(), release());
  m.def("update_scale_hysteresis", &amp_C::update_scale_hysteresis,
        "device-side dynamic loss-scale update with hysteresis; returns current_scale",
        release());
  m.def("cuda_available", &amp_C::cuda_available,
        "whether amp_C has CUDA kernels built against a CUDA PyTorch and a GPU is present");
}
