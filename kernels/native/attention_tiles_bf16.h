/* Attention tiles on bf16 operands (AVX-512 BF16's vdpbf16ps), for forwards that run on bf16
 * activations (included by decode_attention.c after attention_tiles.h, where the build has
 * AVX-512 BF16).
 *
 * Why: attention_tiles.h's fp32 tiles are bound by their FMAs: two per query row, key and 16
 * dims (scores and values), which at 8 tokens over 264 keys made attention ~1.5 ms of a 12 ms
 * forward of SmolLM2-135M on a 2-core AMD EPYC, and most of what a verify costs above a decode
 * step. vdpbf16ps does two multiply-adds per lane and instruction. A forward that rounds its
 * projections' inputs to bf16 (packed_linear_dot.c) takes its attention the way a GPU's bf16
 * attention does: queries and keys rounded to bf16 for the scores, fp32 softmax, its numerators
 * and the values rounded to bf16 for the weighted sum, fp32 accumulation, normalised in fp32.
 *
 * The arithmetic, fixed so that a query's output does not depend on how many queries a call
 * holds (a decode step and a verify, chain or tree, agree bit for bit):
 *   score(q, key) = hsum(c) * scale: c_l, l < 16, a chain over the dim pairs m = l, l + 16, ...
 *                   in order, each link adding q[2m] k[2m] + q[2m+1] k[2m+1] (one vdpbf16ps
 *                   lane), then the 16 added in simd.h's hsum tree (one token's query heads
 *                   compute it key by key, lanes = pairs; more tokens 16 keys at a time, lanes =
 *                   keys, adding the chains in the same tree, as attention_tiles.h's fp32 tiles);
 *   softmax as softmax_row (attention_tiles.h): numerators e_j, 1 / their sum;
 *   out[d]        = (sum over pairs of the keys the query sees, the 1st and 2nd, 3rd and 4th, ...
 *                   in order, of e_a v_a[d] + e_b v_b[d]) * (1 / sum), e and v rounded to bf16,
 *                   one chain per d (pairs by visible index: a tree node's ancestors pair as the
 *                   same tokens do once committed to consecutive columns).
 * Every query goes through this header, one token too: the per-token loop (attention_tokens.h)
 * has no part in it. Rounding is the instruction's (vcvtne2ps2bf16: to nearest even).
 *
 * The cache's keys and values come as fp32 (KB = 4 bytes an element: rounded here, every time a
 * tile reads them) or as bf16 (KB = 2: rounded once, when decode_attention.c writes them, by the
 * same instruction family's rounding, so the same bits). bf16 buffers halve what a step reads of
 * the cache and take the conversions out of every tile: before, on a 2-core Zen 4 EPYC, a verify
 * of 8 tokens spent 12 % of its forward in attention, ~30 % of that in loads of the fp32 cache
 * and ~13 % in conversions (`perf annotate`).
 */
#ifndef SPECLOOP_ATTENTION_TILES_BF16_H
#define SPECLOOP_ATTENTION_TILES_BF16_H

#include <immintrin.h>
#include <stdint.h>

#include "attention_tiles.h"

#define QK_ROWS_BF16 3 /* query rows scored together: 4 chains + 4 sums each */

/* 32 floats -> 32 bf16 in order (as 16 pairs, element 2i the even one). */
static inline __m512i bf16x32(const float *x) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

/* Element i of a cache buffer of KB-byte elements (4: fp32, 2: bf16). */
#define KV_AT(base, i, KB) ((const char *)(base) + (long)(i) * (KB))

/* The 32 cache elements at p as bf16 (bf16x32's pairs): rounded here from fp32 (KB = 4), or as
 * stored (KB = 2: already rounded by the same rule when written). */
static inline __m512i kv_bf16x32(const void *p, const int KB) {
    return KB == 2 ? _mm512_loadu_si512(p) : bf16x32((const float *)p);
}

/* Scores of rows q2[0..RN) (each a query as D/2 bf16 pairs) for one block of 16 keys (kt2: the
 * block's key pairs transposed, [D/2, 16] pairs): lane = key. Pair lane l's chain over the pairs
 * l, l + 16, ... as the one-token path's vector lanes (score_one_bf16), then the chains added in
 * hsum's tree, as attention_tiles.h's score_rows does for fp32. */
