/* The driver door: a library loaded before the CUDA driver (LD_PRELOAD) that charges every
 * device allocation a thread asks of the driver to that thread's innermost budget.
 *
 * Plain C, no Python: it is loaded into processes that may never import Python, and its
 * hooks never take the interpreter lock. gpubudget's Python side, when it finds this library
 * loaded (its gbd_* functions resolve in the process), makes one account per budget
 * (gbd_account_new), tells each thread which account is current there (gbd_set_current),
 * and reads the numbers back for reports.
 *
 * What it catches, however the caller found the entry point: a symbol linked directly (this
 * library comes first in the lookup order), dlsym() on the driver's handle (dlsym is
 * interposed and hands out the hook for the entry points below), and cuGetProcAddress(_v2)
 * (the real answer is compared with the driver's own entry points and swapped for the hook).
 *
 * The rule at each level of a chain (the account and its ancestors), for `x` more bytes:
 *     held + x + max(core - own, 0) <= limit
 * where `held` is what the door charged there (foreign allocations, and at a root also the
 * root's own backend allocations, `own`), and `core` is what gpubudget's allocator charged
 * the budget (stored by the ledger). At a root whose backend took its memory through the
 * driver, core <= own, so the rule reads: reservation or mapped granules + foreign <= limit.
 * `held` changes only by compare-and-swap, checked against the limit.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif
#define TLS __thread __attribute__((tls_model("initial-exec")))
/* A call the compiler must make a jump (dlsym's forwarding: see there); compilers without
 * the attribute make it one at -O2, which the build uses, and a test checks it. */
#if defined(__has_attribute)
#if __has_attribute(musttail)
#define TAIL __attribute__((musttail))
#endif
#endif
#ifndef TAIL
#define TAIL
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr32;
typedef unsigned long long CUhandle; /* CUmemGenericAllocationHandle */
typedef void *CUstream;
typedef void *CUpool;

enum { CU_OK = 0, CU_INVALID_VALUE = 1, CU_OUT_OF_MEMORY = 2 };
/* The door's version, which gpubudget's Python side checks (door/build.py's VERSION): 2
 * since the door reads the ledger's word again after its compare-and-swap. The tag lets
 * `gpubudget run` read it from a library's file without loading it. */
enum { GBD_VERSION = 2 };
EXPORT const char gbd_tag[] = "gpubudget driver door, version 2.";

/* -- accounts ---------------------------------------------------------------------------- */

/* An account is one row of the door file when gpubudget shares one (gbd_share): the first
 * SHARED_WORDS words are what other processes (gpubudget top, metrics) read, at fixed
 * offsets (gpubudget/door/shared.py reads them); the rest is this process's own. The first
 * four words are also shared with gpubudget's ledger (as 64-bit words). */
#define LIBS 64      /* libraries told apart per account; the rest count as "other" */
#define NAME 64
struct gbd_account {
    _Atomic int64_t held;  /* word 0: charged through the door here and below, own included */
    _Atomic int64_t core;  /* word 1: the ledger's `used`, stored at each change */
    _Atomic int64_t own;   /* word 2: a root's own backend allocations (part of held) */
    _Atomic int64_t limit; /* word 3 */
    _Atomic int64_t state; /* word 4: 1 while the row is an account's (readers skip 0) */
    _Atomic int64_t kind;  /* word 5: 1 a registered root, 2 a child, 0 neither (gbd_label) */
    _Atomic int64_t serial; /* word 6: a root's ledger serial, a child's budget number */
    _Atomic int64_t refusals, peak;  /* words 7, 8 */
    _Atomic int64_t last_refused;    /* word 9: size of the last refusal */
    _Atomic int64_t last_refused_lib; /* word 10 */
    _Atomic int64_t watched;         /* word 11: its budget ended; wake gpubudget when
                                      * nothing foreign is held (gbd_watch) */
    _Atomic int64_t spare[4];        /* words 12-15 */
    _Atomic int64_t refusedlib[LIBS]; /* words 16-79: refusals per library */
    _Atomic int64_t libbytes[LIBS];  /* words 80-143: live bytes charged here, per library */
    /* -- this process's own ------------------------------------------------------------ */
    /* References: Python's, each child's, each thread's that has it current. With none left
     * it is buried, and freed once nothing is charged to it (held 0): a live allocation
     * keeps its account without a count of its own, which spares the hooks two atomics. */
    _Atomic int64_t refs;
    struct gbd_account *parent, *next_buried;
    unsigned generation;  /* the process it belongs to: see fork below */
    char name[NAME];
};
#define SHARED_WORDS 144
#define ROW_BYTES 1536 /* a row of the door file */
_Static_assert(offsetof(struct gbd_account, refusedlib) == 16 * 8, "door file layout");
_Static_assert(offsetof(struct gbd_account, libbytes) == 80 * 8, "door file layout");
_Static_assert(offsetof(struct gbd_account, refs) == SHARED_WORDS * 8, "door file layout");
_Static_assert(sizeof(struct gbd_account) <= ROW_BYTES, "door file layout");
typedef struct gbd_account account;

static _Atomic unsigned generation = 1; /* +1 in each forked child */
static int attribute_only = -1;         /* GPUBUDGET_DOOR_MODE=attribute: never refuse */
static int device_info = -1;            /* GPUBUDGET_DOOR_DEVICE_INFO=1: cuMemGetInfo as is */
static TLS account *current;            /* the calling thread's innermost budget's account */
static TLS account *owner;              /* set while gpubudget's own backend calls the driver */

/* Accounts with no reference left, waiting for what is charged to them to be freed. Only the
 * control functions (gpubudget's Python side) touch this list, never a hook. Nothing
 * charged (held 0) means no live allocation points at the account: each one adds its size,
 * above 0, to its account's held and takes it back on its way out, after which that hook
 * never reads the account again (uncharge reads each link's parent first). */
static account *buried;
static pthread_mutex_t buried_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int64_t accounts; /* made and not yet freed */

