/* decode_attention: one attention layer's work between the q/k/v projection and the output
 * projection, for a few new tokens per row over a KV cache, fp32, on the CPU, in one call:
 * rotary embedding of q and k, writing k and v into the cache, and masked grouped-query attention.
 *
 * Why: after the projections went native (packed_linear.c), these ~15 small torch ops per layer
 * (rotate-half, index_put, transposes, SDPA's dispatch) cost as much as a third of a decode step
 * on a 2-core CPU, and SDPA's cost grew 2.5x from 1 to 8 query tokens at a few hundred keys,
 * where the arithmetic is a few MFLOPs.
 *
 * Layouts (all contiguous unless said): qkv [B, T, (Hq + 2 Hkv) D] (q heads, then k, then v);
 * cos, sin [B, T, D]; the cache's key and value buffers [Bc, Hkv, C, D] (C = capacity); cols
 * [B, T] int64, the cache column each new token is written to; mask [B, T, L] (uint8/bool), which
 * cache columns query t of row b sees; out [B, T, Hq D]. rows [B] int64, the cache row of each
 * row b (NULL: row b itself, Bc = B): a ragged verify passes its real tokens alone, one per row
 * (T = 1) with their cache rows, so that padding costs nothing. Rotary as Hugging Face's Llama:
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
 *
 * Softmax in fp32: scores, their max, exp(score - max) by simd.h's vector exp (vexp_nonpos),
 * their sum; then the weighted sum of values. One task per (row, kv head, token): the query heads
 * that share a kv head (3 in SmolLM2) read each key and value row once, and sum their outputs in
 * registers (on a 2-core Xeon, 8 tokens over 272 keys: 0.094 -> 0.053 ms per layer).
 * Results agree with torch's SDPA to float rounding (tests compare).
 *
 * Several tokens of one cache row (a verify's, or consecutive rows of one token that share a
 * cache row) go to attention_tiles.h where the build has AVX-512 F/BW/VL: one task per (segment of
 * up to TILE_TOKENS tokens, kv head), the keys transposed once per 16 for all the segment's query
 * rows (on a 2-core Xeon, 30 layers at 264 keys: 8 tokens 1.52 -> 1.02 ms, 16 tokens 3.14 ->
 * 1.93; 8 rows x 4 tokens 6.05 -> 3.78). A one-token segment keeps the per-token loop
 * (attention_tokens.h), which then computes with the tiles' arithmetic: a token's output is the
 * same bits in either.
 *
 * Without AVX-512 (AVX2 with FMA), a cache row's tokens go to attention_segments.h together: each
 * block of eight keys and each value row read once for all of them, with the per-token loop's
 * chains, so the same bits (on a 2-core AMD EPYC with AVX2 only, 30 calls at 256 keys from
 * Python, medians of 21: 8 tokens 3.75 -> 3.18 ms, 16 tokens 6.40 -> 5.23, one token alike).
 *
 * With bf16 set (a forward on bf16 activations, where the build has AVX-512 BF16 and the heads are
 * 64 or 128 wide), every segment, one token too, goes to attention_tiles_bf16.h: scores and the
 * weighted sum on bf16 operands, two multiply-adds an instruction, as a GPU's bf16 attention.
 * Such a forward's cache may hold bf16 keys and values (bf16's bit KV_BF16): they are rounded
 * once, when written here, rather than by every tile that reads them; the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "simd.h"
#if VW == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "attention_tiles.h"
#define TILES 1
#else
#define TILES 0
#endif
#if TILES && defined(__AVX512BF16__)
#include "attention_tiles_bf16.h"
#define TILES_BF16 1
#else
#define TILES_BF16 0
#endif

/* Unaligned vector load/store through vf (aligned(4), so any float address is fine). Not memcpy:
 * GCC tuned for some Intel cores copies 64 bytes as two 32-byte moves through the stack, and the
 * 64-byte reload of two 32-byte stores stalls store forwarding on every key (measured: attention
 * at 16 queries over 272 keys took 2.1 ms per layer on a Xeon with AVX-512, 5x the direct load). */
static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf v) { *(vf *)p = v; }

