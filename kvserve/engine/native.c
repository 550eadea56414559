/* The engine's C kernels (kvserve/engine/native.py builds and loads this file): attention read where the keys and
 * values lie in the paged KV cache (engine.paged_attention calls it for a step's decode rows and prompt chunks on
 * a CPU), the linear layers' product, RMSNorm, rotary with the KV write, and a copy that checks the values it
 * moves (a block fetched from the store into a cache slot).
 *
 * Each decode row has one query per head. For each row and KV head, the queries of the heads that share that
 * KV head (the group) walk the row's blocks in order: a block's scores, then an online softmax (a running
 * maximum and sum, the output rescaled when the maximum grows), as a flash kernel does. Nothing is gathered:
 * SDPA needs each row's keys and values copied out of their blocks first, a copy as large as what it reads.
 *
 * Layout of the cache: [blocks][layers][2 (keys, values)][block_size][kv_heads][head_dim], float32.
 * Returned per row, KV head and group member: the output and the log-sum-exp of its scores (what
 * cascade attention needs to merge this part with the shared prefix's).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (a score minus the running maximum), vectorizable: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by
 * its Taylor polynomial to r^7 (relative error under 2e-7, about one float ulp), 2^n put in the exponent bits.
 * Below -87 (e^x under the smallest normal float) it gives 0. */
/* 16 floats, whatever vectors the CPU has (one AVX-512 register, two AVX2 ones): a dot product of head_dim
 * (a multiple of 16) summed lane by lane, then across the lanes in four halvings. An `omp simd` reduction
 * would sum the lanes one by one, for every key. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* The KV cache and the packed weights hold float32 or bfloat16 (a float32's upper 16 bits); the kernels read either
 * as float32. `bf16` is a constant wherever these are inlined, so each kernel is built once per type, no branch. */
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));

static inline __attribute__((always_inline)) const void *elem_at(const void *p, int64_t i, const int bf16) {
    return (const char *)p + i * (bf16 ? 2 : 4);
}

static inline __attribute__((always_inline)) float load_f32(const void *p, int64_t i, const int bf16) {
    if (!bf16)
        return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) v16 load16_f32(const void *p, int64_t i, const int bf16) {
    if (!bf16)
        return *(const v16 *)((const float *)p + i);
    return (v16)(__builtin_convertvector(*(const u16x16 *)((const uint16_t *)p + i), u32x16) << 16);
}