/* -- the door file: rows other processes read ------------------------------------------- */
/* gbd_share maps a file that gpubudget's Python side made in the host ledger's directory
 * (its header written there: who the process is) and takes accounts from its rows from then
 * on, so that gpubudget top and metrics read every account's words live, with nothing
 * copied: the hooks write nothing more for it. Layout (shared.py reads it): a header of
 * FILE_HEADER bytes, its word FILE_NLIBS the libraries named so far, their names from byte
 * FILE_NAMES (LIBS of NAME bytes, NUL-padded; [0] is "(other)"); then ROW_BYTES per row. An
 * account made before the file, or when its rows are all taken, is the process's alone. */
#define FILE_HEADER 8192
#define FILE_NLIBS 8
#define FILE_NAMES 4096
static unsigned char *_Atomic shared_base; /* NULL: no door file */
static size_t shared_bytes, shared_rows;
static account *free_rows; /* rows not in use, linked by next_buried; under buried_lock */

static int in_file(const account *a) {
    const unsigned char *base = atomic_load(&shared_base);
    return base != NULL && (const unsigned char *)a >= base + FILE_HEADER &&
           (const unsigned char *)a < base + shared_bytes;
}

static account *account_alloc(void) {
    account *a = NULL;
    pthread_mutex_lock(&buried_lock);
    if (free_rows != NULL) {
        a = free_rows;
        free_rows = a->next_buried;
    }
    pthread_mutex_unlock(&buried_lock);
    if (a == NULL) return calloc(1, sizeof *a);
    memset((void *)a, 0, sizeof *a);
    return a;
}

static void account_free_locked(account *a) { /* buried_lock held */
    if (!in_file(a)) {
        free(a);
        return;
    }
    atomic_store(&a->state, 0); /* readers skip it from now on */
    a->next_buried = free_rows;
    free_rows = a;
}

static void sweep_locked(void) {
    for (int again = 1; again;) {
        again = 0;
        for (account **at = &buried; *at != NULL;) {
            account *a = *at;
            if (atomic_load(&a->held) != 0) {
                at = &a->next_buried;
                continue;
            }
            *at = a->next_buried;
            account *parent = a->parent;
            account_free_locked(a);
            atomic_fetch_sub(&accounts, 1);
            if (parent != NULL && atomic_fetch_sub(&parent->refs, 1) == 1) {
                parent->next_buried = buried; /* the child's reference was the last */
                buried = parent;
                again = 1;
            }
        }
    }
}

static void account_unref(account *a) {
    if (a == NULL || atomic_fetch_sub(&a->refs, 1) != 1) return;
    pthread_mutex_lock(&buried_lock);
    a->next_buried = buried;
    buried = a;
    sweep_locked();
    pthread_mutex_unlock(&buried_lock);
}

/* -- libraries: the caller's address, named once ----------------------------------------- */

struct lib { _Atomic(uintptr_t) base; char name[NAME]; };
static struct lib libs[LIBS]; /* libs[0] is "other" */
static _Atomic int nlibs = 1;
static pthread_mutex_t libs_lock = PTHREAD_MUTEX_INITIALIZER;

#define CALLERS 1024 /* a direct-mapped cache: return address -> library index */
/* Each slot one word: the address in the low 56 bits, its library's index in the top 8, so
 * that a reader never pairs one address with another's library. */
static _Atomic uint64_t callers[CALLERS];
#define ADDRESS_BITS 56
#define ADDRESS_MASK (((uint64_t)1 << ADDRESS_BITS) - 1)

static int lib_of_base(uintptr_t base, const char *path) {
    int n = atomic_load(&nlibs);
    for (int i = 1; i < n; i++)
        if (atomic_load(&libs[i].base) == base) return i;
    pthread_mutex_lock(&libs_lock);
    n = atomic_load(&nlibs);
    int found = 0;
    for (int i = 1; i < n; i++)
        if (atomic_load(&libs[i].base) == base) found = i;
    if (!found && n < LIBS) {
        const char *slash = path ? strrchr(path, '/') : NULL;
        const char *name = slash ? slash + 1 : (path && *path ? path : "(main program)");
        snprintf(libs[n].name, NAME, "%s", name);
        unsigned char *file = atomic_load(&shared_base);
        if (file != NULL) { /* the name first, then the count that shows it */
            memcpy(file + FILE_NAMES + (size_t)n * NAME, libs[n].name, NAME);
            atomic_store((_Atomic int64_t *)file + FILE_NLIBS, n + 1);
        }
        atomic_store(&libs[n].base, base);
        atomic_store(&nlibs, n + 1);
        found = n;
    }
    pthread_mutex_unlock(&libs_lock);
    return found; /* 0: the table is full, "other" */
}

static int lib_of(void *pc) {
    uint64_t key = (uint64_t)(uintptr_t)pc & ADDRESS_MASK;
    unsigned slot = (unsigned)((key >> 4) ^ (key >> 14)) % CALLERS;
    uint64_t word = atomic_load_explicit(&callers[slot], memory_order_relaxed);
    if ((word & ADDRESS_MASK) == key && key != 0) return (int)(word >> ADDRESS_BITS);
    Dl_info info;
    int lib = 0;
    if (dladdr(pc, &info) && info.dli_fbase != NULL)
        lib = lib_of_base((uintptr_t)info.dli_fbase, info.dli_fname);
    atomic_store_explicit(&callers[slot], key | ((uint64_t)lib << ADDRESS_BITS),
                          memory_order_relaxed);
    return lib;
}

/* -- what is live: pointer (or handle) -> who was charged ------------------------------ */

enum { OUTSIDE = 0, CHARGED = 1, OWN = 2 };
struct entry {
    uint64_t key;     /* the address, or the handle */
    int64_t size;
    account *acct;    /* who paid, NULL outside every budget */
    int lib, kind;
    int maps, released; /* a handle's mappings, and whether it was released */
    uint64_t handle;  /* a mapping's handle */
};
/* A shard's lock is a spin lock: held for a probe or two, never across a call. */
struct table { atomic_flag lock; struct entry *slots; size_t cap, count; };

