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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef long long i64;

/* ---------------------------------------------------------------------------------------
 * A hash map from i64 (>= 0) to i64: open addressing, linear probing, deletion by backward
 * shift. Keys are stored + 1 so that 0 marks an empty slot.
 */
typedef struct {
    i64 key, value; /* side by side: one probe, one cache line */
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t cap; /* a power of two, or 0 */
    Py_ssize_t len;
} Map;

static inline Py_ssize_t map_slot(const Map *m, i64 key) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ULL; /* Fibonacci hashing: the top bits */
    return (Py_ssize_t)(h >> (64 - __builtin_ctzll((uint64_t)m->cap)));
}

static int map_resize(Map *m, Py_ssize_t cap) {
    Slot *slots = PyMem_Calloc((size_t)cap, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Map old = *m;
    m->slots = slots;
    m->cap = cap;
    for (Py_ssize_t i = 0; i < old.cap; i++) {
        if (old.slots[i].key) {
            Py_ssize_t j = map_slot(m, old.slots[i].key - 1);
            while (slots[j].key) j = (j + 1) & (cap - 1);
            slots[j] = old.slots[i];
        }
    }
    PyMem_Free(old.slots);
    return 0;
}

/* Room for `more` insertions without growing (load at most 1/2): called before a change
 * begins, so that an operation cannot fail half done. */
static int map_reserve(Map *m, Py_ssize_t more) {
    Py_ssize_t need = m->len + more;
    if (m->cap && need * 2 <= m->cap) return 0;
    Py_ssize_t cap = m->cap ? m->cap : 16;
    while (need * 2 > cap) cap *= 2;
    return map_resize(m, cap);
}

static inline int map_get(const Map *m, i64 key, i64 *value) {
    if (!m->cap) return 0;
    Py_ssize_t j = map_slot(m, key);
    while (m->slots[j].key) {
        if (m->slots[j].key == key + 1) {
            *value = m->slots[j].value;
            return 1;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return 0;
}

/* Insert or replace; map_reserve first. */
static inline void map_put(Map *m, i64 key, i64 value) {
    Py_ssize_t j = map_slot(m, key);
    while (m->slots[j].key) {
        if (m->slots[j].key == key + 1) {
            m->slots[j].value = value;
            return;
        }
        j = (j + 1) & (m->cap - 1);
    }
    m->slots[j] = (Slot){key + 1, value};
    m->len++;
}

/* Remove `key`; its value in *value; 0 when absent. */
static inline int map_pop(Map *m, i64 key, i64 *value) {
    if (!m->cap) return 0;
    Py_ssize_t mask = m->cap - 1, j = map_slot(m, key);
    while (m->slots[j].key != key + 1) {
        if (!m->slots[j].key) return 0;
        j = (j + 1) & mask;
    }
    *value = m->slots[j].value;
    /* backward shift: move later entries of the run into the hole where they belong */
    Py_ssize_t hole = j;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->slots[j].key) break;
        Py_ssize_t home = map_slot(m, m->slots[j].key - 1);
        /* the entry at j may move to hole if home is not cyclically in (hole, j] */
        if ((j > hole && (home <= hole || home > j)) || (j < hole && (home <= hole && home > j))) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].key = 0;
    m->len--;
    return 1;
}

static void map_free(Map *m) {
    PyMem_Free(m->slots);
    m->slots = NULL;
    m->cap = m->len = 0;
}

static PyObject *map_to_dict(const Map *m) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (Py_ssize_t i = 0; i < m->cap; i++) {
        if (!m->slots[i].key) continue;
        PyObject *k = PyLong_FromLongLong(m->slots[i].key - 1), *v = PyLong_FromLongLong(m->slots[i].value);
        if (k == NULL || v == NULL || PyDict_SetItem(d, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return d;
}

/* ---------------------------------------------------------------------------------------
 * Arena
 *
 * Free blocks are kept in size classes (two levels, as TLSF: the power of two, then 8 steps
 * within it), each class a small array sorted by (size, start), with a bitmap of the
 * classes that hold any. Every size of a class is above every size of the classes below,
 * so the first key not below (n, -1) is found in n's class or is the first key of the next
 * class that holds any: exactly the block the sorted list of arena.py gives (the smallest
 * that fits, the lowest address among equals), in time that does not grow with the number
 * of free blocks.
 */
typedef struct {
    i64 size, unit;
} Key;

#define SL_BITS 3
#define SL (1 << SL_BITS)
#define FL 64
#define CLASSES (FL * SL)

typedef struct {
    Key *items;
    Py_ssize_t len, cap;
} Bin;

typedef struct {
    PyObject_HEAD
    i64 base, capacity, granularity;
    int shift;
    Bin *bins; /* CLASSES of them */
    uint64_t fl_map;
    uint8_t sl_map[FL];
    Py_ssize_t nkeys;
    Map free_at, free_end, used_at;
} ArenaObject;

static PyTypeObject ArenaType;

static inline int msb(uint64_t v) { return 63 - __builtin_clzll(v); }

static inline int size_class(i64 size) {
    if (size < SL) return (int)size;
    int f = msb((uint64_t)size);
    return (f - SL_BITS + 1) * SL + (int)((size >> (f - SL_BITS)) ^ SL);
}

static inline int key_less(Key a, Key b) {
    return a.size < b.size || (a.size == b.size && a.unit < b.unit);
}

static inline Py_ssize_t bin_lower(const Bin *bin, Key k) {
    Py_ssize_t lo = 0, hi = bin->len;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if (key_less(bin->items[mid], k)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The first class from `c` on that holds a key, or -1. */
static inline int class_from(const ArenaObject *a, int c) {
    if (c >= CLASSES) return -1;
    int fl = c / SL, sl = c % SL;
    unsigned here = a->sl_map[fl] & (0xFFu << sl) & 0xFFu;
    if (here) return fl * SL + __builtin_ctz(here);
    uint64_t above = fl + 1 < FL ? a->fl_map & (~0ULL << (fl + 1)) : 0;
    if (!above) return -1;
    fl = __builtin_ctzll(above);
    return fl * SL + __builtin_ctz(a->sl_map[fl]);
}

/* Room in the class of `size` for `n` more keys: -1 (MemoryError) before anything changes. */
static int bin_room(ArenaObject *a, i64 size, Py_ssize_t n) {
    Bin *bin = &a->bins[size_class(size)];
    if (bin->len + n <= bin->cap) return 0;
    Py_ssize_t cap = bin->cap ? bin->cap * 2 : 8;
    while (cap < bin->len + n) cap *= 2;
    Key *items = PyMem_Realloc(bin->items, (size_t)cap * sizeof(Key));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    bin->items = items;
    bin->cap = cap;
    return 0;
}

static inline void keys_insert(ArenaObject *a, i64 size, i64 unit) { /* bin_room first */
    Key k = {size, unit};
    int c = size_class(size);
    Bin *bin = &a->bins[c];
    Py_ssize_t i = bin_lower(bin, k);
    memmove(bin->items + i + 1, bin->items + i, (size_t)(bin->len - i) * sizeof(Key));
    bin->items[i] = k;
    bin->len++;
    a->sl_map[c / SL] |= (uint8_t)(1u << (c % SL));
    a->fl_map |= 1ULL << (c / SL);
    a->nkeys++;
}

static inline void keys_delete_at(ArenaObject *a, int c, Py_ssize_t i) {
    Bin *bin = &a->bins[c];
    memmove(bin->items + i, bin->items + i + 1, (size_t)(bin->len - i - 1) * sizeof(Key));
    if (--bin->len == 0) {
        a->sl_map[c / SL] &= (uint8_t)~(1u << (c % SL));
        if (!a->sl_map[c / SL]) a->fl_map &= ~(1ULL << (c / SL));
    }
    a->nkeys--;
}

static inline void keys_remove(ArenaObject *a, i64 size, i64 unit) {
    Key k = {size, unit};
    int c = size_class(size);
    keys_delete_at(a, c, bin_lower(&a->bins[c], k));
}

/* Room in the maps for what one operation may add: two free blocks and one taken block. */
static int arena_reserve(ArenaObject *a) {
    if (map_reserve(&a->free_at, 2) < 0 || map_reserve(&a->free_end, 2) < 0 ||
        map_reserve(&a->used_at, 1) < 0)
        return -1;
    return 0;
}

/* The address of a block of `size` bytes; -1 when none fits, -2 (MemoryError) when there is
 * no memory for the bookkeeping (nothing changed). arena_reserve first. */
static i64 arena_alloc(ArenaObject *a, i64 size, i64 alignment) {
    int shift = a->shift;
    i64 need = size >> shift;
    Key probe = {need, -1};
    int c = need < 1 ? 0 : size_class(need);
    Py_ssize_t i = c < CLASSES ? bin_lower(&a->bins[c], probe) : 0;
    if (c >= CLASSES) return -1;
    if (i == a->bins[c].len) {
        c = class_from(a, c + 1);
        if (c < 0) return -1;
        i = 0;
    }
    Key key = a->bins[c].items[i];
    i64 unit = key.unit, pad = 0;
    if (alignment > a->granularity) {
        pad = ((-(a->base + (unit << shift))) & (alignment - 1)) >> shift;
        if (pad && key.size < need + pad) {
            /* walk up the sizes to the first block that fits with its padding */
            for (;;) {
                if (++i == a->bins[c].len) {
                    c = class_from(a, c + 1);
                    if (c < 0) return -1;
                    i = 0;
                }
                key = a->bins[c].items[i];
                unit = key.unit;
                pad = ((-(a->base + (unit << shift))) & (alignment - 1)) >> shift;
                if (key.size >= need + pad) break;
            }
        }
    }
    i64 block = key.size, rest = block - pad - need, ignored;
    if (pad && rest && size_class(pad) == size_class(rest)) {
        if (bin_room(a, pad, 2) < 0) return -2;
    } else if ((pad && bin_room(a, pad, 1) < 0) || (rest && bin_room(a, rest, 1) < 0)) {
        return -2;
    }
    keys_delete_at(a, c, i);
    map_pop(&a->free_at, unit, &ignored);
    i64 end = unit + block;
    if (pad) {
        keys_insert(a, pad, unit);
        map_put(&a->free_at, unit, pad);
        map_put(&a->free_end, unit + pad, unit);
        unit += pad;
    }
    if (rest) {
        i64 start = unit + need;
        keys_insert(a, rest, start);
        map_put(&a->free_at, start, rest);
        map_put(&a->free_end, end, start);
    } else {
        map_pop(&a->free_end, end, &ignored);
    }
    map_put(&a->used_at, unit, need);
    return a->base + (unit << shift);
}

static inline i64 arena_unit(const ArenaObject *a, i64 address) {
    i64 offset = address - a->base;
    if (offset < 0 || (offset & (a->granularity - 1))) return -1;
    return offset >> a->shift;
}

/* Return `size` units at `unit` to the free blocks, merging neighbours; -1 (MemoryError)
 * with nothing changed. arena_reserve first. */
static int arena_release(ArenaObject *a, i64 unit, i64 size) {
    i64 end = unit + size, following = 0, start = -1, preceding = 0, ignored;
    map_get(&a->free_at, end, &following);
    if (map_get(&a->free_end, unit, &start)) map_get(&a->free_at, start, &preceding);
    else start = -1;
    if (bin_room(a, size + following + preceding, 1) < 0) return -1;
    if (following) {
        keys_remove(a, following, end);
        map_pop(&a->free_at, end, &ignored);
        map_pop(&a->free_end, end + following, &ignored);
        size += following;
    }
    if (start >= 0) {
        keys_remove(a, preceding, start);
        map_pop(&a->free_at, start, &ignored);
        map_pop(&a->free_end, unit, &ignored);
        unit = start;
        size += preceding;
    }
    keys_insert(a, size, unit);
    map_put(&a->free_at, unit, size);
    map_put(&a->free_end, unit + size, unit);
    return 0;
}

/* Free the block at `address`: its size in bytes, 0 when no block starts there, -1
 * (MemoryError) with nothing changed. arena_reserve first. */
static i64 arena_free(ArenaObject *a, i64 address) {
    i64 unit = arena_unit(a, address), size = 0, ignored;
    if (unit < 0 || !map_get(&a->used_at, unit, &size) || !size) return 0;
    if (arena_release(a, unit, size) < 0) return -1;
    map_pop(&a->used_at, unit, &ignored);
    return size << a->shift;
}

static void arena_add_free(ArenaObject *a, i64 unit, i64 size) { /* bin_room first */
    keys_insert(a, size, unit);
    map_put(&a->free_at, unit, size);
    map_put(&a->free_end, unit + size, unit);
}

static void arena_remove_free(ArenaObject *a, i64 unit, i64 size) {
    i64 ignored;
    keys_remove(a, size, unit);
    map_pop(&a->free_at, unit, &ignored);
    map_pop(&a->free_end, unit + size, &ignored);
}

static int is_power_of_two(i64 v) { return v > 0 && (v & (v - 1)) == 0; }

/* A Python int as i64; *ok = 0 when it is not one that fits (no error set). */
static i64 as_i64(PyObject *value, int *ok) {
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

static int Arena_init(ArenaObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"base", "capacity", "granularity", NULL};
    i64 base, capacity, granularity = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL|L:Arena", names, &base, &capacity,
                                     &granularity))
        return -1;
    if (!is_power_of_two(granularity)) {
        PyErr_Format(PyExc_ValueError, "granularity must be a power of two, got %lld", granularity);
        return -1;
    }
    if (base < 0 || base % granularity) {
        char hex[40]; /* PyErr_Format has no %#llx */
        snprintf(hex, sizeof hex, base < 0 ? "-%#llx" : "%#llx",
                 (unsigned long long)(base < 0 ? -base : base));
        PyErr_Format(PyExc_ValueError, "base %s is not a multiple of granularity %lld", hex,
                     granularity);
        return -1;
    }
    if (capacity <= 0 || capacity % granularity || base > INT64_MAX - capacity) {
        PyErr_Format(PyExc_ValueError,
                     "capacity %lld is not a positive multiple of granularity %lld", capacity,
                     granularity);
        return -1;
    }
    if (self->bins) {
        PyErr_SetString(PyExc_RuntimeError, "Arena initialised twice");
        return -1;
    }
    if ((self->bins = PyMem_Calloc(CLASSES, sizeof(Bin))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->base = base;
    self->capacity = capacity;
    self->granularity = granularity;
    self->shift = 0;
    while (((i64)1 << self->shift) < granularity) self->shift++;
    if (arena_reserve(self) < 0 || bin_room(self, capacity >> self->shift, 1) < 0) return -1;
    arena_add_free(self, 0, capacity >> self->shift);
    return 0;
}

static void Arena_dealloc(ArenaObject *self) {
    if (self->bins != NULL)
        for (int c = 0; c < CLASSES; c++) PyMem_Free(self->bins[c].items);
    PyMem_Free(self->bins);
    map_free(&self->free_at);
    map_free(&self->free_end);
    map_free(&self->used_at);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Arena_allocate(ArenaObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    static const char *const names[] = {"size", "alignment"};
    PyObject *values[2] = {NULL, NULL};
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 2) return PyErr_Format(PyExc_TypeError, "allocate() takes at most 2 arguments");
    for (Py_ssize_t i = 0; i < nargs; i++) values[i] = args[i];
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int found = 0;
        for (int j = 0; j < 2; j++) {
            if (PyUnicode_CompareWithASCIIString(name, names[j]) == 0) {
                if (values[j]) return PyErr_Format(PyExc_TypeError, "allocate() got %R twice", name);
                values[j] = args[nargs + i];
                found = 1;
            }
        }
        if (!found) return PyErr_Format(PyExc_TypeError, "allocate() got an unexpected keyword %R", name);
    }
    if (!values[0]) return PyErr_Format(PyExc_TypeError, "allocate() missing 'size'");
    int ok = 1, ok2 = 1;
    i64 size = as_i64(values[0], &ok), alignment = values[1] ? as_i64(values[1], &ok2) : 0;
    if (!ok || !ok2 || size <= 0) Py_RETURN_NONE; /* nothing that large fits */
    if (arena_reserve(self) < 0) return NULL;
    i64 address = arena_alloc(self, size, alignment);
    if (address == -2) return NULL;
    if (address < 0) Py_RETURN_NONE;
    return PyLong_FromLongLong(address);
}

static PyObject *Arena_free(ArenaObject *self, PyObject *address) {
    int ok;
    i64 at = as_i64(address, &ok);
    if (!ok) return PyLong_FromLong(0);
    i64 size;
    if (arena_reserve(self) < 0 || (size = arena_free(self, at)) < 0) return NULL;
    return PyLong_FromLongLong(size);
}

static PyObject *Arena_resize(ArenaObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "resize() takes 2 arguments");
    int ok, ok2;
    i64 address = as_i64(args[0], &ok), new_size = as_i64(args[1], &ok2);
    i64 unit = ok ? arena_unit(self, address) : -1, size = 0;
    if (unit < 0 || !map_get(&self->used_at, unit, &size) || !size || !ok2) Py_RETURN_FALSE;
    if (arena_reserve(self) < 0) return NULL;
    i64 need = new_size >> self->shift;
    if (need < 1) Py_RETURN_FALSE;
    if (need < size) {
        if (arena_release(self, unit + need, size - need) < 0) return NULL;
        map_put(&self->used_at, unit, need);
        Py_RETURN_TRUE;
    }
    if (need == size) Py_RETURN_TRUE;
    i64 end = unit + size, following = 0;
    map_get(&self->free_at, end, &following);
    if (following < need - size) Py_RETURN_FALSE;
    i64 remainder = following - (need - size);
    if (remainder && bin_room(self, remainder, 1) < 0) return NULL;
    arena_remove_free(self, end, following);
    if (remainder) arena_add_free(self, unit + need, remainder);
    map_put(&self->used_at, unit, need);
    Py_RETURN_TRUE;
}

static PyObject *Arena_state(ArenaObject *self, PyObject *unused) {
    PyObject *keys = PyList_New(self->nkeys), *free_at = NULL, *free_end = NULL, *used_at = NULL;
    if (keys == NULL) return NULL;
    Py_ssize_t n = 0;
    for (int c = 0; c < CLASSES; c++) {
        for (Py_ssize_t i = 0; i < self->bins[c].len; i++) {
            Key k = self->bins[c].items[i];
            PyObject *pair = Py_BuildValue("(LL)", k.size, k.unit);
            if (pair == NULL) goto fail;
            PyList_SET_ITEM(keys, n++, pair);
        }
    }
    if ((free_at = map_to_dict(&self->free_at)) == NULL) goto fail;
    if ((free_end = map_to_dict(&self->free_end)) == NULL) goto fail;
    if ((used_at = map_to_dict(&self->used_at)) == NULL) goto fail;
    return Py_BuildValue("(NNNN)", keys, free_at, free_end, used_at);
fail:
    Py_DECREF(keys);
    Py_XDECREF(free_at);
    Py_XDECREF(free_end);
    return NULL;
}

static i64 free_units(const ArenaObject *self) {
    i64 total = 0;
    for (int c = 0; c < CLASSES; c++)
        for (Py_ssize_t i = 0; i < self->bins[c].len; i++) total += self->bins[c].items[i].size;
    return total;
}

static PyObject *Arena_get_free_bytes(ArenaObject *self, void *closure) {
    return PyLong_FromLongLong(free_units(self) << self->shift);
}

static PyObject *Arena_get_used_bytes(ArenaObject *self, void *closure) {
    return PyLong_FromLongLong(self->capacity - (free_units(self) << self->shift));
}

static PyObject *Arena_get_largest_free(ArenaObject *self, void *closure) {
    if (!self->fl_map) return PyLong_FromLong(0);
    int fl = msb(self->fl_map), c = fl * SL + msb(self->sl_map[fl]);
    return PyLong_FromLongLong(self->bins[c].items[self->bins[c].len - 1].size << self->shift);
}

static PyObject *Arena_get_blocks(ArenaObject *self, void *closure) {
    return PyLong_FromSsize_t(self->used_at.len);
}

static PyObject *Arena_get_free_blocks(ArenaObject *self, void *closure) {
    return PyLong_FromSsize_t(self->nkeys);
}

static PyMethodDef Arena_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Arena_allocate, METH_FASTCALL | METH_KEYWORDS,
     "The address of a block of ``size`` bytes, or ``None`` if none fits."},
    {"free", (PyCFunction)Arena_free, METH_O,
     "Free the block at ``address``; its size, or 0 if no block starts there."},
    {"resize", (PyCFunction)(void (*)(void))Arena_resize, METH_FASTCALL,
     "Grow or shrink the block at ``address`` in place; ``False`` when it cannot."},
    {"_state", (PyCFunction)Arena_state, METH_NOARGS,
     "(free keys as (size, unit) pairs in order, free start -> size, free end -> start, "
     "taken start -> size), in units."},
    {NULL}};

static PyMemberDef Arena_members[] = {
    {"base", T_LONGLONG, offsetof(ArenaObject, base), READONLY, NULL},
    {"capacity", T_LONGLONG, offsetof(ArenaObject, capacity), READONLY, NULL},
    {"granularity", T_LONGLONG, offsetof(ArenaObject, granularity), READONLY, NULL},
    {"_shift", T_INT, offsetof(ArenaObject, shift), READONLY, NULL},
    {NULL}};

static PyGetSetDef Arena_getset[] = {
    {"free_bytes", (getter)Arena_get_free_bytes, NULL, "Bytes in free blocks.", NULL},
    {"used_bytes", (getter)Arena_get_used_bytes, NULL, "Bytes in allocated blocks.", NULL},
    {"largest_free", (getter)Arena_get_largest_free, NULL, "Size of the largest free block.", NULL},
    {"blocks", (getter)Arena_get_blocks, NULL, "Allocated blocks.", NULL},
    {"free_blocks", (getter)Arena_get_free_blocks, NULL, "Free blocks.", NULL},
    {NULL}};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Arena",
    .tp_basicsize = sizeof(ArenaObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Best-fit placement over [base, base + capacity); see arena.py.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Arena_init,
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_methods = Arena_methods,
    .tp_members = Arena_members,
    .tp_getset = Arena_getset,
};

/* ---------------------------------------------------------------------------------------
 * Lock: re-entrant, owned by a thread.
 */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;
    long count;
} LockObject;

