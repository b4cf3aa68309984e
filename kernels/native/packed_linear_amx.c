/* packed_linear_amx: packed_linear's matmul (y[T, N] = prologue(x)[T, K] @ w[N, K]^T (+ res))
 * on Intel AMX tiles, for weights that are exactly bf16 (the default SmolLM2 target's are).
 *
 * Why: with FMAs (packed_linear.c) a verify of 8 tokens cost 1.4 one-token steps and 16 tokens
 * 2.1 on a 2-core Xeon: each weight streamed in once, but every token's FMAs ran on two cores'
 * vector units. One AMX tile multiply (TDPBF16PS) does 16 x 16 x 32 multiply-adds; streaming the
 * weights of one step through tiles took 26-29 ms single-threaded at 1 token and 28-33 ms at 16
 * (measured on that Xeon), so a verify of up to 16 tokens costs about one step, as on a GPU.
 *
 * Tiles multiply bf16 by bf16 and accumulate in fp32; our activations are fp32. Each activation
 * is split into three bf16 parts, a = hi + mid + lo, each the top 8 significant bits of what the
 * parts before it left (truncation: exact, since 3 x 8 bits hold an fp32's 24). A product of two
 * bf16 values is exact in fp32, so w * a is computed as three exact products summed in fp32: the
 * same precision as an fp32 dot product, only another order of the additions (and denormals
 * flushed, as tiles do). A row's result depends on nothing but that row: a token's outputs are
 * the same whether it is alone or one of 16 in the call (verify and decode agree bit for bit).
 *
 * Layout (kernels/packed_linear.py packs it): panels of 32 outputs (two 16-wide C tiles); a
 * panel is K/32 blocks, each block the two B tiles of its outputs for 32 k: tile s row kp holds
 * w[n0 + 16 s + nn][32 kb + 2 kp + i] at column 2 nn + i (AMX's pair-interleaved layout), 1 KB,
 * so a panel is one contiguous stream. Tiles: 0-1 C accumulators, 2-4 the activation parts
 * (hi, mid, lo) of up to 16 tokens, 5-6 weights; the six multiplies of a block alternate between
 * the accumulators. Three 16-wide tiles a panel (reusing a weight tile register within a block)
 * streamed 270 MB of weights at 9.9 GB/s on one core at 1 token and 8.8 at 16; two, 11.7 and
 * 10.2. Parallel over panels on the worker pool.
 *
 * A second entry (packed_linear_fused_amx_bf16a) rounds each activation to its nearest bf16 value
 * instead (one part): a third of the multiplies, for callers whose numerics only steer a choice and
 * never reach an output, a learned drafter's forward (its drafts are verified by the target). Its
 * tiles are blocked two token groups by two output tiles (4 accumulators, 2 + 2 operand tiles, 4
 * multiplies a block for 4 loads): a drafter's history of 64 tokens through a 3072 x 576
 * projection cost 0.70 ms with three parts and 0.37 with one (256 tokens: 2.77 and 1.13 ms; one
 * core of a 2-core Xeon).
 *
 * Entry points return -1 where the build has no AMX, the OS refused the tile state, or the
 * arguments do not fit (K not a multiple of 32). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_common.h"
#include "pool.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NT 2               /* C tiles per panel */
#define TN 16              /* outputs per C tile */
#define TK 32              /* k per B tile (16 rows of bf16 pairs) */
#define TM 16              /* tokens per tile, at most */
#define PANEL (NT * TN)    /* outputs per panel */
#define TILE (TK * TN)     /* bf16 values per B tile (1 KB) */
#define PF_BLOCKS 3        /* blocks of the panel prefetched ahead of the one computing */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0 .. b-1 (C: 16 fp32, and A: 32 bf16) hold m token rows, the rest one B tile each (16
 * rows of 32 bf16); 64 bytes a row. Three parts: 0-1 C, 2-4 A, 5-6 B (b = 5); one part: 0-3 C,
 * 4-5 A, 6-7 B (b = 6). */
static void configure(int m, int b) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i < b ? m : TK / 2;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* a [K] -> hi, mid, lo [K] bf16 with a = hi + mid + lo: each part the top 16 bits (truncated)
 * of what the parts before it left, which is exact. 16 lanes at a time, then one by one. */
