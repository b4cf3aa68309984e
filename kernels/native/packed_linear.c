/* packed_linear: y[T, N] = x[T, K] @ w[N, K]^T, fp32, on the CPU, with w repacked once into panels.
 *
 * Why a second kernel beside thin_linear: thin_linear reads w as stored ([N, K] rows) and takes
 * dot products, so each output ends in a horizontal sum, and a forward of more than 3 tokens makes
 * several passes over each block of rows. Its first pass streams from memory while the FMA units
 * wait; the later passes compute from L2 while memory idles. At 8 tokens a step cost ~1.5x one
 * token, on a machine where reading the weights once and doing 8 tokens' FMAs both take about a
 * step.
 *
 * Here w is repacked (kernels/packed_linear.py) into panels of P = PV vector widths of outputs:
 * panel p holds w[p*P .. p*P+P, :] transposed, [K, P], so one panel is one contiguous stream.
 * For each k the kernel loads the panel's P weights (PV vectors) once and broadcasts x[t, k] of
 * up to RMAX tokens against them: PV x RMAX accumulators, no horizontal sums, and up to RMAX
 * tokens' FMAs are done while the panel streams in from memory. More tokens either share that
 * stream chunk by chunk, up to 8 x RMAX (see KC below), or make a pass each, RMAX at a time (from
 * L2; see GROUP_PASSES): whichever the machine runs faster.
 *
 * Each output is one FMA chain over k in order, whatever T is: a token's result does not depend
 * on how many tokens share the call (verify and decode agree bit for bit on the projections).
 * Panels hold fp32, or bf16 where every weight is exactly a bf16 value (the default SmolLM2 cache
 * is: its weights were dequantised to bf16): a bf16 weight widened to fp32 is the same number, so
 * the FMA chains are the same and the results bit for bit those of fp32 panels, from half the
 * bytes. A single group of tokens widens each weight vector in registers; several groups widen a
 * chunk once into an fp32 buffer in L1 that they all read. int8 panels (a learned drafter's only:
 * not exact) hold q with one scale per output, applied once to each output's chain.
 *
 * Parallel over panels on the process's worker threads (pool.h). Measured on a 2-core AMD
 * EPYC (Zen 4), the 30 layers + lm_head of SmolLM2-135M: 1 token ~18 ms (thin_linear ~20),
 * 8 tokens ~1.0x one token (thin_linear ~1.5x), 256 tokens ~5 % faster than MKL's sgemm.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "linear_common.h"
#include "pool.h"
#include "simd.h"
#include "panel_layout.h"

/* Up to CHUNK_GROUPS groups of up to RMAX tokens (balanced: with AVX-512 10 tokens are 5 + 5, not
 * 9 + 1) share one stream of a panel: the panel is read in chunks of KC rows (KC x P floats: 3 KB
 * with AVX-512, in L1), and every group computes its part of a chunk before the next chunk streams
 * in, its accumulators kept in `state` between chunks. Before, each further group made its own
 * pass over the whole panel once the first had streamed it in from memory: at 16 tokens the second
 * pass was FMAs alone with memory idle, ~9 ms of a 45 ms step on a 2-core Xeon. Chunks of 16 rows,
 * not 64: the prefetches run PREFETCH_ROWS ahead of the first group only, so in a long chunk
 * memory idled while the other groups computed; with bf16 panels (half the bytes, so compute
 * matters more) the 30 layers + lm_head took 23.8 ms at 9 tokens against 17.7 at 8 with 64-row
 * chunks, 20.3-21.2 with 16 (16 tokens: 28.4 -> 27.3; fp32 panels alike or a little faster). More
 * groups than CHUNK_GROUPS (prefill) keep the passes: they are compute-bound either way. Each
 * output is still one FMA chain over k in order. */
#define KC 16
#define CHUNK_GROUPS 8

