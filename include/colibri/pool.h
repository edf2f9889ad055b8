/*
 * A small worker pool whose caller never waits for a helper that has not started.
 *
 * An OpenMP parallel region ends at a barrier: when the OS has not yet run one of its
 * threads (every core busy: a compiler, torch's own pool), the caller waits for it a whole
 * scheduler quantum, ~10 ms for a call whose work takes 50 us. Here a call publishes its
 * chunks, wakes the helpers and claims chunks itself from a shared counter; when none is
 * left it waits only for chunks a helper has already claimed (and is running). A helper
 * that wakes late finds no work, or a later call's: claims carry the call's generation,
 * so a stale helper can never run a chunk of the wrong call.
 *
 * Between calls a spinning helper can be handed a warm (colibri_pool_warm): prefetching the
 * next call's weights while the caller runs its own code, given up when that call begins.
 *
 * POSIX threads; elsewhere (or without GCC/Clang atomics) colibri_pool_run falls back to
 * an OpenMP loop. One call at a time uses the helpers; a concurrent caller runs its chunks
 * alone (still no stall). Helpers: COLIBRI_POOL_MAX - 1 at most, made on first use.
 *
 * One pool a process: each compiled module that includes this header has its own static
 * pool until colibri_pool_share() points it at another's (colibri/_pool.pyx hands every
 * extension the same one at import). Two pools would each keep a helper spinning for the
 * next call, and on a machine with one core to spare the helper whose pool runs shares that
 * core with the others' spinning: it runs a fraction of its chunks, the caller waits for it.
 */
#ifndef COLIBRI_POOL_H
#define COLIBRI_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef void (*colibri_chunk_fn)(void *arg, int32_t chunk);

#if !defined(_WIN32) && (defined(__GNUC__) || defined(__clang__))
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#define COLIBRI_POOL_THREADS 1
#endif

#define COLIBRI_POOL_MAX 64
/* A warm (colibri_pool_warm) covers at most this many ranges, in chunks of this many bytes:
 * a helper looks for a new call between chunks (~1-2 us apart). */
#define COLIBRI_POOL_WARM_RANGES 8
#define COLIBRI_POOL_WARM_CHUNK (32 << 10)
/* How long a helper spins for new work before it sleeps, in nanoseconds. A model's decoding
 * step calls colibri's kernels every 0.1-0.5 ms with the host framework's operations in
 * between; a helper asleep by then is woken through the OS (tens of microseconds, in a VM
 * often longer than a 50-100 us call) and arrives when the caller has run every chunk: the
 * second thread then adds nothing. Spinning 1 ms keeps it awake for the whole step, as
 * llama.cpp's and OpenMP's threads are; the caller never waits for it, so on a busy core the
 * spin costs the other program's time, not colibri's. */
#define COLIBRI_POOL_SPIN_NS 1000000L

static inline void colibri_pool_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

#ifdef COLIBRI_POOL_THREADS
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t busy; /* held by the call that uses the helpers */
    int helpers;          /* started */
    int indices;          /* handed to helpers as they start */
    int sleeping;
    pid_t pid; /* a forked child has no helpers: start again */
    /* the current call, written under lock */
    colibri_chunk_fn fn;
    void *arg;
    int32_t chunks;
    int32_t want; /* helpers the call asked for */
    uint32_t gen;
    /* claims: generation << 32 | next chunk; finished chunks of the current call */
    volatile uint64_t claim;
    volatile int32_t done;
    /* the current call is a warm (colibri_pool_warm) of these ranges, not fn's chunks */
    int warm;
    const char *at[COLIBRI_POOL_WARM_RANGES];
    int64_t ends[COLIBRI_POOL_WARM_RANGES];  /* chunk after each range's last */
    int64_t sizes[COLIBRI_POOL_WARM_RANGES]; /* bytes */
} colibri_pool_t;

static colibri_pool_t colibri_pool_own = {PTHREAD_MUTEX_INITIALIZER,
                                          PTHREAD_COND_INITIALIZER,
                                          PTHREAD_MUTEX_INITIALIZER,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          0,
                                          {0},
                                          {0},
                                          {0}};
/* The pool this module's calls use: its own until colibri_pool_share(). */
static colibri_pool_t *colibri_pool_used = &colibri_pool_own;

