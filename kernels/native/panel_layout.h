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
/* AVX2, 16 registers: 2 x 6 accumulators + 2 weights + 1 broadcast + the bf16 mask. Until
 * 2026-12-06 4 x 3 (32-wide panels): 17 registers with the mask, so GCC spilled accumulators in
 * the inner loop, and every 4 weights widened fed 12 FMAs instead of 24. On a 2-core AMD EPYC with
 * AVX2 only (Zen 3), the 121 projections of SmolLM2-135M (bf16 panels, 2 threads, passes), 4 x 3
 * -> 2 x 6: 1 token 10.4 -> 9.5 ms, 2 tokens 10.0 -> 9.4, 8 tokens 24.7 -> 16.6 (with balanced
 * groups, 4 + 4), 16 tokens 57 -> 38 (one run, alternating). */
#define PV 2
#define RMAX 6
#endif
#define P (PV * VW)

/* The panel's rows k + PREFETCH_ROWS are asked for in software while row k computes. Without it
 * one core keeps too few loads in flight once a row carries several tokens' FMAs: on a 2-core
 * Xeon (AVX-512) the 121 projections of SmolLM2-135M took 35 ms at 8 tokens against 22 at one
 * token (2 threads); with it 23-24 ms (16, 24, 32 and 48 rows ahead measured alike; into L1
 * instead of L2 was slower, non-temporal twice as slow). One token is unchanged. */
#define PREFETCH_ROWS 16

#endif
