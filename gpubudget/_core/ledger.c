/* The ledger in C: ledger.py's accounts and its rules for charging a chain of budgets. */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * Account and the ledger (ledger.py has the rules in words).
 */

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

/* -- the driver door's words (gpubudget/door): [0] bytes it charged here, [2] the part that is
 * a root's own memory, [1] where this account's `used` is stored at each change. */

static void account_undoor(AccountObject *self) {
    if (self->door != NULL) {
        PyBuffer_Release(&self->door_words);
        Py_CLEAR(self->door);
    }
}

/* Loads in the one order of all sequentially consistent operations (plain loads on x86): a
 * claim's store before them is seen by the door's compare-and-swap after them, or they see
 * that compare-and-swap (see ledger_claim). */
static inline i64 door_foreign(const AccountObject *a) {
    const int64_t *w = (const int64_t *)a->door_words.buf;
    i64 foreign = __atomic_load_n(&w[0], __ATOMIC_SEQ_CST) - __atomic_load_n(&w[2], __ATOMIC_SEQ_CST);
    return foreign > 0 ? foreign : 0;
}

/* What the door counts of this account: `used`, and the bytes claimed here not yet charged. */
static inline i64 door_word(const AccountObject *a) {
    return a->claimed > INT64_MAX - a->used ? INT64_MAX : a->used + a->claimed;
}

static inline void door_store(AccountObject *a) {
    __atomic_store_n(&((int64_t *)a->door_words.buf)[1], door_word(a), __ATOMIC_RELEASE);
}

/* door_store for a claim: ordered before the door's bytes are read again (ledger_claim). */
static inline void door_claim(AccountObject *a) {
    __atomic_store_n(&((int64_t *)a->door_words.buf)[1], door_word(a), __ATOMIC_SEQ_CST);
}

static PyObject *Account_get_door(AccountObject *self, void *closure) {
    PyObject *value = self->door ? self->door : Py_None;
    Py_INCREF(value);
    return value;
}

