/* ggml's own CPU matrix products, through a libggml loaded at run time (dlopen).
 *
 * ggml is a kernel library: its CPU backend quantizes the activations to each weight type's
 * vec_dot_type (q8_0, q8_K, ...) and takes integer dot products, AVX2/AVX-512/VNNI as its build
 * and the CPU allow. This module uses it as a library and copies none of it: for each product it
 * builds a one-node graph (ggml_mul_mat, or ggml_mul_mat_id for routed experts) whose tensors
 * point at the caller's memory (the weights stay where native storage keeps them, the float32
 * activations and the output are torch tensors), and runs it on a CPU backend. The results are
 * ggml's own, bit for bit: what llama.cpp built on the same libggml computes for the same
 * weights and activations.
 *
 * Only ggml's public, stable C API is used (the ggml.h / ggml-backend.h functions below, the same
 * in mainline ggml and in ik_llama.cpp's fork); no struct layout is read or written except
 * ggml_init_params, three fields that both declare alike. ggml aborts the process on a failed
 * assertion, so the caller (runtime/kernels/_ggml.py) checks every shape, type and size first.
 *
 * One backend serves the process; a mutex serialises the products (its work buffer is shared).
 * The GIL is released while ggml computes.
 *
 * Python interface (pointers are the integer data_ptr() of contiguous CPU tensors):
 *   load(path) -> bool                 (dlopen + symbols + a CPU backend; True for ik_llama.cpp's
 *                                       fork, which exports iqk_mul_mat; raises OSError)
 *   row_size(type, cols) -> int        (ggml_row_size: bytes of a row of `cols` values)
 *   block_size(type) -> int            (ggml_blck_size)
 *   mul_mat(w, type, rows, cols, x, n, y, threads)
 *        y[n, rows] = x[n, cols] @ W.T, W `rows` rows of ggml_row_size(type, cols) bytes
 *   mul_mats(x, n, cols, threads, ((w, type, rows, y), ...))
 *        several matrices by the same activations, one graph (up to MAX_MATS): ggml quantizes
 *        the activations once where it can (ik's fork fuses products that share them)
 *   mul_mat_id(w, type, n_expert, rows, cols, x, x_per_token, n_tokens, ids, n_used, y, threads)
 *        y[t, j] = W[ids[t, j]] @ x[t, j % x_per_token] for each token t and slot j: W a stack
 *        of n_expert matrices [rows, cols], x [n_tokens, x_per_token, cols] (x_per_token is 1,
 *        the same input for every slot, or n_used), ids int32 [n_tokens, n_used],
 *        y [n_tokens, n_used, rows]
 *   mul_mat_ids(x, x_per_token, n_tokens, ids, n_used, cols, threads,
 *               ((w, type, n_expert, rows, y), ...))
 *        several stacks' routed products by the same activations and routing, one graph (up to
 *        MAX_STACKS: a MoE layer's gate and up)
 *   geglu_tail(...), attn_front(...), flash_attn(...), geglu_layer(...)
 *        a block's steps around its products in one call each, one token's attention over an
 *        F16 KV cache (ggml_flash_attn_ext, attn_locked below), a whole GeGLU block for one
 *        token: ggmlblock.c
 *   moe_ffn(...), moe_layer(...)
 *        one token through a MoE FFN of stacked SwiGLU experts (router_locked and
 *        experts_locked below: ggml's nodes), a whole block with one: ggmlmoe.c, ggmlblock.c
 *   decode_step(...)
 *        one token through a decoder's blocks (GeGLU or MoE ones), final norm and head:
 *        ggmlstep.c
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ggmlcall.h"

enum { GGML_F32 = 0, GGML_F16 = 1, GGML_I32 = 26 };
/* mainline's enum ggml_prec: GGML_PREC_F32 (ggml_prec_set_acc, which ik's fork does not have) */
#define MAINLINE_PREC_F32 10
/* ggml asserts that a CPU buffer made from a pointer starts at a multiple of this. */
#define TENSOR_ALIGNMENT 32

