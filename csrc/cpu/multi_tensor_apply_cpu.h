// The CPU multi-tensor-apply launcher: the twin of ../multi_tensor_apply.cuh.
//
// Tensors are cut into pieces of at most `chunk_size` elements (the same chunks the CUDA kernels
// use) and at::parallel_for spreads the pieces over threads, so one call is parallel over
// tensors and over the elements of large tensors. Each piece runs a plain loop over raw pointers
// that the compiler vectorises; on x86-64 every loop is also compiled for x86-64-v3 (AVX2, FMA, F16C) and chosen
// at run time (AMP_CPU_CLONES), so the build needs no machine-specific flags.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../amp_C_host_device.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// flatten: the dtype dispatch and loops must be inlined into each clone to be compiled for it.
#define AMP_CPU_CLONES __attribute__((flatten, target_clones("arch=x86-64-v3", "default")))
#define AMP_CPU_HAS_CLONES 1
#else
#define AMP_CPU_CLONES __attribute__((flatten))
#define AMP_CPU_HAS_CLONES 0
#endif
#define AMP_INLINE inline __attribute__((always_inline))

namespace amp_C {
namespace cpu {

// Elements a parallel task handles at least: below this the threads cost more than they save.
constexpr int64_t kMinElementsPerTask = 32768;

struct Piece {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Calls fn(piece) for every chunk of every tensor, in parallel. Returns nothing; fn records
// results in per-piece or atomic state.
template <typename Fn>
void for_each_piece(const TensorLists& lists, int64_t chunk_size, const Fn& fn) {
  std::vector<Piece> pieces;
  for (int64_t t = 0; t < static_cast<int64_t>(lists.numel.size()); ++t) {
    for (int64_t begin = 0; begin < lists.numel[t]; begin += chunk_size) {
      pieces.push_back({t, begin, std::min(begin + chunk_size, lists.numel[t])});
    }
  }
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / chunk_size);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), grain, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) fn(pieces[p]);
  });
}

// Element types of the loops: plain 16-bit storage the vectoriser understands (c10::Half and
// c10::BFloat16 are classes it will not vectorise). Conversions round to nearest even exactly
// like c10's; NaN payloads may differ.
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

template <typename F>
AMP_INLINE void dispatch_float_types(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::Float32: f(float{}); break;
    case DType::Float16: f(half_t{}); break;
    case DType::BFloat16: f(bf16_t{}); break;
    default: throw std::runtime_error(std::string(op) + ": unsupported dtype");
  }
}

AMP_INLINE float to_float(float x) { return x; }

// fp16 -> fp32 without branches, so that it vectorises: shifting exponent and mantissa into
// place gives the value times 2^-112 (exact, subnormals included); multiplying by 2^112 restores
// it. Inf and NaN (exponent all ones) instead get the fp32 all-ones exponent.
AMP_INLINE float to_float(half_t x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t magnitude = x.bits & 0x7fffu;
  const uint32_t shifted = magnitude << 13;
  const uint32_t finite = bits_of_float(float_of_bits(shifted) * 0x1p112f);
  const uint32_t special = shifted | 0x7f800000u;
  const uint32_t is_special = 0u - static_cast<uint32_t>(magnitude >= 0x7c00u);  // all ones or 0
  return float_of_bits(sign | (special & is_special) | (finite & ~is_special));
}

AMP_INLINE float to_float(bf16_t x) { return float_of_bits(static_cast<uint32_t>(x.bits) << 16); }

template <typename T> AMP_INLINE T from_float(float x);
template <> AMP_INLINE float from_float<float>(float x) { return x; }
template <> AMP_INLINE half_t from_float<half_t>(float x) {
#if defined(__FLT16_MAX__)
  const _Float16 h = static_cast<_Float16>(x);  // one F16C instruction in the x86-64-v3 clones
  half_t out;
  std::memcpy(&out.bits, &h, sizeof(h));
  return out;
#else
  return half_t{c10::Half(x).x};
#endif
}
template <> AMP_INLINE bf16_t from_float<bf16_t>(float x) { return bf16_t{bf16_bits_rounded(x)}; }

// out[0, n) = fp16(in[0, n)), rounded like from_float<half_t>, eight at a time (to_half_cpu.cpp).
void to_half(half_t* out, const float* in, int64_t n);
// out[0, n) = fp32(in[0, n)), the values of to_float(half_t), eight at a time (to_half_cpu.cpp);
// a signalling NaN comes out quiet.
void from_half(float* out, const half_t* in, int64_t n);
// Whether to_half() and from_half() take their F16C paths on this CPU.
bool to_half_uses_f16c();

// Elements of the fp32 staging block of a loop that stores fp16: small enough to stay in L1.
constexpr int64_t kHalfBlock = 1024;

// Runs a loop with an fp16 output in blocks: compute(block, i, m) writes the fp32 results of
// elements [i, i + m) into `block`, which to_half() then stores. Returns whether any compute()
// returned true.
template <typename Compute>
AMP_INLINE bool store_half_in_blocks(half_t* out, int64_t n, Compute&& compute) {
  float block[kHalfBlock];
  bool bad = false;
  for (int64_t i = 0; i < n; i += kHalfBlock) {
    const int64_t m = std::min(kHalfBlock, n - i);
    bad |= compute(block, i, m);
    to_half(out + i, block, m);
  }
  return bad;
}

