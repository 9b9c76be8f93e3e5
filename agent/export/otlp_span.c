/* OTLP/JSON text of finished SDK spans, for agent/export/otlp_json.py `spans_to_line`; and their
 * OTLP protobuf Span messages (encode_pb, below), for agent/export/otlp_proto.py.
 *
 * The export thread encodes every span the agent makes (~18 per request at the reference load);
 * in Python that was ~13 µs a span on a quiet machine and ~30 in the agent beside its main loop.
 * This writes the same text, byte for byte, for the spans the agent makes: a context without
 * trace state, attributes in a plain dict (or the shared set, agent/export/spans.py) whose values
 * are ASCII str, bool, int within int64, float, None, or lists/tuples of those. Events and links
 * are written by Python callbacks (they are few, and their attributes are BoundedAttributes): a
 * step span's one device-memory event used to send the whole span, the largest the agent makes,
 * to the Python encoder (a third of the export thread's CPU at the reference load). Any
 * other span — and any span where something is not as expected — is handed to the Python encoder
 * (`fallback`), which also decides what an unencodable attribute becomes (left out and logged). So
 * this can only ever be faster, never different: tests/export compares both with the protobuf
 * route.
 *
 * encode(spans, fallback, link_text, event_text, shared_type, span_type) -> str: the span texts
 * joined by ",";
 * only spans of exactly span_type (the SDK's ReadableSpan) are taken.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "double_repr.h"

/* The text is written either into memory of its own (data) or, where the caller wants bytes,
 * straight into the bytes object it returns (bytes: no copy of a ~0.1-1 MB text at the end, and
 * none of the page faults of that copy's fresh memory). */
typedef struct {
    char *data;
    size_t len, cap;
    PyObject *bytes; /* NULL, or the bytes object data lives in (its size is cap until the end) */
} Buf;

/* buf_reserve's growing half (apart, so that the check inlines: it runs for every piece written). */
static int buf_grow(Buf *b, size_t extra) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    if (b->bytes != NULL) {
        if (_PyBytes_Resize(&b->bytes, (Py_ssize_t)cap) < 0) return -1; /* (frees it on failure) */
        b->data = PyBytes_AS_STRING(b->bytes);
    } else {
        char *data = PyMem_Realloc(b->data, cap);
        if (!data) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
    }
    b->cap = cap;
    return 0;
}

static inline int buf_reserve(Buf *b, size_t extra) { return b->len + extra <= b->cap ? 0 : buf_grow(b, extra); }

/* The room a new text starts with: about the last one's size (a batch's text is ~0.1-0.5 MB; grown
 * from 4 KB it was copied a dozen times), at most 64 MB. */
static size_t size_hint(size_t last_len) {
    size_t hint = last_len + last_len / 8;
    return hint > ((size_t)64 << 20) ? (size_t)64 << 20 : hint;
}

/* A Buf that writes into a new bytes object of `cap` bytes (at least 4 KB). */
static int buf_into_bytes(Buf *b, size_t cap) {
    if (cap < 4096) cap = 4096;
    b->bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    if (b->bytes == NULL) return -1;
    b->data = PyBytes_AS_STRING(b->bytes);
    b->len = 0;
    b->cap = cap;
    return 0;
}

static int buf_add(Buf *b, const char *s, size_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

#define ADD_LIT(b, lit) buf_add((b), (lit), sizeof(lit) - 1)

/* v as 16 lowercase hex digits, as "%016llx" writes it (snprintf was ~2 % of the agent's main
 * thread at the reference load: three ids a span). */
static int buf_hex16(Buf *b, unsigned long long v) {
    static const char digits[] = "0123456789abcdef";
    if (buf_reserve(b, 16) < 0) return -1;
    char *p = b->data + b->len;
    for (int i = 15; i >= 0; i--) {
        p[i] = digits[v & 0xf];
        v >>= 4;
    }
    b->len += 16;
    return 0;
}

/* Decimal text of v, as "%lld" writes it (snprintf was most of an int array's cost: a layer span
 * carries two E-long arrays of counts). */
static int buf_fmt_i64(Buf *b, long long v) {
    char tmp[24];
    char *end = tmp + sizeof tmp, *p = end;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *--p = '-';
    return buf_add(b, p, (size_t)(end - p));
}

/* Result of an encoding step: OK, NOT_MINE (hand the span to Python; no exception set), ERROR. */
enum { OK = 0, NOT_MINE = 1, ERROR = -1 };

static PyObject *s_context, *s_parent, *s_name, *s_kind, *s_start, *s_end, *s_attributes, *s_events,
    *s_links, *s_status, *s_status_code, *s_description, *s_value, *s_text, *sixty_four;

/* The type of a span already written as OTLP/JSON text (agent/export/spans.py EncodedSpan; its
 * `_text` is the bytes add_span would write for it): encode() appends the text as it is. */
static PyObject *encoded_type;

/* After a failed lookup or conversion: an AttributeError, TypeError, ValueError or OverflowError
 * means "not a span this takes" (Python's encoder decides); anything else (MemoryError, an
 * interrupt) is an error that propagates. */
static int not_mine_or_error(void) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
        PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        return NOT_MINE;
    }
    return ERROR;
}

/* An ASCII str as json.encoder.encode_basestring_ascii writes it; NOT_MINE for a non-ASCII one. */
static int add_string(Buf *b, PyObject *s) {
    if (!PyUnicode_CheckExact(s) || !PyUnicode_IS_ASCII(s)) return NOT_MINE;
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    const unsigned char *p = (const unsigned char *)PyUnicode_DATA(s);
    if (buf_reserve(b, (size_t)n * 6 + 2) < 0) return ERROR;
    char *out = b->data + b->len;
    static const char hex[] = "0123456789abcdef";
    *out++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (c >= ' ' && c <= '~' && c != '\\' && c != '"') {
            *out++ = (char)c;
            continue;
        }
        *out++ = '\\';
        switch (c) {
            case '\\': *out++ = '\\'; break;
            case '"': *out++ = '"'; break;
            case '\b': *out++ = 'b'; break;
            case '\f': *out++ = 'f'; break;
            case '\n': *out++ = 'n'; break;
            case '\r': *out++ = 'r'; break;
            case '\t': *out++ = 't'; break;
            default:
                *out++ = 'u';
                *out++ = '0';
                *out++ = '0';
                *out++ = hex[c >> 4];
                *out++ = hex[c & 0xf];
        }
    }
    *out++ = '"';
    b->len = (size_t)(out - b->data);
    return OK;
}

/* Whether double_repr's tables are ready (else CPython's formatter: the same text, slower). */
static int fast_doubles;

/* A finite float as float.__repr__, a non-finite one as the quoted OTLP/JSON names. */
static int add_double(Buf *b, double v) {
    if (isnan(v)) return ADD_LIT(b, "\"NaN\"") < 0 ? ERROR : OK;
    if (isinf(v)) return (v > 0 ? ADD_LIT(b, "\"Infinity\"") : ADD_LIT(b, "\"-Infinity\"")) < 0 ? ERROR : OK;
    if (fast_doubles) {
        char text[DOUBLE_REPR_MAX];
        return buf_add(b, text, double_repr(v, text)) < 0 ? ERROR : OK;
    }
    char *text = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!text) return ERROR;
    int rc = buf_add(b, text, strlen(text)) < 0 ? ERROR : OK;
    PyMem_Free(text);
    return rc;
}

