/* The C scanner of trace files: granted allocations and frees read, checked and (for a
 * replay) replayed in C, a buffer of lines at a time.
 *
 * A Scanner shares the Python reader's state: the validator's tables (budgets entered,
 * blocks live, frames defined). scan() walks complete lines of a buffer and takes a line
 * only when it is an ``alloc`` that was granted or a ``free``, written as one flat JSON
 * object that the reader's plain path (json and checks.py) accepts too, and that passes
 * the same checks. Any other line (an entry, an exit, a denial, a frame, an escape in a
 * string, a number out of range, a blank line, a problem of any kind) stops the scan
 * before it: the Python reader reads it the way it always did, and says what is wrong in
 * its own words. So the events, and every message, are the same with or without this
 * module; only the speed differs (tests/test_tracefile_fastparse.py and test_tracefile_cscan.py
 * compare them). Lines in the writer's own layout are matched literal by literal; any other
 * layout of the same object (keys in another order, other spaces, unknown keys with plain
 * values, a key twice: the last counts, as in json) is read key by key.
 *
 * Without a sink, each line taken becomes the event the Python reader would yield
 * (an Alloc or Free named tuple), returned in a list. With a sink (a replay's tables, see
 * gpubudget/replay/run.py) the events are replayed here, as the replay's Python loop does:
 * the clock set to the event's time, Budget.allocate / Budget.free called, the recorded
 * address mapped to the replayed block. An event the sink cannot take whole (no tag, a
 * budget not open) ends the scan, returned for the Python loop to replay.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

typedef long long i64;

#define MAX_KEYS 24     /* keys per line the scanner reads at most; more: Python's */
#define NUMBER_TEXT 64  /* characters of a float at most; longer: Python's */
#define TAG_CACHE 64    /* recent ASCII tags kept as str objects (direct mapped) */

static PyObject *s_budget, *s_open, *s_now, *s_allocate, *s_free, *s_tag, *kw_tag;

/* ---------------------------------------------------------------------------------------
 * One line, parsed: the values of the keys the format names; others checked, then ignored.
 */
enum { K_EV, K_T, K_B, K_SIZE, K_ALIGN, K_TAG, K_PTR, K_BYTES, K_REASON, K_STACK, K_KNOWN };

enum { V_NULL, V_BOOL, V_INT, V_FLOAT, V_STRING, V_LIST };

/* Which of the keys the format names (K_...) the key is, -1 for none. */
static inline int key_index(const char *k, Py_ssize_t n) {
    switch (n) {
    case 1: return k[0] == 't' ? K_T : k[0] == 'b' ? K_B : -1;
    case 2: return k[0] == 'e' && k[1] == 'v' ? K_EV : -1;
    case 3: return memcmp(k, "tag", 3) == 0 ? K_TAG : memcmp(k, "ptr", 3) == 0 ? K_PTR : -1;
    case 4: return memcmp(k, "size", 4) == 0 ? K_SIZE : -1;
    case 5:
        return memcmp(k, "align", 5) == 0   ? K_ALIGN
               : memcmp(k, "bytes", 5) == 0 ? K_BYTES
               : memcmp(k, "stack", 5) == 0 ? K_STACK
                                            : -1;
    case 6: return memcmp(k, "reason", 6) == 0 ? K_REASON : -1;
    default: return -1;
    }
}

/* Powers of ten that a double holds exactly. */
static const double exact_tens[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                      1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                      1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

typedef struct {
    int kind;
    int big;           /* V_INT: outside [0, 2**63): negative, or too large */
    i64 integer;       /* V_INT */
    double real;       /* V_FLOAT */
    const char *text;  /* V_STRING: the bytes between the quotes; V_LIST: after '[' */
    const char *stop;  /* V_LIST: after ']' */
    Py_ssize_t length; /* V_STRING: their number; V_LIST: the ids in it */
    int ascii;         /* V_STRING: no byte >= 0x80 */
} Value;

typedef struct {
    Value v[K_KNOWN];
    unsigned seen;
} Line;

/* The parsers below read a line [p, end) whose byte at `end` is its newline: every loop
 * stops there (a newline is no space, digit or string byte), so only the keywords need the
 * end. */

static inline const char *skip_space(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\r') p++;
    return p;
}

static inline int is_digit(char c) { return (unsigned char)(c - '0') < 10; }

/* The 8 bytes at p as 8 decimal digits: 1 and their value, or 0 (not all digits). */
static inline int eight_digits(const char *p, uint64_t *value) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t chunk;
    memcpy(&chunk, p, 8);
    if (((chunk & 0xF0F0F0F0F0F0F0F0u) | (((chunk + 0x0606060606060606u) & 0xF0F0F0F0F0F0F0F0u)
                                          >> 4)) != 0x3333333333333333u)
        return 0; /* each byte 0x30-0x39: high nibble 3, and still 3 after adding 6 */
    chunk -= 0x3030303030303030u;                     /* eight values 0-9, first digit lowest */
    chunk = chunk * 10 + (chunk >> 8);                /* pairs: 10a + b in every other byte */
    chunk = (((chunk & 0x000000FF000000FFu) * (100 + (1000000ull << 32))) +
             (((chunk >> 16) & 0x000000FF000000FFu) * (1 + (10000ull << 32)))) >> 32;
    *value = chunk;
    return 1;
#else
    (void)p;
    (void)value;
    return 0;
#endif
}

