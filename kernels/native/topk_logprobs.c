/* topk_logprobs: for each row of logits [N, V], the T largest logits' ids and their log-probs
 * (logit - logsumexp(row)), in one read of the row instead of three (gather, top-k, logsumexp).
 *
 * The trace of every verify step carries the target's top-k at each verified position; on a CPU,
 * torch's topk + logsumexp over 49,152 logits cost about 40 us per position, ~5 % of a 4 x 5-token
 * verify step. Here each row is read once for its max and top-T candidates and once more, from
 * cache, for the sum of exp(x - max) with a polynomial exp (relative error < 2e-7; the trace
 * stores log-probs as float16). The first read goes a block of four vectors at a time: the block's
 * lane-wise max updates the row's, and only a block whose max beats the current T-th value is
 * scanned element by element into a small sorted list (after the first few blocks, almost none
 * is). Rows go in parallel on the process's worker threads (pool.h).
 *
 * ``topk_logprobs_padded`` writes a step's trace arrays directly: [B, K+1, T] int32 ids and
 * float16 log-probs with the untraced positions padded, so that the serving step does not build
 * them from a handful of small array operations (~0.1 ms on its cold caches at batch 1).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd.h"
#include "topk_row.h"

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

/* IEEE binary16 bits of f, rounded to nearest even (as torch's and numpy's float16 casts). */
static uint16_t half_bits(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u); /* inf, nan */
    if (mag >= 0x477ff000u) return sign | 0x7c00u;  /* rounds past 65504: inf */
    if (mag < 0x38800000u) {                         /* below 2^-14: a subnormal half, or 0 */
        if (mag < 0x33000000u) return sign;          /* below 2^-25 */
        uint32_t e = mag >> 23, m = (mag & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e, h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        return sign | (h + (rem > half || (rem == half && (h & 1u))));
    }
    uint32_t h = (mag - 0x38000000u) >> 13, rem = mag & 0x1fffu;
    return sign | (h + (rem > 0x1000u || (rem == 0x1000u && (h & 1u))));
}

struct padded_job {
    const float *logits;
    const int64_t *src, *dst; /* per computed position: its logits row, its slot in [B * K1] */
    long N, V;
    int T;
    int32_t *ids;
    uint16_t *lp;
};

static void run_padded(void *ctx, int id, int n) {
    const struct padded_job *j = ctx;
    long lo, hi;
    spl_range(j->N, id, n, &lo, &hi);
    for (long r = lo; r < hi; r++) {
        int64_t ids[64];
        float lp[64];
        one_row(j->logits + j->src[r] * j->V, j->V, j->T, ids, lp);
        for (int i = 0; i < j->T; i++) {
            j->ids[j->dst[r] * j->T + i] = (int32_t)ids[i];
            j->lp[j->dst[r] * j->T + i] = half_bits(lp[i]);
        }
    }
}

/* A step's trace arrays: for b < B and j < K1, slot (b, j) holds the top-T of logits row
 * node_rows[b * K1 + j] (of [R, V]) when traced[b] and j <= lengths[b], else -1 ids and -inf
 * log-probs. ids [B, K1, T] int32, lp [B, K1, T] float16 bits. Threads: 1 below min_parallel
 * computed slots. Returns the slots computed, or -1 on bad arguments (T must be 1..64 and at most
 * V, computed slots' rows within [0, R)). */
long topk_logprobs_padded(const float *logits, long R, long V, const int64_t *node_rows,
                          const int64_t *lengths, const uint8_t *traced, long B, long K1, int T,
                          int32_t *ids, uint16_t *lp, int threads, long min_parallel) {
    if (B < 0 || K1 < 1 || V < 1 || T < 1 || T > 64 || T > V || threads < 1) return -1;
    int64_t stack_src[256], stack_dst[256];
    int64_t *src = stack_src, *dst = stack_dst;
    if (B * K1 > 256) {
        src = malloc(sizeof(int64_t) * 2 * B * K1);
        if (!src) return -1;
        dst = src + B * K1;
    }
    long n = 0;
    for (long b = 0; b < B; b++)
        for (long j = 0; j < K1; j++) {
            long slot = b * K1 + j;
            if (traced[b] && j <= lengths[b]) {
                if (node_rows[slot] < 0 || node_rows[slot] >= R) {
                    if (src != stack_src) free(src);
                    return -1;
                }
                src[n] = node_rows[slot];
                dst[n++] = slot;
            } else {
                for (int i = 0; i < T; i++) {
                    ids[slot * T + i] = -1;
                    lp[slot * T + i] = 0xfc00u; /* -inf */
                }
            }
        }
    struct padded_job job = {logits, src, dst, n, V, T, ids, lp};
    spl_parallel(run_padded, &job, n >= min_parallel ? threads : 1);
    if (src != stack_src) free(src);
    return n;
}