static PyTypeObject LockType;

static PyObject *Lock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    LockObject *self = (LockObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void Lock_dealloc(LockObject *self) {
    if (self->lock != NULL) {
        if (self->count) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

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

static PyObject *Lock_acquire(LockObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    if (!blocking && timeout != -1) { /* as threading.RLock says */
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout != -1 && !(timeout >= 0)) { /* NaN too */
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout != -1 && timeout * 1e6 >= (double)PY_TIMEOUT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    if (lock_try(self)) Py_RETURN_TRUE;
    if (!blocking) Py_RETURN_FALSE;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    PY_TIMEOUT_T micros = timeout < 0 ? -1 : (PY_TIMEOUT_T)(timeout * 1e6);
    PyLockStatus status;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        status = PyThread_acquire_lock_timed(self->lock, micros, 1);
        Py_END_ALLOW_THREADS
        if (status != PY_LOCK_INTR) break;
        if (Py_MakePendingCalls() < 0) return NULL; /* a signal handler raised */
        if (micros > 0) { /* wait only what is left of the timeout */
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            double spent = (double)(now.tv_sec - start.tv_sec) * 1e6 +
                           (double)(now.tv_nsec - start.tv_nsec) / 1e3;
            double left = timeout * 1e6 - spent;
            micros = left > 0 ? (PY_TIMEOUT_T)left : 0;
        }
    }
    if (status != PY_LOCK_ACQUIRED) Py_RETURN_FALSE;
    self->owner = PyThread_get_thread_ident();
    self->count = 1;
    Py_RETURN_TRUE;
}

static PyObject *Lock_release(LockObject *self, PyObject *unused) {
    if (!self->count || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    lock_leave(self);
    Py_RETURN_NONE;
}

static PyObject *Lock_exit(LockObject *self, PyObject *args) { return Lock_release(self, NULL); }

static PyObject *Lock_is_owned(LockObject *self, PyObject *unused) {
    return PyBool_FromLong(self->count && self->owner == PyThread_get_thread_ident());
}

static PyObject *Lock_locked(LockObject *self, PyObject *unused) {
    return PyBool_FromLong(self->count != 0);
}

static PyObject *Lock_at_fork_reinit(LockObject *self, PyObject *unused) {
    /* In a forked child: the thread that held the lock does not exist here. The old lock
     * may be held: it is left, not freed (freeing a held lock is undefined). */
    PyThread_type_lock lock = PyThread_allocate_lock();
    if (lock == NULL) return PyErr_NoMemory();
    self->lock = lock;
    self->owner = 0;
    self->count = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Lock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): take the lock (again, if this thread holds it)."},
    {"release", (PyCFunction)Lock_release, METH_NOARGS, "Give the lock back once."},
    {"__enter__", (PyCFunction)(void (*)(void))Lock_acquire, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__exit__", (PyCFunction)Lock_exit, METH_VARARGS, NULL},
    {"_is_owned", (PyCFunction)Lock_is_owned, METH_NOARGS, "Whether this thread holds it."},
    {"locked", (PyCFunction)Lock_locked, METH_NOARGS, "Whether some thread holds it."},
    {"_at_fork_reinit", (PyCFunction)Lock_at_fork_reinit, METH_NOARGS,
     "In a forked child: a fresh, free lock."},
    {NULL}};

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Lock",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A re-entrant lock (a tree's): threading.RLock's interface, and a fast path in C.",
    .tp_new = Lock_new,
    .tp_dealloc = (destructor)Lock_dealloc,
    .tp_methods = Lock_methods,
};

/* ---------------------------------------------------------------------------------------
 * Account and the ledger (ledger.py has the rules in words).
 */
typedef struct AccountObject {
    PyObject_HEAD
    PyObject *name, *limit_given, *reserve_given; /* as given; in C at most 2**63 - 1 */
    i64 limit, reserve, used, peak, refusals, depth;
    struct AccountObject *parent;
    char plain;
    PyObject *published; /* a writable buffer of unsigned 64-bit words, or NULL */
    Py_buffer words;
} AccountObject;

static PyTypeObject AccountType;

static int Account_init(AccountObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"name", "limit", "reserve", "parent", NULL};
    PyObject *name, *limit, *reserve = NULL, *parent = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OO:Account", names, &name, &limit, &reserve,
                                     &parent))
        return -1;
    if (self->name != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Account initialised twice");
        return -1;
    }
    if (parent != Py_None && !PyObject_TypeCheck(parent, &AccountType)) {
        PyErr_Format(PyExc_TypeError, "parent must be an Account or None, got %R", parent);
        return -1;
    }
    if (reserve == NULL) reserve = PyLong_FromLong(0);
    else Py_INCREF(reserve);
    if (reserve == NULL) return -1;
    if (!PyLong_Check(limit) || !PyLong_Check(reserve) ||
        PyObject_RichCompareBool(limit, Py_False, Py_LT) ||
        PyObject_RichCompareBool(reserve, Py_False, Py_LT)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "limit %R and reserve %R must be bytes, 0 or more", limit,
                     reserve);
        Py_DECREF(reserve);
        return -1;
    }
    int ok = 1, ok2 = 1; /* beyond 64 bits: more than any request that can be granted */
    i64 lim = as_i64(limit, &ok), res = as_i64(reserve, &ok2);
    Py_INCREF(name);
    self->name = name;
    Py_INCREF(limit);
    self->limit_given = limit;
    self->reserve_given = reserve;
    lim = ok ? lim : INT64_MAX;
    res = ok2 ? res : INT64_MAX;
    self->limit = lim;
    self->reserve = res;
    if (parent != Py_None) {
        Py_INCREF(parent);
        self->parent = (AccountObject *)parent;
        self->depth = self->parent->depth + 1;
        self->plain = res == 0 && self->parent->plain;
    } else {
        self->plain = res == 0;
    }
    return 0;
}