// One fp16 list of a loop run in fp32 blocks: widened from `in` before the loop (when the loop
// reads it), stored to `out` after it (when the loop writes it); nullptr where it does not.
struct HalfList {
  const half_t* in;
  half_t* out;
};

// Runs an fp32 loop over fp16 lists in blocks small enough to stay in L1: block by block, the
// lists are widened into fp32 blocks (from_half), loop(blocks, m) updates elements [0, m) of the
// blocks in place, and the written lists are stored back (to_half); both conversions take eight
// elements per instruction with F16C.
template <size_t kLists, typename Loop>
AMP_INLINE void in_fp32_blocks(const HalfList (&lists)[kLists], int64_t n, Loop&& loop) {
  static_assert(kLists <= 4, "in_fp32_blocks takes up to four lists");
  // Four arrays rather than one 2-d array: the vectoriser then sees blocks that cannot overlap.
  float block0[kHalfBlock];
  float block1[kHalfBlock];
  float block2[kHalfBlock];
  float block3[kHalfBlock];
  float* const blocks[4] = {block0, block1, block2, block3};
  for (int64_t i = 0; i < n; i += kHalfBlock) {
    const int64_t m = std::min(kHalfBlock, n - i);
    for (size_t k = 0; k < kLists; ++k) {
      if (lists[k].in != nullptr) from_half(blocks[k], lists[k].in + i, m);
    }
    loop(blocks, m);
    for (size_t k = 0; k < kLists; ++k) {
      if (lists[k].out != nullptr) to_half(lists[k].out + i, blocks[k], m);
    }
  }
}

// ---- fp32 masters kept as bf16 weights plus remainders (amp_C_host_device.h) --------------------

// Rebuilds the masters of one carry word's `count` elements from their weights, low halves and
// carry bits. kCount: 32, a constant count the compiler unrolls and vectorises whole, or 0 for
// fewer (`count`, in a tensor's last word).
template <int64_t kCount>
AMP_INLINE void rebuild_word(float* __restrict master, const bf16_t* __restrict weight,
                             const uint16_t* __restrict low, uint32_t bits, int64_t count) {
  for (int64_t j = 0; j < (kCount ? kCount : count); ++j) {
    master[j] = master_from_parts(weight[j].bits, low[j], (bits >> j) & 1u);
  }
}

// Splits the masters of one carry word's `count` elements (kCount as for rebuild_word) into their
// weights and low halves; returns the word, its bits past `count` zero as remainder.split leaves
// them.
template <int64_t kCount>
AMP_INLINE uint32_t split_word(const float* __restrict master, bf16_t* __restrict weight,
                               uint16_t* __restrict low, int64_t count) {
  uint32_t bits = 0;
  for (int64_t j = 0; j < (kCount ? kCount : count); ++j) {
    uint32_t bit;
    weight[j].bits = master_to_parts(master[j], low[j], bit);
    bits |= bit << j;
  }
  return bits;
}

// Elements [i, i + count) of one carry word, word(i / 32): their masters rebuilt into `block`,
// stepped by loop(block, i, count), and split back, the word stored whole.
template <int64_t kCount, typename Loop>
AMP_INLINE void step_word(float* block, bf16_t* weight, uint16_t* low, uint32_t* carry, int64_t i,
                          int64_t count, Loop& loop) {
  rebuild_word<kCount>(block, weight + i, low + i, carry[i / 32], count);
  loop(block, i, count);
  carry[i / 32] = split_word<kCount>(block, weight + i, low + i, count);
}

// Runs an fp32 loop over the masters of piece `p` of a remainders form (bf16 weights in list 1,
// their remainders in the last list) one carry word at a time: its masters are rebuilt into an
// fp32 block, loop(block, i, count) steps elements [i, i + count) of the piece in it, and they are
// split back. A word, not a larger block: over larger blocks rebuild, loop and split are passes
// of their own, whose loads do not overlap the others' arithmetic (Adam measured 15% slower). A
// piece begins a word (chunk_size is a multiple of 32), so no two pieces share one.
template <typename Loop>
AMP_INLINE void in_master_words(const TensorLists& lists, const Piece& p, Loop&& loop) {
  const int64_t numel = lists.numel[p.tensor];
  const int64_t n = p.end - p.begin;
  auto* packed = static_cast<uint16_t*>(lists.ptr[lists.depth - 1][p.tensor]);
  bf16_t* weight = static_cast<bf16_t*>(lists.ptr[1][p.tensor]) + p.begin;
  uint16_t* low = packed + p.begin;
  uint32_t* carry = reinterpret_cast<uint32_t*>(packed + carry_offset(numel)) + p.begin / 32;
  float block[32];
  const int64_t full = n - n % 32;
  for (int64_t i = 0; i < full; i += 32) step_word<32>(block, weight, low, carry, i, 32, loop);
  if (full < n) step_word<0>(block, weight, low, carry, full, n - full, loop);
  // The padding after an odd count of low halves is zero, as remainder.split leaves it.
  if (p.end == numel && numel % 2 != 0) packed[numel] = 0;
}

}  // namespace cpu
}  // namespace amp_C