/* A JSON number at p (the line's end at `end`); NULL where it is not one the scanner
 * takes. */
static const char *parse_number(const char *p, const char *end, Value *v) {
    const char *start = p;
    int negative = *p == '-';
    p += negative;
    uint64_t digits = 0; /* all of them, point aside, while there are at most 19 */
    int count = 0;
    if (*p == '0') {
        p++;
        count = 1;
    } else if (is_digit(*p)) {
        uint64_t eight;
        if (end - p >= 8 && eight_digits(p, &eight)) { /* most numbers of a trace are long */
            digits = eight;
            p += 8;
            count = 8;
        }
        for (; is_digit(*p); p++, count++)
            if (count < 19) digits = digits * 10 + (uint64_t)(*p - '0'); /* < 10**19 < 2**64 */
    } else {
        return NULL;
    }
    if (*p != '.' && *p != 'e' && *p != 'E') {
        if (count > 19) return NULL; /* json reads it; the scanner leaves it to json */
        v->kind = V_INT;
        v->big = negative || digits >= ((uint64_t)1 << 63);
        v->integer = v->big ? 0 : (i64)digits;
        return p;
    }
    int decimals = 0, exponent = 0;
    if (*p == '.') {
        p++;
        if (!is_digit(*p)) return NULL;
        for (; is_digit(*p); p++, decimals++)
            if (count + decimals < 19) digits = digits * 10 + (uint64_t)(*p - '0');
    }
    if (*p == 'e' || *p == 'E') {
        exponent = 1;
        p++;
        if (*p == '+' || *p == '-') p++;
        if (!is_digit(*p)) return NULL;
        while (is_digit(*p)) p++;
    }
    v->kind = V_FLOAT;
    v->big = negative;
    if (FLT_EVAL_METHOD == 0 && !exponent && count + decimals <= 15) {
        /* d.ddd with at most 15 digits: the digits and the power of ten are both exact in
         * a double, so one division rounds correctly, as strtod does */
        v->real = (double)digits / exact_tens[decimals];
        if (negative) v->real = -v->real;
        return p;
    }
    char text[NUMBER_TEXT];
    Py_ssize_t n = p - start;
    if (n >= NUMBER_TEXT) return NULL;
    memcpy(text, start, (size_t)n);
    text[n] = '\0';
    char *stop;
    v->real = PyOS_string_to_double(text, &stop, NULL); /* as float() does, for json */
    if (stop != text + n) {
        PyErr_Clear();
        return NULL;
    }
    return p;
}

/* A string at p (after its opening quote): its bytes; NULL for an escape or a control
 * character (json's to read and judge). */
static inline const char *parse_string(const char *p, Value *v) {
    const char *start = p;
    unsigned char high = 0;
    for (;; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"') break;
        if (c == '\\' || c < 0x20) return NULL; /* the newline too */
        high |= c;
    }
    v->kind = V_STRING;
    v->text = start;
    v->length = p - start;
    v->ascii = high < 0x80;
    return p + 1;
}

/* A list of integers at p (after '['): NULL for anything else. */
static const char *parse_ids(const char *p, const char *end, Value *v) {
    v->kind = V_LIST;
    v->text = p;
    v->length = 0;
    p = skip_space(p);
    if (*p == ']') return v->stop = p + 1;
    for (;;) {
        Value id;
        p = parse_number(skip_space(p), end, &id);
        if (p == NULL || id.kind != V_INT || id.big) return NULL;
        v->length++;
        p = skip_space(p);
        if (*p == ']') return v->stop = p + 1;
        if (*p != ',') return NULL;
        p++;
    }
}

/* The value at p of key `known` (-1: a key the format does not name); NULL where the
 * scanner leaves it to Python. */