static inline __attribute__((always_inline)) float dot16(const float *a, const void *b, int64_t n, const int bf16) {
    v16 acc = *(const v16 *)a * load16_f32(b, 0, bf16);
    for (int64_t i = 16; i < n; i += 16)
        acc += *(const v16 *)(a + i) * load16_f32(b, i, bf16);
    acc += __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += __builtin_shufflevector(acc, acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += __builtin_shufflevector(acc, acc, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return acc[0];
}

#pragma omp declare simd
static inline float exp_nonpositive(float x) {
    const int under = x < -87.0f;
    x = under ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return under ? 0.0f : p * scale.f;
}

typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

/* exp_nonpositive on 16 lanes at once: the same steps, in vector operations. */
static inline v16 exp16_nonpositive(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    const i16v under = x < lo;
    x = (v16)(((i16v)x & ~under) | ((i16v)lo & under));
    const v16 y = x * 1.44269504088896341f + 0.5f;
    i16v ni = __builtin_convertvector(y, i16v); /* toward zero: one less where that rounded up */
    ni += __builtin_convertvector(ni, v16) > y;
    const v16 n = __builtin_convertvector(ni, v16);
    const v16 r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    v16 p = (v16){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (v16)((i16v)(p * (v16)((ni + 127) << 23)) & ~under);
}

/* The next block's keys and values (`n` values at `p`, one layer's), asked for a few lines at a time while the
 * current block is computed. Blocks lie anywhere in the cache, so the hardware's prefetchers learn each one's
 * addresses only after its first misses; but asked all at once (384 lines of a float32 SmolLM2 block) the requests
 * fill the core's miss buffers and the last of them wait for memory, the block's compute after them. Spread over
 * the current block's loops, the next block's reads overlap its compute: decode attention over 16 rows of 200
 * tokens, SmolLM2's shape, 8.9 -> 6.2 ms; one row of 2,000 tokens 5.4 -> 3.4 ms; prompt chunks 11-19 % faster. */
typedef struct {
    const char *p;
    int64_t at, end; /* bytes asked for, bytes in all */
} Ahead;

static inline Ahead ahead(const void *p, int64_t n, const int bf16) {
    return (Ahead){p, 0, p == NULL ? 0 : n * (bf16 ? 2 : 4)};
}

static inline int64_t lines_each(const Ahead *a, int64_t calls) { /* spread over `calls` calls of ask */
    return (a->end / 64 + calls - 1) / calls;
}

static inline __attribute__((always_inline)) void ask(Ahead *a, int64_t lines) {
    for (int64_t i = 0; i < lines && a->at < a->end; i++, a->at += 64)
        __builtin_prefetch(a->p + a->at, 0, 2);
}

/* One row's attention over blocks [first, last) of its table: unnormalized outputs o, maxima m and sums l for
 * each of its queries (kv_heads * group of them, KV head major). A block's keys are read once, KV head by KV head,
 * against the group's queries; then its values likewise, each query's output summed in registers over the
 * block's tokens. Inlined for the usual head sizes (attend_row), so that the compiler knows head_dim: the loops
 * over it unroll, and an output row of 64 or 128 floats stays in registers across a block. */
static inline __attribute__((always_inline)) void attend_blocks(
    const float *restrict q, const void *restrict kv, const int64_t *table, int64_t len, int64_t first,
    int64_t last, int64_t block_stride, int64_t layer_offset, int64_t block_size, int64_t kv_heads, int64_t group,
    const int64_t head_dim, float scale, float *restrict o, float *restrict m, float *restrict l, const int bf16) {
    const int64_t queries = kv_heads * group, slot = kv_heads * head_dim, half = block_size * slot;
    float s[queries][block_size];
    for (int64_t i = 0; i < queries; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(o, 0, sizeof(float) * queries * head_dim);
    for (int64_t b = first; b < last; b++) {
        const void *k = elem_at(kv, table[b] * block_stride + layer_offset, bf16), *v = elem_at(k, half, bf16);
        Ahead next = ahead(b + 1 < last ? elem_at(kv, table[b + 1] * block_stride + layer_offset, bf16) : NULL,
                           2 * half, bf16);
        const int64_t n = len - b * block_size < block_size ? len - b * block_size : block_size;
        const int64_t per = lines_each(&next, kv_heads * n);
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t t = 0; t < n; t++) {
                ask(&next, per);
                const void *kt = elem_at(k, t * slot + h * head_dim, bf16);
                for (int64_t g = 0; g < group; g++) {
                    const float *qi = q + (h * group + g) * head_dim;
                    float dot = 0.0f;
                    if (head_dim % 16 == 0) {
                        dot = dot16(qi, kt, head_dim, bf16);
                    } else {
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; d++)
                            dot += qi[d] * load_f32(kt, d, bf16);
                    }
                    s[h * group + g][t] = dot * scale;
                }
            }
        }
        for (int64_t i = 0; i < queries; i++) {
            if (block_size == 16) { /* the block's 16 scores as one vector (past n: -inf, whatever the slot holds) */
                v16 sv;
                memcpy(&sv, s[i], sizeof sv);
                for (int t = n; t < 16; t++)
                    sv[t] = -INFINITY;
                float top = m[i];
                for (int t = 0; t < 16; t++)
                    top = sv[t] > top ? sv[t] : top;
                if (top > m[i]) {
                    const float c = exp_nonpositive(m[i] - top);
                    l[i] *= c;
                    for (int64_t d = 0; d < head_dim; d++)
                        o[i * head_dim + d] *= c;
                    m[i] = top;
                }
                const v16 pv = exp16_nonpositive(sv - top);
                memcpy(s[i], &pv, sizeof pv);
                float sum = 0.0f;
                for (int t = 0; t < 16; t++)
                    sum += pv[t];
                l[i] += sum;
                continue;
            }
            float top = m[i];
            for (int64_t t = 0; t < n; t++)
                top = s[i][t] > top ? s[i][t] : top;
            if (top > m[i]) { /* rescale what was summed under the old maximum */
                const float c = exp_nonpositive(m[i] - top);
                l[i] *= c;
                for (int64_t d = 0; d < head_dim; d++)
                    o[i * head_dim + d] *= c;
                m[i] = top;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                s[i][t] = exp_nonpositive(s[i][t] - top);
                sum += s[i][t];
            }
            l[i] += sum;
        }
        ask(&next, next.end / 64); /* what is left (a short last block) */
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t g = 0; g < group; g++) {
                float *oi = o + (h * group + g) * head_dim;
                const float *p = s[h * group + g];
                for (int64_t t = 0; t < n; t++) {
                    const void *vt = elem_at(v, t * slot + h * head_dim, bf16);
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        oi[d] += p[t] * load_f32(vt, d, bf16);
                }
            }
        }
    }
}

/* attend_blocks for many queries per KV head (WIDE_GROUP or more: a step's rows over a prefix they share, read
 * once for all of them), 16 queries at a time in the lanes of a vector: a block's scores as head_dim
 * multiply-adds of the queries' d-th elements by each key's d-th, broadcast, with no sum across lanes; the
 * softmax's maxima and sums lane by lane. qt holds the queries transposed and scaled: [kv_heads][chunks][head_dim]
 * of 16 lanes, zero past the last query. */
