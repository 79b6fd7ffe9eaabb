// The CUDA multi-tensor-apply launcher: one kernel launch walks many tensors in fixed-size chunks.
//
// The host packs, per launch, the addresses and sizes of up to kMaxTensors<depth> tensors and a
// (tensor slot, chunk index) pair per block into a metadata struct passed by value (it must stay
// under the 4 KB kernel-parameter limit). Each block then runs the op's functor on one chunk.
// Compared with Apex's launcher: empty tensors are skipped rather than ending the packing loop
// early (they used to drop queued work when last), offsets are 64-bit, and the dtype of every
// tensor has already been checked by the caller.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "amp_C_host_device.h"

namespace amp_C {

constexpr int kBlockSize = 512;            // threads per block
constexpr int kILP = 8;                    // elements per thread per step: one 16-byte load of
                                           // 16-bit values, two of fp32
constexpr int kMaxBlocksPerLaunch = 320;   // chunks queued before a launch
constexpr int kMaxTensorsPerLaunch[kMaxDepth + 1] = {0, 110, 64, 48, 36, 30};
constexpr int kVectorBytes = 16;

template <int depth>
struct TensorListMetadata {
  void* addresses[depth][kMaxTensorsPerLaunch[depth]];
  int64_t sizes[kMaxTensorsPerLaunch[depth]];
  int32_t chunk_base[kMaxTensorsPerLaunch[depth]];  // index of the tensor's first chunk overall
  uint8_t block_to_tensor[kMaxBlocksPerLaunch];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];
};
static_assert(sizeof(TensorListMetadata<1>) < 4000, "metadata exceeds the kernel parameter limit");
static_assert(sizeof(TensorListMetadata<2>) < 4000, "metadata exceeds the kernel parameter limit");
static_assert(sizeof(TensorListMetadata<3>) < 4000, "metadata exceeds the kernel parameter limit");
static_assert(sizeof(TensorListMetadata<4>) < 4000, "metadata exceeds the kernel parameter limit");
static_assert(sizeof(TensorListMetadata<5>) < 4000, "metadata exceeds the kernel parameter limit");

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("amp_C: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// The chunk a block works on: list k's elements are `base<T>(k)[0 .. n)`.
template <int depth>
struct Chunk {
  const TensorListMetadata<depth>& meta;
  int slot;
  int64_t chunk_idx;
  int64_t start;
  int64_t n;

  __device__ Chunk(const TensorListMetadata<depth>& m, int64_t chunk_size)
      : meta(m), slot(m.block_to_tensor[blockIdx.x]), chunk_idx(m.block_to_chunk[blockIdx.x]) {
    start = chunk_idx * chunk_size;
    const int64_t left = meta.sizes[slot] - start;
    n = left < chunk_size ? left : chunk_size;
  }
  template <typename T>
  __device__ T* base(int k) const {
    return static_cast<T*>(meta.addresses[k][slot]) + start;
  }
  // A list k of remainders (amp_C_host_device.h): the carry word of the chunk's first element,
  // which begins one (chunk_size is a multiple of 32).
  __device__ uint32_t* carry_words(int k) const {
    uint16_t* packed = static_cast<uint16_t*>(meta.addresses[k][slot]);
    return reinterpret_cast<uint32_t*>(packed + carry_offset(meta.sizes[slot])) + start / 32;
  }
  // The chunk's element that ends its tensor, or -1.
  __device__ int64_t last() const { return start + n == meta.sizes[slot] ? n - 1 : -1; }
};

template <typename Functor, int depth, typename... Args>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(int64_t chunk_size, TensorListMetadata<depth> meta, Args... args) {
  Functor()(chunk_size, meta, args...);
}

// Launches Functor over every chunk of every non-empty tensor of `lists` on `stream`.
template <int depth, typename Functor, typename... Args>
void multi_tensor_apply(int64_t chunk_size, const TensorLists& lists, void* stream, Args... args) {
  constexpr int max_tensors = kMaxTensorsPerLaunch[depth];
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  TensorListMetadata<depth> meta;
  int slots = 0;
  int blocks = 0;
  int64_t chunk_base = 0;
  auto launch = [&]() {
    multi_tensor_apply_kernel<Functor, depth, Args...>
        <<<blocks, kBlockSize, 0, cuda_stream>>>(chunk_size, meta, args...);
    check_cuda(cudaGetLastError(), "multi_tensor_apply kernel launch");
    blocks = 0;
  };
  const size_t ntensors = lists.numel.size();
  for (size_t t = 0; t < ntensors; ++t) {
    const int64_t n = lists.numel[t];
    if (n == 0) continue;
    for (int k = 0; k < depth; ++k) meta.addresses[k][slots] = lists.ptr[k][t];
    meta.sizes[slots] = n;
    meta.chunk_base[slots] = static_cast<int32_t>(chunk_base);
    ++slots;
    const int64_t chunks = chunks_of(n, chunk_size);
    chunk_base += chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<uint8_t>(slots - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocksPerLaunch || (last_chunk && slots == max_tensors)) {
        launch();
        if (last_chunk) {
          slots = 0;
        } else {  // the tensor continues into the next launch: keep it, in slot 0
          for (int k = 0; k < depth; ++k) meta.addresses[k][0] = meta.addresses[k][slots - 1];
          meta.sizes[0] = meta.sizes[slots - 1];
          meta.chunk_base[0] = meta.chunk_base[slots - 1];
          slots = 1;
        }
      }
    }
  }
  if (blocks > 0) launch();
}

