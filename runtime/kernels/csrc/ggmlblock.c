/* A transformer block's steps around ggml's products, in one call each (ggml's numerics).
 *
 * At one token per step a block is a handful of products and a few dozen row operations (norms,
 * RoPE, residual adds, GELU), and from Python each row operation costs its dispatch more than its
 * arithmetic. These functions run a block's steps in C around ggml's products (the same graphs as
 * ggmlcall.c's mul_mat and mul_mats, so the same bits), with ggml's RMS norm (rownorm.h) and the
 * decoders' RoPE (rowrope.h): the results are, bit for bit, those of the steps one by one
 * (runtime/kernels/ggml_block.py says which). Weights are read where the caller's store holds
 * them: a commit changes what the next call reads.
 *
 *   attn_front(x, n, d, attn_norm, (wq, type, rows), (wk, type, rows), (wv, type, rows), q_norm,
 *              k_norm, hd, n_rot, neox, cos, sin, q_heads_step, kv_heads_step, eps, kv_f16, q, k,
 *              v, threads, small)
 *        xn = attn_norm(x[n, d]); q, k, v = xn @ W.T; per head of hd values q_norm (k_norm)
 *        when given (pointer 0: none); RoPE of q and k by cos, sin [positions, n_rot / 2], row r
 *        of q at position r / q_heads_step (k: kv_heads_step); with kv_f16, k and v rounded to
 *        F16 values (an F16 KV cache's); q [n, rows_q], k, v likewise
 *   geglu_tail(x, a, n, d, q_dim, ff, (wo, type), (gate, type), (up, type), (down, type),
 *              post_attn_norm, ffn_norm, post_ffw_norm, eps, gelu_table, y, threads, small)
 *        y[n, d] = h + post_ffw_norm(down(gelu(gate(f)) * up(f))) with h = x + post_attn_norm(
 *        a[n, q_dim] @ Wo.T), f = ffn_norm(h); a norm pointer 0 is no norm (ffn_norm is
 *        required); gelu_table: 65536 float32, the GELU of each F16 value (ggml's table)
 *
 * A product runs on one thread when n times its weight bytes is under `small` (ggml's results do
 * not depend on the thread count), else on `threads`. Compiled without FMA contraction.
 */
#include <stdlib.h>
#include <string.h>

#include "ggmlblock.h"
#include "ggmlcall.h"
#include "rownorm.h"
#include "rowrope.h"

/* One row-major float32 buffer of n x (sum of widths) for a block's intermediates. */
static float *scratch(long long n, long long width) {
    return (float *)malloc((size_t)(n * width) * sizeof(float));
}

/* g -> GELU(g) * u: GELU through ggml's F16 table (GGML_GELU_FP16: the value at g rounded to
 * F16, to nearest even as GGML_FP32_TO_FP16; zero from -10 down, the identity from 10 up), then
 * ggml_mul's float32 product. */
static inline __attribute__((always_inline)) void geglu_body(float *g, const float *u,
                                                             long long count, const float *table) {
    for (long long i = 0; i < count; i++) {
        const float x = g[i];
        float a;
        if (x <= -10.0f) {
            a = 0.0f;
        } else if (x >= 10.0f) {
            a = x;
        } else {
            _Float16 h = (_Float16)x;
            uint16_t bits;
            memcpy(&bits, &h, sizeof bits);
            a = table[bits];
        }
        g[i] = a * u[i];
    }
}

/* The F16C instruction converts where the CPU has it; elsewhere the compiler's conversion gives
 * the same bits, slower. */
__attribute__((target("f16c"))) static void geglu_f16c(float *g, const float *u, long long count,
                                                       const float *table) {
    geglu_body(g, u, count, table);
}

static void geglu_soft(float *g, const float *u, long long count, const float *table) {
    geglu_body(g, u, count, table);
}

static void geglu_rows(float *g, const float *u, long long count, const float *table) {
    (__builtin_cpu_supports("f16c") ? geglu_f16c : geglu_soft)(g, u, count, table);
}

