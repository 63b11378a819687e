/* The trace's queue in C: tracefile/queue.py's Queue, the lines a TraceWriter has not
 * written yet, as bytes in one buffer. The fast path (tree.c) encodes a granted allocation
 * and a free here itself, with the tree's lock held and nothing but C running; the writer's
 * other lines come as text (put). The writer's thread takes what is queued (take) and
 * writes it; a queue that would hold more than its limit stops: from then on every event is
 * dropped and counted, and the next take ends with a "lost" line giving the count (see
 * queue.py for the why). Every method runs with the GIL held, which is the queue's lock. */
#include "native.h"
#include <math.h>

struct TraceQueueObject {
    PyObject_HEAD
    char *buf;              /* pending bytes: buf[0 .. len) */
    Py_ssize_t len, cap;
    PyObject *inflight;     /* bytes taken and being written, or NULL */
    i64 inflight_start;     /* where in the file they go */
    Py_ssize_t limit, wake; /* most bytes held (pending and in flight); bytes that wake */
    double t0;              /* the trace's time 0, in perf_counter seconds */
    i64 entries;            /* entries ever queued */
    i64 lost, noted;        /* events dropped; of them, counted on a "lost" line already */
    double stopped_at;      /* when the first was dropped */
    int stopped, closed;
    PyObject *frames;       /* dict: frame text -> its id, once its line is queued */
    i64 next_frame;
    PyObject *tags;         /* dict: tag -> its JSON text (bytes, quoted, shortened) */
};

static PyObject *encode_ascii; /* _json.encode_basestring_ascii: what json.dumps writes */

/* -- waking the writer's thread ---------------------------------------------------------- */

static PyThread_type_lock wake_lock; /* taken while nobody wakes the thread */
static int sleeping;                 /* the thread waits on it (GIL held to read or write) */

static void tq_wake(void) {
    if (sleeping && wake_lock != NULL) {
        sleeping = 0;
        PyThread_release_lock(wake_lock);
    }
}

PyObject *py_trace_wait(PyObject *module, PyObject *arg) {
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (wake_lock == NULL) {
        if ((wake_lock = PyThread_allocate_lock()) == NULL) return PyErr_NoMemory();
        PyThread_acquire_lock(wake_lock, WAIT_LOCK);
    }
    PY_TIMEOUT_T us = seconds > 0 ? (PY_TIMEOUT_T)(seconds * 1e6) : 0;
    sleeping = 1;
    PyLockStatus got;
    Py_BEGIN_ALLOW_THREADS
    got = PyThread_acquire_lock_timed(wake_lock, us, 0);
    Py_END_ALLOW_THREADS
    if (got != PY_LOCK_ACQUIRED) {
        if (sleeping) sleeping = 0; /* timed out, nobody woke it */
        else PyThread_acquire_lock(wake_lock, WAIT_LOCK); /* woken meanwhile: taken again */
    }
    Py_RETURN_NONE;
}

/* -- the buffer ---------------------------------------------------------------------------- */

/* Stop: from now on every event is dropped (this one included) and counted. */
static void tq_stop(TraceQueueObject *q) {
    if (!q->stopped) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        q->stopped_at = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        q->stopped = 1;
    }
    q->lost++;
}

/* Room for `n` more bytes at buf + len: a pointer to them, or NULL when the queue is
 * stopped or would go over its limit, or memory runs out (then it stops; the event is
 * counted as lost). No exception is left set. */
static char *tq_room(TraceQueueObject *q, Py_ssize_t n) {
    Py_ssize_t held = q->len + (q->inflight ? PyBytes_GET_SIZE(q->inflight) : 0);
    if (q->stopped || held + n > q->limit) {
        tq_stop(q);
        return NULL;
    }
    if (q->len + n > q->cap) {
        Py_ssize_t cap = q->cap ? q->cap : 65536;
        while (cap < q->len + n) cap *= 2;
        char *buf = PyMem_Realloc(q->buf, (size_t)cap);
        if (buf == NULL) {
            tq_stop(q);
            return NULL;
        }
        q->buf = buf;
        q->cap = cap;
    }
    return q->buf + q->len;
}

/* The bytes up to `end` (from tq_room) are one more entry. */
static void tq_commit(TraceQueueObject *q, char *end) {
    Py_ssize_t before = q->len;
    q->len = end - q->buf;
    q->entries++;
    if (before < q->wake && q->len >= q->wake) tq_wake();
}

static char *put_text(char *p, const char *text) {
    size_t n = strlen(text);
    memcpy(p, text, n);
    return p + n;
}

