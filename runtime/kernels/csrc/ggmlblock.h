/* What ggmlblock.c (a block's steps in one call) shares with ggmlstep.c (a decode step's blocks,
 * final norm and head in one call). */
#ifndef GGUFSWAP_GGMLBLOCK_H
#define GGUFSWAP_GGMLBLOCK_H

#include "ggmlcall.h"

/* A GeGLU block's half after attention (tail_locked). */
typedef struct {
    long long n, d, q_dim, ff, small;
    mat_arg wo, gate, up, down;
    const float *x, *a, *post_attn, *ffn_norm, *post_ffw, *table;
    float eps;
    float *y;
    int threads;
} tail_args;

/* A block's attention up to the heads' q, k, v (front_locked). */
typedef struct {
    long long n, d, hd, n_rot, q_step, kv_step, small;
    mat_arg w[3]; /* q, k, v */
    const float *x, *attn_norm, *q_norm, *k_norm, *cos_t, *sin_t;
    int neox, threads, kv_f16;
    float eps;
} front_args;

/* One token through a block: its front, attention over the F16 caches, its tail. */
typedef struct {
    front_args f;
    attn_arg a;
    tail_args t;
    long long pos; /* the token's position: its keys and values go to row pos of the caches */
    float q_scale;
} layer_args;

/* The attention half's weights, (attn_norm, (wq, type, rows), (wk, ...), (wv, ...), q_norm,
 * k_norm, hd), into l->f; false with an exception. */
bool parse_held(PyObject *held, layer_args *l);

/* Checks a layer's front (its weights, d, n_rot, eps and caches set, l->t.threads and small
 * too) and derives the rest of it; false with a ValueError. */
bool check_front(layer_args *l);

/* A GeGLU tail, ((wo, type), (gate, type), (up, type), (down, type), ff, post_attn_norm,
 * ffn_norm, post_ffw_norm, gelu_table), into l->t (after the front: its d, q_dim, eps, x);
 * false with an exception. l->t.y is the caller's. */
bool parse_tail(PyObject *tail, layer_args *l);

/* One token through a GeGLU block: its front, its keys and values written to the caches, the
 * attention, the tail; LOCK held, no GIL; 0 or -1. */
int layer_locked(layer_args *l);

/* A pre-norm block with a MoE FFN (qwen3moe's): its attention as a GeGLU block's (l), then the
 * output product wo, the residual, the FFN norm, the MoE FFN (m) and the residual into y. */
typedef struct {
    layer_args l;
    moe_args m;
    mat_arg wo;
    const float *ffn_norm;
    float *y;
} moe_layer_args;

/* The block after the attention, ((wo, type), ffn_norm, moe) with moe as ggmlmoe.c's parse_moe,
 * into b (after its front: d, threads, small); false with an exception. b->y is the caller's. */
bool parse_moe_block(PyObject *block, moe_layer_args *b);

/* One token through a block with a MoE FFN: y = h + moe(ffn_norm(h)), h = x + attention @ Wo.T;
 * LOCK held, no GIL; 0 or -1. */
int moe_block_locked(moe_layer_args *b);

/* locked(arg) with LOCK held and without the GIL: None, or MemoryError where it returned -1. */
PyObject *run_locked(int (*locked)(void *), void *arg);

#endif
