// The interface between the PyTorch-facing ops (amp_C_ops.cpp) and the kernels.
//
// Deliberately free of PyTorch, ATen, c10 and CUDA headers: the CUDA translation units include
// only this header and the CUDA runtime, so they compile with nvcc against a CPU-only PyTorch
// (the CI machine) exactly as against a CUDA one. Tensors cross this boundary as raw pointers,
// element counts and dtype tags; streams cross it as an opaque `void*` (a cudaStream_t).
#pragma once

#include <cstdint>
#include <vector>

namespace amp_C {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Int32 = 3 };

// Up to three parallel lists ([in, out] for scale, [x, y, out] for axpby, [x] for l2norm).
constexpr int kMaxDepth = 3;

// Parallel tensor lists, already validated: list k holds `numel.size()` tensors of dtype
// `dtype[k]`, tensor i of every list has `numel[i]` elements laid out identically.
struct TensorLists {
  int depth = 0;
  DType dtype[kMaxDepth] = {DType::Float32, DType::Float32, DType::Float32};
  std::vector<void*> ptr[kMaxDepth];
  std::vector<int64_t> numel;
};

// The overflow flag: ops only ever store 1 into it (int32 as in Apex, or float32).
struct Flag {
  void* ptr;
  DType dtype;
};

// What amp's own loss scaler asks of update_scale_hysteresis beyond Apex's step, so that one
// launch does the whole update (every field optional; all off for Apex's signature).
struct ScaleUpdateExtras {
  bool clamp;          // keep the scale within [min_scale, max_scale] after the step
  float min_scale;
  float max_scale;
  float* inv_scale;    // nullptr, or [1]: 1 / the new scale, divided in double, rounded to fp32
  float* should_skip;  // nullptr, or [1]: 1 if found_inf was set (this step is skipped), else 0
};

// A float argument given either by value or as a 1-element float32 tensor that the kernel reads
// itself (the sync-free path keeps the loss scale on the device). `ptr` wins when non-null.
struct Scalar {
  float value;
  const float* ptr;
};

// Outputs of the l2norm family; every buffer is zero-filled by the caller.
struct NormOutputs {
  float* total;         // [1]: sqrt of the sum of squares of all tensors
  float* per_tensor;    // [ntensors] or nullptr when per-tensor norms were not asked for
  float* chunk_sums;    // [total number of chunks], scratch
  float* tensor_sums;   // [ntensors], scratch
};


// CPU twins (csrc/cpu/*.cpp), parallel over tensors and elements.
void multi_tensor_scale_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale);
void multi_tensor_axpby_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                            Scalar b, int arg_to_check);
void multi_tensor_l2norm_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                             Scalar inv_scale, bool respect_flag, NormOutputs out);
void update_scale_hysteresis_cpu(float* current_scale, int32_t* growth_tracker,
                                 int32_t* hysteresis_tracker, const float* found_inf,
                                 double growth_factor, double backoff_factor,
                                 int32_t growth_interval, int32_t hysteresis,
                                 ScaleUpdateExtras extras);

// CUDA launchers (csrc/*.cu); `stream` is the caller's cudaStream_t, all pointers are device
// pointers on the stream's device. Errors are thrown as std::runtime_error.
void multi_tensor_scale_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale,
                             void* stream);
void multi_tensor_axpby_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                             Scalar b, int arg_to_check, void* stream);
void multi_tensor_l2norm_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                              Scalar inv_scale, bool respect_flag, NormOutputs out, void* stream);
void update_scale_hysteresis_cuda(float* current_scale, int32_t* growth_tracker,
                                  int32_t* hysteresis_tracker, const float* found_inf,
                                  double growth_factor, double backoff_factor,
                                  int32_t growth_interval, int32_t hysteresis,
                                  ScaleUpdateExtras extras, void* stream);

}  // namespace amp_C
