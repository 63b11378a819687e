/* What adapter.py makes in C where the C core runs: by_device's Router, hand_clock's Clock. */
#include "native.h"

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

PyTypeObject RouterType = {
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

static PyObject *Clock_call(ClockObject *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds)))
        return PyErr_Format(PyExc_TypeError, "a Clock takes no arguments");
    return PyFloat_FromDouble(self->now);
}

static PyMemberDef Clock_members[] = {
    {"now", T_DOUBLE, offsetof(ClockObject, now), 0, "The time it answers, in seconds."},
    {NULL}};

PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget._core._native.Clock",
    .tp_basicsize = sizeof(ClockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A clock set by hand: clock.now = t; clock() returns it.",
    .tp_new = PyType_GenericNew,
    .tp_call = (ternaryfunc)Clock_call,
    .tp_members = Clock_members,
};
