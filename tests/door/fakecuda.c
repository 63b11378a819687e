/* A fake CUDA driver for the driver door's tests: libcuda.so.1 serving the allocation entry
 * points from host memory, with a device of FAKECUDA_TOTAL bytes (default 1 GiB), its own
 * cuGetProcAddress, and fake_* functions the tests read the device through.
 *
 * Built by the tests with the system's C compiler; not part of the package. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>

#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr32;
typedef unsigned long long CUhandle;
enum { OK = 0, INVALID = 1, OOM = 2, NOT_FOUND = 500 };

static _Atomic int64_t used, allocations, frees;
static int64_t total_bytes;

static int64_t total(void) {
    if (total_bytes == 0) {
        const char *t = getenv("FAKECUDA_TOTAL");
        total_bytes = t ? strtoll(t, NULL, 0) : (int64_t)1 << 30;
    }
    return total_bytes;
}

/* Live blocks: address -> size, so that a free of anything else is refused, not a crash. */
#define CAP (1 << 18)
static struct { uint64_t key; int64_t size; int kind; } live[CAP];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static size_t home(uint64_t k) { return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> 46) & (CAP - 1); }

static int add(uint64_t key, int64_t size, int kind) {
    pthread_mutex_lock(&lock);
    size_t i = home(key);
    while (live[i].key != 0) i = (i + 1) & (CAP - 1);
    live[i].key = key;
    live[i].size = size;
    live[i].kind = kind;
    pthread_mutex_unlock(&lock);
    return 0;
}

static int64_t removed(uint64_t key, int kind) { /* its size, or -1 */
    pthread_mutex_lock(&lock);
    size_t i = home(key);
    while (live[i].key != 0 && !(live[i].key == key && live[i].kind == kind))
        i = (i + 1) & (CAP - 1);
    if (live[i].key == 0) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    int64_t size = live[i].size;
    size_t j = i;
    for (;;) { /* backward shift */
        j = (j + 1) & (CAP - 1);
        if (live[j].key == 0) break;
        size_t h = home(live[j].key);
        if (((j - h) & (CAP - 1)) >= ((j - i) & (CAP - 1))) {
            live[i] = live[j];
            i = j;
        }
    }
    live[i].key = 0;
    pthread_mutex_unlock(&lock);
    return size;
}

static int take_room(uint64_t n) {
    int64_t u = atomic_load(&used);
    do {
        if (n == 0 || n > (uint64_t)(total() - u)) return 0;
    } while (!atomic_compare_exchange_weak(&used, &u, u + (int64_t)n));
    return 1;
}

/* Small blocks from malloc (cheap, for the benchmark), the rest and 32-bit ones mmapped. */
#define SMALL (1 << 16)
static int small(uint64_t n, int low) { return !low && n <= SMALL; }

/* FAKECUDA_NULL=1 (the benchmark): allocations are addresses only, counted up, and frees
 * always succeed: the driver costs next to nothing, so what a hook adds shows whole. */
static int null_driver = -1;
static _Atomic uint64_t next_address = 1ULL << 40;
static int nothing_behind(void) {
    if (null_driver < 0) {
        const char *v = getenv("FAKECUDA_NULL");
        null_driver = v != NULL && strcmp(v, "1") == 0;
    }
    return null_driver;
}

static CUresult alloc(CUdeviceptr *p, uint64_t n, int low) {
    if (p == NULL || n == 0) return INVALID;
    if (nothing_behind()) {
        *p = atomic_fetch_add(&next_address, (n + 255) / 256 * 256);
        return OK;
    }
    if (!take_room(n)) return OOM;
    void *m = small(n, low) ? aligned_alloc(256, (n + 255) / 256 * 256)
                            : mmap(NULL, n, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE |
                                       (low ? MAP_32BIT : 0), -1, 0);
    if (m == MAP_FAILED || m == NULL) {
        atomic_fetch_sub(&used, (int64_t)n);
        return OOM;
    }
    add((uint64_t)(uintptr_t)m, (int64_t)n, small(n, low) ? 3 : 0);
    atomic_fetch_add(&allocations, 1);
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}