static char *put_i64(char *p, i64 v) {
    char digits[24];
    int n = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *p++ = '-';
    while (n) *p++ = digits[--n];
    return p;
}

/* Seconds since the trace's time 0 at `now`, to the nanosecond (what round(t, 9) keeps),
 * with the trailing zeros of the fraction left out: a JSON number of the same value. */
static char *put_time(char *p, double seconds) {
    if (!(seconds > -9e9 && seconds < 9e9)) seconds = 0.0; /* NaN: never from perf_counter */
    i64 ns = (i64)llround(seconds * 1e9);
    if (ns < 0) {
        *p++ = '-';
        ns = -ns;
    }
    p = put_i64(p, ns / 1000000000);
    *p++ = '.';
    i64 frac = ns % 1000000000;
    char digits[9];
    for (int i = 8; i >= 0; i--) {
        digits[i] = (char)('0' + frac % 10);
        frac /= 10;
    }
    int keep = 9;
    while (keep > 1 && digits[keep - 1] == '0') keep--;
    memcpy(p, digits, (size_t)keep);
    return p + keep;
}

static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* `text` as json.dumps writes it (ASCII, quoted), cut to MAX_TEXT characters as writer.py's
 * shortened() does: a new bytes object, or NULL with an exception. */
static PyObject *json_text(PyObject *text) {
    PyObject *cut = text;
    Py_INCREF(cut);
    if (PyUnicode_GET_LENGTH(text) > TRACE_MAX_TEXT) {
        PyObject *start = PyUnicode_Substring(text, 0, TRACE_MAX_TEXT - 1);
        Py_DECREF(cut);
        PyObject *dots = start ? PyUnicode_FromOrdinal(0x2026) : NULL;
        cut = dots ? PyUnicode_Concat(start, dots) : NULL;
        Py_XDECREF(start);
        Py_XDECREF(dots);
        if (cut == NULL) return NULL;
    }
    PyObject *quoted = PyObject_CallOneArg(encode_ascii, cut);
    Py_DECREF(cut);
    if (quoted == NULL) return NULL;
    PyObject *raw = PyUnicode_AsASCIIString(quoted);
    Py_DECREF(quoted);
    return raw;
}

/* The JSON text of tag `tag` (a str), made once per tag: a borrowed bytes object, or NULL
 * with an exception. Makes no object the collector tracks. */
PyObject *tq_tag_text(TraceQueueObject *q, PyObject *tag) {
    PyObject *known = PyDict_GetItemWithError(q->tags, tag);
    if (known != NULL || PyErr_Occurred()) return known;
    PyObject *raw = json_text(tag);
    if (raw == NULL) return NULL;
    if (PyDict_GET_SIZE(q->tags) >= 4096) PyDict_Clear(q->tags); /* a program making tags */
    int failed = PyDict_SetItem(q->tags, tag, raw);
    Py_DECREF(raw);
    return failed ? NULL : raw; /* the dict's reference */
}

/* Queue a "frame" line for each frame of `stack` (a tuple of str; its innermost
 * TRACE_MAX_FRAMES) not queued yet: 0, or -1 with an exception (nothing queued for that
 * frame). A frame whose line was dropped (the queue stopped) is noted all the same: nothing
 * after it is written. Makes no object the collector tracks. */
int tq_frames(TraceQueueObject *q, PyObject *stack) {
    Py_ssize_t n = PyTuple_GET_SIZE(stack);
    for (Py_ssize_t i = n > TRACE_MAX_FRAMES ? n - TRACE_MAX_FRAMES : 0; i < n; i++) {
        PyObject *frame = PyTuple_GET_ITEM(stack, i);
        if (!PyUnicode_Check(frame)) {
            PyErr_Format(PyExc_TypeError, "a stack's frame is a str, got %R", frame);
            return -1;
        }
        PyObject *known = PyDict_GetItemWithError(q->frames, frame);
        if (known != NULL) continue;
        if (PyErr_Occurred()) return -1;
        PyObject *raw = json_text(frame), *id = PyLong_FromLongLong(q->next_frame);
        if (raw == NULL || id == NULL || PyDict_SetItem(q->frames, frame, id) < 0) {
            Py_XDECREF(raw);
            Py_XDECREF(id);
            return -1;
        }
        Py_DECREF(id);
        char *p = tq_room(q, PyBytes_GET_SIZE(raw) + 64);
        if (p != NULL) {
            p = put_text(p, "{\"ev\": \"frame\", \"id\": ");
            p = put_i64(p, q->next_frame);
            p = put_text(p, ", \"at\": ");
            memcpy(p, PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw));
            p = put_text(p + PyBytes_GET_SIZE(raw), "}\n");
            tq_commit(q, p);
        }
        Py_DECREF(raw);
        q->next_frame++;
    }
    return 0;
}