#define WIDE_GROUP 8
static inline __attribute__((always_inline)) void attend_blocks_wide(
    const v16 *restrict qt, const void *restrict kv, const int64_t *table, int64_t len, int64_t first, int64_t last,
    int64_t block_stride, int64_t layer_offset, const int64_t block_size, int64_t kv_heads, int64_t group,
    const int64_t head_dim, float *restrict o, float *restrict m, float *restrict l, const int bf16) {
    const int64_t queries = kv_heads * group, slot = kv_heads * head_dim, half = block_size * slot;
    const int64_t chunks = (group + 15) / 16;
    v16 mv[kv_heads * chunks], lv[kv_heads * chunks], s[16];
    for (int64_t i = 0; i < kv_heads * chunks; i++) {
        for (int j = 0; j < 16; j++) {
            mv[i][j] = -INFINITY;
            lv[i][j] = 0.0f;
        }
    }
    memset(o, 0, sizeof(float) * queries * head_dim);
    for (int64_t b = first; b < last; b++) {
        const void *k = elem_at(kv, table[b] * block_stride + layer_offset, bf16), *v = elem_at(k, half, bf16);
        Ahead next = ahead(b + 1 < last ? elem_at(kv, table[b + 1] * block_stride + layer_offset, bf16) : NULL,
                           2 * half, bf16);
        const int64_t n = len - b * block_size < block_size ? len - b * block_size : block_size;
        const int64_t per = lines_each(&next, kv_heads * group);
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t c = 0; c < chunks; c++) {
                const v16 *qc = qt + (h * chunks + c) * head_dim;
                /* every slot of the block (past n: whatever it holds, never read as a score) */
                for (int64_t t0 = 0; t0 < block_size; t0 += 8) { /* 8 tokens a pass: their sums stay in registers */
                    const int64_t tn = block_size - t0 < 8 ? block_size - t0 : 8;
                    v16 acc[8] = {{0}};
                    const void *kt = elem_at(k, t0 * slot + h * head_dim, bf16);
                    for (int64_t d = 0; d < head_dim; d++) {
                        const v16 qd = qc[d];
                        for (int64_t t = 0; t < tn; t++)
                            acc[t] += qd * load_f32(kt, t * slot + d, bf16);
                    }
                    for (int64_t t = 0; t < tn; t++)
                        s[t0 + t] = acc[t];
                }
                v16 top = mv[h * chunks + c];
                for (int64_t t = 0; t < n; t++)
                    top = (v16)(((i16v)s[t] & (s[t] > top)) | ((i16v)top & ~(s[t] > top)));
                const v16 corr = exp16_nonpositive(mv[h * chunks + c] - top);
                v16 sum = {0}, p[16];
                for (int64_t t = 0; t < n; t++) {
                    p[t] = exp16_nonpositive(s[t] - top);
                    sum += p[t];
                }
                lv[h * chunks + c] = lv[h * chunks + c] * corr + sum;
                mv[h * chunks + c] = top;
                const int64_t g_end = group - c * 16 < 16 ? group - c * 16 : 16;
                for (int64_t j = 0; j < g_end; j++) {
                    ask(&next, per);
                    float *oi = o + (h * group + c * 16 + j) * head_dim;
                    const float cj = corr[j];
                    for (int64_t d = 0; d < head_dim; d++)
                        oi[d] *= cj;
                    for (int64_t t = 0; t < n; t++) {
                        const void *vt = elem_at(v, t * slot + h * head_dim, bf16);
                        const float pt = p[t][j];
                        for (int64_t d = 0; d < head_dim; d++)
                            oi[d] += pt * load_f32(vt, d, bf16);
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        for (int64_t g = 0; g < group; g++) {
            m[h * group + g] = mv[h * chunks + g / 16][g % 16];
            l[h * group + g] = lv[h * chunks + g / 16][g % 16];
        }
    }
}

/* attend_blocks_wide and attend_blocks, inlined for the usual head and block sizes, for the cache's type (bf16). */
static inline __attribute__((always_inline)) void attend_row_wide_as(
    const v16 *qt, const void *kv, const int64_t *table, int64_t len, int64_t first, int64_t last,
    int64_t block_stride, int64_t layer_offset, int64_t block_size, int64_t kv_heads, int64_t group,
    int64_t head_dim, float *o, float *m, float *l, const int bf16) {
    if (head_dim == 64 && block_size == 16)
        attend_blocks_wide(qt, kv, table, len, first, last, block_stride, layer_offset, 16, kv_heads, group,
                           64, o, m, l, bf16);
    else if (head_dim == 128 && block_size == 16)
        attend_blocks_wide(qt, kv, table, len, first, last, block_stride, layer_offset, 16, kv_heads, group,
                           128, o, m, l, bf16);
    else
        attend_blocks_wide(qt, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                           head_dim, o, m, l, bf16);
}

static void attend_row_wide(const v16 *qt, const void *kv, const int64_t *table, int64_t len, int64_t first,
                            int64_t last, int64_t block_stride, int64_t layer_offset, int64_t block_size,
                            int64_t kv_heads, int64_t group, int64_t head_dim, float *o, float *m, float *l, int bf16) {
    if (bf16)
        attend_row_wide_as(qt, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                           head_dim, o, m, l, 1);
    else
        attend_row_wide_as(qt, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                           head_dim, o, m, l, 0);
}

static inline __attribute__((always_inline)) void attend_row_as(
    const float *q, const void *kv, const int64_t *table, int64_t len, int64_t first, int64_t last,
    int64_t block_stride, int64_t layer_offset, int64_t block_size, int64_t kv_heads, int64_t group,
    int64_t head_dim, float scale, float *o, float *m, float *l, const int bf16) {
    if (head_dim == 64)
        attend_blocks(q, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group, 64,
                      scale, o, m, l, bf16);
    else if (head_dim == 128)
        attend_blocks(q, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group, 128,
                      scale, o, m, l, bf16);
    else
        attend_blocks(q, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                      head_dim, scale, o, m, l, bf16);
}

static void attend_row(const float *q, const void *kv, const int64_t *table, int64_t len, int64_t first,
                       int64_t last, int64_t block_stride, int64_t layer_offset, int64_t block_size,
                       int64_t kv_heads, int64_t group, int64_t head_dim, float scale, float *o, float *m, float *l,
                       int bf16) {
    if (bf16)
        attend_row_as(q, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                      head_dim, scale, o, m, l, 1);
    else
        attend_row_as(q, kv, table, len, first, last, block_stride, layer_offset, block_size, kv_heads, group,
                      head_dim, scale, o, m, l, 0);
}

/* q [rows][kv_heads][group][head_dim]; kv [blocks][layers][2][block_size][kv_heads][head_dim], float32 or, where
 * kv_bf16, bfloat16; tables [rows][width]; lens [rows]; out like q; lse [rows][kv_heads][group]. A row's blocks are
 * split in ranges, enough for every thread to have work with a single row, and the ranges' results merged by their
 * maxima and sums. Returns 0; -2, reading nothing, when a row's length or a block it reads is out of bounds; -1 when out
 * of memory. */
int kvserve_decode_attention(const float *q, const void *kv, int64_t blocks, const int64_t *tables,
                             const int64_t *lens, int64_t rows, int64_t width, int64_t layers, int64_t layer,
                             int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, float scale,
                             float *out, float *lse, int64_t kv_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        if (lens[r] < 1 || lens[r] > width * block_size)
            return -2;
        for (int64_t b = 0; b * block_size < lens[r]; b++)
            if (tables[r * width + b] < 0 || tables[r * width + b] >= blocks)
                return -2;
    }
    if (layer < 0 || layer >= layers)
        return -2;
    const int64_t queries = kv_heads * group, half = block_size * kv_heads * head_dim;
    const int64_t block_stride = layers * 2 * half, layer_offset = layer * 2 * half;
    const int64_t threads = omp_get_max_threads();
    int64_t splits = (2 * threads + rows - 1) / rows;
    if (splits > width)
        splits = width;
    float *part = malloc(sizeof(float) * rows * splits * queries * (head_dim + 2));
    if (part == NULL)
        return -1;
    float *part_m = part + rows * splits * queries * head_dim, *part_l = part_m + rows * splits * queries;
    const int64_t chunks = (group + 15) / 16;
    v16 *qt = NULL;
    if (group >= WIDE_GROUP) { /* the queries transposed, scaled, 16 to a vector (attend_blocks_wide) */
        qt = aligned_alloc(64, sizeof(v16) * rows * kv_heads * chunks * head_dim);
        if (qt == NULL) {
            free(part);
            return -1;
        }
        memset(qt, 0, sizeof(v16) * rows * kv_heads * chunks * head_dim);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++)
                    for (int64_t d = 0; d < head_dim; d++)
                        qt[((r * kv_heads + h) * chunks + g / 16) * head_dim + d][g % 16] =
                            q[((r * kv_heads + h) * group + g) * head_dim + d] * scale;
    }
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t p = 0; p < splits; p++) {
            const int64_t blocks = (lens[r] + block_size - 1) / block_size, at = (r * splits + p) * queries;
            if (qt != NULL)
                attend_row_wide(qt + r * kv_heads * chunks * head_dim, kv, tables + r * width, lens[r],
                                blocks * p / splits, blocks * (p + 1) / splits, block_stride, layer_offset, block_size,
                                kv_heads, group, head_dim, part + at * head_dim, part_m + at, part_l + at, kv_bf16 != 0);
            else
                attend_row(q + r * queries * head_dim, kv, tables + r * width, lens[r], blocks * p / splits,
                           blocks * (p + 1) / splits, block_stride, layer_offset, block_size, kv_heads, group,
                           head_dim, scale, part + at * head_dim, part_m + at, part_l + at, kv_bf16 != 0);
        }
    }
    free(qt);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < queries; i++) {
            float top = -INFINITY, sum = 0.0f;
            for (int64_t p = 0; p < splits; p++)
                top = part_m[(r * splits + p) * queries + i] > top ? part_m[(r * splits + p) * queries + i] : top;
            float *o = out + (r * queries + i) * head_dim;
            memset(o, 0, sizeof(float) * head_dim);
            for (int64_t p = 0; p < splits; p++) {
                const int64_t at = (r * splits + p) * queries + i;
                const float c = exp_nonpositive(part_m[at] - top);
                sum += part_l[at] * c;
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += part[at * head_dim + d] * c;
            }
            for (int64_t d = 0; d < head_dim; d++)
                o[d] /= sum;
            lse[r * queries + i] = top + logf(sum);
        }
    }
    free(part);
    return 0;
}

