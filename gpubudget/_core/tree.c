/* The fast path in C: the common case of tree.py's Tree.allocate and Tree.free, done whole,
 * as the methods Budget.allocate and Budget.free (install(), called by node.py's
 * install_fast_path); everything else goes to the Python methods they stand in for. */
#include "native.h"

/* ---------------------------------------------------------------------------------------
 * The fast path of Budget.allocate and Budget.free.
 */
typedef struct {
    Py_ssize_t budget_node;
    Py_ssize_t node_tree, node_account, node_stats, node_granularity, node_track_stacks,
        node_refusal, node_id, node_state, node_pins, node_unreleased;
    Py_ssize_t tree_lock, tree_arena, tree_live, tree_pending, tree_mapping, tree_recorder,
        tree_root, tree_ordered, tree_fast;
    Py_ssize_t recorder_events, recorder_writer, recorder_clock;
    Py_ssize_t pending_fifo;
    Py_ssize_t mapping_mapped, mapping_asleep, mapping_address, mapping_granule;
} Offsets;

static Offsets at;
static int configured = 0;
static PyObject *label_var, *perf_counter, *slow_allocate, *slow_free;
static PyObject *s_alignment, *s_tag, *s_stream, *s_raise_on_denial, *s_exited;

int tree_init(void) {
    PyObject **names[] = {&s_alignment, &s_tag, &s_stream, &s_raise_on_denial, &s_exited};
    const char *texts[] = {"alignment", "tag", "stream", "raise_on_denial", "exited"};
    for (int i = 0; i < 5; i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return -1;
    return 0;
}

/* The classes whose __slots__ the fast path reads (given to install), and the class of
 * PendingFrees._fifo. */
static PyTypeObject *node_class, *tree_class, *recorder_class, *pending_class, *mapping_class,
    *deque_class;

#define SLOT(object, offset) (*(PyObject **)((char *)(object) + (offset)))

/* What a slot holds is whatever Python code put there (None, an int, an object of another
 * class, nothing): the fast path reads a slot of an object only once the object is known to
 * be exactly the class the offset was looked up in, and uses what it read as one of its
 * types only after the same check. NULL for anything else, and the caller leaves the call
 * to the Python methods, which raise a clear error or behave as Python does.
 *
 * typed_slot: the slot at `offset` of `object` when `object` is exactly `cls`, else NULL
 * (also for a NULL `object`, and for an empty slot). */
static inline PyObject *typed_slot(PyObject *object, PyTypeObject *cls, Py_ssize_t offset) {
    return object != NULL && Py_TYPE(object) == cls ? SLOT(object, offset) : NULL;
}

/* `object` when it is exactly `cls`, else NULL. */
static inline PyObject *exactly(PyObject *object, PyTypeObject *cls) {
    return object != NULL && Py_TYPE(object) == cls ? object : NULL;
}

/* A budget's counters, when `object` is a Stats whose tags are a dict: what the fast path
 * reads and changes of them (the other members it never touches). */
static inline StatsObject *stats_of(PyObject *object) {
    if (object == NULL || !PyObject_TypeCheck(object, &StatsType)) return NULL;
    StatsObject *stats = (StatsObject *)object;
    return stats->tags != NULL && PyDict_CheckExact(stats->tags) ? stats : NULL;
}

/* The time, from a clock the fast path reads without running Python code (the monotonic
 * clock that time.perf_counter reads, or a Clock); -1 for any other clock, which the Python
 * methods read with the tree's lock held (a clock written in Python could run anything). */
static inline int read_clock(PyObject *clock, double *time) {
    if (clock == perf_counter) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        *time = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        return 0;
    }
    if (Py_TYPE(clock) == &ClockType) {
        *time = ((ClockObject *)clock)->now;
        return 0;
    }
    return -1;
}

static inline int i64_slot(PyObject *object, Py_ssize_t offset, i64 *out) {
    PyObject *value = SLOT(object, offset);
    if (value == NULL || !PyLong_CheckExact(value)) return 0;
    int ok;
    *out = as_i64(value, &ok);
    return ok;
}

