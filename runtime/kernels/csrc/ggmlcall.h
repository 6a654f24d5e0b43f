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

/* A stack of n_expert matrices [rows, cols] in their blocks at w (routed experts); y: their
 * product's output where a caller gives one. */
typedef struct {
    unsigned long long w, y;
    int type;
    long long n_expert, rows;
} stack_arg;

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

/* Whether the loaded library has the nodes a MoE FFN's graphs use (soft_max, silu, mul). */
bool routes(void);

/* A MoE FFN's router and experts for one token, ggml's nodes (ggmlcall.c says which); LOCK
 * held, no GIL; 0 or -1. router->y: scratch for the logits [rows]. */
int router_locked(const mat_arg *router, long long d, uintptr_t f, uintptr_t probs, int threads);
int experts_locked(uintptr_t f, long long d, long long ff, uintptr_t ids, long long k,
                   const stack_arg s[3], uintptr_t scratch, uintptr_t down, int threads);

/* A MoE FFN of stacked SwiGLU experts (ggmlmoe.c): the router (its y: set by moe_locked), k
 * experts used, norm: weights divided by their sum, scale: times it; stacks: gate, up, down. */
#define MAX_USED 64
typedef struct {
    mat_arg router;
    stack_arg stacks[3];
    long long d, ff, k, small;
    int norm, threads;
    float scale;
} moe_args;

/* y[d] = the MoE FFN of f[d] for one token; LOCK held, no GIL; 0 or -1. */
int moe_locked(moe_args *m, const float *f, float *y);

/* moe_args from Python's spec tuple (ggmlmoe.c); false with an exception set. */
bool parse_moe(PyObject *spec, long long d, moe_args *m);

PyObject *py_moe_ffn(PyObject *self, PyObject *args);
PyObject *py_moe_layer(PyObject *self, PyObject *args);
PyObject *py_geglu_tail(PyObject *self, PyObject *args);
PyObject *py_attn_front(PyObject *self, PyObject *args);
PyObject *py_flash_attn(PyObject *self, PyObject *args);
PyObject *py_geglu_layer(PyObject *self, PyObject *args);
PyObject *py_decode_step(PyObject *self, PyObject *args);

#endif
