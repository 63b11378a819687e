/* gpubudget's allocation core in C: what its files share.
 *
 * The core's hot path has two implementations with one behaviour: the Python modules beside
 * these files (the reference, and what runs where no C compiler was at hand) and the C
 * extension gpubudget._core._native, built by setup.py from every .c file here. Each C file
 * does one job and is named after the Python module it mirrors:
 *
 *   arena.c     arena.py      Arena: best fit over one address range with coalescing: the
 *                             smallest free block that fits, the lowest address among equals;
 *                             free blocks in size classes, three hash maps (free start ->
 *                             size, free end -> start, taken start -> size), in units of
 *                             the granularity
 *   ledger.c    ledger.py     Account: one budget's limit, reserve, used, peak; refusal(),
 *                             claim(), settle(), charge(), available(), passed_up() up the
 *                             chain of parents
 *   recorder.c  recorder.py   Stats: one budget's counters (its methods stay in Python);
 *                             EventLog: a tree's bounded timeline, a ring of C records
 *   locks.c     locks.py      Lock: a tree's re-entrant lock; Python code holds it with
 *                             `with`, the fast path takes it without waiting
 *   registry.c  registry.py   Registry: a tree's live blocks (Tree.live), a dict's interface
 *   tree.c      tree.py       the fast path: the common case of Tree.allocate and Tree.free,
 *                             whole, as Budget.allocate and Budget.free (node.py installs it)
 *   adapter.c   ../adapter.py Router (by_device) and Clock (hand_clock)
 *   trace.c     ../tracefile/queue.py
 *                             TraceQueue: a trace writer's lines not yet written, one
 *                             buffer; the fast path encodes its events into it
 *   callers.c   ../callers.py user_stack: the caller's frames, walked without tracebacks
 *   _native.c   __init__.py   the module: its types and functions
 *
 * The fast path (tree.c) does the common case whole, and anything else (a denial, a stream
 * still pending, a growth of a growable root, stacks, tracing, an argument that is not a
 * plain int or str) calls the Python method it replaces, which does everything, as in the
 * pure-Python core (a traced tree's allocations and frees, and stacks, stay in C: trace.c,
 * callers.c). It reads the Python objects' __slots__ at offsets looked up once, so both
 * cores share their classes. tests/test_native.py runs both side by side and compares every
 * answer and number.
 *
 * Below: what more than one file uses, in the order of the files above. A struct is here
 * only where another file reads its fields; the others stay in their file.
 */
#ifndef GPUBUDGET_NATIVE_H
#define GPUBUDGET_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef long long i64;

static inline int is_power_of_two(i64 v) { return v > 0 && (v & (v - 1)) == 0; }

/* A Python int as i64; *ok = 0 when it is not one that fits (no error set). */
static inline i64 as_i64(PyObject *value, int *ok) {
    int overflow = 0;
    i64 v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    *ok = 1;
    return v;
}

/* Hash tables of i64 keys (the arena's maps, the registry): open addressing, linear probing,
 * a power-of-two number of slots `cap`, deletion by backward shift. */

/* The slot where `key` belongs: Fibonacci hashing, the top bits. */
static inline Py_ssize_t hash_home(i64 key, Py_ssize_t cap) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ULL;
    return (Py_ssize_t)(h >> (64 - __builtin_ctzll((uint64_t)cap)));
}

/* Deleting by backward shift: whether the entry at `j`, which belongs at `home`, may move
 * to the hole at `hole` (it may unless `home` is cyclically in (hole, j]). */
static inline int hash_may_fill(Py_ssize_t home, Py_ssize_t hole, Py_ssize_t j) {
    return (j > hole && (home <= hole || home > j)) || (j < hole && (home <= hole && home > j));
}

/* -- arena.c ------------------------------------------------------------------------------ */

typedef struct ArenaObject ArenaObject;
extern PyTypeObject ArenaType;

/* Where a block goes (arena_place), found before anything changes; arena_take takes it. */
typedef struct {
    i64 address;
    int class_;
    Py_ssize_t index;
    i64 pad, units;
} Place;

int arena_reserve(ArenaObject *a);
int arena_place(const ArenaObject *a, i64 size, i64 alignment, Place *place);
i64 arena_take(ArenaObject *a, const Place *place);
i64 arena_alloc(ArenaObject *a, i64 size, i64 alignment);
i64 arena_free(ArenaObject *a, i64 address);

/* -- ledger.c ----------------------------------------------------------------------------- */

typedef struct AccountObject {
    PyObject_HEAD
    PyObject *name, *limit_given, *reserve_given; /* as given; in C at most 2**63 - 1 */
    i64 limit, reserve, used, peak, refusals, depth;
    i64 claimed; /* bytes of allocations claimed here and not yet charged (ledger_claim) */
    struct AccountObject *parent;
    char plain;
    PyObject *published; /* a writable buffer of unsigned 64-bit words, or NULL */
    Py_buffer words;
    PyObject *door; /* the driver door's words for this budget (ledger.py), or NULL */
    Py_buffer door_words;
} AccountObject;

extern PyTypeObject AccountType;