/* Copies `n` bytes of `width`-byte floats (2, 4 or 8) from src to dst; 1 when every value is finite (its exponent
 * bits, `exponent`, not all set), else 0. One pass over the bytes: the check rides on the copy's memory traffic,
 * where a separate pass over a fetched block would read it again. Bytes past the last whole value are copied
 * unchecked (none for a KV block). The check reads what was written (dst), never src again: src is memory
 * another process shares, and a compiler that turned the copy into a memcpy before the loop would otherwise
 * check a second read of it. */
#define COPY_FINITE(T)                                                                        \
    do {                                                                                      \
        T *d = dst, bad = 0, e = (T)exponent;                                                 \
        const T *s = src;                                                                     \
        for (int64_t i = 0; i < n / (int64_t)sizeof(T); i++) {                                \
            d[i] = s[i];                                                                      \
            bad |= (T)((d[i] & e) == e);                                                      \
        }                                                                                     \
        memcpy((char *)dst + n / sizeof(T) * sizeof(T), (const char *)src + n / sizeof(T) * sizeof(T), \
               n % sizeof(T));                                                                \
        return !bad;                                                                          \
    } while (0)

int kvserve_copy_finite(void *restrict dst, const void *restrict src, int64_t n, int width, uint64_t exponent) {
    switch (width) {
    case 2: COPY_FINITE(uint16_t);
    case 4: COPY_FINITE(uint32_t);
    case 8: COPY_FINITE(uint64_t);
    default: return -1;
    }
}