/* Passes instead of chunks: each group of up to RMAX tokens (balanced sizes) makes its own pass
 * over the panel, widening bf16 or int8 weights in registers (the first pass streams the panel
 * from memory, the others read it from L2). The default in every build; each process times both
 * layouts once and keeps the faster (packed_linear_set_group_passes, called by
 * kernels/group_layout.py where the target's forward is built). Measured on a 2-core AMD EPYC
 * (Zen 4, no AMX), the lm_head and the 90 projections of SmolLM2-135M with K = 576 (2 threads, ms,
 * chunks -> passes): 10 tokens 4.1 -> 3.6 and 12.9 -> 11.0, 16 tokens 6.6 -> 5.0 and 19.5 -> 15.0,
 * 32 tokens 12.3 -> 9.9 and 35.5 -> 28.6, 64 tokens 24 -> 19.5 and 69 -> 55; 1-9 tokens (one group)
 * alike. The same source built for AVX2 with RMAX 3 measured the other way (16 tokens: chunks
 * 24.4 ms, passes 31.5): a group had few FMAs for each weight it widened, and passes widen every
 * weight once per group. With AVX2's groups of 6 (panel_layout.h) passes win there too: on a 2-core
 * AMD EPYC with AVX2 only (Zen 3), the 121 projections of SmolLM2-135M (bf16 panels, 2 threads,
 * chunks -> passes) 8 tokens 31.1 -> 18.4 ms, 16 tokens 39.5 -> 33.1, 32 tokens 109 -> 69. Chunk
 * timings were erratic with the buffer's size and place (KC 16 / 48 / 144 read 4.1 / 4.2 / 4.8 ms
 * at 10 tokens), passes were not. On a CPU with AMX the target's verifies run on tiles
 * (packed_linear_amx.c), not here. */
#define GROUP_PASSES 1
static int group_passes = GROUP_PASSES; /* both layouts: one FMA chain per output, the same bits */

/* Non-temporal prefetches for a panel streamed once: a call of one group (T <= RMAX, a decode
 * step or a verify of up to RMAX tokens) reads each fp32 or bf16 panel once and never again in
 * that call, so its rows are prefetched with the non-temporal hint (prefetchnta) instead of into
 * L2 (prefetcht2). Measured on a 2-core AMD EPYC (Zen 4), SmolLM2-135M's bf16 panels, 2 threads:
 * the lm_head alone at 1-2 tokens ~2.2-2.4 -> ~1.8-2.0 ms; `bench engine --reps 30`, 5 alternating
 * pairs, the forward at 1 / 2 / 4 / 8 tokens 0.97 / 0.94 / 0.95 / 0.98 of the T2 build's, 16-32
 * alike (those are several groups, which re-read the panel from L2: they keep T2); one thread's
 * step 17.8 -> 13.1-14.1 ms. A learned drafter's int8 panels keep T2 (its one-token draft after a
 * target step measured the same with the target's panels either way). Intel cores treat
 * the hint otherwise (a Xeon measured non-temporal prefetches twice as slow in an early session),
 * so kernels/stream_hint.py times both once per process and keeps the faster. Off by default; the
 * same bits either way. */
static int stream_nt = 0;

/* bf16 panels hold each pair of rows k, k+1 (k even) interleaved, [K/2, P, 2] (panel_layout.h):
 * one vector of 2 x VW values holds VW outputs' weights at k (the low half of each 32-bit lane)
 * and at k+1 (the high half). A bf16 is the top half of an fp32, so each row widens exactly in
 * one operation: row k by a shift, row k+1 by a mask. (Interleaved because the bf16 dot product,
 * packed_linear_dot.c, multiplies such pairs as they are.) */
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint32_t vu_u __attribute__((vector_size(VW * 4), aligned(2)));
static inline vf as_vf(vu u) {
    vf f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}
static inline vf bf16_even(const uint16_t *p) { return as_vf(*(const vu_u *)p << 16); }
static inline vf bf16_odd(const uint16_t *p) { return as_vf(*(const vu_u *)p & 0xFFFF0000u); }
static inline vf load_f32(const float *p) { return *(const vf *)p; }

/* A vector of VW int8 values widened to fp32 (exact). int8 panels (``packed_linear_fused_int8``)
 * hold each output's weights as q * scale, |q| <= 127, one scale per output: the FMA chains run on
 * q and the scale multiplies each output once, before the residual. A learned drafter's weights
 * only (half the bytes of bf16: a draft token streams its layers and head from memory; a draft's
 * numerics move its acceptance, never the output). */
static inline vf load_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf f;
    for (int i = 0; i < VW; i++) f[i] = (float)p[i];
    return f;
