/* Row operations of a decode step in one call each: RMS norm and RoPE over float32 rows.
 *
 * At one token per step a layer's norms and rotations work on a few hundred values; torch's
 * composite ops (F.rms_norm is pow, mean, add, rsqrt and two muls) then cost their dispatch,
 * not their arithmetic, and a Gemma 3 270M step runs 108 norms and 36 rotations. Each function
 * here is one pass over the rows, called with the integer data_ptr() of contiguous CPU float32
 * tensors (runtime/kernels/rowops.py checks them first).
 *
 *   rms_norm(x, rows, n, w, eps, y)
 *        ggml_compute_forward_rms_norm_f32 followed by ggml_mul by w (llama.cpp's build_norm):
 *        rownorm.h, compiled without FMA contraction, so the bits are ggml's.
 *   rope(x, rows, heads, hd, n_rot, neox, cos, sin, y)
 *        x [rows / heads positions, heads, hd] rotated by cos, sin [positions, n_rot / 2]
 *        (rowrope.h): the same float32 operations, each rounded, as RopeTables.rotate's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rownorm.h"
#include "rowrope.h"

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long px, pw, py;
    long long rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "KLLKfK", &px, &rows, &n, &pw, &eps, &py)) return NULL;
    if (rows < 0 || n < 1) return PyErr_Format(PyExc_ValueError, "rms_norm rows=%lld n=%lld", rows, n);
    rownorm((const float *)(uintptr_t)px, rows, n, (const float *)(uintptr_t)pw, eps,
            (float *)(uintptr_t)py);
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long px, pcos, psin, py;
    long long rows, heads, hd, n_rot;
    int neox;
    if (!PyArg_ParseTuple(args, "KLLLLpKKK", &px, &rows, &heads, &hd, &n_rot, &neox, &pcos, &psin,
                          &py))
        return NULL;
    if (rows < 0 || heads < 1 || rows % heads || n_rot < 2 || n_rot % 2 || n_rot > hd)
        return PyErr_Format(PyExc_ValueError, "rope rows=%lld heads=%lld hd=%lld n_rot=%lld", rows,
                            heads, hd, n_rot);
    rowrope((const float *)(uintptr_t)px, rows, heads, hd, n_rot, neox,
            (const float *)(uintptr_t)pcos, (const float *)(uintptr_t)psin,
            (float *)(uintptr_t)py);
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"rms_norm", py_rms_norm, METH_VARARGS, "ggml's RMS norm times the weight, per row."},
    {"rope", py_rope, METH_VARARGS, "RoPE (NEOX or NORM pairs) of rows of heads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_rowops", "Row operations of a decode step in one call each.",
    -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowops(void) { return PyModule_Create(&MODULE); }
