/* gpubudget's allocation core, the hot path in C.
 *
 * The same rules as the Python modules beside this file (arena.py, ledger.py, recorder.py,
 * tree.py), for what every allocation touches:
 *
 *   Arena     best fit over one address range with coalescing: the smallest free block that
 *             fits, the lowest address among equals; free blocks sorted by (size, start) in
 *             an array, and three hash maps (free start -> size, free end -> start, taken
 *             start -> size), all in units of the granularity.
 *   Account   one budget's limit, reserve, used, peak; refusal() and charge() up the chain of
 *             parents, as ledger.py.
 *   Stats     one budget's counters, as recorder.Stats (its methods stay in Python).
 *   EventLog  a tree's bounded timeline, a ring of C records, read back as tuples.
 *   Lock      a re-entrant lock, the tree's: Python code holds it with `with`; the fast path
 *             takes it without waiting, and leaves to Python when another thread has it.
 *
 * install() puts two methods on Budget, allocate and free: the common case runs here
 * whole, and anything else (a denial, a stream still pending, a growable root, stacks,
 * tracing, an argument that is not a plain int or str) calls the Python method it
 * replaces, which does everything, as in the pure-Python core. The fast path reads the
 * Python objects' __slots__ at offsets looked up once, so both cores share their classes.
 * tests/test_native.py runs both side by side and compares every answer and number.
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

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;
    long count;
} LockObject;

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

typedef struct AccountObject {
    PyObject_HEAD
    PyObject *name, *limit_given, *reserve_given; /* as given; in C at most 2**63 - 1 */
    i64 limit, reserve, used, peak, refusals, depth;
    struct AccountObject *parent;
    char plain;
    PyObject *published; /* a writable buffer of unsigned 64-bit words, or NULL */
    Py_buffer words;
} AccountObject;

typedef struct {
    PyObject_HEAD
    i64 allocations, frees, blocks, peak_blocks, invalid_frees, denied, bytes_allocated,
        bytes_freed;
    PyObject *largest_denied; /* an int: a request may be larger than 64 bits */
    PyObject *denials, *tags, *errors, *retired;
} StatsObject;

enum { KIND_ALLOC, KIND_FREE, KIND_DENY, KINDS };

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

static inline Py_ssize_t reg_slot(const RegistryObject *r, i64 key) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ULL;
    return (Py_ssize_t)(h >> (64 - __builtin_ctzll((uint64_t)r->cap)));
}

/* The entry of `address`, or NULL. */
static inline Entry *reg_find(const RegistryObject *r, i64 address) {
    if (!r->cap || address == INT64_MAX) return NULL;
    Py_ssize_t j = reg_slot(r, address);
    while (r->keys[j]) {
        if (r->keys[j] == address + 1) return &r->entries[j];
        j = (j + 1) & (r->cap - 1);
    }
    return NULL;
}

typedef struct {
    PyObject_HEAD
    double now;
} ClockObject;

typedef struct ArenaObject ArenaObject;
typedef struct EventLogObject EventLogObject;

extern PyTypeObject ArenaType, LockType, AccountType, StatsType, EventLogType, RegistryType,
    RouterType, ClockType;

/* arena.c */
int arena_reserve(ArenaObject *a);
i64 arena_alloc(ArenaObject *a, i64 size, i64 alignment);
i64 arena_free(ArenaObject *a, i64 address);

/* ledger.c */
AccountObject *ledger_refusal(AccountObject *account, i64 delta);
void ledger_charge(AccountObject *account, i64 delta);
PyObject *py_passed_up(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_refusal(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_charge(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_available(PyObject *module, PyObject *arg);

/* recorder.c */
extern PyObject *kind_names[KINDS];
int tag_add(StatsObject *stats, PyObject *tag, i64 delta, PyObject *fresh);
int log_reserve(EventLogObject *self);
void log_append(EventLogObject *self, double time, int kind, i64 budget, i64 nbytes,
                PyObject *tag, i64 used, i64 total);

/* registry.c */
int reg_reserve(RegistryObject *r, Py_ssize_t more);
void reg_put(RegistryObject *r, i64 address, PyObject *owner, i64 nbytes, PyObject *tag,
             PyObject *stack, Entry *old);
int reg_pop(RegistryObject *r, i64 address, Entry *out);
void entry_release(Entry *e);

/* tree.c */
extern PyObject *s_alignment, *s_tag, *s_stream, *s_raise_on_denial, *s_exited;
PyObject *py_install(PyObject *module, PyObject *args, PyObject *kwds);

#endif
