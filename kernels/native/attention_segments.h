/* Attention for the tokens of one cache row together, for builds without AVX-512 tiles (AVX2):
 * included by decode_attention.c after its per-token loop, whose numbers it reproduces to the
 * bit. A verify's tokens (one segment of up to SEG_TOKENS tokens of one cache row, x the kv
 * head's G query heads = R rows) read each key and value once for all R rows instead of once per
 * token:
 *   - scores, eight keys at a time: for each row, eight FMA chains over d (the per-token loop's
 *     chain for each key) summed by simd.h's hsum8 (hsum's tree, lane by lane); the keys after
 *     the last eight one by one with hsum, as there;
 *   - the softmax of each row by the per-token loop's softmax();
 *   - the weighted sum two tokens at a time (2 x G x DCH accumulators), each row's chain over its
 *     visible keys in key order, as there: a key one row does not see is skipped for that row.
 * So a token's output does not depend on which other tokens share the call. */
#ifndef SPECLOOP_ATTENTION_SEGMENTS_H
#define SPECLOOP_ATTENTION_SEGMENTS_H

#define SEG_TOKENS 8 /* tokens of one cache row in a task (more are split over tasks) */
#define SEG_ROWS (SEG_TOKENS * GMAX)

/* c + a x b in one rounding, as the per-token loop's contracted `c += a * b`. Written out: GCC
 * left one of these loops as a multiply and an add (two roundings: other bits). */
static inline vf fma8(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }

/* Scores of rows q[0..R) against keys [0, L): scores[r * S + j], -inf where row r does not see
 * key j; m[r]: each row's max. */
static void segment_scores(const float *const *q, const uint8_t *const *vis, long R, const float *K,
                           long L, long D, float scale, float *scores, long S, float *m) {
    for (long r = 0; r < R; r++) m[r] = -INFINITY;
    long j = 0;
    for (; j + 8 <= L; j += 8) {
        const float *k = K + j * D;
        if (PF_KEYS)
            for (long c = 0; c < 8 * D; c += 16) __builtin_prefetch(k + PF_KEYS * D + c);
        for (long r = 0; r < R; r++) {
            vf acc[8];
            for (int i = 0; i < 8; i++) acc[i] = (vf){0};
            for (long d = 0; d < D; d += VW) {
                vf qv = load(q[r] + d);
                for (int i = 0; i < 8; i++) acc[i] = fma8(qv, load(k + i * D + d), acc[i]);
            }
            vf s = hsum8(acc) * scale;
            for (int i = 0; i < 8; i++) {
                float v = vis[r][j + i] ? s[i] : -INFINITY;
                scores[r * S + j + i] = v;
                if (v > m[r]) m[r] = v;
            }
        }
    }
    for (; j < L; j++)
        for (long r = 0; r < R; r++) {
            if (!vis[r][j]) {
                scores[r * S + j] = -INFINITY;
                continue;
            }
            vf acc = (vf){0};
            for (long d = 0; d < D; d += VW) acc = fma8(load(q[r] + d), load(K + j * D + d), acc);
            float s = hsum(acc) * scale;
            scores[r * S + j] = s;
            if (s > m[r]) m[r] = s;
        }
}

/* The weighted sum of values for the G rows of token a and, when b is not NULL, the G rows of
 * token b: out{a,b}[g * D ..] = sum over visible j of p{a,b}[g * S + j] x V[j] (unnormalised).
 * The two tokens' updates are written out, not looped over a pair of arrays: that loop took 8
 * tokens' attention back to the per-token loop's time (30 layers 3.44 -> 3.80 ms). */
#define DEFINE_SEGMENT_VALUES(G)                                                               \
    static void segment_values_##G(const float *pa, const uint8_t *va, float *oa,              \
                                   const float *pb, const uint8_t *vb, float *ob, const float *V, \
                                   long L, long D, long S) {                                   \
        for (long d0 = 0; d0 < D; d0 += DCH * VW) {                                            \
            vf acc[2][G][DCH];                                                                 \
            for (int t = 0; t < 2; t++)                                                        \
                for (int g = 0; g < G; g++)                                                    \
                    for (int c = 0; c < DCH; c++) acc[t][g][c] = (vf){0};                      \
            for (long j = 0; j < L; j++) {                                                     \
                int sa = va[j], sb = pb && vb[j];                                              \
                if (!sa && !sb) continue;                                                      \
                if (PF_KEYS && d0 == 0)                                                        \
                    for (long c = 0; c < D; c += 16) __builtin_prefetch(V + (j + PF_KEYS) * D + c); \
                vf v[DCH];                                                                     \
                for (int c = 0; c < DCH; c++) v[c] = load(V + j * D + d0 + c * VW);           \
                if (sa)                                                                        \
                    for (int g = 0; g < G; g++) {                                              \
                        vf p = vbroadcast(pa[g * S + j]);                                      \
                        for (int c = 0; c < DCH; c++)                                  \
                            acc[0][g][c] = fma8(v[c], p, acc[0][g][c]);                \
                    }                                                                          \
                if (sb)                                                                        \
                    for (int g = 0; g < G; g++) {                                              \
                        vf p = vbroadcast(pb[g * S + j]);                                      \
                        for (int c = 0; c < DCH; c++)                                  \
                            acc[1][g][c] = fma8(v[c], p, acc[1][g][c]);                \
                    }                                                                          \
            }                                                                                  \
            for (int g = 0; g < G; g++)                                                        \
                for (int c = 0; c < DCH; c++) {                                                \
                    store(oa + g * D + d0 + c * VW, acc[0][g][c]);                             \
                    if (pb) store(ob + g * D + d0 + c * VW, acc[1][g][c]);                     \
                }                                                                              \
        }                                                                                      \
    }
DEFINE_SEGMENT_VALUES(1)
DEFINE_SEGMENT_VALUES(2)
DEFINE_SEGMENT_VALUES(3)
#define SEGMENT_GROUP 3 /* query heads per kv head the pairs take (2 x 3 x DCH accumulators) */

typedef void (*segment_values_fn)(const float *, const uint8_t *, float *, const float *,
                                  const uint8_t *, float *, const float *, long, long, long);
static const segment_values_fn SEGMENT_VALUES[SEGMENT_GROUP + 1] = {
    0, segment_values_1, segment_values_2, segment_values_3};

/* R rows, token-major (row t * G + g: the segment's token t, query head g of the kv head; a
 * token's G heads consecutive in q and out), against one kv head's keys K and values V [L, D].
 * scores: scratch of R x S floats. G <= SEGMENT_GROUP, R <= SEG_ROWS, D % (DCH * VW) == 0. */
static void attend_segment(const float *const *q, const uint8_t *const *vis, float *const *out,
                           long R, long G, const float *K, const float *V, long L, long D,
                           float scale, float *scores) {
    const long S = SCORE_STRIDE(L);
    float m[SEG_ROWS], inv[SEG_ROWS];
    segment_scores(q, vis, R, K, L, D, scale, scores, S, m);
    for (long r = 0; r < R; r++)
        inv[r] = m[r] == -INFINITY ? 0.0f : softmax(scores + r * S, vis[r], L, S, m[r]);
    for (long r = 0; r < R; r += 2 * G) { /* two tokens' rows at a time */
        int pair = r + G < R;
        SEGMENT_VALUES[G](scores + r * S, vis[r], out[r], pair ? scores + (r + G) * S : NULL,
                          pair ? vis[r + G] : NULL, pair ? out[r + G] : NULL, V, L, D, S);
    }
    for (long r = 0; r < R; r++)
        for (long d = 0; d < D; d++) out[r][d] *= inv[r];
}

#endif