/* One AnyValue (otlp_json._any_value) for the value types this takes; NOT_MINE for the others,
 * and for an int outside int64 (Python leaves that attribute out and logs it). */
static int add_any_value(Buf *b, PyObject *v, int depth) {
    if (PyUnicode_CheckExact(v)) {
        if (ADD_LIT(b, "{\"stringValue\":") < 0) return ERROR;
        int rc = add_string(b, v);
        if (rc != OK) return rc;
        return ADD_LIT(b, "}") < 0 ? ERROR : OK;
    }
    if (PyBool_Check(v)) return (v == Py_True ? ADD_LIT(b, "{\"boolValue\":true}") : ADD_LIT(b, "{\"boolValue\":false}")) < 0 ? ERROR : OK;
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return NOT_MINE;
        if (x == -1 && PyErr_Occurred()) return ERROR;
        if (ADD_LIT(b, "{\"intValue\":\"") < 0 || buf_fmt_i64(b, x) < 0 || ADD_LIT(b, "\"}") < 0) return ERROR;
        return OK;
    }
    if (PyFloat_CheckExact(v)) {
        if (ADD_LIT(b, "{\"doubleValue\":") < 0) return ERROR;
        int rc = add_double(b, PyFloat_AS_DOUBLE(v));
        if (rc != OK) return rc;
        return ADD_LIT(b, "}") < 0 ? ERROR : OK;
    }
    if (v == Py_None) return ADD_LIT(b, "{}") < 0 ? ERROR : OK;
    if ((PyTuple_CheckExact(v) || PyList_CheckExact(v)) && depth < 8) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        if (n == 0) return ADD_LIT(b, "{\"arrayValue\":{}}") < 0 ? ERROR : OK;
        if (ADD_LIT(b, "{\"arrayValue\":{\"values\":[") < 0) return ERROR;
        PyObject **items = PySequence_Fast_ITEMS(v);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i && ADD_LIT(b, ",") < 0) return ERROR;
            int rc = add_any_value(b, items[i], depth + 1);
            if (rc != OK) return rc;
        }
        return ADD_LIT(b, "]}}") < 0 ? ERROR : OK;
    }
    return NOT_MINE;
}

static int add_attributes(Buf *b, PyObject *attrs) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int first = 1;
    if (ADD_LIT(b, ",\"attributes\":[") < 0) return ERROR;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) return NOT_MINE;
        if (!first && ADD_LIT(b, ",") < 0) return ERROR;
        first = 0;
        if (PyUnicode_GET_LENGTH(key) == 0) {
            if (ADD_LIT(b, "{\"value\":") < 0) return ERROR;
        } else {
            if (ADD_LIT(b, "{\"key\":") < 0) return ERROR;
            int rc = add_string(b, key);
            if (rc != OK) return rc;
            if (ADD_LIT(b, ",\"value\":") < 0) return ERROR;
        }
        int rc = add_any_value(b, value, 0);
        if (rc != OK) return rc;
        if (ADD_LIT(b, "}") < 0) return ERROR;
    }
    return ADD_LIT(b, "]") < 0 ? ERROR : OK;
}

/* A SpanContext's span id (the tuple: trace_id, span_id, is_remote, flags, trace_state, ...). */
static int context_span_id(PyObject *ctx, unsigned long long *span) {
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 5) return NOT_MINE;
    PyObject *span_id = PyTuple_GET_ITEM(ctx, 1);
    if (!PyLong_CheckExact(span_id)) return NOT_MINE;
    *span = PyLong_AsUnsignedLongLong(span_id); /* negative or past 64 bits: Python's then */
    if (*span == (unsigned long long)-1 && PyErr_Occurred()) return not_mine_or_error();
    return OK;
}

/* Its trace id as two 64-bit halves and its span id. */
static int context_ids(PyObject *ctx, unsigned long long *hi, unsigned long long *lo, unsigned long long *span) {
    int rc = context_span_id(ctx, span);
    if (rc != OK) return rc;
    PyObject *trace_id = PyTuple_GET_ITEM(ctx, 0);
    if (!PyLong_CheckExact(trace_id)) return NOT_MINE;
    *lo = PyLong_AsUnsignedLongLongMask(trace_id);
    if (*lo == (unsigned long long)-1 && PyErr_Occurred()) return not_mine_or_error();
    PyObject *high = PyNumber_Rshift(trace_id, sixty_four);
    if (!high) return not_mine_or_error();
    *hi = PyLong_AsUnsignedLongLong(high); /* a negative or > 128-bit id fails here: Python's then */
    Py_DECREF(high);
    if (*hi == (unsigned long long)-1 && PyErr_Occurred()) return not_mine_or_error();
    return OK;
}

static int add_flags(Buf *b, PyObject *ctx) {
    int remote = 0;
    if (ctx != Py_None) {
        if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 5) return NOT_MINE;
        PyObject *is_remote = PyTuple_GET_ITEM(ctx, 2);
        remote = PyObject_IsTrue(is_remote);
        if (remote < 0) return ERROR;
    }
    return (remote ? ADD_LIT(b, "768") : ADD_LIT(b, "256")) < 0 ? ERROR : OK;
}

static int add_time(Buf *b, const char *field, size_t field_len, PyObject *t) {
    if (t == Py_None) return OK;
    if (!PyLong_CheckExact(t)) return NOT_MINE;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (overflow) return NOT_MINE;
    if (v == -1 && PyErr_Occurred()) return ERROR;
    if (v == 0) return OK; /* `if span.start_time:` */
    if (buf_add(b, field, field_len) < 0 || buf_fmt_i64(b, v) < 0 || ADD_LIT(b, "\"") < 0) return ERROR;
    return OK;
}

/* Small int attribute of an object (an enum's value: an exact int in 0..1023). */
static int int_attr(PyObject *obj, PyObject *name, long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return not_mine_or_error();
    if (!PyLong_CheckExact(v)) {
        Py_DECREF(v);
        return NOT_MINE;
    }
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    if (*out == -1 && PyErr_Occurred()) return not_mine_or_error();
    return (*out >= 0 && *out < 1024) ? OK : NOT_MINE;
}

/* Enum members (SpanKind, StatusCode) and status objects with no message (the factory's shared
 * UNSET) are a handful of immutable objects on every span, whose fields are Python properties (~1 us
 * a span in all): their values are remembered by identity, each object held so its address is never
 * another's. */
#define MEMO_SLOTS 8
typedef struct {
    PyObject *key[MEMO_SLOTS];
    long value[MEMO_SLOTS];
    int next;
} Memo;
static Memo member_values, status_codes;
static PyObject *enum_type;

static int memo_get(const Memo *m, PyObject *key, long *out) {
    for (int i = 0; i < MEMO_SLOTS; i++) {
        if (m->key[i] == key) {
            *out = m->value[i];
            return 1;
        }
    }
    return 0;
}

static void memo_put(Memo *m, PyObject *key, long value) {
    int i = m->next;
    m->next = (i + 1) % MEMO_SLOTS;
    Py_INCREF(key);
    Py_XSETREF(m->key[i], key);
    m->value[i] = value;
}

/* opentelemetry.trace.Status (its fields have no setters), imported at the first status read;
 * NULL where it cannot be (nothing is remembered then) */