struct ggml_init_params { /* ggml.h: the same three fields in mainline and ik */
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};
typedef struct ggml_context ggml_context; /* opaque from here on */
typedef struct ggml_tensor ggml_tensor;
typedef struct ggml_cgraph ggml_cgraph;
typedef void *ggml_backend_t;
typedef void *ggml_backend_buffer_t;

static struct {
    void *handle;
    bool ik;
    ggml_context *(*init)(struct ggml_init_params);
    void (*free)(ggml_context *);
    size_t (*tensor_overhead)(void);
    size_t (*graph_overhead_custom)(size_t, bool);
    ggml_tensor *(*new_tensor_2d)(ggml_context *, int, int64_t, int64_t);
    ggml_tensor *(*new_tensor_3d)(ggml_context *, int, int64_t, int64_t, int64_t);
    ggml_tensor *(*mul_mat)(ggml_context *, ggml_tensor *, ggml_tensor *);
    ggml_tensor *(*mul_mat_id)(ggml_context *, ggml_tensor *, ggml_tensor *, ggml_tensor *);
    ggml_cgraph *(*new_graph_custom)(ggml_context *, size_t, bool);
    void (*build_forward_expand)(ggml_cgraph *, ggml_tensor *);
    ggml_backend_t (*cpu_init)(void);
    void (*cpu_set_n_threads)(ggml_backend_t, int);
    int (*graph_compute)(ggml_backend_t, ggml_cgraph *);
    ggml_backend_buffer_t (*buffer_from_ptr)(void *, size_t);
    void (*buffer_free)(ggml_backend_buffer_t);
    void (*tensor_alloc)(ggml_backend_buffer_t, ggml_tensor *, void *);
    size_t (*row_size)(int, int64_t);
    int64_t (*blck_size)(int);
    /* optional: attention (attn_locked) where the library has them */
    ggml_tensor *(*view_3d)(ggml_context *, ggml_tensor *, int64_t, int64_t, int64_t, size_t,
                            size_t, size_t);
    ggml_tensor *(*flash_attn_ext)(ggml_context *, ggml_tensor *, ggml_tensor *, ggml_tensor *,
                                   ggml_tensor *, float, float, float);
    bool (*prec_set_acc)(ggml_tensor *, int);
    /* optional: a MoE FFN's router and experts (router_locked, experts_locked) */
    ggml_tensor *(*soft_max)(ggml_context *, ggml_tensor *);
    ggml_tensor *(*silu)(ggml_context *, ggml_tensor *);
    ggml_tensor *(*mul)(ggml_context *, ggml_tensor *, ggml_tensor *);
    ggml_backend_t backend;
    int threads; /* the backend's thread count as last set */
} G;

pthread_mutex_t LOCK = PTHREAD_MUTEX_INITIALIZER;

/* Graph memory: a handful of tensor headers and a small graph, reused by every product. */
#define GRAPH_NODES 16
#define MAX_MATS 4
#define CTX_BYTES (64 * 1024)
static _Alignas(64) unsigned char CTX_MEM[CTX_BYTES];

#define SYM(field, name)                                                                       \
    do {                                                                                       \
        *(void **)(&G.field) = dlsym(handle, name);                                            \
        if (G.field == NULL) missing = name;                                                   \
    } while (0)

