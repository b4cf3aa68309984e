/* The top-T logits of one row and their log-probs, in one read of the row and one more from cache:
 * what topk_logprobs.c computes per traced position, and draft_chain.c per drafted position
 * (the drafter's most likely tokens and their probabilities). */
#ifndef SPECLOOP_TOPK_ROW_H
#define SPECLOOP_TOPK_ROW_H

#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Insert (v, id) into the descending list vals/ids of length t (v beats vals[t-1]). */
static inline void insert(float *vals, int64_t *ids, int t, float v, int64_t id) {
    int i = t - 1;
    while (i > 0 && vals[i - 1] < v) {
        vals[i] = vals[i - 1];
        ids[i] = ids[i - 1];
        i--;
    }
    vals[i] = v;
    ids[i] = id;
}

/* Whether any lane of v is above th (one mask test where the ISA has one). */
static inline int any_above(vf v, float th) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(th), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(th), _CMP_GT_OQ)) != 0;
#else
    int any = 0;
    for (int l = 0; l < VW; l++) any |= v[l] > th;
    return any;
#endif
}

/* x [V] -> the T (1..64) largest values' ids [T] and log-probs [T], descending. */
static inline void one_row(const float *x, long V, int t, int64_t *ids, float *lp) {
    float vals[64];
    for (int i = 0; i < t; i++) {
        vals[i] = -INFINITY;
        ids[i] = -1;
    }
    long j = 0;
    vf vmax = vbroadcast(-INFINITY);
    for (; j + 4 * VW <= V; j += 4 * VW) {
        vf a = *(const vf *)(x + j), b = *(const vf *)(x + j + VW);
        vf c = *(const vf *)(x + j + 2 * VW), d = *(const vf *)(x + j + 3 * VW);
        vf ab = vsel(a > b, a, b), cd = vsel(c > d, c, d);
        vf block = vsel(ab > cd, ab, cd);
        vmax = vsel(block > vmax, block, vmax);
        if (any_above(block, vals[t - 1]))
            for (long i = j; i < j + 4 * VW; i++)
                if (x[i] > vals[t - 1]) insert(vals, ids, t, x[i], i);
    }
    for (; j + VW <= V; j += VW) {
        vf v = *(const vf *)(x + j);
        vmax = vsel(v > vmax, v, vmax);
        if (any_above(v, vals[t - 1]))
            for (long i = j; i < j + VW; i++)
                if (x[i] > vals[t - 1]) insert(vals, ids, t, x[i], i);
    }
    float m = -INFINITY;
    for (int l = 0; l < VW; l++) m = vmax[l] > m ? vmax[l] : m;
    for (; j < V; j++) {
        m = x[j] > m ? x[j] : m;
        if (x[j] > vals[t - 1]) insert(vals, ids, t, x[j], j);
    }
    vf acc = (vf){0};
    j = 0;
    for (; j + VW <= V; j += VW) acc += vexp_nonpos(*(const vf *)(x + j) - m);
    double s = 0.0;
    for (int l = 0; l < VW; l++) s += acc[l];
    for (; j < V; j++) s += expf(x[j] - m);
    float lse = m + (float)log(s);
    for (int i = 0; i < t; i++) lp[i] = vals[i] - lse;
}

#endif