static PyTypeObject *otel_status_type(void) {
    static PyObject *type;
    static int tried;
    if (!tried) {
        tried = 1;
        PyObject *module = PyImport_ImportModule("opentelemetry.trace.status");
        type = module ? PyObject_GetAttrString(module, "Status") : NULL;
        Py_XDECREF(module);
        if (!type || !PyType_Check(type)) {
            PyErr_Clear();
            Py_CLEAR(type);
        }
    }
    return (PyTypeObject *)type;
}

/* member.value of an enum member (remembered), int_attr(obj, "value") of anything else */
static int member_value(PyObject *member, long *out) {
    if (memo_get(&member_values, member, out)) return OK;
    int rc = int_attr(member, s_value, out);
    if (rc != OK) return rc;
    int is_member = PyObject_IsInstance(member, enum_type);
    if (is_member < 0) return not_mine_or_error();
    if (is_member) memo_put(&member_values, member, *out);
    return OK;
}

typedef struct {
    PyObject *context, *parent, *name, *kind, *start, *end, *attributes, *events, *links, *status;
} Fields;

static void fields_clear(Fields *f) {
    Py_XDECREF(f->context);
    Py_XDECREF(f->parent);
    Py_XDECREF(f->name);
    Py_XDECREF(f->kind);
    Py_XDECREF(f->start);
    Py_XDECREF(f->end);
    Py_XDECREF(f->attributes);
    Py_XDECREF(f->events);
    Py_XDECREF(f->links);
    Py_XDECREF(f->status);
}

static int fields_get(PyObject *span, Fields *f) {
    memset(f, 0, sizeof *f);
    PyObject **slots[] = {&f->context, &f->parent, &f->name, &f->kind, &f->start, &f->end, &f->attributes,
                          &f->events, &f->links, &f->status};
    PyObject *names[] = {s_context, s_parent, s_name, s_kind, s_start, s_end, s_attributes, s_events, s_links,
                         s_status};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
        *slots[i] = PyObject_GetAttr(span, names[i]);
        if (!*slots[i]) return not_mine_or_error();
    }
    return OK;
}

/* The status's code and its message (a new reference: a str, or NULL for none). */
static int status_fields(PyObject *status, long *code, PyObject **message) {
    *message = NULL;
    if (memo_get(&status_codes, status, code)) return OK; /* (a status remembered has no message) */
    PyObject *code_obj = PyObject_GetAttr(status, s_status_code);
    if (!code_obj) return not_mine_or_error();
    int rc = member_value(code_obj, code);
    Py_DECREF(code_obj);
    if (rc != OK) return rc;
    PyObject *description = PyObject_GetAttr(status, s_description);
    if (!description) return not_mine_or_error();
    int truthy = PyObject_IsTrue(description); /* `if status.description:` */
    if (truthy < 0) {
        Py_DECREF(description);
        return not_mine_or_error();
    }
    if (!truthy) {
        Py_DECREF(description);
        if (Py_TYPE(status) == otel_status_type()) memo_put(&status_codes, status, *code); /* immutable */
        return OK;
    }
    if (!PyUnicode_CheckExact(description) || !PyUnicode_IS_ASCII(description)) {
        Py_DECREF(description);
        return NOT_MINE;
    }
    *message = description;
    return OK;
}

/* One span's text appended to b, or NOT_MINE with b as it was. Everything that can still make
 * the span Python's is decided before the first byte is written. */
/* `,"<key>":[t0,t1,...]` from text(item) for each item of a tuple (nothing when it is empty). */
static int add_texts(Buf *b, const char *key, size_t key_len, PyObject *items, PyObject *text_of) {
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    if (count == 0) return OK;
    if (buf_add(b, key, key_len) < 0) return ERROR;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i && ADD_LIT(b, ",") < 0) return ERROR;
        PyObject *text = PyObject_CallOneArg(text_of, PyTuple_GET_ITEM(items, i));
        if (!text) return ERROR;
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(text, &len);
        int added = s ? buf_add(b, s, (size_t)len) : -1;
        Py_DECREF(text);
        if (added < 0) return ERROR;
    }
    return ADD_LIT(b, "]") < 0 ? ERROR : OK;
}

/* What both encoders read of a span before writing its first byte. */
typedef struct {
    Fields f;
    PyObject *message, *links, *events; /* owned: the status message (or NULL), tuples of our own */
    unsigned long long hi, lo, span_id, parent_id;
    long kind, code;
} Taken;

static void taken_clear(Taken *t) {
    Py_XDECREF(t->message);
    Py_XDECREF(t->links);
    Py_XDECREF(t->events);
    fields_clear(&t->f);
}

/* The span's fields if the native encoders take it (OK; taken_clear after, whatever the result):
 * exactly span_type, no trace state, events and links in a tuple or list (not the SDK's
 * BoundedList, which may have dropped some), attributes in a dict or the shared set, a str name
 * (ASCII with `ascii_name`). NOT_MINE otherwise (no exception set), ERROR on an error. */
static int span_taken(PyObject *span, PyObject *shared_type, PyObject *span_type, int ascii_name, Taken *t) {
    memset(t, 0, sizeof *t);
    if ((PyObject *)Py_TYPE(span) != span_type) return NOT_MINE; /* a subclass may override a property */
    int rc = fields_get(span, &t->f);
    if (rc != OK) return rc;
    Fields *f = &t->f;
    PyObject *ctx = f->context;
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 5) return NOT_MINE;
    Py_ssize_t trace_state = PyObject_Size(PyTuple_GET_ITEM(ctx, 4));
    if (trace_state != 0) return trace_state < 0 ? not_mine_or_error() : NOT_MINE;
    if (!(PyTuple_CheckExact(f->events) || PyList_CheckExact(f->events))) return NOT_MINE;
    if (!(PyTuple_CheckExact(f->links) || PyList_CheckExact(f->links))) return NOT_MINE;
    PyObject *attrs = f->attributes;
    if (!(attrs == Py_None || PyDict_CheckExact(attrs) ||
          (PyDict_Check(attrs) && (PyObject *)Py_TYPE(attrs) == shared_type)))
        return NOT_MINE;
    if (!PyUnicode_CheckExact(f->name) || (ascii_name && !PyUnicode_IS_ASCII(f->name))) return NOT_MINE;
    if ((rc = context_ids(ctx, &t->hi, &t->lo, &t->span_id)) != OK) return rc;
    if (f->parent != Py_None && (rc = context_span_id(f->parent, &t->parent_id)) != OK) return rc;
    if ((rc = member_value(f->kind, &t->kind)) != OK) return rc;
    if ((rc = status_fields(f->status, &t->code, &t->message)) != OK) return rc;
    t->links = PySequence_Tuple(f->links); /* our own: callbacks may run other threads' code */
    t->events = t->links ? PySequence_Tuple(f->events) : NULL;
    return t->events ? OK : ERROR;
}