// ---- element access: every op computes in fp32 --------------------------------------------------

template <DType> struct CudaType;
template <> struct CudaType<DType::Float32> { using type = float; };
template <> struct CudaType<DType::Float16> { using type = __half; };
template <> struct CudaType<DType::BFloat16> { using type = __nv_bfloat16; };

// Calls f(T{}) with T the CUDA type of a floating dtype.
template <typename F>
void dispatch_float_types(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); break;
    case DType::Float16: f(__half{}); break;
    case DType::BFloat16: f(__nv_bfloat16{}); break;
    default: throw std::runtime_error(std::string(op) + ": unsupported dtype");
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Loads W elements from p as fp32; W == kILP uses 16-byte vector loads (p must be aligned).
template <int W, typename T>
__device__ __forceinline__ void load(float (&x)[W], const T* p) {
  if constexpr (W == 1) {
    x[0] = to_float(p[0]);
  } else {
    static_assert(W * sizeof(T) % kVectorBytes == 0, "kILP must fill whole vectors");
    alignas(kVectorBytes) T tmp[W];
#pragma unroll
    for (int v = 0; v < W * int(sizeof(T)) / kVectorBytes; ++v) {
      reinterpret_cast<uint4*>(tmp)[v] = reinterpret_cast<const uint4*>(p)[v];
    }
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = to_float(tmp[k]);
  }
}

template <int W, typename T>
__device__ __forceinline__ void store(T* p, const float (&x)[W]) {
  if constexpr (W == 1) {
    p[0] = from_float<T>(x[0]);
  } else {
    alignas(kVectorBytes) T tmp[W];
#pragma unroll
    for (int k = 0; k < W; ++k) tmp[k] = from_float<T>(x[k]);
#pragma unroll
    for (int v = 0; v < W * int(sizeof(T)) / kVectorBytes; ++v) {
      reinterpret_cast<uint4*>(p)[v] = reinterpret_cast<const uint4*>(tmp)[v];
    }
  }
}

__device__ __forceinline__ bool is_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0;
}

// ---- fp32 masters kept as bf16 weights plus remainders (amp_C_host_device.h) --------------------

// The tag of a remainders list in an op's functor, in place of a model-copy type.
struct Remainders {};

// A chunk of bf16 weights and their remainders: the weights' bits, low halves and carry words from
// the chunk's first element, and the chunk's element that ends the tensor (Chunk::last).
struct MasterParts {
  uint16_t* weight;
  uint16_t* low;
  uint32_t* carry;
  int64_t last;
};

template <int depth>
__device__ __forceinline__ MasterParts master_parts(const Chunk<depth>& chunk, int weights,
                                                    int remainders) {
  return {chunk.template base<uint16_t>(weights), chunk.template base<uint16_t>(remainders),
          chunk.carry_words(remainders), chunk.last()};
}

