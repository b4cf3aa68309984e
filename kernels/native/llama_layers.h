/* The argument structs of llama_layers (llama_layers.c) and the kernel signatures it calls through,
 * shared with draft_chain.c, which runs a learned drafter's layers through llama_layers. Mirrored
 * by kernels/llama_layers.py's ctypes structures. */
#ifndef SPECLOOP_LLAMA_LAYERS_H
#define SPECLOOP_LLAMA_LAYERS_H

#include <stdint.h>

typedef int (*linear_fn)(const float *x, int prologue, const float *g, float eps, const void *w,
                         const float *res, float *y, long T, long N, long K, int threads);
typedef int (*attention_fn)(const float *qkv, const float *cos, const float *sin, void *kcache,
                            void *vcache, const int64_t *cols, const int64_t *rows,
                            const uint8_t *mask, float *out, long B, long Bc, long T, long Hq,
                            long Hkv, long D, long C, long L, float scale, int threads, int bf16);

/* One decoder layer as served: norm weights [H] and packed projections, each with the
 * packed_linear entry for its panels' dtype. Mirrors kernels/llama_layers.py's Layer. */
struct layer {
    const float *ln1, *ln2;
    const void *qkv, *o, *gu, *down;
    linear_fn qkv_fn, o_fn, gu_fn, down_fn;
};

/* The model's sizes. Mirrors kernels/llama_layers.py's Dims. */
struct dims {
    long hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
};

/* This forward's attention inputs, the same for every layer but the cache buffers: the
 * decode_attention arguments (see decode_attention.c). Mirrors llama_layers.py's Attention. */
struct attention {
    attention_fn fn;
    const float *cos, *sin;      /* [B, Tq, D] */
    const int64_t *cols, *rows;  /* [B, Tq], [B] or NULL */
    const uint8_t *mask;         /* [B, Tq, L] */
    long B, Bc, T, C, L;
    int bf16;                    /* decode_attention's bf16 bits (bf16 operands; a bf16 cache) */
};

/* llama_layers' own signature (draft_chain.c calls it through its address). */
typedef int (*layers_fn)(const struct layer *layers, int n, const struct dims *d,
                         const struct attention *a, void *const *keys, void *const *values,
                         float *const *hidden, float *h, float *h2, float *qkv, float *att,
                         float *gu, int threads);

#endif
