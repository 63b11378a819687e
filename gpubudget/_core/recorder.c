/* The recorder in C: recorder.py's counters of a budget (Stats) and a tree's bounded event
 * log (EventLog). */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * Stats: a budget's counters (the methods are recorder.py's, on a Python subclass).
 */

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

PyTypeObject StatsType = {
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
int tag_add(StatsObject *stats, PyObject *tag, i64 delta, PyObject *fresh) {
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
static PyObject *kind_names[KINDS];

int recorder_init(void) {
    static const char *kinds[KINDS] = {"alloc", "free", "deny"};
    for (int i = 0; i < KINDS; i++)
        if ((kind_names[i] = PyUnicode_InternFromString(kinds[i])) == NULL) return -1;
    return 0;
}

typedef struct {
    double time;
    int kind;
    i64 budget, nbytes, used, total;
    PyObject *tag; /* a str or NULL (None) */
    PyObject *big; /* the bytes when beyond 64 bits (a denied request), else NULL */
} Record;

struct EventLogObject {
    PyObject_HEAD
    Record *ring;
    Py_ssize_t maxlen, cap, len, head; /* the oldest record is ring[head] */
    i64 logged;
};

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
int log_reserve(EventLogObject *self) {
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
void log_append(EventLogObject *self, double time, int kind, i64 budget, i64 nbytes,
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

PyTypeObject EventLogType = {
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
