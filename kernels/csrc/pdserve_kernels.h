/* pdserve's compiled CPU kernels: every entry point, status code, shared structure and limit, declared
 * once. Each C source in kernels/csrc includes this header, so the compiler checks every definition against
 * its declaration; kernels/cpu/native.py reads the same header to generate the typed Python wrapper
 * (argument types, tensor dtypes, the span of memory each pointer must cover, status codes as
 * exceptions) and reads the limits' values from the built library.
 *
 * Syntax the wrapper parses (keep to it): one declaration per PDS_API line group ending in ");",
 * plain C parameter types, and PDS_SPAN(expr) after a pointer parameter: the fewest elements the
 * call reads or writes from that pointer, as an expression over the integer parameters (checked
 * against the tensor's storage before the call; a bound, not the exact extent); PDS_NULLABLE after a
 * pointer that may be NULL (None in Python). Entry points that
 * need an instruction-set level are built only into the libraries of that level or above. */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <stdint.h>

#define PDS_API __attribute__((visibility("default")))
#define PDS_SPAN(expr)
#define PDS_NULLABLE

/* Status codes: 0 or one of these, never another value. */
enum pds_status {
    PDS_OK = 0,
    PDS_ERR_RANGE = 1,       /* an index in the data (a position, slot or block id) outside its table */
    PDS_ERR_MEMORY = 2,      /* a buffer could not be allocated */
    PDS_ERR_UNSUPPORTED = 3, /* sizes this kernel has no path for: the caller takes another */
};

/* Limits, defined here only: the library exports each as `const int64_t pds_limit_<name>`. */
#define PDS_LIMITS(X)                                                                                                  \
    X(max_heads, 128)          /* paged decode attention: query heads */                                              \
    X(max_head_dim, 256)       /* paged decode attention: head size */                                                \
    X(max_block_size, 256)     /* paged decode attention: tokens per KV block */                                      \
    X(panel, 48)               /* outputs per panel of the small-batch projection kernels' packed W */                \
    X(gate_up_half, 32)        /* gate (and up) outputs per panel of the gate/up kernel's packed W */                 \
    X(small_batch_rows, 64)    /* the most rows the small-batch projection kernels take */

#define PDS_LIMIT_ENUM(name, value) PDS_LIMIT_##name = value,
enum pds_limit { PDS_LIMITS(PDS_LIMIT_ENUM) };
#undef PDS_LIMIT_ENUM

/* A decode step's layers in one call (decode_layers.c): the kernels below, in the Python layer
 * loop's order, on buffers the caller allocates. */
typedef struct {
    const void *input_norm;
    const void *post_norm;
    const void *qkv;
    const void *o;
    const void *gate_up;
    const void *down;
    const float *qkv_bias;
    const float *o_bias;
    const float *gate_up_bias;
    const float *down_bias;
} pds_layer;

typedef struct {
    int64_t elem_size;
    int64_t rows;
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    float eps;
    float scale;
    void *kv_cache;
    int64_t stride_layer;
    int64_t stride_block;
    int64_t stride_kv;
    int64_t stride_token;
    int64_t stride_head;
    int64_t num_blocks;
    int64_t block_size;
    const int64_t *positions;
    const int64_t *slots;
    const int32_t *block_tables;
    int64_t stride_table;
    const int32_t *seq_lens;
    const void *cos_sin;
    int64_t stride_cs;
    int64_t max_position;
    void *hidden_buf;
    void *residual;
    void *normed;
    void *qkv;
    void *attn;
    void *o_out;
    void *gate_up;
    void *act;
} pds_step;

/* The projection kernel decode_layers runs. */
enum pds_linear_kind { PDS_LINEAR_F32 = 0, PDS_LINEAR_BF16 = 1, PDS_LINEAR_BF16_WIDE = 2, PDS_LINEAR_AMX = 3 };

/* ---- every level ---- */
PDS_API void argmax_rows_f32(const float *x PDS_SPAN((rows - 1) * stride + cols), int64_t stride, int64_t rows,
                             int64_t cols, int64_t *out PDS_SPAN(rows));