/* The linear layers' product, y = x w^T + bias, over a weight stored once in panels of PANEL output features:
 * [panels][k][PANEL] (engine.packed_linear packs them). Each panel is read front to back once for every 8 rows
 * of x (a decode step's few rows read it once): 8 rows' scalars broadcast against the panel's 2 vectors per
 * input feature, 16 sums in registers, no sum across lanes. oneDNN's product over its own packed layout took
 * 28.5 ms for one row of SmolLM2-135M's weights (its one-row path streams at 19 GB/s) where this takes 19.2 ms
 * (28 GB/s, what a plain read of memory reaches here); 32.4 against 25.4 ms for 16 rows; even from 512 rows.
 * A bfloat16 weight (`bf16`) is widened to float32 as it is read: half the bytes to stream, the same sums. Its
 * panels hold each row's 32 features interleaved, 0, 16, 1, 17, ..., so that one 64-byte load widens into both
 * vectors with a shift and a mask (gcc widened 16 at a time in four instructions, and streamed at 29 GB/s). */
#define PANEL 32

static inline __attribute__((always_inline)) void product_rows(int rows, const float *x, int64_t k,
                                                              const void *p, const float *bias, int64_t cols,
                                                              float *y, int64_t ldy, const int bf16) {
    v16 a0[8], a1[8];
    const v16 b0 = bias ? *(const v16 *)bias : (v16){0}, b1 = bias ? *(const v16 *)(bias + 16) : (v16){0};
    for (int r = 0; r < rows; r++) {
        a0[r] = b0;
        a1[r] = b1;
    }
    for (int64_t i = 0; i < k; i++) {
        v16 w0, w1;
        if (bf16) { /* a panel's row of 32 interleaved as (0, 16), (1, 17), ...: the even ones widen by a shift */
            const u32x16 pair = *(const u32x16 *)((const uint16_t *)p + i * PANEL);
            w0 = (v16)(pair << 16);
            w1 = (v16)(pair & 0xFFFF0000u);
        } else {
            w0 = *(const v16 *)((const float *)p + i * PANEL);
            w1 = *(const v16 *)((const float *)p + i * PANEL + 16);
        }
        for (int r = 0; r < rows; r++) {
            const float s = x[r * k + i];
            a0[r] += s * w0;
            a1[r] += s * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        if (cols == PANEL) {
            *(v16 *)(y + r * ldy) = a0[r];
            *(v16 *)(y + r * ldy + 16) = a1[r];
        } else { /* the last panel, past n: only its first cols are outputs */
            float out[PANEL];
            *(v16 *)out = a0[r];
            *(v16 *)(out + 16) = a1[r];
            memcpy(y + r * ldy, out, sizeof(float) * cols);
        }
    }
}

#define PRODUCT_ROWS(R)                                                                                        \
    static void product_rows_##R(const float *x, int64_t k, const void *p, const float *bias, int64_t cols,   \
                                 float *y, int64_t ldy) {                                                      \
        product_rows(R, x, k, p, bias, cols, y, ldy, 0);                                                       \
    }                                                                                                          \
    static void product_rows_bf16_##R(const float *x, int64_t k, const void *p, const float *bias,            \
                                      int64_t cols, float *y, int64_t ldy) {                                   \
        product_rows(R, x, k, p, bias, cols, y, ldy, 1);                                                       \
    }
PRODUCT_ROWS(1)
PRODUCT_ROWS(2)
PRODUCT_ROWS(3)
PRODUCT_ROWS(4)
PRODUCT_ROWS(5)
PRODUCT_ROWS(6)
PRODUCT_ROWS(7)
PRODUCT_ROWS(8)
typedef void (*product_fn)(const float *, int64_t, const void *, const float *, int64_t, float *, int64_t);
static const product_fn PRODUCTS[2][9] = {
    {NULL, product_rows_1, product_rows_2, product_rows_3, product_rows_4, product_rows_5, product_rows_6,
     product_rows_7, product_rows_8},
    {NULL, product_rows_bf16_1, product_rows_bf16_2, product_rows_bf16_3, product_rows_bf16_4, product_rows_bf16_5,
     product_rows_bf16_6, product_rows_bf16_7, product_rows_bf16_8}};

/* x [m][k]; p [ceil(n / PANEL)][k][PANEL], float32 or, where p_bf16, bfloat16; bias [ceil(n / PANEL) * PANEL] or
 * NULL; y [m][n]. Returns 0, or -2 (nothing written) for sizes below 1. */
