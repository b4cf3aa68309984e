/* Attention for many query rows that share one kv head's cache row, 16 keys at a time, with
 * AVX-512 (included by decode_attention.c where the build has AVX-512 F/BW/VL).
 *
 * Why: the per-token loop (attention_tokens.h) scores each key with one horizontal sum
 * per query head; a verify of 8 tokens repeats that for each token (on a 2-core Xeon, 30 layers
 * of 8 tokens over 264 keys took 1.5 ms, 16 tokens 3.1, one token 0.3). Here a block of 16 keys is
 * transposed once ([16, D] -> [D, 16] in registers) and shared by every query row of the task (up
 * to TILE_TOKENS tokens x the kv head's query heads): each row's 16 partial sums come out with
 * the keys in the lanes, and the values stream once per group of rows.
 *
 * The same bits as the per-token loop, by construction: a score there is a lane sum (simd.h's
 * hsum, a fixed tree) of 16 lanes, lane l an FMA chain over d = l, l + 16, ...; here lane l's chain runs
 * over the same d in the same order, with the block's 16 keys in the lanes, and the 16 chains are
 * added in hsum's tree. Both take the softmax through softmax_row and weigh the values in key
 * order (a key a row does not see weighs exactly 0 here and is skipped there: the same sum). So a
 * token's attention output does not depend on how many tokens the call holds: a verify's logits
 * are the plain decode step's, bit for bit (tests compare).
 */
#ifndef SPECLOOP_ATTENTION_TILES_H
#define SPECLOOP_ATTENTION_TILES_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define TILE_TOKENS 8 /* tokens of one cache row in a task (more are split over tasks) */
#ifndef TILE_MIN_TOKENS
#define TILE_MIN_TOKENS 2 /* fewer go through the per-token loop (same bits) */
#endif
#define QK_ROWS 3     /* query rows scored together: 4 chains + 4 sums each */
#define PV_ACC 24     /* accumulator registers of the value pass (rows x D/16) */
#define TILE_GROUP 8  /* at most this many query heads per kv head */
#define TILE_ROWS (TILE_TOKENS * TILE_GROUP)
#define TILE_MAX_D 128 /* head sizes 64 and 128 (tile_head_dim) */
/* Prefetch distances. A layer's cache rows are not in L2 when its attention starts (the weights
 * stream through between two layers), and a block's 16 key rows, loaded to be transposed, then
 * waited on memory: on a 2-core AMD EPYC (Zen 4), 30 layers at 8 tokens over 264 keys took 1.6 ms
 * with every row in L2 and 2.1-2.5 ms from L3. Keys KEY_PF_BLOCKS blocks ahead into L2, values
 * VALUE_PF_ROWS rows ahead into L1 (one block and 8 rows ahead gained about half as much); in
 * SmolLM2-135M's whole forward (2 threads, 256 keys of context, medians of 21 alternating, two
 * runs) 8 tokens 12.79 / 12.57 -> 12.01 / 12.11 ms, 16 tokens 18.69 / 18.25 -> 18.13 / 17.70.
 * Prefetches only: the same bits. */
#ifndef KEY_PF_BLOCKS
#define KEY_PF_BLOCKS 2
#endif
#ifndef VALUE_PF_ROWS
#define VALUE_PF_ROWS 32
#endif

/* While the keys of block j0 (16 from j0) are scored, ask for those KEY_PF_BLOCKS blocks ahead
 * (at the first block, every block up to there). K: the kv head's keys [L.., D], rows of
 * row_bytes (fp32 or bf16 elements). */
static inline void prefetch_keys_ahead(const void *K, long j0, long L, long row_bytes) {
    for (long b = j0 == 0 ? 1 : KEY_PF_BLOCKS; b <= KEY_PF_BLOCKS; b++) {
        long at = j0 + 16 * b, m = L - at < 16 ? L - at : 16;
        for (long jj = 0; jj < m; jj++)
            for (long c = 0; c < row_bytes; c += 64)
                _mm_prefetch((const char *)K + (at + jj) * row_bytes + c, _MM_HINT_T1);
    }
}