static inline int64_t colibri_pool_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin (pause) until *gen moves on from seen, for at most COLIBRI_POOL_SPIN_NS. */
static inline void colibri_pool_spin(uint32_t *gen, uint32_t seen)
{
    int64_t end = colibri_pool_now_ns() + COLIBRI_POOL_SPIN_NS;
    int i;
    for (;;) {
        for (i = 0; i < 64; i++) { /* ~1-4 us between clock reads */
            if (__atomic_load_n(gen, __ATOMIC_ACQUIRE) != seen)
                return;
            colibri_pool_pause();
        }
        if (colibri_pool_now_ns() >= end)
            return;
    }
}

/* The next chunk of call `gen`, claimed; -1 when none is left (or a later call began). */
static inline int32_t colibri_pool_claim(colibri_pool_t *p, uint32_t gen, int32_t chunks)
{
    for (;;) {
        uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(c >> 32) != gen || (int32_t)(uint32_t)c >= chunks)
            return -1;
        if (__atomic_compare_exchange_n(&p->claim, &c, c + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return (int32_t)(uint32_t)c;
    }
}

/* Claim and run chunks of call `gen` until none is left (or a later call began). */
static inline void colibri_pool_work(colibri_pool_t *p, uint32_t gen, colibri_chunk_fn fn,
                                     void *arg, int32_t chunks)
{
    int32_t c;
    while ((c = colibri_pool_claim(p, gen, chunks)) >= 0) {
        fn(arg, c);
        __atomic_fetch_add(&p->done, 1, __ATOMIC_RELEASE);
    }
}

/* Prefetch the chunks of warm `gen` until none is left or a call began. The ranges are
 * read without the lock (relaxed atomics): a later warm may rewrite them under a stale
 * helper, which then prefetches at most one chunk of other addresses, harmless (a prefetch
 * never faults). */
static inline void colibri_pool_warm_work(colibri_pool_t *p, uint32_t gen, int32_t chunks)
{
    int32_t chunk;
    while ((chunk = colibri_pool_claim(p, gen, chunks)) >= 0) {
        int32_t j = 0;
        int64_t first = 0, n, i;
        const char *at;
        while (j + 1 < COLIBRI_POOL_WARM_RANGES
               && (n = __atomic_load_n(&p->ends[j], __ATOMIC_RELAXED)) <= chunk) {
            first = n;
            j++;
        }
        first = (int64_t)(chunk - first) * COLIBRI_POOL_WARM_CHUNK; /* offset in range j */
        at = __atomic_load_n(&p->at[j], __ATOMIC_RELAXED) + first;
        n = __atomic_load_n(&p->sizes[j], __ATOMIC_RELAXED) - first;
        if (n > COLIBRI_POOL_WARM_CHUNK)
            n = COLIBRI_POOL_WARM_CHUNK;
        for (i = 0; i < n; i += 64)
            __builtin_prefetch(at + i, 0, 3);
    }
}

static void *colibri_pool_helper(void *self)
{
    colibri_pool_t *p = (colibri_pool_t *)self;
    int index = __atomic_fetch_add(&p->indices, 1, __ATOMIC_RELAXED);
    uint32_t seen = 0;
    pthread_mutex_lock(&p->lock);
    seen = p->gen;
    for (;;) {
        colibri_chunk_fn fn;
        void *arg;
        int32_t chunks;
        uint32_t gen;
        int warm;
        while (p->gen == seen) {
            /* spin first: the next call of a decoding step finds it awake */
            pthread_mutex_unlock(&p->lock);
            colibri_pool_spin(&p->gen, seen);
            pthread_mutex_lock(&p->lock);
            if (p->gen != seen)
                break;
            p->sleeping++;
            pthread_cond_wait(&p->wake, &p->lock);
            p->sleeping--;
        }
        seen = gen = p->gen;
        fn = p->fn;
        arg = p->arg;
        chunks = p->chunks;
        warm = p->warm;
        if (index >= p->want) /* this call asked for fewer helpers */
            continue;
        pthread_mutex_unlock(&p->lock);
        if (warm)
            colibri_pool_warm_work(p, gen, chunks);
        else
            colibri_pool_work(p, gen, fn, arg, chunks);
        pthread_mutex_lock(&p->lock);
    }
    return NULL;
}

/* Start helpers up to `count` (under p->lock). */
static inline void colibri_pool_grow(colibri_pool_t *p, int count)
{
    pid_t pid = getpid();
    if (p->pid != pid) { /* first use, or a forked child: its helpers did not come along */
        p->pid = pid;
        p->helpers = 0;
        p->indices = 0;
        p->sleeping = 0;
    }
    while (p->helpers < count && p->helpers < COLIBRI_POOL_MAX - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, colibri_pool_helper, (void *)p) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        p->helpers++;
    }
}
#endif /* COLIBRI_POOL_THREADS */

