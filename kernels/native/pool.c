/* pool: the process's worker threads for the native kernels (why not OpenMP: see pool.h).
 *
 * Workers are started on first use, up to the largest n asked for (at most MAX_WORKERS + 1).
 * A call publishes (task, ctx, n) and bumps `generation`; each worker with a part in it runs
 * task(ctx, id, n) and counts itself done; the caller runs part 0 and then waits for the count.
 * An idle worker spins on `generation` for SPIN_NS (a decode step makes ~150 calls a few
 * microseconds apart), then sleeps on a condition variable until the next call wakes it.
 *
 * Every started worker acknowledges every call (counts itself done, with or without a part in
 * it), and a call returns only after all have: so no worker can still be reading one call's
 * (task, ctx, n) when the next call writes them.
 *
 * Ordering: sequentially consistent atomics throughout. A worker counts itself among the sleepers
 * before it re-reads `generation` under the mutex, and a caller bumps `generation` before it reads
 * the sleepers, so a worker either sees the new generation or is woken by the broadcast.
 * After fork() the child has none of the parent's workers: an atfork handler forgets them.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_WORKERS 63
/* 0.1 ms covers the gaps between one forward's calls; a worker then sleeps between steps and
 * burns no CPU that a trainer beside it could use. Serving measured the same with 2 ms (28.4 and
 * 28.8 ms per token, SmolLM2 target-only on a 2-core Xeon). */
#define SPIN_NS 100000L

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static atomic_long generation;
static atomic_int sleepers;
static atomic_int done;
static int workers; /* started so far (guarded by call_lock) */
static long first_seen[MAX_WORKERS + 1]; /* the generation before a worker's first call */

static spl_task job_task; /* the current call, published before `generation` moves */
static void *job_ctx;
static int job_n;

static atomic_int barrier_count;
static atomic_long barrier_generation;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *worker_main(void *arg) {
    int id = (int)(long)arg; /* 1 .. MAX_WORKERS */
    long seen = first_seen[id];
    for (;;) {
        long start = now_ns();
        int spins = 0;
        while (atomic_load(&generation) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&sleep_lock);
                atomic_fetch_add(&sleepers, 1);
                while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &sleep_lock);
                atomic_fetch_sub(&sleepers, 1);
                pthread_mutex_unlock(&sleep_lock);
                break;
            }
        }
        seen = atomic_load(&generation);
        if (id < job_n) job_task(job_ctx, id, job_n);
        atomic_fetch_add(&done, 1);
    }
    return NULL;
}

static void forget_workers(void) { /* in a forked child: the threads did not come along */
    pthread_mutex_init(&call_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
    workers = 0;
    atomic_store(&sleepers, 0);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

static __thread int alone; /* set by spl_run_alone: this thread never takes the workers */

void spl_run_alone(int on) { alone = on; }

void spl_parallel(spl_task task, void *ctx, int n) {
    if (n > MAX_WORKERS + 1) n = MAX_WORKERS + 1;
    if (n <= 1 || alone || pthread_mutex_trylock(&call_lock) != 0) {
        task(ctx, 0, 1); /* alone, or another thread's call holds the workers */
        return;
    }
    pthread_once(&once, register_fork_handler);
    while (workers < n - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        first_seen[workers + 1] = atomic_load(&generation);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(long)(workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        workers++;
    }
    if (n > workers + 1) n = workers + 1;
    job_task = task;
    job_ctx = ctx;
    job_n = n;
    atomic_store(&done, 0);
    atomic_store(&barrier_count, 0);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    task(ctx, 0, n);
    while (atomic_load(&done) < workers) cpu_relax();
    pthread_mutex_unlock(&call_lock);
}

void spl_barrier(int n) {
    if (n <= 1) return;
    long g = atomic_load(&barrier_generation);
    if (atomic_fetch_add(&barrier_count, 1) == n - 1) {
        atomic_store(&barrier_count, 0);
        atomic_fetch_add(&barrier_generation, 1);
    } else {
        while (atomic_load(&barrier_generation) == g) cpu_relax();
    }
}