/* r[i] <- column i of the 16 x 16 block r (row j of the result holds element i of input row j). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = (__m512d)t[4 * i], b = (__m512d)t[4 * i + 1];
        __m512d c = (__m512d)t[4 * i + 2], d = (__m512d)t[4 * i + 3];
        r[4 * i] = (__m512)_mm512_unpacklo_pd(a, c);
        r[4 * i + 1] = (__m512)_mm512_unpackhi_pd(a, c);
        r[4 * i + 2] = (__m512)_mm512_unpacklo_pd(b, d);
        r[4 * i + 3] = (__m512)_mm512_unpackhi_pd(b, d);
    }
    /* each r[i] now holds, per 128-bit lane L, column (i % 4) + 4 * (L's quarter) ... of rows
     * 4 * (i / 4) .. + 3: gather the four quarters across the groups */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* The 16 mask bytes of keys j0.. as a lane mask (n < 16: only the first n exist). */
static inline __mmask16 visible16(const uint8_t *vis, long j0, long n) {
    __mmask16 in = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m128i bytes = _mm_maskz_loadu_epi8(in, vis + j0);
    return _mm_test_epi8_mask(bytes, bytes);
}

/* A row of scores (-inf where not visible; Lp a multiple of 16, padded with -inf) -> its softmax
 * numerators exp(s - max) in place, exactly 0 where -inf; returns 1 / their sum.
 *
 * The sum is a vector sum, key j in lane j % 16, of the visible keys in the order a decode step
 * sees them. A step (and a chain verify) sees keys [0, c): lane = column. A token tree's node sees
 * the prefix and its ancestors, which sit at the tree's columns, not at the columns the same
 * tokens take once committed one after another: there the visible numerators are packed first
 * (key i of the visible ones in lane i % 16), so that the node's sum, and so its attention, is
 * the bits a decode step along its path computes (before, a tree's nodes could differ from the
 * step in the last bit of the sum, enough to flip a near-tie in a later argmax). */
static inline float softmax_row(float *sc, long Lp) {
    const __m512 neg = _mm512_set1_ps(-INFINITY);
    __m512 mx = neg, sum = _mm512_setzero_ps();
    for (long j = 0; j < Lp; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j));
    __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __mmask16 lives[Lp / 16];
    int ended = 0, holes = 0; /* a block not wholly visible seen; a visible key after a hidden one */
    for (long j = 0; j < Lp; j += 16) {
        __m512 s = _mm512_loadu_ps(sc + j);
        __mmask16 live = _mm512_cmp_ps_mask(s, neg, _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(live, (__m512)vexp_nonpos((vf)_mm512_sub_ps(s, vmax)));
        _mm512_storeu_ps(sc + j, e);
        sum = _mm512_add_ps(sum, e);
        unsigned m = live;
        holes |= (ended && m) || (m & (m + 1)) != 0; /* the visible lanes are not a prefix */
        ended |= m != 0xffff;
        lives[j / 16] = live;
    }
    if (holes) { /* a tree node: its visible numerators packed in key order, then summed alike */
        /* Blocks wholly visible before the first that is not (the committed prefix) pack to
         * themselves: summed as they are. The rest packed by a compress in registers, each block
         * stored whole at the packed end (its lanes past the visible ones are overwritten by the
         * next block's, the last by zeros): vcompressps to memory is microcoded on AMD Zen 4, and
         * packing every block of a node's ~270 keys that way cost about a quarter of a 9-node
         * tree's attention there. */
        float packed[Lp + 16] __attribute__((aligned(64)));
        long b0 = 0;
        sum = _mm512_setzero_ps();
        for (; b0 < Lp / 16 && lives[b0] == 0xffff; b0++) sum = _mm512_add_ps(sum, _mm512_loadu_ps(sc + 16 * b0));
        long n = 0;
        for (long b = b0; b < Lp / 16; b++) {
            _mm512_storeu_ps(packed + n, _mm512_maskz_compress_ps(lives[b], _mm512_loadu_ps(sc + 16 * b)));
            n += __builtin_popcount(lives[b]);
        }
        _mm512_storeu_ps(packed + n, _mm512_setzero_ps()); /* the last block's other lanes */
        for (long i = 0; i < n; i += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(packed + i));
    }
    return 1.0f / hsum((vf)sum); /* a token always sees itself: sum > 0 */
}