static void split_row(const float *a, uint16_t *hi, uint16_t *mid, uint16_t *lo, long K) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 r = _mm512_loadu_ps(a + k);
        uint16_t *dst[3] = {hi + k, mid + k, lo + k};
        for (int part = 0; part < 3; part++) {
            __m512i bits = _mm512_and_si512(_mm512_castps_si512(r), top);
            r = _mm512_sub_ps(r, _mm512_castsi512_ps(bits)); /* exact */
            _mm256_storeu_si256((__m256i *)dst[part], _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        }
    }
    for (; k < K; k++) {
        float r = a[k];
        uint16_t *dst[3] = {hi + k, mid + k, lo + k};
        for (int part = 0; part < 3; part++) {
            uint32_t u;
            memcpy(&u, &r, 4);
            u &= 0xFFFF0000u;
            float h;
            memcpy(&h, &u, 4);
            r -= h;
            *dst[part] = (uint16_t)(u >> 16);
        }
    }
}

/* Into L2: the block PF_BLOCKS ahead of block b of a panel (its two B tiles). */
static inline void prefetch_ahead(const uint16_t *b) {
    for (int line = 0; line < NT * TILE * 2 / 64; line++)
        _mm_prefetch((const char *)(b + PF_BLOCKS * NT * TILE) + 64 * line, _MM_HINT_T1);
}

/* One panel (outputs n0 .. n0 + 32) for all T tokens, m at a time. parts: hi, mid, lo, each
 * [Tpad, K] bf16 (rows past T zero). */
static void panel_amx(const uint16_t *parts, long Tpad, long m, const uint16_t *wt,
                      const float *res, float *y, long T, long N, long K, long n0) {
    float c[TM * PANEL] __attribute__((aligned(64)));
    const long blocks = K / TK, stride = K * 2;
    for (long t0 = 0; t0 < T; t0 += m) {
        const uint16_t *hi = parts + t0 * K, *mid = hi + Tpad * K, *lo = mid + Tpad * K;
        _tile_zero(0);
        _tile_zero(1);
        for (long kb = 0; kb < blocks; kb++) {
            const uint16_t *b = wt + kb * NT * TILE;
            if (t0 == 0) /* later groups read the panel from L2 */
                prefetch_ahead(b);
            _tile_loadd(2, hi + kb * TK, stride);
            _tile_loadd(3, mid + kb * TK, stride);
            _tile_loadd(4, lo + kb * TK, stride);
            _tile_loadd(5, b, 64);
            _tile_loadd(6, b + TILE, 64);
            /* the two accumulators alternate: no multiply waits on the one just before it */
            _tile_dpbf16ps(0, 2, 5);
            _tile_dpbf16ps(1, 2, 6);
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, c, PANEL * 4);
        _tile_stored(1, c + TN, PANEL * 4);
        store_rows(c, PANEL, res ? res + t0 * N : NULL, y + t0 * N, T - t0 < m ? T - t0 : m, N, n0);
    }
}

/* C tile acc += hi, mid and lo (tiles 4-6) times the B tile at src, loaded into tile 7 (tile
 * numbers are immediates: a macro, not a function). */
#define PARTS_TIMES_B(acc, src)            \
    do {                                   \
        _tile_loadd(7, (src), 64);         \
        _tile_dpbf16ps(acc, 4, 7);         \
        _tile_dpbf16ps(acc, 5, 7);         \
        _tile_dpbf16ps(acc, 6, 7);         \
    } while (0)

/* panel_amx for two panels at once (outputs n0 .. n0 + 64), past 16 tokens, where every tile
 * holds 16 rows: 4 C tiles (0-3), the A parts (4-6), one B tile register (7) loaded for each C
 * tile in turn, so 7 tile loads a block feed 12 multiplies (5 fed 6). Each C tile sums the same
 * products in the same order as panel_amx: the same bits. 10-35 % faster from 32 tokens on (a
 * batch's verify, a prefill). */