static int product_threads(const tail_args *t, long long weight_bytes) {
    return t->n * weight_bytes < t->small ? 1 : t->threads;
}

/* The block's half after attention (gemma3's: llama.cpp's graph, ggml's products and norms):
 *   h = x + post_attn_norm(a @ Wo.T);  f = ffn_norm(h)
 *   y = h + post_ffw_norm(down(gelu(gate(f)) * up(f)))
 * a post norm given as NULL is left out. LOCK held, no GIL. */
static int tail_locked(tail_args *t) {
    const long long n = t->n, d = t->d, ff = t->ff;
    float *h = scratch(n, 3 * d + 2 * ff);
    if (h == NULL) return -1;
    float *o = h + n * d, *f = o + n * d, *g = f + n * d, *u = g + n * ff;
    t->wo.y = (uintptr_t)o;
    int status = mats_locked((uintptr_t)t->a, n, t->q_dim, &t->wo, 1,
                             product_threads(t, d * row_size(t->wo.type, t->q_dim)));
    if (status == 0) {
        if (t->post_attn != NULL) rownorm(o, n, d, t->post_attn, t->eps, o);
        for (long long i = 0; i < n * d; i++) h[i] = t->x[i] + o[i];
        rownorm(h, n, d, t->ffn_norm, t->eps, f);
        mat_arg gu[2] = {t->gate, t->up};
        gu[0].y = (uintptr_t)g;
        gu[1].y = (uintptr_t)u;
        long long bytes = ff * (row_size(t->gate.type, d) + row_size(t->up.type, d));
        status = mats_locked((uintptr_t)f, n, d, gu, 2, product_threads(t, bytes));
    }
    if (status == 0) {
        geglu_rows(g, u, n * ff, t->table);
        t->down.y = (uintptr_t)o;
        status = mats_locked((uintptr_t)g, n, ff, &t->down, 1,
                             product_threads(t, d * row_size(t->down.type, ff)));
    }
    if (status == 0) {
        if (t->post_ffw != NULL) rownorm(o, n, d, t->post_ffw, t->eps, o);
        for (long long i = 0; i < n * d; i++) t->y[i] = h[i] + o[i];
    }
    free(h);
    return status;
}

PyObject *py_geglu_tail(PyObject *self, PyObject *args) {
    (void)self;
    tail_args t;
    unsigned long long x, a, pa, fn, pf, table, y;
    if (!PyArg_ParseTuple(args, "KKLLLL(Ki)(Ki)(Ki)(Ki)KKKfKKiL", &x, &a, &t.n, &t.d, &t.q_dim,
                          &t.ff, &t.wo.w, &t.wo.type, &t.gate.w, &t.gate.type, &t.up.w,
                          &t.up.type, &t.down.w, &t.down.type, &pa, &fn, &pf, &t.eps, &table, &y,
                          &t.threads, &t.small))
        return NULL;
    if (!loaded()) return NULL;
    if (t.n < 1 || t.d < 1 || t.q_dim < 1 || t.ff < 1 || t.threads < 1 || fn == 0 || table == 0)
        return PyErr_Format(PyExc_ValueError, "geglu_tail n=%lld d=%lld q_dim=%lld ff=%lld", t.n,
                            t.d, t.q_dim, t.ff);
    t.wo.rows = t.d;
    t.gate.rows = t.up.rows = t.ff;
    t.down.rows = t.d;
    t.x = (const float *)(uintptr_t)x;
    t.a = (const float *)(uintptr_t)a;
    t.post_attn = (const float *)(uintptr_t)pa;
    t.ffn_norm = (const float *)(uintptr_t)fn;
    t.post_ffw = (const float *)(uintptr_t)pf;
    t.table = (const float *)(uintptr_t)table;
    t.y = (float *)(uintptr_t)y;
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = tail_locked(&t);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}


/* x -> x rounded to F16 and back, in place (the F16 KV cache's values; to nearest even both
 * ways, as torch's .half().float()). The F16C instructions where the CPU has them. */
