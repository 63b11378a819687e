/* The module gpubudget._core._native (what __init__.py loads): its functions and types, from
 * the files named in native.h. */
#include "native.h"

static PyMethodDef module_methods[] = {
    {"passed_up", (PyCFunction)(void (*)(void))py_passed_up, METH_FASTCALL,
     "passed_up(account, used): what an account using ``used`` bytes weighs in its parent."},
    {"refusal", (PyCFunction)(void (*)(void))py_refusal, METH_FASTCALL,
     "refusal(account, delta): the first account up the chain that ``delta`` more bytes would "
     "take over its limit, or None."},
    {"claim", (PyCFunction)(void (*)(void))py_claim, METH_FASTCALL,
     "claim(account, delta): refusal(), and under the driver door the bytes shown to it first."},
    {"settle", (PyCFunction)(void (*)(void))py_settle, METH_FASTCALL,
     "settle(account, delta): withdraw a claim of ``delta`` bytes that was not charged."},
    {"charge", (PyCFunction)(void (*)(void))py_charge, METH_FASTCALL,
     "charge(account, delta): add ``delta`` bytes up the chain; raise the peaks."},
    {"available", (PyCFunction)py_available, METH_O,
     "available(account): bytes one allocation could still be charged to ``account``."},
    {"install", (PyCFunction)(void (*)(void))py_install, METH_VARARGS | METH_KEYWORDS,
     "install(budget, node, tree, recorder, pending, mapping, label, clock, frame_text): put the fast "
     "allocate and free on ``budget`` (the Budget class); once."},
    {"trace_wait", (PyCFunction)py_trace_wait, METH_O,
     "trace_wait(seconds): wait (the GIL released) until a TraceQueue holds enough to be "
     "written, or ``seconds`` pass; for the trace writer's thread."},
    {"trace_writer", (PyCFunction)py_trace_writer, METH_O,
     "trace_writer(cls): the TraceWriter class, whose ``_queue`` the fast path writes to."},
    {"user_stack", (PyCFunction)py_user_stack, METH_NOARGS,
     "user_stack(): callers.user_stack in C, from the calling frame (after install())."},
    {NULL}};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "gpubudget._core._native",
    "gpubudget's allocation core, the hot path in C (see native.h).", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (recorder_init() < 0 || tree_init() < 0) return NULL;
    PyTypeObject *types[] = {&ArenaType, &LockType, &AccountType, &StatsType, &EventLogType,
                             &RouterType, &RegistryType, &ClockType, &TraceQueueType};
    const char *type_names[] = {"Arena", "Lock", "Account", "Stats", "EventLog", "Router",
                                "Registry", "Clock", "TraceQueue"};
    for (int i = 0; i < 9; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) return NULL;
    for (int i = 0; i < 9; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, type_names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(module);
            return NULL;
        }
    }
    return module;
}