static inline const char *parse_value(const char *p, const char *end, int known, Value *v) {
    char c = *p;
    if (c == '"') {
        p = parse_string(p + 1, v);
        /* UTF-8 beyond ASCII is checked where it is decoded: only in a tag */
        return p != NULL && known != K_TAG && !v->ascii ? NULL : p;
    }
    if (c == '-' || is_digit(c)) return parse_number(p, end, v);
    if (c == 'n' && end - p >= 4 && memcmp(p, "null", 4) == 0) {
        v->kind = V_NULL;
        return p + 4;
    }
    if (c == 't' && end - p >= 4 && memcmp(p, "true", 4) == 0) {
        v->kind = V_BOOL;
        return p + 4;
    }
    if (c == 'f' && end - p >= 5 && memcmp(p, "false", 5) == 0) {
        v->kind = V_BOOL;
        return p + 5;
    }
    if (c == '[' && known == K_STACK) return parse_ids(p + 1, end, v);
    return NULL;
}

/* The writer's own layout of the two lines (json.dumps: keys in its order, ", " and ": "),
 * literal by literal: each literal's length is known here, so comparing it is a few
 * instructions. VALUE reads the value of key k; AFTER(text) steps over text or gives up. */
#define AFTER(text)                                                                    \
    if ((size_t)(end - p) < sizeof(text) - 1 || memcmp(p, text, sizeof(text) - 1) != 0) \
        return 0;                                                                      \
    p += sizeof(text) - 1
#define VALUE(k)                                     \
    if ((p = parse_value(p, end, k, &line->v[k])) == NULL) \
        return 0;                                    \
    line->seen |= 1u << (k)

/* The line in the writer's layout; 0 for any other (then read key by key). */
static int parse_layout(const char *p, const char *end, Line *line) {
    line->seen = 1u << K_EV;
    if (end - p > 13 && memcmp(p, "{\"ev\": \"alloc\"", 14) == 0) {
        line->v[K_EV] = (Value){.kind = V_STRING, .text = p + 8, .length = 5, .ascii = 1};
        p += 14;
        AFTER(", \"t\": ");
        VALUE(K_T);
        AFTER(", \"b\": ");
        VALUE(K_B);
        AFTER(", \"size\": ");
        VALUE(K_SIZE);
        AFTER(", \"align\": ");
        VALUE(K_ALIGN);
        AFTER(", \"tag\": ");
        VALUE(K_TAG);
        AFTER(", \"ptr\": ");
        VALUE(K_PTR);
        AFTER(", \"bytes\": ");
        VALUE(K_BYTES);
        AFTER(", \"reason\": ");
        VALUE(K_REASON);
        if (*p == ',') { /* a stack, with track_stacks=True */
            AFTER(", \"stack\": ");
            VALUE(K_STACK);
        }
    } else if (end - p > 12 && memcmp(p, "{\"ev\": \"free\"", 13) == 0) {
        line->v[K_EV] = (Value){.kind = V_STRING, .text = p + 8, .length = 4, .ascii = 1};
        p += 13;
        AFTER(", \"t\": ");
        VALUE(K_T);
        AFTER(", \"b\": ");
        VALUE(K_B);
        AFTER(", \"ptr\": ");
        VALUE(K_PTR);
    } else {
        return 0;
    }
    return *p == '}' && p + 1 == end;
}
#undef AFTER
#undef VALUE

/* The line [p, end) (end at its newline) as one flat object; 0 where the scanner leaves it
 * to Python. */
static int parse_line(const char *p, const char *end, Line *line) {
    if (parse_layout(p, end, line)) return 1;
    line->seen = 0;
    if (*p != '{') return 0;
    p = skip_space(p + 1);
    if (*p == '}') return 0; /* no "ev": Python's message */
    for (int keys = 0;; keys++) {
        if (keys >= MAX_KEYS || *p != '"') return 0;
        Value key;
        p = parse_string(p + 1, &key);
        if (p == NULL || !key.ascii) return 0;
        int known = key_index(key.text, key.length);
        if (known >= 0) line->seen |= 1u << known; /* a key twice: the last counts, as in json */
        p = skip_space(p);
        if (*p != ':') return 0;
        p = skip_space(p + 1);
        Value scratch;
        p = parse_value(p, end, known, known >= 0 ? &line->v[known] : &scratch);
        if (p == NULL) return 0;
        p = skip_space(p);
        if (*p == '}') break;
        if (*p != ',') return 0;
        p = skip_space(p + 1);
    }
    return skip_space(p + 1) == end; /* nothing after the object but spaces */
}

/* ---------------------------------------------------------------------------------------
 * The scanner.
 */
typedef struct {
    PyObject *text;   /* a str, or NULL */
    Py_ssize_t length;
} CachedTag;

