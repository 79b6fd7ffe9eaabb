// multi_tensor_l2norm and its variants: the L2 norm of a list (and of each tensor), optionally of
// the values times an inverse scale (unscale_l2norm), optionally skipped when the flag is already
// set (l2norm_mp). Each block writes its chunk's sum of squares into its own scratch slot, then
// fixed-order reductions give per-tensor and total sums, so the result is deterministic. The
// flag is set when the total is not finite.
#include "multi_tensor_apply.cuh"

namespace amp_C {
namespace {

template <typename T>
struct SumSquaresFunctor {
  __device__ void operator()(int64_t chunk_size, const TensorListMetadata<1>& meta, Flag flag,
                             Scalar inv_scale_arg, bool respect_flag, float* chunk_sums) {
    if (respect_flag && flag_is_set(flag)) return;
    const Chunk<1> chunk(meta, chunk_size);
    const T* x = chunk.base<T>(0);
    const float inv_scale = read_scalar(inv_scale_arg);
    float acc = 0.f;
    for_each_step(chunk.n, is_aligned(x), [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      float v[W];
      load<W>(v, x + i);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float u = v[k] * inv_scale;
        acc += u * u;
      }
    });
    const float sum = block_sum(acc);
    if (threadIdx.x == 0) chunk_sums[meta.chunk_base[chunk.slot] + chunk.chunk_idx] = sum;
  }
};

// Per launch: the chunk range of up to kTensorsPerCleanup tensors, one block each.
constexpr int kTensorsPerCleanup = 256;
struct CleanupBatch {
  int32_t tensor[kTensorsPerCleanup];
  int32_t first_chunk[kTensorsPerCleanup];
  int32_t chunks[kTensorsPerCleanup];
};

__global__ void __launch_bounds__(kBlockSize)
    tensor_sums_kernel(CleanupBatch batch, Flag flag, bool respect_flag, NormOutputs out) {
  if (respect_flag && flag_is_set(flag)) return;
  const float* sums = out.chunk_sums + batch.first_chunk[blockIdx.x];
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < batch.chunks[blockIdx.x]; c += blockDim.x) acc += sums[c];
  const float total = block_sum(acc);
  if (threadIdx.x == 0) {
    const int t = batch.tensor[blockIdx.x];
    out.tensor_sums[t] = total;
    if (out.per_tensor != nullptr) out.per_tensor[t] = sqrtf(total);
  }
}

__global__ void __launch_bounds__(kBlockSize)
    total_kernel(int64_t ntensors, Flag flag, bool respect_flag, NormOutputs out) {
  if (respect_flag && flag_is_set(flag)) return;
  float acc = 0.f;
  for (int64_t t = threadIdx.x; t < ntensors; t += blockDim.x) acc += out.tensor_sums[t];
  const float total = block_sum(acc);
  if (threadIdx.x == 0) {
    *out.total = sqrtf(total);
    if (!is_finite(*out.total)) raise_flag(flag);
  }
}

}  // namespace

void multi_tensor_l2norm_cuda(int64_t chunk_size, Flag flag, const TensorLists& lists,
                              Scalar inv_scale, bool respect_flag, NormOutputs out, void* stream) {
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  dispatch_float_types(lists.dtype[0], "multi_tensor_l2norm", [&](auto x) {
    using Functor = SumSquaresFunctor<decltype(x)>;
    multi_tensor_apply<1, Functor>(chunk_size, lists, stream, flag, inv_scale, respect_flag,
                                   out.chunk_sums);
  });
  CleanupBatch batch;
  int queued = 0;
  int64_t first_chunk = 0;
  const int64_t ntensors = static_cast<int64_t>(lists.numel.size());
  for (int64_t t = 0; t < ntensors; ++t) {
    const int64_t chunks = chunks_of(lists.numel[t], chunk_size);
    if (chunks > 0) {
      batch.tensor[queued] = static_cast<int32_t>(t);
      batch.first_chunk[queued] = static_cast<int32_t>(first_chunk);
      batch.chunks[queued] = static_cast<int32_t>(chunks);
      ++queued;
      first_chunk += chunks;
    }
    if (queued == kTensorsPerCleanup || (t == ntensors - 1 && queued > 0)) {
      tensor_sums_kernel<<<queued, kBlockSize, 0, cuda_stream>>>(batch, flag, respect_flag, out);
      check_cuda(cudaGetLastError(), "multi_tensor_l2norm cleanup launch");
      queued = 0;
    }
  }
  total_kernel<<<1, kBlockSize, 0, cuda_stream>>>(ntensors, flag, respect_flag, out);
  check_cuda(cudaGetLastError(), "multi_tensor_l2norm total launch");
}

}  // namespace amp_C