/* A pass of a kernel over weight rows (an expert's gate/up or down, a linear) splits into
 * chunks of about COLIBRI_POOL_CHUNK_BYTES of weights, smaller when that leaves fewer than
 * COLIBRI_POOL_CHUNK_SPLIT chunks a thread. Long runs of rows keep each thread's stream of
 * weights long (its prefetches ahead land in its own rows) and its claims few: on a 2-core
 * Zen 4 a layer's two held Q4_0 experts of the demo's shape (4.4 MB) ran a step in 127-133 us
 * with 36-64 KiB chunks, 108-116 us with 256 KiB-1 MiB ones; two float16 ones (15.7 MB) in 32
 * KiB chunks ran slower on two threads than on one (492 us against 434), in these 344 us. */
#define COLIBRI_POOL_CHUNK_BYTES (1 << 20)
#define COLIBRI_POOL_CHUNK_SPLIT 2

/* Bytes of weights a chunk of a pass over `total` bytes on `threads` threads. */
static inline int64_t colibri_pool_chunk_bytes(int64_t total, int threads)
{
    int64_t bytes = total / ((int64_t)COLIBRI_POOL_CHUNK_SPLIT * (threads > 1 ? threads : 1));
    return bytes < COLIBRI_POOL_CHUNK_BYTES ? bytes : COLIBRI_POOL_CHUNK_BYTES;
}

/* Rows of `row` bytes in a chunk of `bytes`: a multiple of `unit`, at least one unit. */
static inline int32_t colibri_pool_chunk_rows(int64_t bytes, int64_t row, int32_t unit)
{
    int64_t rows = bytes / (row > 0 ? row : 1);
    rows -= rows % unit;
    return rows < unit ? unit : (int32_t)rows; /* at most COLIBRI_POOL_CHUNK_BYTES */
}

/* This module's pool, to hand to another module's colibri_pool_share (NULL without the
 * threads' pool: OpenMP loops). */
static inline void *colibri_pool_instance(void)
{
#ifdef COLIBRI_POOL_THREADS
    return (void *)colibri_pool_used;
#else
    return NULL;
#endif
}

/* Make this module's calls use `pool` (from colibri_pool_instance(), NULL: keep its own);
 * before its first call. */
static inline void colibri_pool_share(void *pool)
{
#ifdef COLIBRI_POOL_THREADS
    if (pool != NULL)
        colibri_pool_used = (colibri_pool_t *)pool;
#else
    (void)pool;
#endif
}

/* Run fn(arg, c) for every c < chunks on the calling thread and up to threads - 1
 * helpers; returns when every chunk has run. */