#endif
}

/* Rows [k0, k1) of one panel (outputs n0 .. n0+P) for R tokens of x, into the accumulators in
 * state [R][PV] (zeroed first when k0 == 0). wp points at row k0 of the panel, whose weights are
 * of type WT, read with LOAD; PF: rows prefetched ahead, with locality LOC (1: into L2, 0:
 * non-temporal; see stream_nt). */
#define DEFINE_PANEL(NAME, WT, LOAD, PF, R, LOC)                                             \
    static void NAME##_##R(const float *restrict x, const WT *restrict wp, vf *restrict state, \
                           long K, long k0, long k1) {                                       \
        vf acc[R][PV];                                                                       \
        for (int t = 0; t < R; t++)                                                          \
            for (int j = 0; j < PV; j++) acc[t][j] = k0 ? state[t * PV + j] : (vf){0};       \
        for (long k = k0; k < k1; k++) {                                                     \
            const WT *row = wp + (k - k0) * P;                                               \
            for (int j = 0; j < PV; j++) /* PF rows ahead (see PREFETCH_ROWS) */             \
                __builtin_prefetch(row + PF * P + j * VW, 0, LOC);                           \
            vf w[PV];                                                                        \
            for (int j = 0; j < PV; j++) w[j] = LOAD(row + j * VW);                          \
            for (int t = 0; t < R; t++) {                                                    \
                vf xb = vbroadcast(x[t * K + k]);                                            \
                for (int j = 0; j < PV; j++) acc[t][j] += w[j] * xb;                         \
            }                                                                                \
        }                                                                                    \
        for (int t = 0; t < R; t++)                                                          \
            for (int j = 0; j < PV; j++) state[t * PV + j] = acc[t][j];                      \
    }

/* The same for bf16 panels, two rows (one interleaved pair) an iteration: k0 and k1 even. Each
 * output's chain still adds k, then k+1, in order: the bits of fp32 panels. A pair is read twice
 * (the second time from L1) rather than kept widened, so that the R x PV accumulators keep their
 * registers. bf16 rows are half as long: prefetching twice as many rows ahead keeps the same
 * bytes in flight. */
#define DEFINE_PAIR_PANEL(NAME, R, LOC)                                                      \
    static void NAME##_##R(const float *restrict x, const uint16_t *restrict wp,             \
                           vf *restrict state, long K, long k0, long k1) {                   \
        vf acc[R][PV];                                                                       \
        for (int t = 0; t < R; t++)                                                          \
            for (int j = 0; j < PV; j++) acc[t][j] = k0 ? state[t * PV + j] : (vf){0};       \
        for (long k = k0; k < k1; k += 2) {                                                  \
            const uint16_t *pair = wp + (k - k0) * P; /* rows k and k+1 */                   \
            for (int j = 0; j < PV; j++) /* 2P values: PV vectors of 2 VW each */            \
                __builtin_prefetch(pair + 2 * PREFETCH_ROWS * P + j * 2 * VW, 0, LOC);       \
            vf w[PV];                                                                        \
            for (int j = 0; j < PV; j++) w[j] = bf16_even(pair + j * 2 * VW);                \
            for (int t = 0; t < R; t++) {                                                    \
                vf xb = vbroadcast(x[t * K + k]);                                            \
                for (int j = 0; j < PV; j++) acc[t][j] += w[j] * xb;                         \
            }                                                                                \
            for (int j = 0; j < PV; j++) w[j] = bf16_odd(pair + j * 2 * VW);                 \
            for (int t = 0; t < R; t++) {                                                    \
                vf xb = vbroadcast(x[t * K + k + 1]);                                        \
                for (int j = 0; j < PV; j++) acc[t][j] += w[j] * xb;                         \
            }                                                                                \
        }                                                                                    \
        for (int t = 0; t < R; t++)                                                          \
            for (int j = 0; j < PV; j++) state[t * PV + j] = acc[t][j];                      \
    }

