/* The live-block registry in C: what tree.py keeps in a dict (Tree.live). */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * Registry: the live blocks of a tree, address -> (owner, aligned bytes, tag, stack), with
 * the interface of the dict the Python core uses (tuples made when asked for).
 */

int reg_reserve(RegistryObject *r, Py_ssize_t more) {
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
        Py_ssize_t j = hash_home(old_keys[i] - 1, cap);
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
void reg_put(RegistryObject *r, i64 address, PyObject *owner, i64 nbytes, PyObject *tag,
             PyObject *stack, Entry *old) {
    Py_ssize_t j = hash_home(address, r->cap);
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
int reg_pop(RegistryObject *r, i64 address, Entry *out) {
    if (!r->cap || address == INT64_MAX) return 0;
    Py_ssize_t mask = r->cap - 1, j = hash_home(address, r->cap);
    while (r->keys[j] != address + 1) {
        if (!r->keys[j]) return 0;
        j = (j + 1) & mask;
    }
    *out = r->entries[j];
    Py_ssize_t hole = j;
    for (;;) {
        j = (j + 1) & mask;
        if (!r->keys[j]) break;
        Py_ssize_t home = hash_home(r->keys[j] - 1, r->cap);
        if (hash_may_fill(home, hole, j)) {
            r->keys[hole] = r->keys[j];
            r->entries[hole] = r->entries[j];
            hole = j;
        }
    }
    r->keys[hole] = 0;
    r->len--;
    return 1;
}

void entry_release(Entry *e) {
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

/* kind 0: keys, 1: values, 2: items; a list (a snapshot). The entries are copied first,
 * with no Python object made: making the list's items may run the collector, whose
 * finalizers may free blocks (this thread holds the tree's lock, which is re-entrant) and so
 * change the registry under the loop. */
static PyObject *reg_list(RegistryObject *self, int kind) {
    Py_ssize_t count = self->len, n = 0;
    i64 *keys = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(i64));
    Entry *entries = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(Entry));
    if (keys == NULL || entries == NULL) {
        PyMem_Free(keys);
        PyMem_Free(entries);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < self->cap && n < count; i++) {
        if (!self->keys[i]) continue;
        keys[n] = self->keys[i] - 1;
        entries[n] = self->entries[i];
        Py_INCREF(entries[n].owner);
        Py_XINCREF(entries[n].tag);
        Py_XINCREF(entries[n].stack);
        n++;
    }
    PyObject *list = PyList_New(n);
    for (Py_ssize_t j = 0; j < n && list != NULL; j++) {
        PyObject *item;
        if (kind == 0) item = PyLong_FromLongLong(keys[j]);
        else if (kind == 1) item = entry_tuple(&entries[j]);
        else {
            PyObject *value = entry_tuple(&entries[j]);
            item = value ? Py_BuildValue("(LN)", keys[j], value) : NULL;
        }
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, j, item);
    }
    for (Py_ssize_t j = 0; j < n; j++) entry_release(&entries[j]);
    PyMem_Free(keys);
    PyMem_Free(entries);
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

PyTypeObject RegistryType = {
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