static PyObject *py_load(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (G.handle != NULL) return PyBool_FromLong(G.ik);
    /* RTLD_LOCAL: ggml's symbols stay out of the process namespace (torch, a llama_cpp module
     * loaded later with another libggml, each keep their own). */
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) return PyErr_Format(PyExc_OSError, "dlopen %s: %s", path, dlerror());
    const char *missing = NULL;
    SYM(init, "ggml_init");
    SYM(free, "ggml_free");
    SYM(tensor_overhead, "ggml_tensor_overhead");
    SYM(graph_overhead_custom, "ggml_graph_overhead_custom");
    SYM(new_tensor_2d, "ggml_new_tensor_2d");
    SYM(new_tensor_3d, "ggml_new_tensor_3d");
    SYM(mul_mat, "ggml_mul_mat");
    SYM(mul_mat_id, "ggml_mul_mat_id");
    SYM(new_graph_custom, "ggml_new_graph_custom");
    SYM(build_forward_expand, "ggml_build_forward_expand");
    SYM(cpu_init, "ggml_backend_cpu_init");
    SYM(cpu_set_n_threads, "ggml_backend_cpu_set_n_threads");
    SYM(graph_compute, "ggml_backend_graph_compute");
    SYM(buffer_from_ptr, "ggml_backend_cpu_buffer_from_ptr");
    SYM(buffer_free, "ggml_backend_buffer_free");
    SYM(tensor_alloc, "ggml_backend_tensor_alloc");
    SYM(row_size, "ggml_row_size");
    SYM(blck_size, "ggml_blck_size");
    if (missing != NULL) {
        dlclose(handle);
        memset(&G, 0, sizeof G);
        return PyErr_Format(PyExc_OSError, "%s: no symbol %s (not a libggml with a CPU backend)",
                            path, missing);
    }
    G.ik = dlsym(handle, "iqk_mul_mat") != NULL;
    *(void **)(&G.view_3d) = dlsym(handle, "ggml_view_3d");
    *(void **)(&G.flash_attn_ext) = dlsym(handle, "ggml_flash_attn_ext");
    *(void **)(&G.prec_set_acc) = dlsym(handle, "ggml_prec_set_acc");
    *(void **)(&G.soft_max) = dlsym(handle, "ggml_soft_max");
    *(void **)(&G.silu) = dlsym(handle, "ggml_silu");
    *(void **)(&G.mul) = dlsym(handle, "ggml_mul");
    G.backend = G.cpu_init();
    if (G.backend == NULL) {
        dlclose(handle);
        memset(&G, 0, sizeof G);
        return PyErr_Format(PyExc_OSError, "%s: ggml_backend_cpu_init failed", path);
    }
    G.handle = handle;
    G.threads = 0;
    return PyBool_FromLong(G.ik);
}

bool loaded(void) {
    if (G.handle != NULL) return true;
    PyErr_SetString(PyExc_RuntimeError, "no libggml loaded (call load first)");
    return false;
}

static PyObject *py_row_size(PyObject *self, PyObject *args) {
    (void)self;
    int type;
    long long cols;
    if (!PyArg_ParseTuple(args, "iL", &type, &cols) || !loaded()) return NULL;
    return PyLong_FromSize_t(G.row_size(type, cols));
}

static PyObject *py_block_size(PyObject *self, PyObject *args) {
    (void)self;
    int type;
    if (!PyArg_ParseTuple(args, "i", &type) || !loaded()) return NULL;
    return PyLong_FromLongLong(G.blck_size(type));
}

/* Point `t` at `nbytes` of caller memory at `addr`, through a CPU buffer over that range (its
 * start aligned down as ggml wants; the buffer never frees the memory). */
static ggml_backend_buffer_t place(ggml_tensor *t, uintptr_t addr, size_t nbytes) {
    uintptr_t base = addr & ~(uintptr_t)(TENSOR_ALIGNMENT - 1);
    ggml_backend_buffer_t buf = G.buffer_from_ptr((void *)base, addr + nbytes - base);
    if (buf != NULL) G.tensor_alloc(buf, t, (void *)addr);
    return buf;
}

typedef struct {
    ggml_tensor *t;
    uintptr_t addr;
    size_t nbytes;
} placed;

#define MAX_PLACED 12 /* a MoE FFN's experts' graph: 10 */

/* Place the tensors, compute the graph of `outs` on `threads` threads, free the buffers. Called
 * with LOCK held and without the GIL. Returns 0, or -1 when ggml could not allocate. */
