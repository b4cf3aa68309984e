/* packed_linear_dot: y[T, N] = round_bf16(x)[T, K] @ w[N, K]^T on bf16 panels, with the CPU's bf16
 * dot product (AVX-512 BF16: vdpbf16ps), for forwards that run on rounded activations.
 *
 * Why: packed_linear.c's FMA kernel keeps a forward fp32-exact, one multiply-add per lane and
 * instruction. Past ~8 tokens a call is bound by those FMAs, not by the weight stream: on a 2-core
 * AMD EPYC (Zen 4, no AMX) a verify of 8 tokens costs ~1.5 one-token steps and one of 16 ~3.5
 * (ARCHITECTURE.md). vdpbf16ps does two bf16 multiply-adds per lane in the same slot (measured on
 * that CPU: 3.6 G instructions a second a core either way, so 115 G multiply-adds against 58), on
 * activations rounded to bf16 after the prologue (the norm, the activation), as a GPU's bf16 matmul
 * does. The weights are the very same bf16 panels (panel_layout.h): no second copy.
 *
 * Each output is one chain over k in order, two k at a time (w[k] x[k] + w[k+1] x[k+1] added to
 * the chain by one instruction, fp32, round to nearest even, denormals flushed), whatever T is: a
 * token's result does not depend on how many tokens share the call, so a verify and a decode
 * step of a forward that runs here agree bit for bit. Not fp32-exact against the weights (the
 * activations are rounded; relative error up to 2^-9 each): a forward chooses it as a whole
 * (kernels/packed_linear.py, PackedLinear.rounded).
 *
 * The bf16 panels hold each pair of rows k, k+1 interleaved (panel_layout.h), which is the
 * instruction's operand as it is: one load a vector of outputs, shared by every token of the
 * group. Groups of RMAX tokens make a pass over the panel each (the first streams it, the others
 * read it from L2), as packed_linear.c's passes do.
 *
 * Without AVX-512 BF16 the entry returns -1 and packed_linear_dot_available() 0 (the caller keeps
 * the FMA kernel). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_common.h"
#include "panel_layout.h"
#include "pool.h"
#include "simd.h"

#if defined(__AVX512BF16__) && VW == 16
#define HAVE_DOT 1

/* Rows prefetched ahead, into L2: twice the FMA kernel's bf16 distance (an iteration here does
 * half the instructions, so the same rows ahead were less time ahead), and into L2 whatever hint
 * the FMA kernel was timed to use (kernels/stream_hint.py). Measured on a 2-core AMD EPYC (Zen 4),
 * SmolLM2-135M's whole forward at 256 tokens of context (2 threads, median of 11, alternating in
 * one process; ms at 1 / 4 / 8 / 16 tokens): 64 rows into L2 7.11 / 10.30 / 11.82 / 18.80, 64
 * non-temporally 7.17 / 10.29 / 14.55 / 20.23, 32 non-temporally 7.24 / 10.14 / 13.66 / 19.91;
 * the exact FMA forward 7.08 / 10.08 / 15.64 / 28.06. */
#define DOT_PREFETCH_ROWS (4 * PREFETCH_ROWS)

/* Passes of at most this many tokens ask for no rows ahead: the hardware's stream prefetcher
 * keeps them fed, and the software prefetches only cost them. Measured on the same EPYC, the whole
 * forward at 200 tokens of context against the kernel that always prefetched (2 threads, median of
 * 41, alternating in one process, six runs): 1 token 0.98-1.02, 2 tokens 0.91-0.99, 3 tokens
 * 0.90-0.97; 4 tokens 1.00-1.04. With the distance a run-time knob, in a period of the VM whose
 * step took 7.4 ms instead of ~10: 1 / 2 / 3 tokens 0.89 / 0.90 / 0.88 (ARCHITECTURE.md, "Small
 * verifies without software prefetches"). */
#define DOT_HW_STREAM_TOKENS 3

/* A panel (outputs n0 .. n0+P) for R tokens of rounded activations xh [R, K] (K even) into
 * state [R][PV]. wp points at the panel's row 0. */
#define DEFINE_DOT_PANEL(NAME, R)                                                               \
    static void NAME##_##R(const uint16_t *restrict xh, const uint16_t *restrict wp,             \
                           vf *restrict state, long K) {                                        \
        __m512 acc[R][PV];                                                                      \
        for (int t = 0; t < R; t++)                                                             \
            for (int j = 0; j < PV; j++) acc[t][j] = _mm512_setzero_ps();                       \
        for (long k = 0; k < K; k += 2) {                                                       \
            const uint16_t *pair = wp + k * P; /* rows k and k+1, interleaved */              \
            for (int j = 0; j < PV && R > DOT_HW_STREAM_TOKENS; j++)                            \
                __builtin_prefetch(pair + DOT_PREFETCH_ROWS * P + j * 2 * VW, 0, 1);            \
            __m512bh w[PV];                                                                     \
            for (int j = 0; j < PV; j++)                                                        \
                w[j] = (__m512bh)_mm512_loadu_si512(pair + j * 2 * VW);                         \
            for (int t = 0; t < R; t++) {                                                       \
                int32_t xk;                                                                     \
                memcpy(&xk, xh + t * K + k, sizeof xk); /* x[t, k] and x[t, k+1] */            \
                __m512bh xb = (__m512bh)_mm512_set1_epi32(xk);                                  \
                for (int j = 0; j < PV; j++) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], w[j], xb); \
            }                                                                                   \
        }                                                                                       \
        for (int t = 0; t < R; t++)                                                             \
            for (int j = 0; j < PV; j++) state[t * PV + j] = (vf)acc[t][j];                     \
    }

