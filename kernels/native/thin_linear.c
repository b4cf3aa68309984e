/* thin_linear: y[T, N] = x[T, K] @ w[N, K]^T for a few tokens T, fp32, on the CPU.
 *
 * A decode or verify step of a small LM on a CPU is bound by reading the weights once. BLAS runs
 * one token as a streaming gemv, but 2+ tokens go through its gemm path, which on these machines
 * costs 1.6-1.9x the one-token time. This kernel reads each weight row once and computes the dot
 * products of that row with every token (3 at a time, for 8 rows at once, held in vector
 * registers; the rows stay in L2 while the next 3 tokens pass), so a forward of 1-8 tokens costs
 * about one pass over the weights from memory.
 *
 * Parallel over output rows on the process's worker threads (pool.h). Each output value is summed
 * in the same order whatever T is: a token's result does not depend on how many tokens share the
 * call.
 * Built with -march=native by kernels/thin_linear.py (vector width 16 with AVX-512, else 8).
 * thin_linear_bf16 reads bf16 weights (half the bytes; widened to fp32 in registers, fp32 sums):
 * for drafters, whose numerics never change what is emitted, only how often drafts are accepted.
 */

#include "pool.h"
#include "simd.h"

#define ROWS_PER_PASS 8 /* weight rows streamed together: each load of x feeds 8 FMAs */
#define T_CHUNK 3        /* tokens per pass: 8 x 3 accumulators + 8 weight vectors in registers */
#define ROW_BLOCK 32     /* rows of w kept hot in L2 while every chunk of tokens passes over them */
/* Each pass also asks for the same columns of the next 8 rows (into L2), as packed_linear.c does
 * for its panels: measured with infra.costs.measure_costs on the 2-core Xeon, alternating, a
 * selfspec draft token cost 0.155-0.174 of a target step before and 0.143-0.156 after, a
 * standalone one 0.121-0.138 and 0.114-0.127. */

/* Weight loads: fp32 as is; bf16 (the upper 16 bits of an fp32) widened in registers, so a bf16
 * weight costs half the memory traffic and its products are the same fp32 products. */
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
static inline vf load_f32(const float *p) { return *(const vf *)p; }
static inline vf load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    /* one 256-bit load widened to 512 bits (GCC splits the generic form into two halves) */
    __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vf)wide;
#else
    vi wide = __builtin_convertvector(*(const vh *)p, vi) << 16;
    return (vf)wide;
#endif
}
static inline float scalar_f32(const float *p) { return *p; }
static inline float scalar_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)*p << 16};
    return v.f;
}

/* Rows [n0, n1) of y for T tokens of x (T a compile-time constant: loops unroll, accumulators
 * stay in registers). Measured on a 2-core AMD EPYC (AVX-512 and AVX2 builds alike), 8 rows x 3
 * tokens beat 2x8, 4x4, 6x4, 12x2 and 16x1: per pass over 16 floats of 8 rows, T loads of x feed
 * 8T FMAs. Leftover rows (fewer than 8) go one at a time. WT: the weights' element type. */
