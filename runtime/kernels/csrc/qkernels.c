/* Quantized matrix products straight from GGUF blocks (CPU), for native storage.
 *
 * y[n, r] = sum_k W[r, k] * x[n, k], where row r of W is a run of GGUF blocks. Each block is
 * decoded into a small float buffer that stays in L1 (exactly the values gguf.quants.dequantize
 * gives: the same float32 operations in the same order, no FMA contraction), then multiplied
 * with every activation row: the float32 weights never exist in memory, so a product costs
 * reading the quantized bytes once. The sum over k runs in 8 independent lanes (vectorised by the
 * compiler without reassociation), added up in a fixed order at the end: for given inputs the
 * result is always the same bits on one machine and build.
 *
 * Rows are split over `threads` POSIX threads; the GIL is released for the whole product (and
 * for a decode, whose blocks the threads take piece by piece).
 *
 * Python interface (pointers are the integer data_ptr() of contiguous tensors, checked by the
 * caller, runtime/kernels/qmatmul.py):
 *   matmul(w, type, rows, cols, x, n, y, threads) -> None
 *   decode(w, type, n_values, out, threads=1, cols=0, piece=0)
 *                                                (blocks to float32: dequantization on the CPU;
 *                                                 cols, the row length, is required by types
 *                                                 with a per-row header; piece: blocks a thread
 *                                                 takes at a time, 0 = about 2 MiB of output)
 *   block_size(type) -> int                      (values per kernel block: plain types use 64)
 *   types() -> tuple[int, ...]                   (GGML type ids handled here)
 *
 * ik_llama.cpp's IQ4_K, IQ5_K, IQ4_KS, IQ4_KSS, IQ2_KS and IQ3_KS: values are ik's CPU
 * dequantize_row_* (the golden files in tests/fixtures/ik_golden, compared bit for bit). The _KS
 * types have a per-row header (row_meta bytes: the row scale, float32 in 4 bytes, fp16 in 2) before
 * the row's blocks; their decoders take the row scale as an argument.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
    T_IQ4_XS = 23, T_BF16 = 30, T_IQ4_K = 139, T_IQ5_K = 140, T_IQ4_KS = 144, T_IQ2_KS = 145,
    T_IQ4_KSS = 146, T_IQ3_KS = 156,
};

#define LANES 8

/* x86-64: an AVX2 build of the hot loops beside the baseline one, chosen at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
#define MAX_BLOCK 256

static float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while ((man & 0x400) == 0) {
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
    memcpy(&f, &bits, 4);
    return f;
}

/* Every half-precision value as float32: exact, and a load instead of a branchy conversion. */
static float F16_TABLE[1 << 16];

static void init_f16_table(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) F16_TABLE[h] = fp16_to_f32((uint16_t)h);
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float f32_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* A block's fp16 scale as float32, computed (Maratyszcza's FP16 conversion: the exponent rebased
 * by one exact multiplication, subnormals by one exact subtraction). The same value as
 * fp16_to_f32 for every non-NaN input (checked over all 65536); a signalling NaN comes out quiet,
 * as it does from the products it scales anyway. A F16_TABLE lookup per block missed the cache
 * on tensors with many distinct scales. */
static inline float rdh(const uint8_t *p) {
    uint32_t w = (uint32_t)rd16(p) << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = f32_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float subnormal = f32_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_bits(sign | (two_w < (1u << 27) ? bits_f32(subnormal) : bits_f32(normal)));
}

static inline __attribute__((always_inline)) void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K/Q5_K: the scales and mins of sub-blocks `is` and `is + 1`, as gguf.quants computes them. */
static inline __attribute__((always_inline)) void k_scale_pair(float d, float dmin,
                                                               const uint8_t *scales, int is,
                                                               float *d1, float *m1, float *d2,
                                                               float *m2) {
    uint8_t sc, m;
    scale_min_k4(is, scales, &sc, &m);
    *d1 = d * sc;
    *m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    *d2 = d * sc;
    *m2 = dmin * m;
}

