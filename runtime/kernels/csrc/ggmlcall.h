/* What ggmlcall.c (the library, its products) shares with ggmlblock.c (a block's steps around
 * them in one call each). */
#ifndef GGUFSWAP_GGMLCALL_H
#define GGUFSWAP_GGMLCALL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A matrix of `rows` rows in its blocks at w, of ggml type `type`; its product goes to y. */
typedef struct {
    unsigned long long w, y;
    int type;
    long long rows;
} mat_arg;

/* Serialises the products (the backend's work buffer is shared). */
extern pthread_mutex_t LOCK;

/* Whether a libggml is loaded (else a RuntimeError is set). */
bool loaded(void);

/* ggml_row_size of the loaded library. */
size_t row_size(int type, long long cols);

/* y_i[n, rows_i] = x[n, cols] @ W_i.T for `count` matrices by the same activations, one graph.
 * Called with LOCK held and without the GIL; 0, or -1 when ggml could not allocate. */
int mats_locked(uintptr_t x, long long n, long long cols, const mat_arg *m, int count,
                int threads);

/* One token's attention (ggml_flash_attn_ext) over an F16 KV cache: q [n_head, hd] float32;
 * k, v F16 [n_head_kv, cap, hd] (one sequence's cache), keys lo .. hi - 1 read; y [n_head, hd]
 * float32. */
typedef struct {
    long long hd, n_head, n_head_kv, cap, lo, hi;
    uintptr_t q, k, v, y;
    float scale, softcap;
} attn_arg;

/* Whether the loaded library has what attn_locked builds (ggml_view_3d, ggml_flash_attn_ext). */
bool attends(void);

/* attn_locked: LOCK held, no GIL; 0, or -1 (no allocation, or no attention in the library). */
int attn_locked(const attn_arg *a, int threads);

PyObject *py_geglu_tail(PyObject *self, PyObject *args);
PyObject *py_attn_front(PyObject *self, PyObject *args);
PyObject *py_flash_attn(PyObject *self, PyObject *args);
PyObject *py_geglu_layer(PyObject *self, PyObject *args);

#endif