INLINE void score_rows_bf16(const int RN, const long D, const uint32_t *const *q2,
                            const uint32_t *kt2, __m512 scale, __m512 *s) {
    __m512 quarter[QK_ROWS_BF16][4];
    for (int i = 0; i < 4; i++) {
        __m512 p[QK_ROWS_BF16][4];
        for (int r = 0; r < RN; r++)
            for (int a = 0; a < 4; a++) p[r][a] = _mm512_setzero_ps();
        for (long h = 0; h < D / 32; h++)
            for (int a = 0; a < 4; a++) { /* pair lane l = i + 4a */
                long m = h * 16 + i + 4 * a;
                __m512bh k = (__m512bh)_mm512_load_si512(kt2 + m * 16);
                for (int r = 0; r < RN; r++)
                    p[r][a] = _mm512_dpbf16_ps(p[r][a], k, (__m512bh)_mm512_set1_epi32((int)q2[r][m]));
            }
        for (int r = 0; r < RN; r++)
            quarter[r][i] = _mm512_add_ps(_mm512_add_ps(p[r][3], p[r][1]), _mm512_add_ps(p[r][2], p[r][0]));
    }
    for (int r = 0; r < RN; r++) {
        __m512 half0 = _mm512_add_ps(quarter[r][0], quarter[r][2]);
        __m512 half1 = _mm512_add_ps(quarter[r][1], quarter[r][3]);
        s[r] = _mm512_mul_ps(_mm512_add_ps(half0, half1), scale);
    }
}

/* The same scores for one token's rows, one key at a time (lane = pair): each key row read once
 * for the RN rows, in order, as a decode step streams the cache; sc[r * Lp + j], -inf where the
 * token does not see key j. */
INLINE void score_keys_bf16(const long D, int RN, const uint32_t *const *q2, const uint8_t *vis,
                            const void *K, long L, long Lp, float scale, float *sc, const int KB) {
    for (long j = 0; j < Lp; j++) {
        if (j >= L || !vis[j]) {
            for (int r = 0; r < RN; r++) sc[r * Lp + j] = -INFINITY;
            continue;
        }
        const char *k = KV_AT(K, j * D, KB);
        if (j + 8 < L)
            for (long c = 0; c < D * KB; c += 64) _mm_prefetch(k + 8 * D * KB + c, _MM_HINT_T0);
        __m512bh kp[TILE_MAX_D / 32];
        for (long h = 0; h < D / 32; h++) kp[h] = (__m512bh)kv_bf16x32(k + 32 * h * KB, KB);
        for (int r = 0; r < RN; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (long h = 0; h < D / 32; h++)
                acc = _mm512_dpbf16_ps(acc, kp[h], (__m512bh)_mm512_loadu_si512(q2[r] + 16 * h));
            sc[r * Lp + j] = hsum((vf)acc) * scale;
        }
    }
}

/* Two value rows (v0, v1; NULL: zeros) as D/16 vectors of bf16 pairs, lanes = d: pair d holds
 * (v0[d], v1[d]), the operand of one vdpbf16ps link of the weighted sum. */
static inline void value_pairs(const void *v0, const void *v1, long D, __m512bh *pairs, const int KB) {
    /* vpermt2w indices: even elements from the first key's row, odd from the second's */
    static const uint16_t interleave[2][32] __attribute__((aligned(64))) = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
    const __m512i lo = _mm512_load_si512(interleave[0]), hi = _mm512_load_si512(interleave[1]);
    for (long h = 0; h < D / 32; h++) {
        __m512i a = v0 ? kv_bf16x32(KV_AT(v0, 32 * h, KB), KB) : _mm512_setzero_si512();
        __m512i b = v1 ? kv_bf16x32(KV_AT(v1, 32 * h, KB), KB) : _mm512_setzero_si512();
        pairs[2 * h] = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);
        pairs[2 * h + 1] = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
    }
}

/* acc[r][c] = sum over key pairs of e[r] . V for rows [0, RN), d = 16 c .. 16 c + 15 (e2[r]: row
 * r's numerators as bf16, Lp2 of them, 0 past L; u: whether any of these rows sees key j). A
 * pair no row sees is skipped, and a key no row sees enters as 0 (its cache column may hold
 * anything): either way each row adds exactly what its own numerators give. */
