/* llama_layers: the decoder layers of a Llama-family forward, all of them in one native call.
 *
 * Why: serving/engine/llama_forward.py already runs each layer as five native calls (q/k/v with
 * its norm, attention with rotary and the cache write, the output projection with the residual,
 * gate/up with its norm, down with the activation and the residual). Between two calls Python and
 * torch allocate the output, reshape, check and convert arguments: measured on a 2-core Xeon, ~42 us
 * a gap, 6.3 ms of a 22 ms one-token step of SmolLM2-135M (30 layers, 150 gaps), while the same
 * calls replayed back to back took 13.7 ms. Here the loop over layers and the five calls run in C,
 * on buffers allocated once per forward; the kernels called are the very same functions (their
 * addresses come from the libraries that define them, kernels/llama_layers.py), so the results are
 * bit for bit those of the per-call path.
 *
 * Per layer, with h [T, H] the residual stream (T = B x Tq tokens):
 *   qkv = rmsnorm(h) * ln1 @ Wqkv^T        (packed_linear, RMSNORM prologue)
 *   att = attention(rope(qkv), cache)      (decode_attention: writes this step's keys and values)
 *   h2  = h + att @ Wo^T                   (packed_linear, residual)
 *   gu  = rmsnorm(h2) * ln2 @ Wgu^T
 *   h   = h2 + (silu(gate) * up) @ Wd^T    (packed_linear, SWIGLU prologue, residual)
 */
#include <stdint.h>
#include <string.h>

#include "linear_common.h"
#include "llama_layers.h"

/* Runs layers [0, n) on h [B * Tq, H] in place. keys[i], values[i]: layer i's cache buffers
 * [Bc, Hkv, C, D] (fp32, or bf16 with a->bf16's bit 2). hidden[i] (i < n; NULL where not wanted): a
 * copy of h after layer i.
 * Scratch, each sized for B * Tq tokens: h2 [H], qkv [(Hq + 2 Hkv) D], att [Hq D], gu [2 I].
 * Returns 0, or -(1 + i) when a kernel refused layer i's arguments (nothing is then trusted). */
int llama_layers(const struct layer *layers, int n, const struct dims *d,
                 const struct attention *a, void *const *keys, void *const *values,
                 float *const *hidden, float *h, float *h2, float *qkv, float *att, float *gu,
                 int threads) {
    long tokens = a->B * a->T;
    long q_dim = d->heads * d->head_dim;
    long qkv_dim = q_dim + 2 * d->kv_heads * d->head_dim;
    for (int i = 0; i < n; i++) {
        const struct layer *l = &layers[i];
        int rc = l->qkv_fn(h, PROLOGUE_RMSNORM, l->ln1, d->eps, l->qkv, NULL, qkv, tokens, qkv_dim,
                           d->hidden, threads);
        if (!rc)
            rc = a->fn(qkv, a->cos, a->sin, keys[i], values[i], a->cols, a->rows, a->mask, att,
                       a->B, a->Bc, a->T, d->heads, d->kv_heads, d->head_dim, a->C, a->L, d->scale,
                       threads, a->bf16);
        if (!rc) rc = l->o_fn(att, PROLOGUE_NONE, NULL, 0.0f, l->o, h, h2, tokens, d->hidden, q_dim,
                              threads);
        if (!rc) rc = l->gu_fn(h2, PROLOGUE_RMSNORM, l->ln2, d->eps, l->gu, NULL, gu, tokens,
                               2 * d->inter, d->hidden, threads);
        if (!rc) rc = l->down_fn(gu, PROLOGUE_SWIGLU, NULL, 0.0f, l->down, h2, h, tokens,
                                 d->hidden, d->inter, threads);
        if (rc) return -(1 + i);
        if (hidden[i]) memcpy(hidden[i], h, sizeof(float) * tokens * d->hidden);
    }
    return 0;
}
