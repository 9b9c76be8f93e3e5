/* The busy experts of a stats page copy (moescope/stats_page.py, layout moescope-stats-page/2),
 * for the policy's queue signal (agent/policy/stats_source.py RuntimeStatsSignals._queue).
 *
 * Beside NVTX the policy reads only a page's queues, peaks and penalties, five times a second.
 * The numpy path (a copy of the arrays, five views, the held peak, a maximum, two flatnonzero,
 * tolist and a divmod per expert) is ~10 numpy calls, each a walk through numpy's dispatch: on a
 * thread that wakes every 200 ms beside a busy runtime, with its caches cold, ~0.2 ms a period at
 * the reference shape. This does the same in one pass over the copy.
 *
 * busy(buf, layers, experts, floor, written, now_bucket) -> (queued, penalised, peaks)
 *   buf:        the page copy from offset 0 (at least 64 + 32 * layers * experts bytes: header,
 *               queue_depth i64[L*E], penalty f64[L*E], queue_peak i64[2][L*E])
 *   floor:      the queue level (float) at or past which an expert is queued
 *   written:    the page's peak_bucket; now_bucket: the reader's (stats_page.held_peak's rule)
 *   queued:     {(layer, expert): float(level)} for each expert with level >= floor, where level
 *               is max(queue_depth, held peak), in index order
 *   penalised:  [(layer, expert)] with penalty > 0, in index order
 *   peaks:      whether any held peak is non-zero (the reader keeps an unchanged copy only without)
 * tests/policy/test_stats_page.py holds it equal to the numpy path.
 *
 * read_busy(fd, buf, layers, experts, floor, now_bucket, held, version, updates) does a policy
 * period's whole read of the page (StatsPageReader.read_busy): with `held` (a PageBusy of this floor
 * stands: its version and updates), the page's version and updates are read first (16 bytes) and
 * None is returned when they are the same; otherwise the page's first 64 + 32 * L * E bytes are
 * copied into `buf` and `seq` read again after the copy (seqlock: equal and even, the copy is one
 * update's), up to READ_TRIES times, and the busy experts made of the copy. Returns
 *   None                                    unchanged (only with `held`)
 *   (version, updates, queued, penalised, peaks)   one update's busy experts (as busy())
 *   (0,)                                    the writer was mid-update on every try
 *   (-1, got, want)                         a read came back short (a truncated page)
 *   (-2,)                                   the header's magic or shape changed
 * and raises OSError where a read fails. In Python this was ~15 interpreted calls a period (two
 * preadv, struct unpacks, a memoryview, the comparisons): ~80 µs of a policy wake-up on this VM.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the stats page is little-endian: its words are read in place"
#endif

#define HEADER_BYTES 64
#define SEQ_OFFSET 24
#define VERSION_OFFSET 32
#define READ_TRIES 3 /* stats_page.READ_TRIES */
/* A copy this long lets other threads run meanwhile (58 x 256 experts: ~475 KB); a shorter one
 * (the reference model's 2 KB: ~1 µs) keeps the GIL, cheaper than handing it over and back. */
#define RELEASE_GIL_BYTES (64 * 1024)
static const char MAGIC[8] = {'M', 'O', 'E', 'S', 'T', 'A', 'T', '1'};

static PyObject *key_of(Py_ssize_t i, long long experts) {
    PyObject *layer = PyLong_FromSsize_t((Py_ssize_t)(i / experts));
    PyObject *expert = layer ? PyLong_FromSsize_t((Py_ssize_t)(i % experts)) : NULL;
    PyObject *key = expert ? PyTuple_Pack(2, layer, expert) : NULL;
    Py_XDECREF(layer);
    Py_XDECREF(expert);
    return key;
}

/* The busy experts of a copy's body (`base`: just past the header, 32 * n bytes): a new
 * (queued, penalised, peaks) tuple, or NULL with an exception set. */
static PyObject *busy_of(const char *base, long long n, long long experts, double floor,
                         unsigned long long written, unsigned long long now_bucket) {
    PyObject *queued = NULL, *penalised = NULL, *result = NULL;
    /* held_peak: both halves when the newest written is now (or ahead: another clock), that half
     * when it is the one before, none when older */
    int halves = written >= now_bucket ? 2 : written + 1 == now_bucket ? 1 : 0;
    const char *half = base + 16 * n + (halves == 1 ? 8 * n * (written & 1) : 0);
    queued = PyDict_New();
    penalised = PyList_New(0);
    if (!queued || !penalised) goto done;
    int peaks = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t depth, peak = 0, other;
        double penalty;
        memcpy(&depth, base + 8 * i, 8); /* (unaligned-safe: the copy is a bytearray) */
        memcpy(&penalty, base + 8 * (n + i), 8);
        if (halves) {
            memcpy(&peak, half + 8 * i, 8);
            if (halves == 2) {
                memcpy(&other, half + 8 * (n + i), 8);
                if (other > peak) peak = other;
            }
            if (peak != 0) peaks = 1;
        }
        int64_t level = peak > depth ? peak : depth;
        if ((double)level >= floor) {
            PyObject *key = key_of(i, experts);
            PyObject *value = key ? PyFloat_FromDouble((double)level) : NULL;
            int bad = !value || PyDict_SetItem(queued, key, value) < 0;
            Py_XDECREF(key);
            Py_XDECREF(value);
            if (bad) goto done;
        }
        if (penalty > 0) {
            PyObject *key = key_of(i, experts);
            int bad = !key || PyList_Append(penalised, key) < 0;
            Py_XDECREF(key);
            if (bad) goto done;
        }
    }
    result = Py_BuildValue("(OON)", queued, penalised, PyBool_FromLong(peaks));
