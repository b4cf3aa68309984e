/* topk_logprobs: for each row of logits [N, V], the T largest logits' ids and their log-probs
 * (logit - logsumexp(row)), in one read of the row instead of three (gather, top-k, logsumexp).
 *
 * The trace of every verify step carries the target's top-k at each verified position; on a CPU,
 * torch's topk + logsumexp over 49,152 logits cost about 40 us per position, ~5 % of a 4 x 5-token
 * verify step. Here each row is read once for its max and top-T candidates (vector compares
 * against the current T-th value; the few elements above it go into a small sorted list) and once
 * more, from cache, for the sum of exp(x - max) with a polynomial exp (relative error < 2e-7; the
 * trace stores log-probs as float16). Rows go in parallel on the process's worker threads (pool.h).
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"
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

static void one_row(const float *x, long V, int t, int64_t *ids, float *lp) {
    float vals[64];
    for (int i = 0; i < t; i++) {
        vals[i] = -INFINITY;
        ids[i] = -1;
    }
    float m = -INFINITY;
    long j = 0;
    vf vmax = (vf){0} - INFINITY;
    for (; j + VW <= V; j += VW) {
        vf v = *(const vf *)(x + j);
        vmax = vsel(v > vmax, v, vmax);
        vi above = v > vals[t - 1];
        int any = 0;
        for (int l = 0; l < VW; l++) any |= above[l];
        if (any)
            for (int l = 0; l < VW; l++)
                if (v[l] > vals[t - 1]) insert(vals, ids, t, v[l], j + l);
    }
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

struct job {
    const float *logits;
    const int64_t *rows;
    long N, V;
    int T;
    int64_t *ids;
    float *lp;
};

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long lo, hi;
    spl_range(j->N, id, n, &lo, &hi);
    for (long r = lo; r < hi; r++)
        one_row(j->logits + (j->rows ? j->rows[r] : r) * j->V, j->V, j->T, j->ids + r * j->T,
                j->lp + r * j->T);
}

/* For n = 0..N-1: row rows[n] of logits [R, V] (contiguous fp32; rows NULL: row n, R = N) ->
 * ids [N, T] int64 and logprobs [N, T] fp32, descending. Returns 0, or -1 on bad arguments (T must
 * be 1..64 and at most V, rows within [0, R)). */
int topk_logprobs(const float *logits, const int64_t *rows, long N, long R, long V, int T,
                  int64_t *ids, float *lp, int threads) {
    if (N < 0 || V < 1 || T < 1 || T > 64 || T > V || threads < 1) return -1;
    if (!rows && R != N) return -1;
    for (long n = 0; rows && n < N; n++)
        if (rows[n] < 0 || rows[n] >= R) return -1;
    struct job j = {logits, rows, N, V, T, ids, lp};
    spl_parallel(run, &j, threads);
    return 0;
}