/* A granted allocation's line; `tag` the tag's JSON text (tq_tag_text) or NULL, `stack` a
 * tuple whose frames tq_frames queued, or NULL. Never fails: an event that cannot be
 * queued is counted as lost. */
void tq_alloc(TraceQueueObject *q, double now, i64 budget, i64 size, i64 align, PyObject *tag,
              i64 ptr, i64 nbytes, PyObject *stack) {
    Py_ssize_t frames = stack ? PyTuple_GET_SIZE(stack) : 0;
    if (frames > TRACE_MAX_FRAMES) frames = TRACE_MAX_FRAMES;
    /* the line's text is 109 bytes, its seven numbers at most 142, each frame's id 22 */
    char *p = tq_room(q, 256 + (tag ? PyBytes_GET_SIZE(tag) : 0) + 22 * frames);
    if (p == NULL) return;
    p = put_text(p, "{\"ev\": \"alloc\", \"t\": ");
    p = put_time(p, now - q->t0);
    p = put_text(p, ", \"b\": ");
    p = put_i64(p, budget);
    p = put_text(p, ", \"size\": ");
    p = put_i64(p, size);
    p = put_text(p, ", \"align\": ");
    p = put_i64(p, align);
    p = put_text(p, ", \"tag\": ");
    if (tag != NULL) {
        memcpy(p, PyBytes_AS_STRING(tag), (size_t)PyBytes_GET_SIZE(tag));
        p += PyBytes_GET_SIZE(tag);
    } else {
        p = put_text(p, "null");
    }
    p = put_text(p, ", \"ptr\": ");
    p = put_i64(p, ptr);
    p = put_text(p, ", \"bytes\": ");
    p = put_i64(p, nbytes);
    p = put_text(p, ", \"reason\": null");
    if (stack != NULL) {
        p = put_text(p, ", \"stack\": [");
        Py_ssize_t n = PyTuple_GET_SIZE(stack);
        for (Py_ssize_t i = n - frames; i < n; i++) {
            PyObject *id = PyDict_GetItem(q->frames, PyTuple_GET_ITEM(stack, i)); /* borrowed */
            int ok = 0;
            i64 value = id ? as_i64(id, &ok) : 0;
            if (!ok) { /* never: tq_frames noted it, and nothing ran since */
                tq_stop(q);
                return;
            }
            if (i > n - frames) p = put_text(p, ", ");
            p = put_i64(p, value);
        }
        *p++ = ']';
    }
    p = put_text(p, "}\n");
    tq_commit(q, p);
}

void tq_free(TraceQueueObject *q, double now, i64 budget, i64 ptr) {
    char *p = tq_room(q, 128); /* 39 bytes of text, three numbers of at most 62 */
    if (p == NULL) return;
    p = put_text(p, "{\"ev\": \"free\", \"t\": ");
    p = put_time(p, now - q->t0);
    p = put_text(p, ", \"b\": ");
    p = put_i64(p, budget);
    p = put_text(p, ", \"ptr\": ");
    p = put_i64(p, ptr);
    p = put_text(p, "}\n");
    tq_commit(q, p);
}

int tq_open(const TraceQueueObject *q) { return !q->closed; }

double tq_now(void) { return now_seconds(); }

/* -- the Python interface (queue.py's) ----------------------------------------------------- */

static int TraceQueue_init(TraceQueueObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"t0", "limit", "wake", NULL};
    double t0;
    Py_ssize_t limit, wake;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "dnn:TraceQueue", names, &t0, &limit, &wake))
        return -1;
    if (limit < 1 || wake < 1) {
        PyErr_SetString(PyExc_ValueError, "limit and wake must be positive");
        return -1;
    }
    if (self->frames != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TraceQueue initialised twice");
        return -1;
    }
    if (encode_ascii == NULL) {
        PyObject *json = PyImport_ImportModule("_json");
        encode_ascii = json ? PyObject_GetAttrString(json, "encode_basestring_ascii") : NULL;
        Py_XDECREF(json);
        if (encode_ascii == NULL) return -1;
    }
    if ((self->frames = PyDict_New()) == NULL || (self->tags = PyDict_New()) == NULL) return -1;
    self->t0 = t0;
    self->limit = limit;
    self->wake = wake;
    return 0;
}