static inline void lock_table(struct table *t) {
    for (unsigned spins = 0;
         atomic_flag_test_and_set_explicit(&t->lock, memory_order_acquire); spins++) {
        if (spins < 64) cpu_relax();
        else sched_yield(); /* the holder was preempted: let it run */
    }
}
static inline void unlock_table(struct table *t) {
    atomic_flag_clear_explicit(&t->lock, memory_order_release);
}
#define SHARDS 32
static struct table pointers[SHARDS], handles[SHARDS], mappings[SHARDS];

static void tables_init(void) { /* also in a forked child: a lock another thread held */
    for (int i = 0; i < SHARDS; i++) {
        atomic_flag_clear(&pointers[i].lock);
        atomic_flag_clear(&handles[i].lock);
        atomic_flag_clear(&mappings[i].lock);
    }
}

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}
static inline struct table *shard(struct table *set, uint64_t key) {
    return &set[mix(key) % SHARDS];
}

/* Linear probing, key 0 marks an empty slot (no live allocation has address 0). */
static struct entry *find(struct table *t, uint64_t key) {
    if (t->cap == 0) return NULL;
    size_t i = mix(key) & (t->cap - 1);
    while (t->slots[i].key != 0) {
        if (t->slots[i].key == key) return &t->slots[i];
        i = (i + 1) & (t->cap - 1);
    }
    return NULL;
}

static int put(struct table *t, const struct entry *e) { /* -1: no memory */
    if ((t->count + 1) * 2 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        struct entry *slots = calloc(cap, sizeof *slots);
        if (slots == NULL) return -1;
        for (size_t j = 0; j < t->cap; j++) {
            if (t->slots[j].key == 0) continue;
            size_t i = mix(t->slots[j].key) & (cap - 1);
            while (slots[i].key != 0) i = (i + 1) & (cap - 1);
            slots[i] = t->slots[j];
        }
        free(t->slots);
        t->slots = slots;
        t->cap = cap;
    }
    size_t i = mix(e->key) & (t->cap - 1);
    while (t->slots[i].key != 0 && t->slots[i].key != e->key) i = (i + 1) & (t->cap - 1);
    if (t->slots[i].key == 0) t->count++;
    t->slots[i] = *e;
    return 0;
}

static void drop(struct table *t, struct entry *e) { /* backward-shift deletion */
    size_t i = (size_t)(e - t->slots), mask = t->cap - 1;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].key == 0) break;
        size_t home = mix(t->slots[j].key) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) { /* j may move back to i */
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].key = 0;
    t->count--;
}

/* Take the entry for `key` out of `set` into *out; 0 if there was none. */
static int take(struct table *set, uint64_t key, struct entry *out) {
    struct table *t = shard(set, key);
    lock_table(t);
    struct entry *e = find(t, key);
    int found = e != NULL;
    if (found) {
        *out = *e;
        drop(t, e);
    }
    unlock_table(t);
    return found;
}

static int record(struct table *set, const struct entry *e) {
    struct table *t = shard(set, e->key);
    lock_table(t);
    int r = put(t, e);
    unlock_table(t);
    return r;
}

/* -- charging ---------------------------------------------------------------------------- */

static inline int live(const account *a) {
    return a != NULL && a->generation == atomic_load_explicit(&generation, memory_order_relaxed);
}

/* How many bytes `a` alone may still take (its limit, held, core and own); may be negative. */
static inline int64_t room(account *a) {
    int64_t held = atomic_load(&a->held), core = atomic_load(&a->core);
    int64_t own = atomic_load(&a->own), extra = core > own ? core - own : 0;
    return atomic_load(&a->limit) - held - extra;
}

#ifdef GBD_TEST_HOOKS /* the tests' build only: a call between the check and the CAS */
static void (*_Atomic test_between)(void);
static _Atomic int test_level; /* at this level of the chain (0: the innermost account) */
EXPORT void gbd_test_between(void (*fn)(void), int level) {
    atomic_store(&test_level, level);
    atomic_store(&test_between, fn);
}
static void between(int level) {
    if (level != atomic_load(&test_level)) return;
    void (*fn)(void) = atomic_exchange(&test_between, NULL); /* once */
    if (fn != NULL) fn();
}
#else
static inline void between(int level) { (void)level; }
#endif

/* Whether `size` more bytes at `link` pass its limit, `held` the door's bytes there before
 * them. The ledger's bytes count as far as they pass the root's own memory (own bytes being
 * charged now included: they are what will hold the ledger's blocks). */
static inline int over_limit(account *link, int64_t held, int64_t size, int is_own) {
    int64_t core = atomic_load(&link->core), own = atomic_load(&link->own) + (is_own ? size : 0);
    int64_t extra = core > own ? core - own : 0, limit = atomic_load(&link->limit);
    return size > limit || held > limit - size || extra > limit - size - held;
}

/* Give `size` back from `a` up to (not including) `stop`. */
static void charge_undone(account *a, account *stop, int64_t size) {
    for (account *back = a; back != stop; back = back->parent) atomic_fetch_sub(&back->held, size);
}

/* Charge `size` to `a` and every ancestor; NULL when granted, else the account refusing.
 * At each level: checked, added by compare-and-swap, then checked again against the ledger's
 * word read after it. The ledger does the mirror image (ledger.c's ledger_claim: its word
 * stored, the door's read after), so of two allocations at the same moment, one here and one
 * through gpubudget's allocator, at least one sees the other: never both past the limit. */
static account *charge(account *a, int64_t size, int is_own) {
    int check = !attribute_only, level = 0;
    for (account *link = a; link != NULL; link = link->parent, level++) {
        int64_t held = atomic_load(&link->held);
        for (;;) {
            if (check && over_limit(link, held, size, is_own)) {
                charge_undone(a, link, size);
                return link;
            }
            between(level);
            if (atomic_compare_exchange_weak(&link->held, &held, held + size)) break;
        }
        if (check && over_limit(link, held, size, is_own)) { /* the ledger's word, again */
            charge_undone(a, link->parent, size);
            return link;
        }
        int64_t now = held + size, peak = atomic_load(&link->peak);
        while (now > peak && !atomic_compare_exchange_weak(&link->peak, &peak, now)) {}
        if (is_own) { /* own bytes are a root's: it has no parent */
            atomic_fetch_add(&link->own, size);
            break;
        }
    }
    return NULL;
}