// Copies W 16-bit values; W == kILP as one 16-byte vector (both pointers aligned).
template <int W>
__device__ __forceinline__ void copy_bits(uint16_t* to, const uint16_t* from) {
  if constexpr (W == 1) {
    to[0] = from[0];
  } else {
    static_assert(W * sizeof(uint16_t) == kVectorBytes, "kILP 16-bit values fill one vector");
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
  }
}

// Rebuilds the masters of chunk elements [i, i + W), whose carry bits one word holds (i is a
// multiple of W, and W divides 32).
template <int W>
__device__ __forceinline__ void load_masters(float (&master)[W], const MasterParts& parts,
                                             int64_t i) {
  alignas(kVectorBytes) uint16_t weight[W];
  alignas(kVectorBytes) uint16_t low[W];
  copy_bits<W>(weight, parts.weight + i);
  copy_bits<W>(low, parts.low + i);
  const uint32_t word = parts.carry[i / 32];
  const int shift = static_cast<int>(i % 32);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    master[k] = master_from_parts(weight[k], low[k], (word >> (shift + k)) & 1u);
  }
}

// Splits the masters of chunk elements [i, i + W) back: the weights and low halves stored, and
// their carry bits changed by one atomicXor. Other threads change only their own bits of a word,
// so a plain read gives this one's bits as they are and nothing races. The thread of the
// tensor's last element also owns the word's bits past it and the padding after an odd count of
// low halves, which it zeroes as remainder.split does.
template <int W>
__device__ __forceinline__ void store_masters(const MasterParts& parts, int64_t i,
                                              const float (&master)[W]) {
  alignas(kVectorBytes) uint16_t weight[W];
  alignas(kVectorBytes) uint16_t low[W];
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    uint32_t bit;
    weight[k] = master_to_parts(master[k], low[k], bit);
    bits |= bit << k;
  }
  copy_bits<W>(parts.weight + i, weight);
  copy_bits<W>(parts.low + i, low);
  const uint32_t word = parts.carry[i / 32];
  const int shift = static_cast<int>(i % 32);
  uint32_t mine = ((1u << W) - 1u) << shift;
  if (parts.last >= i && parts.last < i + W) {
    mine |= ~((2u << (parts.last % 32)) - 1u);  // the bits past it (none where it ends a word)
    // A chunk starts on an even element, so the tensor's count is odd where last + 1 is.
    if ((parts.last + 1) % 2 != 0) parts.low[parts.last + 1] = 0;
  }
  const uint32_t change = (word ^ (bits << shift)) & mine;
  if (change != 0) atomicXor(parts.carry + i / 32, change);
}

// Runs step(std::integral_constant<int, W>, i) over elements [0, n) of a chunk in steps of W:
// W == kILP while every pointer is vector-aligned, W == 1 for the tail and unaligned chunks.
template <typename Step>
__device__ __forceinline__ void for_each_step(int64_t n, bool aligned, Step&& step) {
  int64_t i0 = 0;
  if (aligned) {
    const int64_t vectors = n / kILP;
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      step(std::integral_constant<int, kILP>{}, v * kILP);
    }
    i0 = vectors * kILP;
  }
  for (int64_t i = i0 + threadIdx.x; i < n; i += blockDim.x) {
    step(std::integral_constant<int, 1>{}, i);
  }
}

// Sum of `val` over the block, valid in thread 0. Deterministic: a fixed shuffle tree per warp,
// then warp 0 reduces the per-warp sums.
__device__ __forceinline__ float block_sum(float val) {
  __shared__ float warp_sums[kBlockSize / 32];
  for (int offset = 16; offset > 0; offset /= 2) val += __shfl_down_sync(0xffffffffu, val, offset);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = val;
  __syncthreads();
  if (warp == 0) {
    val = lane < int(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) val += __shfl_down_sync(0xffffffffu, val, offset);
  }
  __syncthreads();  // warp_sums may be reused by a following call
  return val;
}

}  // namespace amp_C