#define DEFINE_PANELS(R)                                                                     \
    DEFINE_PANEL(panel, float, load_f32, PREFETCH_ROWS, R, 1)                                \
    DEFINE_PAIR_PANEL(panel_bf16, R, 1)                                                      \
    DEFINE_PANEL(panel_i8, int8_t, load_i8, 4 * PREFETCH_ROWS, R, 1)                         \
    DEFINE_PANEL(panel_nt, float, load_f32, PREFETCH_ROWS, R, 0)                             \
    DEFINE_PAIR_PANEL(panel_bf16_nt, R, 0)

DEFINE_PANELS(1)
DEFINE_PANELS(2)
DEFINE_PANELS(3)
DEFINE_PANELS(4)
DEFINE_PANELS(5)
DEFINE_PANELS(6)
#if RMAX > 6
DEFINE_PANELS(7)
DEFINE_PANELS(8)
DEFINE_PANELS(9)
#define PANELS_7_TO_9(NAME) , NAME##_7, NAME##_8, NAME##_9
#else
#define PANELS_7_TO_9(NAME)
#endif
/* The table of a family's kernels by token count: entry r takes r tokens (1 .. RMAX). */
#define PANEL_TABLE(NAME) \
    {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6 PANELS_7_TO_9(NAME)}

typedef void (*panel_fn)(const float *, const float *, vf *, long, long, long);
typedef void (*panel_bf16_fn)(const float *, const uint16_t *, vf *, long, long, long);
typedef void (*panel_i8_fn)(const float *, const int8_t *, vf *, long, long, long);
static const panel_fn PANELS[RMAX + 1] = PANEL_TABLE(panel);
static const panel_bf16_fn PANELS_BF16[RMAX + 1] = PANEL_TABLE(panel_bf16);
static const panel_fn PANELS_NT[RMAX + 1] = PANEL_TABLE(panel_nt);
static const panel_bf16_fn PANELS_BF16_NT[RMAX + 1] = PANEL_TABLE(panel_bf16_nt);
static const panel_i8_fn PANELS_I8[RMAX + 1] = PANEL_TABLE(panel_i8);

/* Panel weights: fp32, bf16, or int8 with one fp32 scale per output. */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };

/* Rows [k0, k1) of a chunk widened to fp32 into buf ([k1 - k0, P]; bf16: k0, k1 even). */
static void widen_chunk(int kind, const void *w, float *buf, long k0, long k1) {
    if (kind == W_BF16) {
        const uint16_t *wh = (const uint16_t *)w + k0 * P;
        for (long k = 0; k < k1 - k0; k += 2)
            for (int j = 0; j < PV; j++) {
                const uint16_t *v = wh + k * P + j * 2 * VW;
                __builtin_prefetch(v + 2 * PREFETCH_ROWS * P, 0, 1);
                *(vf *)(buf + k * P + j * VW) = bf16_even(v);
                *(vf *)(buf + (k + 1) * P + j * VW) = bf16_odd(v);
            }
        return;
    }
    const int8_t *wq = w;
    for (long i = 0; i < (k1 - k0) * P; i += VW) {
        __builtin_prefetch(wq + (k0 + 4 * PREFETCH_ROWS) * P + i, 0, 1);
        *(vf *)(buf + i) = load_i8(wq + k0 * P + i);
    }
}

/* A group's finished accumulators [r][PV] into y (times the int8 scales, plus the residual). */
static void finish_group(vf *state, const float *scales, const float *res, float *y, long r,
                         long N, long n0) {
    if (scales) {
        vf sv[PV];
        for (int j = 0; j < PV; j++) __builtin_memcpy(&sv[j], scales + j * VW, sizeof(vf));
        for (long t = 0; t < r; t++)
            for (int j = 0; j < PV; j++) state[t * PV + j] *= sv[j];
    }
    store_rows((const float *)state, P, res, y, r, N, n0);
}

/* One panel for all T tokens in passes (GROUP_PASSES): each group of at most RMAX tokens (as
 * many groups as RMAX needs, of balanced sizes) reads the whole panel itself, widening in
 * registers; the panel streams from memory once and stays in L2 for the groups after the first,
 * whatever T is. `nt`: fp32 and bf16 rows
 * prefetched non-temporally (one group, see stream_nt). */