static int add_span(Buf *b, PyObject *span, PyObject *link_text, PyObject *event_text, PyObject *shared_type,
                    PyObject *span_type) {
    Taken t;
    size_t start_len = b->len;
    int rc = span_taken(span, shared_type, span_type, 1, &t);
    if (rc != OK) goto done;
    Fields f = t.f;
    PyObject *attrs = f.attributes, *message = t.message;
    long kind = t.kind, code = t.code;
    rc = ERROR;
    if (ADD_LIT(b, "{\"traceId\":\"") < 0 || buf_hex16(b, t.hi) < 0 || buf_hex16(b, t.lo) < 0
        || ADD_LIT(b, "\",\"spanId\":\"") < 0 || buf_hex16(b, t.span_id) < 0 || ADD_LIT(b, "\"") < 0)
        goto done;
    if (f.parent != Py_None) {
        if (ADD_LIT(b, ",\"parentSpanId\":\"") < 0 || buf_hex16(b, t.parent_id) < 0 || ADD_LIT(b, "\"") < 0)
            goto done;
    }
    if (PyUnicode_GET_LENGTH(f.name) > 0) {
        if (ADD_LIT(b, ",\"name\":") < 0) goto done;
        if ((rc = add_string(b, f.name)) != OK) goto done;
        rc = ERROR;
    }
    if (ADD_LIT(b, ",\"kind\":") < 0 || buf_fmt_i64(b, (long long)kind + 1) < 0) goto done;
#define TIME_FIELD(lit, t)                                                        \
    if ((rc = add_time(b, lit, sizeof(lit) - 1, (t))) != OK) goto done;
    TIME_FIELD(",\"startTimeUnixNano\":\"", f.start)
    TIME_FIELD(",\"endTimeUnixNano\":\"", f.end)
#undef TIME_FIELD
    if (attrs != Py_None && PyDict_GET_SIZE(attrs) > 0) {
        if ((rc = add_attributes(b, attrs)) != OK) goto done;
    }
    if ((rc = add_texts(b, ",\"events\":[", sizeof(",\"events\":[") - 1, t.events, event_text)) != OK) goto done;
    if ((rc = add_texts(b, ",\"links\":[", sizeof(",\"links\":[") - 1, t.links, link_text)) != OK) goto done;
    rc = ERROR;
    if (ADD_LIT(b, ",\"status\":{") < 0) goto done;
    if (message != NULL) {
        if (ADD_LIT(b, "\"message\":") < 0) goto done;
        if ((rc = add_string(b, message)) != OK) goto done;
        rc = ERROR;
    }
    if (code) {
        if ((message != NULL && ADD_LIT(b, ",") < 0) || ADD_LIT(b, "\"code\":") < 0
            || buf_fmt_i64(b, (long long)code) < 0)
            goto done;
    }
    if (ADD_LIT(b, "},\"flags\":") < 0) goto done;
    if ((rc = add_flags(b, f.parent)) != OK) goto done;
    rc = ADD_LIT(b, "}") < 0 ? ERROR : OK;
done:
    taken_clear(&t);
    if (rc != OK) b->len = start_len;
    return rc;
}

/* The size of the last text made (size_hint). Read and written with the GIL held. */
static size_t last_text_len;

static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *spans, *fallback, *link_text, *event_text, *shared_type, *span_type;
    Py_buffer prefix = {0}, suffix = {0};
    if (!PyArg_ParseTuple(args, "OOOOOO|y*y*:encode", &spans, &fallback, &link_text, &event_text, &shared_type,
                          &span_type, &prefix, &suffix))
        return NULL;
    /* with a prefix and a suffix: the bytes prefix + spans + suffix (the file exporter's whole line,
     * one copy of the text); without: the spans' text as a str */
    int as_bytes = prefix.buf != NULL;
    PyObject *out = NULL;
    /* a tuple of our own: the callbacks run Python code, and another thread could change a list */
    PyObject *seq = PySequence_Tuple(spans);
    if (!seq) goto done;
    Buf b = {0};
    size_t hint = size_hint(last_text_len);
    if (as_bytes ? buf_into_bytes(&b, hint) < 0 : (hint && buf_reserve(&b, hint) < 0)) goto fail;
    if (as_bytes && buf_add(&b, prefix.buf, (size_t)prefix.len) < 0) goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *span = PyTuple_GET_ITEM(seq, i);
        if (i && ADD_LIT(&b, ",") < 0) goto fail;
        if (encoded_type != NULL && (PyObject *)Py_TYPE(span) == encoded_type) {
            PyObject *text = PyObject_GetAttr(span, s_text);
            if (!text) goto fail;
            int added = PyBytes_Check(text) ? buf_add(&b, PyBytes_AS_STRING(text), (size_t)PyBytes_GET_SIZE(text)) : -2;
            Py_DECREF(text);
            if (added == -2) PyErr_SetString(PyExc_TypeError, "an encoded span's text is not bytes");
            if (added < 0) goto fail;
            continue;
        }
        int rc = add_span(&b, span, link_text, event_text, shared_type, span_type);
        if (rc == ERROR) goto fail;
        if (rc == NOT_MINE) {
            PyObject *text = PyObject_CallOneArg(fallback, span);
            if (!text) goto fail;
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(text, &len);
            int added = s ? buf_add(&b, s, (size_t)len) : -1;
            Py_DECREF(text);
            if (added < 0) goto fail;
        }
    }
    if (as_bytes && buf_add(&b, suffix.buf, (size_t)suffix.len) < 0) goto fail;
    last_text_len = b.len;
    if (as_bytes) {
        if (_PyBytes_Resize(&b.bytes, (Py_ssize_t)b.len) == 0) {
            out = b.bytes; /* (the Buf's reference, handed over) */
            b.bytes = NULL;
        }
    } else {
        out = PyUnicode_FromStringAndSize(b.data ? b.data : "", (Py_ssize_t)b.len);
    }
fail:
    Py_DECREF(seq);
    if (b.bytes != NULL) Py_DECREF(b.bytes);
    else if (!as_bytes) PyMem_Free(b.data);
done:
    if (prefix.buf) PyBuffer_Release(&prefix);
    if (suffix.buf) PyBuffer_Release(&suffix);
    return out;
}

/* ---- Spans written from columns (agent/outputs/traces.py, a step's layer spans) -----------------
 *
 * column_spans(parent, name, span_ids, starts, ends, heads, head_key, rows, head2_key, head2,
 *              keys, columns, first_key, first, second_key, second, extras) -> list of bytes
 *
 * For each i: the text add_span writes for the INTERNAL span `name` under `parent` (a valid
 * SpanContext tuple without trace state) with span id span_ids[i], times starts[i]..ends[i], no
 * events or links, status unset, and the attributes, in this order:
 *   head_key: heads[i];
 *   where rows[i] >= 0 (r = rows[i]): head2_key: head2; keys[j]: columns[j][r] for each j, a NaN
 *     float left out; first_key: first[r] and second_key: second[r] where not empty;
 *   then extras[i] (a dict, as a span stores it: no None, no NaN scalar), in its order.
 * That is the dict TraceOutput builds for the layer span, written without building it (nor the
 * span object): tests/export/test_column_spans.py holds the text to add_span's for the same spans.
 * ValueError where something is not as described (the caller builds the spans the usual way). */
static int column_value(Buf *b, PyObject *key, PyObject *value, int *first) {
    if (!*first && ADD_LIT(b, ",") < 0) return ERROR;
    *first = 0;
    if (ADD_LIT(b, "{\"key\":") < 0) return ERROR;
    int rc = add_string(b, key);
    if (rc != OK) return rc;
    if (ADD_LIT(b, ",\"value\":") < 0) return ERROR;
    rc = add_any_value(b, value, 0);
    if (rc != OK) return rc;
    return ADD_LIT(b, "}") < 0 ? ERROR : OK;
}