static void account_unpublish(AccountObject *self) {
    if (self->published != NULL) {
        PyBuffer_Release(&self->words);
        Py_CLEAR(self->published);
    }
}

static int Account_traverse(AccountObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->parent);
    Py_VISIT(self->published);
    return 0;
}

static int Account_clear(AccountObject *self) {
    account_unpublish(self);
    Py_CLEAR(self->parent);
    return 0;
}

static void Account_dealloc(AccountObject *self) {
    PyObject_GC_UnTrack(self);
    Account_clear(self);
    Py_CLEAR(self->name);
    Py_CLEAR(self->limit_given);
    Py_CLEAR(self->reserve_given);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void account_publish(AccountObject *a) {
    if (a->published != NULL) {
        uint64_t *words = (uint64_t *)a->words.buf;
        words[0] = (uint64_t)a->used;
        if (a->used == a->peak) words[1] = (uint64_t)a->used;
    }
}

static PyObject *Account_get_published(AccountObject *self, void *closure) {
    PyObject *value = self->published ? self->published : Py_None;
    Py_INCREF(value);
    return value;
}

static int Account_set_published(AccountObject *self, PyObject *value, void *closure) {
    if (value == NULL || value == Py_None) {
        account_unpublish(self);
        return 0;
    }
    Py_buffer words;
    if (PyObject_GetBuffer(value, &words, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (words.itemsize != 8 || words.len < 16 || words.format == NULL ||
        strcmp(words.format, "Q") != 0) {
        PyBuffer_Release(&words);
        PyErr_SetString(PyExc_ValueError, "published must be unsigned 64-bit words ('Q'), 2 at least");
        return -1;
    }
    account_unpublish(self);
    Py_INCREF(value);
    self->published = value;
    self->words = words;
    return 0;
}

static inline i64 passed_up(const AccountObject *a, i64 used) {
    return used > a->reserve ? used : a->reserve;
}

/* What ledger_refusal answers when 64 bits cannot tell: a limit given beyond them (kept as
 * INT64_MAX here) that used + delta passes; exact_refusal decides with Python ints. */
#define UNDECIDED ((AccountObject *)1)

/* Whether `delta` more bytes take `link` over its limit: 1 yes, 0 no, -1 undecided. */
static inline int over(const AccountObject *link, i64 delta) {
    if (delta <= 0) return link->used + delta > link->limit; /* used >= 0: no overflow */
    if (link->used <= link->limit - delta) return 0;
    return link->limit == INT64_MAX && link->used > INT64_MAX - delta ? -1 : 1;
}

/* The first account up the chain whose limit `delta` more bytes would exceed, NULL when all
 * of them can take it, or UNDECIDED. */
static AccountObject *ledger_refusal(AccountObject *account, i64 delta) {
    if (account->plain) {
        for (AccountObject *link = account; link != NULL; link = link->parent) {
            int o = over(link, delta);
            if (o) return o > 0 ? link : UNDECIDED;
        }
        return NULL;
    }
    AccountObject *node = account;
    while (node != NULL && delta > 0) {
        int o = over(node, delta);
        if (o) return o > 0 ? node : UNDECIDED;
        i64 used = node->used + delta;
        if (node->reserve) delta = passed_up(node, used) - passed_up(node, node->used);
        node = node->parent;
    }
    return NULL;
}

/* ledger_refusal in Python ints, with the limits and reserves as given: for requests and
 * limits beyond 64 bits (never on the fast path). A new reference, or NULL with an error. */
static PyObject *exact_refusal(AccountObject *account, PyObject *delta) {
    Py_INCREF(delta);
    for (AccountObject *node = account; node != NULL; node = node->parent) {
        int positive = PyObject_RichCompareBool(delta, Py_False, Py_GT);
        if (positive < 0) goto error;
        if (!account->plain && !positive) break; /* a floor passes nothing more up */
        PyObject *used = PyLong_FromLongLong(node->used);
        PyObject *sum = used ? PyNumber_Add(used, delta) : NULL;
        int exceeds = sum ? PyObject_RichCompareBool(sum, node->limit_given, Py_GT) : -1;
        if (exceeds != 0) {
            Py_XDECREF(used);
            Py_XDECREF(sum);
            if (exceeds < 0) goto error;
            Py_DECREF(delta);
            Py_INCREF(node);
            return (PyObject *)node;
        }
        if (!account->plain && node->reserve) { /* only what rises above the floor goes up */
            PyObject *after = PyNumber_Check(sum) ? PyObject_RichCompareBool(sum, node->reserve_given, Py_GT) > 0 ? sum : node->reserve_given : NULL;
            PyObject *before = PyObject_RichCompareBool(used, node->reserve_given, Py_GT) > 0 ? used : node->reserve_given;
            PyObject *next = after ? PyNumber_Subtract(after, before) : NULL;
            Py_DECREF(used);
            Py_DECREF(sum);
            if (next == NULL) goto error;
            Py_SETREF(delta, next);
            continue;
        }
        Py_DECREF(used);
        Py_DECREF(sum);
    }
    Py_DECREF(delta);
    Py_RETURN_NONE;
error:
    Py_DECREF(delta);
    return NULL;
}

static void ledger_charge(AccountObject *account, i64 delta) {
    if (account->plain) {
        for (AccountObject *link = account; link != NULL; link = link->parent) {
            i64 used = link->used += delta;
            if (used > link->peak) link->peak = used;
            if (link->parent == NULL) account_publish(link);
        }
        return;
    }
    AccountObject *node = account;
    while (node != NULL && delta) {
        i64 old = node->used, used = node->used = old + delta;
        if (used > node->peak) node->peak = used;
        account_publish(node);
        if (node->reserve) delta = passed_up(node, used) - passed_up(node, old);
        node = node->parent;
    }
}

static AccountObject *as_account(PyObject *value) {
    if (!PyObject_TypeCheck(value, &AccountType)) {
        PyErr_Format(PyExc_TypeError, "expected an Account, got %R", value);
        return NULL;
    }
    return (AccountObject *)value;
}

static int arg_i64(PyObject *value, i64 *out) {
    int ok;
    *out = as_i64(value, &ok);
    if (!ok) PyErr_Format(PyExc_OverflowError, "%R is not a byte count from -2**63 to 2**63 - 1", value);
    return ok ? 0 : -1;
}

static PyObject *py_passed_up(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    i64 used;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "passed_up(account, used)");
    AccountObject *a = as_account(args[0]);
    if (a == NULL) return NULL;
    int ok;
    used = as_i64(args[1], &ok);
    if (!ok) { /* beyond 64 bits: above the reserve when positive */
        if (!PyLong_Check(args[1])) return PyErr_Format(PyExc_TypeError, "used must be an int");
        int sign = PyObject_RichCompareBool(args[1], Py_False, Py_GT);
        if (sign < 0) return NULL;
        if (sign) {
            Py_INCREF(args[1]);
            return args[1];
        }
        return PyLong_FromLongLong(a->reserve);
    }
    return PyLong_FromLongLong(passed_up(a, used));
}

static PyObject *py_refusal(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    i64 delta;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "refusal(account, delta)");
    AccountObject *a = as_account(args[0]);
    if (a == NULL) return NULL;
    if (!PyLong_Check(args[1])) return PyErr_Format(PyExc_TypeError, "delta must be an int");
    int ok;
    delta = as_i64(args[1], &ok);
    AccountObject *refused = ok ? ledger_refusal(a, delta) : UNDECIDED;
    if (refused == UNDECIDED) return exact_refusal(a, args[1]);
    PyObject *result = refused ? (PyObject *)refused : Py_None;
    Py_INCREF(result);
    return result;
}

static PyObject *py_charge(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    i64 delta;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "charge(account, delta)");
    AccountObject *a = as_account(args[0]);
    if (a == NULL || arg_i64(args[1], &delta) < 0) return NULL;
    ledger_charge(a, delta);
    Py_RETURN_NONE;
}