static int compute(ggml_context *ctx, ggml_tensor *const *outs, int n_outs, const placed *ts,
                   int count, int threads) {
    ggml_backend_buffer_t bufs[MAX_PLACED] = {0};
    int status = 0;
    for (int i = 0; i < count && status == 0; i++) {
        bufs[i] = place(ts[i].t, ts[i].addr, ts[i].nbytes);
        if (bufs[i] == NULL) status = -1;
    }
    if (status == 0) {
        ggml_cgraph *graph = G.new_graph_custom(ctx, GRAPH_NODES, false);
        for (int i = 0; i < n_outs; i++) G.build_forward_expand(graph, outs[i]);
        if (G.threads != threads) {
            G.cpu_set_n_threads(G.backend, threads);
            G.threads = threads;
        }
        status = G.graph_compute(G.backend, graph) == 0 ? 0 : -1;
    }
    for (int i = 0; i < count; i++)
        if (bufs[i] != NULL) G.buffer_free(bufs[i]);
    return status;
}

static ggml_context *new_context(void) {
    struct ggml_init_params params = {CTX_BYTES, CTX_MEM, true};
    return G.init(params);
}

/* ggmlcall.h */
int mats_locked(uintptr_t x, long long n, long long cols, const mat_arg *m, int count,
                       int threads) {
    ggml_context *ctx = new_context();
    ggml_tensor *tx = G.new_tensor_2d(ctx, GGML_F32, cols, n);
    ggml_tensor *outs[MAX_MATS];
    placed ts[MAX_PLACED];
    ts[0] = (placed){tx, x, (size_t)(n * cols) * sizeof(float)};
    for (int i = 0; i < count; i++) {
        ggml_tensor *tw = G.new_tensor_2d(ctx, m[i].type, cols, m[i].rows);
        outs[i] = G.mul_mat(ctx, tw, tx);
        ts[1 + 2 * i] = (placed){tw, (uintptr_t)m[i].w, (size_t)m[i].rows * G.row_size(m[i].type, cols)};
        ts[2 + 2 * i] = (placed){outs[i], (uintptr_t)m[i].y, (size_t)(n * m[i].rows) * sizeof(float)};
    }
    int status = compute(ctx, outs, count, ts, 1 + 2 * count, threads);
    G.free(ctx);
    return status;
}

/* ggmlcall.h */
bool attends(void) { return G.view_3d != NULL && G.flash_attn_ext != NULL; }

/* ggmlcall.h: one token's attention over an F16 KV cache, llama.cpp's node: ggml_flash_attn_ext
 * of q [hd, 1, n_head] over views of keys and values lo .. hi - 1 of the caches [n_head_kv,
 * cap, hd], no mask, with the accumulator precision llama.cpp asks for (F32 on mainline, which
 * has ggml_prec_set_acc; ik's fork's default). */
int attn_locked(const attn_arg *a, int threads) {
    if (!attends()) return -1;
    ggml_context *ctx = new_context();
    const size_t row = (size_t)a->hd * 2, head = (size_t)a->cap * row;
    ggml_tensor *tq = G.new_tensor_3d(ctx, GGML_F32, a->hd, 1, a->n_head);
    ggml_tensor *kb = G.new_tensor_3d(ctx, GGML_F16, a->hd, a->cap, a->n_head_kv);
    ggml_tensor *vb = G.new_tensor_3d(ctx, GGML_F16, a->hd, a->cap, a->n_head_kv);
    /* the caches are placed first: a view takes its data pointer from its source when made */
    ggml_backend_buffer_t kbuf = place(kb, a->k, head * a->n_head_kv);
    ggml_backend_buffer_t vbuf = place(vb, a->v, head * a->n_head_kv);
    int status = -1;
    if (kbuf != NULL && vbuf != NULL) {
        const long long n_kv = a->hi - a->lo;
        ggml_tensor *tk = G.view_3d(ctx, kb, a->hd, n_kv, a->n_head_kv, row, head, a->lo * row);
        ggml_tensor *tv = G.view_3d(ctx, vb, a->hd, n_kv, a->n_head_kv, row, head, a->lo * row);
        ggml_tensor *out = G.flash_attn_ext(ctx, tq, tk, tv, NULL, a->scale, 0.0f, a->softcap);
        if (G.prec_set_acc != NULL) G.prec_set_acc(out, MAINLINE_PREC_F32);
        placed ts[2] = {{tq, a->q, (size_t)(a->n_head * a->hd) * sizeof(float)},
                        {out, a->y, (size_t)(a->n_head * a->hd) * sizeof(float)}};
        status = compute(ctx, &out, 1, ts, 2, threads);
    }
    if (kbuf != NULL) G.buffer_free(kbuf);
    if (vbuf != NULL) G.buffer_free(vbuf);
    G.free(ctx);
    return status;
}