static int column_span(Buf *b, PyObject *name, unsigned long long hi, unsigned long long lo, unsigned long long parent_id,
                       PyObject *parent, PyObject *span_id, PyObject *start, PyObject *end, PyObject *head_key,
                       PyObject *head, Py_ssize_t row, PyObject *head2_key, PyObject *head2, PyObject *keys,
                       PyObject *columns, PyObject *first_key, PyObject *first, PyObject *second_key, PyObject *second,
                       PyObject *extra) {
    if (!PyLong_CheckExact(span_id)) return NOT_MINE;
    unsigned long long id = PyLong_AsUnsignedLongLong(span_id);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return not_mine_or_error();
    if (ADD_LIT(b, "{\"traceId\":\"") < 0 || buf_hex16(b, hi) < 0 || buf_hex16(b, lo) < 0
        || ADD_LIT(b, "\",\"spanId\":\"") < 0 || buf_hex16(b, id) < 0 || ADD_LIT(b, "\",\"parentSpanId\":\"") < 0
        || buf_hex16(b, parent_id) < 0 || ADD_LIT(b, "\",\"name\":") < 0)
        return ERROR;
    int rc = add_string(b, name);
    if (rc != OK) return rc;
    if (ADD_LIT(b, ",\"kind\":1") < 0) return ERROR; /* INTERNAL (0) + 1 */
    if ((rc = add_time(b, ",\"startTimeUnixNano\":\"", sizeof(",\"startTimeUnixNano\":\"") - 1, start)) != OK) return rc;
    if ((rc = add_time(b, ",\"endTimeUnixNano\":\"", sizeof(",\"endTimeUnixNano\":\"") - 1, end)) != OK) return rc;
    if (ADD_LIT(b, ",\"attributes\":[") < 0) return ERROR;
    int first_item = 1;
    if ((rc = column_value(b, head_key, head, &first_item)) != OK) return rc;
    if (row >= 0) {
        if ((rc = column_value(b, head2_key, head2, &first_item)) != OK) return rc;
        Py_ssize_t n = PyTuple_GET_SIZE(keys);
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *value = PyList_GET_ITEM(PyList_GET_ITEM(columns, j), row);
            if (PyFloat_CheckExact(value) && isnan(PyFloat_AS_DOUBLE(value))) continue; /* NaN: left out */
            if ((rc = column_value(b, PyTuple_GET_ITEM(keys, j), value, &first_item)) != OK) return rc;
        }
        PyObject *arrays[2][2] = {{first_key, PyList_GET_ITEM(first, row)}, {second_key, PyList_GET_ITEM(second, row)}};
        for (int k = 0; k < 2; k++) {
            PyObject *values = arrays[k][1];
            if (!(PyList_CheckExact(values) || PyTuple_CheckExact(values))) return NOT_MINE;
            if (PySequence_Fast_GET_SIZE(values) == 0) continue; /* an empty array: left out */
            if ((rc = column_value(b, arrays[k][0], values, &first_item)) != OK) return rc;
        }
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(extra, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0 || value == Py_None) return NOT_MINE;
        if (PyFloat_CheckExact(value) && isnan(PyFloat_AS_DOUBLE(value))) return NOT_MINE;
        if ((rc = column_value(b, key, value, &first_item)) != OK) return rc;
    }
    if (ADD_LIT(b, "],\"status\":{},\"flags\":") < 0) return ERROR;
    if ((rc = add_flags(b, parent)) != OK) return rc;
    return ADD_LIT(b, "}") < 0 ? ERROR : OK;
}

/* Span i's text, as its writer (rc) left it in b, into the list out: 0, or -1 with an exception set
 * (ValueError naming `what` where the writer did not take the span). */
static int take_text(PyObject *out, Py_ssize_t i, const Buf *b, int rc, const char *what) {
    if (rc == ERROR) return -1;
    if (rc == NOT_MINE) {
        PyErr_Format(PyExc_ValueError, "%s: span %zd has a value it does not write", what, i);
        return -1;
    }
    PyObject *text = PyBytes_FromStringAndSize(b->data, (Py_ssize_t)b->len);
    if (!text) return -1;
    PyList_SET_ITEM(out, i, text);
    return 0;
}

static PyObject *column_spans(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *parent, *name, *span_ids, *starts, *ends, *heads, *head_key, *rows, *head2_key, *head2, *keys, *columns,
        *first_key, *first, *second_key, *second, *extras;
    if (!PyArg_ParseTuple(args, "O!UO!O!O!O!UO!UOO!O!UO!UO!O!:column_spans", &PyTuple_Type, &parent, &name,
                          &PyList_Type, &span_ids, &PyList_Type, &starts, &PyList_Type, &ends, &PyList_Type, &heads,
                          &head_key, &PyList_Type, &rows, &head2_key, &head2, &PyTuple_Type, &keys, &PyList_Type,
                          &columns, &first_key, &PyList_Type, &first, &second_key, &PyList_Type, &second,
                          &PyList_Type, &extras))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(span_ids);
    Py_ssize_t width = PyTuple_GET_SIZE(keys), height = PyList_GET_SIZE(first);
    int shaped = PyList_GET_SIZE(starts) == n && PyList_GET_SIZE(ends) == n && PyList_GET_SIZE(heads) == n
                 && PyList_GET_SIZE(rows) == n && PyList_GET_SIZE(extras) == n && PyList_GET_SIZE(columns) == width
                 && PyList_GET_SIZE(second) == height;
    for (Py_ssize_t j = 0; shaped && j < width; j++) {
        PyObject *column = PyList_GET_ITEM(columns, j);
        shaped = PyList_CheckExact(column) && PyList_GET_SIZE(column) == height;
    }
    if (!shaped) {
        PyErr_SetString(PyExc_ValueError, "column_spans: lists of different lengths");
        return NULL;
    }
    unsigned long long hi, lo, parent_id;
    int rc = context_ids(parent, &hi, &lo, &parent_id);
    if (rc == OK && PyObject_Size(PyTuple_GET_ITEM(parent, 4)) != 0) rc = PyErr_Occurred() ? ERROR : NOT_MINE;
    if (rc != OK) {
        if (rc == NOT_MINE) PyErr_SetString(PyExc_ValueError, "column_spans: not a parent context it takes");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    Buf b = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row_obj = PyList_GET_ITEM(rows, i), *extra = PyList_GET_ITEM(extras, i);
        Py_ssize_t row = PyLong_CheckExact(row_obj) ? PyLong_AsSsize_t(row_obj) : -2;
        if (row == -1 && PyErr_Occurred()) goto fail;
        if (row < -1 || row >= height || !PyDict_CheckExact(extra)) {
            rc = NOT_MINE;
        } else {
            b.len = 0;
            rc = column_span(&b, name, hi, lo, parent_id, parent, PyList_GET_ITEM(span_ids, i), PyList_GET_ITEM(starts, i),
                             PyList_GET_ITEM(ends, i), head_key, PyList_GET_ITEM(heads, i), row, head2_key, head2, keys,
                             columns, first_key, first, second_key, second, extra);
        }
        if (take_text(out, i, &b, rc, "column_spans") < 0) goto fail;
    }
    PyMem_Free(b.data);
    return out;
fail:
    PyMem_Free(b.data);
    Py_DECREF(out);
    return NULL;
}