static _Atomic int notify_fd = -1; /* an eventfd gpubudget's watcher reads (gbd_set_notify) */

/* A watched account's foreign bytes are all gone: wake the watcher (a write of 8 bytes). */
static void notify(void) {
    int fd = atomic_load_explicit(&notify_fd, memory_order_relaxed);
    uint64_t one = 1;
    if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* full or closed: it wakes anyway */ }
}

/* Take `size` back from `a` and its ancestors. Each link's parent is read before its bytes
 * go: an account with nothing held may be freed at once (see buried). A watched account is
 * one whose budget ended while charged (Python keeps it, so it is not freed): the last
 * foreign byte leaving it wakes the watcher. */
static void uncharge(account *a, int64_t size, int is_own) {
    if (is_own) atomic_fetch_sub(&a->own, size); /* own first: held - own never too small */
    for (account *link = a, *next; link != NULL; link = next) {
        next = is_own ? NULL : link->parent;
        int watched = !is_own && atomic_load_explicit(&link->watched, memory_order_relaxed);
        int64_t before = atomic_fetch_sub(&link->held, size);
        if (watched && before - size - atomic_load(&link->own) <= 0) notify();
    }
}

static int verbose = -1;

static void settings(void) {
    if (attribute_only < 0) {
        const char *mode = getenv("GPUBUDGET_DOOR_MODE");
        attribute_only = mode != NULL && strcmp(mode, "attribute") == 0;
    }
    if (device_info < 0) {
        const char *info = getenv("GPUBUDGET_DOOR_DEVICE_INFO");
        device_info = info != NULL && *info != '\0' && strcmp(info, "0") != 0;
    }
    if (verbose < 0) {
        const char *v = getenv("GPUBUDGET_DOOR_VERBOSE");
        verbose = v != NULL && *v != '\0' && strcmp(v, "0") != 0;
    }
}

/* Who pays for an allocation by this thread now; kind set to OUTSIDE, CHARGED or OWN. */
static inline account *payer(int *kind) {
    account *a = owner;
    if (live(a)) {
        *kind = OWN;
        return a;
    }
    a = current;
    *kind = live(a) ? CHARGED : OUTSIDE;
    return *kind == CHARGED ? a : NULL;
}

static void refused(account *a, account *by, int64_t size, int lib) {
    atomic_fetch_add(&a->refusals, 1);
    if (by != a) atomic_fetch_add(&by->refusals, 1);
    atomic_fetch_add(&a->refusedlib[lib], 1);
    atomic_store(&a->last_refused, size);
    atomic_store(&a->last_refused_lib, lib);
    if (verbose)
        fprintf(stderr, "gpubudget door: %lld bytes asked by %s refused: over the limit of "
                "budget '%s'\n", (long long)size, lib ? libs[lib].name : "(other)", by->name);
}

/* Before the real call: charge. CU_OK to go on (*who set, maybe NULL: outside every budget),
 * CU_OUT_OF_MEMORY when refused. */
static CUresult admit(unsigned long long size, int lib, account **who, int *kind) {
    account *a = payer(kind);
    *who = a;
    if (a == NULL) return CU_OK;
    if (size > (unsigned long long)INT64_MAX) {
        if (attribute_only) { *who = NULL; *kind = OUTSIDE; return CU_OK; }
        refused(a, a, INT64_MAX, lib);
        return CU_OUT_OF_MEMORY;
    }
    account *by = charge(a, (int64_t)size, *kind == OWN);
    if (by != NULL) {
        refused(a, by, (int64_t)size, lib);
        return CU_OUT_OF_MEMORY;
    }
    return CU_OK;
}

/* After a successful real call: remember the allocation; -1 if it cannot be (no memory). */
static int remember(struct table *set, uint64_t key, int64_t size, account *a, int lib,
                    int kind) {
    struct entry e = {key, size, a, lib, kind, 0, 0, 0};
    if (record(set, &e) < 0) return -1;
    /* what it holds keeps its account (see buried); its bytes by library are counted in
     * the account itself, for readers in other processes (the door file) */
    if (kind == CHARGED) atomic_fetch_add_explicit(&a->libbytes[lib], size, memory_order_relaxed);
    return 0;
}

static void unadmit(account *a, int64_t size, int kind) {
    if (a != NULL) uncharge(a, size, kind == OWN);
}

/* An allocation given back: uncharge whoever paid, whichever thread this is. */
static void forget(const struct entry *e) {
    if (e->acct == NULL) return;
    if (e->kind == CHARGED) /* before its bytes go: the account may go with them */
        atomic_fetch_sub_explicit(&e->acct->libbytes[e->lib], e->size, memory_order_relaxed);
    uncharge(e->acct, e->size, e->kind == OWN);
}

/* -- the real driver --------------------------------------------------------------------- */

static void *(*real_dlsym)(void *, const char *);