typedef struct {
    PyObject_HEAD
    PyObject *budgets, *live, *frames; /* the validator's dicts */
    PyTypeObject *alloc_type, *free_type;
    Py_ssize_t line_limit, max_frames;
    /* the sink, a replay's tables (all NULL without one) */
    PyObject *members, *blocks, *stacks, *clock, *deny;
    Py_ssize_t clock_now;         /* the offset of the clock's `now` (a C double), or 0 */
    PyTypeObject *member_type;    /* the members' class, once one was seen, and the */
    Py_ssize_t member_budget, member_open; /* offsets of its two slots (or 0) */
    /* what scan() reached: read by the reader after each call, even one that raised */
    Py_ssize_t position;
    i64 lines, bytes_read;
    int stopped;
    CachedTag tags[TAG_CACHE];
} ScannerObject;

enum { STOP_END, STOP_LINE, STOP_EVENT }; /* why scan() returned (see Scanner.stopped) */

static int Scanner_traverse(ScannerObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->budgets);
    Py_VISIT(self->live);
    Py_VISIT(self->frames);
    Py_VISIT(self->alloc_type);
    Py_VISIT(self->free_type);
    Py_VISIT(self->members);
    Py_VISIT(self->blocks);
    Py_VISIT(self->stacks);
    Py_VISIT(self->clock);
    Py_VISIT(self->deny);
    Py_VISIT(self->member_type);
    return 0;
}

static int Scanner_clear(ScannerObject *self) {
    Py_CLEAR(self->budgets);
    Py_CLEAR(self->live);
    Py_CLEAR(self->frames);
    Py_CLEAR(self->alloc_type);
    Py_CLEAR(self->free_type);
    Py_CLEAR(self->members);
    Py_CLEAR(self->blocks);
    Py_CLEAR(self->stacks);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->deny);
    Py_CLEAR(self->member_type);
    for (int i = 0; i < TAG_CACHE; i++) Py_CLEAR(self->tags[i].text);
    return 0;
}

static void Scanner_dealloc(ScannerObject *self) {
    PyObject_GC_UnTrack(self);
    Scanner_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Where instances of `type` keep attribute `name` when it is a writable member of kind
 * `kind` (T_DOUBLE; T_OBJECT_EX for a __slots__ entry): its offset; 0 for any other
 * attribute (then read and written the generic way). */
static Py_ssize_t member_offset(PyTypeObject *type, PyObject *name, int kind) {
    PyObject *found = PyObject_GetAttr((PyObject *)type, name);
    if (found == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t offset = 0;
    if (Py_IS_TYPE(found, &PyMemberDescr_Type)) {
        PyMemberDef *def = ((PyMemberDescrObject *)found)->d_member;
        if (def->type == kind && !(def->flags & READONLY) &&
            PyType_IsSubtype(type, PyDescr_TYPE(found)) && def->offset > 0)
            offset = def->offset;
    }
    Py_DECREF(found);
    return offset;
}

/* A named tuple class the scanner may make instances of the way tuple.__new__ does. */
static int plain_tuple_class(PyObject *cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) return 0;
    PyTypeObject *type = (PyTypeObject *)cls;
    return type->tp_basicsize == PyTuple_Type.tp_basicsize &&
           type->tp_itemsize == PyTuple_Type.tp_itemsize;
}

static int Scanner_init(ScannerObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"budgets", "live", "frames", "alloc", "free", "line_limit",
                            "max_frames", "sink", NULL};
    PyObject *budgets, *live, *frames, *alloc, *free_, *sink = Py_None;
    Py_ssize_t line_limit, max_frames;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!OOnn|O", names, &PyDict_Type, &budgets,
                                     &PyDict_Type, &live, &PyDict_Type, &frames, &alloc, &free_,
                                     &line_limit, &max_frames, &sink))
        return -1;
    if (!plain_tuple_class(alloc) || !plain_tuple_class(free_)) {
        PyErr_SetString(PyExc_TypeError, "alloc and free must be named tuple classes");
        return -1;
    }
    PyObject *members = NULL, *blocks = NULL, *stacks = NULL, *clock = NULL, *deny = NULL;
    if (sink != Py_None) {
        if (!PyArg_ParseTuple(sink, "O!O!O!OO;sink must be (members, blocks, stacks, clock, "
                              "deny)", &PyDict_Type, &members, &PyDict_Type, &blocks,
                              &PyDict_Type, &stacks, &clock, &deny))
            return -1;
        if (!PyCallable_Check(deny)) {
            PyErr_SetString(PyExc_TypeError, "the sink's deny must be callable");
            return -1;
        }
    }
    Scanner_clear(self);
    self->budgets = Py_NewRef(budgets);
    self->live = Py_NewRef(live);
    self->frames = Py_NewRef(frames);
    self->alloc_type = (PyTypeObject *)Py_NewRef(alloc);
    self->free_type = (PyTypeObject *)Py_NewRef(free_);
    self->members = Py_XNewRef(members);
    self->blocks = Py_XNewRef(blocks);
    self->stacks = Py_XNewRef(stacks);
    self->clock = Py_XNewRef(clock);
    self->deny = Py_XNewRef(deny);
    self->line_limit = line_limit;
    self->max_frames = max_frames;
    self->clock_now = clock != NULL ? member_offset(Py_TYPE(clock), s_now, T_DOUBLE) : 0;
    return 0;
}

