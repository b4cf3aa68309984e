/* argmax_rows: out[i] = the index of the largest value of row rows[i] of x [R, V] (the first such
 * index, as torch's argmax), for the rows a greedy verify reads.
 *
 * Why: a verify's logits are [B, K+1, V] with each row padded to the widest, and torch's argmax
 * reads all of them on the step thread (whose torch ops run serially, kernels/threads.py): 8 rows
 * x 9 positions x 49,152 logits took ~2.5 ms of a 60 ms step on a 2-core Xeon. Here only the
 * positions that were verified are read, in parallel on the kernels' workers (pool.h).
 * NaN is never the answer here (torch would return it); logits are finite.
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"
#include "simd.h"

static int64_t one_row(const float *x, long V) {
    vf vmax = (vf){0} - INFINITY;
    long j = 0;
    for (; j + VW <= V; j += VW) {
        vf v = *(const vf *)(x + j);
        vmax = vsel(v > vmax, v, vmax);
    }
    float m = -INFINITY;
    for (int l = 0; l < VW; l++) m = vmax[l] > m ? vmax[l] : m;
    for (; j < V; j++) m = x[j] > m ? x[j] : m;
    for (j = 0; j < V; j++) /* the first index holding the maximum */
        if (x[j] == m) return j;
    return 0; /* every value -inf or NaN */
}

struct job {
    const float *x;
    const int64_t *rows;
    int64_t *out;
    long n, V;
};

static void run(void *ctx, int id, int n) {
    const struct job *j = ctx;
    long lo, hi;
    spl_range(j->n, id, n, &lo, &hi);
    for (long i = lo; i < hi; i++) j->out[i] = one_row(j->x + j->rows[i] * j->V, j->V);
}

/* x [R, V] fp32 contiguous; rows [n] in [0, R); out [n]. Returns 0, or -1 on bad arguments. */
int argmax_rows(const float *x, const int64_t *rows, int64_t *out, long n, long R, long V,
                int threads) {
    if (n < 0 || R < 1 || V < 1 || threads < 1) return -1;
    for (long i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= R) return -1;
    struct job j = {x, rows, out, n, V};
    spl_parallel(run, &j, threads);
    return 0;
}
