// The argument contract of the amp_C operations: the C++ mirror of amp/_pytorch_ops/contract.py.
//
// The contract is written once, as that module's docstring: nine rules for the list ops and the
// rules of update_scale_hysteresis, checked in one order. Each function here is the function of
// the same name there (or in contract_coefficients.py, which holds rule 9 and the checks of
// update_scale_hysteresis), checking the same rules in the same order and raising the same
// exception types with the same messages (tests/test_contract.py compares both on every kind of
// misuse).
// The rule numbers below are the docstring's. Everything is checked before anything is written.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "amp_C_kernels.h"
#include "amp_C_ops.h"

namespace amp_C {

using ListNames = std::vector<std::string>;

// Rules 1 to 3 (chunk_size beyond int64 and of the wrong type are refused while the binding
// converts it); returns the names of the lists, the form of `forms` that has their count (of two
// such, the remainders form, last, where the last list's first tensor is int16).
ListNames check_call(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                     const TensorListList& tensor_lists, const std::vector<ListNames>& forms);

// Rule 4: a float (a Python int or float), an int, an on/off int (an int or a bool), adam's mode.
double real(const char* op, const char* name, const HostNumber& value);
const HostNumber& integer(const char* op, const char* name, const HostNumber& value);
bool on_off(const char* op, const char* name, const HostNumber& value);
void check_adam_mode(const char* op, const HostNumber& mode);

// Rules 5 and 6; returns the lists' raw view (no tensors: an empty view). `chunks_in_all`: the
// chunks of all tensors are numbered together (the l2norm family). amp_C's own rule follows:
// the tensors are on the CPU or a CUDA device.
TensorLists check_tensors(const char* op, int64_t chunk_size, const TensorListList& tensor_lists,
                          const ListNames& names, bool chunks_in_all = false);

// Rule 7.
void check_output_overlap(const char* op, const TensorListList& tensor_lists);
void check_fused_dtypes(const char* op, const TensorLists& lists, const ListNames& names);
void check_no_shared_memory(const char* op, const TensorListList& tensor_lists);

// Rule 8: noop_flag on the tensors' device, then every tensor the op writes (the flag, then the
// lists from `first_written` on) is writable.
void check_writable(const at::Tensor& t, const char* op, const std::string& name);
void check_writes(const char* op, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
                  const ListNames& names, size_t first_written);

// Rules 7 and 8 for scale and axpby, which write their last list.
void check_outputs(const char* op, const at::Tensor& noop_flag, const TensorListList& tensor_lists,
                   const ListNames& names);

// Rules 5 to 8 for sgd and adam, which write every list but the grads; returns the lists' view.
TensorLists check_fused_tensors(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                                const TensorListList& tensor_lists, const ListNames& names);

// Rule 9: a coefficient for tensors on `device`, and adam's step (a CPU tensor's value is read and
// checked here; another device's is checked by the kernel, see adam_step_of).
Scalar scalar(const char* op, const char* name, const FloatArg& value, const at::Device& device);
StepArg adam_step(const char* op, const StepValue& step, const at::Device& device);
// Rule 4 for lamb's step: a Python int from 1 to 2**31 - 1.
int64_t step_number(const char* op, const HostNumber& step);

// update_scale_hysteresis.
void check_state_tensor(const char* op, const char* name, const at::Tensor& t,
                        at::ScalarType dtype, const at::Device& device);
int32_t int32(const char* op, const char* name, const HostNumber& value);
std::optional<double> scale_bound(const char* op, const char* name,
                                  const std::optional<HostNumber>& value);

}  // namespace amp_C
