/* What packed_linear's entries (packed_linear.c, packed_linear_amx.c) share: what they do to x
 * before the matmul (nothing, Llama's RMSNorm, or the SwiGLU between an MLP's gate/up and down),
 * and how they write a panel's outputs after it. One copy, so every entry computes the same
 * prologue numbers. */
#ifndef SPECLOOP_LINEAR_COMMON_H
#define SPECLOOP_LINEAR_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { PROLOGUE_NONE = 0, PROLOGUE_RMSNORM = 1, PROLOGUE_SWIGLU = 2 };

/* h = x * rsqrt(mean(x^2) + eps) * g (Llama's RMSNorm, fp32). The sum of squares in double
 * (each square exact), 16 lanes at a time in two chains: a sequential loop was a latency chain of
 * K adds per token, computed by every thread for every token of a small call (about 0.2 ms of an
 * 8-token forward of SmolLM2-135M on a 2-core EPYC). Its order only moves the double's last bits,
 * far below the float it becomes. */
static inline void rmsnorm_row(const float *x, const float *g, float eps, float *h, long K) {
    double ss = 0.0;
    long k = 0;
#if defined(__AVX512F__)
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (; k + 16 <= K; k += 16) {
        __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + k));
        __m512d b = _mm512_cvtps_pd(_mm256_loadu_ps(x + k + 8));
        lo = _mm512_fmadd_pd(a, a, lo);
        hi = _mm512_fmadd_pd(b, b, hi);
    }
    ss = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
#endif
    for (; k < K; k++) ss += (double)x[k] * x[k];
    float r = 1.0f / sqrtf((float)(ss / K) + eps);
    for (k = 0; k < K; k++) h[k] = (x[k] * r) * g[k];
}

/* h = silu(x[:K]) * x[K:] (Llama's MLP between gate/up and down), for one row of 2K. With
 * e = exp(-|a|) <= 1, silu(a) = a / (1 + e) for a >= 0 and a e / (1 + e) below: only exps of
 * non-positive values, VW lanes at a time (libm's expf, one at a time, was most of a 16-token
 * down projection's time: ~5.6 ns an element on a 2-core Xeon). */
static inline void swiglu_row(const float *x, float *h, long K) {
    long k = 0;
    for (; k + VW <= K; k += VW) {
        vf a = *(const vf *)(x + k), up = *(const vf *)(x + K + k);
        vi neg = a < 0.0f;
        vf e = vexp_nonpos(vsel(neg, a, -a));
        *(vf *)(h + k) = a * vsel(neg, e, (vf){0} + 1.0f) / (1.0f + e) * up;
    }
    for (; k < K; k++) {
        float a = x[k], e = expf(-fabsf(a));
        h[k] = a * (a < 0.0f ? e : 1.0f) / (1.0f + e) * x[K + k];
    }
}

/* Row t's prologue into h (x itself for PROLOGUE_NONE: returns the row to read). */
static inline const float *prologue_row(const float *x, int prologue, const float *g, float eps,
                                        float *h, long t, long K) {
    if (prologue == PROLOGUE_RMSNORM) {
        rmsnorm_row(x + t * K, g, eps, h + t * K, K);
        return h + t * K;
    }
    if (prologue == PROLOGUE_SWIGLU) {
        swiglu_row(x + t * 2 * K, h + t * K, K);
        return h + t * K;
    }
    return x + t * K;
}

/* a [K] -> its nearest bf16 values [K] (ties to even; activations are finite): what the
 * kernels that round activations (packed_linear_amx.c's and packed_linear_dot.c's) multiply. */
static inline void round_row_bf16(const float *a, uint16_t *out, long K) {
    long k = 0;
#if defined(__AVX512F__)
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (; k + 16 <= K; k += 16) {
        __m512i u = _mm512_castps_si512(_mm512_loadu_ps(a + k));
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
        u = _mm512_add_epi32(u, _mm512_add_epi32(half, odd));
        _mm256_storeu_si256((__m256i *)(out + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
#endif
    for (; k < K; k++) {
        uint32_t u;
        memcpy(&u, a + k, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);
        out[k] = (uint16_t)(u >> 16);
    }
}

/* y[t, n0 .. n0 + valid] = acc[t, 0 .. valid] (+ res[t, n0 ..]) for t < rows, valid = the
 * panel's outputs that exist (the last panel may be padded). acc: rows of `width` floats; y and
 * res: rows of N. */
static inline void store_rows(const float *acc, long width, const float *res, float *y, long rows,
                              long N, long n0) {
    long valid = N - n0 < width ? N - n0 : width;
    for (long t = 0; t < rows; t++) {
        float *out = y + t * N + n0;
        const float *a = acc + t * width;
        if (res) /* the same sum as a copy and an add; a loop, not a memcpy call per token */
            for (long j = 0; j < valid; j++) out[j] = a[j] + res[t * N + n0 + j];
        else
            for (long j = 0; j < valid; j++) out[j] = a[j];
    }
}

#endif