/* Decoders: one block -> y[block_size] float32, as gguf.quants.dequantize. Loops are written
 * so that GCC vectorises them in the AVX2 clone (checked with objdump: ymm conversions and
 * products in decode_pieces.avx2); Q5_0/Q5_1 take each fifth bit with a per-lane shift of the
 * 32-bit mask rather than through an int32 staging array (2x faster into a reused buffer). */

/* The 32 4-bit codes of a 32-value block: low nibbles are values 0-15, high nibbles 16-31. */
static inline __attribute__((always_inline)) void nibbles(const uint8_t *qs, int32_t *q) {
    for (int j = 0; j < 16; j++) q[j] = qs[j] & 0xF;
    for (int j = 0; j < 16; j++) q[j + 16] = qs[j] >> 4;
}

/* Plain types are decoded as "blocks" of PLAIN values (a multiple of LANES). */
#define PLAIN 64

static inline __attribute__((always_inline)) void dec_f32(const uint8_t *b, float *y) { memcpy(y, b, 4 * PLAIN); }
static inline __attribute__((always_inline)) void dec_f16(const uint8_t *b, float *y) {
    uint16_t h[PLAIN];
    memcpy(h, b, sizeof h);
    for (int i = 0; i < PLAIN; i++) y[i] = F16_TABLE[h[i]];
}
static inline __attribute__((always_inline)) void dec_bf16(const uint8_t *b, float *y) {
    uint16_t h[PLAIN];
    uint32_t bits[PLAIN];
    memcpy(h, b, sizeof h);
    for (int i = 0; i < PLAIN; i++) bits[i] = (uint32_t)h[i] << 16;
    memcpy(y, bits, sizeof bits);
}

static inline __attribute__((always_inline)) void dec_q4_0(const uint8_t *b, float *y) {
    float d = rdh(b);
    int32_t q[32];
    nibbles(b + 2, q);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(q[j] - 8);
}

static inline __attribute__((always_inline)) void dec_q4_1(const uint8_t *b, float *y) {
    float d = rdh(b), m = rdh(b + 2);
    int32_t q[32];
    nibbles(b + 4, q);
    for (int j = 0; j < 32; j++) y[j] = d * (float)q[j] + m;
}

