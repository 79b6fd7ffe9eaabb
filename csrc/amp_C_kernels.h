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

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Int32 = 3, Int64 = 4, Int16 = 5 };

// Up to five parallel lists ([in, out] for scale, [x, y, out] for axpby, [x] for l2norm, up to
// [grads, params, exp_avgs, exp_avg_sqs, model_copies] for adam).
constexpr int kMaxDepth = 5;

// Parallel tensor lists, already validated: list k holds `numel.size()` tensors of dtype
// `dtype[k]`, tensor i of every list has `numel[i]` elements laid out identically (but for a last
// list of Int16 remainders, which packs those of the bf16 weights in list 1: amp_C_host_device.h).
struct TensorLists {
  int depth = 0;
  DType dtype[kMaxDepth] = {DType::Float32, DType::Float32, DType::Float32, DType::Float32,
                            DType::Float32};
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

// The coefficients of one fused SGD step (see sgd_element in amp_C_host_device.h). `dc` is
// fp32(1 - dampening), computed in fp64.
struct SgdArgs {
  float wd;
  float momentum;
  float dc;
  float lr;
  bool nesterov;
  bool first_run;
  bool wd_after_momentum;
  Scalar scale;
};

// The step number of a fused Adam step: a checked value, or a 1-element device tensor of `dtype`
// (Int32, Int64 or Float32) that the kernel reads and checks itself (adam_step_of).
struct StepArg {
  int64_t value;
  const void* ptr;
  DType dtype;
};

// The coefficients of one fused Adam step (see adam_element in amp_C_host_device.h): fp32 values
// derived on the host, and the fp64 ones the bias corrections need once the step is known.
struct AdamArgs {
  float wd;
  bool l2;           // Adam's weight decay: mode 0 and wd != 0
  float decay;       // fp32(1 - lr * weight_decay) for AdamW with wd != 0, else exactly 1
  float w1;          // fp32(1 - beta1)
  float w1_minus_1;  // w1 - 1, exact
  bool small_w1;     // |w1| < 0.5: torch's lerp rule
  float w2;          // fp32(1 - beta2)
  float beta2;
  float eps;
  bool bias_correction;
  double lr;
  double beta1_d;
  double beta2_d;
  Scalar inv_scale;
  StepArg step;
};

// The coefficients of one fused LAMB step (see lamb_update in amp_C_host_device.h): host numbers
// rounded to fp32, and the bias corrections fp32(1 - beta ** step), computed in fp64.
struct LambArgs {
  float beta1;
  float beta3;        // fp32(1 - beta1) with grad_averaging, else 1
  float beta2;
  float w2;           // fp32(1 - beta2)
  float eps;
  float bc1;          // 1 without bias_correction
  float bc2;
  float wd;
  bool l2;            // mode 0 and wd != 0: the decay is added to the gradient
  bool decoupled;     // mode 1 and wd != 0: the decay is added to the update
  float max_grad_norm;
  Scalar global_grad_norm;
  Scalar inv_scale;
};

// CPU twins (csrc/cpu/*.cpp), parallel over tensors and elements.
void multi_tensor_scale_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale);
void multi_tensor_axpby_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                            Scalar b, int arg_to_check);
void multi_tensor_l2norm_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                             Scalar inv_scale, bool respect_flag, NormOutputs out);
void multi_tensor_sgd_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                          const SgdArgs& args);
void multi_tensor_adam_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                           const AdamArgs& args);
// LAMB's two element-wise passes: [grads, params, exp_avgs, exp_avg_sqs, updates] (stage 1 writes
// the moments and the fp32 updates), then [updates, params(, model_copies)] (stage 2 applies each
// tensor's ratio: `ratios[t]` on the CPU, `ratios[chunk_base + chunk]` per CUDA chunk).
void multi_tensor_lamb_stage1_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                  const LambArgs& args);
void multi_tensor_lamb_stage2_cpu(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                  const float* ratios);
void update_scale_hysteresis_cpu(float* current_scale, int32_t* growth_tracker,
                                 int32_t* hysteresis_tracker, const float* found_inf,
                                 double growth_factor, double backoff_factor,
                                 int32_t growth_interval, int32_t hysteresis,
                                 ScaleUpdateExtras extras);

// The CPU twins' code paths (csrc/cpu/cpu_paths.cpp): whether their loops are also compiled for
// x86-64-v3 (AVX2, FMA, F16C), whether this CPU runs those clones, and whether fp16 stores go
// through F16C here (else a scalar conversion per element).
struct CpuPaths {
  bool x86_64_v3_clones;
  bool runs_x86_64_v3;
  bool f16c_stores;
};
CpuPaths cpu_paths();

// CUDA launchers (csrc/*.cu); `stream` is the caller's cudaStream_t, all pointers are device
// pointers on the stream's device. Errors are thrown as std::runtime_error.
void multi_tensor_scale_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar scale,
                             void* stream);
void multi_tensor_axpby_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists, Scalar a,
                             Scalar b, int arg_to_check, void* stream);
void multi_tensor_l2norm_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                              Scalar inv_scale, bool respect_flag, NormOutputs out, void* stream);
void multi_tensor_sgd_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                           const SgdArgs& args, void* stream);
void multi_tensor_adam_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                            const AdamArgs& args, void* stream);
void multi_tensor_lamb_stage1_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                   const LambArgs& args, void* stream);
void multi_tensor_lamb_stage2_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                                   const float* chunk_ratios, void* stream);
void update_scale_hysteresis_cuda(float* current_scale, int32_t* growth_tracker,
                                  int32_t* hysteresis_tracker, const float* found_inf,
                                  double growth_factor, double backoff_factor,
                                  int32_t growth_interval, int32_t hysteresis,
                                  ScaleUpdateExtras extras, void* stream);

}  // namespace amp_C