static PyObject *py_available(PyObject *module, PyObject *arg) {
    AccountObject *account = as_account(arg);
    if (account == NULL) return NULL;
    i64 best = account->limit - account->used, slack = 0;
    for (AccountObject *link = account; link->parent != NULL; link = link->parent) {
        slack += link->reserve > link->used ? link->reserve - link->used : 0;
        AccountObject *parent = link->parent;
        i64 here = parent->limit - parent->used + slack;
        if (here < best) best = here;
    }
    return PyLong_FromLongLong(best > 0 ? best : 0);
}

static PyObject *Account_get_parent(AccountObject *self, void *closure) {
    PyObject *value = self->parent ? (PyObject *)self->parent : Py_None;
    Py_INCREF(value);
    return value;
}

static PyObject *Account_get_plain(AccountObject *self, void *closure) {
    return PyBool_FromLong(self->plain);
}

static PyMemberDef Account_members[] = {
    {"name", T_OBJECT_EX, offsetof(AccountObject, name), READONLY, NULL},
    {"limit", T_OBJECT_EX, offsetof(AccountObject, limit_given), READONLY, NULL},
    {"reserve", T_OBJECT_EX, offsetof(AccountObject, reserve_given), READONLY, NULL},
    {"used", T_LONGLONG, offsetof(AccountObject, used), 0, NULL},
    {"peak", T_LONGLONG, offsetof(AccountObject, peak), 0, NULL},
    {"refusals", T_LONGLONG, offsetof(AccountObject, refusals), 0, NULL},
    {"depth", T_LONGLONG, offsetof(AccountObject, depth), READONLY, NULL},
    {NULL}};

static PyGetSetDef Account_getset[] = {
    {"parent", (getter)Account_get_parent, NULL, NULL, NULL},
    {"plain", (getter)Account_get_plain, NULL, NULL, NULL},
    {"published", (getter)Account_get_published, (setter)Account_set_published, NULL, NULL},
    {NULL}};

static PyTypeObject AccountType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Account",
    .tp_basicsize = sizeof(AccountObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One budget's limit, reserve floor, bytes charged now and their peak; see ledger.py.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Account_init,
    .tp_dealloc = (destructor)Account_dealloc,
    .tp_traverse = (traverseproc)Account_traverse,
    .tp_clear = (inquiry)Account_clear,
    .tp_members = Account_members,
    .tp_getset = Account_getset,
};

/* ---------------------------------------------------------------------------------------
 * Stats: a budget's counters (the methods are recorder.py's, on a Python subclass).
 */
typedef struct {
    PyObject_HEAD
    i64 allocations, frees, blocks, peak_blocks, invalid_frees, denied, bytes_allocated,
        bytes_freed;
    PyObject *largest_denied; /* an int: a request may be larger than 64 bits */
    PyObject *denials, *tags, *errors, *retired;
} StatsObject;

static PyTypeObject StatsType;

static int Stats_init(StatsObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"errors", NULL};
    PyObject *errors;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Stats", names, &errors)) return -1;
    PyObject *denials = PyDict_New(), *tags = PyDict_New(), *retired = Py_BuildValue("[iiiii]", 0, 0, 0, 0, 0);
    PyObject *largest = PyLong_FromLong(0);
    if (denials == NULL || tags == NULL || retired == NULL || largest == NULL) {
        Py_XDECREF(largest);
        Py_XDECREF(denials);
        Py_XDECREF(tags);
        Py_XDECREF(retired);
        return -1;
    }
    Py_INCREF(errors);
    Py_XSETREF(self->errors, errors);
    Py_XSETREF(self->denials, denials);
    Py_XSETREF(self->tags, tags);
    Py_XSETREF(self->retired, retired);
    Py_XSETREF(self->largest_denied, largest);
    return 0;
}

static int Stats_traverse(StatsObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->denials);
    Py_VISIT(self->tags);
    Py_VISIT(self->errors);
    Py_VISIT(self->retired);
    return 0;
}

static int Stats_clear(StatsObject *self) {
    Py_CLEAR(self->denials);
    Py_CLEAR(self->tags);
    Py_CLEAR(self->errors);
    Py_CLEAR(self->retired);
    Py_CLEAR(self->largest_denied);
    return 0;
}

static void Stats_dealloc(StatsObject *self) {
    PyObject_GC_UnTrack(self);
    Stats_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Stats_members[] = {
    {"allocations", T_LONGLONG, offsetof(StatsObject, allocations), 0, NULL},
    {"frees", T_LONGLONG, offsetof(StatsObject, frees), 0, NULL},
    {"blocks", T_LONGLONG, offsetof(StatsObject, blocks), 0, NULL},
    {"peak_blocks", T_LONGLONG, offsetof(StatsObject, peak_blocks), 0, NULL},
    {"invalid_frees", T_LONGLONG, offsetof(StatsObject, invalid_frees), 0, NULL},
    {"denied", T_LONGLONG, offsetof(StatsObject, denied), 0, NULL},
    {"bytes_allocated", T_LONGLONG, offsetof(StatsObject, bytes_allocated), 0, NULL},
    {"bytes_freed", T_LONGLONG, offsetof(StatsObject, bytes_freed), 0, NULL},
    {"largest_denied", T_OBJECT_EX, offsetof(StatsObject, largest_denied), 0, NULL},
    {"denials", T_OBJECT_EX, offsetof(StatsObject, denials), 0, NULL},
    {"tags", T_OBJECT_EX, offsetof(StatsObject, tags), 0, NULL},
    {"errors", T_OBJECT_EX, offsetof(StatsObject, errors), 0, NULL},
    {"retired", T_OBJECT_EX, offsetof(StatsObject, retired), 0, NULL},
    {NULL}};

static PyTypeObject StatsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Stats",
    .tp_basicsize = sizeof(StatsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A budget's counters; see recorder.Stats.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Stats_init,
    .tp_dealloc = (destructor)Stats_dealloc,
    .tp_traverse = (traverseproc)Stats_traverse,
    .tp_clear = (inquiry)Stats_clear,
    .tp_members = Stats_members,
};

/* tags[tag] = [live, peak]: `delta` more live bytes (may be negative). A tag seen for the
 * first time takes `fresh` (a list of two, made by the caller before anything was read:
 * making a list may start the collector, whose finalizers run Python code). -1 on error,
 * nothing changed. Creates no object the collector tracks. */
static int tag_add(StatsObject *stats, PyObject *tag, i64 delta, PyObject *fresh) {
    PyObject *entry = PyDict_GetItemWithError(stats->tags, tag);
    if (entry == NULL) {
        if (PyErr_Occurred()) return -1;
        if (fresh == NULL || !PyList_CheckExact(fresh) || PyList_GET_SIZE(fresh) != 2) {
            PyErr_SetString(PyExc_SystemError, "a new tag without its list");
            return -1;
        }
        PyObject *live = PyLong_FromLongLong(delta), *peak = PyLong_FromLongLong(delta);
        if (live == NULL || peak == NULL) {
            Py_XDECREF(live);
            Py_XDECREF(peak);
            return -1;
        }
        PyList_SetItem(fresh, 0, live);
        PyList_SetItem(fresh, 1, peak);
        return PyDict_SetItem(stats->tags, tag, fresh);
    }
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "a tag's entry is not [live, peak]");
        return -1;
    }
    int ok, ok2;
    i64 live = as_i64(PyList_GET_ITEM(entry, 0), &ok), peak = as_i64(PyList_GET_ITEM(entry, 1), &ok2);
    if (!ok || !ok2) {
        PyErr_SetString(PyExc_OverflowError, "a tag's bytes are out of range");
        return -1;
    }
    live += delta;
    PyObject *now = PyLong_FromLongLong(live), *high = NULL;
    if (now == NULL) return -1;
    if (live > peak && (high = PyLong_FromLongLong(live)) == NULL) {
        Py_DECREF(now);
        return -1;
    }
    PyList_SetItem(entry, 0, now);
    if (high != NULL) PyList_SetItem(entry, 1, high);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * EventLog: a tree's last `maxlen` events; each reads back as the tuple recorder.Event
 * (time, kind, budget id, bytes, tag, budget's used after, root's used after).
 */