int kvserve_linear(const float *x, int64_t m, int64_t k, const void *p, int64_t n, const float *bias, float *y,
                   int64_t p_bf16) {
    if (m < 1 || k < 1 || n < 1)
        return -2;
    const int64_t panels = (n + PANEL - 1) / PANEL, groups = (m + 7) / 8;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t j = 0; j < panels; j++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r = g * 8, rows = m - r < 8 ? m - r : 8, cols = n - j * PANEL < PANEL ? n - j * PANEL : PANEL;
            PRODUCTS[p_bf16 != 0][rows](x + r * k, k, elem_at(p, j * k * PANEL, p_bf16 != 0), bias ? bias + j * PANEL : NULL,
                                        cols, y + r * n + j * PANEL, n);
        }
    }
    return 0;
}

/* Hugging Face's RMSNorm of float32 rows, after adding x into the residual stream where `residual` is given:
 * residual += x (in place), out = weight * (residual / sqrt(mean(residual^2) + eps)). torch's rms_norm on a CPU
 * runs as half a dozen kernels (pow, mean, add, rsqrt, mul, mul): 31 us a call for one row of 576 here, twice
 * a layer. x [rows][dim] (read, or the residual itself where `residual` is NULL); out [rows][dim]. */
void kvserve_rms_norm(const float *x, float *residual, const float *weight, int64_t rows, int64_t dim, float eps,
                      float *out) {
#pragma omp parallel for schedule(static) if (rows * dim >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *h = residual ? residual + r * dim : (float *)xr, *o = out + r * dim;
        float sum = 0.0f;
        if (residual) {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) {
                h[i] += xr[i];
                sum += h[i] * h[i];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++)
                sum += h[i] * h[i];
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = weight[i] * (h[i] * scale);
    }
}

/* bfloat16 from float32, rounded to nearest, ties to even, as torch rounds (a NaN stays a NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t v) {
    return load_f32(&v, 0, 1);
}

/* kvserve_rms_norm in bfloat16, rounding where Hugging Face's bfloat16 ops round: the residual sum, the normalized
 * row before the weight's product, and that product; the mean of squares in float32. */
void kvserve_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t rows, int64_t dim,
                           float eps, uint16_t *out) {
#pragma omp parallel for schedule(static) if (rows * dim >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *h = residual ? residual + r * dim : (uint16_t *)xr, *o = out + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            if (residual)
                h[i] = to_bf16(load_f32(h, i, 1) + load_f32(xr, i, 1));
            const float v = load_f32(h, i, 1);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            const uint16_t n = to_bf16(load_f32(h, i, 1) * scale);
            o[i] = to_bf16(load_f32(weight, i, 1) * from_bf16(n)); /* the weight times the rounded row */
        }
    }
}

/* One head's rotary, in place: x * cos + (x turned by half) * sin; in bfloat16 each product is rounded, then their
 * sum, as bfloat16 tensors' ops round. */
static inline __attribute__((always_inline)) void rope_head(void *x, const void *c, const void *s,
                                                           const int64_t head_dim, const int bf16) {
    const int64_t half = head_dim / 2;
    float turned[head_dim];
    for (int64_t i = 0; i < half; i++) {
        turned[i] = load_f32(x, i + half, bf16);
        turned[i + half] = load_f32(x, i, bf16);
    }
    for (int64_t i = 0; i < head_dim; i++) {
        const float a = load_f32(x, i, bf16) * load_f32(c, i, bf16), b = turned[i] * load_f32(s, i, bf16);
        if (bf16)
            ((uint16_t *)x)[i] = to_bf16(from_bf16(to_bf16(a)) + from_bf16(to_bf16(b)));
        else
            ((float *)x)[i] = a + b;
    }
}

/* rope_head over a token's `n` heads, inlined for the usual head sizes (their loops then unroll and vectorize). */
static inline __attribute__((always_inline)) void rope_heads_as(char *q, int64_t n, const void *c, const void *s,
                                                               int64_t head_dim, const int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    if (head_dim == 64)
        for (int64_t h = 0; h < n; h++)
            rope_head(q + h * 64 * size, c, s, 64, bf16);
    else if (head_dim == 128)
        for (int64_t h = 0; h < n; h++)
            rope_head(q + h * 128 * size, c, s, 128, bf16);
    else
        for (int64_t h = 0; h < n; h++)
            rope_head(q + h * head_dim * size, c, s, head_dim, bf16);
}

/* Rotary embeddings on a step's queries and keys, in place, and its keys and values written into their cache
 * slots: qkv [tokens][heads + 2 * kv_heads][head_dim] (queries, keys, values); cos and sin [positions][head_dim],
 * sin with its first half negated, so that x * cos + (x turned by head_dim / 2) * sin is Hugging Face's
 * x * cos + rotate_half(x) * sin; a token's slot is block `blocks[t]`, offset `offsets[t]` in it; all float32, or
 * all bfloat16 where `bf16`. In torch this was a roll (itself a cat), two products, a sum and two indexed writes a
 * layer. Returns 0, or -2 (nothing written) where a position, block or offset is out of bounds. */