INLINE void weigh_values_bf16(const int RN, const long D, const uint16_t *const *e2,
                              const uint8_t *u, const void *V, long L, __m512 *acc, const int KB) {
    const int DV = (int)(D / 16);
    for (int a = 0; a < RN * DV; a++) acc[a] = _mm512_setzero_ps();
    for (long j = 0; j < L; j += 2) {
        int first = u[j], second = j + 1 < L && u[j + 1];
        if (!first && !second) continue;
        const char *v0 = KV_AT(V, j * D, KB), *v1 = KV_AT(V, (j + 1) * D, KB);
        if (j + VALUE_PF_ROWS < L)
            for (long c = 0; c < 2 * D * KB; c += 64) _mm_prefetch(v0 + VALUE_PF_ROWS * D * KB + c, _MM_HINT_T0);
        __m512bh pairs[TILE_MAX_D / 16];
        value_pairs(first ? v0 : NULL, second ? v1 : NULL, D, pairs, KB);
        for (int r = 0; r < RN; r++) {
            uint32_t ep;
            memcpy(&ep, e2[r] + j, sizeof ep); /* e_j, e_{j+1} */
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)ep);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_dpbf16_ps(acc[r * DV + c], pairs[c], w);
        }
    }
}

/* The value pass for rows that see one set of columns (a token's query heads), from column `from`
 * on: their values paired by visible index, keys i and i + 1 of the ones the rows see, as decode
 * steps along the same path pair them once its tokens sit at consecutive columns (in a prefix,
 * visible index = column; a tree node sees the prefix and its ancestors). e2[r]: row r's
 * numerators as bf16 by column; out[r] = the sum / its inv[r]. The columns before `from` (even,
 * all seen by these rows) are already summed: row r's accumulators start at init[r * D/16 ..]
 * (attend_tile_bf16_d's shared passes over them). */
INLINE void weigh_gathered_bf16(const long D, const uint16_t *const *e2, int RN, const uint8_t *vis,
                                const void *V, long L, float *const *out, const float *inv,
                                long from, const __m512 *init, const int KB) {
    const int DV = (int)(D / 16);
    __m512 acc[TILE_GROUP * TILE_MAX_D / 16];
    for (int a = 0; a < RN * DV; a++) acc[a] = init[a];
    long j = from;
    for (;;) {
        long first = j, second;
        while (first < L && !vis[first]) first++;
        if (first >= L) break;
        second = first + 1;
        while (second < L && !vis[second]) second++;
        __m512bh pairs[TILE_MAX_D / 16];
        value_pairs(KV_AT(V, first * D, KB), second < L ? KV_AT(V, second * D, KB) : NULL, D, pairs, KB);
        for (int r = 0; r < RN; r++) {
            uint32_t ep = e2[r][first] | (second < L ? (uint32_t)e2[r][second] << 16 : 0u);
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)ep);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_dpbf16_ps(acc[r * DV + c], pairs[c], w);
        }
        j = second + 1;
    }
    for (int r = 0; r < RN; r++) {
        __m512 s = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(out[r] + c * 16, _mm512_mul_ps(acc[r * DV + c], s));
    }
}

/* The mask bytes j0 .. j0 + 63 (those below L) that are set, one bit each. */
static inline uint64_t seen64(const uint8_t *vis, long j0, long L) {
    long n = L - j0 < 64 ? L - j0 : 64;
    __mmask64 in = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
    __m512i bytes = _mm512_maskz_loadu_epi8(in, vis + j0);
    return _mm512_test_epi8_mask(bytes, bytes);
}

/* The first column (of L) a row does not see, L if it sees them all; 64 mask bytes at a time. */
static inline long first_unseen(const uint8_t *vis, long L) {
    for (long j0 = 0; j0 < L; j0 += 64) {
        uint64_t m = seen64(vis, j0, L);
        if (m != ~(uint64_t)0) {
            long j = j0 + __builtin_ctzll(~m);
            return j < L ? j : L;
        }
    }
    return L;
}

