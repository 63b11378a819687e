/* The module gpubudget._core._native (what __init__.py loads): its functions and types, from
 * the files named in native.h. */
#include "native.h"

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
     "install(budget, node, tree, recorder, pending, mapping, state, label, clock): put the fast "
     "allocate and free on ``budget`` (the Budget class); once."},
    {NULL}};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "gpubudget._core._native",
    "gpubudget's allocation core, the hot path in C (see native.h).", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (recorder_init() < 0 || tree_init() < 0) return NULL;
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