#define DEFINE_ROWS(SUFFIX, WT, T)                                                           \
    static void rows_##SUFFIX##_##T(const float *restrict x, const WT *restrict w,            \
                                    float *restrict y, long N, long K, long n0, long n1) {    \
        long n = n0;                                                                        \
        for (; n + ROWS_PER_PASS <= n1; n += ROWS_PER_PASS) {                               \
            const WT *w0 = w + n * K;                                                       \
            vf acc[ROWS_PER_PASS][T];                                                       \
            for (int r = 0; r < ROWS_PER_PASS; r++)                                         \
                for (int t = 0; t < T; t++) acc[r][t] = (vf){0};                            \
            long k = 0;                                                                     \
            for (; k + VW <= K; k += VW) {                                                  \
                vf wv[ROWS_PER_PASS];                                                       \
                for (int r = 0; r < ROWS_PER_PASS; r++)                                     \
                    __builtin_prefetch(w0 + (r + ROWS_PER_PASS) * K + k, 0, 1);             \
                for (int r = 0; r < ROWS_PER_PASS; r++) wv[r] = load_##SUFFIX(w0 + r * K + k); \
                for (int t = 0; t < T; t++) {                                               \
                    vf xv = *(const vf *)(x + t * K + k);                                   \
                    for (int r = 0; r < ROWS_PER_PASS; r++) acc[r][t] += wv[r] * xv;        \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < ROWS_PER_PASS; r++)                                         \
                for (int t = 0; t < T; t++) {                                               \
                    float s = hsum(acc[r][t]);                                              \
                    for (long j = k; j < K; j++) s += scalar_##SUFFIX(w0 + r * K + j) * x[t * K + j]; \
                    y[t * N + n + r] = s;                                                   \
                }                                                                           \
        }                                                                                   \
        for (; n < n1; n++) /* one token at a time: the same code whatever T (an AVX2 */   \
            for (int t = 0; t < T; t++) { /* build's T-token loop differed in the last bit) */ \
                const WT *w0 = w + n * K;                                                   \
                vf acc = (vf){0};                                                           \
                long k = 0;                                                                 \
                for (; k + VW <= K; k += VW)                                                \
                    acc += load_##SUFFIX(w0 + k) * *(const vf *)(x + t * K + k);            \
                float s = hsum(acc);                                                        \
                for (long j = k; j < K; j++) s += scalar_##SUFFIX(w0 + j) * x[t * K + j];   \
                y[t * N + n] = s;                                                           \
            }                                                                               \
    }

DEFINE_ROWS(f32, float, 1)
DEFINE_ROWS(f32, float, 2)
DEFINE_ROWS(f32, float, 3)
DEFINE_ROWS(bf16, uint16_t, 1)
DEFINE_ROWS(bf16, uint16_t, 2)
DEFINE_ROWS(bf16, uint16_t, 3)

/* One driver per weight type: the worker threads split the rows (whole passes of 8), token
 * chunks inside a block. */
#define DEFINE_DRIVER(NAME, SUFFIX, WT)                                                      \
    typedef void (*rows_##SUFFIX##_fn)(const float *, const WT *, float *, long, long, long, long); \
    static const rows_##SUFFIX##_fn ROWS_##SUFFIX[T_CHUNK + 1] = {                          \
        0, rows_##SUFFIX##_1, rows_##SUFFIX##_2, rows_##SUFFIX##_3};                        \
    struct NAME##_job {                                                                     \
        const float *x;                                                                     \
        const WT *w;                                                                        \
        float *y;                                                                           \
        long T, N, K;                                                                       \
    };                                                                                      \
    static void NAME##_run(void *ctx, int id, int nt) {                                     \
        const struct NAME##_job *j = ctx;                                                   \
        long N = j->N, T = j->T, K = j->K;                                                  \
        long per = ((N + nt - 1) / nt + ROWS_PER_PASS - 1) / ROWS_PER_PASS * ROWS_PER_PASS; \
        long lo = id * per < N ? id * per : N, hi = lo + per < N ? lo + per : N;            \
        for (long b = lo; b < hi; b += ROW_BLOCK) {                                         \
            long e = b + ROW_BLOCK < hi ? b + ROW_BLOCK : hi;                               \
            for (long t0 = 0; t0 < T; t0 += T_CHUNK) {                                      \
                long tt = T - t0 < T_CHUNK ? T - t0 : T_CHUNK;                              \
                ROWS_##SUFFIX[tt](j->x + t0 * K, j->w, j->y + t0 * N, N, K, b, e);          \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    int NAME(const float *x, const WT *w, float *y, long T, long N, long K, int threads) {   \
        if (T < 1 || N < 1 || K < 1 || threads < 1) return -1;                              \
        struct NAME##_job j = {x, w, y, T, N, K};                                           \
        spl_parallel(NAME##_run, &j, threads);                                              \
        return 0;                                                                           \
    }

/* x [T, K] fp32, w [N, K] fp32 or bf16, y [T, N] fp32, all contiguous. Return 0, or -1 on bad
 * arguments. */
DEFINE_DRIVER(thin_linear, f32, float)
DEFINE_DRIVER(thin_linear_bf16, bf16, uint16_t)

int thin_linear_vector_width(void) { return VW; }
