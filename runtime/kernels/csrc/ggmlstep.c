/* A whole decode step in one call (ggml's numerics): every block (ggmlblock.c's layer_locked
 * for a GeGLU block, gemma3's; moe_block_locked for a block with a MoE FFN, qwen3moe's), one
 * after the other, the final RMS norm and the output head.
 *
 * One token's step is, per block, a handful of products and row operations; the blocks one call
 * each still cross from Python into C once a block and build each block's arguments in Python.
 * Here the step crosses once: the blocks' weights come as tuples made once per commit (read
 * where the store holds them: a commit changes what the next call reads), the step's own
 * arguments (the token's residual row, its position, the RoPE rows and the keys each kind of
 * layer attends, the caches' buffers) as a few more, and the results are, bit for bit, those of
 * the blocks one call each followed by the final norm (rownorm.h, ggml's) and the head's product
 * (ggmlcall.c's mats_locked, the graph of ggml_mul_mat).
 *
 *   decode_step(layers, (x, d, pos, eps, ropes, x_scale), caches, (out_norm, w, type, rows), y,
 *               threads, small)
 *        layers: per block (held, tail, kind, kq_scale, q_scale), held as ggmlblock.c's
 *        parse_held reads it, tail as parse_tail (a GeGLU block's) or, of three items, as
 *        parse_moe_block (a MoE block's); kind: which of `ropes` the block reads;
 *        ropes: per kind of block (cos, sin, n_rot, neox, lo): the RoPE row of the token's
 *        position (float32 [n_rot / 2] each) and the first key it attends; caches: per block
 *        (k, v, cap), its F16 caches [n_head_kv, cap, hd]; x: the token's embedding, float32
 *        [d], times x_scale (float32 products, as torch's x * scale; 1: x as it is; x is not
 *        written); y: the logits, float32 [rows] (the head W [rows, d] in its blocks at w).
 *
 * A product runs on one thread when its weight bytes are under `small`, else on `threads`.
 */
#include <stdlib.h>
#include <string.h>

#include "ggmlblock.h"
#include "ggmlcall.h"
#include "rownorm.h"

#define MAX_KINDS 4 /* kinds of blocks a step tells apart (gemma3: sliding-window and global) */

typedef struct {
    moe_layer_args b; /* b.l: the block's attention (and a GeGLU block's tail) */
    bool moe;
} step_layer;

typedef struct {
    long long n_layer, d;
    step_layer *layers;
    const float *x, *out_norm;
    mat_arg head;
    float eps, x_scale;
    int threads;
    long long small;
} step_args;

/* The step: the blocks, each reading the one before's output, then the norm and the head.
 * LOCK held, no GIL; 0 or -1. */
static int step_locked(step_args *s) {
    const long long d = s->d;
    float *buf = (float *)malloc((size_t)(4 * d) * sizeof(float));
    if (buf == NULL) return -1;
    const float *cur = s->x;
    if (s->x_scale != 1.0f) {
        float *scaled = buf + 3 * d;
        for (long long i = 0; i < d; i++) scaled[i] = s->x[i] * s->x_scale;
        cur = scaled;
    }
    int status = 0;
    for (long long i = 0; i < s->n_layer && status == 0; i++) {
        step_layer *b = &s->layers[i];
        float *out = buf + (i % 2) * d;
        b->b.l.f.x = cur, b->b.l.t.x = cur, b->b.l.t.y = out, b->b.y = out;
        status = b->moe ? moe_block_locked(&b->b) : layer_locked(&b->b.l);
        cur = out;
    }
    if (status == 0) {
        float *xn = buf + 2 * d;
        rownorm(cur, 1, d, s->out_norm, s->eps, xn);
        long long bytes = s->head.rows * (long long)row_size(s->head.type, d);
        status = mats_locked((uintptr_t)xn, 1, d, &s->head, 1,
                             bytes < s->small ? 1 : s->threads);
    }
    free(buf);
    return status;
}

typedef struct {
    unsigned long long cos, sin;
    long long n_rot, lo;
    int neox;
} rope_row;