/* weigh_values_bf16 for rn rows (at most PV_ACC / (D / 16)), with RN a constant where inlined. */
INLINE void weigh_values_rows_bf16(int rn, const long D, const uint16_t *const *e2, const uint8_t *u,
                                   const void *V, long L, __m512 *acc, const int KB) {
    if (D == 64) {
        switch (rn) {
        case 6: weigh_values_bf16(6, D, e2, u, V, L, acc, KB); break;
        case 5: weigh_values_bf16(5, D, e2, u, V, L, acc, KB); break;
        case 4: weigh_values_bf16(4, D, e2, u, V, L, acc, KB); break;
        case 3: weigh_values_bf16(3, D, e2, u, V, L, acc, KB); break;
        case 2: weigh_values_bf16(2, D, e2, u, V, L, acc, KB); break;
        default: weigh_values_bf16(1, D, e2, u, V, L, acc, KB); break;
        }
    } else {
        switch (rn) {
        case 3: weigh_values_bf16(3, D, e2, u, V, L, acc, KB); break;
        case 2: weigh_values_bf16(2, D, e2, u, V, L, acc, KB); break;
        default: weigh_values_bf16(1, D, e2, u, V, L, acc, KB); break;
        }
    }
}

/* attend_tile_bf16 for one head size D (a constant where inlined); arguments as attend_tile's.
 * scratch: R x (Lp floats + Lp2 bf16 + D/2 pairs), Lp2 = L rounded up to 32. */
