/* The vector types every native kernel computes with: VW floats per register, the widest the
 * build's -march=native allows (16 with AVX-512, else 8: AVX2 or narrower, which the compiler
 * splits). GCC vector extensions, so one source serves both. And the vector helpers the kernels
 * share (a lane sum, a lane select, exp of non-positive values). */
#ifndef SPECLOOP_SIMD_H
#define SPECLOOP_SIMD_H

#include <stdint.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

/* Every lane = a (one broadcast instruction; `(vf){0} + a` costs an add, since 0 + -0 is +0). */
static inline vf vbroadcast(float a) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(a);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(a);
#else
    return (vf){0} + a;
#endif
}

/* The sum of a vector's lanes in a fixed order: with AVX-512, lanes i and i + 8, then i and
 * i + 4, then 0 and 2, 1 and 3, then the two (GCC's _mm512_reduce_add_ps, written out so that no
 * compiler picks another order: attention_tiles.h adds its transposed chains in this tree). */
static inline float hsum(vf v) {
#if defined(__AVX512F__)
    __m256 a = _mm256_add_ps(_mm512_extractf32x8_ps((__m512)v, 1), _mm512_castps512_ps256((__m512)v));
    __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    return (b[0] + b[2]) + (b[1] + b[3]);
#elif VW == 8
    /* lanes in pairs, then pairs of pairs, then the two halves: hsum8's order, so that a score
     * summed alone and one summed with seven others are the same bits */
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
#else
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
}

#if VW == 8 && defined(__AVX__)
/* The lane sums of eight vectors at once, lane i = hsum(a[i]) to the bit (additions in hsum's
 * order; a + b == b + a exactly): three levels of horizontal adds instead of eight
 * chains of seven scalar adds. */
static inline vf hsum8(const vf a[8]) {
    __m256 s01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), s23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 s45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), s67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 q0 = _mm256_hadd_ps(s01, s23), q1 = _mm256_hadd_ps(s45, s67); /* quads of lanes 0-3 | 4-7 */
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}
#endif

/* a where m, else b (m: all-ones or all-zeros lanes, from a vector compare) */
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* exp(x) for x <= 0 (x - max), vectorised: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6
 * polynomial, 2^n through the exponent bits. Below -87 the result flushes to 0. */
static inline vf vexp_nonpos(vf x) {
    const vf lo = (vf){0} - 87.0f;
    x = vsel(x < lo, lo, x);
    /* n = round(x / ln2): x <= 0, so truncating (x / ln2 - 0.5) toward zero rounds to nearest */
    vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 split in two for accuracy */
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
