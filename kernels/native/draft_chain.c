/* draft_chain: a learned drafter's greedy draft for one request in one native call: commit the
 * request's new tokens to the drafter's cache, then draft k positions, each the head's m most
 * likely tokens and their probabilities, the chain going on from the most likely one.
 *
 * Why: the drafter's layers and head already run natively (llama_layers.c, packed_linear), but
 * between them a draft step ran ~25 Python and torch operations (the cache layout and masks, the
 * embedding and rotary lookups, softmax, top-k, the vocabulary map), each on the cold caches a
 * target forward leaves behind. Measured on a 2-core AMD EPYC (Zen 4), a one-token draft of the
 * two-layer standalone drafter after a SmolLM2-135M step: 1.46 ms, of which the layers' native
 * call 0.35 and the head's 0.19. Here the same kernels run in the same order on the same inputs
 * (the layers through llama_layers' address, the head through its packed_linear entry), so the
 * hidden states and logits are bit for bit those of the per-call path; the probabilities come
 * from topk_row.h's log-probs (within ~1e-6 of torch's softmax).
 *
 * Per call, for one request whose cache holds `col` committed positions (rotary position `pos`
 * for the next one):
 *   h[t]    = embed[tokens[t]],  t < q          (the inputs the target committed since the last draft)
 *   h       = layers(h)                          (cache columns col .. col+q-1, causal)
 *   last    = h[q - 1]                           (or last_in when q = 0)
 *   for j < k:
 *     ids[j], probs[j] = top-m of softmax(head(rmsnorm(x)))    (x = last for j = 0)
 *     x = layers(embed[map(ids[j][0])])          (column col+q+j; not committed: scratch)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_common.h"
#include "llama_layers.h"
#include "topk_row.h"

/* What of the drafter the chain reads besides its layers. Mirrors kernels/draft_chain.py's
 * ChainModel. */
struct chain_model {
    layers_fn layers;        /* llama_layers */
    const struct layer *layer_args;
    int num_layers;
    const struct dims *dims;
    attention_fn attention;
    int bf16;                /* decode_attention's bf16 bits for this cache */
    const float *embed;      /* [V, H] */
    long vocab;              /* V: rows of embed */
    const float *cos, *sin;  /* rotary tables [P, D] */
    long positions;          /* P */
    const float *norm;       /* final norm [H] */
    const void *head;        /* packed lm_head (at the draft vocabulary) */
    linear_fn head_fn;
    long head_rows;          /* Vd */
    const int64_t *vocab_map; /* [Vd] the token id of each head row, or NULL (the row's index) */
};

/* Returns 0, or -1 on bad arguments (tokens outside the vocabulary, columns past `capacity`,
 * positions past the rotary table, m outside 1..64), -2 when memory ran out, -3 when a kernel
 * refused its arguments. keys/values: each layer's cache buffer [1, Hkv, capacity, D].
 * out_ids [k, m] (token ids), out_probs [k, m], last_out [H] (the hidden state after the last
 * committed input, which the next call's q = 0 passes back as last_in). */
int draft_chain(const struct chain_model *c, void *const *keys, void *const *values, long capacity,
                const int64_t *tokens, long q, long col, long pos, const float *last_in,
                int k, int m, int64_t *out_ids, float *out_probs, float *last_out, int threads) {
    const struct dims *d = c->dims;
    long H = d->hidden, D = d->head_dim;
    long q_dim = d->heads * D, qkv_dim = q_dim + 2 * d->kv_heads * D;
    if (q < 0 || k < 1 || m < 1 || m > 64 || m > c->head_rows || (q == 0 && !last_in)) return -1;
    if (col + q + k - 1 > capacity || pos + q + k - 1 > c->positions) return -1;
    for (long t = 0; t < q; t++)
        if (tokens[t] < 0 || tokens[t] >= c->vocab) return -1;
    long rows = q > 1 ? q : 1, width = col + q + k;
    float *buf = malloc(sizeof(float) * (rows * (2 * H + qkv_dim + q_dim + 2 * d->inter) + c->head_rows));
    uint8_t *mask = malloc((size_t)rows * width);
    int64_t *cols = malloc(sizeof(int64_t) * rows);
    float **hidden = calloc((size_t)c->num_layers, sizeof(float *)); /* no layer's state wanted */
    int rc = 0;
    if (!buf || !mask || !cols || !hidden) {
        rc = -2;
        goto done;
    }
    float *h = buf, *h2 = h + rows * H, *qkv = h2 + rows * H, *att = qkv + rows * qkv_dim;
    float *gu = att + rows * q_dim, *logits = gu + rows * 2 * d->inter;
    struct attention a = {c->attention, NULL, NULL, cols, NULL, mask, 1, 1, 0, capacity, 0, c->bf16};
    if (q > 0) {
        for (long t = 0; t < q; t++) {
            memcpy(h + t * H, c->embed + tokens[t] * H, sizeof(float) * H);
            cols[t] = col + t;
            for (long j = 0; j < col + q; j++) mask[t * (col + q) + j] = j <= col + t;
        }
        a.cos = c->cos + pos * D, a.sin = c->sin + pos * D, a.T = q, a.L = col + q;
        if (c->layers(c->layer_args, c->num_layers, d, &a, keys, values, hidden, h, h2, qkv, att, gu,
                      threads)) {
            rc = -3;
            goto done;
        }
        memcpy(last_out, h + (q - 1) * H, sizeof(float) * H);
    } else {
        memcpy(last_out, last_in, sizeof(float) * H);
    }
    memcpy(h, last_out, sizeof(float) * H); /* x: row 0 from here on */
    for (int j = 0; j < k; j++) {
        if (c->head_fn(h, PROLOGUE_RMSNORM, c->norm, d->eps, c->head, NULL, logits, 1, c->head_rows,
                       H, threads)) {
            rc = -3;
            goto done;
        }
        int64_t *ids = out_ids + (long)j * m;
        float *probs = out_probs + (long)j * m;
        one_row(logits, c->head_rows, m, ids, probs); /* head rows and log-probs */
        for (int s = 0; s < m; s++) {
            probs[s] = expf(probs[s]);
            if (c->vocab_map) ids[s] = c->vocab_map[ids[s]];
        }
        if (j + 1 == k) break;
        long at = col + q + j; /* the next draft input's column */
        if (ids[0] < 0 || ids[0] >= c->vocab) {
            rc = -1;
            goto done;
        }
        memcpy(h, c->embed + ids[0] * H, sizeof(float) * H);
        cols[0] = at;
        memset(mask, 1, (size_t)(at + 1));
        a.cos = c->cos + (pos + q + j) * D, a.sin = c->sin + (pos + q + j) * D, a.T = 1, a.L = at + 1;
        if (c->layers(c->layer_args, c->num_layers, d, &a, keys, values, hidden, h, h2, qkv, att, gu,
                      threads)) {
            rc = -3;
            goto done;
        }
    }
done:
    free(buf);
    free(mask);
    free(cols);
    free(hidden);
    return rc;
}