static void panel_passes(const float *x, int kind, const void *w, const float *scales,
                         const float *res, float *y, long T, long N, long K, long n0, int nt) {
    const panel_fn *f32 = nt ? PANELS_NT : PANELS;
    const panel_bf16_fn *bf16 = nt ? PANELS_BF16_NT : PANELS_BF16;
    vf state[RMAX * PV];
    long groups = (T + RMAX - 1) / RMAX;
    for (long g = 0; g < groups; g++) { /* balanced: with AVX2 8 tokens are 4 + 4, not 6 + 2 */
        long t0 = T * g / groups, r = T * (g + 1) / groups - t0;
        if (kind == W_BF16)
            bf16[r](x + t0 * K, w, state, K, 0, K);
        else if (kind == W_I8)
            PANELS_I8[r](x + t0 * K, w, state, K, 0, K);
        else
            f32[r](x + t0 * K, w, state, K, 0, K);
        finish_group(state, scales, res ? res + t0 * N : NULL, y + t0 * N, r, N, n0);
    }
}

/* One panel for all T tokens in shared chunks: groups of RMAX, CHUNK_GROUPS at a time sharing
 * each chunk. With bf16 or int8 and several groups, each chunk is widened once into buf, which the
 * groups then read as an fp32 panel. */
static void panel_chunks(const float *x, int kind, const void *w, const float *scales,
                         const float *res, float *y, long T, long N, long K, long n0) {
    vf state[CHUNK_GROUPS][RMAX * PV];
    float buf[KC * P] __attribute__((aligned(64)));
    long first[CHUNK_GROUPS + 1];
    for (long g0 = 0; g0 < T; g0 += CHUNK_GROUPS * RMAX) {
        long span = T - g0 < CHUNK_GROUPS * RMAX ? T - g0 : CHUNK_GROUPS * RMAX;
        long groups = (span + RMAX - 1) / RMAX;
        /* balanced groups (see CHUNK_GROUPS) */
        for (long g = 0; g <= groups; g++) first[g] = g0 + span * g / groups;
        long step = groups > 1 ? KC : K; /* one group: one pass, no chunks needed */
        for (long k0 = 0; k0 < K; k0 += step) {
            long k1 = k0 + step < K ? k0 + step : K;
            const float *rows = kind == W_F32 ? (const float *)w + k0 * P : buf;
            if (kind != W_F32 && groups > 1) widen_chunk(kind, w, buf, k0, k1); /* once for all */
            for (long g = 0; g < groups; g++) {
                long t0 = first[g], r = first[g + 1] - t0;
                if (kind == W_BF16 && groups == 1)
                    PANELS_BF16[r](x + t0 * K, (const uint16_t *)w + k0 * P, state[g], K, k0, k1);
                else if (kind == W_I8 && groups == 1)
                    PANELS_I8[r](x + t0 * K, (const int8_t *)w + k0 * P, state[g], K, k0, k1);
                else
                    PANELS[r](x + t0 * K, rows, state[g], K, k0, k1);
            }
        }
        for (long g = 0; g < groups; g++) {
            long t0 = first[g], r = first[g + 1] - t0;
            finish_group(state[g], scales, res ? res + t0 * N : NULL, y + t0 * N, r, N, n0);
        }
    }
}

/* One panel (outputs n0 .. n0+P) for all T tokens; the panel w holds weights of `kind` (W_I8:
 * `scales`, its P outputs' scales). One group (T <= RMAX) is one pass either way. */
static void panel_all(const float *x, int kind, const void *w, const float *scales,
                      const float *res, float *y, long T, long N, long K, long n0) {
    /* one group: the panel streams once (see stream_nt); one pass in either layout */
    int nt = T <= RMAX && kind != W_I8 && __atomic_load_n(&stream_nt, __ATOMIC_RELAXED);
    if (nt || __atomic_load_n(&group_passes, __ATOMIC_RELAXED))
        panel_passes(x, kind, w, scales, res, y, T, N, K, n0, nt);
    else
        panel_chunks(x, kind, w, scales, res, y, T, N, K, n0);
}