static inline void colibri_pool_run(colibri_chunk_fn fn, void *arg, int32_t chunks, int threads)
{
    int32_t c;
    if (threads > chunks)
        threads = chunks;
    if (threads <= 1) {
        for (c = 0; c < chunks; c++)
            fn(arg, c);
        return;
    }
#ifdef COLIBRI_POOL_THREADS
    {
        colibri_pool_t *p = colibri_pool_used;
        uint32_t gen;
        int spins = 0;
        if (pthread_mutex_trylock(&p->busy) != 0) { /* another call has the helpers */
            for (c = 0; c < chunks; c++)
                fn(arg, c);
            return;
        }
        pthread_mutex_lock(&p->lock);
        colibri_pool_grow(p, threads - 1);
        gen = p->gen + 1;
        p->fn = fn;
        p->arg = arg;
        p->chunks = chunks;
        p->want = threads - 1;
        p->warm = 0;
        p->done = 0;
        __atomic_store_n(&p->claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
        __atomic_store_n(&p->gen, gen, __ATOMIC_RELEASE); /* spinning helpers look here */
        if (p->sleeping)
            pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
        colibri_pool_work(p, gen, fn, arg, chunks);
        /* every chunk is claimed: wait for those that helpers are running */
        while (__atomic_load_n(&p->done, __ATOMIC_ACQUIRE) < chunks) {
            if (++spins > 200)
                sched_yield();
            else
                colibri_pool_pause();
        }
        pthread_mutex_unlock(&p->busy);
    }
#else
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
#endif
    for (c = 0; c < chunks; c++)
        fn(arg, c);
#endif
}

/* Hand a spinning helper the prefetch of `count` ranges of memory (the next call's weights)
 * and return at once: the helper brings them toward the caches while the caller runs its
 * own code (the interpreter between two kernels), and leaves them for the next call, which
 * never waits for it. Nothing happens when no helper is awake and free: a warm never wakes
 * one or waits for a lock. Prefetches never fault: memory freed meanwhile is harmless. */
static inline void colibri_pool_warm(const void *const *at, const int64_t *bytes, int count)
{
#ifdef COLIBRI_POOL_THREADS
    colibri_pool_t *p = colibri_pool_used;
    int64_t chunks = 0;
    int j, kept = 0;
    if (pthread_mutex_trylock(&p->busy) != 0) /* a call (another thread's) has the helpers */
        return;
    if (pthread_mutex_trylock(&p->lock) != 0) {
        pthread_mutex_unlock(&p->busy);
        return;
    }
    if (p->helpers > 0 && p->pid == getpid() && !p->sleeping) {
        for (j = 0; j < count && kept < COLIBRI_POOL_WARM_RANGES; j++) {
            if (bytes[j] <= 0 || at[j] == NULL)
                continue;
            chunks += (bytes[j] + COLIBRI_POOL_WARM_CHUNK - 1) / COLIBRI_POOL_WARM_CHUNK;
            __atomic_store_n(&p->at[kept], (const char *)at[j], __ATOMIC_RELAXED);
            __atomic_store_n(&p->sizes[kept], bytes[j], __ATOMIC_RELAXED);
            __atomic_store_n(&p->ends[kept++], chunks, __ATOMIC_RELAXED);
        }
        for (j = kept; j < COLIBRI_POOL_WARM_RANGES; j++) {
            __atomic_store_n(&p->sizes[j], 0, __ATOMIC_RELAXED);
            __atomic_store_n(&p->ends[j], chunks, __ATOMIC_RELAXED);
        }
    }
    if (chunks > 0 && chunks <= INT32_MAX) {
        uint32_t gen = p->gen + 1;
        p->fn = NULL;
        p->arg = NULL;
        p->warm = 1;
        p->chunks = (int32_t)chunks;
        p->want = 1; /* one helper: the others (more cores) stay free for the next call */
        __atomic_store_n(&p->claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
        __atomic_store_n(&p->gen, gen, __ATOMIC_RELEASE); /* spinning helpers look here */
    }
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&p->busy);
#else
    (void)at;
    (void)bytes;
    (void)count;
#endif
}

/* Several items' chunks in one index space: item j (stride bytes apart from items) owns
 * chunks first[j] .. first[j + 1] - 1 and runs them as fn(item j, chunk - first[j]). */
typedef struct {
    colibri_chunk_fn fn;
    const char *items;
    size_t stride;
    int32_t count;
    const int32_t *first;
} colibri_pool_many_t;

static void colibri_pool_many_chunk(void *arg, int32_t c)
{
    const colibri_pool_many_t *m = (const colibri_pool_many_t *)arg;
    int32_t j = 0;
    while (j + 1 < m->count && m->first[j + 1] <= c)
        j++;
    m->fn((void *)(m->items + (size_t)j * m->stride), c - m->first[j]);
}

/* colibri_pool_run over the chunks of count items (first: count + 1 entries) at once: one
 * dispatch for a whole layer's experts. */
static inline void colibri_pool_run_many(colibri_chunk_fn fn, const void *items, size_t stride,
                                         int32_t count, const int32_t *first, int threads)
{
    colibri_pool_many_t m;
    m.fn = fn;
    m.items = (const char *)items;
    m.stride = stride;
    m.count = count;
    m.first = first;
    colibri_pool_run(colibri_pool_many_chunk, (void *)&m, first[count], threads);
}

#endif /* COLIBRI_POOL_H */