/* ---- Spans written from their parts (agent/outputs/traces.py: a request's server and phase spans,
 * a step span) ------------------------------------------------------------------------------------
 *
 * plain_spans(trace, parent, items, link_text, event_text) -> list of bytes
 *
 * `trace`: a SpanContext tuple whose trace id the spans carry; `parent`: None (each span a root) or
 * the SpanContext tuple of their parent. Each item is (span_id, name, kind, start, end, keys, values,
 * links, events): kind a SpanKind value; keys a tuple of str and values a list or tuple as long, or
 * keys None and values a dict; links and events tuples of SDK links and events (written by
 * link_text and event_text, as encode's callbacks). For each item: the text add_span writes for
 * that span with status unset, whose attributes are the dict {keys[j]: values[j]} (or values) as
 * span_attributes leaves it: a None, a NaN float or an empty list or tuple left out; every other
 * value a str, bool, int or float, or a list or tuple of one of those types. Not building the dict
 * (where keys are given), the span object or their cleaning is the point: a request's six spans
 * were ~30 µs of building and encoding, written here in a few (tests/export/test_plain_spans.py holds
 * the text to the spans the factory makes). ValueError where something is not as described (the
 * caller makes the spans the usual way). */

/* A value as span_attributes stores it, unchanged: OK (write it), NOT_MINE (it would convert or
 * drop it with a log line: not written here), or SKIP (it leaves it out). */
enum { SKIP = 2 };
static int plain_value(PyObject *value) {
    if (value == Py_None) return SKIP;
    if (PyFloat_CheckExact(value)) return isnan(PyFloat_AS_DOUBLE(value)) ? SKIP : OK;
    if (PyUnicode_CheckExact(value) || PyLong_CheckExact(value) || PyBool_Check(value)) return OK;
    if (!(PyList_CheckExact(value) || PyTuple_CheckExact(value))) return NOT_MINE; /* (numpy: converted) */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
    if (n == 0) return SKIP;
    PyObject **items = PySequence_Fast_ITEMS(value);
    PyTypeObject *type = Py_TYPE(items[0]);
    if (type != &PyLong_Type && type != &PyFloat_Type && type != &PyUnicode_Type && type != &PyBool_Type)
        return NOT_MINE;
    for (Py_ssize_t i = 1; i < n; i++)
        if (Py_TYPE(items[i]) != type) return NOT_MINE; /* mixed: converted to one type */
    return OK;
}

static int plain_attribute(Buf *b, PyObject *key, PyObject *value, int *first) {
    int rc = plain_value(value);
    if (rc == SKIP) return OK;
    if (rc != OK) return rc;
    if (!PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0) return NOT_MINE;
    if (*first && ADD_LIT(b, ",\"attributes\":[") < 0) return ERROR;
    return column_value(b, key, value, first);
}

static int plain_span(Buf *b, unsigned long long hi, unsigned long long lo, PyObject *parent, unsigned long long parent_id,
                      PyObject *item, PyObject *link_text, PyObject *event_text) {
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 9) return NOT_MINE;
    PyObject *span_id = PyTuple_GET_ITEM(item, 0), *name = PyTuple_GET_ITEM(item, 1), *kind = PyTuple_GET_ITEM(item, 2),
             *start = PyTuple_GET_ITEM(item, 3), *end = PyTuple_GET_ITEM(item, 4), *keys = PyTuple_GET_ITEM(item, 5),
             *values = PyTuple_GET_ITEM(item, 6), *links = PyTuple_GET_ITEM(item, 7), *events = PyTuple_GET_ITEM(item, 8);
    int keyed = keys != Py_None;
    if (!PyLong_CheckExact(span_id) || !PyLong_CheckExact(kind) || !PyUnicode_CheckExact(name)
        || !PyTuple_CheckExact(links) || !PyTuple_CheckExact(events))
        return NOT_MINE;
    if (keyed ? !(PyTuple_CheckExact(keys) && (PyList_CheckExact(values) || PyTuple_CheckExact(values))
                  && PySequence_Fast_GET_SIZE(values) == PyTuple_GET_SIZE(keys))
              : !PyDict_CheckExact(values))
        return NOT_MINE;
    unsigned long long id = PyLong_AsUnsignedLongLong(span_id);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return not_mine_or_error();
    long k = PyLong_AsLong(kind);
    if (k == -1 && PyErr_Occurred()) return not_mine_or_error();
    if (k < 0 || k > 4) return NOT_MINE;
    if (ADD_LIT(b, "{\"traceId\":\"") < 0 || buf_hex16(b, hi) < 0 || buf_hex16(b, lo) < 0
        || ADD_LIT(b, "\",\"spanId\":\"") < 0 || buf_hex16(b, id) < 0 || ADD_LIT(b, "\"") < 0)
        return ERROR;
    if (parent != Py_None
        && (ADD_LIT(b, ",\"parentSpanId\":\"") < 0 || buf_hex16(b, parent_id) < 0 || ADD_LIT(b, "\"") < 0))
        return ERROR;
    int rc;
    if (PyUnicode_GET_LENGTH(name) > 0) {
        if (ADD_LIT(b, ",\"name\":") < 0) return ERROR;
        if ((rc = add_string(b, name)) != OK) return rc;
    }
    if (ADD_LIT(b, ",\"kind\":") < 0 || buf_fmt_i64(b, (long long)k + 1) < 0) return ERROR;
    if ((rc = add_time(b, ",\"startTimeUnixNano\":\"", sizeof(",\"startTimeUnixNano\":\"") - 1, start)) != OK) return rc;
    if ((rc = add_time(b, ",\"endTimeUnixNano\":\"", sizeof(",\"endTimeUnixNano\":\"") - 1, end)) != OK) return rc;
    int first = 1;
    if (keyed) {
        Py_ssize_t n = PyTuple_GET_SIZE(keys);
        PyObject **items = PySequence_Fast_ITEMS(values);
        for (Py_ssize_t j = 0; j < n; j++)
            if ((rc = plain_attribute(b, PyTuple_GET_ITEM(keys, j), items[j], &first)) != OK) return rc;
    } else {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(values, &pos, &key, &value))
            if ((rc = plain_attribute(b, key, value, &first)) != OK) return rc;
    }
    if (!first && ADD_LIT(b, "]") < 0) return ERROR;
    if ((rc = add_texts(b, ",\"events\":[", sizeof(",\"events\":[") - 1, events, event_text)) != OK) return rc;
    if ((rc = add_texts(b, ",\"links\":[", sizeof(",\"links\":[") - 1, links, link_text)) != OK) return rc;
    if (ADD_LIT(b, ",\"status\":{},\"flags\":") < 0) return ERROR;
    if ((rc = add_flags(b, parent)) != OK) return rc;
    return ADD_LIT(b, "}") < 0 ? ERROR : OK;
}

static PyObject *plain_spans(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *trace, *parent, *items, *link_text, *event_text;
    if (!PyArg_ParseTuple(args, "O!OO!OO:plain_spans", &PyTuple_Type, &trace, &parent, &PyList_Type, &items, &link_text,
                          &event_text))
        return NULL;
    unsigned long long hi, lo, own_id, parent_id = 0;
    int rc = context_ids(trace, &hi, &lo, &own_id);
    if (rc == OK && parent != Py_None) {
        unsigned long long parent_hi, parent_lo;
        rc = PyTuple_Check(parent) ? context_ids(parent, &parent_hi, &parent_lo, &parent_id) : NOT_MINE;
        if (rc == OK && (parent_hi != hi || parent_lo != lo)) rc = NOT_MINE; /* a child is in its parent's trace */
    }
    if (rc == OK && PyObject_Size(PyTuple_GET_ITEM(trace, 4)) != 0) rc = PyErr_Occurred() ? ERROR : NOT_MINE;
    if (rc != OK) {
        if (rc == NOT_MINE) PyErr_SetString(PyExc_ValueError, "plain_spans: not a trace or parent context it takes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    Buf b = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        b.len = 0;
        rc = plain_span(&b, hi, lo, parent, parent_id, PyList_GET_ITEM(items, i), link_text, event_text);
        if (take_text(out, i, &b, rc, "plain_spans") < 0) goto fail;
    }
    PyMem_Free(b.data);
    return out;
fail:
    PyMem_Free(b.data);
    Py_DECREF(out);
    return NULL;
}

static PyObject *set_encoded_type(PyObject *self, PyObject *type) {
    (void)self;
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "set_encoded_type takes a type");
        return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(encoded_type, type);
    Py_RETURN_NONE;
}