static void TraceQueue_dealloc(TraceQueueObject *self) {
    PyMem_Free(self->buf);
    Py_XDECREF(self->inflight);
    Py_XDECREF(self->frames);
    Py_XDECREF(self->tags);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *TraceQueue_put(TraceQueueObject *self, PyObject *text) {
    if (!PyUnicode_Check(text)) return PyErr_Format(PyExc_TypeError, "put() takes a str, got %R", text);
    PyObject *raw = PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass");
    if (raw == NULL) return NULL;
    char *p = tq_room(self, PyBytes_GET_SIZE(raw));
    if (p != NULL) {
        memcpy(p, PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw));
        tq_commit(self, p + PyBytes_GET_SIZE(raw));
    }
    Py_DECREF(raw);
    return PyBool_FromLong(p != NULL);
}

static PyObject *TraceQueue_alloc(TraceQueueObject *self, PyObject *args) {
    double now;
    i64 budget, size, align, ptr, nbytes;
    PyObject *tag, *stack = Py_None;
    if (!PyArg_ParseTuple(args, "dLLLOLL|O:alloc", &now, &budget, &size, &align, &tag, &ptr,
                          &nbytes, &stack))
        return NULL;
    if (tag != Py_None && !PyUnicode_Check(tag))
        return PyErr_Format(PyExc_TypeError, "a tag is a str or None, got %R", tag);
    if (stack != Py_None && !PyTuple_Check(stack))
        return PyErr_Format(PyExc_TypeError, "a stack is a tuple or None, got %R", stack);
    PyObject *text = tag == Py_None ? NULL : tq_tag_text(self, tag);
    if (tag != Py_None && text == NULL) return NULL;
    if (stack != Py_None && tq_frames(self, stack) < 0) return NULL;
    i64 lost = self->lost;
    tq_alloc(self, now, budget, size, align, text, ptr, nbytes, stack == Py_None ? NULL : stack);
    return PyBool_FromLong(self->lost == lost);
}

static PyObject *TraceQueue_free(TraceQueueObject *self, PyObject *args) {
    double now;
    i64 budget, ptr;
    if (!PyArg_ParseTuple(args, "dLL:free", &now, &budget, &ptr)) return NULL;
    i64 lost = self->lost;
    tq_free(self, now, budget, ptr);
    return PyBool_FromLong(self->lost == lost);
}

static PyObject *TraceQueue_take(TraceQueueObject *self, PyObject *arg) {
    int ok = 0;
    i64 start = PyLong_Check(arg) ? as_i64(arg, &ok) : 0;
    if (!ok) return PyErr_Format(PyExc_TypeError, "take() takes a file offset, got %R", arg);
    if (self->inflight != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take() with bytes still in flight (done() first)");
        return NULL;
    }
    char line[128], *p = line;
    if (self->lost > self->noted) {
        p = put_text(p, "{\"ev\": \"lost\", \"t\": ");
        p = put_time(p, self->stopped_at - self->t0);
        p = put_text(p, ", \"events\": ");
        p = put_i64(p, self->lost - self->noted);
        p = put_text(p, "}\n");
    }
    Py_ssize_t extra = p - line;
    if (!self->len && !extra) Py_RETURN_NONE;
    PyObject *data = PyBytes_FromStringAndSize(NULL, self->len + extra);
    if (data == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(data), self->buf, (size_t)self->len);
    memcpy(PyBytes_AS_STRING(data) + self->len, line, (size_t)extra);
    self->len = 0;
    self->noted = self->lost;
    self->inflight = data;
    self->inflight_start = start;
    Py_INCREF(data);
    return data;
}