static inline __attribute__((always_inline)) void f16_body(float *x, long long count) {
    for (long long i = 0; i < count; i++) x[i] = (float)(_Float16)x[i];
}

__attribute__((target("f16c"))) static void f16_round_f16c(float *x, long long count) {
    f16_body(x, count);
}

static void f16_round_soft(float *x, long long count) { f16_body(x, count); }

static void f16_round(float *x, long long count) {
    (__builtin_cpu_supports("f16c") ? f16_round_f16c : f16_round_soft)(x, count);
}

/* A block's attention up to the heads' q, k, v. LOCK held, no GIL. */
static int front_locked(front_args *t) {
    const long long n = t->n, d = t->d, hd = t->hd;
    float *xn = (float *)malloc((size_t)(n * d) * sizeof(float));
    if (xn == NULL) return -1;
    rownorm(t->x, n, d, t->attn_norm, t->eps, xn);
    long long bytes = 0;
    for (int i = 0; i < 3; i++) bytes += t->w[i].rows * (long long)row_size(t->w[i].type, d);
    int status = mats_locked((uintptr_t)xn, n, d, t->w, 3,
                             n * bytes < t->small ? 1 : t->threads);
    free(xn);
    if (status != 0) return status;
    float *q = (float *)(uintptr_t)t->w[0].y, *k = (float *)(uintptr_t)t->w[1].y;
    const long long q_rows = n * t->w[0].rows / hd, k_rows = n * t->w[1].rows / hd;
    if (t->q_norm != NULL) rownorm(q, q_rows, hd, t->q_norm, t->eps, q);
    if (t->k_norm != NULL) rownorm(k, k_rows, hd, t->k_norm, t->eps, k);
    rowrope(q, q_rows, t->q_step, hd, t->n_rot, t->neox, t->cos_t, t->sin_t, q);
    rowrope(k, k_rows, t->kv_step, hd, t->n_rot, t->neox, t->cos_t, t->sin_t, k);
    if (t->kv_f16) {
        f16_round(k, n * t->w[1].rows);
        f16_round((float *)(uintptr_t)t->w[2].y, n * t->w[2].rows);
    }
    return 0;
}