/* out[d] = x[d] cos[d] + rotate_half(x)[d] sin[d], for one head of D floats. */
static void rope(const float *x, const float *cos, const float *sin, float *out, long D) {
    long half = D / 2;
    for (long d = 0; d < half; d++) out[d] = x[d] * cos[d] + -x[d + half] * sin[d];
    for (long d = half; d < D; d++) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

#include "attention_tokens.h"

#if !TILES && VW == 8 && defined(__AVX__) && defined(__FMA__)
#include "attention_segments.h"
#define SEGMENTS 1 /* a cache row's tokens together, without tiles (attention_segments.h) */
#define SEGMENT_TOKENS SEG_TOKENS
#define SEGMENT_ROWS SEG_ROWS
#define SEGMENT_MIN_TOKENS 2
#else
#define SEGMENTS 0
#endif
#if TILES
#define SEGMENT_TOKENS TILE_TOKENS
#define SEGMENT_ROWS TILE_ROWS
#define SEGMENT_MIN_TOKENS TILE_MIN_TOKENS
#endif

#define OPERANDS_BF16 1 /* bf16's bits: bf16 operands (attention_tiles_bf16.h) */
#define KV_BF16 2       /* the cache holds bf16 keys and values (with OPERANDS_BF16 only) */

struct job {
    const float *qkv, *cos, *sin;
    void *kcache, *vcache; /* fp32, or bf16 with kv_bf16 */
    float *out, *qrot, *scratch;
    const int64_t *cols, *rows;
    const uint8_t *mask;
    long B, T, Hq, Hkv, D, C, L;
    float scale;
    /* tiles (attention_tiles.h): segments of consecutive tokens that share a cache row, the
     * tokens of segment s at [seg[s], seg[s + 1]); NULL: one task per (row, kv head, token) */
    const long *seg;
    long nseg;
    long per_thread; /* scratch floats per thread */
    int bf16;        /* every segment through the bf16 tiles (attention_tiles_bf16.h) */
    int kv_bf16;     /* the cache's elements are bf16 (only with bf16) */
};

/* Token bt (= b * T + t) with kv head g's query heads (in groups of up to GMAX). */
static void attend_token(const struct job *j, long bt, long g, float *scores) {
    long Hq = j->Hq, D = j->D, L = j->L, group = Hq / j->Hkv;
    long cb = j->rows ? j->rows[bt / j->T] : bt / j->T; /* the cache row */
    long kv = ((cb * j->Hkv + g) * j->C) * D;
    const uint8_t *visible = j->mask + bt * L;
    const float *K = (const float *)j->kcache + kv, *V = (const float *)j->vcache + kv;
    int grouped = D % (DCH * VW) == 0;
    for (long h = g * group; h < (g + 1) * group;) {
        long m = grouped ? ((g + 1) * group - h < GMAX ? (g + 1) * group - h : GMAX) : 1;
        const float *q = j->qrot + (bt * Hq + h) * D;
        float *o = j->out + (bt * Hq + h) * D;
        if (grouped) GROUPS[m](q, K, V, visible, L, D, j->scale, scores, o);
        else attend_one(q, K, V, visible, L, D, j->scale, scores, o);
        h += m;
    }
}

#if SEGMENTS
/* Whether a call's heads go to attention_segments.h (else token by token, the same bits). */
static int segments_take(long Hq, long Hkv, long D) {
    return Hq / Hkv <= SEGMENT_GROUP && D % (DCH * VW) == 0;
}
#endif

#if TILES || SEGMENTS
/* Segment s's tokens with kv head g's query heads together: one tile (attention_tiles.h, or
 * attention_tiles_bf16.h on bf16 operands) or, without tiles, one segment (attention_segments.h).
 * Rows token-major: row t * group + h is query head h of the segment's token t. Fewer than
 * SEGMENT_MIN_TOKENS go to attend_token (the same bits, faster with nothing to share), except on
 * bf16 operands, which only the tiles compute. */
static void run_segment(const struct job *j, long s, long g, float *scores) {
    long Hq = j->Hq, D = j->D, group = Hq / j->Hkv;
    long first = j->seg[s], tokens = j->seg[s + 1] - first;
    if (tokens < SEGMENT_MIN_TOKENS && !j->bf16) {
        attend_token(j, first, g, scores);
        return;
    }
    long cb = j->rows ? j->rows[first / j->T] : first / j->T; /* the segment's cache row */
    const float *q[SEGMENT_ROWS];
    const uint8_t *vis[SEGMENT_ROWS];
    float *out[SEGMENT_ROWS];
    int R = 0;
    for (long bt = first; bt < first + tokens; bt++)
        for (long h = g * group; h < (g + 1) * group; h++, R++) {
            q[R] = j->qrot + (bt * Hq + h) * D;
            vis[R] = j->mask + bt * j->L;
            out[R] = j->out + (bt * Hq + h) * D;
        }
    long kv = ((cb * j->Hkv + g) * j->C) * D;
#if TILES_BF16
    if (j->bf16) {
        int kb = j->kv_bf16 ? 2 : 4; /* bytes an element */
        attend_tile_bf16(q, vis, out, R, (const char *)j->kcache + kv * kb,
                         (const char *)j->vcache + kv * kb, j->L, D, j->scale, scores, kb);
        return;
    }
#endif
    const float *K = (const float *)j->kcache + kv, *V = (const float *)j->vcache + kv;
#if TILES
    attend_tile(q, vis, out, R, K, V, j->L, D, j->scale, scores);
#else
    attend_segment(q, vis, out, R, group, K, V, j->L, D, j->scale, scores);
#endif
}
#endif

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long B = j->B, T = j->T, Hq = j->Hq, Hkv = j->Hkv, D = j->D, C = j->C;
    long width = (Hq + 2 * Hkv) * D, lo, hi;
    /* 1. rotary on q (to qrot) and k (into the cache); v copied into the cache */
    spl_range(B * T, id, n, &lo, &hi);
    for (long bt = lo; bt < hi; bt++) {
        long b = j->rows ? j->rows[bt / T] : bt / T;
        const float *row = j->qkv + bt * width, *c = j->cos + bt * D, *s = j->sin + bt * D;
        for (long h = 0; h < Hq; h++) rope(row + h * D, c, s, j->qrot + (bt * Hq + h) * D, D);
        for (long h = 0; h < Hkv; h++) {
            long at = ((b * Hkv + h) * C + j->cols[bt]) * D;
#if TILES_BF16
            if (j->kv_bf16) { /* rounded once here, as every bf16 tile would round them */
                float k[TILE_MAX_D];
                rope(row + (Hq + h) * D, c, s, k, D);
                store_bf16((uint16_t *)j->kcache + at, k, D);
                store_bf16((uint16_t *)j->vcache + at, row + (Hq + Hkv + h) * D, D);
                continue;
            }
#endif
            rope(row + (Hq + h) * D, c, s, (float *)j->kcache + at, D);
            memcpy((float *)j->vcache + at, row + (Hq + Hkv + h) * D, sizeof(float) * D);
        }
    }
    spl_barrier(n); /* every new key and value is in the cache before anyone attends */
#if TILES || SEGMENTS
    if (j->seg) {
        float *scores = j->scratch + j->per_thread * id;
        spl_range(j->nseg * Hkv, id, n, &lo, &hi);
        for (long task = lo; task < hi; task++) run_segment(j, task / Hkv, task % Hkv, scores);
        return;
    }
#endif
    /* 2. attention, one (row, kv head, token) per task: the kv head's query heads together */
    float *scores = j->scratch + j->per_thread * id;
    spl_range(B * Hkv * T, id, n, &lo, &hi);
    for (long task = lo; task < hi; task++) {
        long b = task / (Hkv * T), g = task / T % Hkv, t = task % T;
        attend_token(j, b * T + t, g, scores);
    }
}