/* Call the Python method the fast one stands in for, with the same arguments. */
static PyObject *slow(PyObject *function, PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[16], **all = total < 16 ? small : PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
    if (all == NULL) return PyErr_NoMemory();
    all[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) all[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(function, all, (size_t)(nargs + 1), kwnames);
    if (all != small) PyMem_Free(all);
    return result;
}

/* The time of the operation by the tree's clock; -1: leave the call to Python (see
 * read_clock). Nothing runs Python code here. */
static inline int stamp(PyObject *node, double *time) {
    PyObject *tree = typed_slot(node, node_class, at.node_tree);
    PyObject *recorder = typed_slot(tree, tree_class, at.tree_recorder);
    PyObject *clock = typed_slot(recorder, recorder_class, at.recorder_clock);
    return clock == NULL ? -1 : read_clock(clock, time);
}

/* The common case of memory.py's Mapping.admit, read without running Python code: 1 when
 * `mapping` (exactly a Mapping) is awake and every granule that [address, address + nbytes)
 * touches is mapped already (its bytearray `mapped`, kept by the Python class for both
 * cores); 0 for anything else (a growth, a sleeping range, a slot holding what Python code
 * put there), which the Python methods do. The tree's lock held. */
static int mapped_already(PyObject *mapping, i64 address, i64 nbytes) {
    PyObject *mapped = SLOT(mapping, at.mapping_mapped);
    i64 base, granule;
    if (SLOT(mapping, at.mapping_asleep) != Py_None || mapped == NULL ||
        !PyByteArray_CheckExact(mapped) || !i64_slot(mapping, at.mapping_address, &base) ||
        !i64_slot(mapping, at.mapping_granule, &granule) || granule <= 0 || address < base ||
        address - base > INT64_MAX - nbytes)
        return 0;
    i64 first = (address - base) / granule, last = (address - base + nbytes - 1) / granule;
    if (last >= PyByteArray_GET_SIZE(mapped)) return 0;
    const char *granules = PyByteArray_AS_STRING(mapped);
    for (i64 index = first; index <= last; index++)
        if (!granules[index]) return 0;
    return 1;
}

/* The parts of a tree the fast path uses, when it may take it: 1 yes, 0 leave it to Python. */
typedef struct {
    PyObject *tree;
    RegistryObject *live;
    ArenaObject *arena;
    LockObject *lock;
    EventLogObject *events;
    AccountObject *root;
    TraceQueueObject *queue; /* the trace writer's queue, NULL when not traced */
} Parts;

static int tree_parts(PyObject *node, Parts *p) {
    PyObject *tree = exactly(typed_slot(node, node_class, at.node_tree), tree_class);
    if (tree == NULL || SLOT(tree, at.tree_fast) != Py_True) return 0;
    PyObject *arena = SLOT(tree, at.tree_arena), *live = SLOT(tree, at.tree_live),
             *lock = SLOT(tree, at.tree_lock), *recorder = exactly(SLOT(tree, at.tree_recorder), recorder_class),
             *root = exactly(SLOT(tree, at.tree_root), node_class);
    if (arena == NULL || !PyObject_TypeCheck(arena, &ArenaType) || live == NULL ||
        Py_TYPE(live) != &RegistryType || lock == NULL || Py_TYPE(lock) != &LockType ||
        recorder == NULL || root == NULL)
        return 0;
    PyObject *events = SLOT(recorder, at.recorder_events), *writer = SLOT(recorder, at.recorder_writer),
             *account = SLOT(root, at.node_account);
    TraceQueueObject *queue = NULL; /* a traced tree: its writer's queue, still open */
    if (writer == NULL || (writer != Py_None && (queue = writer_queue(writer)) == NULL))
        return 0;
    if (events == NULL || Py_TYPE(events) != &EventLogType || account == NULL ||
        Py_TYPE(account) != &AccountType)
        return 0;
    *p = (Parts){tree, (RegistryObject *)live, (ArenaObject *)arena, (LockObject *)lock, (EventLogObject *)events,
                 (AccountObject *)account, queue};
    return 1;
}

static PyObject *fast_allocate(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    PyObject *size = nargs >= 1 ? args[0] : NULL, *alignment = nargs >= 2 ? args[1] : NULL;
    PyObject *tag = NULL, *stream = NULL;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (!configured || nargs < 1 || nargs > 2) goto slow;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (name == s_tag) tag = value;
        else if (name == s_stream) stream = value;
        else if (name == s_alignment && alignment == NULL) alignment = value;
        else if (name != s_raise_on_denial) goto slow; /* a denial is Python's anyway */
    }
    int ok;
    if (!PyLong_CheckExact(size)) goto slow;
    i64 nsize = as_i64(size, &ok), align = 0;
    if (!ok || nsize <= 0) goto slow;
    if (alignment != NULL) {
        if (!PyLong_CheckExact(alignment)) goto slow;
        align = as_i64(alignment, &ok);
        if (!ok || align < 0 || (align && !is_power_of_two(align))) goto slow;
    }
    if (stream != NULL && stream != Py_None && !PyLong_CheckExact(stream)) goto slow;
    if (tag != NULL && tag != Py_None && !PyUnicode_CheckExact(tag)) goto slow;
    PyObject *label = NULL; /* the tag: given, else the current label */
    if (tag == NULL || tag == Py_None) {
        if (PyContextVar_Get(label_var, NULL, &label) < 0) return NULL;
        if (label == Py_None) Py_CLEAR(label);
        else if (label != NULL && !PyUnicode_CheckExact(label)) {
            Py_DECREF(label);
            goto slow;
        }
    } else {
        Py_INCREF(tag);
        label = tag;
    }
    PyObject *fresh = NULL; /* a new tag's [live, peak], made before the state is read */
    PyObject *stack = NULL; /* the caller's frames, taken before the state is read */
    PyObject *where = NULL;
retry:;
    PyObject *node = exactly(SLOT(self, at.budget_node), node_class);
    double time;
    Parts p;
    if (node == NULL || stamp(node, &time) < 0) goto slow_labelled;
    PyObject *tracking = SLOT(node, at.node_track_stacks);
    if (tracking == Py_True && stack == NULL) {
        /* walking the frames may make frame objects (the collector may run) and run
         * callers.py's frame_text: taken first, then everything read again */
        if ((stack = user_stack()) == NULL) goto failed;
        goto retry;
    }
    if (tracking == Py_False) Py_CLEAR(stack);
    else if (tracking != Py_True) goto slow_labelled;
    if (SLOT(node, at.node_refusal) != Py_None || !tree_parts(node, &p))
        goto slow_labelled;
    PyObject *mapping = SLOT(p.tree, at.tree_mapping);
    PyObject *fifo = exactly(typed_slot(SLOT(p.tree, at.tree_pending), pending_class, at.pending_fifo),
                             deque_class);
    if ((mapping != Py_None && exactly(mapping, mapping_class) == NULL) || fifo == NULL ||
        PyObject_Length(fifo) != 0)
        goto slow_labelled;
    PyObject *account = SLOT(node, at.node_account);
    StatsObject *st = stats_of(SLOT(node, at.node_stats));
    i64 granularity, id;
    if (account == NULL || Py_TYPE(account) != &AccountType || st == NULL ||
        !i64_slot(node, at.node_granularity, &granularity) || !i64_slot(node, at.node_id, &id) ||
        granularity <= 0)
        goto slow_labelled;
    if (align > granularity) granularity = align;
    if (nsize > INT64_MAX - granularity) goto slow_labelled;
    i64 nbytes = (nsize + granularity - 1) & -granularity;
    if (label != NULL && fresh == NULL) {
        PyObject *known = PyDict_GetItemWithError(st->tags, label);
        if (known == NULL) {
            if (PyErr_Occurred()) goto failed;
            /* Making a list may start the collector, whose finalizers may change anything
             * read so far: make it first, then read it all again. */
            if ((fresh = Py_BuildValue("[ii]", 0, 0)) == NULL) goto failed;
            goto retry;
        }
    }
    PyObject *tag_text = NULL; /* the tag as the trace writes it: made once per tag */
    if (p.queue != NULL && ((label != NULL && (tag_text = tq_tag_text(p.queue, label)) == NULL) ||
                            (stack != NULL && tq_frames(p.queue, stack) < 0)))
        goto failed; /* only memory: nothing changed (frames queued are defined, unused) */
    if (!lock_try(p.lock)) goto slow_labelled;
    /* the lock held: refuse, place, then commit; a denial is left to Python (it records it),
     * and so is a block of a growable root that needs a granule mapped (nothing changed) */
    AccountObject *acct = (AccountObject *)account;
    Place place;
    i64 address;
    if (ledger_claim(acct, nbytes) != NULL) { /* refused (and nothing left claimed) */
        lock_leave(p.lock);
        goto slow_labelled;
    }
    if (arena_reserve(p.arena) < 0 || log_reserve(p.events) < 0 || reg_reserve(p.live, 1) < 0 ||
        arena_place(p.arena, nbytes, granularity, &place) < 0 ||
        (mapping != Py_None && !mapped_already(mapping, place.address, nbytes)) ||
        (address = arena_take(p.arena, &place)) < 0) {
        PyErr_Clear();
        ledger_settle(acct, nbytes); /* the claim withdrawn: Python claims again */
        lock_leave(p.lock);
        goto slow_labelled;
    }
    /* from the refusal to the commit nothing runs Python code (no object the collector
     * tracks is made): no finalizer can slip an allocation in between */
    where = PyLong_FromLongLong(address);
    if (where == NULL || (label != NULL && tag_add(st, label, nbytes, fresh) < 0)) {
        arena_free(p.arena, address); /* undone: the block is as it was */
        ledger_settle(acct, nbytes);
        lock_leave(p.lock);
        goto failed;
    }
    Entry replaced; /* the commit; nothing below can fail */
    reg_put(p.live, address, node, nbytes, label, stack, &replaced);
    ledger_charge(acct, nbytes);
    st->allocations++;
    st->bytes_allocated += nbytes;
    if (++st->blocks > st->peak_blocks) st->peak_blocks = st->blocks;
    log_append(p.events, time, KIND_ALLOC, id, nbytes, label, acct->used, p.root->used);
    if (p.queue != NULL) /* the trace's line, in order with the tree's other events */
        tq_alloc(p.queue, tq_now(), id, nsize, align, tag_text, address, nbytes, stack);
    lock_leave(p.lock);
    if (replaced.owner != NULL) entry_release(&replaced); /* never: addresses are unique */
    Py_XDECREF(fresh);
    Py_XDECREF(stack);
    Py_XDECREF(label);
    return where;
failed:
    Py_XDECREF(where);
    Py_XDECREF(fresh);
    Py_XDECREF(stack);
    Py_XDECREF(label);
    return NULL;
slow_labelled:
    Py_XDECREF(fresh);
    Py_XDECREF(stack);
    Py_XDECREF(label);
slow:
    return slow(slow_allocate, self, args, nargs, kwnames);
}