static CUresult release(uint64_t p) {
    if (p == 0) return INVALID;
    if (nothing_behind()) return OK;
    int64_t n = removed(p, 0);
    if (n >= 0) munmap((void *)(uintptr_t)p, (size_t)n);
    else if ((n = removed(p, 3)) >= 0) free((void *)(uintptr_t)p);
    else return INVALID;
    atomic_fetch_sub(&used, n);
    atomic_fetch_add(&frees, 1);
    return OK;
}

EXPORT CUresult cuInit(unsigned flags) { (void)flags; return OK; }
EXPORT CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID; *v = 12080; return OK; }
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc(p, n, 0); }
static CUresult alloc_entry(CUdeviceptr *p, size_t n) { return alloc(p, n, 0); }
EXPORT CUresult cuMemAlloc(CUdeviceptr32 *p, unsigned n) {
    CUdeviceptr q;
    if (p == NULL) return INVALID;
    CUresult r = alloc(&q, n, 1);
    if (r == OK) *p = (CUdeviceptr32)q;
    return r;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) { (void)f; return alloc(p, n, 0); }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) { (void)s; return alloc(p, n, 0); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *s) { (void)s; return alloc(p, n, 0); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *q, void *s) {
    (void)q; (void)s; return alloc(p, n, 0);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, void *q, void *s) {
    (void)q; (void)s; return alloc(p, n, 0);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e) {
    (void)e;
    if (pitch == NULL || w == 0 || h == 0) return INVALID;
    size_t rounded = (w + 511) / 512 * 512;
    if (rounded < w || h > SIZE_MAX / rounded) return OOM;
    CUresult r = alloc(p, rounded * h, 0);
    if (r == OK) *pitch = rounded;
    return r;
}
EXPORT CUresult cuMemAllocPitch(CUdeviceptr32 *p, unsigned *pitch, unsigned w, unsigned h, unsigned e) {
    (void)e;
    if (p == NULL || pitch == NULL || w == 0 || h == 0) return INVALID;
    unsigned rounded = (w + 511) / 512 * 512;
    CUdeviceptr q;
    CUresult r = alloc(&q, (uint64_t)rounded * h, 1);
    if (r == OK) { *p = (CUdeviceptr32)q; *pitch = rounded; }
    return r;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return release(p); }
static CUresult free_entry(CUdeviceptr p) { return release(p); }
EXPORT CUresult cuMemFree(CUdeviceptr32 p) { return release(p); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; return release(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *s) { (void)s; return release(p); }

EXPORT CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
    if (f == NULL || t == NULL) return INVALID;
    *t = (size_t)total();
    *f = (size_t)(total() - atomic_load(&used));
    return OK;
}
EXPORT CUresult cuMemGetInfo(unsigned *f, unsigned *t) {
    if (f == NULL || t == NULL) return INVALID;
    int64_t free_ = total() - atomic_load(&used);
    *t = total() > UINT32_MAX ? UINT32_MAX : (unsigned)total();
    *f = free_ > UINT32_MAX ? UINT32_MAX : (unsigned)free_;
    return OK;
}

/* Virtual memory: a handle is physical memory counted on the device until it is released
 * and unmapped; mapping makes a reserved range readable and writable. */