struct job {
    const float *x, *g, *res, *in;
    const void *w;
    int kind;
    float *h, *y;
    float eps;
    int prologue;
    long T, N, K;
};

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long lo, hi;
    if (j->prologue != PROLOGUE_NONE) {
        spl_range(j->T, id, n, &lo, &hi);
        for (long t = lo; t < hi; t++) prologue_row(j->x, j->prologue, j->g, j->eps, j->h, t, j->K);
        spl_barrier(n); /* h is complete before any panel reads it */
    }
    long count = (j->N + P - 1) / P;
    static const long bytes[] = {sizeof(float), sizeof(uint16_t), sizeof(int8_t)};
    long panel_bytes = j->K * P * bytes[j->kind];
    /* int8: the scales follow the panels, P per panel */
    const float *scales = j->kind == W_I8 ? (const float *)((const char *)j->w + count * panel_bytes) : NULL;
    spl_range(count, id, n, &lo, &hi);
    for (long p = lo; p < hi; p++)
        panel_all(j->in, j->kind, (const char *)j->w + p * panel_bytes, scales ? scales + p * P : NULL,
                  j->res, j->y, j->T, j->N, j->K, p * P);
}

/* y [T, N] = prologue(x) @ w^T (+ res [T, N] when not NULL). x [T, K] (PROLOGUE_SWIGLU: [T, 2K]),
 * g [K] the norm weight (PROLOGUE_RMSNORM), panels [ceil(N/P), K, P] (packed_linear.py): fp32
 * (wp) or bf16 (wh; wp NULL); all contiguous. Returns 0, or -1 on bad arguments. */
static int fused(const float *x, int prologue, const float *g, float eps, int kind, const void *w,
                 const float *res, float *y, long T, long N, long K, int threads) {
    if (T < 1 || N < 1 || K < 1 || threads < 1 || prologue < 0 || prologue > 2) return -1;
    if (prologue == PROLOGUE_RMSNORM && !g) return -1;
    if (!w) return -1;
    float *h = NULL;
    if (prologue != PROLOGUE_NONE) {
        h = malloc(sizeof(float) * T * K);
        if (!h) return -1;
    }
    struct job j = {x, g, res, h ? h : x, w, kind, h, y, eps, prologue, T, N, K};
    spl_parallel(run, &j, threads);
    free(h);
    return 0;
}

int packed_linear_fused(const float *x, int prologue, const float *g, float eps, const float *wp,
                        const float *res, float *y, long T, long N, long K, int threads) {
    return fused(x, prologue, g, eps, W_F32, wp, res, y, T, N, K, threads);
}

/* The same with bf16 panels (each weight exactly a bf16 value; results equal fp32 panels'). */
int packed_linear_fused_bf16(const float *x, int prologue, const float *g, float eps,
                             const uint16_t *wh, const float *res, float *y, long T, long N,
                             long K, int threads) {
    return fused(x, prologue, g, eps, W_BF16, wh, res, y, T, N, K, threads);
}

/* The same with int8 panels, [ceil(N/P), K, P] int8 followed by ceil(N/P) x P fp32 scales: output
 * n is scale[n] x (its FMA chain over the int8 weights), then the residual. Not fp32-exact against
 * the weights it was quantised from: for drafters (kernels/packed_linear.py, pack_int8). */
int packed_linear_fused_int8(const float *x, int prologue, const float *g, float eps,
                             const int8_t *wq, const float *res, float *y, long T, long N,
                             long K, int threads) {
    return fused(x, prologue, g, eps, W_I8, wq, res, y, T, N, K, threads);
}

/* Whether groups of tokens make a pass over a panel each (1) or share its chunks (0); see
 * GROUP_PASSES. Each panel reads it as it starts: a call under way when it changes may run some
 * panels one way and some the other, with the same bits. */
void packed_linear_set_group_passes(int on) { __atomic_store_n(&group_passes, on != 0, __ATOMIC_RELAXED); }
int packed_linear_group_passes(void) { return __atomic_load_n(&group_passes, __ATOMIC_RELAXED); }

/* Whether one-group calls prefetch fp32 and bf16 panels non-temporally (1) or into L2 (0); see
 * stream_nt. Read per panel, like the layout; the same bits either way. */
void packed_linear_set_stream_nt(int on) { __atomic_store_n(&stream_nt, on != 0, __ATOMIC_RELAXED); }
int packed_linear_stream_nt(void) { return __atomic_load_n(&stream_nt, __ATOMIC_RELAXED); }

/* Outputs per panel: the packing's P (48 with AVX-512, 32 otherwise). */
int packed_linear_panel_width(void) { return P; }