#define HOOKS(X)                                                                             \
    X(cuMemAlloc_v2, CUresult, (CUdeviceptr * p, size_t n), (p, n))                          \
    X(cuMemAlloc, CUresult, (CUdeviceptr32 * p, unsigned n), (p, n))                         \
    X(cuMemAllocPitch_v2, CUresult,                                                          \
      (CUdeviceptr * p, size_t *pitch, size_t w, size_t h, unsigned e), (p, pitch, w, h, e)) \
    X(cuMemAllocPitch, CUresult,                                                             \
      (CUdeviceptr32 * p, unsigned *pitch, unsigned w, unsigned h, unsigned e),              \
      (p, pitch, w, h, e))                                                                   \
    X(cuMemAllocManaged, CUresult, (CUdeviceptr * p, size_t n, unsigned f), (p, n, f))       \
    X(cuMemFree_v2, CUresult, (CUdeviceptr p), (p))                                          \
    X(cuMemFree, CUresult, (CUdeviceptr32 p), (p))                                           \
    X(cuMemAllocAsync, CUresult, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s))         \
    X(cuMemAllocAsync_ptsz, CUresult, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s))    \
    X(cuMemAllocFromPoolAsync, CUresult,                                                     \
      (CUdeviceptr * p, size_t n, CUpool q, CUstream s), (p, n, q, s))                       \
    X(cuMemAllocFromPoolAsync_ptsz, CUresult,                                                \
      (CUdeviceptr * p, size_t n, CUpool q, CUstream s), (p, n, q, s))                       \
    X(cuMemFreeAsync, CUresult, (CUdeviceptr p, CUstream s), (p, s))                         \
    X(cuMemFreeAsync_ptsz, CUresult, (CUdeviceptr p, CUstream s), (p, s))                    \
    X(cuMemCreate, CUresult, (CUhandle * h, size_t n, const void *prop, unsigned long long f), \
      (h, n, prop, f))                                                                       \
    X(cuMemRelease, CUresult, (CUhandle h), (h))                                             \
    X(cuMemMap, CUresult,                                                                    \
      (CUdeviceptr p, size_t n, size_t off, CUhandle h, unsigned long long f),               \
      (p, n, off, h, f))                                                                     \
    X(cuMemUnmap, CUresult, (CUdeviceptr p, size_t n), (p, n))                               \
    X(cuMemGetInfo_v2, CUresult, (size_t * f, size_t *t), (f, t))                            \
    X(cuMemGetInfo, CUresult, (unsigned *f, unsigned *t), (f, t))                            \
    X(cuGetProcAddress_v2, CUresult,                                                         \
      (const char *s, void **fn, int v, unsigned long long fl, int *st), (s, fn, v, fl, st)) \
    X(cuGetProcAddress, CUresult, (const char *s, void **fn, int v, unsigned long long fl),  \
      (s, fn, v, fl))

#define INDEX(name, ret, params, args) H_##name,
enum { HOOKS(INDEX) NHOOKS };
#define TYPE(name, ret, params, args) typedef ret(*name##_fn) params;
HOOKS(TYPE)
#define DECLARE(name, ret, params, args) EXPORT ret name params;
HOOKS(DECLARE)
#define NAMEOF(name, ret, params, args) #name,
static const char *const hook_names[NHOOKS] = {HOOKS(NAMEOF)};
#define ADDRESS(name, ret, params, args) (void *)name,
static void *const hook_addresses[NHOOKS] = {HOOKS(ADDRESS)};
static void *_Atomic reals[NHOOKS];

static void *driver(void) { /* the driver's handle, loading it if no one has */
    static void *_Atomic handle;
    void *h = atomic_load(&handle);
    if (h == NULL) {
        h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (h == NULL) h = dlopen("libcuda.so.1", RTLD_LAZY);
        if (h != NULL) atomic_store(&handle, h);
    }
    return h;
}

static void find_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
    for (int i = 0; real_dlsym == NULL && versions[i] != NULL; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void *real(int i) {
    void *fn = atomic_load_explicit(&reals[i], memory_order_acquire);
    if (fn != NULL) return fn;
    find_dlsym();
    if (real_dlsym == NULL) return NULL;
    fn = real_dlsym(RTLD_NEXT, hook_names[i]);
    if (fn == NULL || fn == hook_addresses[i]) {
        void *h = driver();
        fn = h != NULL ? real_dlsym(h, hook_names[i]) : NULL;
    }
    if (fn == hook_addresses[i]) fn = NULL;
    if (fn != NULL) atomic_store_explicit(&reals[i], fn, memory_order_release);
    return fn;
}

static inline void *real_fast(int i) {
    void *fn = atomic_load_explicit(&reals[i], memory_order_acquire);
    return fn != NULL ? fn : real(i);
}
#define REAL(name) ((name##_fn)real_fast(H_##name))
#define CALLER() __builtin_extract_return_addr(__builtin_return_address(0))

/* The real entry points of the driver that `fn` belongs to, all of them, found once. */
static void learn_driver_of(void *fn) {
    static _Atomic int learned;
    if (atomic_load(&learned)) return;
    Dl_info info;
    if (!dladdr(fn, &info) || info.dli_fname == NULL) return;
    void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) return;
    find_dlsym();
    for (int i = 0; i < NHOOKS; i++) {
        void *r = real_dlsym(h, hook_names[i]);
        void *none = NULL;
        if (r != NULL && r != hook_addresses[i])
            atomic_compare_exchange_strong(&reals[i], &none, r);
    }
    atomic_store(&learned, 1);
}

/* The hook standing for the driver's `fn`, or `fn` itself. */
static void *swap(void *fn) {
    if (fn == NULL) return fn;
    learn_driver_of(fn);
    for (int i = 0; i < NHOOKS; i++)
        if (atomic_load(&reals[i]) == fn) return hook_addresses[i];
    return fn;
}

/* -- the hooks --------------------------------------------------------------------------- */

#define NO_DRIVER 3 /* CUDA_ERROR_NOT_INITIALIZED: what a call gets without a driver */

/* An allocation of `size` bytes made by `call` (an expression assigning `r`), whose address
 * lands in `*where`. */
#define ALLOCATE(size, where, call)                                                 \
    do {                                                                              \
        if ((where) == NULL) { r = (call); break; }                                   \
        int lib = lib_of(CALLER()), kind;                                             \
        account *a;                                                                   \
        if (admit((size), lib, &a, &kind) != CU_OK) return CU_OUT_OF_MEMORY;          \
        r = (call);                                                                   \
        if (r != CU_OK) { unadmit(a, (int64_t)(size), kind); break; }                 \
        if (remember(pointers, (uint64_t)*(where), (int64_t)(size), a, lib, kind) < 0) { \
            unadmit(a, (int64_t)(size), kind);                                        \
            give_back((uint64_t)*(where));                                            \
            r = CU_OUT_OF_MEMORY;                                                     \
        }                                                                             \
    } while (0)

static void give_back(uint64_t p) {
    cuMemFree_v2_fn f = REAL(cuMemFree_v2);
    if (f != NULL) f((CUdeviceptr)p);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    cuMemAlloc_v2_fn f = REAL(cuMemAlloc_v2);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n));
    return r;
}

