/* The per-token attention loop (decode_attention.c): one token's query heads that share a kv
 * head against its visible keys, scores key by key, the softmax, then the weighted sum of values
 * DCH vectors of the head at a time. A decode step's path, and every token's where nothing shares
 * its keys; the tiles (attention_tiles.h) and segments (attention_segments.h) reproduce its bits.
 * Included by decode_attention.c after load(), store() and the tiles' header. */
#ifndef SPECLOOP_ATTENTION_TOKENS_H
#define SPECLOOP_ATTENTION_TOKENS_H

/* The PV pass keeps DCH vectors of each head's output in registers while the values stream by. */
#if VW == 16
#define DCH 4 /* AVX-512: up to 4 heads x 4 accumulators + 4 value vectors */
#else
#define DCH 2 /* AVX2, 16 registers: 4 x 2 accumulators + 2 values + 1 broadcast */
#endif
#define GMAX 4 /* query heads of one kv head attended together */
/* Keys (and value rows) ahead that the attention passes ask for in software: at batch 8 the
 * cache streams from memory (8 rows x 300 columns: 110 MB a step over 30 layers), and one core
 * kept too few loads in flight. On a 2-core Xeon, 30 layers at 8 rows x 300 keys: 7.5 -> 5.7-6.2
 * ms, 600 keys 17.4 -> 14.6 (4, 8 and 16 keys ahead alike); one row unchanged. 0 turns it off. */
#ifndef PF_KEYS
#define PF_KEYS 8
#endif

#if TILES
/* With tiles, the per-token loop below computes with the tile's arithmetic (attention_tiles.h):
 * its softmax over score rows padded with -inf to S, a multiple of 16 (the lane sum, simd.h's
 * hsum, is the tiles' tree in every build). */
#define SCORE_STRIDE(L) (((L) + 15) & ~15L)
static inline float softmax(float *sc, const uint8_t *visible, long L, long S, float m) {
    (void)visible, (void)m;
    for (long j = L; j < S; j++) sc[j] = -INFINITY;
    return softmax_row(sc, S);
}
#else
#define SCORE_STRIDE(L) (((L) + VW - 1) / VW * VW)
/* Row sc of L scores (-inf where not visible; S = SCORE_STRIDE(L) floats) -> exp(s - m) in
 * place; returns 1 / the sum over the visible ones, in key order. Every numerator comes from the
 * vector exp, the row padded to whole vectors: a key's numerator does not depend on L (a scalar
 * expf for the last L % VW keys made a verify's numerators, whose rows are wider, differ from a
 * decode step's in the last bit). */
static inline float softmax(float *sc, const uint8_t *visible, long L, long S, float m) {
    for (long j = L; j < S; j++) sc[j] = -INFINITY;
    for (long j = 0; j < S; j += VW) store(sc + j, vexp_nonpos(load(sc + j) - m));
    float sum = 0.0f;
    for (long j = 0; j < L; j++)
        if (visible[j]) sum += sc[j];
    return 1.0f / sum; /* a token always sees itself: sum > 0 */
}
#endif

/* One query (already rotated) against columns [0, L) of one kv head: out = softmax(q.K^T * scale
 * over the visible columns) . V, with the softmax and the value pass of attend_group (for head
 * sizes it cannot take). scores: scratch of SCORE_STRIDE(L) floats. */
static void attend_one(const float *q, const float *K, const float *V, const uint8_t *visible,
                       long L, long D, float scale, float *scores, float *out) {
    float m = -INFINITY;
    for (long j = 0; j < L; j++) {
        if (!visible[j]) {
            scores[j] = -INFINITY; /* exp gives 0, and the sums below skip it */
            continue;
        }
        const float *k = K + j * D;
        vf acc = (vf){0};
        long d = 0;
        for (; d + VW <= D; d += VW) acc += load(q + d) * load(k + d);
        float s = hsum(acc);
        for (; d < D; d++) s += q[d] * k[d];
        s *= scale;
        scores[j] = s;
        if (s > m) m = s;
    }
    for (long d = 0; d < D; d++) out[d] = 0.0f;
    if (m == -INFINITY) return; /* nothing visible: zeros (never happens: a token sees itself) */
    float inv = softmax(scores, visible, L, SCORE_STRIDE(L), m);
    for (long j = 0; j < L; j++) {
        if (!visible[j]) continue;
        float p = scores[j];
        const float *v = V + j * D;
        long d = 0;
        for (; d + VW <= D; d += VW) store(out + d, load(out + d) + load(v + d) * p);
        for (; d < D; d++) out[d] += v[d] * p;
    }
    for (long d = 0; d < D; d++) out[d] *= inv;
}