static PyObject *fast_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    PyObject *stream = NULL;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (!configured || nargs != 1) goto slow;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (PyTuple_GET_ITEM(kwnames, i) != s_stream) goto slow;
        stream = args[nargs + i];
    }
    PyObject *where = args[0];
    int ok;
    if (!PyLong_CheckExact(where)) goto slow;
    i64 address = as_i64(where, &ok);
    PyObject *node = exactly(SLOT(self, at.budget_node), node_class);
    double time;
    if (!ok || node == NULL || stamp(node, &time) < 0) goto slow;
    Parts p;
    if (!tree_parts(node, &p)) goto slow;
    if (stream != NULL && stream != Py_None &&
        (!PyLong_CheckExact(stream) || SLOT(p.tree, at.tree_ordered) != Py_False))
        goto slow; /* a free on a stream of a device waits for its work: Python's */
    Entry *entry = reg_find(p.live, address);
    if (entry == NULL) goto slow; /* not a live block: Python counts the invalid free */
    PyObject *owner = entry->owner, *tag = entry->tag ? entry->tag : Py_None;
    i64 nbytes = entry->nbytes;
    if (exactly(owner, node_class) == NULL) goto slow; /* the registry holds what Python put */
    PyObject *owner_account = SLOT(owner, at.node_account), *node_account = SLOT(node, at.node_account);
    PyObject *state = SLOT(owner, at.node_state);
    StatsObject *st = stats_of(SLOT(owner, at.node_stats));
    i64 id, pins, unreleased;
    if (owner_account == NULL || Py_TYPE(owner_account) != &AccountType || node_account == NULL ||
        st == NULL || state == NULL || !PyUnicode_Check(state) || !i64_slot(owner, at.node_id, &id))
        goto slow;
    /* A budget whose scope has ended is released by the free of its last block when nothing
     * else holds it (Python's release_if_unused): that free is Python's. An ended budget
     * still held (pinned by a TensorRT runtime, or with children) frees here. */
    if (PyUnicode_Compare(state, s_exited) == 0 &&
        (!i64_slot(owner, at.node_pins, &pins) || !i64_slot(owner, at.node_unreleased, &unreleased) ||
         (st->blocks <= 1 && !pins && !unreleased)))
        goto slow;
    if (owner != node) { /* a descendant's block: node's account is up its chain */
        AccountObject *link = ((AccountObject *)owner_account)->parent;
        while (link != NULL && (PyObject *)link != node_account) link = link->parent;
        if (link == NULL) goto slow;
    }
    if (tag != Py_None && !PyUnicode_CheckExact(tag)) goto slow;
    if (!lock_try(p.lock)) goto slow;
    if (arena_reserve(p.arena) < 0 || log_reserve(p.events) < 0) {
        PyErr_Clear(); /* no memory: nothing changed */
        lock_leave(p.lock);
        goto slow;
    }
    PyObject *tag_entry = NULL, *live_after = NULL; /* the tag's [live, peak], live bytes after */
    if (tag != Py_None) {
        tag_entry = PyDict_GetItemWithError(st->tags, tag);
        i64 live;
        if (tag_entry == NULL || !PyList_CheckExact(tag_entry) || PyList_GET_SIZE(tag_entry) != 2 ||
            !PyLong_CheckExact(PyList_GET_ITEM(tag_entry, 0)) ||
            (live = as_i64(PyList_GET_ITEM(tag_entry, 0), &ok), !ok) ||
            (live_after = PyLong_FromLongLong(live - nbytes)) == NULL) {
            PyErr_Clear();
            lock_leave(p.lock);
            goto slow;
        }
    }
    if (arena_free(p.arena, address) <= 0) { /* no memory for the bookkeeping: nothing changed */
        PyErr_Clear();
        Py_XDECREF(live_after);
        lock_leave(p.lock);
        goto slow;
    }
    Entry gone; /* the commit; nothing below can fail */
    reg_pop(p.live, address, &gone); /* its references released once the lock is left */
    if (tag_entry != NULL) PyList_SetItem(tag_entry, 0, live_after);
    AccountObject *acct = (AccountObject *)owner_account;
    ledger_charge(acct, -nbytes);
    st->frees++;
    st->bytes_freed += nbytes;
    st->blocks--;
    log_append(p.events, time, KIND_FREE, id, nbytes, tag == Py_None ? NULL : tag, acct->used,
               p.root->used);
    if (p.queue != NULL) tq_free(p.queue, tq_now(), id, address);
    lock_leave(p.lock);
    entry_release(&gone);
    Py_RETURN_TRUE;