static PyObject *TraceQueue_inflight(TraceQueueObject *self, PyObject *unused) {
    if (self->inflight == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(LO)", self->inflight_start, self->inflight);
}

static PyObject *TraceQueue_done(TraceQueueObject *self, PyObject *unused) {
    Py_CLEAR(self->inflight);
    Py_RETURN_NONE;
}

static PyObject *TraceQueue_forget_frames(TraceQueueObject *self, PyObject *unused) {
    PyDict_Clear(self->frames);
    Py_RETURN_NONE;
}

static PyObject *TraceQueue_clear(TraceQueueObject *self, PyObject *unused) {
    self->len = 0;
    Py_CLEAR(self->inflight);
    Py_RETURN_NONE;
}

static PyObject *TraceQueue_close(TraceQueueObject *self, PyObject *unused) {
    self->closed = 1;
    Py_RETURN_NONE;
}

static PyObject *TraceQueue_get_pending(TraceQueueObject *self, void *unused) {
    return PyLong_FromSsize_t(self->len);
}

static PyObject *TraceQueue_get_due(TraceQueueObject *self, void *unused) {
    return PyBool_FromLong(self->len >= self->wake);
}

static PyObject *TraceQueue_get_stopped(TraceQueueObject *self, void *unused) {
    return PyBool_FromLong(self->stopped);
}

static PyObject *TraceQueue_get_closed(TraceQueueObject *self, void *unused) {
    return PyBool_FromLong(self->closed);
}

static PyMethodDef TraceQueue_methods[] = {
    {"put", (PyCFunction)TraceQueue_put, METH_O, "Queue one entry (text); False: dropped."},
    {"alloc", (PyCFunction)TraceQueue_alloc, METH_VARARGS, "Queue a granted allocation's line."},
    {"free", (PyCFunction)TraceQueue_free, METH_VARARGS, "Queue a free's line."},
    {"take", (PyCFunction)TraceQueue_take, METH_O, "What is queued, now in flight at an offset."},
    {"inflight", (PyCFunction)TraceQueue_inflight, METH_NOARGS, "(offset, bytes) in flight, or None."},
    {"done", (PyCFunction)TraceQueue_done, METH_NOARGS, "What was in flight is written."},
    {"forget_frames", (PyCFunction)TraceQueue_forget_frames, METH_NOARGS, "Frames again, new ids."},
    {"clear", (PyCFunction)TraceQueue_clear, METH_NOARGS, "Drop what is queued and in flight."},
    {"close", (PyCFunction)TraceQueue_close, METH_NOARGS, "Nothing more: the fast path leaves it."},
    {NULL}};

static PyGetSetDef TraceQueue_getset[] = {
    {"pending", (getter)TraceQueue_get_pending, NULL, "Bytes queued, not yet taken.", NULL},
    {"due", (getter)TraceQueue_get_due, NULL, "Whether enough is queued to be written now.", NULL},
    {"stopped", (getter)TraceQueue_get_stopped, NULL, "Whether it was full and drops events.", NULL},
    {"closed", (getter)TraceQueue_get_closed, NULL, "Whether close() was called.", NULL},
    {NULL}};

static PyMemberDef TraceQueue_members[] = {
    {"entries", T_LONGLONG, offsetof(TraceQueueObject, entries), READONLY, "Entries ever queued."},
    {"lost", T_LONGLONG, offsetof(TraceQueueObject, lost), READONLY, "Events dropped."},
    {"limit", T_PYSSIZET, offsetof(TraceQueueObject, limit), READONLY, NULL},
    {NULL}};

PyTypeObject TraceQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.TraceQueue",
    .tp_basicsize = sizeof(TraceQueueObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A trace writer's lines not yet written; see tracefile/queue.py.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TraceQueue_init,
    .tp_dealloc = (destructor)TraceQueue_dealloc,
    .tp_methods = TraceQueue_methods,
    .tp_getset = TraceQueue_getset,
    .tp_members = TraceQueue_members,
};

/* -- which queue a writer has: TraceWriter's slot, told by writer.py (trace_writer) ------- */

static PyTypeObject *writer_class;
static Py_ssize_t writer_queue_offset;

PyObject *py_trace_writer(PyObject *module, PyObject *cls) {
    if (!PyType_Check(cls)) return PyErr_Format(PyExc_TypeError, "a class, got %R", cls);
    PyObject *descr = PyObject_GetAttrString(cls, "_queue");
    if (descr == NULL) return NULL;
    int good = Py_TYPE(descr) == &PyMemberDescr_Type &&
               ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    Py_ssize_t offset = good ? ((PyMemberDescrObject *)descr)->d_member->offset : 0;
    Py_DECREF(descr);
    if (!good) return PyErr_Format(PyExc_TypeError, "%R._queue is not a __slots__ member", cls);
    Py_INCREF(cls);
    Py_XSETREF(writer_class, (PyTypeObject *)cls);
    writer_queue_offset = offset;
    Py_RETURN_NONE;
}

TraceQueueObject *writer_queue(PyObject *writer) {
    if (writer_class == NULL || Py_TYPE(writer) != writer_class) return NULL;
    PyObject *queue = *(PyObject **)((char *)writer + writer_queue_offset);
    if (queue == NULL || Py_TYPE(queue) != &TraceQueueType) return NULL;
    return ((TraceQueueObject *)queue)->closed ? NULL : (TraceQueueObject *)queue;
}