enum { KIND_ALLOC, KIND_FREE, KIND_DENY, KINDS };
static PyObject *kind_names[KINDS];

typedef struct {
    double time;
    int kind;
    i64 budget, nbytes, used, total;
    PyObject *tag; /* a str or NULL (None) */
    PyObject *big; /* the bytes when beyond 64 bits (a denied request), else NULL */
} Record;

typedef struct {
    PyObject_HEAD
    Record *ring;
    Py_ssize_t maxlen, cap, len, head; /* the oldest record is ring[head] */
    i64 logged;
} EventLogObject;

static PyTypeObject EventLogType;

static int EventLog_init(EventLogObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"maxlen", NULL};
    Py_ssize_t maxlen;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:EventLog", names, &maxlen)) return -1;
    if (maxlen < 1) {
        PyErr_Format(PyExc_ValueError, "maxlen must be positive, got %zd", maxlen);
        return -1;
    }
    if (self->maxlen) {
        PyErr_SetString(PyExc_RuntimeError, "EventLog initialised twice");
        return -1;
    }
    self->maxlen = maxlen;
    return 0;
}

static void EventLog_dealloc(EventLogObject *self) {
    for (Py_ssize_t i = 0; i < self->len; i++) {
        Py_XDECREF(self->ring[(self->head + i) % self->cap].tag);
        Py_XDECREF(self->ring[(self->head + i) % self->cap].big);
    }
    PyMem_Free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Room for one more record: -1 (MemoryError) before anything changes. */
static int log_reserve(EventLogObject *self) {
    if (self->len < self->cap || self->cap == self->maxlen) return 0;
    Py_ssize_t cap = self->cap ? self->cap * 2 : 256;
    if (cap > self->maxlen) cap = self->maxlen;
    Record *ring = PyMem_Malloc((size_t)cap * sizeof(Record));
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->len; i++) ring[i] = self->ring[(self->head + i) % self->cap];
    PyMem_Free(self->ring);
    self->ring = ring;
    self->cap = cap;
    self->head = 0;
    return 0;
}

/* Append (log_reserve first); takes a new reference to `tag` (NULL or a str). */
static void log_append(EventLogObject *self, double time, int kind, i64 budget, i64 nbytes,
                       PyObject *tag, i64 used, i64 total) {
    Record *slot;
    PyObject *dropped = NULL, *dropped_big = NULL;
    if (self->len == self->cap) { /* full: the oldest goes */
        slot = &self->ring[self->head];
        dropped = slot->tag;
        dropped_big = slot->big;
        self->head = (self->head + 1) % self->cap;
    } else {
        slot = &self->ring[(self->head + self->len) % self->cap];
        self->len++;
    }
    Py_XINCREF(tag);
    *slot = (Record){time, kind, budget, nbytes, used, total, tag, NULL};
    self->logged++;
    Py_XDECREF(dropped);
    Py_XDECREF(dropped_big);
}

static PyObject *EventLog_append(EventLogObject *self, PyObject *event) {
    double time;
    PyObject *kind, *tag, *size;
    i64 budget, nbytes, used, total;
    if (!PyArg_ParseTuple(event, "dULO!OLL:append", &time, &kind, &budget, &PyLong_Type, &size,
                          &tag, &used, &total))
        return NULL;
    int ok;
    nbytes = as_i64(size, &ok);
    int k = -1;
    for (int i = 0; i < KINDS; i++)
        if (PyUnicode_Compare(kind, kind_names[i]) == 0) k = i;
    if (k < 0) return PyErr_Format(PyExc_ValueError, "unknown event kind %R", kind);
    if (tag != Py_None && !PyUnicode_Check(tag))
        return PyErr_Format(PyExc_TypeError, "an event's tag is a str or None, got %R", tag);
    if (log_reserve(self) < 0) return NULL;
    log_append(self, time, k, budget, ok ? nbytes : 0, tag == Py_None ? NULL : tag, used, total);
    if (!ok) {
        Record *last = &self->ring[(self->head + self->len - 1) % self->cap];
        Py_INCREF(size);
        last->big = size;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t EventLog_len(EventLogObject *self) { return self->len; }

static PyObject *record_tuple(const Record *r) {
    if (r->big != NULL)
        return Py_BuildValue("(dOLOOLL)", r->time, kind_names[r->kind], r->budget, r->big,
                             r->tag ? r->tag : Py_None, r->used, r->total);
    return Py_BuildValue("(dOLLOLL)", r->time, kind_names[r->kind], r->budget, r->nbytes,
                         r->tag ? r->tag : Py_None, r->used, r->total);
}

static PyObject *EventLog_list(EventLogObject *self, PyObject *unused) {
    PyObject *list = PyList_New(self->len);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->len; i++) {
        PyObject *event = record_tuple(&self->ring[(self->head + i) % self->cap]);
        if (event == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, event);
    }
    return list;
}

static PyObject *EventLog_iter(EventLogObject *self) {
    PyObject *list = EventLog_list(self, NULL);
    if (list == NULL) return NULL;
    PyObject *it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

static PyMethodDef EventLog_methods[] = {
    {"append", (PyCFunction)EventLog_append, METH_O, "Log one event (a tuple, as recorder.Event)."},
    {"to_list", (PyCFunction)EventLog_list, METH_NOARGS, "The events kept, oldest first."},
    {NULL}};

static PyMemberDef EventLog_members[] = {
    {"maxlen", T_PYSSIZET, offsetof(EventLogObject, maxlen), READONLY, NULL},
    {"logged", T_LONGLONG, offsetof(EventLogObject, logged), READONLY, "Events ever logged."},
    {NULL}};

static PySequenceMethods EventLog_sequence = {.sq_length = (lenfunc)EventLog_len};

static PyTypeObject EventLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.EventLog",
    .tp_basicsize = sizeof(EventLogObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A tree's bounded event log; see recorder.EventLog.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EventLog_init,
    .tp_dealloc = (destructor)EventLog_dealloc,
    .tp_methods = EventLog_methods,
    .tp_members = EventLog_members,
    .tp_as_sequence = &EventLog_sequence,
    .tp_iter = (getiterfunc)EventLog_iter,
};



/* ---------------------------------------------------------------------------------------
 * Registry: the live blocks of a tree, address -> (owner, aligned bytes, tag, stack), with
 * the interface of the dict the Python core uses (tuples made when asked for).
 */
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

static PyTypeObject RegistryType;

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

static int reg_reserve(RegistryObject *r, Py_ssize_t more) {
    Py_ssize_t need = r->len + more;
    if (r->cap && need * 4 < r->cap * 3) return 0;
    Py_ssize_t cap = r->cap ? r->cap : 64;
    while (need * 4 >= cap * 3) cap *= 2;
    i64 *keys = PyMem_Calloc((size_t)cap, sizeof(i64));
    Entry *entries = PyMem_Malloc((size_t)cap * sizeof(Entry));
    if (keys == NULL || entries == NULL) {
        PyMem_Free(keys);
        PyMem_Free(entries);
        PyErr_NoMemory();
        return -1;
    }
    i64 *old_keys = r->keys;
    Entry *old_entries = r->entries;
    Py_ssize_t old_cap = r->cap;
    r->keys = keys;
    r->entries = entries;
    r->cap = cap;
    for (Py_ssize_t i = 0; i < old_cap; i++) {
        if (!old_keys[i]) continue;
        Py_ssize_t j = reg_slot(r, old_keys[i] - 1);
        while (keys[j]) j = (j + 1) & (cap - 1);
        keys[j] = old_keys[i];
        entries[j] = old_entries[i];
    }
    PyMem_Free(old_keys);
    PyMem_Free(old_entries);
    return 0;
}

/* Put an entry (reg_reserve first); takes new references; the replaced one's are returned
 * in *old (to be released by the caller), else old->owner is NULL. */
static void reg_put(RegistryObject *r, i64 address, PyObject *owner, i64 nbytes, PyObject *tag,
                    PyObject *stack, Entry *old) {
    Py_ssize_t j = reg_slot(r, address);
    old->owner = NULL;
    while (r->keys[j]) {
        if (r->keys[j] == address + 1) {
            *old = r->entries[j];
            break;
        }
        j = (j + 1) & (r->cap - 1);
    }
    if (!r->keys[j]) r->len++;
    Py_INCREF(owner);
    Py_XINCREF(tag);
    Py_XINCREF(stack);
    r->keys[j] = address + 1;
    r->entries[j] = (Entry){owner, tag, stack, nbytes};
}

/* Remove `address`; its entry (references now the caller's) in *out; 0 when absent. */
static int reg_pop(RegistryObject *r, i64 address, Entry *out) {
    if (!r->cap || address == INT64_MAX) return 0;
    Py_ssize_t mask = r->cap - 1, j = reg_slot(r, address);
    while (r->keys[j] != address + 1) {
        if (!r->keys[j]) return 0;
        j = (j + 1) & mask;
    }
    *out = r->entries[j];
    Py_ssize_t hole = j;
    for (;;) {
        j = (j + 1) & mask;
        if (!r->keys[j]) break;
        Py_ssize_t home = reg_slot(r, r->keys[j] - 1);
        if ((j > hole && (home <= hole || home > j)) || (j < hole && (home <= hole && home > j))) {
            r->keys[hole] = r->keys[j];
            r->entries[hole] = r->entries[j];
            hole = j;
        }
    }
    r->keys[hole] = 0;
    r->len--;
    return 1;
}

static void entry_release(Entry *e) {
    Py_XDECREF(e->owner);
    Py_XDECREF(e->tag);
    Py_XDECREF(e->stack);
}

static PyObject *entry_tuple(const Entry *e) {
    return Py_BuildValue("(OLOO)", e->owner, e->nbytes, e->tag ? e->tag : Py_None,
                         e->stack ? e->stack : Py_None);
}

/* A key as an address; 0 (no error) when it cannot be one. */
static int reg_key(PyObject *key, i64 *address) {
    if (!PyLong_Check(key)) return 0;
    int ok;
    *address = as_i64(key, &ok);
    return ok && *address >= 0 && *address != INT64_MAX;
}

static int Registry_traverse(RegistryObject *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->cap; i++) {
        if (!self->keys[i]) continue;
        Py_VISIT(self->entries[i].owner);
        Py_VISIT(self->entries[i].tag);
        Py_VISIT(self->entries[i].stack);
    }
    return 0;
}

static int Registry_clear(RegistryObject *self) {
    Py_ssize_t cap = self->cap;
    i64 *keys = self->keys;
    Entry *entries = self->entries;
    self->keys = NULL;
    self->entries = NULL;
    self->cap = self->len = 0;
    for (Py_ssize_t i = 0; i < cap; i++)
        if (keys[i]) entry_release(&entries[i]);
    PyMem_Free(keys);
    PyMem_Free(entries);
    return 0;
}

static void Registry_dealloc(RegistryObject *self) {
    PyObject_GC_UnTrack(self);
    Registry_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t Registry_len(RegistryObject *self) { return self->len; }

static PyObject *Registry_getitem(RegistryObject *self, PyObject *key) {
    i64 address;
    Entry *e = reg_key(key, &address) ? reg_find(self, address) : NULL;
    if (e == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return entry_tuple(e);
}

static int Registry_setitem(RegistryObject *self, PyObject *key, PyObject *value) {
    i64 address;
    if (!reg_key(key, &address)) {
        if (value == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        PyErr_Format(PyExc_TypeError, "a registry's keys are addresses, got %R", key);
        return -1;
    }
    Entry old;
    if (value == NULL) {
        if (!reg_pop(self, address, &old)) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        entry_release(&old);
        return 0;
    }
    PyObject *owner, *nbytes, *tag, *stack;
    if (!PyTuple_Check(value) || !PyArg_ParseTuple(value, "OO!OO", &owner, &PyLong_Type, &nbytes,
                                                   &tag, &stack)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "a registry's values are (owner, bytes, tag, stack), got %R",
                     value);
        return -1;
    }
    int ok;
    i64 n = as_i64(nbytes, &ok);
    if (!ok) {
        PyErr_Format(PyExc_OverflowError, "%R bytes do not fit a registry entry", nbytes);
        return -1;
    }
    if (reg_reserve(self, 1) < 0) return -1;
    reg_put(self, address, owner, n, tag == Py_None ? NULL : tag, stack == Py_None ? NULL : stack,
            &old);
    if (old.owner != NULL) entry_release(&old);
    return 0;
}

static int Registry_contains(RegistryObject *self, PyObject *key) {
    i64 address;
    return reg_key(key, &address) && reg_find(self, address) != NULL;
}

static PyObject *Registry_get(RegistryObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "get(key, default=None)");
    i64 address;
    Entry *e = reg_key(args[0], &address) ? reg_find(self, address) : NULL;
    if (e != NULL) return entry_tuple(e);
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(fallback);
    return fallback;
}

static PyObject *Registry_pop(RegistryObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "pop(key[, default])");
    i64 address;
    Entry e;
    if (reg_key(args[0], &address) && reg_pop(self, address, &e)) {
        PyObject *result = entry_tuple(&e);
        entry_release(&e);
        return result;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

/* kind 0: keys, 1: values, 2: items; a list (a snapshot). */
static PyObject *reg_list(RegistryObject *self, int kind) {
    PyObject *list = PyList_New(self->len);
    if (list == NULL) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < self->cap; i++) {
        if (!self->keys[i]) continue;
        PyObject *item;
        if (kind == 0) item = PyLong_FromLongLong(self->keys[i] - 1);
        else if (kind == 1) item = entry_tuple(&self->entries[i]);
        else {
            PyObject *value = entry_tuple(&self->entries[i]);
            item = value ? Py_BuildValue("(LN)", self->keys[i] - 1, value) : NULL;
        }
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, n++, item);
    }
    return list;
}

static PyObject *Registry_keys(RegistryObject *self, PyObject *unused) { return reg_list(self, 0); }
static PyObject *Registry_values(RegistryObject *self, PyObject *unused) { return reg_list(self, 1); }
static PyObject *Registry_items(RegistryObject *self, PyObject *unused) { return reg_list(self, 2); }

static PyObject *Registry_iter(RegistryObject *self) {
    PyObject *keys = reg_list(self, 0);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyMethodDef Registry_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Registry_get, METH_FASTCALL, "get(address, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))Registry_pop, METH_FASTCALL, "pop(address[, default])"},
    {"keys", (PyCFunction)Registry_keys, METH_NOARGS, "The addresses (a list)."},
    {"values", (PyCFunction)Registry_values, METH_NOARGS, "The entries (a list)."},
    {"items", (PyCFunction)Registry_items, METH_NOARGS, "(address, entry) pairs (a list)."},
    {NULL}};

static PyMappingMethods Registry_mapping = {
    .mp_length = (lenfunc)Registry_len,
    .mp_subscript = (binaryfunc)Registry_getitem,
    .mp_ass_subscript = (objobjargproc)Registry_setitem,
};

static PySequenceMethods Registry_sequence = {.sq_contains = (objobjproc)Registry_contains};

static PyTypeObject RegistryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Registry",
    .tp_basicsize = sizeof(RegistryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A tree's live blocks: address -> (owner, aligned bytes, tag, stack); a dict's "
              "interface.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Registry_dealloc,
    .tp_traverse = (traverseproc)Registry_traverse,
    .tp_clear = (inquiry)Registry_clear,
    .tp_methods = Registry_methods,
    .tp_as_mapping = &Registry_mapping,
    .tp_as_sequence = &Registry_sequence,
    .tp_iter = (getiterfunc)Registry_iter,
};

/* ---------------------------------------------------------------------------------------
 * Router: a callable that calls `here` with its arguments when `current()` == `device`, else
 * `elsewhere`: a framework's per-thread allocator function that serves one device from a
 * budget and leaves the others to what was there before (CuPy calls it for every array).
 */
typedef struct {
    PyObject_HEAD
    PyObject *current, *device, *here, *elsewhere;
    vectorcallfunc vectorcall;
} RouterObject;

static PyObject *router_call(PyObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    RouterObject *r = (RouterObject *)self;
    PyObject *device = PyObject_CallNoArgs(r->current);
    if (device == NULL) return NULL;
    int same = device == r->device ? 1 : PyObject_RichCompareBool(device, r->device, Py_EQ);
    Py_DECREF(device);
    if (same < 0) return NULL;
    return PyObject_Vectorcall(same ? r->here : r->elsewhere, args, nargsf, kwnames);
}

static PyObject *Router_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"current", "device", "here", "elsewhere", NULL};
    PyObject *current, *device, *here, *elsewhere;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO:Router", names, &current, &device, &here,
                                     &elsewhere))
        return NULL;
    if (!PyCallable_Check(current) || !PyCallable_Check(here) || !PyCallable_Check(elsewhere))
        return PyErr_Format(PyExc_TypeError, "current, here and elsewhere must be callables");
    RouterObject *self = (RouterObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(current);
    Py_INCREF(device);
    Py_INCREF(here);
    Py_INCREF(elsewhere);
    self->current = current;
    self->device = device;
    self->here = here;
    self->elsewhere = elsewhere;
    self->vectorcall = router_call;
    return (PyObject *)self;
}