static PyObject *py_mul_mat(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, x, y;
    int type, threads;
    long long rows, cols, n;
    if (!PyArg_ParseTuple(args, "KiLLKLKi", &w, &type, &rows, &cols, &x, &n, &y, &threads))
        return NULL;
    if (!loaded()) return NULL;
    if (rows < 1 || cols < 1 || n < 1 || threads < 1)
        return PyErr_Format(PyExc_ValueError, "bad product rows=%lld cols=%lld n=%lld", rows,
                            cols, n);
    mat_arg m = {w, y, type, rows};
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = mats_locked((uintptr_t)x, n, cols, &m, 1, threads);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_mul_mats(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x;
    long long n, cols;
    int threads;
    PyObject *mats;
    if (!PyArg_ParseTuple(args, "KLLiO", &x, &n, &cols, &threads, &mats)) return NULL;
    if (!loaded()) return NULL;
    PyObject *seq = PySequence_Fast(mats, "mul_mats: the matrices must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    mat_arg m[MAX_MATS];
    if (count < 1 || count > MAX_MATS || n < 1 || cols < 1 || threads < 1) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "mul_mats: 1 to %d matrices, n=%lld cols=%lld",
                            MAX_MATS, n, cols);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "KiLK", &m[i].w, &m[i].type, &m[i].rows, &m[i].y) ||
            m[i].rows < 1) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "mul_mats: rows < 1");
            return NULL;
        }
    }
    Py_DECREF(seq);
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = mats_locked((uintptr_t)x, n, cols, m, (int)count, threads);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define MAX_STACKS 3

/* The routed experts' products of `count` stacks by the same activations and routing, one graph
 * (ggml quantizes the activations once per node, as separate calls do). LOCK held, no GIL. */
static int ids_locked(uintptr_t x, long long x_per_token, long long n_tokens, uintptr_t ids,
                      long long n_used, long long cols, const stack_arg *s, int count,
                      int threads) {
    ggml_context *ctx = new_context();
    ggml_tensor *tx = G.new_tensor_3d(ctx, GGML_F32, cols, x_per_token, n_tokens);
    ggml_tensor *ti = G.new_tensor_2d(ctx, GGML_I32, n_used, n_tokens);
    ggml_tensor *outs[MAX_STACKS];
    placed ts[2 + 2 * MAX_STACKS];
    ts[0] = (placed){tx, x, (size_t)(n_tokens * x_per_token * cols) * sizeof(float)};
    ts[1] = (placed){ti, ids, (size_t)(n_tokens * n_used) * sizeof(int32_t)};
    for (int i = 0; i < count; i++) {
        ggml_tensor *tw = G.new_tensor_3d(ctx, s[i].type, cols, s[i].rows, s[i].n_expert);
        outs[i] = G.mul_mat_id(ctx, tw, tx, ti);
        ts[2 + 2 * i] = (placed){tw, (uintptr_t)s[i].w,
                                 (size_t)(s[i].n_expert * s[i].rows) * G.row_size(s[i].type, cols)};
        ts[3 + 2 * i] = (placed){outs[i], (uintptr_t)s[i].y,
                                 (size_t)(n_tokens * n_used * s[i].rows) * sizeof(float)};
    }
    int status = compute(ctx, outs, count, ts, 2 + 2 * count, threads);
    G.free(ctx);
    return status;
}

