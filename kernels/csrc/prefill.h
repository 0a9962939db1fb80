/* What the CPU prefill-attention kernels share (amx_attention.c in bfloat16, prefill_attention_f32.c
 * in float32): the check of the caller's tables and lengths, made before anything is read, and a
 * vector 2^x for the softmax. */
#ifndef PDSERVE_PREFILL_H
#define PDSERVE_PREFILL_H
#include <stdint.h>

/* 0 when every sequence's chunk, length and blocks are in range; 1 otherwise. */
static inline int check_chunks(const int32_t *tables, int64_t table_stride, int64_t table_width, const int32_t *cu,
                               const int32_t *lens, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks,
                               int64_t block_size) {
    if (cu[0] < 0 || cu[num_seqs] > num_tokens) return 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = (int64_t)cu[s + 1] - cu[s], len = lens[s];
        if (q_len < 0 || q_len > len || len > table_width * block_size) return 1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
            const int32_t id = tables[s * table_stride + b];
            if (id < 0 || id >= num_blocks) return 1;
        }
    }
    return 0;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 2^x for x <= 128, and 0 for x below -126 (masked keys: -inf). x is rounded to the nearest
 * integer n and 2^f for f = x - n in [-0.5, 0.5] taken from its Taylor series to f^6 (relative
 * error < 2e-7). */
static inline __m512 exp2_ps(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

#endif

#endif