static void panel_pair_amx(const uint16_t *parts, long Tpad, long m, const uint16_t *wt0,
                           const uint16_t *wt1, const float *res, float *y, long T, long N, long K,
                           long n0) {
    float c[TM * PANEL] __attribute__((aligned(64)));
    const long blocks = K / TK, stride = K * 2;
    for (long t0 = 0; t0 < T; t0 += m) {
        const uint16_t *hi = parts + t0 * K, *mid = hi + Tpad * K, *lo = mid + Tpad * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long kb = 0; kb < blocks; kb++) {
            const uint16_t *b0 = wt0 + kb * NT * TILE, *b1 = wt1 + kb * NT * TILE;
            if (t0 == 0) {
                prefetch_ahead(b0);
                prefetch_ahead(b1);
            }
            _tile_loadd(4, hi + kb * TK, stride);
            _tile_loadd(5, mid + kb * TK, stride);
            _tile_loadd(6, lo + kb * TK, stride);
            PARTS_TIMES_B(0, b0);
            PARTS_TIMES_B(1, b0 + TILE);
            PARTS_TIMES_B(2, b1);
            PARTS_TIMES_B(3, b1 + TILE);
        }
        long rows = T - t0 < m ? T - t0 : m;
        _tile_stored(0, c, PANEL * 4);
        _tile_stored(1, c + TN, PANEL * 4);
        store_rows(c, PANEL, res ? res + t0 * N : NULL, y + t0 * N, rows, N, n0);
        _tile_stored(2, c, PANEL * 4);
        _tile_stored(3, c + TN, PANEL * 4);
        store_rows(c, PANEL, res ? res + t0 * N : NULL, y + t0 * N, rows, N, n0 + PANEL);
    }
}

/* panel_amx for one part (rounded activations, [Tpad, K] bf16): two groups of m tokens at a time,
 * each B tile multiplied by both groups' A tiles (tiles: 0-3 C, 4-5 A, 6-7 B). */
static void panel_amx_rounded(const uint16_t *a, long m, const uint16_t *wt, const float *res,
                              float *y, long T, long N, long K, long n0) {
    float c[2 * TM * PANEL] __attribute__((aligned(64)));
    const long blocks = K / TK, stride = K * 2;
    for (long t0 = 0; t0 < T; t0 += 2 * m) {
        const uint16_t *a0 = a + t0 * K, *a1 = a0 + m * K;
        const int pair = t0 + m < T; /* a second group of tokens */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long kb = 0; kb < blocks; kb++) {
            const uint16_t *b = wt + kb * NT * TILE;
            if (t0 == 0)
                prefetch_ahead(b);
            _tile_loadd(4, a0 + kb * TK, stride);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) {
                _tile_loadd(5, a1 + kb * TK, stride);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c, PANEL * 4);
        _tile_stored(1, c + TN, PANEL * 4);
        long rows = T - t0 < m ? T - t0 : m;
        store_rows(c, PANEL, res ? res + t0 * N : NULL, y + t0 * N, rows, N, n0);
        if (pair) {
            _tile_stored(2, c + TM * PANEL, PANEL * 4);
            _tile_stored(3, c + TM * PANEL + TN, PANEL * 4);
            rows = T - t0 - m < m ? T - t0 - m : m;
            store_rows(c + TM * PANEL, PANEL, res ? res + (t0 + m) * N : NULL, y + (t0 + m) * N,
                       rows, N, n0);
        }
    }
}

struct job {
    const float *x, *g, *res;
    const uint16_t *wt;
    uint16_t *parts_buf;
    float *h, *y;
    float eps;
    int prologue, parts; /* 3: exact split; 1: rounded */
    long T, Tpad, m, N, K;
};

/* Up to this many tokens every thread computes all of their prologues and parts into its own
 * copy (microseconds) instead of its share and a wait at a barrier for the rest (measured on a
 * 2-core Xeon, a 576 x 576 projection: 1 token 12.3 -> 9.3 us, 8 tokens 19.9 -> 12.3). */
#define PRIVATE_SPLIT_TOKENS 8

static void split_rows(const struct job *j, uint16_t *parts, long lo, long hi) {
    for (long t = lo; t < hi; t++) {
        const float *a = prologue_row(j->x, j->prologue, j->g, j->eps, j->h, t, j->K);
        uint16_t *p = parts + t * j->K;
        if (j->parts == 1)
            round_row_bf16(a, p, j->K);
        else
            split_row(a, p, p + j->Tpad * j->K, p + 2 * j->Tpad * j->K, j->K);
    }
}

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long lo, hi;
    const uint16_t *parts = j->parts_buf;
    if (j->T <= PRIVATE_SPLIT_TOKENS) {
        uint16_t *mine = j->parts_buf + id * j->parts * j->Tpad * j->K;
        struct job own = *j;
        own.h = j->h ? j->h + id * j->T * j->K : NULL;
        split_rows(&own, mine, 0, j->T);
        parts = mine;
    } else {
        spl_range(j->T, id, n, &lo, &hi);
        split_rows(j, j->parts_buf, lo, hi);
        spl_barrier(n); /* every token's parts are complete before any panel reads them */
    }
    spl_range((j->N + PANEL - 1) / PANEL, id, n, &lo, &hi);
    if (lo < hi) {
        configure((int)j->m, j->parts == 1 ? 6 : 5);
        for (long p = lo; p < hi; p++) {
            const uint16_t *w = j->wt + p * j->K * PANEL;
            if (j->parts == 1)
                panel_amx_rounded(parts, j->m, w, j->res, j->y, j->T, j->N, j->K, p * PANEL);
            else if (j->T > TM && p + 1 < hi) /* m = 16: one tile configuration fits both */
                panel_pair_amx(parts, j->Tpad, j->m, w, w + j->K * PANEL, j->res, j->y, j->T,
                               j->N, j->K, p++ * PANEL);
            else
                panel_amx(parts, j->Tpad, j->m, w, j->res, j->y, j->T, j->N, j->K, p * PANEL);
        }
        _tile_release();
    }
}