static int Router_traverse(RouterObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->current);
    Py_VISIT(self->device);
    Py_VISIT(self->here);
    Py_VISIT(self->elsewhere);
    return 0;
}

static int Router_clear(RouterObject *self) {
    Py_CLEAR(self->current);
    Py_CLEAR(self->device);
    Py_CLEAR(self->here);
    Py_CLEAR(self->elsewhere);
    return 0;
}

static void Router_dealloc(RouterObject *self) {
    PyObject_GC_UnTrack(self);
    Router_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Router_members[] = {
    {"device", T_OBJECT_EX, offsetof(RouterObject, device), READONLY, NULL},
    {"here", T_OBJECT_EX, offsetof(RouterObject, here), READONLY, NULL},
    {"elsewhere", T_OBJECT_EX, offsetof(RouterObject, elsewhere), READONLY, NULL},
    {NULL}};

static PyTypeObject RouterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Router",
    .tp_basicsize = sizeof(RouterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Router(current, device, here, elsewhere): calls here(...) when current() == "
              "device, else elsewhere(...).",
    .tp_new = Router_new,
    .tp_dealloc = (destructor)Router_dealloc,
    .tp_traverse = (traverseproc)Router_traverse,
    .tp_clear = (inquiry)Router_clear,
    .tp_members = Router_members,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(RouterObject, vectorcall),
};


/* ---------------------------------------------------------------------------------------
 * Clock: a clock set by hand (``clock.now = t``; ``clock()`` returns it): what a replay
 * stamps its timeline with, read by the fast path without running Python code.
 */
typedef struct {
    PyObject_HEAD
    double now;
} ClockObject;

static PyTypeObject ClockType;

static PyObject *Clock_call(ClockObject *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds)))
        return PyErr_Format(PyExc_TypeError, "a Clock takes no arguments");
    return PyFloat_FromDouble(self->now);
}

static PyMemberDef Clock_members[] = {
    {"now", T_DOUBLE, offsetof(ClockObject, now), 0, "The time it answers, in seconds."},
    {NULL}};

static PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Clock",
    .tp_basicsize = sizeof(ClockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A clock set by hand: clock.now = t; clock() returns it.",
    .tp_new = PyType_GenericNew,
    .tp_call = (ternaryfunc)Clock_call,
    .tp_members = Clock_members,
};

/* ---------------------------------------------------------------------------------------
 * The fast path of Budget.allocate and Budget.free.
 */
typedef struct {
    Py_ssize_t budget_node;
    Py_ssize_t node_tree, node_account, node_stats, node_granularity, node_track_stacks,
        node_refusal, node_id, node_state, node_pins, node_unreleased;
    Py_ssize_t tree_lock, tree_arena, tree_live, tree_pending, tree_mapping, tree_recorder,
        tree_root, tree_ordered, tree_fast;
    Py_ssize_t recorder_events, recorder_writer, recorder_clock;
    Py_ssize_t pending_fifo;
    Py_ssize_t state_pending;
} Offsets;

static Offsets at;
static int configured = 0;
static PyObject *state_object, *label_var, *perf_counter, *slow_allocate, *slow_free;
static PyObject *s_alignment, *s_tag, *s_stream, *s_raise_on_denial, *s_exited;

/* The classes whose __slots__ the fast path reads (given to install), and the class of
 * PendingFrees._fifo. */
static PyTypeObject *node_class, *tree_class, *recorder_class, *pending_class, *deque_class;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* What a slot holds is whatever Python code put there (None, an int, an object of another
 * class, nothing): the fast path reads a slot of an object only once the object is known to
 * be exactly the class the offset was looked up in, and uses what it read as one of its
 * types only after the same check. NULL for anything else, and the caller leaves the call
 * to the Python methods, which raise a clear error or behave as Python does.
 *
 * typed_slot: the slot at `offset` of `object` when `object` is exactly `cls`, else NULL
 * (also for a NULL `object`, and for an empty slot). */
static inline PyObject *typed_slot(PyObject *object, PyTypeObject *cls, Py_ssize_t offset) {
    return object != NULL && Py_TYPE(object) == cls ? SLOT(object, offset) : NULL;
}

/* `object` when it is exactly `cls`, else NULL. */
static inline PyObject *exactly(PyObject *object, PyTypeObject *cls) {
    return object != NULL && Py_TYPE(object) == cls ? object : NULL;
}