#define INLINE static inline __attribute__((always_inline))

/* Scores of rows q[0..RN) for one block of 16 keys (kt: the block transposed, [D, 16]): lane
 * l's chain over d = l, l + 16, ... as in the per-token loop, then the chains added in hsum's
 * tree (lanes i, i + 8; then i, i + 4; then 0, 2 and 1, 3; then the two). RN and D are constants
 * where this is inlined, so the accumulators stay in registers. */
INLINE void score_rows(const int RN, const long D, const float *const *q, const float *kt,
                       __m512 scale, __m512 *s) {
    __m512 quarter[QK_ROWS][4]; /* hsum's level-3 sums: lanes i, i + 4, i + 8, i + 12 */
    for (int i = 0; i < 4; i++) {
        __m512 p[QK_ROWS][4];
        for (int r = 0; r < RN; r++)
            for (int a = 0; a < 4; a++) p[r][a] = _mm512_setzero_ps();
        for (long c = 0; c < D / 16; c++)
            for (int a = 0; a < 4; a++) { /* lane l = i + 4a */
                __m512 k = _mm512_load_ps(kt + (c * 16 + i + 4 * a) * 16);
                for (int r = 0; r < RN; r++)
                    p[r][a] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][c * 16 + i + 4 * a]), k, p[r][a]);
            }
        for (int r = 0; r < RN; r++) /* (l + 8, l) pairs, then (i + 4, i) */
            quarter[r][i] = _mm512_add_ps(_mm512_add_ps(p[r][3], p[r][1]), _mm512_add_ps(p[r][2], p[r][0]));
    }
    for (int r = 0; r < RN; r++) {
        __m512 half0 = _mm512_add_ps(quarter[r][0], quarter[r][2]);
        __m512 half1 = _mm512_add_ps(quarter[r][1], quarter[r][3]);
        s[r] = _mm512_mul_ps(_mm512_add_ps(half0, half1), scale);
    }
}

/* out[r] = sum over the keys some row sees of p[r][j] * V[j], for rows [0, RN) (p: each row's
 * softmax weights, stride Lp; exactly 0 where the row does not see the key), unnormalised. */
INLINE void weigh_values(const int RN, const long D, const float *const *p, const uint8_t *const *vis,
                         const float *V, long L, __m512 *acc) {
    const int DV = (int)(D / 16);
    for (int a = 0; a < RN * DV; a++) acc[a] = _mm512_setzero_ps();
    for (long j = 0; j < L; j++) {
        int live = 0;
        for (int r = 0; r < RN; r++) live |= vis[r][j];
        if (!live) continue;
        const float *v = V + j * D;
        if (j + VALUE_PF_ROWS < L)
            for (long c = 0; c < D; c += 16)
                _mm_prefetch((const char *)(v + VALUE_PF_ROWS * D + c), _MM_HINT_T0);
        __m512 vv[TILE_MAX_D / 16];
        for (int c = 0; c < DV; c++) vv[c] = _mm512_loadu_ps(v + c * 16);
        for (int r = 0; r < RN; r++) {
            __m512 w = _mm512_set1_ps(p[r][j]);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_fmadd_ps(w, vv[c], acc[r * DV + c]);
        }
    }
}