/* ---- OTLP protobuf (agent/export/otlp_proto.py): the same spans as ExportTraceServiceRequest's
 * Span messages, as opentelemetry-exporter-otlp's encoder (_encode_span) makes them, field for
 * field; anything else goes to the fallback, as above. tests/export/test_otlp_proto.py parses
 * both and compares the messages. Wire format: varints, length-delimited fields whose length
 * is written after their content (one byte reserved, the content moved on when it needs more). */

static int pb_varint(Buf *b, unsigned long long v) {
    if (buf_reserve(b, 10) < 0) return ERROR;
    unsigned char *p = (unsigned char *)b->data + b->len;
    size_t n = 0;
    do {
        unsigned char byte = (unsigned char)(v & 0x7f);
        v >>= 7;
        p[n++] = byte | (v ? 0x80 : 0);
    } while (v);
    b->len += n;
    return OK;
}

#define PB_TAG(b, field, wire) pb_varint((b), ((unsigned long long)(field) << 3) | (wire))

static int pb_fixed64(Buf *b, unsigned field, unsigned long long v) {
    if (PB_TAG(b, field, 1) != OK || buf_reserve(b, 8) < 0) return ERROR;
    for (int i = 0; i < 8; i++) b->data[b->len++] = (char)((v >> (8 * i)) & 0xff);
    return OK;
}

/* A length-delimited field opened: its tag, one byte for its length; pb_close writes the length. */
static int pb_open(Buf *b, unsigned field, size_t *mark) {
    if (PB_TAG(b, field, 2) != OK || buf_reserve(b, 1) < 0) return ERROR;
    *mark = b->len++;
    return OK;
}

static int pb_close(Buf *b, size_t mark) {
    size_t n = b->len - mark - 1;
    unsigned char len[10];
    size_t width = 0;
    unsigned long long v = n;
    do {
        unsigned char byte = (unsigned char)(v & 0x7f);
        v >>= 7;
        len[width++] = byte | (v ? 0x80 : 0);
    } while (v);
    if (width > 1) {
        if (buf_reserve(b, width - 1) < 0) return ERROR;
        memmove(b->data + mark + width, b->data + mark + 1, n);
        b->len += width - 1;
    }
    memcpy(b->data + mark, len, width);
    return OK;
}

static int pb_bytes(Buf *b, unsigned field, const char *data, size_t n) {
    if (PB_TAG(b, field, 2) != OK || pb_varint(b, n) != OK || buf_add(b, data, n) < 0) return ERROR;
    return OK;
}

/* A str field (UTF-8); NOT_MINE for a str that has none (lone surrogates), or a non-str. */
static int pb_string(Buf *b, unsigned field, PyObject *s) {
    if (!PyUnicode_CheckExact(s)) return NOT_MINE;
    Py_ssize_t n;
    const char *data = PyUnicode_AsUTF8AndSize(s, &n);
    if (!data) return not_mine_or_error();
    return pb_bytes(b, field, data, (size_t)n);
}

static int pb_id(Buf *b, unsigned field, unsigned long long hi, unsigned long long lo, int with_hi) {
    char id[16];
    int n = 0;
    if (with_hi)
        for (int i = 7; i >= 0; i--) id[n++] = (char)((hi >> (8 * i)) & 0xff);
    for (int i = 7; i >= 0; i--) id[n++] = (char)((lo >> (8 * i)) & 0xff);
    return pb_bytes(b, field, id, (size_t)n);
}

/* One AnyValue's content (opentelemetry's _encode_value for these types); NOT_MINE for the
 * others and for an int outside int64 (the SDK leaves that attribute out and logs it). */
static int pb_any_value(Buf *b, PyObject *v, int depth) {
    if (PyUnicode_CheckExact(v)) return pb_string(b, 1, v);
    if (PyBool_Check(v)) return (PB_TAG(b, 2, 0) != OK || pb_varint(b, v == Py_True) != OK) ? ERROR : OK;
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return NOT_MINE;
        if (x == -1 && PyErr_Occurred()) return ERROR;
        return (PB_TAG(b, 3, 0) != OK || pb_varint(b, (unsigned long long)x) != OK) ? ERROR : OK;
    }
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        unsigned long long bits;
        memcpy(&bits, &d, sizeof bits);
        return pb_fixed64(b, 4, bits);
    }
    if (v == Py_None) return OK; /* an empty AnyValue */
    if ((PyTuple_CheckExact(v) || PyList_CheckExact(v)) && depth < 8) {
        size_t array, item;
        if (pb_open(b, 5, &array) != OK) return ERROR;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        PyObject **items = PySequence_Fast_ITEMS(v);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (pb_open(b, 1, &item) != OK) return ERROR;
            int rc = pb_any_value(b, items[i], depth + 1);
            if (rc != OK) return rc;
            if (pb_close(b, item) != OK) return ERROR;
        }
        return pb_close(b, array);
    }
    return NOT_MINE;
}

/* Repeated KeyValue `field` from a dict. */
static int pb_attributes(Buf *b, unsigned field, PyObject *attrs) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) return NOT_MINE;
        size_t kv, any;
        if (pb_open(b, field, &kv) != OK) return ERROR;
        if (PyUnicode_GET_LENGTH(key) > 0) {
            int rc = pb_string(b, 1, key);
            if (rc != OK) return rc;
        }
        if (pb_open(b, 2, &any) != OK) return ERROR;
        int rc = pb_any_value(b, value, 0);
        if (rc != OK) return rc;
        if (pb_close(b, any) != OK || pb_close(b, kv) != OK) return ERROR;
    }
    return OK;
}

/* Repeated message `field`, each item's encoded message from message_of(item) (bytes). */
static int pb_messages(Buf *b, unsigned field, PyObject *items, PyObject *message_of) {
    Py_ssize_t count = PyTuple_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *data = PyObject_CallOneArg(message_of, PyTuple_GET_ITEM(items, i));
        if (!data) return ERROR;
        if (!PyBytes_Check(data)) {
            Py_DECREF(data);
            PyErr_SetString(PyExc_TypeError, "a link or event encoder must return bytes");
            return ERROR;
        }
        int rc = pb_bytes(b, field, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data));
        Py_DECREF(data);
        if (rc != OK) return rc;
    }
    return OK;
}

static int pb_time(Buf *b, unsigned field, PyObject *t) {
    if (t == Py_None) return OK;
    if (!PyLong_CheckExact(t)) return NOT_MINE;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(t, &overflow);
    if (overflow || v < 0) return NOT_MINE;
    if (v == -1 && PyErr_Occurred()) return ERROR;
    return v ? pb_fixed64(b, field, (unsigned long long)v) : OK;
}