/* The tag's str: recent ASCII tags come from the cache (the same object each time, its
 * hash kept), others are decoded (NULL and no error: not UTF-8, Python's to refuse). */
static PyObject *tag_text(ScannerObject *self, const Value *v) {
    if (!v->ascii) {
        PyObject *text = PyUnicode_DecodeUTF8(v->text, v->length, "strict");
        if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
        return text;
    }
    uint32_t hash = 2166136261u;
    for (Py_ssize_t i = 0; i < v->length; i++) hash = (hash ^ (unsigned char)v->text[i]) * 16777619u;
    CachedTag *slot = &self->tags[hash % TAG_CACHE];
    if (slot->text != NULL && slot->length == v->length &&
        memcmp(PyUnicode_DATA(slot->text), v->text, (size_t)v->length) == 0)
        return Py_NewRef(slot->text);
    PyObject *text = PyUnicode_DecodeASCII(v->text, v->length, "strict");
    if (text == NULL) return NULL;
    Py_XSETREF(slot->text, Py_NewRef(text));
    slot->length = v->length;
    return text;
}

/* A stack's frame texts; NULL and no error where an id names no frame (Python's). */
static PyObject *stack_frames(ScannerObject *self, const Value *v) {
    if (v->length > self->max_frames) return NULL;
    PyObject *stack = PyTuple_New(v->length);
    if (stack == NULL) return NULL;
    const char *p = v->text;
    for (Py_ssize_t i = 0; i < v->length; i++) {
        Value id;
        p = parse_number(skip_space(p), v->stop, &id); /* as parse_ids read it */
        PyObject *key = PyLong_FromLongLong(id.integer);
        PyObject *frame = key ? PyDict_GetItemWithError(self->frames, key) : NULL;
        Py_XDECREF(key);
        if (frame == NULL) {
            Py_DECREF(stack);
            return NULL;
        }
        PyTuple_SET_ITEM(stack, i, Py_NewRef(frame));
        p = skip_space(p) + 1; /* past ',' or ']' */
    }
    return stack;
}