PyObject *py_attn_front(PyObject *self, PyObject *args) {
    (void)self;
    front_args t;
    unsigned long long x, an, qn, kn, pc, ps;
    if (!PyArg_ParseTuple(args, "KLLK(KiL)(KiL)(KiL)KKLLpKKLLfpKKKiL", &x, &t.n, &t.d, &an,
                          &t.w[0].w, &t.w[0].type, &t.w[0].rows, &t.w[1].w, &t.w[1].type,
                          &t.w[1].rows, &t.w[2].w, &t.w[2].type, &t.w[2].rows, &qn, &kn, &t.hd,
                          &t.n_rot, &t.neox, &pc, &ps, &t.q_step, &t.kv_step, &t.eps, &t.kv_f16,
                          &t.w[0].y, &t.w[1].y, &t.w[2].y, &t.threads, &t.small))
        return NULL;
    if (!loaded()) return NULL;
    bool heads = t.hd > 0 && t.w[0].rows % t.hd == 0 && t.w[1].rows % t.hd == 0;
    if (t.n < 1 || t.d < 1 || !heads || t.n_rot < 2 || t.n_rot % 2 || t.n_rot > t.hd ||
        t.q_step < 1 || t.kv_step < 1 || t.threads < 1 || an == 0 || t.w[2].rows < 1 ||
        (t.n * t.w[0].rows / t.hd) % t.q_step || (t.n * t.w[1].rows / t.hd) % t.kv_step)
        return PyErr_Format(PyExc_ValueError, "attn_front n=%lld d=%lld hd=%lld n_rot=%lld", t.n,
                            t.d, t.hd, t.n_rot);
    t.x = (const float *)(uintptr_t)x;
    t.attn_norm = (const float *)(uintptr_t)an;
    t.q_norm = (const float *)(uintptr_t)qn;
    t.k_norm = (const float *)(uintptr_t)kn;
    t.cos_t = (const float *)(uintptr_t)pc;
    t.sin_t = (const float *)(uintptr_t)ps;
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = front_locked(&t);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Threads for an attention: one where the keys and values it reads are under `small` bytes. */
static int attn_threads(const attn_arg *a, int threads, long long small) {
    return 4 * (a->hi - a->lo) * a->hd * a->n_head_kv < small ? 1 : threads;
}

/* attn_arg from Python: (q, k, v, y, hd, n_head, n_head_kv, cap, lo, hi, scale, softcap). */
PyObject *py_flash_attn(PyObject *self, PyObject *args) {
    (void)self;
    attn_arg a;
    unsigned long long q, k, v, y;
    int threads;
    long long small;
    if (!PyArg_ParseTuple(args, "KKKKLLLLLLffiL", &q, &k, &v, &y, &a.hd, &a.n_head,
                          &a.n_head_kv, &a.cap, &a.lo, &a.hi, &a.scale, &a.softcap, &threads,
                          &small))
        return NULL;
    if (!loaded()) return NULL;
    if (!attends())
        return PyErr_Format(PyExc_RuntimeError, "this libggml has no ggml_flash_attn_ext");
    if (a.hd < 1 || a.n_head_kv < 1 || a.n_head % a.n_head_kv || a.lo < 0 || a.hi <= a.lo ||
        a.hi > a.cap || threads < 1)
        return PyErr_Format(PyExc_ValueError,
                            "flash_attn hd=%lld heads=%lld/%lld keys %lld..%lld of %lld", a.hd,
                            a.n_head, a.n_head_kv, a.lo, a.hi, a.cap);
    a.q = (uintptr_t)q, a.k = (uintptr_t)k, a.v = (uintptr_t)v, a.y = (uintptr_t)y;
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = attn_locked(&a, attn_threads(&a, threads, small));
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Row `pos` of each head of an F16 cache [heads, cap, hd] from rows [heads, hd] of float32. */
static void to_cache(const float *x, uintptr_t cache, long long heads, long long cap,
                     long long pos, long long hd) {
    _Float16 *c = (_Float16 *)cache;
    for (long long h = 0; h < heads; h++)
        for (long long j = 0; j < hd; j++) c[(h * cap + pos) * hd + j] = (_Float16)x[h * hd + j];
}

/* One token's attention from the residual stream into att [q rows]: attn_front, its keys and
 * values written to the caches, q times q_scale (llama.cpp's ggml_scale of Qcur where the model
 * scales q, else 1), attn_locked. LOCK held, no GIL. */
static int token_attention(layer_args *l, float *att) {
    const long long qn = l->f.w[0].rows, kn = l->f.w[1].rows, vn = l->f.w[2].rows;
    float *q = scratch(1, qn + kn + vn);
    if (q == NULL) return -1;
    float *k = q + qn, *v = k + kn;
    l->f.w[0].y = (uintptr_t)q, l->f.w[1].y = (uintptr_t)k, l->f.w[2].y = (uintptr_t)v;
    int status = front_locked(&l->f);
    if (status == 0) {
        to_cache(k, l->a.k, l->a.n_head_kv, l->a.cap, l->pos, l->a.hd);
        to_cache(v, l->a.v, l->a.n_head_kv, l->a.cap, l->pos, l->a.hd);
        if (l->q_scale != 1.0f)
            for (long long i = 0; i < qn; i++) q[i] *= l->q_scale;
        l->a.q = (uintptr_t)q, l->a.y = (uintptr_t)att;
        status = attn_locked(&l->a, attn_threads(&l->a, l->t.threads, l->t.small));
    }
    free(q);
    return status;
}

/* ggmlblock.h */
int layer_locked(layer_args *l) {
    float *att = scratch(1, l->f.w[0].rows);
    if (att == NULL) return -1;
    int status = token_attention(l, att);
    if (status == 0) {
        l->t.a = att;
        status = tail_locked(&l->t);
    }
    free(att);
    return status;
}

/* ggmlblock.h */
bool parse_held(PyObject *held, layer_args *l) {
    front_args *f = &l->f;
    unsigned long long an, qn, kn;
    if (!PyArg_ParseTuple(held, "K(KiL)(KiL)(KiL)KKL", &an, &f->w[0].w, &f->w[0].type,
                          &f->w[0].rows, &f->w[1].w, &f->w[1].type, &f->w[1].rows, &f->w[2].w,
                          &f->w[2].type, &f->w[2].rows, &qn, &kn, &f->hd))
        return false;
    f->attn_norm = (const float *)(uintptr_t)an;
    f->q_norm = (const float *)(uintptr_t)qn, f->k_norm = (const float *)(uintptr_t)kn;
    return true;
}

/* ggmlblock.h */
bool check_front(layer_args *l) {
    front_args *f = &l->f;
    const long long d = f->d, hd = f->hd;
    bool ok = attends() && d >= 1 && hd >= 1 && f->w[0].rows % hd == 0 &&
              f->w[1].rows % hd == 0 && f->w[2].rows == f->w[1].rows && f->w[1].rows > 0 &&
              f->w[0].rows % f->w[1].rows == 0 && f->n_rot >= 2 && f->n_rot % 2 == 0 &&
              f->n_rot <= hd && l->t.threads >= 1 && f->attn_norm != NULL && l->pos >= 0 &&
              l->pos < l->a.cap && l->a.lo >= 0 && l->a.lo <= l->pos;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "layer d=%lld hd=%lld pos=%lld of %lld", d, hd, l->pos,
                     l->a.cap);
        return false;
    }
    f->n = 1, f->kv_f16 = 1, f->threads = l->t.threads, f->small = l->t.small;
    f->q_step = f->w[0].rows / hd, f->kv_step = f->w[1].rows / hd;
    l->a.hd = hd, l->a.n_head = f->q_step, l->a.n_head_kv = f->kv_step;
    l->a.hi = l->pos + 1;
    return true;
}