slow:
    return slow(slow_free, self, args, nargs, kwnames);
}

/* The offset of slot `name` of `cls` (a __slots__ member holding an object). */
static int slot_offset(PyObject *cls, const char *name, Py_ssize_t *offset) {
    PyObject *descr = PyObject_GetAttrString(cls, name);
    if (descr == NULL) return -1;
    int good = Py_TYPE(descr) == &PyMemberDescr_Type &&
               ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    if (good) *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!good) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ member", cls, name);
        return -1;
    }
    return 0;
}

static PyMethodDef fast_allocate_def = {"allocate", (PyCFunction)(void (*)(void))fast_allocate,
                                        METH_FASTCALL | METH_KEYWORDS, NULL};
static PyMethodDef fast_free_def = {"free", (PyCFunction)(void (*)(void))fast_free,
                                    METH_FASTCALL | METH_KEYWORDS, NULL};

/* Budget.<name> becomes the fast method, with the docstring of the Python one it stands in for. */
static int put_method(PyObject *cls, PyMethodDef *def, PyObject *function) {
    PyObject *doc = PyObject_GetAttrString(function, "__doc__");
    if (doc == NULL) return -1;
    if (doc != Py_None) {
        const char *text = PyUnicode_AsUTF8(doc);
        if (text == NULL) {
            Py_DECREF(doc);
            return -1;
        }
        char *copy = PyMem_RawMalloc(strlen(text) + 1); /* kept for the process, as the class */
        if (copy == NULL) {
            Py_DECREF(doc);
            PyErr_NoMemory();
            return -1;
        }
        strcpy(copy, text);
        def->ml_doc = copy;
    }
    Py_DECREF(doc);
    PyObject *descr = PyDescr_NewMethod((PyTypeObject *)cls, def);
    if (descr == NULL) return -1;
    int failed = PyObject_SetAttrString(cls, def->ml_name, descr);
    Py_DECREF(descr);
    return failed;
}