EXPORT CUresult cuMemAlloc(CUdeviceptr32 *p, unsigned n) {
    cuMemAlloc_fn f = REAL(cuMemAlloc);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n));
    return r;
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned flags) {
    cuMemAllocManaged_fn f = REAL(cuMemAllocManaged);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n, flags));
    return r;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    cuMemAllocAsync_fn f = REAL(cuMemAllocAsync);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n, s));
    return r;
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    cuMemAllocAsync_ptsz_fn f = REAL(cuMemAllocAsync_ptsz);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n, s));
    return r;
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUpool q, CUstream s) {
    cuMemAllocFromPoolAsync_fn f = REAL(cuMemAllocFromPoolAsync);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n, q, s));
    return r;
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUpool q, CUstream s) {
    cuMemAllocFromPoolAsync_ptsz_fn f = REAL(cuMemAllocFromPoolAsync_ptsz);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    ALLOCATE(n, p, f(p, n, q, s));
    return r;
}

/* A pitched allocation: its size (pitch x height) is known only once the driver chose the
 * pitch, so it is charged after the call and given back if refused. */
static CUresult pitched(uint64_t address, unsigned long long size, int lib) {
    int kind;
    account *a;
    if (admit(size, lib, &a, &kind) != CU_OK) {
        give_back(address);
        return CU_OUT_OF_MEMORY;
    }
    if (remember(pointers, address, (int64_t)size, a, lib, kind) < 0) {
        unadmit(a, (int64_t)size, kind);
        give_back(address);
        return CU_OUT_OF_MEMORY;
    }
    return CU_OK;
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h,
                                   unsigned e) {
    cuMemAllocPitch_v2_fn f = REAL(cuMemAllocPitch_v2);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(p, pitch, w, h, e);
    if (r != CU_OK || p == NULL || pitch == NULL) return r;
    return pitched(*p, (unsigned long long)*pitch * h, lib_of(CALLER()));
}

EXPORT CUresult cuMemAllocPitch(CUdeviceptr32 *p, unsigned *pitch, unsigned w, unsigned h,
                                unsigned e) {
    cuMemAllocPitch_fn f = REAL(cuMemAllocPitch);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(p, pitch, w, h, e);
    if (r != CU_OK || p == NULL || pitch == NULL) return r;
    return pitched(*p, (unsigned long long)*pitch * h, lib_of(CALLER()));
}

/* A free: the entry comes out first (no other thread can be given this address while it is
 * still allocated) and goes back if the driver refuses the free. */
#define FREE(key, call)                                                \
    do {                                                               \
        struct entry e;                                                \
        int known = (key) != 0 && take(pointers, (key), &e);           \
        r = (call);                                                    \
        if (!known) break;                                             \
        if (r == CU_OK) forget(&e);                                    \
        else record(pointers, &e); /* was there a moment ago: room */  \
    } while (0)

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    cuMemFree_v2_fn f = REAL(cuMemFree_v2);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    FREE((uint64_t)p, f(p));
    return r;
}

EXPORT CUresult cuMemFree(CUdeviceptr32 p) {
    cuMemFree_fn f = REAL(cuMemFree);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    FREE((uint64_t)p, f(p));
    return r;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    cuMemFreeAsync_fn f = REAL(cuMemFreeAsync);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    FREE((uint64_t)p, f(p, s));
    return r;
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    cuMemFreeAsync_ptsz_fn f = REAL(cuMemFreeAsync_ptsz);
    if (f == NULL) return NO_DRIVER;
    CUresult r;
    FREE((uint64_t)p, f(p, s));
    return r;
}

/* Virtual memory: physical memory is taken by cuMemCreate and given back once its handle is
 * released and no longer mapped anywhere (the driver keeps a released handle's memory while
 * a mapping holds it), so that is when it is uncharged. */
/* CUmemAllocationProp begins {int type; int requestedHandleTypes; {int type; int id}
 * location; ...}: memory on a device has location.type CU_MEM_LOCATION_TYPE_DEVICE (1);
 * host-located physical memory (2, 3, 4: host, a NUMA node) is not the device's. */
static int on_device(const void *prop) {
    return prop != NULL && ((const int *)prop)[2] == 1;
}

EXPORT CUresult cuMemCreate(CUhandle *h, size_t n, const void *prop, unsigned long long flags) {
    cuMemCreate_fn f = REAL(cuMemCreate);
    if (f == NULL) return NO_DRIVER;
    if (h == NULL || !on_device(prop)) return f(h, n, prop, flags);
    int lib = lib_of(CALLER()), kind;
    account *a;
    if (admit(n, lib, &a, &kind) != CU_OK) return CU_OUT_OF_MEMORY;
    CUresult r = f(h, n, prop, flags);
    if (r != CU_OK) {
        unadmit(a, (int64_t)n, kind);
        return r;
    }
    if (remember(handles, (uint64_t)*h, (int64_t)n, a, lib, kind) < 0) {
        unadmit(a, (int64_t)n, kind);
        cuMemRelease_fn release = REAL(cuMemRelease);
        if (release != NULL) release(*h);
        return CU_OUT_OF_MEMORY;
    }
    return CU_OK;
}

/* Change a handle's mapping count by `delta`, or mark it released; uncharge it when it is
 * released and unmapped. */
static void handle_changed(uint64_t h, int delta, int release) {
    struct table *t = shard(handles, h);
    struct entry gone;
    int done = 0;
    lock_table(t);
    struct entry *e = find(t, h);
    if (e != NULL) {
        e->maps += delta;
        if (release) e->released = 1;
        if (e->released && e->maps <= 0) {
            gone = *e;
            drop(t, e);
            done = 1;
        }
    }
    unlock_table(t);
    if (done) forget(&gone);
}

