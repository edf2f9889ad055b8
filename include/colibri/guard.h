/*
 * A SIGBUS guard for file mappings whose file may shrink under a reader.
 *
 * Reading a page of a shared file mapping that lies past the end of the file (it was
 * truncated after it was mapped) raises SIGBUS, which kills the process. The pager registers
 * the address range of each of its mappings here. On a SIGBUS inside a registered range the
 * handler maps one anonymous zero page over the faulting page (MAP_FIXED), records that the
 * range faulted and returns: the reader (numpy, torch, the fused kernel on any thread)
 * finishes on zeros, and the pager, which checks colibri_guard_faulted() when the reader is
 * done, raises FileChangedError instead of handing out what was read. A SIGBUS anywhere else
 * goes to the handler installed before this one (or the default action: the process dies as
 * it would have).
 *
 * Registration and removal hold the GIL (one registrant at a time); the handler may run at the
 * same moment on any thread, so it reads the table through atomics only. A range is published
 * by its start (written last, cleared first): the handler never matches a half-written entry.
 * POSIX only (Linux, macOS, BSD); elsewhere every call is a no-op and COLIBRI_GUARD_ENABLED is 0
 * (Windows refuses to truncate a mapped file).
 */
#ifndef COLIBRI_GUARD_H
#define COLIBRI_GUARD_H

#include <stddef.h>
#include <stdint.h>

#if !defined(_WIN32) && !defined(__STDC_NO_ATOMICS__)
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>
#define COLIBRI_GUARD_ENABLED 1
#ifndef MAP_ANONYMOUS
#define MAP_ANONYMOUS MAP_ANON
#endif
#else
#define COLIBRI_GUARD_ENABLED 0
#endif

/* Ranges registered at once: a pager registers one per file (io="mmap") or one per resident
 * expert and file (io="view"). */
#define COLIBRI_GUARD_MAX 65536

#if COLIBRI_GUARD_ENABLED

typedef struct {
    atomic_uintptr_t start; /* 0: the entry is free */
    atomic_uintptr_t end;
    atomic_int faulted; /* a page of the range was replaced by zeros */
} colibri_guard_range;

static colibri_guard_range colibri_guard_ranges[COLIBRI_GUARD_MAX];
static atomic_size_t colibri_guard_used; /* entries [0, used) may be live */
static struct sigaction colibri_guard_previous;
static uintptr_t colibri_guard_page;
static int colibri_guard_installed;

/* The handler installed before this one, for a SIGBUS that is not ours. */
static void colibri_guard_chain(int sig, siginfo_t *info, void *context)
{
    if (colibri_guard_previous.sa_flags & SA_SIGINFO) {
        colibri_guard_previous.sa_sigaction(sig, info, context);
        return;
    }
    if (colibri_guard_previous.sa_handler != SIG_DFL
        && colibri_guard_previous.sa_handler != SIG_IGN) {
        colibri_guard_previous.sa_handler(sig);
        return;
    }
    /* the default action: die of this signal once the handler returns */
    signal(sig, SIG_DFL);
    raise(sig);
}

static void colibri_guard_handler(int sig, siginfo_t *info, void *context)
{
    int saved = errno;
    uintptr_t address = (uintptr_t)info->si_addr;
    size_t used = atomic_load_explicit(&colibri_guard_used, memory_order_acquire);
    if (info->si_code > 0) { /* raised by a fault, not by kill() or raise() */
        for (size_t i = 0; i < used; i++) {
            colibri_guard_range *r = &colibri_guard_ranges[i];
            uintptr_t start = atomic_load_explicit(&r->start, memory_order_acquire);
            if (start == 0 || address < start
                || address >= atomic_load_explicit(&r->end, memory_order_acquire)) {
                continue;
            }
            void *page = (void *)(address & ~(colibri_guard_page - 1));
            if (mmap(page, colibri_guard_page, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0)
                == MAP_FAILED) {
                break;
            }
            atomic_store_explicit(&r->faulted, 1, memory_order_release);
            errno = saved;
            return; /* the read is retried, on zeros */
        }
    }
    errno = saved;
    colibri_guard_chain(sig, info, context);
}

/* Install the handler (once); 0, or -1 with errno set. */
static int colibri_guard_install(void)
{
    if (colibri_guard_installed) {
        return 0;
    }
    struct sigaction action;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    action.sa_sigaction = colibri_guard_handler;
    colibri_guard_page = (uintptr_t)sysconf(_SC_PAGESIZE);
    if (sigaction(SIGBUS, &action, &colibri_guard_previous) != 0) {
        return -1;
    }
    colibri_guard_installed = 1;
    return 0;
}

/* Guard [start, start + length); the entry's index, or -1 when the table is full or the
 * handler cannot be installed. */
static int64_t colibri_guard_register(uintptr_t start, size_t length)
{
    if (start == 0 || length == 0 || colibri_guard_install() != 0) {
        return -1;
    }
    size_t used = atomic_load_explicit(&colibri_guard_used, memory_order_relaxed);
    size_t i = 0;
    while (i < used && atomic_load_explicit(&colibri_guard_ranges[i].start, memory_order_relaxed)) {
        i++;
    }
    if (i == COLIBRI_GUARD_MAX) {
        return -1;
    }
    colibri_guard_range *r = &colibri_guard_ranges[i];
    atomic_store_explicit(&r->faulted, 0, memory_order_relaxed);
    atomic_store_explicit(&r->end, start + length, memory_order_relaxed);
    atomic_store_explicit(&r->start, start, memory_order_release);
    if (i == used) {
        atomic_store_explicit(&colibri_guard_used, used + 1, memory_order_release);
    }
    return (int64_t)i;
}

/* Stop guarding entry i (before its range is unmapped). */
static void colibri_guard_unregister(int64_t i)
{
    if (i >= 0 && i < COLIBRI_GUARD_MAX) {
        atomic_store_explicit(&colibri_guard_ranges[i].start, 0, memory_order_release);
    }
}

/* Whether entry i replaced a page by zeros since it was registered. */
static int colibri_guard_faulted(int64_t i)
{
    if (i < 0 || i >= COLIBRI_GUARD_MAX) {
        return 0;
    }
    return atomic_load_explicit(&colibri_guard_ranges[i].faulted, memory_order_acquire);
}

#else

static int64_t colibri_guard_register(uintptr_t start, size_t length)
{
    (void)start;
    (void)length;
    return -1;
}

static void colibri_guard_unregister(int64_t i)
{
    (void)i;
}

static int colibri_guard_faulted(int64_t i)
{
    (void)i;
    return 0;
}

#endif
#endif
