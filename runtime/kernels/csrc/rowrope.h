/* RoPE of rows of heads, shared by rowops.c and ggmlcall.c.
 *
 * x [rows / heads positions, heads, hd]; position p rotates with cos[p], sin[p] ([positions,
 * n_rot / 2]): NEOX pairs (x[i], x[i + n_rot/2]), NORM pairs (x[2i], x[2i+1]), (x0 * c - x1 * s,
 * x0 * s + x1 * c), dims past n_rot copied: the same float32 operations, each rounded, as
 * RopeTables.rotate's torch ops (whoever includes it compiles without FMA contraction). y may be
 * x: each pair is read before it is written.
 */
#ifndef GGUFSWAP_ROWROPE_H
#define GGUFSWAP_ROWROPE_H

#include <string.h>

static inline void rowrope(const float *x, long long rows, long long heads, long long hd,
                           long long n_rot, int neox, const float *cos_t, const float *sin_t,
                           float *y) {
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
        if (n_rot < hd && yr != xr)
            memcpy(yr + n_rot, xr + n_rot, (size_t)(hd - n_rot) * sizeof(float));
    }
}

#endif