PDS_API void argmax_rows_bf16(const uint16_t *x PDS_SPAN((rows - 1) * stride + cols), int64_t stride, int64_t rows,
                              int64_t cols, int64_t *out PDS_SPAN(rows));
PDS_API void add_rms_norm_f32(const float *x PDS_SPAN((num_rows - 1) * stride_x + hidden), int64_t stride_x,
                              const float *residual PDS_NULLABLE, int64_t stride_res, const float *weight PDS_SPAN(hidden),
                              float *out PDS_SPAN((num_rows - 1) * stride_out + hidden), int64_t stride_out,
                              float *new_residual PDS_SPAN((num_rows - 1) * stride_new + hidden), int64_t stride_new,
                              int64_t num_rows, int64_t hidden, float eps);
PDS_API void add_rms_norm_bf16(const uint16_t *x PDS_SPAN((num_rows - 1) * stride_x + hidden), int64_t stride_x,
                               const uint16_t *residual PDS_NULLABLE, int64_t stride_res, const uint16_t *weight PDS_SPAN(hidden),
                               uint16_t *out PDS_SPAN((num_rows - 1) * stride_out + hidden), int64_t stride_out,
                               uint16_t *new_residual PDS_SPAN((num_rows - 1) * stride_new + hidden),
                               int64_t stride_new, int64_t num_rows, int64_t hidden, float eps);
PDS_API void silu_and_mul_f32(const float *x PDS_SPAN((num_rows - 1) * stride_x + 2 * half), int64_t stride_x,
                              float *out PDS_SPAN((num_rows - 1) * stride_out + half), int64_t stride_out,
                              int64_t num_rows, int64_t half);
PDS_API void silu_and_mul_bf16(const uint16_t *x PDS_SPAN((num_rows - 1) * stride_x + 2 * half), int64_t stride_x,
                               uint16_t *out PDS_SPAN((num_rows - 1) * stride_out + half), int64_t stride_out,
                               int64_t num_rows, int64_t half);
PDS_API int rotary_f32(float *query PDS_SPAN((num_tokens - 1) * stride_q_tok + (num_heads - 1) * stride_q_head + 2 * half),
                       int64_t stride_q_tok, int64_t stride_q_head, int64_t num_heads,
                       float *key PDS_SPAN((num_tokens - 1) * stride_k_tok + (num_kv_heads - 1) * stride_k_head + 2 * half),
                       int64_t stride_k_tok, int64_t stride_k_head, int64_t num_kv_heads,
                       const int64_t *positions PDS_SPAN(num_tokens),
                       const float *cos_sin PDS_SPAN((max_position - 1) * stride_cs + 2 * half), int64_t stride_cs,
                       int64_t max_position, int64_t num_tokens, int64_t half);
PDS_API int rotary_bf16(uint16_t *query PDS_SPAN((num_tokens - 1) * stride_q_tok + (num_heads - 1) * stride_q_head + 2 * half),
                        int64_t stride_q_tok, int64_t stride_q_head, int64_t num_heads,
                        uint16_t *key PDS_SPAN((num_tokens - 1) * stride_k_tok + (num_kv_heads - 1) * stride_k_head + 2 * half),
                        int64_t stride_k_tok, int64_t stride_k_head, int64_t num_kv_heads,
                        const int64_t *positions PDS_SPAN(num_tokens),
                        const uint16_t *cos_sin PDS_SPAN((max_position - 1) * stride_cs + 2 * half),
                        int64_t stride_cs, int64_t max_position, int64_t num_tokens, int64_t half);
PDS_API int write_kv_f32(const float *key PDS_SPAN((num_tokens - 1) * stride_k_tok + (num_kv_heads - 1) * stride_k_head + head_dim),
                         int64_t stride_k_tok, int64_t stride_k_head, const float *value PDS_SPAN((num_tokens - 1) * stride_v_tok + (num_kv_heads - 1) * stride_v_head + head_dim),
                         int64_t stride_v_tok, int64_t stride_v_head,
                         float *cache PDS_SPAN((num_blocks - 1) * stride_block + 1), int64_t stride_block,
                         int64_t stride_kv, int64_t stride_token, int64_t stride_head, int64_t num_blocks,
                         int64_t block_size, const int64_t *slots PDS_SPAN(num_tokens), int64_t num_tokens,
                         int64_t num_kv_heads, int64_t head_dim);
