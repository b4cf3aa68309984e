/* The vector types every native kernel computes with: VW floats per register, the widest the
 * build's -march=native allows (16 with AVX-512, else 8: AVX2 or narrower, which the compiler
 * splits). GCC vector extensions, so one source serves both. */
#ifndef SPECLOOP_SIMD_H
#define SPECLOOP_SIMD_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

#endif
