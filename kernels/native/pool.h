/* The worker threads every native kernel runs on (pool.c), in place of OpenMP.
 *
 * Why not OpenMP: libgomp keeps one team of threads per calling OS thread, and once the threads
 * of all teams outnumber the CPUs, an idle worker spins only ~100 iterations before it sleeps in
 * the kernel, so every parallel region pays a wake-up. A serving process always has two teams:
 * the main thread's (it loaded and packed the model) and the engine's step thread's. Measured on a
 * 2-core Xeon: the same forward took 23-28 ms from the main thread and 39-42 ms from any other
 * thread (~150 regions per forward). This pool is one per process, whatever thread calls it, and
 * its workers spin for a while (SPIN_NS in pool.c) before they sleep.
 *
 * pool.c is built into its own library, loaded (RTLD_GLOBAL) before any kernel that uses it, so
 * every kernel in the process shares it (kernels/native_build.py). */
#ifndef SPECLOOP_POOL_H
#define SPECLOOP_POOL_H

/* The work of thread `id` of `n` (0 is the caller). */
typedef void (*spl_task)(void *ctx, int id, int n);

/* Run task(ctx, id, n) for id = 0 .. n-1, each on its own thread, the caller as thread 0, and
 * return when all are done. One call at a time: a call made while another thread's call is
 * running runs task(ctx, 0, 1) on the caller alone (tasks must split their work by n). */
void spl_parallel(spl_task task, void *ctx, int n);

/* From now on (on = 1), every spl_parallel call made by the calling thread runs on that thread
 * alone: for background threads (a hot swap's preparer, an artifact load), so that they never
 * hold the workers that the decode steps are about to need. */
void spl_run_alone(int on);

/* Wait until all n threads of the current spl_parallel call have reached this barrier. */
void spl_barrier(int n);

/* The static split of `count` items among n threads: [*lo, *hi) for thread id. */
static inline void spl_range(long count, int id, int n, long *lo, long *hi) {
    long per = (count + n - 1) / n;
    *lo = id * per < count ? id * per : count;
    *hi = *lo + per < count ? *lo + per : count;
}

#endif