struct handle { int64_t size; _Atomic int refs; };
EXPORT CUresult cuMemCreate(CUhandle *h, size_t n, const void *prop, unsigned long long f) {
    (void)prop; (void)f;
    if (h == NULL || n == 0) return INVALID;
    if (!take_room(n)) return OOM;
    struct handle *x = malloc(sizeof *x);
    if (x == NULL) { atomic_fetch_sub(&used, (int64_t)n); return OOM; }
    x->size = (int64_t)n;
    x->refs = 1;
    add((uint64_t)(uintptr_t)x, (int64_t)n, 1);
    atomic_fetch_add(&allocations, 1);
    *h = (CUhandle)(uintptr_t)x;
    return OK;
}
static void handle_unref(struct handle *x) {
    if (atomic_fetch_sub(&x->refs, 1) == 1) {
        atomic_fetch_sub(&used, x->size);
        atomic_fetch_add(&frees, 1);
        free(x);
    }
}
EXPORT CUresult cuMemRelease(CUhandle h) {
    if (removed(h, 1) < 0) return INVALID;
    handle_unref((struct handle *)(uintptr_t)h);
    return OK;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr,
                                    unsigned long long f) {
    (void)align; (void)addr; (void)f;
    if (p == NULL || n == 0) return INVALID;
    void *m = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OOM;
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t n) {
    return munmap((void *)(uintptr_t)p, n) == 0 ? OK : INVALID;
}
/* mappings: start address -> handle, in the live table as kind 2 (size: the handle) */
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUhandle h, unsigned long long f) {
    (void)off; (void)f;
    struct handle *x = (struct handle *)(uintptr_t)h;
    if (p == 0 || n == 0 || h == 0) return INVALID;
    if (mprotect((void *)(uintptr_t)p, n, PROT_READ | PROT_WRITE) != 0) return INVALID;
    atomic_fetch_add(&x->refs, 1);
    add(p, (int64_t)h, 2);
    return OK;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
    int64_t h = removed(p, 2);
    if (h < 0) return INVALID;
    madvise((void *)(uintptr_t)p, n, MADV_DONTNEED);
    mprotect((void *)(uintptr_t)p, n, PROT_NONE);
    handle_unref((struct handle *)(uintptr_t)h);
    return OK;
}
EXPORT CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const void *desc, size_t count) {
    (void)p; (void)n; (void)desc; (void)count;
    return OK;
}
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option;
    if (g == NULL) return INVALID;
    *g = 2 << 20;
    return OK;
}

/* Page-locked host memory and copies: plain host memory here. */
EXPORT CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    if (p == NULL) return INVALID;
    *p = malloc(n ? n : 1);
    return *p ? OK : OOM;
}
EXPORT CUresult cuMemFreeHost(void *p) { free(p); return OK; }
EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    memcpy(dst, (void *)(uintptr_t)src, n);
    return OK;
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    memcpy((void *)(uintptr_t)dst, src, n);
    return OK;
}

