/* The strings of a GGUF string array (each a little-endian u64 byte length, then UTF-8), decoded
 * in one pass: ggufswap.shards._strings.decode(data, count, index) -> (list[str], dict | None).
 *
 * shards/arrays.py's StringArray.tolist() uses it when it is built (the Python fallback joins,
 * decodes and splits the strings in a few passes of its own). With ``index`` true it also returns
 * {string: position}, a string held twice mapping to its later position (llama.cpp's
 * token_to_id): a SentencePiece tokenizer's look-up table, built here at about one dictionary
 * insert per token. Invalid UTF-8 decodes with U+FFFD ("replace"), as a look-up does; a length
 * that runs past the data raises ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static uint64_t read_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t count;
    int index;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*np", &view, &count, &index)) {
        return NULL;
    }
    const unsigned char *data = view.buf;
    Py_ssize_t size = view.len, pos = 0;
    PyObject *strings = NULL, *table = NULL, *result = NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative string count");
        goto done;
    }
    strings = PyList_New(count);
    /* Presized: no rehash while it fills (CPython's _PyDict_NewPresized, 3.x). */
    table = index ? _PyDict_NewPresized(count) : NULL;
    if (strings == NULL || (index && table == NULL)) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (size - pos < 8) {
            PyErr_Format(PyExc_ValueError, "string %zd's length runs past the array", i);
            goto done;
        }
        uint64_t n = read_u64(data + pos);
        pos += 8;
        if (n > (uint64_t)(size - pos)) {
            PyErr_Format(PyExc_ValueError, "string %zd runs past the array", i);
            goto done;
        }
        PyObject *s = PyUnicode_DecodeUTF8((const char *)data + pos, (Py_ssize_t)n, "replace");
        if (s == NULL) {
            goto done;
        }
        pos += (Py_ssize_t)n;
        PyList_SET_ITEM(strings, i, s); /* steals the reference */
        if (table != NULL) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyDict_SetItem(table, s, at) < 0) {
                Py_XDECREF(at);
                goto done;
            }
            Py_DECREF(at);
        }
    }
    result = Py_BuildValue("(OO)", strings, table != NULL ? table : Py_None);
done:
    PyBuffer_Release(&view);
    Py_XDECREF(strings);
    Py_XDECREF(table);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, count, index) -> (strings, {string: position} or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_strings", "GGUF string arrays decoded in one pass.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__strings(void) { return PyModule_Create(&module); }