static PyObject *expert_products(long long x_per_token, long long n_tokens, long long n_used,
                                 long long cols, int threads, const stack_arg *s, int count,
                                 unsigned long long x, unsigned long long ids) {
    bool ok = cols >= 1 && n_tokens >= 1 && n_used >= 1 && threads >= 1 &&
              (x_per_token == 1 || x_per_token == n_used);
    for (int i = 0; i < count; i++) ok = ok && s[i].n_expert >= 1 && s[i].rows >= 1;
    if (!ok)
        return PyErr_Format(PyExc_ValueError,
                            "bad expert product cols=%lld tokens=%lld used=%lld x_per_token=%lld",
                            cols, n_tokens, n_used, x_per_token);
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = ids_locked((uintptr_t)x, x_per_token, n_tokens, (uintptr_t)ids, n_used, cols, s,
                        count, threads);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ggmlcall.h */
bool routes(void) { return G.soft_max != NULL && G.silu != NULL && G.mul != NULL; }

/* ggmlcall.h: probs[E] = soft_max(router [E, d] @ f [d]), ggml's mul_mat and soft_max nodes
 * (logits: scratch for the product). */
int router_locked(const mat_arg *router, long long d, uintptr_t f, uintptr_t probs, int threads) {
    if (!routes()) return -1;
    ggml_context *ctx = new_context();
    ggml_tensor *tw = G.new_tensor_2d(ctx, router->type, d, router->rows);
    ggml_tensor *tx = G.new_tensor_2d(ctx, GGML_F32, d, 1);
    ggml_tensor *tl = G.mul_mat(ctx, tw, tx);
    ggml_tensor *tp = G.soft_max(ctx, tl);
    const size_t e = (size_t)router->rows * sizeof(float);
    placed ts[4] = {{tw, (uintptr_t)router->w, (size_t)router->rows * G.row_size(router->type, d)},
                    {tx, f, (size_t)d * sizeof(float)},
                    {tl, (uintptr_t)router->y, e},
                    {tp, probs, e}};
    int status = compute(ctx, &tp, 1, ts, 4, threads);
    G.free(ctx);
    return status;
}

/* ggmlcall.h: one token's routed SwiGLU experts: down[k, d] = down_exps[ids] @ (silu(gate) *
 * up), gate, up = gate_exps[ids] @ f, up_exps[ids] @ f: ggml's mul_mat_id, silu and mul nodes
 * in one graph; scratch: 4 * k * ff floats (gate, up, silu(gate), their product). */
int experts_locked(uintptr_t f, long long d, long long ff, uintptr_t ids, long long k,
                   const stack_arg s[3], uintptr_t scratch, uintptr_t down, int threads) {
    if (!routes()) return -1;
    ggml_context *ctx = new_context();
    ggml_tensor *tx = G.new_tensor_3d(ctx, GGML_F32, d, 1, 1);
    ggml_tensor *ti = G.new_tensor_2d(ctx, GGML_I32, k, 1);
    ggml_tensor *wg = G.new_tensor_3d(ctx, s[0].type, d, ff, s[0].n_expert);
    ggml_tensor *wu = G.new_tensor_3d(ctx, s[1].type, d, ff, s[1].n_expert);
    ggml_tensor *wd = G.new_tensor_3d(ctx, s[2].type, ff, d, s[2].n_expert);
    ggml_tensor *g = G.mul_mat_id(ctx, wg, tx, ti), *u = G.mul_mat_id(ctx, wu, tx, ti);
    ggml_tensor *a = G.silu(ctx, g), *h = G.mul(ctx, a, u);
    ggml_tensor *dn = G.mul_mat_id(ctx, wd, h, ti);
    const size_t part = (size_t)(k * ff) * sizeof(float);
    placed ts[10] = {
        {tx, f, (size_t)d * sizeof(float)},
        {ti, ids, (size_t)k * sizeof(int32_t)},
        {wg, (uintptr_t)s[0].w, (size_t)(s[0].n_expert * ff) * G.row_size(s[0].type, d)},
        {wu, (uintptr_t)s[1].w, (size_t)(s[1].n_expert * ff) * G.row_size(s[1].type, d)},
        {wd, (uintptr_t)s[2].w, (size_t)(s[2].n_expert * d) * G.row_size(s[2].type, ff)},
        {g, scratch, part},
        {u, scratch + part, part},
        {a, scratch + 2 * part, part},
        {h, scratch + 3 * part, part},
        {dn, down, (size_t)(k * d) * sizeof(float)},
    };
    int status = compute(ctx, &dn, 1, ts, 10, threads);
    G.free(ctx);
    return status;
}

static PyObject *py_mul_mat_id(PyObject *self, PyObject *args) {
    (void)self;
    stack_arg s;
    unsigned long long x, ids;
    int threads;
    long long cols, x_per_token, n_tokens, n_used;
    if (!PyArg_ParseTuple(args, "KiLLLKLLKLKi", &s.w, &s.type, &s.n_expert, &s.rows, &cols, &x,
                          &x_per_token, &n_tokens, &ids, &n_used, &s.y, &threads))
        return NULL;
    if (!loaded()) return NULL;
    return expert_products(x_per_token, n_tokens, n_used, cols, threads, &s, 1, x, ids);
}

static PyObject *py_mul_mat_ids(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, ids;
    int threads;
    long long cols, x_per_token, n_tokens, n_used;
    PyObject *stacks;
    if (!PyArg_ParseTuple(args, "KLLKLLiO", &x, &x_per_token, &n_tokens, &ids, &n_used, &cols,
                          &threads, &stacks))
        return NULL;
    if (!loaded()) return NULL;
    PyObject *seq = PySequence_Fast(stacks, "mul_mat_ids: the stacks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    stack_arg s[MAX_STACKS];
    if (count < 1 || count > MAX_STACKS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "mul_mat_ids: 1 to %d stacks", MAX_STACKS);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "KiLLK", &s[i].w, &s[i].type, &s[i].n_expert, &s[i].rows,
                              &s[i].y)) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return expert_products(x_per_token, n_tokens, n_used, cols, threads, s, (int)count, x, ids);
}