int kvserve_rope_store(void *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, const void *cos,
                       const void *sin, int64_t table_len, const int64_t *positions, void *kv, int64_t blocks,
                       int64_t layers, int64_t layer, int64_t block_size, const int64_t *slot_blocks,
                       const int64_t *offsets, int64_t bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_len || slot_blocks[t] < 0 || slot_blocks[t] >= blocks ||
            offsets[t] < 0 || offsets[t] >= block_size)
            return -2;
    if (layer < 0 || layer >= layers || head_dim % 2)
        return -2;
    const int64_t row = (heads + 2 * kv_heads) * head_dim, slot = kv_heads * head_dim, size = bf16 ? 2 : 4;
    const int64_t kv_half = block_size * slot, block_stride = layers * 2 * kv_half;
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + positions[t] * head_dim * size;
        const char *s = (const char *)sin + positions[t] * head_dim * size;
        char *q = (char *)qkv + t * row * size;
        if (bf16)
            rope_heads_as(q, heads + kv_heads, c, s, head_dim, 1);
        else
            rope_heads_as(q, heads + kv_heads, c, s, head_dim, 0);
        char *k = (char *)kv + (slot_blocks[t] * block_stride + layer * 2 * kv_half + offsets[t] * slot) * size;
        memcpy(k, q + heads * head_dim * size, size * slot);
        memcpy(k + kv_half * size, q + (heads + kv_heads) * head_dim * size, size * slot);
    }
    return 0;
}

/* A prompt chunk's attention over its context, read in place from the cache: n queries per head, the last at
 * context position ctx - 1, query i seeing the keys at positions 0 .. ctx - n + i (causal, aligned to the lower
 * right), the chunk's own keys already written. Per KV head, the queries of its group's heads over the chunk's
 * tokens, ordered token by token, go 16 to a vector (a tile): a block's scores as head_dim multiply-adds of the
 * tile's d-th elements by each key's d-th, broadcast; a key past a lane's position scores -inf; an online softmax
 * lane by lane; the tile's output kept transposed ([head_dim] vectors of 16 lanes) and summed as 16 output
 * elements at a time, each token's probabilities against its values' elements, broadcast. Nothing is gathered,
 * no score matrix is written: SDPA (or two oneDNN matmuls and a softmax) over a gathered context wrote and read
 * [queries][ctx] scores, and a cold 2.5k-token prompt on SmolLM2 spent 2 of its 5.3 s there. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *restrict q, int64_t q_token, int64_t q_head, const void *restrict kv, const int64_t *table,
    int64_t ctx, int64_t n, int64_t h, int64_t j0, int64_t block_stride, int64_t layer_offset,
    const int64_t block_size, int64_t kv_heads, int64_t group, const int64_t head_dim, float scale,
    float *restrict out, const int bf16) {
    const int64_t slot = kv_heads * head_dim, half = block_size * slot, heads = kv_heads * group;
    const int64_t lanes = n * group - j0 < 16 ? n * group - j0 : 16;
    v16 qt[head_dim], ot[head_dim], pos = {0};
    for (int64_t lane = 0; lane < 16; lane++) { /* lanes past the last query repeat it: never stored */
        const int64_t j = j0 + (lane < lanes ? lane : lanes - 1), i = j / group, g = j % group;
        const float *qi = q + i * q_token + (h * group + g) * q_head;
        for (int64_t d = 0; d < head_dim; d++)
            qt[d][lane] = qi[d] * scale;
        pos[lane] = (float)(ctx - n + i);
    }
    memset(ot, 0, sizeof ot);
    const int64_t first = ctx - n + j0 / group, end = ctx - n + (j0 + lanes - 1) / group + 1; /* keys read */
    v16 m = (v16){0} - INFINITY, l = {0};
    for (int64_t b = 0; b * block_size < end; b++) {
        const void *k = elem_at(kv, table[b] * block_stride + layer_offset + h * head_dim, bf16),
                   *v = elem_at(k, half, bf16);
        Ahead next = ahead((b + 1) * block_size < end ? elem_at(kv, table[b + 1] * block_stride + layer_offset, bf16)
                           : NULL, 2 * half, bf16);
        const int64_t nt = end - b * block_size < block_size ? end - b * block_size : block_size;
        const int64_t per = lines_each(&next, head_dim / 16 * nt);
        v16 s[block_size];
        int64_t t0 = 0;
        for (; t0 + 8 <= nt; t0 += 8) { /* 8 keys a pass: their sums stay in registers */
            v16 acc[8] = {{0}};
            const void *kt = elem_at(k, t0 * slot, bf16);
            for (int64_t d = 0; d < head_dim; d++) {
                const v16 qd = qt[d];
                for (int64_t t = 0; t < 8; t++)
                    acc[t] += qd * load_f32(kt, t * slot + d, bf16);
            }
            for (int64_t t = 0; t < 8; t++)
                s[t0 + t] = acc[t];
        }
        for (; t0 < nt; t0++) { /* the tile's last keys */
            v16 acc = {0};
            for (int64_t d = 0; d < head_dim; d++)
                acc += qt[d] * load_f32(k, t0 * slot + d, bf16);
            s[t0] = acc;
        }
        v16 top = m;
        for (int64_t t = 0; t < nt; t++) {
            const int64_t at = b * block_size + t;
            if (at > first) /* some lane's query lies before this key */
                s[t] = (v16)(((i16v)s[t] & ~(pos < (float)at)) | ((i16v)((v16){0} - INFINITY) & (pos < (float)at)));
            top = (v16)(((i16v)s[t] & (s[t] > top)) | ((i16v)top & ~(s[t] > top)));
        }
        const v16 corr = exp16_nonpositive(m - top); /* block 0 holds key 0, which every query sees: top is finite */
        v16 sum = {0};
        for (int64_t t = 0; t < nt; t++) {
            s[t] = exp16_nonpositive(s[t] - top);
            sum += s[t];
        }
        l = l * corr + sum;
        m = top;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) { /* 16 output elements' sums in registers */
            v16 acc[16];
            for (int64_t e = 0; e < 16; e++)
                acc[e] = ot[d0 + e] * corr;
            for (int64_t t = 0; t < nt; t++) {
                ask(&next, per);
                const v16 p = s[t];
                const void *vt = elem_at(v, t * slot + d0, bf16);
                for (int64_t e = 0; e < 16; e++)
                    acc[e] += p * load_f32(vt, e, bf16);
            }
            for (int64_t e = 0; e < 16; e++)
                ot[d0 + e] = acc[e];
        }
    }
    for (int64_t lane = 0; lane < lanes; lane++) {
        const int64_t j = j0 + lane, i = j / group, g = j % group;
        float *o = out + (i * heads + h * group + g) * head_dim;
        const float inv = 1.0f / l[lane];
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = ot[d][lane] * inv;
    }
}