INLINE void attend_tile_bf16_d(const long D, const float *const *q, const uint8_t *const *vis,
                               float *const *out, int R, const void *K, const void *V, long L,
                               float scale, float *scores, const int KB) {
    const long DV = D / 16, Lp = (L + 15) & ~15L, Lp2 = (L + 31) & ~31L;
    const __m512 neg = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    uint32_t kt2[TILE_MAX_D / 2 * 16] __attribute__((aligned(64))); /* [D/2, 16] key pairs */
    uint16_t *e2base = (uint16_t *)(scores + R * Lp);
    uint32_t *q2base = (uint32_t *)(e2base + R * Lp2);
    const uint32_t *q2[TILE_ROWS];
    const uint16_t *e2[TILE_ROWS];
    for (int r = 0; r < R; r++) { /* the queries as bf16 pairs */
        uint32_t *row = q2base + r * (D / 2);
        for (long h = 0; h < D / 32; h++) _mm512_storeu_si512(row + 16 * h, bf16x32(q[r] + 32 * h));
        q2[r] = row;
        e2[r] = e2base + r * Lp2;
    }
    /* 1. scores: one token's rows (they share a mask) key by key; more, 16 keys at a time with
     * the block's key pairs transposed once for all R rows. The same bits either way. */
    int one = 1;
    for (int r = 1; r < R; r++) one &= vis[r] == vis[0];
    if (one) score_keys_bf16(D, R, q2, vis[0], K, L, Lp, scale, scores, KB);
    for (long j0 = 0; j0 < Lp && !one; j0 += 16) {
        long n = L - j0 < 16 ? L - j0 : 16;
        __mmask16 any = 0, m[TILE_ROWS];
        for (int r = 0; r < R; r++) any |= (m[r] = visible16(vis[r], j0, n));
        if (!any) {
            for (int r = 0; r < R; r++) _mm512_store_ps(scores + r * Lp + j0, neg);
            continue;
        }
        prefetch_keys_ahead(K, j0, L, D * KB);
        for (long h = 0; h < D / 32; h++) {
            __m512 rows[16];
            for (long jj = 0; jj < 16; jj++)
                rows[jj] = jj < n ? (__m512)kv_bf16x32(KV_AT(K, (j0 + jj) * D + 32 * h, KB), KB)
                                  : _mm512_setzero_ps();
            transpose16(rows);
            for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(kt2 + (16 * h + i) * 16), rows[i]);
        }
        for (int r0 = 0; r0 < R; r0 += QK_ROWS_BF16) {
            __m512 s[QK_ROWS_BF16];
            int rn = R - r0 < QK_ROWS_BF16 ? R - r0 : QK_ROWS_BF16;
            switch (rn) {
            case 3: score_rows_bf16(3, D, q2 + r0, kt2, vscale, s); break;
            case 2: score_rows_bf16(2, D, q2 + r0, kt2, vscale, s); break;
            default: score_rows_bf16(1, D, q2 + r0, kt2, vscale, s); break;
            }
            for (int r = 0; r < rn; r++)
                _mm512_store_ps(scores + (r0 + r) * Lp + j0, _mm512_mask_mov_ps(neg, m[r0 + r], s[r]));
        }
    }
    /* 2. softmax per row (fp32), its numerators rounded to bf16, zeros past L */
    float inv[TILE_ROWS];
    for (int r = 0; r < R; r++) {
        float *p = scores + r * Lp;
        inv[r] = softmax_row(p, Lp);
        uint16_t *e = e2base + r * Lp2;
        for (long j = 0; j < Lp2; j += 32) {
            __m512 lo = j < Lp ? _mm512_load_ps(p + j) : _mm512_setzero_ps();
            __m512 hi = j + 16 < Lp ? _mm512_load_ps(p + j + 16) : _mm512_setzero_ps();
            _mm512_storeu_si512(e + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    /* 3. out = e . V / sum. Every row sees the columns [0, E), E even: the committed prefix, where
     * a tree node's visible index is the column, so that its pairs there are by column. Those
     * columns go through shared passes of `per` rows (each pair of value rows made once a pass);
     * then each mask's own columns from E on (a token's query heads: its ancestors, or a chain
     * token's last columns) through weigh_gathered_bf16, resuming from those sums: the same bits
     * as one walk. Before, rows that saw a prefix shared passes over all L columns while each tree
     * node walked all L by itself: on a 2-core Zen 4 EPYC (one thread, 9 tokens over 256 keys) a
     * binary tree's attention took 106 us a layer, 88 with this alone (a chain's: 70). */
    const int per = (int)(PV_ACC / DV);
    long E = L;
    for (int r = 0; r < R; r++) {
        long c = first_unseen(vis[r], L);
        E = c < E ? c : E;
    }
    E &= ~1L;
    __m512 head[R * DV];
    for (int r0 = 0; r0 < R; r0 += per) {
        __m512 acc[PV_ACC]; /* a local array: kept in registers (head, in memory, is not) */
        int rn = R - r0 < per ? R - r0 : per;
        weigh_values_rows_bf16(rn, D, e2 + r0, vis[0], V, E, acc, KB);
        for (int a = 0; a < rn * DV; a++) head[r0 * DV + a] = acc[a];
    }
    for (int r = 0; r < R;) {
        int n = 1;
        while (r + n < R && vis[r + n] == vis[r]) n++;
        weigh_gathered_bf16(D, e2 + r, n, vis[r], V, L, out + r, inv + r, E, head + r * DV, KB);
        r += n;
    }
}

/* Scratch floats a bf16 tile of R rows needs over L keys (see attend_tile_bf16_d). */
static inline long tile_bf16_scratch(long R, long L, long D) {
    long Lp = (L + 15) & ~15L, Lp2 = (L + 31) & ~31L;
    return R * (Lp + (Lp2 + 1) / 2 + D / 2) + 16;
}

/* attend_tile on bf16 operands (the header's arithmetic); tile_head_dim(D). K, V: the cache's
 * buffers of KB-byte elements (4: fp32, 2: bf16). */
static void attend_tile_bf16(const float *const *q, const uint8_t *const *vis, float *const *out,
                             int R, const void *K, const void *V, long L, long D, float scale,
                             float *scores, int KB) {
    if (KB == 2) {
        if (D == 64) attend_tile_bf16_d(64, q, vis, out, R, K, V, L, scale, scores, 2);
        else attend_tile_bf16_d(128, q, vis, out, R, K, V, L, scale, scores, 2);
    } else {
        if (D == 64) attend_tile_bf16_d(64, q, vis, out, R, K, V, L, scale, scores, 4);
        else attend_tile_bf16_d(128, q, vis, out, R, K, V, L, scale, scores, 4);
    }
}

/* n (a multiple of 32) floats -> bf16 at dst, rounded as bf16x32 rounds (to nearest even). */
static inline void store_bf16(uint16_t *dst, const float *x, long n) {
    for (long i = 0; i < n; i += 32) _mm512_storeu_si512(dst + i, bf16x32(x + i));
}

#endif