/* ggmlcall.h */
size_t row_size(int type, long long cols) { return G.row_size(type, cols); }

static PyMethodDef METHODS[] = {
    {"load", py_load, METH_VARARGS, "dlopen a libggml; True for ik_llama.cpp's fork."},
    {"row_size", py_row_size, METH_VARARGS, "ggml_row_size(type, cols)."},
    {"block_size", py_block_size, METH_VARARGS, "ggml_blck_size(type)."},
    {"mul_mat", py_mul_mat, METH_VARARGS, "y[n, rows] = x[n, cols] @ W.T through ggml."},
    {"mul_mats", py_mul_mats, METH_VARARGS, "Several matrices by the same x, one graph."},
    {"mul_mat_id", py_mul_mat_id, METH_VARARGS, "Routed experts' products through ggml."},
    {"mul_mat_ids", py_mul_mat_ids, METH_VARARGS, "Several stacks' routed products, one graph."},
    {"geglu_tail", py_geglu_tail, METH_VARARGS, "A GeGLU block's half after attention."},
    {"attn_front", py_attn_front, METH_VARARGS, "A block's attention up to the heads' q, k, v."},
    {"flash_attn", py_flash_attn, METH_VARARGS, "One token's attention over an F16 KV cache."},
    {"geglu_layer", py_geglu_layer, METH_VARARGS, "One token through a GeGLU block."},
    {"moe_ffn", py_moe_ffn, METH_VARARGS, "One token through a MoE FFN of SwiGLU experts."},
    {"moe_layer", py_moe_layer, METH_VARARGS, "One token through a block with a MoE FFN."},
    {"decode_step", py_decode_step, METH_VARARGS, "One token through a decoder's blocks and head."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_ggmlcall", "ggml's CPU matrix products from a libggml loaded at run time.",
    -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ggmlcall(void) { return PyModule_Create(&MODULE); }