DEFINE_DOT_PANEL(dot, 1)
DEFINE_DOT_PANEL(dot, 2)
DEFINE_DOT_PANEL(dot, 3)
DEFINE_DOT_PANEL(dot, 4)
DEFINE_DOT_PANEL(dot, 5)
DEFINE_DOT_PANEL(dot, 6)
DEFINE_DOT_PANEL(dot, 7)
DEFINE_DOT_PANEL(dot, 8)
DEFINE_DOT_PANEL(dot, 9)

typedef void (*dot_fn)(const uint16_t *, const uint16_t *, vf *, long);
static const dot_fn DOTS[RMAX + 1] = {0, dot_1, dot_2, dot_3, dot_4, dot_5, dot_6, dot_7, dot_8,
                                      dot_9};

/* Up to this many tokens every thread rounds all of them into its own copy (microseconds)
 * instead of its share and a wait at a barrier (as packed_linear_amx.c's PRIVATE_SPLIT_TOKENS). */
#define PRIVATE_ROUND_TOKENS 8

struct job {
    const float *x, *g, *res;
    const uint16_t *w;
    uint16_t *xh; /* rounded activations: [T, K], or [threads][T, K] when private */
    float *h, *y; /* prologue scratch: [T, K], or [threads][T, K] when private */
    float eps;
    int prologue;
    long T, N, K;
};

static void round_rows(const struct job *j, uint16_t *xh, float *h, long lo, long hi) {
    for (long t = lo; t < hi; t++)
        round_row_bf16(prologue_row(j->x, j->prologue, j->g, j->eps, h, t, j->K), xh + t * j->K,
                       j->K);
}

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long lo, hi, T = j->T, K = j->K;
    const uint16_t *xh = j->xh;
    if (T <= PRIVATE_ROUND_TOKENS) {
        uint16_t *mine = j->xh + id * T * K;
        round_rows(j, mine, j->h ? j->h + id * T * K : NULL, 0, T);
        xh = mine;
    } else {
        spl_range(T, id, n, &lo, &hi);
        round_rows(j, j->xh, j->h, lo, hi);
        spl_barrier(n); /* every token is rounded before any panel reads it */
    }
    vf state[RMAX * PV];
    spl_range((j->N + P - 1) / P, id, n, &lo, &hi);
    for (long p = lo; p < hi; p++) {
        const uint16_t *panel = j->w + p * K * P;
        for (long t0 = 0; t0 < T; t0 += RMAX) {
            long r = T - t0 < RMAX ? T - t0 : RMAX;
            DOTS[r](xh + t0 * K, panel, state, K);
            store_rows((const float *)state, P, j->res ? j->res + t0 * j->N : NULL,
                       j->y + t0 * j->N, r, j->N, p * P);
        }
    }
}
#endif

/* y [T, N] = round_bf16(prologue(x)) @ w^T (+ res [T, N] when not NULL), w the bf16 panels
 * [ceil(N/P), K, P] of packed_linear.py; arguments as packed_linear_fused_bf16's. K must be even.
 * Returns 0, or -1 on bad arguments or where the CPU has no bf16 dot product. */
int packed_linear_fused_bf16dot(const float *x, int prologue, const float *g, float eps,
                                const uint16_t *w, const float *res, float *y, long T, long N,
                                long K, int threads) {
#ifdef HAVE_DOT
    if (T < 1 || N < 1 || K < 2 || K % 2 || threads < 1 || prologue < 0 || prologue > 2) return -1;
    if ((prologue == PROLOGUE_RMSNORM && !g) || !w) return -1;
    long copies = T <= PRIVATE_ROUND_TOKENS ? threads : 1;
    uint16_t *xh = aligned_alloc(64, ((sizeof(uint16_t) * copies * T * K + 63) / 64) * 64);
    float *h = prologue != PROLOGUE_NONE ? malloc(sizeof(float) * copies * T * K) : NULL;
    if (!xh || (prologue != PROLOGUE_NONE && !h)) {
        free(xh);
        free(h);
        return -1;
    }
    struct job j = {x, g, res, w, xh, h, y, eps, prologue, T, N, K};
    spl_parallel(run, &j, threads);
    free(xh);
    free(h);
    return 0;
#else
    (void)x, (void)prologue, (void)g, (void)eps, (void)w, (void)res, (void)y, (void)T, (void)N,
        (void)K, (void)threads;
    return -1;
#endif
}

/* Whether this build has the bf16 dot product (AVX-512 BF16). */
int packed_linear_dot_available(void) {
#ifdef HAVE_DOT
    return 1;
#else
    return 0;
#endif
}