static PyObject *make_event(PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    PyObject *event = type->tp_alloc(type, n);
    if (event == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(event, i, Py_NewRef(items[i]));
    return event;
}

/* The value of key k when it is an integer in [0, 2**63). */
static inline int plain_int(const Line *line, int k) {
    return (line->seen & (1u << k)) && line->v[k].kind == V_INT && !line->v[k].big;
}

static inline int absent_or_null(const Line *line, int k) {
    return !(line->seen & (1u << k)) || line->v[k].kind == V_NULL;
}

/* The line's time, as the checks read it: an integer or a float, finite and >= 0. */
static int line_time(const Line *line, double *t) {
    const Value *v = &line->v[K_T];
    if (!(line->seen & (1u << K_T))) return 0;
    if (v->kind == V_INT && !v->big) *t = (double)v->integer;
    else if (v->kind == V_FLOAT && !v->big && v->real >= 0.0 && v->real < Py_HUGE_VAL) *t = v->real;
    else return 0;
    return 1;
}

static int set_clock(ScannerObject *self, double t) {
    if (self->clock_now) {
        *(double *)((char *)self->clock + self->clock_now) = t;
        return 0;
    }
    PyObject *now = PyFloat_FromDouble(t);
    int failed = now == NULL ? -1 : PyObject_SetAttr(self->clock, s_now, now);
    Py_XDECREF(now);
    return failed;
}

/* A member's slot (`budget` or `open`), a new reference; NULL with an error if unset. */
static PyObject *member_slot(ScannerObject *self, PyObject *member, PyObject *name) {
    if (Py_TYPE(member) != self->member_type) {
        Py_XSETREF(self->member_type, (PyTypeObject *)Py_NewRef(Py_TYPE(member)));
        self->member_budget = member_offset(self->member_type, s_budget, T_OBJECT_EX);
        self->member_open = member_offset(self->member_type, s_open, T_OBJECT_EX);
    }
    Py_ssize_t offset = name == s_budget ? self->member_budget : self->member_open;
    PyObject *value = offset ? *(PyObject **)((char *)member + offset) : NULL;
    return value != NULL ? Py_NewRef(value) : PyObject_GetAttr(member, name);
}

/* Replay a granted allocation: 1 done, 0 not for the sink (the caller returns the event),
 * -1 an error. */
static int sink_alloc(ScannerObject *self, double t, PyObject *b, PyObject *size,
                      PyObject *align, PyObject *tag, PyObject *ptr, PyObject *nbytes,
                      PyObject *stack) {
    PyObject *member = PyDict_GetItemWithError(self->members, b);
    if (member == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(member);
    int done = 0;
    PyObject *budget = NULL, *open = NULL, *address = NULL;
    if (tag == Py_None) goto out; /* the label of the member's context: Python's */
    if ((open = member_slot(self, member, s_open)) == NULL) goto error;
    if (open != Py_True) goto out; /* refused, exited or released: Python's */
    if ((budget = member_slot(self, member, s_budget)) == NULL) goto error;
    if (budget == Py_None) goto out;
    if (set_clock(self, t) < 0) goto error;
    PyObject *call[5] = {NULL, budget, size, align, tag};
    address = PyObject_VectorcallMethod(s_allocate, call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                        kw_tag);
    if (address == NULL) goto error;
    if (address == Py_None) {
        PyObject *denied = PyObject_CallFunctionObjArgs(self->deny, member, nbytes, NULL);
        if (denied == NULL) goto error;
        Py_DECREF(denied);
    } else {
        PyObject *block = PyTuple_Pack(3, member, address, nbytes);
        if (block == NULL) goto error;
        int stored = PyDict_SetItem(self->blocks, ptr, block);
        Py_DECREF(block);
        if (stored < 0 || (stack != Py_None && PyDict_SetItem(self->stacks, address, stack) < 0))
            goto error;
    }
    done = 1;
    goto out;
error:
    done = -1;
out:
    Py_XDECREF(address);
    Py_XDECREF(budget);
    Py_XDECREF(open);
    Py_DECREF(member);
    return done;
}

/* dict.pop(key, None) with None as NULL: a new reference; NULL (with no error) if absent. */
static PyObject *dict_pop(PyObject *dict, PyObject *key) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *value;
    return PyDict_Pop(dict, key, &value) < 0 ? NULL : value;
#else
    PyObject *value = _PyDict_Pop(dict, key, Py_None);
    if (value == Py_None) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
#endif
}

/* Replay a free (the replay's Python loop does the same): 0 done, -1 an error. */
static int sink_free(ScannerObject *self, double t, PyObject *ptr) {
    if (set_clock(self, t) < 0) return -1;
    PyObject *found = dict_pop(self->blocks, ptr);
    if (found == NULL) return PyErr_Occurred() ? -1 : 0;
    int result = -1;
    PyObject *budget = NULL;
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) < 2) {
        PyErr_SetString(PyExc_TypeError, "a replay's block must be (member, address, bytes)");
        goto out;
    }
    PyObject *address = PyTuple_GET_ITEM(found, 1);
    if ((budget = member_slot(self, PyTuple_GET_ITEM(found, 0), s_budget)) == NULL) goto out;
    if (budget != Py_None) {
        PyObject *call[3] = {NULL, budget, address};
        PyObject *freed = PyObject_VectorcallMethod(s_free, call + 1,
                                                    2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (freed == NULL) goto out;
        Py_DECREF(freed);
        if (PyDict_GET_SIZE(self->stacks) && PyDict_DelItem(self->stacks, address) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto out;
            PyErr_Clear();
        }
    }
    result = 0;
out:
    Py_XDECREF(budget);
    Py_DECREF(found);
    return result;
}

/* The line of `length` bytes is taken (the validator's tables changed): count it, before
 * replaying it (which may raise, and end the reading there). */
static inline void count_line(ScannerObject *self, Py_ssize_t length) {
    self->position += length;
    self->lines++;
    self->bytes_read += length;
}

/* Take one parsed line of `length` bytes: 1 taken (its event appended to `events`, or
 * replayed), 0 left to Python, 2 taken and returned for the replay's Python loop, -1 an
 * error. The validator's tables change, and the line is counted, only when it is taken. */
