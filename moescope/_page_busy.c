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
 * tests/neutral/test_stats_page.py holds it equal to the numpy path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 64

static PyObject *key_of(Py_ssize_t i, long long experts) {
    PyObject *layer = PyLong_FromSsize_t((Py_ssize_t)(i / experts));
    PyObject *expert = layer ? PyLong_FromSsize_t((Py_ssize_t)(i % experts)) : NULL;
    PyObject *key = expert ? PyTuple_Pack(2, layer, expert) : NULL;
    Py_XDECREF(layer);
    Py_XDECREF(expert);
    return key;
}

static PyObject *busy(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long layers, experts;
    unsigned long long written, now_bucket;
    double floor;
    if (!PyArg_ParseTuple(args, "y*LLdKK", &view, &layers, &experts, &floor, &written, &now_bucket)) return NULL;
    PyObject *queued = NULL, *penalised = NULL, *result = NULL;
    if (layers < 1 || experts < 1 || layers > INT32_MAX || experts > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "busy: layers and experts must be in [1, 2**31)");
        goto done;
    }
    long long n = layers * experts; /* < 2^62 */
    if (n > (PY_SSIZE_T_MAX - HEADER_BYTES) / 32) {
        PyErr_Format(PyExc_ValueError, "busy: a %lld x %lld page is past any buffer", layers, experts);
        goto done;
    }
    if (view.len < HEADER_BYTES || (view.len - HEADER_BYTES) / 32 < n) {
        PyErr_Format(PyExc_ValueError, "busy: a %lld x %lld page needs %lld bytes, got %zd", layers, experts,
                     HEADER_BYTES + 32 * n, view.len);
        goto done;
    }
    const char *base = (const char *)view.buf + HEADER_BYTES;
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
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"busy", busy, METH_VARARGS, "busy(buf, layers, experts, floor, written, now_bucket) -> (queued, penalised, peaks)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_page_busy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__page_busy(void) { return PyModule_Create(&module); }