/* cuGetProcAddress: base names, versioned as the real driver does. */
#define PER_THREAD 2ULL
EXPORT CUresult cuGetProcAddress_v2(const char *s, void **fn, int v, unsigned long long fl, int *st);
static void *lookup(const char *s, int v, unsigned long long fl) {
    static const struct { const char *name; void *v1, *v2; int since; } versioned[] = {
        {"cuMemAlloc", (void *)cuMemAlloc, (void *)cuMemAlloc_v2, 3020},
        {"cuMemFree", (void *)cuMemFree, (void *)cuMemFree_v2, 3020},
        {"cuMemAllocPitch", (void *)cuMemAllocPitch, (void *)cuMemAllocPitch_v2, 3020},
        {"cuMemGetInfo", (void *)cuMemGetInfo, (void *)cuMemGetInfo_v2, 3020},
        {"cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz, -1},
        {"cuMemFreeAsync", (void *)cuMemFreeAsync, (void *)cuMemFreeAsync_ptsz, -1},
        {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync,
         (void *)cuMemAllocFromPoolAsync_ptsz, -1},
    };
    for (size_t i = 0; i < sizeof versioned / sizeof *versioned; i++) {
        if (strcmp(s, versioned[i].name) != 0) continue;
        if (versioned[i].since < 0) return (fl & PER_THREAD) ? versioned[i].v2 : versioned[i].v1;
        return v >= versioned[i].since ? versioned[i].v2 : versioned[i].v1;
    }
    if (strcmp(s, "cuGetProcAddress") == 0) return (void *)cuGetProcAddress_v2;
    static const char *const plain[] = {"cuInit", "cuDriverGetVersion", "cuMemAllocManaged",
        "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemAddressReserve",
        "cuMemAddressFree", "cuMemSetAccess", "cuMemGetAllocationGranularity", NULL};
    for (int i = 0; plain[i]; i++)
        if (strcmp(s, plain[i]) == 0) {
            Dl_info info;
            dladdr((void *)lookup, &info);
            void *self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
            void *f = self ? dlsym(self, s) : NULL; /* this library's own, as the driver would */
            if (self) dlclose(self);
            return f;
        }
    return NULL;
}
EXPORT CUresult cuGetProcAddress_v2(const char *s, void **fn, int v, unsigned long long fl, int *st) {
    if (s == NULL || fn == NULL) return INVALID;
    *fn = lookup(s, v, fl);
    if (st) *st = *fn ? 0 : 1;
    return *fn ? OK : NOT_FOUND;
}
EXPORT CUresult cuGetProcAddress(const char *s, void **fn, int v, unsigned long long fl) {
    return cuGetProcAddress_v2(s, fn, v, fl, NULL);
}

/* For the tests: what the device holds, and how many allocations and frees it served. */
EXPORT int64_t fake_used(void) { return atomic_load(&used); }
EXPORT int64_t fake_allocations(void) { return atomic_load(&allocations); }
EXPORT int64_t fake_frees(void) { return atomic_load(&frees); }

/* The deadlock test: a thread of this library's own takes `lock`, calls `alloc` (the hook,
 * with `account` current there) and lets go; the caller (holding the interpreter lock, called
 * through ctypes.PyDLL) waits for `lock` meanwhile. 1 if both finished within timeout_ms. */
#include <time.h>
static pthread_mutex_t held = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int inside, finished;
static CUresult (*test_alloc)(CUdeviceptr *, size_t);
static CUresult (*test_free)(CUdeviceptr);
static void *test_account;
static CUresult test_result;
static void *in_hook(void *unused) {
    (void)unused;
    void (*set_current)(void *) = (void (*)(void *))dlsym(RTLD_DEFAULT, "gbd_set_current");
    if (set_current) set_current(test_account);
    pthread_mutex_lock(&held);
    atomic_store(&inside, 1);
    CUdeviceptr p = 0;
    test_result = test_alloc(&p, 4096);
    if (test_result == OK) test_free(p);
    pthread_mutex_unlock(&held);
    if (set_current) set_current(NULL);
    atomic_store(&finished, 1);
    return NULL;
}
EXPORT int fake_deadlock_test(void *alloc_, void *free_, void *account, int timeout_ms) {
    test_alloc = (CUresult (*)(CUdeviceptr *, size_t))alloc_;
    test_free = (CUresult (*)(CUdeviceptr))free_;
    test_account = account;
    atomic_store(&inside, 0);
    atomic_store(&finished, 0);
    pthread_t t;
    if (pthread_create(&t, NULL, in_hook, NULL) != 0) return -1;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    while (!atomic_load(&inside)) sched_yield();
    int got = pthread_mutex_timedlock(&held, &until) == 0; /* waits while it is in the hook */
    if (got) pthread_mutex_unlock(&held);
    if (!got) return 0; /* left running: the process ends anyway */
    pthread_join(t, NULL);
    return atomic_load(&finished) && test_result == OK ? 1 : 0;
}

/* The benchmark: nanoseconds for `rounds` pairs of alloc(size) + free through the given
 * entry points, timed in C on the calling thread's CPU clock (time it spent running: on a
 * loaded machine, what other processes take does not count). */
EXPORT double fake_pairs_ns(void *alloc_, void *free_, size_t size, long rounds) {
    CUresult (*a)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))alloc_;
    CUresult (*f)(CUdeviceptr) = (CUresult (*)(CUdeviceptr))free_;
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long i = 0; i < rounds; i++) {
        CUdeviceptr p;
        if (a(&p, size) != OK) return -1;
        f(p);
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / (double)rounds;
}

/* The driver's own entry points, reached without any lookup a preloaded library could see. */
EXPORT void *fake_unhooked_alloc(void) { return (void *)alloc_entry; }
EXPORT void *fake_unhooked_free(void) { return (void *)free_entry; }