static int take(ScannerObject *self, const Line *line, Py_ssize_t length, PyObject *events) {
    const Value *ev = &line->v[K_EV];
    double time;
    if (!(line->seen & (1u << K_EV)) || ev->kind != V_STRING || !line_time(line, &time) ||
        !plain_int(line, K_B) || !plain_int(line, K_PTR))
        return 0;
    int is_alloc = ev->length == 5 && memcmp(ev->text, "alloc", 5) == 0;
    int is_free = ev->length == 4 && memcmp(ev->text, "free", 4) == 0;
    i64 size = 0, align = 0, nbytes = 0;
    if (is_alloc) {
        if (!plain_int(line, K_SIZE) || !plain_int(line, K_ALIGN) || !absent_or_null(line, K_REASON))
            return 0;
        size = line->v[K_SIZE].integer;
        align = line->v[K_ALIGN].integer;
        if (size < 1 || (align & (align - 1))) return 0;
        nbytes = size;
        if (!absent_or_null(line, K_BYTES)) {
            if (!plain_int(line, K_BYTES) || line->v[K_BYTES].integer < size) return 0;
            nbytes = line->v[K_BYTES].integer;
        }
        if (!absent_or_null(line, K_TAG) && line->v[K_TAG].kind != V_STRING) return 0;
        if (!absent_or_null(line, K_STACK) && line->v[K_STACK].kind != V_LIST) return 0;
    } else if (!is_free || ((line->seen & (1u << K_TAG)) && line->v[K_TAG].kind == V_STRING &&
                            !line->v[K_TAG].ascii)) {
        return 0; /* a free's tag is not read: its UTF-8 is Python's to check */
    }
    int result = -1;
    PyObject *b = NULL, *ptr = NULL, *t = NULL, *holder = NULL, *event = NULL;
    PyObject *osize = NULL, *oalign = NULL, *onbytes = NULL, *tag = NULL, *stack = NULL;
    if ((b = PyLong_FromLongLong(line->v[K_B].integer)) == NULL ||
        (ptr = PyLong_FromLongLong(line->v[K_PTR].integer)) == NULL)
        goto out;
    if (is_free) {
        holder = dict_pop(self->live, ptr);
        if (holder == NULL) { /* not live: Python's message */
            result = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        int same = holder == b ? 1 : PyObject_RichCompareBool(holder, b, Py_EQ);
        if (same <= 0) { /* another budget's block: put it back, for Python's message */
            result = PyDict_SetItem(self->live, ptr, holder) < 0 ? -1 : same;
            Py_DECREF(holder);
            goto out;
        }
        Py_DECREF(holder);
        count_line(self, length);
        if (self->members != NULL) {
            result = sink_free(self, time, ptr) < 0 ? -1 : 1;
            goto out;
        }
        if ((t = PyFloat_FromDouble(time)) == NULL) goto out;
        PyObject *items[3] = {t, b, ptr};
        event = make_event(self->free_type, items, 3);
    } else {
        int known = PyDict_Contains(self->budgets, b);
        if (known <= 0) {
            result = known; /* 0: not entered: Python's message */
            goto out;
        }
        tag = absent_or_null(line, K_TAG) ? Py_NewRef(Py_None) : tag_text(self, &line->v[K_TAG]);
        stack = absent_or_null(line, K_STACK) ? Py_NewRef(Py_None)
                                              : stack_frames(self, &line->v[K_STACK]);
        if (tag == NULL || stack == NULL) {
            result = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        if ((osize = PyLong_FromLongLong(size)) == NULL ||
            (oalign = PyLong_FromLongLong(align)) == NULL ||
            (onbytes = nbytes == size ? Py_NewRef(osize) : PyLong_FromLongLong(nbytes)) == NULL)
            goto out;
        Py_ssize_t before = PyDict_GET_SIZE(self->live);
        if (PyDict_SetDefault(self->live, ptr, b) == NULL) goto out;
        if (PyDict_GET_SIZE(self->live) == before) {
            result = 0; /* live already: Python decides (another tree's block, or wrong) */
            goto out;
        }
        count_line(self, length);
        if (self->members != NULL) {
            int sunk = sink_alloc(self, time, b, osize, oalign, tag, ptr, onbytes, stack);
            if (sunk != 0) {
                result = sunk;
                goto out;
            }
        }
        if ((t = PyFloat_FromDouble(time)) == NULL) goto out;
        PyObject *items[9] = {t, b, osize, oalign, tag, ptr, onbytes, Py_None, stack};
        event = make_event(self->alloc_type, items, 9);
    }
    if (event == NULL || PyList_Append(events, event) < 0) goto out;
    result = self->members != NULL ? 2 : 1;
out:
    Py_XDECREF(event);
    Py_XDECREF(stack);
    Py_XDECREF(tag);
    Py_XDECREF(onbytes);
    Py_XDECREF(oalign);
    Py_XDECREF(osize);
    Py_XDECREF(t);
    Py_XDECREF(ptr);
    Py_XDECREF(b);
    return result;
}

static PyObject *Scanner_scan(ScannerObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    i64 position, lines, bytes_read, stop_lines, max_bytes;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "scan(buffer, position, lines, bytes_read, "
                        "stop_lines, max_bytes)");
        return NULL;
    }
    i64 *numbers[5] = {&position, &lines, &bytes_read, &stop_lines, &max_bytes};
    for (int i = 0; i < 5; i++)
        if ((*numbers[i] = PyLong_AsLongLong(args[i + 1])) == -1 && PyErr_Occurred()) return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *events = PyList_New(0);
    if (events == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *data = view.buf, *end = data + view.len;
    if (position < 0 || position > (i64)view.len) position = view.len;
    self->position = (Py_ssize_t)position;
    self->lines = lines;
    self->bytes_read = bytes_read;
    self->stopped = STOP_END;
    Line line;
    while (position < view.len) {
        const char *start = data + position;
        const char *newline = memchr(start, '\n', (size_t)(end - start));
        if (newline == NULL) break; /* the rest is the start of a line: Python reads it */
        Py_ssize_t length = newline - start + 1;
        /* Python counts lines, bytes and progress, and says what is wrong: a blank line, a
         * line over the limits, the line at which progress is told, any line not taken */
        if (length == 1 || length > self->line_limit || self->lines + 1 >= stop_lines ||
            self->bytes_read + length > max_bytes || !parse_line(start, newline, &line)) {
            self->stopped = STOP_LINE;
            break;
        }
        int taken = take(self, &line, length, events);
        if (taken < 0) goto error;
        if (taken == 0) {
            self->stopped = STOP_LINE;
            break;
        }
        position = self->position;
        if (taken == 2) {
            self->stopped = STOP_EVENT;
            break;
        }
    }
    PyBuffer_Release(&view);
    return events;
error:
    PyBuffer_Release(&view);
    Py_DECREF(events);
    return NULL;
}

static PyMethodDef Scanner_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))Scanner_scan, METH_FASTCALL,
     "scan(buffer, position, lines, bytes_read, stop_lines, max_bytes) -> list of events\n\n"
     "Take the lines of buffer from position on, up to the first one left to Python (see "
     "the module's docstring); position, lines and bytes_read then say how far it went."},
    {NULL}};