AccountObject *ledger_refusal(AccountObject *account, i64 delta);
void ledger_charge(AccountObject *account, i64 delta); /* delta bytes up the chain, peaks */
AccountObject *ledger_claim(AccountObject *account, i64 delta); /* refusal, shown to the door */
void ledger_settle(AccountObject *account, i64 delta); /* a claim not charged, withdrawn */
/* functions of the module (_native.c) */
PyObject *py_passed_up(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_refusal(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_charge(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_claim(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_settle(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_available(PyObject *module, PyObject *arg);

/* -- recorder.c --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    i64 allocations, frees, blocks, peak_blocks, invalid_frees, denied, bytes_allocated,
        bytes_freed;
    PyObject *largest_denied; /* an int: a request may be larger than 64 bits */
    PyObject *denials, *tags, *errors, *retired;
} StatsObject;

typedef struct EventLogObject EventLogObject;
extern PyTypeObject StatsType, EventLogType;
enum { KIND_ALLOC, KIND_FREE, KIND_DENY, KINDS };

/* The names of the kinds of event: once, when the module is made; -1 on error. */
int recorder_init(void);
int tag_add(StatsObject *stats, PyObject *tag, i64 delta, PyObject *fresh);
int log_reserve(EventLogObject *self);
void log_append(EventLogObject *self, double time, int kind, i64 budget, i64 nbytes,
                PyObject *tag, i64 used, i64 total);

/* -- locks.c ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;
    long count;
} LockObject;

extern PyTypeObject LockType;

/* Take the lock if no other thread holds it: 1 taken (or taken again), 0 held elsewhere. */
static inline int lock_try(LockObject *self) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->count && self->owner == me) {
        self->count++;
        return 1;
    }
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) return 0;
    self->owner = me;
    self->count = 1;
    return 1;
}

static inline void lock_leave(LockObject *self) {
    if (--self->count == 0) {
        self->owner = 0;
        PyThread_release_lock(self->lock);
    }
}

/* -- registry.c --------------------------------------------------------------------------- */

typedef struct {
    PyObject *owner, *tag, *stack; /* owner a new reference; tag and stack NULL for None */
    i64 nbytes;
} Entry;

typedef struct {
    PyObject_HEAD
    i64 *keys; /* address + 1; 0: empty */
    Entry *entries;
    Py_ssize_t cap, len;
} RegistryObject;

extern PyTypeObject RegistryType;

/* The entry of `address`, or NULL. */
static inline Entry *reg_find(const RegistryObject *r, i64 address) {
    if (!r->cap || address == INT64_MAX) return NULL;
    Py_ssize_t j = hash_home(address, r->cap);
    while (r->keys[j]) {
        if (r->keys[j] == address + 1) return &r->entries[j];
        j = (j + 1) & (r->cap - 1);
    }
    return NULL;
}

int reg_reserve(RegistryObject *r, Py_ssize_t more); /* room for `more`, or MemoryError */
void reg_put(RegistryObject *r, i64 address, PyObject *owner, i64 nbytes, PyObject *tag,
             PyObject *stack, Entry *old);
int reg_pop(RegistryObject *r, i64 address, Entry *out);
void entry_release(Entry *e); /* its references */

/* -- tree.c ------------------------------------------------------------------------------- */

/* The names the fast path compares keywords with: once, when the module is made; -1 on
 * error. */
int tree_init(void);
PyObject *py_install(PyObject *module, PyObject *args, PyObject *kwds);

/* -- trace.c ------------------------------------------------------------------------------ */

enum { TRACE_MAX_TEXT = 1024, TRACE_MAX_FRAMES = 512 }; /* tracefile/format.py's MAX_TEXT, MAX_FRAMES */
typedef struct TraceQueueObject TraceQueueObject;
extern PyTypeObject TraceQueueType;
/* The queue of a TraceWriter (writer.py tells its class: trace_writer), when it is a
 * TraceQueue still open; else NULL. */
TraceQueueObject *writer_queue(PyObject *writer);
PyObject *tq_tag_text(TraceQueueObject *q, PyObject *tag); /* borrowed, or NULL: error */
int tq_frames(TraceQueueObject *q, PyObject *stack);         /* -1: error */
void tq_alloc(TraceQueueObject *q, double now, i64 budget, i64 size, i64 align, PyObject *tag,
              i64 ptr, i64 nbytes, PyObject *stack);       /* never fails: lost, counted */
void tq_free(TraceQueueObject *q, double now, i64 budget, i64 ptr);
double tq_now(void); /* time.perf_counter's clock */
PyObject *py_trace_wait(PyObject *module, PyObject *arg);
PyObject *py_trace_writer(PyObject *module, PyObject *cls);

/* -- callers.c ---------------------------------------------------------------------------- */

int callers_install(PyObject *frame_text);
PyObject *user_stack(void); /* a new tuple of str, or NULL with an exception */
PyObject *py_user_stack(PyObject *module, PyObject *unused);

/* -- adapter.c ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    double now;
} ClockObject;

extern PyTypeObject RouterType, ClockType;

#endif
