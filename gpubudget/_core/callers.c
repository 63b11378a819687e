/* callers.py's user_stack in C: the frames of the calling stack outside gpubudget, as
 * "file:line in function", outermost first. The frames are walked with the public API (no
 * traceback object); each frame's text is made once, by callers.py's frame_text (which also
 * says which files are gpubudget's), and kept here by its code and instruction, so a stack
 * costs a walk, a lookup per frame and a tuple of texts already made. */
#include "native.h"

typedef struct {
    PyObject *code; /* a reference, so that the address is not reused; NULL: empty slot */
    int at;         /* the instruction (the line before Python 3.11) */
    PyObject *text; /* NULL: gpubudget's own frame, left out */
} Known;

enum { KNOWN_SLOTS = 8192, KNOWN_MOST = 4096 }; /* then it starts again, as callers.py's */
static Known *known;
static Py_ssize_t known_len;
static PyObject *frame_text; /* callers.frame_text(code, line) -> str | None */

int callers_install(PyObject *function) {
    if (!PyCallable_Check(function)) {
        PyErr_Format(PyExc_TypeError, "frame_text must be callable, got %R", function);
        return -1;
    }
    if (known == NULL && (known = PyMem_Calloc(KNOWN_SLOTS, sizeof(Known))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(function);
    Py_XSETREF(frame_text, function);
    return 0;
}

static void known_clear(void) {
    for (Py_ssize_t i = 0; i < KNOWN_SLOTS; i++) {
        Py_CLEAR(known[i].code);
        Py_CLEAR(known[i].text);
    }
    known_len = 0;
}

static inline Py_ssize_t known_home(PyObject *code, int at) {
    return hash_home((i64)((uint64_t)(uintptr_t)code ^ ((uint64_t)(unsigned)at << 40)), KNOWN_SLOTS);
}

/* The slot of (code, at): found (its code set) or the empty one where it belongs. */
static Known *known_slot(PyObject *code, int at) {
    Py_ssize_t j = known_home(code, at);
    while (known[j].code != NULL && (known[j].code != code || known[j].at != at))
        j = (j + 1) & (KNOWN_SLOTS - 1);
    return &known[j];
}

/* The calling stack's frames outside gpubudget (a new tuple of str), or NULL with an
 * exception. May run Python code (frame_text, for a frame not seen before) and make frame
 * objects: the caller reads its state again afterwards. */
PyObject *user_stack(void) {
    if (frame_text == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "user_stack before install()");
        return NULL;
    }
    PyObject *small[64], **texts = small;
    Py_ssize_t n = 0, cap = 64;
    PyFrameObject *frame = PyEval_GetFrame();
    Py_XINCREF(frame);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
#if PY_VERSION_HEX >= 0x030B0000
        int at = PyFrame_GetLasti(frame);
#else
        int at = PyFrame_GetLineNumber(frame);
#endif
        Known *slot = known_slot((PyObject *)code, at);
        PyObject *text = slot->text;
        if (slot->code == NULL) {
            int line = PyFrame_GetLineNumber(frame);
            PyObject *made = line >= 0 ? PyObject_CallFunction(frame_text, "Oi", code, line)
                                       : PyObject_CallFunction(frame_text, "OO", code, Py_None);
            if (made == NULL || (made != Py_None && !PyUnicode_Check(made))) {
                if (made != NULL) {
                    PyErr_Format(PyExc_TypeError, "frame_text gave %R, not a str or None", made);
                    Py_DECREF(made);
                }
                Py_DECREF(code);
                goto failed;
            }
            if (known_len >= KNOWN_MOST) known_clear();
            slot = known_slot((PyObject *)code, at); /* the call may have changed the table */
            if (slot->code == NULL) {
                Py_INCREF(code);
                slot->code = (PyObject *)code;
                slot->at = at;
                slot->text = made == Py_None ? NULL : made;
                known_len++;
                if (made == Py_None) Py_DECREF(made);
            } else {
                Py_DECREF(made);
            }
            text = slot->text;
        }
        Py_DECREF(code);
        if (text != NULL) {
            if (n == cap) {
                PyObject **more = PyMem_Malloc((size_t)cap * 2 * sizeof(PyObject *));
                if (more == NULL) {
                    PyErr_NoMemory();
                    goto failed;
                }
                memcpy(more, texts, (size_t)n * sizeof(PyObject *));
                if (texts != small) PyMem_Free(texts);
                texts = more;
                cap *= 2;
            }
            Py_INCREF(text);
            texts[n++] = text;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    PyObject *stack = PyTuple_New(n);
    if (stack == NULL) goto failed;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(stack, i, texts[n - 1 - i]); /* outermost first */
    if (texts != small) PyMem_Free(texts);
    return stack;
failed:
    Py_XDECREF(frame);
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(texts[i]);
    if (texts != small) PyMem_Free(texts);
    return NULL;
}

PyObject *py_user_stack(PyObject *module, PyObject *unused) { return user_stack(); }