/* attend_tile for one head size D (a constant where inlined). */
INLINE void attend_tile_d(const long D, const float *const *q, const uint8_t *const *vis,
                          float *const *out, int R, const float *K, const float *V, long L,
                          float scale, float *scores) {
    const long DV = D / 16, Lp = (L + 15) & ~15L;
    const __m512 neg = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    float kt[TILE_MAX_D * 16] __attribute__((aligned(64))); /* the block's keys, [D, 16] */
    const float *p[TILE_ROWS];
    for (int r = 0; r < R; r++) p[r] = scores + r * Lp;
    /* 1. scores, 16 keys at a time: the block transposed once for all R rows */
    for (long j0 = 0; j0 < Lp; j0 += 16) {
        long n = L - j0 < 16 ? L - j0 : 16;
        __mmask16 any = 0, m[TILE_ROWS];
        for (int r = 0; r < R; r++) any |= (m[r] = visible16(vis[r], j0, n));
        if (!any) {
            for (int r = 0; r < R; r++) _mm512_store_ps(scores + r * Lp + j0, neg);
            continue;
        }
        prefetch_keys_ahead(K, j0, L, D * (long)sizeof(float));
        for (long c = 0; c < DV; c++) {
            __m512 rows[16];
            for (long jj = 0; jj < 16; jj++)
                rows[jj] = jj < n ? _mm512_loadu_ps(K + (j0 + jj) * D + c * 16) : _mm512_setzero_ps();
            transpose16(rows);
            for (int dd = 0; dd < 16; dd++) _mm512_store_ps(kt + (c * 16 + dd) * 16, rows[dd]);
        }
        for (int r0 = 0; r0 < R; r0 += QK_ROWS) {
            __m512 s[QK_ROWS];
            int rn = R - r0 < QK_ROWS ? R - r0 : QK_ROWS;
            switch (rn) {
            case 3: score_rows(3, D, q + r0, kt, vscale, s); break;
            case 2: score_rows(2, D, q + r0, kt, vscale, s); break;
            default: score_rows(1, D, q + r0, kt, vscale, s); break;
            }
            for (int r = 0; r < rn; r++)
                _mm512_store_ps(scores + (r0 + r) * Lp + j0, _mm512_mask_mov_ps(neg, m[r0 + r], s[r]));
        }
    }
    /* 2. softmax per row: p = exp(s - max) where visible, exactly 0 elsewhere */
    float inv[TILE_ROWS];
    for (int r = 0; r < R; r++) inv[r] = softmax_row(scores + r * Lp, Lp);
    /* 3. out = p . V / sum, the values streaming once per group of rows */
    const int per = (int)(PV_ACC / DV);
    for (int r0 = 0; r0 < R; r0 += per) {
        __m512 acc[PV_ACC];
        int rn = R - r0 < per ? R - r0 : per;
        if (DV == 4) {
            switch (rn) {
            case 6: weigh_values(6, D, p + r0, vis + r0, V, L, acc); break;
            case 5: weigh_values(5, D, p + r0, vis + r0, V, L, acc); break;
            case 4: weigh_values(4, D, p + r0, vis + r0, V, L, acc); break;
            case 3: weigh_values(3, D, p + r0, vis + r0, V, L, acc); break;
            case 2: weigh_values(2, D, p + r0, vis + r0, V, L, acc); break;
            default: weigh_values(1, D, p + r0, vis + r0, V, L, acc); break;
            }
        } else {
            switch (rn) {
            case 3: weigh_values(3, D, p + r0, vis + r0, V, L, acc); break;
            case 2: weigh_values(2, D, p + r0, vis + r0, V, L, acc); break;
            default: weigh_values(1, D, p + r0, vis + r0, V, L, acc); break;
            }
        }
        for (int r = 0; r < rn; r++) {
            __m512 s = _mm512_set1_ps(inv[r0 + r]);
            for (long c = 0; c < DV; c++)
                _mm512_storeu_ps(out[r0 + r] + c * 16, _mm512_mul_ps(acc[r * DV + c], s));
        }
    }
}

/* Whether attend_tile takes heads of D floats. */
static inline int tile_head_dim(long D) { return D == 64 || D == 128; }

/* A tile: R query rows (q[r], rotated, D floats each; vis[r], its L mask bytes; out[r]) against
 * columns [0, L) of one kv head's cache (K, V: [L.., D]). scores: 64-byte aligned scratch of
 * R x Lp floats (Lp = L rounded up to 16). R <= TILE_ROWS; tile_head_dim(D). */
static void attend_tile(const float *const *q, const uint8_t *const *vis, float *const *out, int R,
                        const float *K, const float *V, long L, long D, float scale,
                        float *scores) {
    if (D == 64) attend_tile_d(64, q, vis, out, R, K, V, L, scale, scores);
    else attend_tile_d(128, q, vis, out, R, K, V, L, scale, scores);
}

#endif