/* A budget's counters, when `object` is a Stats whose tags are a dict: what the fast path
 * reads and changes of them (the other members it never touches). */
static inline StatsObject *stats_of(PyObject *object) {
    if (object == NULL || !PyObject_TypeCheck(object, &StatsType)) return NULL;
    StatsObject *stats = (StatsObject *)object;
    return stats->tags != NULL && PyDict_CheckExact(stats->tags) ? stats : NULL;
}

static inline int state_pending(void) {
    PyObject *pending = SLOT(state_object, at.state_pending);
    return pending != NULL && pending != Py_False;
}

/* The time, from a clock the fast path reads without running Python code (the monotonic
 * clock that time.perf_counter reads, or a Clock); -1 for any other clock, which the Python
 * methods read with the tree's lock held (a clock written in Python could run anything). */
static inline int read_clock(PyObject *clock, double *time) {
    if (clock == perf_counter) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        *time = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        return 0;
    }
    if (Py_TYPE(clock) == &ClockType) {
        *time = ((ClockObject *)clock)->now;
        return 0;
    }
    return -1;
}

static inline int i64_slot(PyObject *object, Py_ssize_t offset, i64 *out) {
    PyObject *value = SLOT(object, offset);
    if (value == NULL || !PyLong_CheckExact(value)) return 0;
    int ok;
    *out = as_i64(value, &ok);
    return ok;
}

/* Call the Python method the fast one stands in for, with the same arguments. */
static PyObject *slow(PyObject *function, PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[16], **all = total < 16 ? small : PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
    if (all == NULL) return PyErr_NoMemory();
    all[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) all[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(function, all, (size_t)(nargs + 1), kwnames);
    if (all != small) PyMem_Free(all);
    return result;
}

/* The time of the operation by the tree's clock; -1: leave the call to Python (see
 * read_clock). Nothing runs Python code here. */
static inline int stamp(PyObject *node, double *time) {
    PyObject *tree = typed_slot(node, node_class, at.node_tree);
    PyObject *recorder = typed_slot(tree, tree_class, at.tree_recorder);
    PyObject *clock = typed_slot(recorder, recorder_class, at.recorder_clock);
    return clock == NULL ? -1 : read_clock(clock, time);
}

/* The parts of a tree the fast path uses, when it may take it: 1 yes, 0 leave it to Python. */
typedef struct {
    PyObject *tree;
    RegistryObject *live;
    ArenaObject *arena;
    LockObject *lock;
    EventLogObject *events;
    AccountObject *root;
} Parts;

static int tree_parts(PyObject *node, Parts *p) {
    PyObject *tree = exactly(typed_slot(node, node_class, at.node_tree), tree_class);
    if (tree == NULL || SLOT(tree, at.tree_fast) != Py_True) return 0;
    PyObject *arena = SLOT(tree, at.tree_arena), *live = SLOT(tree, at.tree_live),
             *lock = SLOT(tree, at.tree_lock), *recorder = exactly(SLOT(tree, at.tree_recorder), recorder_class),
             *root = exactly(SLOT(tree, at.tree_root), node_class);
    if (arena == NULL || !PyObject_TypeCheck(arena, &ArenaType) || live == NULL ||
        Py_TYPE(live) != &RegistryType || lock == NULL || Py_TYPE(lock) != &LockType ||
        recorder == NULL || root == NULL)
        return 0;
    PyObject *events = SLOT(recorder, at.recorder_events), *writer = SLOT(recorder, at.recorder_writer),
             *account = SLOT(root, at.node_account);
    if (events == NULL || Py_TYPE(events) != &EventLogType || writer != Py_None ||
        account == NULL || Py_TYPE(account) != &AccountType)
        return 0;
    *p = (Parts){tree, (RegistryObject *)live, (ArenaObject *)arena, (LockObject *)lock, (EventLogObject *)events,
                 (AccountObject *)account};
    return 1;
}

static PyObject *fast_allocate(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    PyObject *size = nargs >= 1 ? args[0] : NULL, *alignment = nargs >= 2 ? args[1] : NULL;
    PyObject *tag = NULL, *stream = NULL;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (!configured || nargs < 1 || nargs > 2) goto slow;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (name == s_tag) tag = value;
        else if (name == s_stream) stream = value;
        else if (name == s_alignment && alignment == NULL) alignment = value;
        else if (name != s_raise_on_denial) goto slow; /* a denial is Python's anyway */
    }
    int ok;
    if (!PyLong_CheckExact(size)) goto slow;
    i64 nsize = as_i64(size, &ok), align = 0;
    if (!ok || nsize <= 0) goto slow;
    if (alignment != NULL) {
        if (!PyLong_CheckExact(alignment)) goto slow;
        align = as_i64(alignment, &ok);
        if (!ok || align < 0 || (align && !is_power_of_two(align))) goto slow;
    }
    if (stream != NULL && stream != Py_None && !PyLong_CheckExact(stream)) goto slow;
    if (tag != NULL && tag != Py_None && !PyUnicode_CheckExact(tag)) goto slow;
    PyObject *label = NULL; /* the tag: given, else the current label */
    if (tag == NULL || tag == Py_None) {
        if (PyContextVar_Get(label_var, NULL, &label) < 0) return NULL;
        if (label == Py_None) Py_CLEAR(label);
        else if (label != NULL && !PyUnicode_CheckExact(label)) {
            Py_DECREF(label);
            goto slow;
        }
    } else {
        Py_INCREF(tag);
        label = tag;
    }
    PyObject *fresh = NULL; /* a new tag's [live, peak], made before the state is read */
    PyObject *where = NULL;
retry:;
    PyObject *node = exactly(SLOT(self, at.budget_node), node_class);
    double time;
    Parts p;
    if (node == NULL || stamp(node, &time) < 0 || state_pending()) goto slow_labelled;
    if (SLOT(node, at.node_track_stacks) != Py_False ||
        SLOT(node, at.node_refusal) != Py_None || !tree_parts(node, &p))
        goto slow_labelled;
    PyObject *mapping = SLOT(p.tree, at.tree_mapping);
    PyObject *fifo = exactly(typed_slot(SLOT(p.tree, at.tree_pending), pending_class, at.pending_fifo),
                             deque_class);
    if (mapping != Py_None || fifo == NULL || PyObject_Length(fifo) != 0) goto slow_labelled;
    PyObject *account = SLOT(node, at.node_account);
    StatsObject *st = stats_of(SLOT(node, at.node_stats));
    i64 granularity, id;
    if (account == NULL || Py_TYPE(account) != &AccountType || st == NULL ||
        !i64_slot(node, at.node_granularity, &granularity) || !i64_slot(node, at.node_id, &id) ||
        granularity <= 0)
        goto slow_labelled;
    if (align > granularity) granularity = align;
    if (nsize > INT64_MAX - granularity) goto slow_labelled;
    i64 nbytes = (nsize + granularity - 1) & -granularity;
    if (label != NULL && fresh == NULL) {
        PyObject *known = PyDict_GetItemWithError(st->tags, label);
        if (known == NULL) {
            if (PyErr_Occurred()) goto failed;
            /* Making a list may start the collector, whose finalizers may change anything
             * read so far: make it first, then read it all again. */
            if ((fresh = Py_BuildValue("[ii]", 0, 0)) == NULL) goto failed;
            goto retry;
        }
    }
    if (!lock_try(p.lock)) goto slow_labelled;
    /* the lock held: refuse, place, then commit; a denial is left to Python (it records it) */
    AccountObject *acct = (AccountObject *)account;
    i64 address;
    if (ledger_refusal(acct, nbytes) != NULL || arena_reserve(p.arena) < 0 ||
        log_reserve(p.events) < 0 || reg_reserve(p.live, 1) < 0 ||
        (address = arena_alloc(p.arena, nbytes, granularity)) < 0) {
        PyErr_Clear();
        lock_leave(p.lock);
        goto slow_labelled;
    }
    /* from the refusal to the commit nothing runs Python code (no object the collector
     * tracks is made): no finalizer can slip an allocation in between */
    where = PyLong_FromLongLong(address);
    if (where == NULL || (label != NULL && tag_add(st, label, nbytes, fresh) < 0)) {
        arena_free(p.arena, address); /* undone: the block is as it was */
        lock_leave(p.lock);
        goto failed;
    }
    Entry replaced; /* the commit; nothing below can fail */
    reg_put(p.live, address, node, nbytes, label, NULL, &replaced);
    ledger_charge(acct, nbytes);
    st->allocations++;
    st->bytes_allocated += nbytes;
    if (++st->blocks > st->peak_blocks) st->peak_blocks = st->blocks;
    log_append(p.events, time, KIND_ALLOC, id, nbytes, label, acct->used, p.root->used);
    lock_leave(p.lock);
    if (replaced.owner != NULL) entry_release(&replaced); /* never: addresses are unique */
    Py_XDECREF(fresh);
    Py_XDECREF(label);
    return where;
failed:
    Py_XDECREF(where);
    Py_XDECREF(fresh);
    Py_XDECREF(label);
    return NULL;
slow_labelled:
    Py_XDECREF(fresh);
    Py_XDECREF(label);
slow:
    return slow(slow_allocate, self, args, nargs, kwnames);
}