PDS_API int write_kv_bf16(const uint16_t *key PDS_SPAN((num_tokens - 1) * stride_k_tok + (num_kv_heads - 1) * stride_k_head + head_dim),
                         int64_t stride_k_tok, int64_t stride_k_head, const uint16_t *value PDS_SPAN((num_tokens - 1) * stride_v_tok + (num_kv_heads - 1) * stride_v_head + head_dim),
                          int64_t stride_v_tok, int64_t stride_v_head,
                          uint16_t *cache PDS_SPAN((num_blocks - 1) * stride_block + 1), int64_t stride_block,
                          int64_t stride_kv, int64_t stride_token, int64_t stride_head, int64_t num_blocks,
                          int64_t block_size, const int64_t *slots PDS_SPAN(num_tokens), int64_t num_tokens,
                          int64_t num_kv_heads, int64_t head_dim);
PDS_API int paged_decode_attention(const void *query PDS_SPAN((num_seqs - 1) * stride_q_seq + (num_kv_heads * group - 1) * stride_q_head + head_dim),
                                   int64_t stride_q_seq, int64_t stride_q_head,
                                   const void *kv_cache, int64_t stride_block, int64_t stride_kv, int64_t stride_token,
                                   int64_t stride_head, const int32_t *block_tables PDS_SPAN((num_seqs - 1) * stride_table + 1),
                                   int64_t stride_table, const int32_t *seq_lens PDS_SPAN(num_seqs),
                                   void *out PDS_SPAN((num_seqs - 1) * stride_out_seq + (num_kv_heads * group - 1) * stride_out_head + head_dim),
                                   int64_t stride_out_seq,
                                   int64_t stride_out_head, int num_seqs, int num_kv_heads, int group, int head_dim,
                                   int block_size, float scale, int kv_bf16);
/* Whether paged_decode_attention has a path for these sizes (1) or answers PDS_ERR_UNSUPPORTED (0). */
PDS_API int paged_decode_attention_takes(int num_heads, int head_dim, int block_size, int kv_bf16);
/* For tests: the lines of the next panel each of num_groups row groups prefetches (panels.h). */
PDS_API int next_panel_plan(int64_t num_groups, int64_t num_w_rows, int64_t *first PDS_SPAN(num_groups),
                            int64_t *count PDS_SPAN(num_groups));

/* ---- AVX-512 (x86-64-v4) and above ---- */
PDS_API int f32_linear_ready(void);
PDS_API int f32_linear(const float *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m, int64_t k,
                       const float *packed PDS_SPAN(n * k), int64_t n, const float *bias PDS_NULLABLE,
                       float *out PDS_SPAN((m - 1) * out_stride + n), int64_t out_stride);
PDS_API int f32_gate_up_ready(void);
PDS_API int f32_gate_up(const float *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m, int64_t k,
                        const float *packed PDS_SPAN(2 * inter * k), int64_t inter, int gated,
                        float *out PDS_SPAN((m - 1) * out_stride + inter), int64_t out_stride);
PDS_API int prefill_attention_f32_ready(void);
PDS_API int prefill_attention_f32(const float *query PDS_SPAN((num_tokens - 1) * q_tok + (num_heads - 1) * q_head + head_dim), int64_t q_tok, int64_t q_head, const float *cache PDS_SPAN((num_blocks - 1) * s_block + 1),
                                  int64_t s_block, int64_t s_kv, int64_t s_off, int64_t s_head, int64_t num_blocks,
                                  int64_t block_size, const int32_t *tables PDS_SPAN((num_seqs - 1) * table_stride + table_width), int64_t table_stride,
                                  int64_t table_width, const int32_t *cu PDS_SPAN(num_seqs + 1),
                                  const int32_t *lens PDS_SPAN(num_seqs), int64_t num_seqs, int64_t num_tokens,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, float *out PDS_SPAN((num_tokens - 1) * o_tok + (num_heads - 1) * o_head + head_dim),
                                  int64_t o_tok, int64_t o_head);
