/*
 * One call that copies a wave's expert tensors from their slots into stacked buffers.
 *
 * stack(src, dsts, lengths, sources): for row r and tensor t (sources row-major, r * T + t),
 *   dsts[t][r * lengths[t] : (r + 1) * lengths[t]] = src[sources[r * T + t] : ... + lengths[t]]
 * Why native: the copy path (CPU, CUDA) copies every leased expert once; a decode
 * layer of 8 experts x 9 tensors is 72 small copies, and in Python each costs
 * microseconds of interpreter time per layer per token, more than the bytes do.
 * Every range is checked before anything is copied; the copies run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define MAX_TENSORS 64
#define MAX_ITEMS (1 << 20)

static int int_list(PyObject *seq, Py_ssize_t *out, Py_ssize_t n, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
        if (out[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is negative: %zd", what, i, out[i]);
            return -1;
        }
    }
    return 0;
}

static PyObject *sc_stack(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *dsts_obj, *lengths_obj, *sources_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &src_obj, &dsts_obj, &lengths_obj, &sources_obj)) return NULL;
    PyObject *dsts = NULL, *lengths = NULL, *sources = NULL, *result = NULL;
    Py_buffer src = {0}, views[MAX_TENSORS];
    Py_ssize_t held = 0, length_at[MAX_TENSORS], *source_at = NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0) return NULL;
    dsts = PySequence_Fast(dsts_obj, "dsts must be a sequence");
    lengths = PySequence_Fast(lengths_obj, "lengths must be a sequence");
    sources = PySequence_Fast(sources_obj, "sources must be a sequence");
    if (!dsts || !lengths || !sources) goto done;
    Py_ssize_t tensors = PySequence_Fast_GET_SIZE(dsts), items = PySequence_Fast_GET_SIZE(sources);
    if (tensors < 1 || tensors > MAX_TENSORS || items > MAX_ITEMS || PySequence_Fast_GET_SIZE(lengths) != tensors ||
        items % tensors) {
        PyErr_Format(PyExc_ValueError, "stack: %zd destinations, %zd lengths, %zd sources", tensors,
                     PySequence_Fast_GET_SIZE(lengths), items);
        goto done;
    }
    Py_ssize_t rows = items / tensors;
    source_at = PyMem_New(Py_ssize_t, items ? items : 1);
    if (!source_at) {
        PyErr_NoMemory();
        goto done;
    }
    if (int_list(lengths, length_at, tensors, "lengths") < 0 || int_list(sources, source_at, items, "sources") < 0)
        goto done;
    for (; held < tensors; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dsts, held), &views[held], PyBUF_WRITABLE) < 0) goto done;
        if (views[held].len < rows * length_at[held]) {
            PyErr_Format(PyExc_ValueError, "destination %zd holds %zd bytes; %zd rows of %zd need %zd", held,
                         views[held].len, rows, length_at[held], rows * length_at[held]);
            held++;
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < items; i++)
        if (source_at[i] + length_at[i % tensors] > src.len) {
            PyErr_Format(PyExc_ValueError, "row %zd tensor %zd: bytes %zd..%zd are outside the source's %zd",
                         i / tensors, i % tensors, source_at[i], source_at[i] + length_at[i % tensors], src.len);
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < items; i++) {
        Py_ssize_t t = i % tensors, r = i / tensors;
        memcpy((char *)views[t].buf + r * length_at[t], (const char *)src.buf + source_at[i], (size_t)length_at[t]);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(source_at);
    Py_XDECREF(dsts);
    Py_XDECREF(lengths);
    Py_XDECREF(sources);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"stack", sc_stack, METH_VARARGS, "Copy each tensor of each slot into its stacked destination."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotcopy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__slotcopy(void) { return PyModule_Create(&module); }
