/* A tree's lock in C: what locks.py's new_lock() makes where the C core runs. */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * Lock: re-entrant, owned by a thread (lock_try and lock_leave, the fast path's, in native.h).
 */

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

PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Lock",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A re-entrant lock (a tree's): threading.RLock's interface, and a fast path in C.",
    .tp_new = Lock_new,
    .tp_dealloc = (destructor)Lock_dealloc,
    .tp_methods = Lock_methods,
};
