/* A hand-written integer Q8_0 matrix-vector product (AVX2 + FMA), for bench/kernels.py only.
 *
 * The measurement behind the kernel choice: what the project would get by writing its own
 * integer kernels instead of calling ggml's. The activations are quantized to 8 bits per block
 * of 32 (d = amax / 127, q = round(x / d)); each weight block's int8 codes meet them in 32-bit
 * integer dot products (maddubs/madd), scaled by d_w * d_x and summed in float with FMA. Not
 * shipped: it is built by the benchmark where a C compiler is at hand.
 *
 *   void q8_0_matvec(const uint8_t *w, long rows, long cols, const float *x, float *y)
 *     w: rows of cols/32 blocks of 34 bytes (fp16 d, 32 int8), x: cols floats, y: rows floats
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

typedef struct {
    float d;
    int8_t q[QK];
} xblock;

static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static void quantize(const float *x, long cols, xblock *out) {
    for (long b = 0; b < cols / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
        out[b].d = d;
        for (int i = 0; i < QK; i++) out[b].q[i] = (int8_t)lrintf(v[i] * id);
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void q8_0_matvec(const uint8_t *w, long rows, long cols, const float *x, float *y) {
    long nb = cols / QK;
    xblock *xq = aligned_alloc(64, ((sizeof(xblock) * nb + 63) / 64) * 64);
    quantize(x, cols, xq);
    const __m256i ones = _mm256_set1_epi16(1);
    for (long r = 0; r < rows; r++) {
        const uint8_t *row = w + r * nb * 34;
        __m256 acc = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            uint16_t dh;
            memcpy(&dh, row + b * 34, 2);
            __m256i wq = _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2));
            __m256i aq = _mm256_loadu_si256((const __m256i *)xq[b].q);
            __m256i sum16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
            __m256 q = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(dh) * xq[b].d), q, acc);
        }
        y[r] = hsum(acc);
    }
    free(xq);
}
