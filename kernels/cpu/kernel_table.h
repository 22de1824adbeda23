// Private to kernels/cpu: the per-ISA kernel table and the precomputed step constants.
//
// Each ISA translation unit (optim_scalar.cc, optim_avx2.cc, optim_avx512.cc) is compiled with
// its own -m flags and exports exactly one function returning its table; optim.cc picks a
// table by CPUID and splits the work into tiles across threads. Table entries work on one
// contiguous range [begin, end) of one call's spans on the calling thread; they never
// allocate, never block, and touch nothing outside that range.
//
// Every entry computes exactly the element-wise operation sequence written in
// optim_scalar.cc (same products, same fused multiply-adds, IEEE sqrt and division), so the
// SIMD variants are bit-identical to the scalar reference; only the sum of squares (a
// reduction, summed in a different order) may differ in the last bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optim.h"
#include "kernels/cpu/step_consts.h"

namespace tiermem::kernels::internal {

struct KernelTable {
  Isa isa;
  void (*adam)(const AdamConsts& c, const AdamSpans& s, size_t begin, size_t end);
  void (*sgd)(const SgdConsts& c, const SgdSpans& s, size_t begin, size_t end);
  // Sum of squares of grad[begin, end) as fp32 values, accumulated in double.
  double (*sq_sum)(const void* grad, DType dtype, size_t begin, size_t end);
  void (*cast_from_f32)(const float* src, void* dst, DType dst_dtype, size_t begin, size_t end);
  void (*cast_to_f32)(const void* src, DType src_dtype, float* dst, size_t begin, size_t end);
  // Bandwidth probe with Adam's access pattern: reads a, b, c, d; writes a, b, c.
  void (*probe)(float* a, float* b, float* c, const float* d, size_t begin, size_t end);
};

const KernelTable& ScalarTable();
// Bulk conversions of compressed state (optim.h QuantizeState / DequantizeState), scalar for
// every ISA (not on the step's path): [begin, end) of the span, begin a multiple of the block
// for kInt8. `key`: RoundingKey(seed).
void QuantizeStateRange(const StateFormat& f, bool is_signed, const float* src, StateRef out,
                        uint32_t key, size_t begin, size_t end);
void DequantizeStateRange(const StateFormat& f, bool is_signed, StateRef in, float* dst,
                          size_t begin, size_t end);
const KernelTable& Avx2Table();
const KernelTable& Avx512Table();

// The AVX-512 int8 state step dequantizes with byte permutes when the CPU has AVX512-VBMI,
// with gathers otherwise; tests turn the former off to run the latter (process-wide).
void SetAvx512VbmiAllowed(bool allowed);
bool Avx512VbmiActive();
// Tests (AVX-512 CPUs only): the AVX-512 block quantizer (codes of x * (1 / absmax), as the
// step's requantization), and the VBMI code lookup (code values of q; needs AVX512-VBMI).
void Avx512QuantizeForTest(bool is_signed, const float* x, size_t n, float absmax, uint8_t* q);
void Avx512DequantizeForTest(bool is_signed, const uint8_t* q, size_t n, float* out);

}  // namespace tiermem::kernels::internal
