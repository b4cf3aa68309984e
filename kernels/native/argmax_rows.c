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
#include <stdlib.h>
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

/* tree_walk: a verify's accept walk (kernels/tree_verify.py, ``tree_accept``) fused with the
 * target's token at each node it reaches, for each row b of a token tree of N nodes (node 0 = the
 * root): y = the target's token at node `cur`; the first child i of `cur` (parents[b, i] == cur)
 * that drafted y is accepted and the walk moves there; else the step ends and y is the next token.
 * The target's token is the argmax of the node's logits (greedy, u == NULL), or the inverse-CDF
 * sample at the uniform u[b, cur] of the node's probabilities (temp == NULL: x holds them;
 * ``sample_from_uniform``: the same double-precision running sum, so the same token) or of the
 * softmax of its logits at temperature temp[b] (``probs_from_logits`` without top-k / top-p, with
 * simd.h's exp: the same distribution to ~2e-7, computed for the reached nodes only).
 *
 * Why: the walk reads the nodes on its path only (accepted + 1 per row), where the torch path
 * computed every verified node's token first; and one call replaces the ~15 small torch and numpy
 * ops of targets, masks and walk, each of which costs 20-40 us on the step thread right after a
 * forward has streamed the weights through the caches.
 *
 * x [R, V] fp32 (logits, or probabilities when u is given without temp); node_row [B, N]: each
 * node's row of x (-1: a padding node, never reached); tokens [B, N - 1]: node i's drafted token is
 * tokens[b, i - 1]; parents [B, N] (-1 for the root and padding); u [B, N] or NULL; temp [B] or
 * NULL. Out: num [B] accepted nodes, next [B] the target's token after them, path [B, N] (0, the
 * accepted nodes, then -1). Returns 0, or -1 on bad arguments or when the walk reaches a node
 * without a row. */

/* sample_from_uniform of one row: the first token whose running sum exceeds u * total; when
 * u * total rounds up to the total, the last token with positive mass. */
static int64_t sample_row(const float *p, long V, double u) {
    double total = 0.0;
    for (long j = 0; j < V; j++) total += (double)p[j];
    double target = u * total, cdf = 0.0;
    for (long j = 0; j < V; j++) {
        cdf += (double)p[j];
        if (cdf > target) return j;
    }
    for (long j = V - 1; j >= 0; j--)
        if (p[j] > 0) return j;
    return V - 1; /* no mass at all (never given): what torch's lookup returns */
}

/* The sample of softmax(x / t) at u: e = exp(x / t - max) into `e` [V] (scratch), then
 * sample_row's running sum over e (an unnormalised distribution samples alike). */
static int64_t sample_softmax_row(const float *x, long V, float t, double u, float *e) {
    float m = -INFINITY;
    for (long j = 0; j < V; j++) {
        e[j] = x[j] / t;
        m = e[j] > m ? e[j] : m;
    }
    long j = 0;
    for (; j + VW <= V; j += VW) *(vf *)(e + j) = vexp_nonpos(*(const vf *)(e + j) - m);
    for (; j < V; j++) e[j] = expf(e[j] - m);
    return sample_row(e, V, u);
}

struct walk_job {
    const float *x;
    const int64_t *node_row, *tokens, *parents;
    const double *u;
    const float *temp;
    int64_t *num, *next, *path;
    long R, V, B, N;
    int bad;
};

static void walk_rows(void *ctx, int id, int n) {
    struct walk_job *j = ctx;
    long lo, hi;
    spl_range(j->B, id, n, &lo, &hi);
    float *scratch = j->temp ? malloc(j->V * sizeof(float)) : NULL;
    if (j->temp && !scratch) {
        j->bad = 1;
        return;
    }
    for (long b = lo; b < hi; b++) {
        const int64_t *rows = j->node_row + b * j->N, *par = j->parents + b * j->N;
        const int64_t *tok = j->tokens + b * (j->N - 1);
        int64_t *path = j->path + b * j->N;
        for (long i = 0; i < j->N; i++) path[i] = -1;
        long cur = 0, depth = 0;
        int64_t y = 0;
        path[0] = 0;
        for (;;) {
            if (rows[cur] < 0 || rows[cur] >= j->R) {
                j->bad = 1;
                break;
            }
            const float *x = j->x + rows[cur] * j->V;
            if (!j->u)
                y = one_row(x, j->V);
            else if (j->temp)
                y = sample_softmax_row(x, j->V, j->temp[b], j->u[b * j->N + cur], scratch);
            else
                y = sample_row(x, j->V, j->u[b * j->N + cur]);
            long child = 0;
            for (long i = 1; i < j->N; i++)
                if (par[i] == cur && tok[i - 1] == y) {
                    child = i;
                    break;
                }
            if (!child) break;
            cur = child;
            path[++depth] = cur;
        }
        j->num[b] = depth;
        j->next[b] = y;
    }
    free(scratch);
}

int tree_walk(const float *x, const int64_t *node_row, const int64_t *tokens,
              const int64_t *parents, const double *u, const float *temp, int64_t *num,
              int64_t *next, int64_t *path, long R, long V, long B, long N, int threads) {
    if (R < 1 || V < 1 || B < 0 || N < 1 || threads < 1 || (temp && !u)) return -1;
    for (long b = 0; temp && b < B; b++)
        if (!(temp[b] > 0)) return -1;
    struct walk_job j = {x, node_row, tokens, parents, u, temp, num, next, path, R, V, B, N, 0};
    spl_parallel(walk_rows, &j, threads);
    return j.bad ? -1 : 0;
}
