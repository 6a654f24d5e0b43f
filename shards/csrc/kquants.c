/* ggml's reference quantizers for the K-quant and IQ4 types, compiled (ggufswap.shards._kquants).
 *
 * The same algorithms as shards/kquants.py (numpy), which follows ggml/src/ggml-quants.c:
 * quantize_row_q{2..6}_K_ref, quantize_iq4_nl and quantize_iq4_xs (no importance matrix), and
 * writes the bytes ggml_quantize_chunk writes. Each function here is ggml's code, statement by
 * statement, in float32 and in its order: setup.py compiles this file with -ffp-contract=off (no
 * fused multiply-adds) and without -ffast-math, so every product and sum rounds as ggml's do.
 * fp16 fields are rounded to nearest even by a software conversion (numpy's, which is also what
 * F16C does), so the bytes do not depend on the CPU. Two changes of form, not of arithmetic, for
 * speed: make_qkx2_quants (Q2_K, Q4_K, Q5_K) runs on all sub-blocks of a super-block at once, one
 * lane each, and best_index_int8 (IQ4) finds its bracket in a table instead of a binary search.
 * tests/test_kquants.py checks the output of both implementations against the bytes ggml wrote,
 * and against each other on random data.
 *
 * Python interface:
 *   quantize(type, src, dst, threads=1) -> None
 *                                      src: C-contiguous float32 buffer of whole blocks;
 *                                      dst: writable buffer of exactly the blocks' bytes.
 *                                      The GIL is released while quantizing; the blocks are
 *                                      split over `threads` POSIX threads (each block is
 *                                      independent: the bytes do not depend on the split).
 *   types() -> tuple[int, ...]         GGML type ids quantized here
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

enum { T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
       T_IQ4_XS = 23 };

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};

/* ------------------------------------------------------------------ fp16 */

/* numpy's npy_floatbits_to_halfbits: round to nearest even, NaN payload kept, overflow to inf. */
static uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x & 0x80000000u) >> 16);
    uint32_t f_exp = x & 0x7f800000u;
    uint32_t f_sig;
    if (f_exp >= 0x47800000u) {
        if (f_exp == 0x7f800000u) {
            f_sig = x & 0x007fffffu;
            if (f_sig != 0) {
                uint16_t ret = (uint16_t)(0x7c00u + (f_sig >> 13));
                if (ret == 0x7c00u) ret++;
                return (uint16_t)(sign + ret);
            }
        }
        return (uint16_t)(sign + 0x7c00u);
    }
    if (f_exp <= 0x38000000u) {
        if (f_exp < 0x33000000u) return sign;
        f_exp >>= 23;
        f_sig = 0x00800000u + (x & 0x007fffffu);
        f_sig >>= (113 - f_exp);
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (x & 0x000007ffu)) f_sig += 0x00001000u;
        return (uint16_t)(sign + (uint16_t)(f_sig >> 13));
    }
    uint16_t h_exp = (uint16_t)((f_exp - 0x38000000u) >> 13);
    f_sig = x & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
    uint16_t h_sig = (uint16_t)(f_sig >> 13);
    h_sig = (uint16_t)(h_sig + h_exp);
    return (uint16_t)(sign + h_sig);
}