#if TILES || SEGMENTS
/* Cut the B x T tokens into segments of consecutive tokens with one cache row (a row's tokens;
 * with `rows`, also consecutive rows of one token each that share a cache row) of at most `tile`
 * tokens, a run of a cache row's tokens in as few segments as that allows, of balanced sizes
 * (the largest tile, SEGMENT_TOKENS, halved while fewer than two tasks per thread) ->
 * seg[0..nseg], the bounds; returns nseg. Balanced: a verify of 9 tokens was 8 + 1, and the
 * thread given the 1 waited for the other's 8 (tasks go to threads in order). */
static long cut(const int64_t *rows, long B, long T, long tile, long *seg) {
    long nseg = 0;
    for (long bt = 0; bt < B * T;) {
        long cb = rows ? rows[bt / T] : bt / T, end = bt + 1;
        while (end < B * T && (rows ? rows[end / T] : end / T) == cb) end++;
        long m = end - bt, parts = (m + tile - 1) / tile;
        for (long i = 0; i < parts; i++) seg[nseg++] = bt + m * i / parts;
        bt = end;
    }
    seg[nseg] = B * T;
    return nseg;
}

static long segments(const int64_t *rows, long B, long T, long Hkv, int threads, long *seg) {
    long tile = SEGMENT_TOKENS, nseg = cut(rows, B, T, tile, seg);
    while (tile > 1 && nseg * Hkv < 2 * threads) nseg = cut(rows, B, T, tile /= 2, seg);
    return nseg;
}
#endif