static PyObject *fast_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    PyObject *stream = NULL;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (!configured || nargs != 1) goto slow;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (PyTuple_GET_ITEM(kwnames, i) != s_stream) goto slow;
        stream = args[nargs + i];
    }
    PyObject *where = args[0];
    int ok;
    if (!PyLong_CheckExact(where)) goto slow;
    i64 address = as_i64(where, &ok);
    PyObject *node = exactly(SLOT(self, at.budget_node), node_class);
    double time;
    if (!ok || node == NULL || stamp(node, &time) < 0 || state_pending()) goto slow;
    Parts p;
    if (!tree_parts(node, &p)) goto slow;
    if (stream != NULL && stream != Py_None &&
        (!PyLong_CheckExact(stream) || SLOT(p.tree, at.tree_ordered) != Py_False))
        goto slow; /* a free on a stream of a device waits for its work: Python's */
    Entry *entry = reg_find(p.live, address);
    if (entry == NULL) goto slow; /* not a live block: Python counts the invalid free */
    PyObject *owner = entry->owner, *tag = entry->tag ? entry->tag : Py_None;
    i64 nbytes = entry->nbytes;
    if (exactly(owner, node_class) == NULL) goto slow; /* the registry holds what Python put */
    PyObject *owner_account = SLOT(owner, at.node_account), *node_account = SLOT(node, at.node_account);
    PyObject *state = SLOT(owner, at.node_state);
    StatsObject *st = stats_of(SLOT(owner, at.node_stats));
    i64 id, pins, unreleased;
    if (owner_account == NULL || Py_TYPE(owner_account) != &AccountType || node_account == NULL ||
        st == NULL || state == NULL || !PyUnicode_Check(state) || !i64_slot(owner, at.node_id, &id))
        goto slow;
    /* A budget whose scope has ended is released by the free of its last block when nothing
     * else holds it (Python's release_if_unused): that free is Python's. An ended budget
     * still held (pinned by a TensorRT runtime, or with children) frees here. */
    if (PyUnicode_Compare(state, s_exited) == 0 &&
        (!i64_slot(owner, at.node_pins, &pins) || !i64_slot(owner, at.node_unreleased, &unreleased) ||
         (st->blocks <= 1 && !pins && !unreleased)))
        goto slow;
    if (owner != node) { /* a descendant's block: node's account is up its chain */
        AccountObject *link = ((AccountObject *)owner_account)->parent;
        while (link != NULL && (PyObject *)link != node_account) link = link->parent;
        if (link == NULL) goto slow;
    }
    if (tag != Py_None && !PyUnicode_CheckExact(tag)) goto slow;
    if (!lock_try(p.lock)) goto slow;
    if (arena_reserve(p.arena) < 0 || log_reserve(p.events) < 0) {
        PyErr_Clear(); /* no memory: nothing changed */
        lock_leave(p.lock);
        goto slow;
    }
    PyObject *tag_entry = NULL, *live_after = NULL; /* the tag's [live, peak], live bytes after */
    if (tag != Py_None) {
        tag_entry = PyDict_GetItemWithError(st->tags, tag);
        i64 live;
        if (tag_entry == NULL || !PyList_CheckExact(tag_entry) || PyList_GET_SIZE(tag_entry) != 2 ||
            !PyLong_CheckExact(PyList_GET_ITEM(tag_entry, 0)) ||
            (live = as_i64(PyList_GET_ITEM(tag_entry, 0), &ok), !ok) ||
            (live_after = PyLong_FromLongLong(live - nbytes)) == NULL) {
            PyErr_Clear();
            lock_leave(p.lock);
            goto slow;
        }
    }
    if (arena_free(p.arena, address) <= 0) { /* no memory for the bookkeeping: nothing changed */
        PyErr_Clear();
        Py_XDECREF(live_after);
        lock_leave(p.lock);
        goto slow;
    }
    Entry gone; /* the commit; nothing below can fail */
    reg_pop(p.live, address, &gone); /* its references released once the lock is left */
    if (tag_entry != NULL) PyList_SetItem(tag_entry, 0, live_after);
    AccountObject *acct = (AccountObject *)owner_account;
    ledger_charge(acct, -nbytes);
    st->frees++;
    st->bytes_freed += nbytes;
    st->blocks--;
    log_append(p.events, time, KIND_FREE, id, nbytes, tag == Py_None ? NULL : tag, acct->used,
               p.root->used);
    lock_leave(p.lock);
    entry_release(&gone);
    Py_RETURN_TRUE;
slow:
    return slow(slow_free, self, args, nargs, kwnames);
}

/* The offset of slot `name` of `cls` (a __slots__ member holding an object). */
static int slot_offset(PyObject *cls, const char *name, Py_ssize_t *offset) {
    PyObject *descr = PyObject_GetAttrString(cls, name);
    if (descr == NULL) return -1;
    int good = Py_TYPE(descr) == &PyMemberDescr_Type &&
               ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    if (good) *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!good) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ member", cls, name);
        return -1;
    }
    return 0;
}

static PyMethodDef fast_allocate_def = {"allocate", (PyCFunction)(void (*)(void))fast_allocate,
                                        METH_FASTCALL | METH_KEYWORDS, NULL};
static PyMethodDef fast_free_def = {"free", (PyCFunction)(void (*)(void))fast_free,
                                    METH_FASTCALL | METH_KEYWORDS, NULL};

/* Budget.<name> becomes the fast method, with the docstring of the Python one it stands in for. */
static int put_method(PyObject *cls, PyMethodDef *def, PyObject *function) {
    PyObject *doc = PyObject_GetAttrString(function, "__doc__");
    if (doc == NULL) return -1;
    if (doc != Py_None) {
        const char *text = PyUnicode_AsUTF8(doc);
        if (text == NULL) {
            Py_DECREF(doc);
            return -1;
        }
        char *copy = PyMem_RawMalloc(strlen(text) + 1); /* kept for the process, as the class */
        if (copy == NULL) {
            Py_DECREF(doc);
            PyErr_NoMemory();
            return -1;
        }
        strcpy(copy, text);
        def->ml_doc = copy;
    }
    Py_DECREF(doc);
    PyObject *descr = PyDescr_NewMethod((PyTypeObject *)cls, def);
    if (descr == NULL) return -1;
    int failed = PyObject_SetAttrString(cls, def->ml_name, descr);
    Py_DECREF(descr);
    return failed;
}

static PyObject *py_install(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *names[] = {"budget", "node", "tree", "recorder", "pending", "state", "label",
                            "clock", NULL};
    PyObject *budget, *node, *tree, *recorder, *pending, *state, *label, *clock;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!OOO:install", names, &PyType_Type,
                                     &budget, &PyType_Type, &node, &PyType_Type, &tree,
                                     &PyType_Type, &recorder, &PyType_Type, &pending, &state,
                                     &label, &clock))
        return NULL;
    if (configured) {
        PyErr_SetString(PyExc_RuntimeError, "install() runs once");
        return NULL;
    }
    if (!PyContextVar_CheckExact(label)) {
        PyErr_Format(PyExc_TypeError, "label must be a ContextVar, got %R", label);
        return NULL;
    }
    Offsets o;
    if (slot_offset(budget, "_node", &o.budget_node) < 0 || slot_offset(node, "tree", &o.node_tree) < 0 ||
        slot_offset(node, "account", &o.node_account) < 0 || slot_offset(node, "stats", &o.node_stats) < 0 ||
        slot_offset(node, "granularity", &o.node_granularity) < 0 ||
        slot_offset(node, "track_stacks", &o.node_track_stacks) < 0 ||
        slot_offset(node, "refusal", &o.node_refusal) < 0 || slot_offset(node, "id", &o.node_id) < 0 ||
        slot_offset(node, "state", &o.node_state) < 0 || slot_offset(node, "pins", &o.node_pins) < 0 ||
        slot_offset(node, "unreleased", &o.node_unreleased) < 0 ||
        slot_offset(tree, "lock", &o.tree_lock) < 0 ||
        slot_offset(tree, "arena", &o.tree_arena) < 0 || slot_offset(tree, "live", &o.tree_live) < 0 ||
        slot_offset(tree, "pending", &o.tree_pending) < 0 ||
        slot_offset(tree, "mapping", &o.tree_mapping) < 0 ||
        slot_offset(tree, "recorder", &o.tree_recorder) < 0 || slot_offset(tree, "root", &o.tree_root) < 0 ||
        slot_offset(tree, "ordered", &o.tree_ordered) < 0 || slot_offset(tree, "fast", &o.tree_fast) < 0 ||
        slot_offset(recorder, "events", &o.recorder_events) < 0 ||
        slot_offset(recorder, "writer", &o.recorder_writer) < 0 ||
        slot_offset(recorder, "clock", &o.recorder_clock) < 0 ||
        slot_offset(pending, "_fifo", &o.pending_fifo) < 0 ||
        slot_offset((PyObject *)Py_TYPE(state), "pending", &o.state_pending) < 0)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    PyObject *deque = collections ? PyObject_GetAttrString(collections, "deque") : NULL;
    Py_XDECREF(collections);
    if (deque == NULL) return NULL;
    if (!PyType_Check(deque)) {
        Py_DECREF(deque);
        PyErr_SetString(PyExc_TypeError, "collections.deque is not a class");
        return NULL;
    }
    PyObject *allocate = PyObject_GetAttrString(budget, "allocate");
    PyObject *free = allocate ? PyObject_GetAttrString(budget, "free") : NULL;
    if (free == NULL || !PyFunction_Check(allocate) || !PyFunction_Check(free)) {
        if (free != NULL) PyErr_SetString(PyExc_TypeError, "Budget.allocate and free must be Python functions");
        Py_XDECREF(allocate);
        Py_XDECREF(free);
        Py_DECREF(deque);
        return NULL;
    }
    if (put_method(budget, &fast_allocate_def, allocate) < 0 || put_method(budget, &fast_free_def, free) < 0) {
        Py_DECREF(allocate);
        Py_DECREF(free);
        Py_DECREF(deque);
        return NULL;
    }
    at = o;
    PyObject *classes[] = {node, tree, recorder, pending};
    PyTypeObject **kept[] = {&node_class, &tree_class, &recorder_class, &pending_class};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(classes[i]);
        *kept[i] = (PyTypeObject *)classes[i];
    }
    deque_class = (PyTypeObject *)deque; /* the reference kept */
    slow_allocate = allocate;
    slow_free = free;
    Py_INCREF(state);
    state_object = state;
    Py_INCREF(label);
    label_var = label;
    Py_INCREF(clock);
    perf_counter = clock;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"passed_up", (PyCFunction)(void (*)(void))py_passed_up, METH_FASTCALL,
     "passed_up(account, used): what an account using ``used`` bytes weighs in its parent."},
    {"refusal", (PyCFunction)(void (*)(void))py_refusal, METH_FASTCALL,
     "refusal(account, delta): the first account up the chain that ``delta`` more bytes would "
     "take over its limit, or None."},
    {"charge", (PyCFunction)(void (*)(void))py_charge, METH_FASTCALL,
     "charge(account, delta): add ``delta`` bytes up the chain; raise the peaks."},
    {"available", (PyCFunction)py_available, METH_O,
     "available(account): bytes one allocation could still be charged to ``account``."},
    {"install", (PyCFunction)(void (*)(void))py_install, METH_VARARGS | METH_KEYWORDS,
     "install(budget, node, tree, recorder, pending, state, label, clock): put the fast "
     "allocate and free on ``budget`` (the Budget class); once."},
    {NULL}};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "gpubudget._core._native",
    "gpubudget's allocation core, the hot path in C (see the file's comment).", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    static const char *kinds[KINDS] = {"alloc", "free", "deny"};
    for (int i = 0; i < KINDS; i++)
        if ((kind_names[i] = PyUnicode_InternFromString(kinds[i])) == NULL) return NULL;
    if ((s_alignment = PyUnicode_InternFromString("alignment")) == NULL ||
        (s_tag = PyUnicode_InternFromString("tag")) == NULL ||
        (s_stream = PyUnicode_InternFromString("stream")) == NULL ||
        (s_raise_on_denial = PyUnicode_InternFromString("raise_on_denial")) == NULL ||
        (s_exited = PyUnicode_InternFromString("exited")) == NULL)
        return NULL;
    PyTypeObject *types[] = {&ArenaType, &LockType, &AccountType, &StatsType, &EventLogType,
                             &RouterType, &RegistryType, &ClockType};
    const char *type_names[] = {"Arena", "Lock", "Account", "Stats", "EventLog", "Router",
                                "Registry", "Clock"};
    for (int i = 0; i < 8; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    for (int i = 0; i < 8; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, type_names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(module);
            return NULL;
        }
    }
    return module;
}