EXPORT CUresult cuMemRelease(CUhandle h) {
    cuMemRelease_fn f = REAL(cuMemRelease);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(h);
    if (r == CU_OK) handle_changed((uint64_t)h, 0, 1);
    return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUhandle h,
                         unsigned long long flags) {
    cuMemMap_fn f = REAL(cuMemMap);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(p, n, off, h, flags);
    if (r != CU_OK || p == 0) return r;
    struct entry m = {(uint64_t)p, (int64_t)n, NULL, 0, OUTSIDE, 0, 0, (uint64_t)h};
    if (record(mappings, &m) == 0) handle_changed((uint64_t)h, 1, 0);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
    cuMemUnmap_fn f = REAL(cuMemUnmap);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(p, n);
    if (r != CU_OK) return r;
    /* the mappings that start in [p, p + n): found from p, each one's size apart */
    for (uint64_t at = p, end = (uint64_t)p + n; at < end && at >= p;) {
        struct entry m;
        if (!take(mappings, at, &m)) break;
        handle_changed(m.handle, -1, 0);
        if (m.size <= 0) break;
        at += (uint64_t)m.size;
    }
    return r;
}

/* What a budget may still take: the least room along its chain, never below 0. */
static int64_t budget_free(account *a) {
    int64_t best = INT64_MAX;
    for (account *link = a; link != NULL; link = link->parent) {
        int64_t r = room(link);
        if (r < best) best = r;
    }
    return best > 0 ? best : 0;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
    cuMemGetInfo_v2_fn f = REAL(cuMemGetInfo_v2);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(free_, total);
    account *a = current;
    if (r != CU_OK || free_ == NULL || total == NULL || device_info || live(owner) || !live(a))
        return r;
    int64_t room_ = budget_free(a), limit = atomic_load(&a->limit);
    if ((uint64_t)room_ < *free_) *free_ = (size_t)room_;
    if ((uint64_t)limit < *total) *total = (size_t)limit; /* never more than the device */
    return r;
}

EXPORT CUresult cuMemGetInfo(unsigned *free_, unsigned *total) {
    cuMemGetInfo_fn f = REAL(cuMemGetInfo);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(free_, total);
    account *a = current;
    if (r != CU_OK || free_ == NULL || total == NULL || device_info || live(owner) || !live(a))
        return r;
    int64_t room_ = budget_free(a), limit = atomic_load(&a->limit);
    if ((uint64_t)room_ < *free_) *free_ = (unsigned)room_;
    if ((uint64_t)limit < *total) *total = (unsigned)limit;
    return r;
}

EXPORT CUresult cuGetProcAddress_v2(const char *s, void **fn, int v, unsigned long long fl,
                                    int *st) {
    cuGetProcAddress_v2_fn f = REAL(cuGetProcAddress_v2);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(s, fn, v, fl, st);
    if (r == CU_OK && fn != NULL) *fn = swap(*fn);
    return r;
}

EXPORT CUresult cuGetProcAddress(const char *s, void **fn, int v, unsigned long long fl) {
    cuGetProcAddress_fn f = REAL(cuGetProcAddress);
    if (f == NULL) return NO_DRIVER;
    CUresult r = f(s, fn, v, fl);
    if (r == CU_OK && fn != NULL) *fn = swap(*fn);
    return r;
}

/* dlsym: a caller looking one of the entry points up on the driver's handle gets the hook.
 * Every other lookup goes on as a tail call, so that dlsym(RTLD_NEXT, ...) still searches
 * after the caller's library (the real dlsym reads its caller's address). */
EXPORT void *dlsym(void *handle, const char *name) {
    if (real_dlsym == NULL) find_dlsym();
    if (name != NULL && name[0] == 'c' && name[1] == 'u') {
        for (int i = 0; i < NHOOKS; i++) {
            if (strcmp(name, hook_names[i]) != 0) continue;
            void *r = real_dlsym(handle, name);
            if (r == NULL) return NULL;
            void *none = NULL;
            if (r != hook_addresses[i]) atomic_compare_exchange_strong(&reals[i], &none, r);
            return hook_addresses[i];
        }
    }
    TAIL return real_dlsym(handle, name);
}

/* -- control, for gpubudget's Python side ---------------------------------------------- */

EXPORT int gbd_version(void) { return GBD_VERSION; }

EXPORT account *gbd_account_new(const char *name, int64_t limit, account *parent) {
    account *a = account_alloc();
    if (a == NULL) return NULL;
    atomic_fetch_add(&accounts, 1);
    snprintf(a->name, NAME, "%s", name ? name : "");
    atomic_store(&a->limit, limit);
    atomic_store(&a->refs, 1);
    a->generation = atomic_load(&generation);
    if (parent != NULL) {
        atomic_fetch_add(&parent->refs, 1);
        a->parent = parent;
    }
    atomic_store(&a->state, 1); /* last: a reader of the door file sees it whole */
    return a;
}

/* Which budget of the host ledger `a` is, for readers of the door file: kind 1 a registered
 * root (serial: its ledger slot's serial), 2 a child (serial: its budget number). */
EXPORT void gbd_label(account *a, int64_t kind, int64_t serial) {
    atomic_store(&a->serial, serial);
    atomic_store(&a->kind, kind);
}

/* Share the accounts made from now on in the door file open as `fd`, `bytes` long (made by
 * gpubudget, its header written): 0, or -1 (errno set) when it cannot be mapped, or a file
 * is shared already. */
EXPORT int gbd_share(int fd, int64_t bytes) {
    if (atomic_load(&shared_base) != NULL || bytes < FILE_HEADER + ROW_BYTES) {
        errno = EINVAL;
        return -1;
    }
    void *at = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (at == MAP_FAILED) return -1;
    unsigned char *file = at;
    pthread_mutex_lock(&libs_lock);
    snprintf((char *)file + FILE_NAMES, NAME, "(other)");
    int n = atomic_load(&nlibs);
    for (int i = 1; i < n; i++) memcpy(file + FILE_NAMES + (size_t)i * NAME, libs[i].name, NAME);
    atomic_store((_Atomic int64_t *)file + FILE_NLIBS, n);
    pthread_mutex_lock(&buried_lock);
    shared_bytes = (size_t)bytes;
    shared_rows = ((size_t)bytes - FILE_HEADER) / ROW_BYTES;
    for (size_t i = shared_rows; i-- > 0;) {
        account *row = (account *)(file + FILE_HEADER + i * ROW_BYTES);
        row->next_buried = free_rows;
        free_rows = row;
    }
    atomic_store(&shared_base, file);
    pthread_mutex_unlock(&buried_lock);
    pthread_mutex_unlock(&libs_lock);
    return 0;
}

