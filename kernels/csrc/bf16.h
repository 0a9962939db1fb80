/* bfloat16 <-> float32 for the CPU kernels: bfloat16 is the top half of a float32, so widening is
 * exact; narrowing rounds to nearest even, as torch does, and keeps NaN a NaN. */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values widened to float32 (exact). */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 lanes of bfloat16 input pairs (input 2i in a lane's low half, 2i + 1 in its high half, as
 * vdpbf16ps reads them) widened to float32: the even inputs, then the odd ones (exact). */
static inline __m512 bf16_pairs_even(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 bf16_pairs_odd(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* bf16_linear_wide takes vdpbf16ps below this many rows, where the weights' stream from memory
 * sets the pace and vdpbf16ps reads each pair with fewer instructions; the greedy head's exact
 * logits (greedy_head.c) follow the same rule. Chosen by benchmarks/kernels.py --cpu. */
enum { BF16_WIDE_MIN_ROWS = 4 };

/* vdpbf16ps's sum with float32 FMAs: acc + the odd product, rounded, + the even product, rounded
 * (each product of two bfloat16 values is exact in float32), the order Intel's manual gives for
 * vdpbf16ps; it differs from that instruction only in denormals, which vdpbf16ps reads and writes
 * as zero. x_even and x_odd: the pair's two inputs, broadcast and widened. */
static inline __m512 bf16_pair_fma(__m512 acc, __m512 x_even, __m512 x_odd, __m512i w_pairs) {
    return _mm512_fmadd_ps(x_even, bf16_pairs_even(w_pairs), _mm512_fmadd_ps(x_odd, bf16_pairs_odd(w_pairs), acc));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same for the lanes of mask (the rest read as 0, and nothing past them is touched). */
static inline __m512 bf16x16_maskz_load(__mmask16 mask, const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

#if defined(__AVX512BF16__)
/* 16 at a time where the CPU has AVX512-BF16: narrowing is one vcvtneps2bf16, which rounds to
 * nearest even as f32_to_bf16 does (against ~8 integer ops) and treats denormals as zero (a
 * difference only below 1.2e-38; NaN stays a NaN). */
static inline __m256i bf16x16_narrow(__m512 f) { return (__m256i)_mm512_cvtneps_pbh(f); }

static inline void bf16x16_store(uint16_t *p, __m512 f) { _mm256_storeu_si256((__m256i *)p, bf16x16_narrow(f)); }

/* f rounded to bfloat16 and widened back. */
static inline __m512 bf16x16_round(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_narrow(f)), 16));
}
#else
/* Without AVX512-BF16: f32_to_bf16's integer rounding on 16 lanes (the same bits). */
static inline void bf16x16_store(uint16_t *p, __m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}
#endif
#endif

#endif