/* The front and cache of a layer call: (x, d, held, n_rot, neox, cos, sin, eps), held as
 * parse_held reads it, then (k_cache, v_cache, cap, pos, lo, kq_scale, q_scale, softcap);
 * threads and small already in l->t. False with an exception. */
static bool parse_front(PyObject *front, PyObject *cache, layer_args *l) {
    front_args *f = &l->f;
    unsigned long long x, pc, ps, kc, vc;
    PyObject *held;
    if (!PyArg_ParseTuple(front, "KLOLpKKf", &x, &f->d, &held, &f->n_rot, &f->neox, &pc, &ps,
                          &f->eps) ||
        !parse_held(held, l) ||
        !PyArg_ParseTuple(cache, "KKLLLfff", &kc, &vc, &l->a.cap, &l->pos, &l->a.lo,
                          &l->a.scale, &l->q_scale, &l->a.softcap))
        return false;
    f->x = (const float *)(uintptr_t)x;
    f->cos_t = (const float *)(uintptr_t)pc, f->sin_t = (const float *)(uintptr_t)ps;
    l->a.k = (uintptr_t)kc, l->a.v = (uintptr_t)vc;
    return check_front(l);
}

/* ggmlblock.h */
PyObject *run_locked(int (*locked)(void *), void *arg) {
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = locked(arg);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int geglu_layer_locked(void *l) { return layer_locked((layer_args *)l); }

/* ggmlblock.h */
bool parse_tail(PyObject *tail, layer_args *l) {
    tail_args *t = &l->t;
    unsigned long long pa, fn, pf, table;
    if (!PyArg_ParseTuple(tail, "(Ki)(Ki)(Ki)(Ki)LKKKK", &t->wo.w, &t->wo.type, &t->gate.w,
                          &t->gate.type, &t->up.w, &t->up.type, &t->down.w, &t->down.type,
                          &t->ff, &pa, &fn, &pf, &table))
        return false;
    if (t->ff < 1 || fn == 0 || table == 0) {
        PyErr_Format(PyExc_ValueError, "geglu_layer ff=%lld", t->ff);
        return false;
    }
    const long long d = l->f.d;
    t->n = 1, t->d = d, t->q_dim = l->f.w[0].rows, t->eps = l->f.eps;
    t->wo.rows = d, t->down.rows = d, t->gate.rows = t->up.rows = t->ff;
    t->x = l->f.x;
    t->post_attn = (const float *)(uintptr_t)pa, t->ffn_norm = (const float *)(uintptr_t)fn;
    t->post_ffw = (const float *)(uintptr_t)pf, t->table = (const float *)(uintptr_t)table;
    return true;
}

/* geglu_layer(front, cache, ((wo, type), (gate, type), (up, type), (down, type), ff,
 *             post_attn_norm, ffn_norm, post_ffw_norm, gelu_table), y, threads, small):
 * front and cache as parse_front reads them, the tail as parse_tail. */
PyObject *py_geglu_layer(PyObject *self, PyObject *args) {
    (void)self;
    layer_args l;
    memset(&l, 0, sizeof l);
    PyObject *front, *cache, *tail;
    unsigned long long y;
    if (!PyArg_ParseTuple(args, "OOOKiL", &front, &cache, &tail, &y, &l.t.threads, &l.t.small))
        return NULL;
    if (!loaded() || !parse_front(front, cache, &l) || !parse_tail(tail, &l)) return NULL;
    l.t.y = (float *)(uintptr_t)y;
    return run_locked(geglu_layer_locked, &l);
}

/* ggmlblock.h */
int moe_block_locked(moe_layer_args *b) {
    const long long d = b->l.f.d, q_dim = b->l.f.w[0].rows;
    float *att = scratch(1, q_dim + 3 * d);
    if (att == NULL) return -1;
    float *h = att + q_dim, *f = h + d, *e = f + d;
    int status = token_attention(&b->l, att);
    if (status == 0) {
        b->wo.y = (uintptr_t)h;
        int threads = d * (long long)row_size(b->wo.type, q_dim) < b->l.t.small ? 1 : b->l.t.threads;
        status = mats_locked((uintptr_t)att, 1, q_dim, &b->wo, 1, threads);
    }
    if (status == 0) {
        for (long long i = 0; i < d; i++) h[i] = b->l.f.x[i] + h[i];
        rownorm(h, 1, d, b->ffn_norm, b->l.f.eps, f);
        status = moe_locked(&b->m, f, e);
    }
    if (status == 0)
        for (long long i = 0; i < d; i++) b->y[i] = h[i] + e[i];
    free(att);
    return status;
}

/* ggmlblock.h */
bool parse_moe_block(PyObject *block, moe_layer_args *b) {
    PyObject *moe;
    unsigned long long fn;
    if (!PyArg_ParseTuple(block, "(Ki)KO", &b->wo.w, &b->wo.type, &fn, &moe) ||
        !parse_moe(moe, b->l.f.d, &b->m))
        return false;
    if (fn == 0) {
        PyErr_SetString(PyExc_ValueError, "moe_layer: no ffn_norm");
        return false;
    }
    b->m.threads = b->l.t.threads, b->m.small = b->l.t.small;
    b->wo.rows = b->l.f.d;
    b->ffn_norm = (const float *)(uintptr_t)fn;
    return true;
}

static int moe_layer_locked(void *b) { return moe_block_locked((moe_layer_args *)b); }

/* moe_layer(front, cache, ((wo, type), ffn_norm, moe), y, threads, small): front and cache as
 * parse_front reads them, the block as parse_moe_block. */
PyObject *py_moe_layer(PyObject *self, PyObject *args) {
    (void)self;
    moe_layer_args b;
    memset(&b, 0, sizeof b);
    PyObject *front, *cache, *block;
    unsigned long long y;
    if (!PyArg_ParseTuple(args, "OOOKiL", &front, &cache, &block, &y, &b.l.t.threads,
                          &b.l.t.small))
        return NULL;
    if (!loaded() || !parse_front(front, cache, &b.l) || !parse_moe_block(block, &b))
        return NULL;
    b.y = (float *)(uintptr_t)y;
    return run_locked(moe_layer_locked, &b);
}