static int permitted = -2; /* -2: not asked yet; 0: tiles usable; -1: refused */

/* Asks the kernel for the AMX tile state (Linux: once per process). 0 when tiles can be used. */
int packed_linear_amx_init(void) {
    if (permitted == -2) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
    }
    return permitted;
}

static int fused(const float *x, int prologue, const float *g, float eps, const uint16_t *wt,
                 const float *res, float *y, long T, long N, long K, int threads, int nparts) {
    if (packed_linear_amx_init() != 0) return -1;
    if (T < 1 || N < 1 || K < 1 || K % TK || threads < 1 || prologue < 0 || prologue > 2) return -1;
    if ((prologue == PROLOGUE_RMSNORM && !g) || !wt) return -1;
    long m = T < TM ? T : TM;
    long group = nparts == 1 ? 2 * m : m; /* one part reads groups in pairs */
    long Tpad = (T + group - 1) / group * group;
    long copies = T <= PRIVATE_SPLIT_TOKENS ? threads : 1;
    /* page-aligned: tile loads from a buffer malloc had only 16-byte aligned ran ~1.5x slower at
     * 8-9 tokens */
    size_t bytes = (sizeof(uint16_t) * nparts * Tpad * K * copies + 4095) / 4096 * 4096;
    uint16_t *parts = aligned_alloc(4096, bytes);
    float *h = prologue != PROLOGUE_NONE ? malloc(sizeof(float) * T * K * copies) : NULL;
    if (!parts || (prologue != PROLOGUE_NONE && !h)) {
        free(parts);
        free(h);
        return -1;
    }
    for (int part = 0; part < nparts; part++) /* padding rows are zero */
        memset(parts + (part * Tpad + T) * K, 0, sizeof(uint16_t) * (Tpad - T) * K);
    struct job j = {x, g, res, wt, parts, h, y, eps, prologue, nparts, T, Tpad, m, N, K};
    spl_parallel(run, &j, threads);
    free(parts);
    free(h);
    return 0;
}

/* y [T, N] = prologue(x) @ w^T (+ res [T, N] when not NULL), as packed_linear_fused_bf16, with
 * w packed as AMX panels [ceil(N/32), K/32, 2, 16, 16, 2] bf16 (packed_linear.py). */
int packed_linear_fused_amx(const float *x, int prologue, const float *g, float eps,
                            const uint16_t *wt, const float *res, float *y, long T, long N, long K,
                            int threads) {
    return fused(x, prologue, g, eps, wt, res, y, T, N, K, threads, 3);
}

/* The same with the activations (after the prologue) rounded to bf16: not fp32-exact. */
int packed_linear_fused_amx_bf16a(const float *x, int prologue, const float *g, float eps,
                                  const uint16_t *wt, const float *res, float *y, long T, long N,
                                  long K, int threads) {
    return fused(x, prologue, g, eps, wt, res, y, T, N, K, threads, 1);
}

int packed_linear_amx_panel_width(void) { return PANEL; }

#else /* no AMX in this build (-march=native on a CPU without it) */

int packed_linear_amx_init(void) { return -1; }
int packed_linear_fused_amx(const float *x, int prologue, const float *g, float eps,
                            const uint16_t *wt, const float *res, float *y, long T, long N, long K,
                            int threads) {
    (void)x, (void)prologue, (void)g, (void)eps, (void)wt, (void)res, (void)y, (void)T, (void)N;
    (void)K, (void)threads;
    return -1;
}
int packed_linear_fused_amx_bf16a(const float *x, int prologue, const float *g, float eps,
                                  const uint16_t *wt, const float *res, float *y, long T, long N,
                                  long K, int threads) {
    return packed_linear_fused_amx(x, prologue, g, eps, wt, res, y, T, N, K, threads);
}
int packed_linear_amx_panel_width(void) { return 0; }

#endif
