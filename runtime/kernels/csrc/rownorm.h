/* ggml's RMS norm times a weight over float32 rows, shared by rowops.c and ggmlcall.c.
 *
 * ggml_compute_forward_rms_norm_f32 followed by ggml_mul by w (llama.cpp's build_norm): per row
 * the float32 squares summed in double in order, mean = (float)(sum / n), scale = 1.0f /
 * sqrtf(mean + eps), y = (x * scale) * w, each product rounded to float32. Whoever includes it
 * compiles without FMA contraction (-ffp-contract=off), so the bits are ggml's.
 */
#ifndef GGUFSWAP_ROWNORM_H
#define GGUFSWAP_ROWNORM_H

#include <math.h>

static inline void rownorm(const float *x, long long rows, long long n, const float *w, float eps,
                           float *y) {
    for (long long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double sum = 0.0;
        for (long long i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (long long i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

#endif