PyObject *py_install(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *names[] = {"budget", "node", "tree", "recorder", "pending", "mapping",
                            "label", "clock", "frame_text", NULL};
    PyObject *budget, *node, *tree, *recorder, *pending, *mapping, *label, *clock, *frame_text;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!O!OOO:install", names, &PyType_Type,
                                     &budget, &PyType_Type, &node, &PyType_Type, &tree,
                                     &PyType_Type, &recorder, &PyType_Type, &pending,
                                     &PyType_Type, &mapping, &label, &clock, &frame_text))
        return NULL;
    if (configured) {
        PyErr_SetString(PyExc_RuntimeError, "install() runs once");
        return NULL;
    }
    if (callers_install(frame_text) < 0) return NULL;
    if (!PyContextVar_CheckExact(label)) {
        PyErr_Format(PyExc_TypeError, "label must be a ContextVar, got %R", label);
        return NULL;
    }
    Offsets o;
    if (slot_offset(budget, "_node", &o.budget_node) < 0 || slot_offset(node, "tree", &o.node_tree) < 0 ||
        slot_offset(node, "account", &o.node_account) < 0 || slot_offset(node, "stats", &o.node_stats) < 0 ||
        slot_offset(node, "granularity", &o.node_granularity) < 0 ||
        slot_offset(node, "track_stacks", &o.node_track_stacks) < 0 ||
        slot_offset(node, "refusal", &o.node_refusal) < 0 || slot_offset(node, "id", &o.node_id) < 0 ||
        slot_offset(node, "state", &o.node_state) < 0 || slot_offset(node, "pins", &o.node_pins) < 0 ||
        slot_offset(node, "unreleased", &o.node_unreleased) < 0 ||
        slot_offset(tree, "lock", &o.tree_lock) < 0 ||
        slot_offset(tree, "arena", &o.tree_arena) < 0 || slot_offset(tree, "live", &o.tree_live) < 0 ||
        slot_offset(tree, "pending", &o.tree_pending) < 0 ||
        slot_offset(tree, "mapping", &o.tree_mapping) < 0 ||
        slot_offset(tree, "recorder", &o.tree_recorder) < 0 || slot_offset(tree, "root", &o.tree_root) < 0 ||
        slot_offset(tree, "ordered", &o.tree_ordered) < 0 || slot_offset(tree, "fast", &o.tree_fast) < 0 ||
        slot_offset(recorder, "events", &o.recorder_events) < 0 ||
        slot_offset(recorder, "writer", &o.recorder_writer) < 0 ||
        slot_offset(recorder, "clock", &o.recorder_clock) < 0 ||
        slot_offset(pending, "_fifo", &o.pending_fifo) < 0 ||
        slot_offset(mapping, "mapped", &o.mapping_mapped) < 0 ||
        slot_offset(mapping, "asleep", &o.mapping_asleep) < 0 ||
        slot_offset(mapping, "address", &o.mapping_address) < 0 ||
        slot_offset(mapping, "granule", &o.mapping_granule) < 0)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    PyObject *deque = collections ? PyObject_GetAttrString(collections, "deque") : NULL;
    Py_XDECREF(collections);
    if (deque == NULL) return NULL;
    if (!PyType_Check(deque)) {
        Py_DECREF(deque);
        PyErr_SetString(PyExc_TypeError, "collections.deque is not a class");
        return NULL;
    }
    PyObject *allocate = PyObject_GetAttrString(budget, "allocate");
    PyObject *free = allocate ? PyObject_GetAttrString(budget, "free") : NULL;
    if (free == NULL || !PyFunction_Check(allocate) || !PyFunction_Check(free)) {
        if (free != NULL) PyErr_SetString(PyExc_TypeError, "Budget.allocate and free must be Python functions");
        Py_XDECREF(allocate);
        Py_XDECREF(free);
        Py_DECREF(deque);
        return NULL;
    }
    if (put_method(budget, &fast_allocate_def, allocate) < 0 || put_method(budget, &fast_free_def, free) < 0) {
        Py_DECREF(allocate);
        Py_DECREF(free);
        Py_DECREF(deque);
        return NULL;
    }
    at = o;
    PyObject *classes[] = {node, tree, recorder, pending, mapping};
    PyTypeObject **kept[] = {&node_class, &tree_class, &recorder_class, &pending_class,
                             &mapping_class};
    for (int i = 0; i < 5; i++) {
        Py_INCREF(classes[i]);
        *kept[i] = (PyTypeObject *)classes[i];
    }
    deque_class = (PyTypeObject *)deque; /* the reference kept */
    slow_allocate = allocate;
    slow_free = free;
    Py_INCREF(label);
    label_var = label;
    Py_INCREF(clock);
    perf_counter = clock;
    configured = 1;
    Py_RETURN_NONE;
}
