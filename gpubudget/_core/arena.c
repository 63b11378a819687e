/* The arena in C: arena.py's placement, the same block for every request (the Python
 * Arena subclasses this one and adds walk() and check()). */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * A hash map from i64 (>= 0) to i64 (see native.h for the table). Keys are stored + 1 so
 * that 0 marks an empty slot.
 */
typedef struct {
    i64 key, value; /* side by side: one probe, one cache line */
} Slot;

typedef struct {
    Slot *slots;
    Py_ssize_t cap; /* a power of two, or 0 */
    Py_ssize_t len;
} Map;

static inline Py_ssize_t map_slot(const Map *m, i64 key) { return hash_home(key, m->cap); }

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
        if (hash_may_fill(home, hole, j)) {
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

struct ArenaObject {
    PyObject_HEAD
    i64 base, capacity, granularity;
    int shift;
    Bin *bins; /* CLASSES of them */
    uint64_t fl_map;
    uint8_t sl_map[FL];
    Py_ssize_t nkeys;
    Map free_at, free_end, used_at;
};

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
int arena_reserve(ArenaObject *a) {
    if (map_reserve(&a->free_at, 2) < 0 || map_reserve(&a->free_end, 2) < 0 ||
        map_reserve(&a->used_at, 1) < 0)
        return -1;
    return 0;
}

/* Where a block of `size` bytes goes (the address in place->address), changing nothing: 0,
 * or -1 when none fits. */
int arena_place(const ArenaObject *a, i64 size, i64 alignment, Place *place) {
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
    *place = (Place){a->base + ((unit + pad) << shift), c, i, pad, need};
    return 0;
}

/* Take the block arena_place found (nothing changed since): its address, or -2 (MemoryError)
 * when there is no memory for the bookkeeping (nothing changed). arena_reserve first. */
i64 arena_take(ArenaObject *a, const Place *place) {
    int c = place->class_;
    Py_ssize_t i = place->index;
    Key key = a->bins[c].items[i];
    i64 unit = key.unit, pad = place->pad, need = place->units;
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
    return place->address;
}

/* The address of a block of `size` bytes; -1 when none fits, -2 (MemoryError) when there is
 * no memory for the bookkeeping (nothing changed). arena_reserve first. */
i64 arena_alloc(ArenaObject *a, i64 size, i64 alignment) {
    Place place;
    return arena_place(a, size, alignment, &place) < 0 ? -1 : arena_take(a, &place);
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
i64 arena_free(ArenaObject *a, i64 address) {
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

PyTypeObject ArenaType = {
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