static inline __attribute__((always_inline)) void dec_q5_0(const uint8_t *b, float *y) {
    float d = rdh(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) { /* value j: low nibble, bit j; value j + 16: high, bit j + 16 */
        int lo = (qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}

static inline __attribute__((always_inline)) void dec_q5_1(const uint8_t *b, float *y) {
    float d = rdh(b), m = rdh(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) { /* as Q5_0 */
        int lo = (qs[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}

static inline __attribute__((always_inline)) void dec_q8_0(const uint8_t *b, float *y) {
    float d = rdh(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * (float)qs[j];
}

static inline __attribute__((always_inline)) void dec_q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *qs = b + 16;
    float d = rdh(b + 80), dmin = rdh(b + 82);
    for (int k = 0; k < 16; k++) { /* value 16 k + i: half k / 8, shift (k / 2) % 4 */
        float dl = d * (float)(scales[k] & 0xF), ml = dmin * (float)(scales[k] >> 4);
        const uint8_t *q = qs + (k / 8) * 32 + (k % 2) * 16;
        int shift = 2 * ((k / 2) % 4);
        for (int i = 0; i < 16; i++) y[16 * k + i] = dl * (float)((q[i] >> shift) & 3) - ml;
    }
}

static inline __attribute__((always_inline)) void dec_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    float d = rdh(b + 108);
    for (int k = 0; k < 16; k++) {
        int low = (sc[k % 8] >> (4 * (k / 8))) & 0xF, high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        float dl = d * (float)((int8_t)(low | (high << 4)) - 32);
        int half = k / 8, shift = 2 * ((k / 2) % 4), bit = k / 2; /* hmask bit: half 4 + shift/2 */
        const uint8_t *q = qs + half * 32 + (k % 2) * 16, *h = hmask + (k % 2) * 16;
        for (int i = 0; i < 16; i++) {
            int v = (int)((q[i] >> shift) & 3) - (((h[i] >> bit) & 1) ? 0 : 4);
            y[16 * k + i] = dl * (float)v;
        }
    }
}

static const int8_t IQ4_KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                       1,    13,   25,  38,  53,  69,  89,  113};

static inline __attribute__((always_inline)) void dec_iq4_nl(const uint8_t *b, float *y) {
    float d = rdh(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = d * (float)IQ4_KVALUES[qs[j] & 0xF];
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)IQ4_KVALUES[qs[j] >> 4];
}

static inline __attribute__((always_inline)) void dec_iq4_xs(const uint8_t *b, float *y) {
    float d = rdh(b);
    uint16_t scales_h = rd16(b + 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF, high = (scales_h >> (2 * ib)) & 3;
        float dl = d * (float)((int8_t)(low | (high << 4)) - 32);
        const uint8_t *q = qs + 16 * ib;
        for (int j = 0; j < 16; j++) y[32 * ib + j] = dl * (float)IQ4_KVALUES[q[j] & 0xF];
        for (int j = 0; j < 16; j++) y[32 * ib + 16 + j] = dl * (float)IQ4_KVALUES[q[j] >> 4];
    }
}

/* ik's IQ4_KS: scales[8] (bit 0: the shifted grid, bits 1-7: scale + 127), qs[128]; the row
 * scale d comes from the row header. dl = d * s is rounded first, as ik does. */
static const int8_t IQ4_KVALUES_SHIFTED[16] = {-123, -100, -79, -61, -45, -31, -18, -6,
                                               5,    17,   29,  42,  57,  73,  93,  117};

static inline __attribute__((always_inline)) void dec_iq4_ks(const uint8_t *b, float *y,
                                                             float d) {
    const uint8_t *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        float dl = d * (float)((b[ib] & 254) - 127);
        const int8_t *values = (b[ib] & 1) ? IQ4_KVALUES_SHIFTED : IQ4_KVALUES;
        float scaled[16]; /* the same products, taken once per sub-block */
        for (int v = 0; v < 16; v++) scaled[v] = dl * (float)values[v];
        const uint8_t *q = qs + 16 * ib;
        for (int j = 0; j < 16; j++) y[32 * ib + j] = scaled[q[j] & 0xF];
        for (int j = 0; j < 16; j++) y[32 * ib + 16 + j] = scaled[q[j] >> 4];
    }
}

/* 16 values of a sub-block: dl times the grid value of each nibble (the products taken once). */
static inline __attribute__((always_inline)) void nibble_run(float dl, const int8_t *values,
                                                             const uint8_t *q, int hi, float *y) {
    float scaled[16];
    for (int v = 0; v < 16; v++) scaled[v] = dl * (float)values[v];
    for (int j = 0; j < 16; j++) y[j] = scaled[hi ? q[j] >> 4 : q[j] & 0xF];
}

/* ik's IQ4_KSS: per sub-block of 32, 8 uint16: bit 0 of each is one bit of the scale byte (as
 * IQ4_KS's), the rest x ^ (x >> 1) (bit 0 cleared) are four nibbles. */
static inline __attribute__((always_inline)) void dec_iq4_kss(const uint8_t *b, float *y,
                                                              float d) {
    for (int ib = 0; ib < 8; ib++) {
        uint8_t q[16];
        int ls = 0;
        for (int k = 0; k < 8; k++) {
            uint16_t w = rd16(b + 16 * ib + 2 * k);
            ls |= (w & 1) << k;
            uint16_t aux = w & 0xFFFE;
            aux ^= aux >> 1;
            q[2 * k] = (uint8_t)(aux & 0xFF);
            q[2 * k + 1] = (uint8_t)(aux >> 8);
        }
        float dl = d * (float)((ls & 254) - 127);
        const int8_t *values = (ls & 1) ? IQ4_KVALUES_SHIFTED : IQ4_KVALUES;
        nibble_run(dl, values, q, 0, y + 32 * ib);
        nibble_run(dl, values, q, 1, y + 32 * ib + 16);
    }
}

/* IQ4_K/IQ5_K 6-bit scale of sub-block s (of 16): nibble s % 2 of scales_l[s / 2], bits
 * 2 * (s % 4) of scales_h[s / 4] above it, minus 32. */
static inline __attribute__((always_inline)) int k_scale6(const uint8_t *b, int s) {
    int low = (b[8 + s / 2] >> (4 * (s % 2))) & 0xF, high = (b[4 + s / 4] >> (2 * (s % 4))) & 3;
    return (low | (high << 4)) - 32;
}

/* ik's IQ4_K: d, extra (u16: shifted grid per sub-block of 16), scales_h[4], scales_l[8],
 * qs[128]; sub-block s = 2 * ib + h: nibble h of qs[16 * ib + j]. */
static inline __attribute__((always_inline)) void dec_iq4_k(const uint8_t *b, float *y) {
    float d = rdh(b);
    uint16_t extra = rd16(b + 2);
    for (int s = 0; s < 16; s++) {
        float dl = d * (float)k_scale6(b, s);
        const int8_t *values = (extra >> s) & 1 ? IQ4_KVALUES_SHIFTED : IQ4_KVALUES;
        nibble_run(dl, values, b + 16 + 16 * (s / 2), s % 2, y + 16 * s);
    }
}

static const int8_t IQ5_KVALUES[64] = {
    -126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
    -1,   5,    11,   17,  23,  29,  36,  43,  51,  59,  68,  77,  87,  97,  109, 121,
    -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
    1,    7,    13,   19,  25,  31,  38,  45,  53,  61,  70,  79,  89,  99,  111, 123};

/* ik's IQ5_K: as IQ4_K, then qh[32] at 144; sub-block t = 4 * ib64 + 2 * nib + half: nibble nib
 * of qs[32 * ib64 + 16 * half + j], 5th bit: bit 2 * ib64 + nib of qh[16 * half + j]. */
static inline __attribute__((always_inline)) void dec_iq5_k(const uint8_t *b, float *y) {
    float d = rdh(b);
    uint16_t extra = rd16(b + 2);
    for (int t = 0; t < 16; t++) {
        int ib64 = t / 4, nib = (t / 2) % 2, half = t % 2;
        float dl = d * (float)k_scale6(b, t);
        const int8_t *values = IQ5_KVALUES + 32 * ((extra >> t) & 1);
        float scaled[32];
        for (int v = 0; v < 32; v++) scaled[v] = dl * (float)values[v];
        const uint8_t *qs = b + 16 + 32 * ib64 + 16 * half, *qh = b + 144 + 16 * half;
        for (int j = 0; j < 16; j++) {
            int q = ((qs[j] >> (4 * nib)) & 0xF) | (((qh[j] >> (2 * ib64 + nib)) & 1) << 4);
            y[16 * t + j] = scaled[q];
        }
    }
}

/* ik's IQ2_KS: extra (u16), scales[4], qs[64]; sub-block s of 32: scale nibble s % 2 of
 * scales[s / 2] with bit 8 + s of extra as its 5th bit, minus 16; 2-bit field s % 4 of
 * qs[32 * (s / 4) + j]; bit s of extra picks the shifted grid. */
static const int8_t IQ2_KVALUES[8] = {-31, -13, 1, 17, -26, -8, 6, 22};

static inline __attribute__((always_inline)) void dec_iq2_ks(const uint8_t *b, float *y,
                                                             float d) {
    uint16_t extra = rd16(b);
    for (int s = 0; s < 8; s++) {
        int sc = ((b[2 + s / 2] >> (4 * (s % 2))) & 0xF) | (((extra >> (8 + s)) & 1) << 4);
        float dl = d * (float)(sc - 16);
        const int8_t *values = IQ2_KVALUES + 4 * ((extra >> s) & 1);
        float scaled[4];
        for (int v = 0; v < 4; v++) scaled[v] = dl * (float)values[v];
        const uint8_t *qs = b + 6 + 32 * (s / 4);
        for (int j = 0; j < 32; j++) y[32 * s + j] = scaled[(qs[j] >> (2 * (s % 4))) & 3];
    }
}

/* ik's IQ3_KS: extra (u16), scales[4], qs[64], qh[32]; sub-block s of 32: scale nibble s / 4 of
 * scales[s % 4] with bit s of extra as its 5th bit, minus 16; bit 8 + s of extra picks the
 * shifted grid; 2-bit field s % 4 of qs[32 * (s / 4) + j], 3rd bit: bit s of qh[j]. */
static const int8_t IQ3_KVALUES[16] = {-63, -40, -23, -10, 1,  13, 28, 47,
                                       -59, -36, -19, -6,  5,  17, 32, 51};

static inline __attribute__((always_inline)) void dec_iq3_ks(const uint8_t *b, float *y,
                                                             float d) {
    uint16_t extra = rd16(b);
    for (int s = 0; s < 8; s++) {
        int sc = ((b[2 + s % 4] >> (4 * (s / 4))) & 0xF) | (((extra >> s) & 1) << 4);
        float dl = d * (float)(sc - 16);
        const int8_t *values = IQ3_KVALUES + 8 * ((extra >> (8 + s)) & 1);
        float scaled[8];
        for (int v = 0; v < 8; v++) scaled[v] = dl * (float)values[v];
        const uint8_t *qs = b + 6 + 32 * (s / 4), *qh = b + 70;
        for (int j = 0; j < 32; j++)
            y[32 * s + j] = scaled[((qs[j] >> (2 * (s % 4))) & 3) | (((qh[j] >> s) & 1) << 2)];
    }
}

static inline __attribute__((always_inline)) void dec_q4_k(const uint8_t *b, float *y) {
    float d = rdh(b), dmin = rdh(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
        float d1, m1, d2, m2;
        k_scale_pair(d, dmin, scales, is, &d1, &m1, &d2, &m2);
        for (int l = 0; l < 32; l++) y[j + l] = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (float)(q[l] >> 4) - m2;
        q += 32;
    }
}

static inline __attribute__((always_inline)) void dec_q5_k(const uint8_t *b, float *y) {
    float d = rdh(b), dmin = rdh(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
        float d1, m1, d2, m2;
        k_scale_pair(d, dmin, scales, is, &d1, &m1, &d2, &m2);
        for (int l = 0; l < 32; l++)
            y[j + l] = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            y[j + 32 + l] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        u1 <<= 2;
        u2 <<= 2;
    }
}

static inline __attribute__((always_inline)) void dec_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = rdh(b + 208);
    for (int n = 0; n < 256; n += 128) {
        float ds[8];
        for (int k = 0; k < 8; k++) ds[k] = d * (float)sc[k];
        for (int half = 0; half < 2; half++) { /* values l in [16 half, 16 half + 16): one scale */
            int o = 16 * half;
            for (int l = o; l < o + 16; l++) {
                y[n + l] = ds[half] * (float)((int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                y[n + l + 32] =
                    ds[half + 2] * (float)((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[n + l + 64] = ds[half + 4] * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[n + l + 96] =
                    ds[half + 6] * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

typedef struct {
    int type;
    int block_size; /* values per kernel block */
    int type_size;  /* bytes per kernel block */
    int row_meta;   /* bytes of per-row header (a float32 row scale) before the row's blocks */
} qtype;

static const qtype QTYPES[] = {
    {T_F32, PLAIN, 4 * PLAIN}, {T_F16, PLAIN, 2 * PLAIN}, {T_BF16, PLAIN, 2 * PLAIN},
    {T_Q4_0, 32, 18},          {T_Q4_1, 32, 20},          {T_Q5_0, 32, 22},
    {T_Q5_1, 32, 24},          {T_Q8_0, 32, 34},          {T_Q4_K, 256, 144},
    {T_Q5_K, 256, 176},        {T_Q6_K, 256, 210},        {T_Q2_K, 256, 84},
    {T_Q3_K, 256, 110},        {T_IQ4_NL, 32, 18},        {T_IQ4_XS, 256, 136},
    {T_IQ4_KS, 256, 136, 4},   {T_IQ4_KSS, 256, 128, 4},  {T_IQ4_K, 256, 144, 0},
    {T_IQ5_K, 256, 176, 0},    {T_IQ2_KS, 256, 70, 2},    {T_IQ3_KS, 256, 102, 2},
};
#define N_QTYPES (sizeof(QTYPES) / sizeof(QTYPES[0]))

static const qtype *find_type(int type) {
    for (size_t i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    return NULL;
}

/* Decode `count` consecutive blocks. The switch names each decoder directly, so that they are
 * inlined into (and vectorised with) each target clone of the caller. */
static inline __attribute__((always_inline)) void decode_step(int type, const uint8_t *src,
                                                              long count, float *dst,
                                                              float row_d) {
#define STEP(fn, bs, ts)                                                                       \
    for (long k = 0; k < count; k++) fn(src + (size_t)k * (ts), dst + k * (bs));              \
    return;
#define STEP_D(fn, bs, ts)                                                                     \
    for (long k = 0; k < count; k++) fn(src + (size_t)k * (ts), dst + k * (bs), row_d);       \
    return;
    switch (type) {
    case T_F32: STEP(dec_f32, PLAIN, 4 * PLAIN)
    case T_F16: STEP(dec_f16, PLAIN, 2 * PLAIN)
    case T_BF16: STEP(dec_bf16, PLAIN, 2 * PLAIN)
    case T_Q4_0: STEP(dec_q4_0, 32, 18)
    case T_Q4_1: STEP(dec_q4_1, 32, 20)
    case T_Q5_0: STEP(dec_q5_0, 32, 22)
    case T_Q5_1: STEP(dec_q5_1, 32, 24)
    case T_Q8_0: STEP(dec_q8_0, 32, 34)
    case T_Q2_K: STEP(dec_q2_k, 256, 84)
    case T_Q3_K: STEP(dec_q3_k, 256, 110)
    case T_IQ4_NL: STEP(dec_iq4_nl, 32, 18)
    case T_IQ4_XS: STEP(dec_iq4_xs, 256, 136)
    case T_Q4_K: STEP(dec_q4_k, 256, 144)
    case T_Q5_K: STEP(dec_q5_k, 256, 176)
    case T_Q6_K: STEP(dec_q6_k, 256, 210)
    case T_IQ4_KS: STEP_D(dec_iq4_ks, 256, 136)
    case T_IQ4_KSS: STEP_D(dec_iq4_kss, 256, 128)
    case T_IQ2_KS: STEP_D(dec_iq2_ks, 256, 70)
    case T_IQ3_KS: STEP_D(dec_iq3_ks, 256, 102)
    case T_IQ4_K: STEP(dec_iq4_k, 256, 144)
    case T_IQ5_K: STEP(dec_iq5_k, 256, 176)
    default: return;
    }
#undef STEP
#undef STEP_D
}

/* -- the product ------------------------------------------------------------------------- */

typedef struct {
    const qtype *t;
    const uint8_t *w;
    const float *x;
    float *y;
    long rows, cols, n, r0, r1;
} job;

/* Blocks decoded per step: MAX_BLOCK values, so that the dot loop runs long. */
static int step_blocks(const qtype *t) { return MAX_BLOCK / t->block_size; }

/* The row scale in a row's header: float32 (4 bytes) or fp16 (2); 0 for types without one. */
static float row_scale(const qtype *t, const uint8_t *row) {
    float d = 0.0f;
    if (t->row_meta == 2) d = rdh(row);
    else if (t->row_meta) memcpy(&d, row, sizeof(d));
    return d;
}

/* a[l] += sum over i = l (mod LANES) of w[i] * x[i], for len a multiple of LANES. */
static inline void dot_lanes(const float *restrict w, const float *restrict x, long len,
                             float *restrict acc) {
    float a[LANES];
    for (int l = 0; l < LANES; l++) a[l] = acc[l];
    for (long i = 0; i < len; i += LANES)
        for (int l = 0; l < LANES; l++) a[l] += w[i + l] * x[i + l];
    for (int l = 0; l < LANES; l++) acc[l] = a[l];
}

CLONES static void *run_rows(void *arg) {
    const job *j = (const job *)arg;
    const qtype *t = j->t;
    long nb = j->cols / t->block_size;
    int per = step_blocks(t);
    float wb[MAX_BLOCK];
    float *acc = (float *)malloc(sizeof(float) * LANES * (size_t)j->n);
    if (acc == NULL) return (void *)1;
    size_t row_bytes = (size_t)t->row_meta + (size_t)nb * t->type_size;
    for (long r = j->r0; r < j->r1; r++) {
        const uint8_t *row = j->w + (size_t)r * row_bytes;
        float row_d = row_scale(t, row);
        row += t->row_meta;
        memset(acc, 0, sizeof(float) * LANES * (size_t)j->n);
        for (long b = 0; b < nb; b += per) {
            long take = nb - b < per ? nb - b : per;
            decode_step(t->type, row + (size_t)b * t->type_size, take, wb, row_d);
            long len = take * t->block_size;
            const float *xk = j->x + b * t->block_size;
            for (long n = 0; n < j->n; n++) /* every block size is a multiple of LANES */
                dot_lanes(wb, xk + n * j->cols, len, acc + n * LANES);
        }
        for (long n = 0; n < j->n; n++) {
            const float *an = acc + n * LANES;
            float s = ((an[0] + an[1]) + (an[2] + an[3])) + ((an[4] + an[5]) + (an[6] + an[7]));
            j->y[n * j->rows + r] = s;
        }
    }
    free(acc);
    return NULL;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, x, y;
    int type, threads;
    long rows, cols, n;
    if (!PyArg_ParseTuple(args, "KillKlKi", &w, &type, &rows, &cols, &x, &n, &y, &threads))
        return NULL;
    const qtype *t = find_type(type);
    if (t == NULL) return PyErr_Format(PyExc_ValueError, "no kernel for GGML type %d", type);
    if (rows < 1 || cols < 1 || n < 1 || cols % t->block_size != 0 || t->block_size % LANES)
        return PyErr_Format(PyExc_ValueError, "bad shape rows=%ld cols=%ld n=%ld", rows, cols, n);
    if (threads < 1) threads = 1;
    if (threads > rows) threads = (int)rows;
    if (threads > 64) threads = 64;
    job jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job){t, (const uint8_t *)(uintptr_t)w, (const float *)(uintptr_t)x,
                        (float *)(uintptr_t)y, rows, cols, n,
                        rows * i / threads, rows * (i + 1) / threads};
    }
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, run_rows, &jobs[i]) == 0;
    for (int i = 1; i < threads; i++)
        if (!started[i]) failed |= run_rows(&jobs[i]) != NULL; /* no thread: run it here */
    failed |= run_rows(&jobs[0]) != NULL;
    for (int i = 1; i < threads; i++) {
        void *ret = NULL;
        if (started[i]) {
            pthread_join(tids[i], &ret);
            failed |= ret != NULL;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Decoding hands out the blocks in pieces of about DECODE_PIECE bytes of float32 output (one
 * transparent huge page): each thread takes the next piece when it is done with one. A fresh
 * result's pages are faulted in (zeroed by the kernel) by whichever thread writes them first, so
 * both the zeroing and the decoding are shared out piece by piece, and a thread that the
 * scheduler parks (other processes on a shared host) holds up one piece, not half the tensor. */
#define DECODE_PIECE (2L << 20)

typedef struct {
    const qtype *t;
    const uint8_t *src;
    float *dst;
    long n_blocks, piece; /* blocks in all, blocks per piece */
    long row_blocks;      /* blocks per row (types with a row header; 0 otherwise) */
    _Atomic long next;    /* the first block not yet taken */
} decode_job;

/* Blocks [b0, b1) of the job. */
static inline __attribute__((always_inline)) void decode_blocks(const decode_job *j, long b0,
                                                                long b1) {
    const qtype *t = j->t;
    if (j->row_blocks == 0) { /* one call: the type's switch is taken once per piece */
        decode_step(t->type, j->src + (size_t)b0 * t->type_size, b1 - b0,
                    j->dst + (size_t)b0 * t->block_size, 0.0f);
        return;
    }
    size_t row_bytes = (size_t)t->row_meta + (size_t)j->row_blocks * t->type_size;
    for (long b = b0; b < b1;) { /* the run of blocks up to the end of b's row */
        long in_row = b % j->row_blocks, take = j->row_blocks - in_row;
        if (take > b1 - b) take = b1 - b;
        const uint8_t *row = j->src + (size_t)(b / j->row_blocks) * row_bytes;
        const uint8_t *block = row + t->row_meta + (size_t)in_row * t->type_size;
        decode_step(t->type, block, take, j->dst + (size_t)b * t->block_size, row_scale(t, row));
        b += take;
    }
}

CLONES static void *decode_pieces(void *arg) {
    decode_job *j = (decode_job *)arg;
    for (;;) {
        long b0 = atomic_fetch_add_explicit(&j->next, j->piece, memory_order_relaxed);
        if (b0 >= j->n_blocks) return NULL;
        long b1 = j->n_blocks - b0 < j->piece ? j->n_blocks : b0 + j->piece;
        decode_blocks(j, b0, b1);
    }
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, out;
    int type, threads = 1;
    long n_values, cols = 0, piece = 0;
    if (!PyArg_ParseTuple(args, "KilK|ill", &w, &type, &n_values, &out, &threads, &cols, &piece))
        return NULL;
    const qtype *t = find_type(type);
    if (t == NULL) return PyErr_Format(PyExc_ValueError, "no kernel for GGML type %d", type);
    if (n_values < 0 || n_values % t->block_size != 0)
        return PyErr_Format(PyExc_ValueError, "%ld values are not whole blocks of %d", n_values,
                            t->block_size);
    if (t->row_meta && (cols <= 0 || cols % t->block_size != 0 || n_values % cols != 0))
        return PyErr_Format(PyExc_ValueError, "GGML type %d needs whole rows (cols=%ld)", type,
                            cols);
    long n_blocks = n_values / t->block_size;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (piece <= 0) { /* a huge page of output, fewer blocks when there are not enough to share */
        piece = DECODE_PIECE / ((long)sizeof(float) * t->block_size);
        long even = (n_blocks + threads - 1) / threads;
        if (even < piece) piece = even > 0 ? even : 1;
    }
    long pieces = (n_blocks + piece - 1) / piece;
    if (threads > pieces) threads = pieces > 0 ? (int)pieces : 1;
    decode_job job = {t, (const uint8_t *)(uintptr_t)w, (float *)(uintptr_t)out, n_blocks, piece,
                      t->row_meta ? cols / t->block_size : 0, 0};
    pthread_t tids[64];
    int started[64] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, decode_pieces, &job) == 0;
    decode_pieces(&job); /* a thread that did not start leaves its pieces to the others */
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(tids[i], NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_block_size(PyObject *self, PyObject *args) {
    (void)self;
    int type;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    const qtype *t = find_type(type);
    if (t == NULL) return PyErr_Format(PyExc_ValueError, "no kernel for GGML type %d", type);
    return PyLong_FromLong(t->block_size);
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
    {"matmul", py_matmul, METH_VARARGS, "y[n, rows] = x[n, cols] @ W.T from GGUF blocks."},
    {"decode", py_decode, METH_VARARGS, "Decode n_blocks GGUF blocks to float32."},
    {"types", py_types, METH_NOARGS, "GGML type ids with a kernel here."},
    {"block_size", py_block_size, METH_VARARGS, "Values per kernel block of a GGML type."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_qkernels", "Quantized products from GGUF blocks (CPU).", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__qkernels(void) {
    init_f16_table();
    return PyModule_Create(&MODULE);
}