static inline __attribute__((always_inline)) void attend_tile_as(
    const float *q, int64_t q_token, int64_t q_head, const void *kv, const int64_t *table, int64_t ctx, int64_t n,
    int64_t h, int64_t j0, int64_t block_stride, int64_t layer_offset, int64_t block_size, int64_t kv_heads,
    int64_t group, int64_t head_dim, float scale, float *out, const int bf16) {
    if (head_dim == 64 && block_size == 16)
        attend_tile(q, q_token, q_head, kv, table, ctx, n, h, j0, block_stride, layer_offset, 16, kv_heads, group, 64,
                    scale, out, bf16);
    else if (head_dim == 128 && block_size == 16)
        attend_tile(q, q_token, q_head, kv, table, ctx, n, h, j0, block_stride, layer_offset, 16, kv_heads, group,
                    128, scale, out, bf16);
    else if (head_dim % 16 == 0)
        attend_tile(q, q_token, q_head, kv, table, ctx, n, h, j0, block_stride, layer_offset, block_size, kv_heads,
                    group, head_dim, scale, out, bf16);
}

static void attend_tile_any(const float *q, int64_t q_token, int64_t q_head, const void *kv, const int64_t *table,
                            int64_t ctx, int64_t n, int64_t h, int64_t j0, int64_t block_stride, int64_t layer_offset,
                            int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, float scale,
                            float *out, int bf16) {
    if (bf16)
        attend_tile_as(q, q_token, q_head, kv, table, ctx, n, h, j0, block_stride, layer_offset, block_size, kv_heads,
                       group, head_dim, scale, out, 1);
    else
        attend_tile_as(q, q_token, q_head, kv, table, ctx, n, h, j0, block_stride, layer_offset, block_size, kv_heads,
                       group, head_dim, scale, out, 0);
}

/* q: the chunk's queries, query i of head hd at q[i * q_token + hd * q_head .. + head_dim]; kv
 * [blocks][layers][2][block_size][kv_heads][head_dim], float32 or, where kv_bf16, bfloat16; table [width], the sequence's blocks in order; out
 * [n][kv_heads * group][head_dim]. Tiles are taken last first (the longest: each reads up to its last query's
 * position), one at a time by whichever thread is free. Returns 0; -2, reading nothing, where ctx, n, the layer
 * or a block the chunk reads is out of bounds, or head_dim is not a multiple of 16. */
int kvserve_chunk_attention(const float *q, int64_t q_token, int64_t q_head, const void *kv, int64_t blocks,
                            const int64_t *table, int64_t width, int64_t ctx, int64_t n, int64_t layers, int64_t layer,
                            int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, float scale,
                            float *out, int64_t kv_bf16) {
    if (n < 1 || ctx < n || ctx > width * block_size || layer < 0 || layer >= layers || head_dim % 16 ||
        head_dim < 16 || block_size < 1 || kv_heads < 1 || group < 1)
        return -2;
    for (int64_t b = 0; b * block_size < ctx; b++)
        if (table[b] < 0 || table[b] >= blocks)
            return -2;
    const int64_t half = block_size * kv_heads * head_dim, tiles = (n * group + 15) / 16;
    const int64_t block_stride = layers * 2 * half, layer_offset = layer * 2 * half;
#pragma omp parallel for schedule(dynamic, 1) if (tiles * kv_heads > 1)
    for (int64_t w = 0; w < tiles * kv_heads; w++) {
        const int64_t tile = tiles - 1 - w / kv_heads, h = w % kv_heads;
        attend_tile_any(q, q_token, q_head, kv, table, ctx, n, h, tile * 16, block_stride, layer_offset, block_size,
                        kv_heads, group, head_dim, scale, out, kv_bf16 != 0);
    }
    return 0;
}