PDS_API int decode_layers(int linear_kind, const pds_layer *layers, int64_t num_layers, const pds_step *step);

/* ---- AVX512-BF16 and AVX512-VNNI and above ---- */
PDS_API int bf16_linear_ready(void);
PDS_API int64_t bf16_linear_chunk(int64_t m, int64_t k);
PDS_API double bf16_linear_dot_ratio(void);
PDS_API int bf16_linear(const uint16_t *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m, int64_t k,
                        const uint16_t *packed PDS_SPAN(n * k), int64_t n, const float *bias PDS_NULLABLE,
                        uint16_t *out PDS_SPAN((m - 1) * out_stride + n), int64_t out_stride);
PDS_API int bf16_linear_wide(const uint16_t *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m,
                             int64_t k, const uint16_t *packed PDS_SPAN(n * k), int64_t n, const float *bias PDS_NULLABLE,
                             uint16_t *out PDS_SPAN((m - 1) * out_stride + n), int64_t out_stride);
PDS_API int prefill_attention_bf16(const uint16_t *query PDS_SPAN((num_tokens - 1) * q_tok + (num_heads - 1) * q_head + head_dim), int64_t q_tok, int64_t q_head, const uint16_t *cache PDS_SPAN((num_blocks - 1) * s_block + 1),
                                   int64_t s_block, int64_t s_kv, int64_t s_off, int64_t s_head, int64_t num_blocks,
                                   int64_t block_size, const int32_t *tables PDS_SPAN((num_seqs - 1) * table_stride + table_width), int64_t table_stride,
                                   int64_t table_width, const int32_t *cu PDS_SPAN(num_seqs + 1),
                                   const int32_t *lens PDS_SPAN(num_seqs), int64_t num_seqs, int64_t num_tokens,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                   uint16_t *out PDS_SPAN((num_tokens - 1) * o_tok + (num_heads - 1) * o_head + head_dim), int64_t o_tok, int64_t o_head);
PDS_API int greedy_head_ready(void);
PDS_API int greedy_head_int8(const void *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m, int64_t k,
                             const int8_t *q8 PDS_SPAN(n * k), const float *scale PDS_SPAN(n),
                             const int32_t *qsum PDS_SPAN(n), const float *e_norm PDS_SPAN(n),
                             const float *w_norm PDS_SPAN(n), const void *wu PDS_SPAN(n * k),
                             const void *weight PDS_SPAN(n * k), int64_t n, int64_t chunk, int wide, int f32,
                             int64_t *out PDS_SPAN(m), int64_t *candidates_out PDS_NULLABLE);

/* ---- AMX ---- */
PDS_API int amx_linear_ready(void);
PDS_API int amx_linear_bf16(const uint16_t *x PDS_SPAN((m - 1) * x_stride + k), int64_t x_stride, int64_t m,
                            int64_t k, const uint16_t *packed PDS_SPAN(n * k), int64_t n, const float *bias PDS_NULLABLE,
                            uint16_t *out PDS_SPAN((m - 1) * out_stride + n), int64_t out_stride);
PDS_API int amx_attention_ready(void);
PDS_API int amx_prefill_attention_bf16(const uint16_t *query PDS_SPAN((num_tokens - 1) * q_tok + (num_heads - 1) * q_head + head_dim), int64_t q_tok, int64_t q_head, const uint16_t *cache PDS_SPAN((num_blocks - 1) * s_block + 1),
                                       int64_t s_block, int64_t s_kv, int64_t s_off, int64_t s_head,
                                       int64_t num_blocks, int64_t block_size, const int32_t *tables PDS_SPAN((num_seqs - 1) * table_stride + table_width),
                                       int64_t table_stride, int64_t table_width,
                                       const int32_t *cu PDS_SPAN(num_seqs + 1), const int32_t *lens PDS_SPAN(num_seqs),
                                       int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim, float scale, uint16_t *out PDS_SPAN((num_tokens - 1) * o_tok + (num_heads - 1) * o_head + head_dim), int64_t o_tok, int64_t o_head);

#endif