static float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The fp16 round trip that storing a field and reading it back does. */
static inline void put_fp16(uint8_t *p, float v) {
    uint16_t h = fp32_to_fp16(v);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

static inline float get_fp16(const uint8_t *p) {
    return fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

/* ------------------------------------------------------------------ ggml's helpers */

static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's best_index_int8(16, kvalues_iq4nl, x) without its binary search (whose branches the CPU
 * mispredicts): inside (val[0], val[15]) the search ends at mu, the first value above x, and for
 * integer values "val > x" is "val > floor(x)", so a table indexed by floor(x) gives mu. Outside,
 * and for NaN (which the search takes to 15), the same answers as ggml's. */
static int8_t IQ4_MU[256]; /* by floor(x) + 128, for floor(x) in [-127, 112] */

static void init_iq4_table(void) {
    for (int k = -128; k < 128; ++k) {
        int mu = 15;
        for (int i = 0; i < 16; ++i) {
            if (IQ4NL_VALUES[i] > k) {
                mu = i;
                break;
            }
        }
        IQ4_MU[k + 128] = (int8_t)MAX(1, MIN(15, mu));
    }
}

static inline int best_index_int8(int n, const int8_t *val, float x) {
    if (x <= val[0]) return 0;
    if (x >= val[n - 1] || x != x) return n - 1;
    int mu = IQ4_MU[(int)floorf(x) + 128];
    return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL) */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0;
    float amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0;
    float suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAX(-nmax, MIN(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = MAX(-nmax, MIN(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + MAX(-nmax, MIN(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* make_q3_quants(n, nmax, x, L, do_rmse = true) */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0;
    float amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0;
    float suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAX(-nmax, MIN(nmax - 1, l));
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = MAX(-nmax, MIN(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* ggml's make_qkx2_quants on G groups at once, for speed: lane g is group g, and xt, wt, L are
 * laid out [n][G] (position-major). Each lane does exactly the scalar function's operations in
 * its order (the sums stay sequential within a lane), so the compiler can vectorize across lanes
 * without reassociating anything (-ffp-contract=off, no -ffast-math). The scalar branches become
 * per-lane selects; a lane that the scalar code would leave early (max == min) computes values
 * that are discarded at the end. */
#define MAX_LANES 16
static inline __attribute__((always_inline)) void make_qkx2_lanes(
    const int n, const int G, const int nmax, const float *xt, const float *wt, uint8_t *L,
    float *scale_out, float *min_out, const float rmin, const float rdelta, const int nstep,
    const bool use_mad) {
    float mn[MAX_LANES], mx[MAX_LANES], sum_w[MAX_LANES], sum_x[MAX_LANES], scale[MAX_LANES];
    float best[MAX_LANES], iscale[MAX_LANES], flat_min[MAX_LANES];
    float sum_l[MAX_LANES], sum_l2[MAX_LANES], sum_xl[MAX_LANES], ts[MAX_LANES], tm[MAX_LANES];
    float cur[MAX_LANES];
    int take[MAX_LANES], flat[MAX_LANES];
    uint8_t Laux[32 * MAX_LANES];
    for (int g = 0; g < G; ++g) {
        mn[g] = xt[g];
        mx[g] = xt[g];
        sum_w[g] = wt[g];
        sum_x[g] = sum_w[g] * xt[g];
    }
    for (int i = 1; i < n; ++i) {
        for (int g = 0; g < G; ++g) {
            const float xi = xt[i * G + g], w = wt[i * G + g];
            mn[g] = xi < mn[g] ? xi : mn[g];
            mx[g] = xi > mx[g] ? xi : mx[g];
            sum_w[g] += w;
            sum_x[g] += w * xi;
        }
    }
    for (int g = 0; g < G; ++g) {
        mn[g] = mn[g] > 0 ? 0.f : mn[g];
        flat[g] = mx[g] == mn[g];
        flat_min[g] = -mn[g];
        iscale[g] = nmax / (mx[g] - mn[g]);
        scale[g] = 1 / iscale[g];
        best[g] = 0;
    }
    for (int i = 0; i < n; ++i) {
        for (int g = 0; g < G; ++g) {
            const float xi = xt[i * G + g], w = wt[i * G + g];
            int l = nearest_int(iscale[g] * (xi - mn[g]));
            l = MAX(0, MIN(nmax, l));
            L[i * G + g] = (uint8_t)l;
            float diff = scale[g] * l + mn[g] - xi;
            diff = use_mad ? fabsf(diff) : diff * diff;
            best[g] += w * diff;
        }
    }
    for (int is = 0; is <= nstep; ++is) {
        for (int g = 0; g < G; ++g) {
            iscale[g] = (rmin + rdelta * is + nmax) / (mx[g] - mn[g]);
            sum_l[g] = sum_l2[g] = sum_xl[g] = 0;
        }
        for (int i = 0; i < n; ++i) {
            for (int g = 0; g < G; ++g) {
                const float xi = xt[i * G + g], w = wt[i * G + g];
                int l = nearest_int(iscale[g] * (xi - mn[g]));
                l = MAX(0, MIN(nmax, l));
                Laux[i * G + g] = (uint8_t)l;
                sum_l[g] += w * l;
                sum_l2[g] += w * l * l;
                sum_xl[g] += w * l * xi;
            }
        }
        for (int g = 0; g < G; ++g) {
            const float D = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            float this_scale = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D;
            float this_min = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D;
            const int positive = this_min > 0;
            ts[g] = positive ? sum_xl[g] / sum_l2[g] : this_scale;
            tm[g] = positive ? 0.f : this_min;
            take[g] = D > 0;
            cur[g] = 0;
        }
        for (int i = 0; i < n; ++i) {
            for (int g = 0; g < G; ++g) {
                const float xi = xt[i * G + g], w = wt[i * G + g];
                float diff = ts[g] * Laux[i * G + g] + tm[g] - xi;
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur[g] += w * diff;
            }
        }
        for (int g = 0; g < G; ++g) {
            take[g] = take[g] && cur[g] < best[g];
            best[g] = take[g] ? cur[g] : best[g];
            scale[g] = take[g] ? ts[g] : scale[g];
            mn[g] = take[g] ? tm[g] : mn[g];
        }
        for (int i = 0; i < n; ++i)
            for (int g = 0; g < G; ++g) L[i * G + g] = take[g] ? Laux[i * G + g] : L[i * G + g];
    }
    for (int g = 0; g < G; ++g) {
        scale_out[g] = flat[g] ? 0.f : scale[g];
        min_out[g] = flat[g] ? flat_min[g] : -mn[g];
    }
    for (int i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) L[i * G + g] = flat[g] ? 0 : L[i * G + g];
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* ------------------------------------------------------------------ one block per type */

/* block_q2_K: scales[16] qs[64] d dmin (84 bytes) */
static void quantize_q2_k(const float *x, uint8_t *y) {
    uint8_t *scales_q = y, *qs = y + 16, *d_p = y + 80, *dmin_p = y + 82;
    uint8_t L[QK_K];
    float mins[QK_K / 16], scales[QK_K / 16];
    const float q4scale = 15.f;
    float max_scale = 0;
    float max_min = 0;
    float xt[QK_K], wt[QK_K];
    uint8_t Lt[QK_K];
    for (int j = 0; j < QK_K / 16; ++j) {
        for (int l = 0; l < 16; ++l) {
            xt[l * 16 + j] = x[16 * j + l];
            wt[l * 16 + j] = fabsf(x[16 * j + l]);
        }
    }
    make_qkx2_lanes(16, 16, 3, xt, wt, Lt, scales, mins, -0.5f, 0.1f, 15, true);
    for (int j = 0; j < QK_K / 16; ++j)
        for (int l = 0; l < 16; ++l) L[16 * j + l] = Lt[l * 16 + j];
    for (int j = 0; j < QK_K / 16; ++j) {
        float scale = scales[j];
        if (scale > max_scale) max_scale = scale;
        float min = mins[j];
        if (min > max_min) max_min = min;
    }
    if (max_scale > 0) {
        float iscale = q4scale / max_scale;
        for (int j = 0; j < QK_K / 16; ++j) {
            int l = nearest_int(iscale * scales[j]);
            scales_q[j] = (uint8_t)l;
        }
        put_fp16(d_p, max_scale / q4scale);
    } else {
        for (int j = 0; j < QK_K / 16; ++j) scales_q[j] = 0;
        put_fp16(d_p, 0.f);
    }
    if (max_min > 0) {
        float iscale = q4scale / max_min;
        for (int j = 0; j < QK_K / 16; ++j) {
            int l = nearest_int(iscale * mins[j]);
            scales_q[j] = (uint8_t)(scales_q[j] | (l << 4));
        }
        put_fp16(dmin_p, max_min / q4scale);
    } else {
        put_fp16(dmin_p, 0.f);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
        const float d = get_fp16(d_p) * (scales_q[j] & 0xF);
        if (!d) continue;
        const float dm = get_fp16(dmin_p) * (scales_q[j] >> 4);
        for (int ii = 0; ii < 16; ++ii) {
            int l = nearest_int((x[16 * j + ii] + dm) / d);
            l = MAX(0, MIN(3, l));
            L[16 * j + ii] = (uint8_t)l;
        }
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
        }
    }
}

/* block_q3_K: hmask[32] qs[64] scales[12] d (110 bytes) */
static void quantize_q3_k(const float *x, uint8_t *y) {
    uint8_t *hmask = y, *qs = y + 32, *sc_q = y + 96, *d_p = y + 108;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0;
    float amax = 0;
    for (int j = 0; j < QK_K / 16; ++j) {
        scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
        float scale = fabsf(scales[j]);
        if (scale > amax) {
            amax = scale;
            max_scale = scales[j];
        }
    }
    memset(sc_q, 0, 12);
    if (max_scale) {
        float iscale = -32.f / max_scale;
        for (int j = 0; j < QK_K / 16; ++j) {
            int8_t l = (int8_t)nearest_int(iscale * scales[j]);
            l = (int8_t)(MAX(-32, MIN(31, l)) + 32);
            if (j < 8) {
                sc_q[j] = (uint8_t)(l & 0xF);
            } else {
                sc_q[j - 8] = (uint8_t)(sc_q[j - 8] | ((l & 0xF) << 4));
            }
            l = (int8_t)(l >> 4);
            sc_q[j % 4 + 8] = (uint8_t)(sc_q[j % 4 + 8] | (l << (2 * (j / 4))));
        }
        put_fp16(d_p, 1 / iscale);
    } else {
        put_fp16(d_p, 0.f);
    }
    int8_t sc;
    for (int j = 0; j < QK_K / 16; ++j) {
        sc = (int8_t)(j < 8 ? sc_q[j] & 0xF : sc_q[j - 8] >> 4);
        sc = (int8_t)((sc | (((sc_q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        float d = get_fp16(d_p) * sc;
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii) {
            int l = nearest_int(x[16 * j + ii] / d);
            l = MAX(-4, MIN(3, l));
            L[16 * j + ii] = (int8_t)(l + 4);
        }
    }
    memset(hmask, 0, QK_K / 8);
    int m = 0;
    uint8_t hm = 1;
    for (int j = 0; j < QK_K; ++j) {
        if (L[j] > 3) {
            hmask[m] |= hm;
            L[j] = (int8_t)(L[j] - 4);
        }
        if (++m == QK_K / 8) {
            m = 0;
            hm = (uint8_t)(hm << 1);
        }
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
        }
    }
}

/* What Q4_K and Q5_K share: d dmin scales[12] (16 bytes at y) and the codes L. */
static void quantize_q45_k(const float *x, uint8_t *y, uint8_t *L, int nmax, float rmin,
                           int nstep) {
    uint8_t *d_p = y, *dmin_p = y + 2, *sc_q = y + 4;
    float mins[QK_K / 32], scales[QK_K / 32];
    float max_scale = 0;
    float max_min = 0;
    float xt[QK_K], wt[QK_K], sum_x2[8], av_x[8];
    uint8_t Lt[QK_K];
    for (int j = 0; j < QK_K / 32; ++j) {
        sum_x2[j] = 0;
        for (int l = 0; l < 32; ++l) xt[l * 8 + j] = x[32 * j + l];
    }
    for (int l = 0; l < 32; ++l)
        for (int j = 0; j < 8; ++j) sum_x2[j] += xt[l * 8 + j] * xt[l * 8 + j];
    for (int j = 0; j < 8; ++j) av_x[j] = sqrtf(sum_x2[j] / 32);
    for (int l = 0; l < 32; ++l)
        for (int j = 0; j < 8; ++j) wt[l * 8 + j] = av_x[j] + fabsf(xt[l * 8 + j]);
    if (nmax == 15)
        make_qkx2_lanes(32, 8, 15, xt, wt, Lt, scales, mins, rmin, 0.1f, nstep, false);
    else
        make_qkx2_lanes(32, 8, 31, xt, wt, Lt, scales, mins, rmin, 0.1f, nstep, false);
    for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) L[32 * j + l] = Lt[l * 8 + j];
    for (int j = 0; j < QK_K / 32; ++j) {
        float scale = scales[j];
        if (scale > max_scale) max_scale = scale;
        float min = mins[j];
        if (min > max_min) max_min = min;
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = MIN(63, ls);
        lm = MIN(63, lm);
        if (j < 4) {
            sc_q[j] = ls;
            sc_q[j + 4] = lm;
        } else {
            sc_q[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc_q[j - 4] = (uint8_t)(sc_q[j - 4] | ((ls >> 4) << 6));
            sc_q[j - 0] = (uint8_t)(sc_q[j - 0] | ((lm >> 4) << 6));
        }
    }
    put_fp16(d_p, max_scale / 63.f);
    put_fp16(dmin_p, max_min / 63.f);
    uint8_t sc, m;
    for (int j = 0; j < QK_K / 32; ++j) {
        get_scale_min_k4(j, sc_q, &sc, &m);
        const float d = get_fp16(d_p) * sc;
        if (!d) continue;
        const float dm = get_fp16(dmin_p) * m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            l = MAX(0, MIN(nmax, l));
            L[32 * j + ii] = (uint8_t)l;
        }
    }
}

/* block_q4_K: d dmin scales[12] qs[128] (144 bytes) */
static void quantize_q4_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K];
    quantize_q45_k(x, y, L, 15, -1.f, 20);
    uint8_t *q = y + 16;
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

/* block_q5_K: d dmin scales[12] qh[32] qs[128] (176 bytes) */
static void quantize_q5_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K];
    quantize_q45_k(x, y, L, 31, -0.5f, 15);
    uint8_t *qh = y + 16, *ql = y + 48;
    memset(qh, 0, QK_K / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            int l2 = L[n + j + 32];
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 = (uint8_t)(m1 << 2);
        m2 = (uint8_t)(m2 << 2);
        ql += 32;
    }
}

/* block_q6_K: ql[128] qh[64] scales[16] d (210 bytes) */
static void quantize_q6_k(const float *x, uint8_t *y) {
    uint8_t *ql = y, *qh = y + 128, *sc_q = y + 192, *d_p = y + 208;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        put_fp16(d_p, 0.f);
        return;
    }
    float iscale = -128.f / max_scale;
    put_fp16(d_p, 1 / iscale);
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        sc_q[ib] = (uint8_t)(int8_t)MIN(127, nearest_int(iscale * scales[ib]));
    }
    for (int j = 0; j < QK_K / 16; ++j) {
        float d = get_fp16(d_p) * (int8_t)sc_q[j];
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii) {
            int l = nearest_int(x[16 * j + ii] / d);
            l = MAX(-32, MIN(31, l));
            L[16 * j + ii] = (int8_t)(l + 32);
        }
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF;
            const uint8_t q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF;
            const uint8_t q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                              ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* quantize_row_iq4_nl_impl without importance weights, ntry 7: IQ4_NL (one 32-value block, the
 * scale in d) and IQ4_XS (8 blocks of 32 under one super-block scale). */
static void quantize_iq4_impl(int super_block_size, const float *x, uint8_t *dh, uint8_t *q4,
                              uint8_t *scales_h, uint8_t *scales_l) {
    const int block_size = 32, ntry = 7;
    const int8_t *values = IQ4NL_VALUES;
    uint8_t L[QK_K];
    float scales[QK_K / 32] = {0}, weight[32];
    memset(q4, 0, (size_t)super_block_size / 2);
    put_fp16(dh, 0.f);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < super_block_size / block_size; ++ib) {
        const float *xb = x + ib * block_size;
        uint8_t *Lb = L + ib * block_size;
        for (int j = 0; j < block_size; ++j) weight[j] = xb[j] * xb[j];
        float amax = 0, max = 0;
        for (int j = 0; j < block_size; ++j) {
            float ax = fabsf(xb[j]);
            if (ax > amax) {
                amax = ax;
                max = xb[j];
            }
        }
        if (amax < GROUP_MAX_EPS) {
            scales[ib] = 0;
            continue;
        }
        float d = -max / values[0];
        float id = 1 / d;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < block_size; ++j) {
            float al = id * xb[j];
            int l = best_index_int8(16, values, al);
            Lb[j] = (uint8_t)l;
            float q = values[l];
            float w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; ++itry) {
            id = (itry + values[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < block_size; ++j) {
                float al = id * xb[j];
                int l = best_index_int8(16, values, al);
                float q = values[l];
                float w = weight[j];
                sumqx += w * q * xb[j];
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        float abs_d = fabsf(d);
        if (abs_d > amax_scale) {
            amax_scale = abs_d;
            max_scale = d;
        }
    }
    if (super_block_size / block_size > 1) {
        uint16_t sh = 0;
        float d = -max_scale / 32;
        put_fp16(dh, d);
        float id = d ? 1 / d : 0.f;
        for (int ib = 0; ib < super_block_size / block_size; ++ib) {
            int l = nearest_int(id * scales[ib]);
            l = MAX(-32, MIN(31, l));
            float dl = d * l;
            float idl = dl ? 1 / dl : 0.f;
            uint8_t *Lb = L + ib * block_size;
            const float *xb = x + ib * block_size;
            for (int j = 0; j < block_size; ++j) Lb[j] = (uint8_t)best_index_int8(16, values, idl * xb[j]);
            l += 32;
            uint8_t l_l = (uint8_t)(l & 0xf);
            uint8_t l_h = (uint8_t)(l >> 4);
            if (ib % 2 == 0) scales_l[ib / 2] = l_l;
            else scales_l[ib / 2] = (uint8_t)(scales_l[ib / 2] | (l_l << 4));
            sh = (uint16_t)(sh | (l_h << 2 * (ib % 8)));
        }
        scales_h[0] = (uint8_t)(sh & 0xff);
        scales_h[1] = (uint8_t)(sh >> 8);
    } else {
        put_fp16(dh, scales[0]);
        float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < super_block_size; ++j) L[j] = (uint8_t)best_index_int8(16, values, id * x[j]);
    }
    for (int i = 0; i < super_block_size / 32; ++i) {
        for (int j = 0; j < 16; ++j) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
    }
}

/* block_iq4_nl: d qs[16] (18 bytes) */
static void quantize_iq4_nl(const float *x, uint8_t *y) {
    quantize_iq4_impl(32, x, y, y + 2, NULL, NULL);
}

/* block_iq4_xs: d scales_h scales_l[4] qs[128] (136 bytes) */
static void quantize_iq4_xs(const float *x, uint8_t *y) {
    quantize_iq4_impl(QK_K, x, y, y + 8, y + 2, y + 4);
}

/* ------------------------------------------------------------------ the module */

typedef struct {
    int type;
    int block_size;
    int type_size;
    void (*quantize)(const float *, uint8_t *);
} qtype;

static const qtype QTYPES[] = {
    {T_Q2_K, QK_K, 84, quantize_q2_k},    {T_Q3_K, QK_K, 110, quantize_q3_k},
    {T_Q4_K, QK_K, 144, quantize_q4_k},   {T_Q5_K, QK_K, 176, quantize_q5_k},
    {T_Q6_K, QK_K, 210, quantize_q6_k},   {T_IQ4_NL, 32, 18, quantize_iq4_nl},
    {T_IQ4_XS, QK_K, 136, quantize_iq4_xs},
};
#define N_QTYPES (sizeof QTYPES / sizeof QTYPES[0])

static const qtype *find_type(int type) {
    for (size_t i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    PyErr_Format(PyExc_ValueError, "no compiled quantizer for GGML type %d", type);
    return NULL;
}

typedef struct {
    const qtype *t;
    const float *x;
    uint8_t *y;
    Py_ssize_t b0, b1;
} quantize_job;

static void *quantize_range(void *arg) {
    const quantize_job *j = (const quantize_job *)arg;
    for (Py_ssize_t b = j->b0; b < j->b1; b++)
        j->t->quantize(j->x + b * j->t->block_size, j->y + b * j->t->type_size);
    return NULL;
}

#define MAX_THREADS 64

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    int type, threads = 1;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "iy*w*|i", &type, &src, &dst, &threads)) return NULL;
    PyObject *result = NULL;
    const qtype *t = find_type(type);
    if (t == NULL) goto done;
    if (!PyBuffer_IsContiguous(&src, 'C') || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_SetString(PyExc_ValueError, "quantize: src and dst must be C-contiguous");
        goto done;
    }
    if (src.len % ((Py_ssize_t)t->block_size * 4) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "quantize: src must be float32 values in whole blocks of %d (%zd bytes)",
                     t->block_size, src.len);
        goto done;
    }
    Py_ssize_t n_blocks = src.len / ((Py_ssize_t)t->block_size * 4);
    if (dst.len != n_blocks * t->type_size) {
        PyErr_Format(PyExc_ValueError, "quantize: dst holds %zd bytes, %zd blocks need %zd",
                     dst.len, n_blocks, n_blocks * t->type_size);
        goto done;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n_blocks) threads = n_blocks > 0 ? (int)n_blocks : 1;
    quantize_job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < threads; i++)
        jobs[i] = (quantize_job){t, (const float *)src.buf, (uint8_t *)dst.buf,
                                 n_blocks * i / threads, n_blocks * (i + 1) / threads};
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, quantize_range, &jobs[i]) == 0;
    for (int i = 1; i < threads; i++)
        if (!started[i]) quantize_range(&jobs[i]); /* no thread: run it here */
    quantize_range(&jobs[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(tids[i], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *py_types(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *out = PyTuple_New(N_QTYPES);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < N_QTYPES; i++)
        PyTuple_SET_ITEM(out, i, PyLong_FromLong(QTYPES[i].type));
    return out;
}

static PyMethodDef METHODS[] = {
    {"quantize", py_quantize, METH_VARARGS, "quantize(type, src, dst): float32 to GGML blocks."},
    {"types", py_types, METH_NOARGS, "GGML type ids quantized here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_kquants", "ggml's reference K-quant and IQ4 quantizers (compiled).",
    -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kquants(void) {
    init_iq4_table();
    return PyModule_Create(&MODULE);
}