static int Account_set_door(AccountObject *self, PyObject *value, void *closure) {
    if (value == NULL || value == Py_None) {
        account_undoor(self);
        return 0;
    }
    Py_buffer words;
    if (PyObject_GetBuffer(value, &words, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (words.len < 24 || ((uintptr_t)words.buf & 7) != 0) {
        PyBuffer_Release(&words);
        PyErr_SetString(PyExc_ValueError, "door must be aligned 64-bit words, 3 at least");
        return -1;
    }
    account_undoor(self);
    Py_INCREF(value);
    self->door = value;
    self->door_words = words;
    return 0;
}

/* -- end of the door's words */

static int Account_traverse(AccountObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->parent);
    Py_VISIT(self->published);
    Py_VISIT(self->door);
    return 0;
}

static int Account_clear(AccountObject *self) {
    account_unpublish(self);
    account_undoor(self);
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

/* Whether `delta` more bytes take `link` over its limit, counting `claimed` bytes claimed
 * there by allocations not yet charged: 1 yes, 0 no, -1 undecided. */
static inline int over_by(const AccountObject *link, i64 delta, i64 claimed) {
    if (delta > 0 && claimed > 0) {
        if (delta > INT64_MAX - claimed) return link->limit == INT64_MAX ? -1 : 1;
        delta += claimed;
    }
    if (link->door != NULL && delta > 0) { /* the driver door's bytes count too */
        i64 foreign = door_foreign(link);
        if (foreign > link->limit || delta > link->limit - foreign) return 1;
        delta += foreign;
    }
    if (delta <= 0) return link->used + delta > link->limit; /* used >= 0: no overflow */
    if (link->used <= link->limit - delta) return 0;
    return link->limit == INT64_MAX && link->used > INT64_MAX - delta ? -1 : 1;
}

static inline int over(const AccountObject *link, i64 delta) {
    return over_by(link, delta, link->claimed);
}

/* The first account up the chain whose limit `delta` more bytes would exceed, NULL when all
 * of them can take it, or UNDECIDED. */
AccountObject *ledger_refusal(AccountObject *account, i64 delta) {
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

static void unclaim(AccountObject *account, AccountObject *stop, i64 delta);

/* ledger_refusal for an allocation about to be charged, closing the race with the driver
 * door (which charges from any thread, without the tree's lock). At each level the claim's
 * bytes are added to `claimed` and, under the door, shown to it (door_claim) before the
 * door's bytes are read again for the check. The door does the mirror image (its
 * compare-and-swap, then this word read again), so of an allocation on each side at the
 * same moment at least one sees the other: both may be refused, never both granted past the
 * limit. Each level is claimed the whole `delta`, even above a reserve floor that passes
 * less up (a claim may count more than its charge will, never less), so that ledger_charge
 * and ledger_settle give back exactly what was claimed, whatever changed meanwhile (a
 * finalizer freeing a block of this thread's while the arena places this one). A refusal
 * withdraws what it claimed. */
AccountObject *ledger_claim(AccountObject *account, i64 delta) {
    if (delta <= 0) return ledger_refusal(account, delta);
    i64 d = delta; /* what reaches this level, past the floors below */
    for (AccountObject *node = account; node != NULL; node = node->parent) {
        i64 others = node->claimed;
        int o = d > 0 ? over_by(node, d, others) : 0;
        if (!o && others > INT64_MAX - delta) o = 1; /* never: claims are bytes granted */
        AccountObject *stop = node; /* the first level not claimed, on a refusal */
        if (!o) {
            node->claimed = others + delta;
            stop = node->parent;
            if (node->door != NULL) {
                door_claim(node);
                o = d > 0 ? over_by(node, d, others) : 0; /* the door's bytes, read again */
            }
        }
        if (o) {
            unclaim(account, stop, delta);
            return o > 0 ? node : UNDECIDED;
        }
        if (!account->plain && node->reserve && d > 0)
            d = passed_up(node, node->used + d) - passed_up(node, node->used);
    }
    return NULL;
}

/* A claim of `delta` given back from `account` up to (not including) `stop`. */
static void unclaim(AccountObject *account, AccountObject *stop, i64 delta) {
    for (AccountObject *link = account; link != stop; link = link->parent) {
        link->claimed = link->claimed > delta ? link->claimed - delta : 0;
        if (link->door != NULL) door_store(link);
    }
}

/* A claim of `delta` that will not be charged, withdrawn at every level. */
void ledger_settle(AccountObject *account, i64 delta) {
    unclaim(account, NULL, delta > 0 ? delta : 0);
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

/* A positive charge follows its claim of the same `delta` (ledger_claim) and takes it back
 * at every level, as the bytes become `used`. */
void ledger_charge(AccountObject *account, i64 delta) {
    i64 claimed = delta > 0 ? delta : 0;
    if (account->plain) {
        for (AccountObject *link = account; link != NULL; link = link->parent) {
            i64 used = link->used += delta;
            if (used > link->peak) link->peak = used;
            account_publish(link); /* a store or two where the account has words */
            if (claimed) link->claimed = link->claimed > claimed ? link->claimed - claimed : 0;
            if (link->door != NULL) door_store(link);
        }
        return;
    }
    for (AccountObject *node = account; node != NULL && (delta || claimed); node = node->parent) {
        if (delta) {
            i64 old = node->used, used = node->used = old + delta;
            if (used > node->peak) node->peak = used;
            account_publish(node);
            if (node->reserve) delta = passed_up(node, used) - passed_up(node, old);
        }
        if (claimed) node->claimed = node->claimed > claimed ? node->claimed - claimed : 0;
        if (node->door != NULL) door_store(node);
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

PyObject *py_passed_up(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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

/* refusal() or claim() from Python: `ask` up the chain, or the exact answer in Python ints
 * where 64 bits cannot tell (nothing claimed then: the door's words are 64-bit). */
static PyObject *asked(PyObject *const *args, Py_ssize_t nargs, const char *usage,
                       AccountObject *(*ask)(AccountObject *, i64)) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "%s", usage);
    AccountObject *a = as_account(args[0]);
    if (a == NULL) return NULL;
    if (!PyLong_Check(args[1])) return PyErr_Format(PyExc_TypeError, "delta must be an int");
    int ok;
    i64 delta = as_i64(args[1], &ok);
    AccountObject *refused = ok ? ask(a, delta) : UNDECIDED;
    if (refused == UNDECIDED) return exact_refusal(a, args[1]);
    PyObject *result = refused ? (PyObject *)refused : Py_None;
    Py_INCREF(result);
    return result;
}

PyObject *py_refusal(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return asked(args, nargs, "refusal(account, delta)", ledger_refusal);
}

PyObject *py_claim(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return asked(args, nargs, "claim(account, delta)", ledger_claim);
}

PyObject *py_settle(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    i64 delta;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "settle(account, delta)");
    AccountObject *a = as_account(args[0]);
    if (a == NULL || arg_i64(args[1], &delta) < 0) return NULL;
    ledger_settle(a, delta);
    Py_RETURN_NONE;
}

PyObject *py_charge(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    i64 delta;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "charge(account, delta)");
    AccountObject *a = as_account(args[0]);
    if (a == NULL || arg_i64(args[1], &delta) < 0) return NULL;
    ledger_charge(a, delta);
    Py_RETURN_NONE;
}

PyObject *py_available(PyObject *module, PyObject *arg) {
    AccountObject *account = as_account(arg);
    if (account == NULL) return NULL;
    i64 best = account->limit - account->used - (account->door ? door_foreign(account) : 0);
    i64 slack = 0;
    for (AccountObject *link = account; link->parent != NULL; link = link->parent) {
        slack += link->reserve > link->used ? link->reserve - link->used : 0;
        AccountObject *parent = link->parent;
        i64 here = parent->limit - parent->used - (parent->door ? door_foreign(parent) : 0) + slack;
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
    {"claimed", T_LONGLONG, offsetof(AccountObject, claimed), 0, NULL},
    {"depth", T_LONGLONG, offsetof(AccountObject, depth), READONLY, NULL},
    {NULL}};

static PyGetSetDef Account_getset[] = {
    {"parent", (getter)Account_get_parent, NULL, NULL, NULL},
    {"plain", (getter)Account_get_plain, NULL, NULL, NULL},
    {"published", (getter)Account_get_published, (setter)Account_set_published, NULL, NULL},
    {"door", (getter)Account_get_door, (setter)Account_set_door, NULL, NULL},
    {NULL}};

PyTypeObject AccountType = {
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
