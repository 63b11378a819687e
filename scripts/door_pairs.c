/* Times N cuMemAlloc_v2 + cuMemFree_v2 pairs through the two entry points it is given (the
 * door's hooks, or the driver's own), for scripts/door_gpu.py's "cost" part: the thread's CPU
 * time and the wall clock, in nanoseconds per pair. Returns -1 if a call failed. */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);

static double ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

int pairs_ns(void *alloc, void *release, size_t size, long n, double *cpu, double *wall) {
    alloc_fn a = (alloc_fn)alloc;
    free_fn f = (free_fn)release;
    double c0 = ns(CLOCK_THREAD_CPUTIME_ID), w0 = ns(CLOCK_MONOTONIC);
    for (long i = 0; i < n; i++) {
        unsigned long long p = 0;
        if (a(&p, size) != 0) return -1;
        if (f(p) != 0) return -1;
    }
    *cpu = (ns(CLOCK_THREAD_CPUTIME_ID) - c0) / (double)n;
    *wall = (ns(CLOCK_MONOTONIC) - w0) / (double)n;
    return 0;
}