/* Whether bf16 operands (attention_tiles_bf16.h) can take heads of this shape in this build. */
int decode_attention_bf16_takes(long Hq, long Hkv, long D) {
#if TILES_BF16
    return Hq >= 1 && Hkv >= 1 && Hq % Hkv == 0 && tile_head_dim(D) && Hq / Hkv <= TILE_GROUP;
#else
    (void)Hq, (void)Hkv, (void)D;
    return 0;
#endif
}

/* See the header for layouts; bf16: OPERANDS_BF16, the queries on bf16 operands
 * (attention_tiles_bf16.h), where decode_attention_bf16_takes; with KV_BF16 too, kcache and vcache
 * hold bf16 elements. Returns 0, or -1 on bad arguments (bf16 where it cannot take, KV_BF16
 * without OPERANDS_BF16). */
int decode_attention(const float *qkv, const float *cos, const float *sin, void *kcache,
                     void *vcache, const int64_t *cols, const int64_t *rows, const uint8_t *mask,
                     float *out, long B, long Bc, long T, long Hq, long Hkv, long D, long C, long L,
                     float scale, int threads, int bf16) {
    if (B < 1 || T < 1 || Hq < 1 || Hkv < 1 || D < 1 || Hq % Hkv || L < 1 || L > C || threads < 1)
        return -1;
    int kv_bf16 = (bf16 & KV_BF16) != 0;
    bf16 &= OPERANDS_BF16;
    if (bf16 && !decode_attention_bf16_takes(Hq, Hkv, D)) return -1;
    if (kv_bf16 && !bf16) return -1;
    if (!rows && Bc != B) return -1;
    for (long i = 0; i < B * T; i++)
        if (cols[i] < 0 || cols[i] >= L) return -1;
    for (long b = 0; rows && b < B; b++)
        if (rows[b] < 0 || rows[b] >= Bc) return -1;
    long *seg = NULL, nseg = 0, per_thread = GMAX * SCORE_STRIDE(L);
#if TILES
    if (tile_head_dim(D) && Hq / Hkv <= TILE_GROUP) {
        seg = malloc(sizeof(long) * (B * T + 1));
        if (!seg) return -1;
        nseg = segments(rows, B, T, Hkv, threads, seg);
        per_thread = TILE_ROWS * SCORE_STRIDE(L);
#if TILES_BF16
        if (bf16) { /* sized for the longest segment: a step's rows need little */
            long most = 1;
            for (long s = 0; s < nseg; s++) most = seg[s + 1] - seg[s] > most ? seg[s + 1] - seg[s] : most;
            per_thread = (tile_bf16_scratch(most * (Hq / Hkv), L, D) + 15) & ~15L;
        }
#endif
    }
#endif
#if SEGMENTS
    if ((T > 1 || rows) && segments_take(Hq, Hkv, D)) { /* else one token per cache row */
        seg = malloc(sizeof(long) * (B * T + 1));
        if (!seg) return -1;
        nseg = segments(rows, B, T, Hkv, threads, seg);
        per_thread = SEG_ROWS * SCORE_STRIDE(L);
    }
#endif
    float *qrot = malloc(sizeof(float) * B * T * Hq * D); /* rotated queries [B, T, Hq, D] */
    float *scratch = aligned_alloc(64, (sizeof(float) * per_thread * threads + 63) & ~63UL);
    if (!qrot || !scratch) {
        free(qrot);
        free(scratch);
        free(seg);
        return -1;
    }
    struct job j = {qkv, cos, sin, kcache, vcache, out, qrot, scratch, cols, rows, mask,
                    B, T, Hq, Hkv, D, C, L, scale, seg, nseg, per_thread, bf16, kv_bf16};
    spl_parallel(run, &j, threads);
    free(qrot);
    free(scratch);
    free(seg);
    return 0;
}