/* G query heads that share one kv head, one token (the grouped-query case): each key and value
 * row is read once for all G heads, and the outputs are summed in registers, not through memory.
 * Same arithmetic, in the same order, as attend_one for each head. q [G, D] rotated, out [G, D];
 * scores: scratch of G x SCORE_STRIDE(L) floats. Needs D % (DCH * VW) == 0. */
#define DEFINE_GROUP(G)                                                                        \
    static void attend_group_##G(const float *q, const float *K, const float *V,                 \
                                 const uint8_t *visible, long L, long D, float scale,            \
                                 float *scores, float *out) {                                    \
        const long S = SCORE_STRIDE(L);                                                        \
        float m[G];                                                                            \
        for (int g = 0; g < G; g++) m[g] = -INFINITY;                                          \
        for (long j = 0; j < L; j++) {                                                         \
            if (!visible[j]) {                                                                 \
                for (int g = 0; g < G; g++) scores[g * S + j] = -INFINITY;                     \
                continue;                                                                      \
            }                                                                                  \
            const float *k = K + j * D;                                                        \
            if (PF_KEYS)                                                                       \
                for (long c = 0; c < D; c += 16) __builtin_prefetch(k + PF_KEYS * D + c);      \
            vf acc[G];                                                                         \
            for (int g = 0; g < G; g++) acc[g] = (vf){0};                                      \
            for (long d = 0; d < D; d += VW) {                                                 \
                vf kv = load(k + d);                                                           \
                for (int g = 0; g < G; g++) acc[g] += load(q + g * D + d) * kv;                \
            }                                                                                  \
            for (int g = 0; g < G; g++) {                                                      \
                float s = hsum(acc[g]) * scale;                                                \
                scores[g * S + j] = s;                                                         \
                if (s > m[g]) m[g] = s;                                                        \
            }                                                                                  \
        }                                                                                      \
        float inv[G];                                                                          \
        for (int g = 0; g < G; g++) inv[g] = softmax(scores + g * S, visible, L, S, m[g]);     \
        for (long d0 = 0; d0 < D; d0 += DCH * VW) {                                            \
            vf acc[G][DCH];                                                                    \
            for (int g = 0; g < G; g++)                                                        \
                for (int c = 0; c < DCH; c++) acc[g][c] = (vf){0};                             \
            for (long j = 0; j < L; j++) {                                                     \
                if (!visible[j]) continue;                                                     \
                if (PF_KEYS && d0 == 0)                                                        \
                    for (long c = 0; c < D; c += 16) __builtin_prefetch(V + (j + PF_KEYS) * D + c); \
                vf v[DCH];                                                                     \
                for (int c = 0; c < DCH; c++) v[c] = load(V + j * D + d0 + c * VW);           \
                for (int g = 0; g < G; g++) {                                                  \
                    vf p = vbroadcast(scores[g * S + j]);                                      \
                    for (int c = 0; c < DCH; c++) acc[g][c] += v[c] * p;                       \
                }                                                                              \
            }                                                                                  \
            for (int g = 0; g < G; g++)                                                        \
                for (int c = 0; c < DCH; c++) store(out + g * D + d0 + c * VW, acc[g][c]);     \
        }                                                                                      \
        for (int g = 0; g < G; g++)                                                            \
            for (long d = 0; d < D; d++) out[g * D + d] *= inv[g];                             \
    }

DEFINE_GROUP(1)
DEFINE_GROUP(2)
DEFINE_GROUP(3)
DEFINE_GROUP(4)

typedef void (*group_fn)(const float *, const float *, const float *, const uint8_t *, long, long,
                         float, float *, float *);
static const group_fn GROUPS[GMAX + 1] = {0, attend_group_1, attend_group_2, attend_group_3,
                                          attend_group_4};

#endif