static PyMemberDef Scanner_members[] = {
    {"position", T_PYSSIZET, offsetof(ScannerObject, position), READONLY,
     "Where the last scan stopped in its buffer."},
    {"lines", T_LONGLONG, offsetof(ScannerObject, lines), READONLY, "Lines read in all."},
    {"bytes_read", T_LONGLONG, offsetof(ScannerObject, bytes_read), READONLY,
     "Bytes read in all."},
    {"stopped", T_INT, offsetof(ScannerObject, stopped), READONLY,
     "Why the last scan stopped: 0 the buffer ended, 1 at a line for Python, 2 after an "
     "event the sink returned."},
    {NULL}};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpubudget.tracefile._scan.Scanner",
    .tp_basicsize = sizeof(ScannerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Scanner(budgets, live, frames, alloc, free, line_limit, max_frames, sink=None)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_traverse = (traverseproc)Scanner_traverse,
    .tp_clear = (inquiry)Scanner_clear,
    .tp_methods = Scanner_methods,
    .tp_members = Scanner_members,
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT, "_scan",
    "Granted allocations and frees of a trace read, checked and replayed in C (see "
    "gpubudget.tracefile.fastparse).",
    -1, NULL};

PyMODINIT_FUNC PyInit__scan(void) {
    if (PyType_Ready(&ScannerType) < 0) return NULL;
    if ((s_budget = PyUnicode_InternFromString("budget")) == NULL ||
        (s_open = PyUnicode_InternFromString("open")) == NULL ||
        (s_now = PyUnicode_InternFromString("now")) == NULL ||
        (s_allocate = PyUnicode_InternFromString("allocate")) == NULL ||
        (s_free = PyUnicode_InternFromString("free")) == NULL ||
        (s_tag = PyUnicode_InternFromString("tag")) == NULL ||
        (kw_tag = PyTuple_Pack(1, s_tag)) == NULL) /* interned: compared by identity */
        return NULL;
    PyObject *module = PyModule_Create(&scan_module);
    if (module == NULL) return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(module, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
