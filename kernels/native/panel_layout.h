/* The panel layout that packed_linear.c's FMA kernel and packed_linear_dot.c's bf16 dot-product
 * kernel both read (kernels/packed_linear.py packs it): panel p holds outputs p*P .. p*P+P of a
 * weight, transposed: [K, P] for fp32 and int8 weights; bf16 weights [K/2, P, 2], each pair of
 * rows k, k+1 interleaved (K even), the operand layout of the bf16 dot product, which the FMA
 * kernel widens as cheaply as rows. One definition, so both kernels read the very same panels. */
#ifndef SPECLOOP_PANEL_LAYOUT_H
#define SPECLOOP_PANEL_LAYOUT_H

#include "simd.h"

#if VW == 16
/* AVX-512, 32 registers: 3 x 9 accumulators + 3 weights + 1 broadcast, 9 tokens in one pass.
 * 4 x 8 (64-wide panels) spills 5 accumulators to the stack; measured alike on a Zen 4 EPYC,
 * and on a Xeon 48-wide panels were ~10 % faster at 16 tokens and the same at 1-8. 9 rather than
 * 8 tokens a group: batch 8 plus one drafted token stays one group (with bf16 panels the 30
 * layers + lm_head at 9 tokens took 16.3-17.0 ms against 18.8-19.3 as 5 + 4; 1-8 and 16
 * tokens alike). */
#define PV 3 /* vectors of outputs per panel */
#define RMAX 9
#else
#define PV 4
#define RMAX 3 /* AVX2, 16 registers: 4 x 3 accumulators + 4 weights + 1 broadcast */
#endif
#define P (PV * VW)

/* The panel's rows k + PREFETCH_ROWS are asked for in software while row k computes. Without it
 * one core keeps too few loads in flight once a row carries several tokens' FMAs: on a 2-core
 * Xeon (AVX-512) the 121 projections of SmolLM2-135M took 35 ms at 8 tokens against 22 at one
 * token (2 threads); with it 23-24 ms (16, 24, 32 and 48 rows ahead measured alike; into L1
 * instead of L2 was slower, non-temporal twice as slow). One token is unchanged. */
#define PREFETCH_ROWS 16

#endif
