/* A MoE FFN of stacked SwiGLU experts for one token in one call (ggml's numerics): llama.cpp's
 * build_moe_ffn as its graph computes it on the CPU.
 *
 *   moe_ffn(f, d, (router, type, n_expert), k, norm, scale, ((gate, type), (up, type),
 *           (down, type)), ff, y, threads, small)
 *        probs = soft_max(router @ f) (ggml's mul_mat and soft_max nodes); the k experts of
 *        the largest probabilities, largest first (ggml_argsort_top_k's order; a tie goes to
 *        the lower id); their weights, divided by their sum when `norm` (ggml_sum_rows: summed
 *        in double, rounded to float), times `scale` when it is not 1; the experts' SwiGLU
 *        (ggml's mul_mat_id, silu and mul nodes, ggmlcall.c's experts_locked); y[d] = the
 *        experts' outputs times their weights, added in slot order (ggml_mul, then ggml_add of
 *        the views one after the other). f, y float32 [d]; the router float32 [n_expert, d] of
 *        ggml type `type` (F32).
 *
 * Compiled without FMA contraction: the weighted sum is ggml's float32 operations, in order.
 */
#include <stdlib.h>
#include <string.h>

#include "ggmlcall.h"

/* ids[k]: the k largest of probs[n], largest first (a tie: the lower id first). */
static void top_k(const float *probs, long long n, long long k, int32_t *ids) {
    for (long long j = 0; j < k; j++) {
        long long best = -1;
        for (long long e = 0; e < n; e++) {
            bool taken = false;
            for (long long i = 0; i < j && !taken; i++) taken = ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = (int32_t)best;
    }
}

/* ggmlcall.h */
int moe_locked(moe_args *m, const float *f, float *y) {
    const long long n = m->router.rows, k = m->k, d = m->d, ff = m->ff;
    float *probs = (float *)malloc((size_t)(2 * n + 4 * k * ff + k * d + k) * sizeof(float));
    if (probs == NULL) return -1;
    float *logits = probs + n, *scratch = logits + n, *down = scratch + 4 * k * ff;
    float *w = down + k * d;
    int32_t ids[MAX_USED];
    m->router.y = (uintptr_t)logits;
    const int one = 1; /* the router's product and a token's experts: small at one token */
    int status = router_locked(&m->router, d, (uintptr_t)f, (uintptr_t)probs, one);
    if (status == 0) {
        top_k(probs, n, k, ids);
        double sum = 0.0;
        for (long long j = 0; j < k; j++) sum += (double)(w[j] = probs[ids[j]]);
        for (long long j = 0; j < k; j++) {
            if (m->norm) w[j] = w[j] / (float)sum;
            if (m->scale != 1.0f) w[j] = w[j] * m->scale;
        }
        long long bytes = 0;
        for (int i = 0; i < 3; i++) bytes += m->stacks[i].rows * (long long)row_size(m->stacks[i].type, i == 2 ? ff : d);
        int threads = k * bytes < m->small ? one : m->threads;
        status = experts_locked((uintptr_t)f, d, ff, (uintptr_t)ids, k, m->stacks,
                                (uintptr_t)scratch, (uintptr_t)down, threads);
    }
    if (status == 0) {
        for (long long i = 0; i < d; i++) y[i] = down[i] * w[0];
        for (long long j = 1; j < k; j++)
            for (long long i = 0; i < d; i++) y[i] = y[i] + down[j * d + i] * w[j];
    }
    free(probs);
    return status;
}

/* ggmlcall.h: moe_args from Python's ((router, type, n_expert), k, norm, scale, ((gate, type),
 * (up, type), (down, type)), ff) after f and d. */
bool parse_moe(PyObject *spec, long long d, moe_args *m) {
    memset(m, 0, sizeof *m);
    m->d = d;
    if (!PyArg_ParseTuple(spec, "(KiL)Lpf((Ki)(Ki)(Ki))L", &m->router.w, &m->router.type,
                          &m->router.rows, &m->k, &m->norm, &m->scale, &m->stacks[0].w,
                          &m->stacks[0].type, &m->stacks[1].w, &m->stacks[1].type,
                          &m->stacks[2].w, &m->stacks[2].type, &m->ff))
        return false;
    if (!routes() || m->router.rows < 1 || m->k < 1 || m->k > MAX_USED ||
        m->k > m->router.rows || m->ff < 1 || d < 1) {
        PyErr_Format(PyExc_ValueError, "moe: %lld of %lld experts (at most %d), ff=%lld",
                     m->k, m->router.rows, MAX_USED, m->ff);
        return false;
    }
    for (int i = 0; i < 3; i++) {
        m->stacks[i].n_expert = m->router.rows;
        m->stacks[i].rows = i == 2 ? d : m->ff;
    }
    return true;
}

PyObject *py_moe_ffn(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long f, y;
    long long d;
    PyObject *spec;
    moe_args m;
    if (!PyArg_ParseTuple(args, "KLOKiL", &f, &d, &spec, &y, &m.threads, &m.small)) return NULL;
    int threads = m.threads;
    long long small = m.small;
    if (!loaded() || !parse_moe(spec, d, &m)) return NULL;
    m.threads = threads, m.small = small;
    int status;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&LOCK);
    status = moe_locked(&m, (const float *)(uintptr_t)f, (float *)(uintptr_t)y);
    pthread_mutex_unlock(&LOCK);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
