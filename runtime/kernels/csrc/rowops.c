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
 *        per row the float32 squares summed in double in order, mean = (float)(sum / n),
 *        scale = 1.0f / sqrtf(mean + eps), y = (x * scale) * w, each product rounded to float32
 *        (compiled without FMA contraction, so the bits are ggml's).
 *   rope(x, rows, heads, hd, n_rot, neox, cos, sin, y)
 *        x [rows / heads positions, heads, hd]; position p rotates with cos[p], sin[p]
 *        ([positions, n_rot / 2]): NEOX pairs (x[i], x[i + n_rot/2]), NORM pairs (x[2i],
 *        x[2i+1]), (x0 * c - x1 * s, x0 * s + x1 * c), dims past n_rot copied: the same float32
 *        operations, each rounded, as RopeTables.rotate's torch ops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long px, pw, py;
    long long rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "KLLKfK", &px, &rows, &n, &pw, &eps, &py)) return NULL;
    if (rows < 0 || n < 1) return PyErr_Format(PyExc_ValueError, "rms_norm rows=%lld n=%lld", rows, n);
    const float *x = (const float *)(uintptr_t)px;
    const float *w = (const float *)(uintptr_t)pw;
    float *y = (float *)(uintptr_t)py;
    for (long long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double sum = 0.0;
        for (long long i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (long long i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
    }
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
    const float *x = (const float *)(uintptr_t)px;
    const float *cos_t = (const float *)(uintptr_t)pcos;
    const float *sin_t = (const float *)(uintptr_t)psin;
    float *y = (float *)(uintptr_t)py;
    const long long half = n_rot / 2;
    for (long long r = 0; r < rows; r++) {
        const float *xr = x + r * hd;
        float *yr = y + r * hd;
        const float *c = cos_t + (r / heads) * half;
        const float *s = sin_t + (r / heads) * half;
        for (long long i = 0; i < half; i++) {
            const long long i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
            const float x0 = xr[i0], x1 = xr[i1];
            const float a = x0 * c[i], b = x1 * s[i], d = x0 * s[i], e = x1 * c[i];
            yr[i0] = a - b;
            yr[i1] = d + e;
        }
        if (n_rot < hd) memcpy(yr + n_rot, xr + n_rot, (size_t)(hd - n_rot) * sizeof(float));
    }
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