/* The door file's geometry, for its reader to check: [header bytes, row bytes, shared
 * words, libraries, name bytes, names offset, nlibs word]. */
EXPORT void gbd_file_layout(int64_t out[7]) {
    out[0] = FILE_HEADER;
    out[1] = ROW_BYTES;
    out[2] = SHARED_WORDS;
    out[3] = LIBS;
    out[4] = NAME;
    out[5] = FILE_NAMES;
    out[6] = FILE_NLIBS;
}

EXPORT void gbd_account_drop(account *a) { account_unref(a); }
EXPORT void gbd_account_set_limit(account *a, int64_t limit) { atomic_store(&a->limit, limit); }
/* A thread that ends with an account current gives its reference back (the key's value is
 * the account, its destructor runs at the thread's exit). */
static pthread_key_t current_key;
static void thread_ended(void *a) { account_unref((account *)a); }

/* The calling thread's account from now on (NULL: none); the thread holds a reference. */
EXPORT void gbd_set_current(account *a) {
    account *before = current;
    if (a != NULL) atomic_fetch_add(&a->refs, 1);
    current = a;
    pthread_setspecific(current_key, a);
    account_unref(before);
}
EXPORT account *gbd_current(void) { return current; }
/* For gpubudget's pure-Python ledger, what ledger.c's ledger_claim does at one level: the
 * ledger's word (1) stored, then the door's bytes that are not own read after it. */
EXPORT int64_t gbd_claim(account *a, int64_t core) {
    atomic_store(&a->core, core);
    int64_t foreign = atomic_load(&a->held) - atomic_load(&a->own);
    return foreign > 0 ? foreign : 0;
}
/* The eventfd (or pipe) that notify() writes to; -1: none. */
EXPORT void gbd_set_notify(int fd) { atomic_store(&notify_fd, fd); }
/* Watch `a` (its budget ended while charged) or stop watching it. */
EXPORT void gbd_watch(account *a, int on) { atomic_store(&a->watched, on ? 1 : 0); }
EXPORT account *gbd_set_owner(account *a) {
    account *before = owner;
    owner = a;
    return before;
}

/* An account's numbers: [held, core, own, limit, 0, refusals, 0, peak,
 * last_refused, last_refused_lib]. */
EXPORT void gbd_account_numbers(account *a, int64_t out[10]) {
    out[0] = atomic_load(&a->held);
    out[1] = atomic_load(&a->core);
    out[2] = atomic_load(&a->own);
    out[3] = atomic_load(&a->limit);
    out[4] = 0; /* live allocations: gbd_live_bytes counts them */
    out[5] = atomic_load(&a->refusals);
    out[6] = 0; /* unused */
    out[7] = atomic_load(&a->peak);
    out[8] = atomic_load(&a->last_refused);
    out[9] = atomic_load(&a->last_refused_lib);
}

/* Library `i`'s name (0: the ones not told apart), or NULL past the last. */
EXPORT const char *gbd_library(int i) {
    if (i < 0 || i >= atomic_load(&nlibs)) return NULL;
    return i == 0 ? "(other)" : libs[i].name;
}

/* Library `i`'s requests refused by `a`. */
EXPORT int64_t gbd_library_refusals(account *a, int i) {
    return a != NULL && i >= 0 && i < LIBS ? atomic_load(&a->refusedlib[i]) : 0;
}

/* The bytes live now that `a` was charged for itself (NULL: outside every budget), by
 * library, summed over the tables (the hooks keep no per-library counters: a report is rare,
 * an allocation is not). out[n] for the first n libraries, *count the allocations; returns
 * the total. */
EXPORT int64_t gbd_live_bytes(account *a, int64_t *out, int n, int64_t *count) {
    int64_t total = 0;
    *count = 0;
    for (int i = 0; i < n; i++) out[i] = 0;
    struct table *sets[] = {pointers, handles};
    for (int s = 0; s < 2; s++) {
        for (int k = 0; k < SHARDS; k++) {
            struct table *t = &sets[s][k];
            lock_table(t);
            for (size_t j = 0; j < t->cap; j++) {
                const struct entry *e = &t->slots[j];
                if (e->key == 0 || e->acct != a || (a != NULL && e->kind != CHARGED)) continue;
                total += e->size;
                *count += 1;
                if (e->lib < n) out[e->lib] += e->size;
            }
            unlock_table(t);
        }
    }
    return total;
}
EXPORT int gbd_attribute_only(void) { settings(); return attribute_only; }

/* Accounts made and not yet freed (for tests: none is kept past what holds it). */
EXPORT int64_t gbd_accounts(void) { return atomic_load(&accounts); }

/* -- process events ---------------------------------------------------------------------- */

static void child_after_fork(void) {
    /* The accounts belong to the parent's budgets, which the child does not hold: from now
     * on they charge nothing here, and this thread (the only one) has no budget. */
    atomic_fetch_add(&generation, 1);
    atomic_store(&notify_fd, -1); /* the parent's watcher's: the child makes its own */
    current = NULL;
    owner = NULL;
    pthread_setspecific(current_key, NULL);
    tables_init();
    pthread_mutex_init(&libs_lock, NULL);
    pthread_mutex_init(&buried_lock, NULL);
    /* The door file is the parent's: this process's rows become its own copy, so that what
     * it does with the inherited accounts (a free of the parent's memory) never shows in
     * the parent's numbers. */
    unsigned char *file = atomic_load(&shared_base);
    if (file != NULL) {
        void *copy = mmap(NULL, shared_bytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (copy != MAP_FAILED) {
            memcpy(copy, file, shared_bytes);
            if (mmap(file, shared_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED)
                memcpy(file, copy, shared_bytes);
            munmap(copy, shared_bytes);
        }
    }
}

__attribute__((constructor)) static void door_init(void) {
    tables_init();
    settings();
    find_dlsym();
    pthread_key_create(&current_key, thread_ended);
    pthread_atfork(NULL, NULL, child_after_fork);
}