done:
    Py_XDECREF(queued);
    Py_XDECREF(penalised);
    return result;
}

/* layers x experts checked for a page body of `len` bytes past offset 0: n, or -1 with ValueError. */
static long long checked_shape(const char *who, long long layers, long long experts, Py_ssize_t len) {
    if (layers < 1 || experts < 1 || layers > INT32_MAX || experts > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: layers and experts must be in [1, 2**31)", who);
        return -1;
    }
    long long n = layers * experts; /* < 2^62 */
    if (n > (PY_SSIZE_T_MAX - HEADER_BYTES) / 32) {
        PyErr_Format(PyExc_ValueError, "%s: a %lld x %lld page is past any buffer", who, layers, experts);
        return -1;
    }
    if (len < HEADER_BYTES || (len - HEADER_BYTES) / 32 < n) {
        PyErr_Format(PyExc_ValueError, "%s: a %lld x %lld page needs %lld bytes, got %zd", who, layers, experts,
                     HEADER_BYTES + 32 * n, len);
        return -1;
    }
    return n;
}

static PyObject *busy(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long layers, experts;
    unsigned long long written, now_bucket;
    double floor;
    if (!PyArg_ParseTuple(args, "y*LLdKK", &view, &layers, &experts, &floor, &written, &now_bucket)) return NULL;
    PyObject *result = NULL;
    long long n = checked_shape("busy", layers, experts, view.len);
    if (n >= 0) result = busy_of((const char *)view.buf + HEADER_BYTES, n, experts, floor, written, now_bucket);
    PyBuffer_Release(&view);
    return result;
}

/* pread until `len` bytes or end of file (a regular file on tmpfs answers in one call; EINTR is
 * retried): the bytes read, or -1 with errno. */
static Py_ssize_t pread_full(int fd, char *dst, size_t len, off_t offset) {
    size_t done = 0;
    while (done < len) {
        ssize_t got = pread(fd, dst + done, len - done, offset + (off_t)done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        done += (size_t)got;
    }
    return (Py_ssize_t)done;
}

static PyObject *read_busy(PyObject *self, PyObject *args) {
    (void)self;
    int fd, held;
    Py_buffer view;
    long long layers, experts;
    unsigned long long now_bucket, held_version, held_updates;
    double floor;
    if (!PyArg_ParseTuple(args, "iw*LLdKpKK", &fd, &view, &layers, &experts, &floor, &now_bucket, &held,
                          &held_version, &held_updates))
        return NULL;
    PyObject *result = NULL;
    long long n = checked_shape("read_busy", layers, experts, view.len);
    if (n < 0) goto done;
    char *buf = (char *)view.buf;
    size_t length = (size_t)(HEADER_BYTES + 32 * n);
    Py_ssize_t got;
    if (held) {
        uint64_t words[2];
        got = pread_full(fd, (char *)words, sizeof words, VERSION_OFFSET); /* (16 bytes: the GIL kept) */
        if (got < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        if (got != (Py_ssize_t)sizeof words) {
            result = Py_BuildValue("(inn)", -1, got, (Py_ssize_t)sizeof words);
            goto done;
        }
        if (words[0] == held_version && words[1] == held_updates) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    for (int attempt = 0; attempt < READ_TRIES; attempt++) {
        uint64_t seq_after = 0;
        Py_ssize_t got_seq;
        if (length >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            got = pread_full(fd, buf, length, 0);
            got_seq = got == (Py_ssize_t)length ? pread_full(fd, (char *)&seq_after, 8, SEQ_OFFSET) : 0;
            Py_END_ALLOW_THREADS
        } else {
            got = pread_full(fd, buf, length, 0);
            got_seq = got == (Py_ssize_t)length ? pread_full(fd, (char *)&seq_after, 8, SEQ_OFFSET) : 0;
        }
        if (got < 0 || got_seq < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        if (got != (Py_ssize_t)length || got_seq != 8) {
            result = Py_BuildValue("(inn)", -1, got, (Py_ssize_t)length);
            goto done;
        }
        uint64_t seq, version, updates, written;
        memcpy(&seq, buf + SEQ_OFFSET, 8);
        if ((seq & 1) || seq != seq_after) continue; /* mid-update, or an update landed during the copy */
        uint32_t shape[2];
        memcpy(shape, buf + 16, 8);
        if (memcmp(buf, MAGIC, 8) != 0 || shape[0] != (uint64_t)layers || shape[1] != (uint64_t)experts) {
            result = Py_BuildValue("(i)", -2);
            goto done;
        }
        memcpy(&version, buf + VERSION_OFFSET, 8);
        memcpy(&updates, buf + VERSION_OFFSET + 8, 8);
        memcpy(&written, buf + 56, 8);
        PyObject *parts = busy_of(buf + HEADER_BYTES, n, experts, floor, written, now_bucket);
        if (parts == NULL) goto done;
        result = Py_BuildValue("(KKOOO)", (unsigned long long)version, (unsigned long long)updates,
                               PyTuple_GET_ITEM(parts, 0), PyTuple_GET_ITEM(parts, 1), PyTuple_GET_ITEM(parts, 2));
        Py_DECREF(parts);
        goto done;
    }
    result = Py_BuildValue("(i)", 0);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"busy", busy, METH_VARARGS, "busy(buf, layers, experts, floor, written, now_bucket) -> (queued, penalised, peaks)"},
    {"read_busy", read_busy, METH_VARARGS,
     "read_busy(fd, buf, layers, experts, floor, now_bucket, held, version, updates) -> None or a tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_page_busy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__page_busy(void) { return PyModule_Create(&module); }