/* One Span message field (`spans`, 2, of ScopeSpans) appended to b, or NOT_MINE with b as it was. */
static int pb_span(Buf *b, PyObject *span, PyObject *link_pb, PyObject *event_pb, PyObject *shared_type,
                   PyObject *span_type) {
    Taken t;
    size_t start_len = b->len, mark;
    int rc = span_taken(span, shared_type, span_type, 0, &t);
    if (rc != OK) goto done;
    Fields f = t.f;
    PyObject *attrs = f.attributes, *message = t.message;
    int remote = 0;
    if (f.parent != Py_None) {
        remote = PyObject_IsTrue(PyTuple_GET_ITEM(f.parent, 2));
        if (remote < 0) {
            rc = ERROR;
            goto done;
        }
    }
    rc = ERROR;
    if (pb_open(b, 2, &mark) != OK) goto done;
    if (pb_id(b, 1, t.hi, t.lo, 1) != OK || pb_id(b, 2, 0, t.span_id, 0) != OK) goto done;
    if (f.parent != Py_None && pb_id(b, 4, 0, t.parent_id, 0) != OK) goto done;
    if (PyUnicode_GET_LENGTH(f.name) > 0 && (rc = pb_string(b, 5, f.name)) != OK) goto done;
    rc = ERROR;
    if (PB_TAG(b, 6, 0) != OK || pb_varint(b, (unsigned long long)(t.kind + 1)) != OK) goto done; /* SpanKind + 1 */
    if ((rc = pb_time(b, 7, f.start)) != OK || (rc = pb_time(b, 8, f.end)) != OK) goto done;
    if (attrs != Py_None && (rc = pb_attributes(b, 9, attrs)) != OK) goto done;
    if ((rc = pb_messages(b, 11, t.events, event_pb)) != OK) goto done;
    if ((rc = pb_messages(b, 13, t.links, link_pb)) != OK) goto done;
    rc = ERROR;
    size_t status;
    if (pb_open(b, 15, &status) != OK) goto done;
    if (message != NULL && (rc = pb_string(b, 2, message)) != OK) goto done;
    rc = ERROR;
    if (t.code && (PB_TAG(b, 3, 0) != OK || pb_varint(b, (unsigned long long)t.code) != OK)) goto done;
    if (pb_close(b, status) != OK) goto done;
    if (PB_TAG(b, 16, 5) != OK || buf_reserve(b, 4) < 0) goto done;
    unsigned flags = remote ? 0x300u : 0x100u;
    for (int i = 0; i < 4; i++) b->data[b->len++] = (char)((flags >> (8 * i)) & 0xff);
    rc = pb_close(b, mark);
done:
    taken_clear(&t);
    if (rc != OK) b->len = start_len;
    return rc;
}

/* encode_pb(spans, fallback, link_pb, event_pb, shared_type, span_type) -> bytes: each span as a
 * `spans` field of ScopeSpans (tag, length, Span message); fallback(span) gives the Span message
 * bytes of a span this does not take. */
static size_t last_pb_len; /* as last_text_len, for the protobuf messages */

static PyObject *encode_pb(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *spans, *fallback, *link_pb, *event_pb, *shared_type, *span_type;
    if (!PyArg_ParseTuple(args, "OOOOOO:encode_pb", &spans, &fallback, &link_pb, &event_pb, &shared_type,
                          &span_type))
        return NULL;
    PyObject *seq = PySequence_Tuple(spans);
    if (!seq) return NULL;
    PyObject *out = NULL;
    Buf b = {0};
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (buf_into_bytes(&b, size_hint(last_pb_len)) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *span = PyTuple_GET_ITEM(seq, i);
        int rc = pb_span(&b, span, link_pb, event_pb, shared_type, span_type);
        if (rc == ERROR) goto fail;
        if (rc == NOT_MINE) {
            PyObject *data = PyObject_CallOneArg(fallback, span);
            if (!data) goto fail;
            int added = PyBytes_Check(data) ? pb_bytes(&b, 2, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data))
                                            : (PyErr_SetString(PyExc_TypeError, "fallback must return bytes"), ERROR);
            Py_DECREF(data);
            if (added != OK) goto fail;
        }
    }
    last_pb_len = b.len;
    if (_PyBytes_Resize(&b.bytes, (Py_ssize_t)b.len) == 0) {
        out = b.bytes; /* (the Buf's reference, handed over) */
        b.bytes = NULL;
    }
fail:
    Py_DECREF(seq);
    Py_XDECREF(b.bytes);
    return out;
}

static PyObject *repr_of_double(PyObject *self, PyObject *arg) {
    (void)self;
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    if (!isfinite(v)) {
        PyErr_SetString(PyExc_ValueError, "double_repr takes finite values");
        return NULL;
    }
    char text[DOUBLE_REPR_MAX];
    return PyUnicode_FromStringAndSize(text, (Py_ssize_t)double_repr(v, text));
}

static PyObject *uses_fast_doubles(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(fast_doubles);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(spans, fallback, link_text, event_text, shared_type, span_type[, prefix, suffix]) -> the spans' "
     "OTLP/JSON texts joined by ',' (a str); with prefix and suffix (bytes), the bytes prefix + texts + suffix"},
    {"encode_pb", encode_pb, METH_VARARGS,
     "encode_pb(spans, fallback, link_pb, event_pb, shared_type, span_type) -> bytes: each span as a ScopeSpans "
     "`spans` field (OTLP protobuf)"},
    {"column_spans", column_spans, METH_VARARGS,
     "column_spans(parent, name, span_ids, starts, ends, heads, head_key, rows, head2_key, head2, keys, columns, "
     "first_key, first, second_key, second, extras) -> list of bytes: each span's OTLP/JSON text, written from "
     "columns (see the source)"},
    {"plain_spans", plain_spans, METH_VARARGS,
     "plain_spans(trace, parent, items, link_text, event_text) -> list of bytes: each span's OTLP/JSON text, written from its "
     "parts (see the source)"},
    {"set_encoded_type", set_encoded_type, METH_O,
     "set_encoded_type(type): spans of exactly this type carry their text in `_text`; encode() appends it"},
    {"double_repr", repr_of_double, METH_O, "double_repr(x) -> repr(x) for a finite float, as the encoder writes it"},
    {"fast_doubles", uses_fast_doubles, METH_NOARGS,
     "fast_doubles() -> whether the encoder formats doubles itself (else with CPython's formatter)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_span", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__otlp_span(void) {
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {{&s_context, "_context"},   {&s_parent, "_parent"},         {&s_name, "_name"},
                 {&s_kind, "_kind"},         {&s_start, "_start_time"},      {&s_end, "_end_time"},
                 {&s_attributes, "_attributes"}, {&s_events, "_events"},     {&s_links, "_links"},
                 {&s_status, "_status"},     {&s_status_code, "status_code"}, {&s_description, "description"},
                 {&s_value, "value"},        {&s_text, "_text"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (!*names[i].slot) return NULL;
    }
    sixty_four = PyLong_FromLong(64);
    if (!sixty_four) return NULL;
    PyObject *enum_module = PyImport_ImportModule("enum");
    enum_type = enum_module ? PyObject_GetAttrString(enum_module, "Enum") : NULL;
    Py_XDECREF(enum_module);
    if (!enum_type) return NULL;
    if (double_repr_init() == 0) {
        fast_doubles = 1;
    } else {
        PyErr_Clear(); /* the tables did not check out: CPython's formatter writes doubles */
    }
    return PyModule_Create(&module);
}