/* The step's ropes: 1 to MAX_KINDS of (cos, sin, n_rot, neox, lo); the count, or -1. */
static int parse_ropes(PyObject *ropes, rope_row *r) {
    if (!PyTuple_Check(ropes) || PyTuple_GET_SIZE(ropes) < 1 ||
        PyTuple_GET_SIZE(ropes) > MAX_KINDS) {
        PyErr_Format(PyExc_ValueError, "decode_step: 1 to %d ropes", MAX_KINDS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ropes); i++)
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(ropes, i), "KKLpL", &r[i].cos, &r[i].sin,
                              &r[i].n_rot, &r[i].neox, &r[i].lo))
            return -1;
    return (int)PyTuple_GET_SIZE(ropes);
}

/* Block i of the step from its (held, tail, kind, kq_scale, q_scale) and (k, v, cap); false
 * with an exception. */
static bool parse_layer(PyObject *item, PyObject *cache, const rope_row *ropes, int n_kinds,
                        const step_args *s, long long pos, step_layer *b) {
    layer_args *l = &b->b.l;
    PyObject *held, *tail;
    int kind;
    unsigned long long kc, vc;
    if (!PyArg_ParseTuple(item, "OOiff", &held, &tail, &kind, &l->a.scale, &l->q_scale) ||
        !PyArg_ParseTuple(cache, "KKL", &kc, &vc, &l->a.cap) || !parse_held(held, l))
        return false;
    if (kind < 0 || kind >= n_kinds) {
        PyErr_Format(PyExc_ValueError, "decode_step: kind %d of %d", kind, n_kinds);
        return false;
    }
    const rope_row *r = &ropes[kind];
    front_args *f = &l->f;
    f->d = s->d, f->eps = s->eps, f->n_rot = r->n_rot, f->neox = r->neox;
    f->cos_t = (const float *)(uintptr_t)r->cos, f->sin_t = (const float *)(uintptr_t)r->sin;
    l->a.k = (uintptr_t)kc, l->a.v = (uintptr_t)vc, l->a.lo = r->lo, l->a.softcap = 0.0f;
    l->pos = pos, l->t.threads = s->threads, l->t.small = s->small;
    b->moe = PyTuple_Check(tail) && PyTuple_GET_SIZE(tail) == 3;
    return check_front(l) && (b->moe ? parse_moe_block(tail, &b->b) : parse_tail(tail, l));
}

static int step_locked_arg(void *s) { return step_locked((step_args *)s); }

PyObject *py_decode_step(PyObject *self, PyObject *args) {
    (void)self;
    step_args s;
    memset(&s, 0, sizeof s);
    PyObject *layers, *caches, *ropes;
    unsigned long long x, on, y;
    long long pos;
    if (!PyArg_ParseTuple(args, "O!(KLLfOf)O!(KKiL)KiL", &PyTuple_Type, &layers, &x, &s.d, &pos,
                          &s.eps, &ropes, &s.x_scale, &PyTuple_Type, &caches, &on, &s.head.w,
                          &s.head.type, &s.head.rows, &y, &s.threads, &s.small))
        return NULL;
    if (!loaded()) return NULL;
    s.n_layer = PyTuple_GET_SIZE(layers);
    if (s.n_layer < 1 || PyTuple_GET_SIZE(caches) != s.n_layer || s.d < 1 || on == 0 ||
        s.head.rows < 1 || s.threads < 1)
        return PyErr_Format(PyExc_ValueError, "decode_step: %lld blocks, %zd caches, d=%lld",
                            s.n_layer, PyTuple_GET_SIZE(caches), s.d);
    rope_row r[MAX_KINDS];
    int n_kinds = parse_ropes(ropes, r);
    if (n_kinds < 0) return NULL;
    s.layers = (step_layer *)calloc((size_t)s.n_layer, sizeof(step_layer));
    if (s.layers == NULL) return PyErr_NoMemory();
    for (long long i = 0; i < s.n_layer; i++) {
        if (!parse_layer(PyTuple_GET_ITEM(layers, i), PyTuple_GET_ITEM(caches, i), r, n_kinds,
                         &s, pos, &s.layers[i])) {
            free(s.layers);
            return NULL;
        }
    }
    s.x = (const float *)(uintptr_t)x, s.out_norm = (const float *)(uintptr_t)on;
    s.head.y = y;
    PyObject *result = run_locked(step_locked_arg, &s);
    free(s.layers);
    return result;
}
