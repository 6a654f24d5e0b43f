// Golden dequantization data for ik_llama.cpp's own quant types, made with ik_llama.cpp's ggml.
//
// Built and run by crosscheck/ik/make_golden.py (see there for the source commit and the build);
// never part of the test suite.
//
//   golden OUTDIR [NAME ...]
//
// For each type (all of TYPES and ILV_TYPES below, or only those named), in a forked child (a type
// that cannot quantize aborts the process): make deterministic float data (NROWS x N_PER_ROW, or
// NROWS_ILV x N_PER_ROW for a row-interleaved type; fixed-seed LCG with a roughly normal shape, a
// different scale per row, one outlier and one all-zero 32-block), quantize it with
// ggml_quantize_chunk (no imatrix), dequantize each row with the type's CPU to_float (a
// row-interleaved type: each group of `interleave` rows with one call, as ggml does), and write
// OUTDIR/<name>.bin. One line per type goes to stdout:
//
//   OK <name> <code> <blck_size> <type_size> <row_meta_size> <row_size> <flags> <rel_rmse>
//   FAIL <name> <code> <reason>
//
// File layout (little-endian):
//   0   char[8]  magic "IKGOLD1\0"
//   8   u32      header size (64)
//   12  i32      ggml type code (ik_llama.cpp's numbering)
//   16  char[16] type name (ggml's type_name, NUL padded)
//   32  i32      n_per_row
//   36  i32      nrows
//   40  u64      row_size in bytes (ggml_row_size: blocks plus any per-row header)
//   48  u32      flags: bit 0 = output is row_header_scale * to_float(row bytes after the header)
//                (iq1_bn/iq2_bn, whose CPU to_float ignores the row scale; see BN_SCALED);
//                bits 8..15 = the row interleave (4, 8 or 16 for the _r4/_r8/_r16 types, whose
//                groups of that many rows are stored together: nrows is a multiple of it and
//                group g is the bytes of rows g*interleave .. (g+1)*interleave-1), 0 otherwise
//   52  u32      blck_size
//   56  u32      type_size (bytes per block)
//   60  u32      row_meta_size (bytes of per-row header before the first block)
//   64  u8       quantized rows, nrows * row_size bytes
//   ..  f32      dequantized rows, nrows * n_per_row values

#include "ggml.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define NROWS 3
#define NROWS_ILV 16  // a multiple of every interleave; rows 0..2 are the NROWS rows
#define N_PER_ROW 512
#define HEADER_SIZE 64
#define BN_SCALED 1u

static const enum ggml_type TYPES[] = {
    GGML_TYPE_Q6_0,   GGML_TYPE_IQ1_BN, GGML_TYPE_IQ2_BN, GGML_TYPE_IQ2_K,   GGML_TYPE_IQ3_K,
    GGML_TYPE_IQ4_K,  GGML_TYPE_IQ5_K,  GGML_TYPE_IQ6_K,  GGML_TYPE_IQ4_KS,  GGML_TYPE_IQ2_KS,
    GGML_TYPE_IQ4_KSS, GGML_TYPE_IQ5_KS, GGML_TYPE_IQ2_KT, GGML_TYPE_IQ3_KT, GGML_TYPE_IQ4_KT,
    GGML_TYPE_IQ3_KS, GGML_TYPE_IQ2_KL, GGML_TYPE_IQ1_KT, GGML_TYPE_Q1_0_G128,
};
#define NTYPES (sizeof(TYPES) / sizeof(TYPES[0]))

// Row-interleaved types and their interleave (the rows that ik's repack_* functions store
// together and its dequantize_row_*_r4/_r8/_r16 decode in one call).
static const struct {
    enum ggml_type type;
    int interleave;
} ILV_TYPES[] = {
    {GGML_TYPE_Q4_0_R8, 8},    {GGML_TYPE_Q5_0_R4, 4},    {GGML_TYPE_Q6_0_R4, 4},
    {GGML_TYPE_Q8_0_R8, 8},    {GGML_TYPE_Q2_K_R4, 4},    {GGML_TYPE_Q3_K_R4, 4},
    {GGML_TYPE_Q4_K_R4, 4},    {GGML_TYPE_Q5_K_R4, 4},    {GGML_TYPE_Q6_K_R4, 4},
    {GGML_TYPE_IQ4_NL_R4, 4},  {GGML_TYPE_IQ4_XS_R8, 8},  {GGML_TYPE_IQ2_K_R4, 4},
    {GGML_TYPE_IQ3_K_R4, 4},   {GGML_TYPE_IQ4_K_R4, 4},   {GGML_TYPE_IQ5_K_R4, 4},
    {GGML_TYPE_IQ4_KS_R4, 4},  {GGML_TYPE_IQ5_KS_R4, 4},  {GGML_TYPE_IQ2_XXS_R4, 4},
    {GGML_TYPE_IQ2_XS_R4, 4},  {GGML_TYPE_IQ2_S_R4, 4},   {GGML_TYPE_IQ3_XXS_R4, 4},
    {GGML_TYPE_IQ3_S_R4, 4},   {GGML_TYPE_IQ1_S_R4, 4},   {GGML_TYPE_IQ1_M_R4, 4},
    {GGML_TYPE_IQ2_BN_R4, 4},  {GGML_TYPE_BF16_R16, 16},  {GGML_TYPE_Q8_K_R8, 8},
    {GGML_TYPE_MXFP4_R8, 8},
};
#define NILV (sizeof(ILV_TYPES) / sizeof(ILV_TYPES[0]))

static uint64_t lcg_state;

static float lcg_uniform(void) {
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)(lcg_state >> 40) * (1.0f / 16777216.0f);  // 24 bits: exact in float
}

// Deterministic source data: Irwin-Hall(4) (roughly normal, unit variance), per-row scale. The
// first NROWS rows are the same for any nrows.
static void make_data(float * x, int nrows) {
    static const float row_scale[NROWS_ILV] = {1.0f,  0.03125f, 7.5f,  0.25f, 2.0f,   0.125f,
                                               3.0f,  0.5f,     1.5f,  0.0625f, 4.0f, 0.75f,
                                               1.25f, 6.0f,     0.375f, 2.5f};
    lcg_state = 0x1234abcd5678ef01ULL;
    for (int r = 0; r < nrows; ++r) {
        for (int j = 0; j < N_PER_ROW; ++j) {
            float s = lcg_uniform() + lcg_uniform() + lcg_uniform() + lcg_uniform();
            x[r * N_PER_ROW + j] = (s - 2.0f) * 1.7320508f * row_scale[r];
        }
    }
    x[0 * N_PER_ROW + 17] *= 6.0f;                              // an outlier
    memset(x + 2 * N_PER_ROW + 288, 0, 32 * sizeof(float));      // an all-zero 32-block
}

static int run_type(enum ggml_type type, int interleave, const char * outdir) {
    const ggml_type_traits_t tt = ggml_internal_get_type_traits(type);
    const char * name = ggml_type_name(type);
    if (!tt.to_float) {
        fprintf(stderr, "%s: no to_float\n", name);
        return 2;
    }
    const int nrows = interleave ? NROWS_ILV : NROWS;
    const size_t row_size = ggml_row_size(type, N_PER_ROW);
    float * src = malloc(sizeof(float) * nrows * N_PER_ROW);
    float * out = malloc(sizeof(float) * nrows * N_PER_ROW);
    uint8_t * q = calloc(nrows, row_size);
    make_data(src, nrows);

    size_t written = ggml_quantize_chunk(type, src, q, 0, nrows, N_PER_ROW, NULL, NULL);
    if (written != nrows * row_size) {
        fprintf(stderr, "%s: quantize wrote %zu bytes, expected %zu\n", name, written,
                nrows * row_size);
        return 3;
    }

    uint32_t flags = (uint32_t)interleave << 8;
    for (int r = 0; interleave && r < nrows; r += interleave) {
        tt.to_float(q + r * row_size, out + r * N_PER_ROW, (int64_t)interleave * N_PER_ROW);
    }
    for (int r = 0; !interleave && r < nrows; ++r) {
        const uint8_t * row = q + r * row_size;
        float * y = out + r * N_PER_ROW;
        if (type == GGML_TYPE_IQ1_BN || type == GGML_TYPE_IQ2_BN) {
            // The CPU to_float decodes the blocks only (called on the row start it would read the
            // row header as block data); the CUDA decoder multiplies by the row header's scale:
            // fp16 for iq1_bn, f32 for iq2_bn. Golden output follows the CUDA decoder.
            float d;
            if (type == GGML_TYPE_IQ1_BN) {
                ggml_fp16_t h;
                memcpy(&h, row, sizeof(h));
                d = ggml_fp16_to_fp32(h);
            } else {
                memcpy(&d, row, sizeof(d));
            }
            tt.to_float(row + tt.row_meta_size, y, N_PER_ROW);
            for (int j = 0; j < N_PER_ROW; ++j) y[j] = d * y[j];
            flags |= BN_SCALED;
        } else {
            tt.to_float(row, y, N_PER_ROW);
        }
    }

    double err = 0, ref = 0;
    for (int i = 0; i < nrows * N_PER_ROW; ++i) {
        if (!isfinite(out[i])) {
            fprintf(stderr, "%s: non-finite output at %d\n", name, i);
            return 4;
        }
        err += ((double)out[i] - src[i]) * ((double)out[i] - src[i]);
        ref += (double)src[i] * src[i];
    }

    char path[4096];
    snprintf(path, sizeof(path), "%s/%s.bin", outdir, name);
    FILE * f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 5;
    }
    uint8_t header[HEADER_SIZE] = {0};
    memcpy(header, "IKGOLD1", 8);
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    u32 = HEADER_SIZE;          memcpy(header + 8, &u32, 4);
    i32 = (int32_t)type;        memcpy(header + 12, &i32, 4);
    strncpy((char *)header + 16, name, 15);
    i32 = N_PER_ROW;            memcpy(header + 32, &i32, 4);
    i32 = nrows;                memcpy(header + 36, &i32, 4);
    u64 = row_size;             memcpy(header + 40, &u64, 8);
    u32 = flags;                memcpy(header + 48, &u32, 4);
    u32 = (uint32_t)tt.blck_size;     memcpy(header + 52, &u32, 4);
    u32 = (uint32_t)tt.type_size;     memcpy(header + 56, &u32, 4);
    u32 = (uint32_t)tt.row_meta_size; memcpy(header + 60, &u32, 4);
    int ok = fwrite(header, 1, HEADER_SIZE, f) == HEADER_SIZE &&
             fwrite(q, 1, nrows * row_size, f) == nrows * row_size &&
             fwrite(out, sizeof(float), nrows * N_PER_ROW, f) == (size_t)nrows * N_PER_ROW;
    if (fclose(f) != 0 || !ok) {
        fprintf(stderr, "%s: write failed\n", path);
        return 5;
    }
    printf("OK %s %d %lld %zu %lld %zu %u %.6g\n", name, (int)type, (long long)tt.blck_size,
           tt.type_size, (long long)tt.row_meta_size, row_size, flags, sqrt(err / ref));
    fflush(stdout);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s OUTDIR [TYPE_NAME ...]\n", argv[0]);
        return 1;
    }
    // fills the fp16 tables that to_float needs (without it several types decode to zeros)
    struct ggml_init_params params = {16 * 1024 * 1024, NULL, true};
    struct ggml_context * ctx = ggml_init(params);

    int failures = 0;
    for (size_t i = 0; i < NTYPES + NILV; ++i) {
        const enum ggml_type type = i < NTYPES ? TYPES[i] : ILV_TYPES[i - NTYPES].type;
        const int interleave = i < NTYPES ? 0 : ILV_TYPES[i - NTYPES].interleave;
        const char * name = ggml_type_name(type);
        if (argc > 2) {
            int wanted = 0;
            for (int a = 2; a < argc; ++a) wanted |= strcmp(argv[a], name) == 0;
            if (!wanted) continue;
        }
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) _exit(run_type(type, interleave, argv[1]));
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFSIGNALED(status)) {
            printf("FAIL %s %d signal_%d\n", name, (int)type, WTERMSIG(status));
            ++failures;
        } else if (WEXITSTATUS(status) != 0) {
            printf("FAIL %s %d exit_%d\n", name, (int)type, WEXITSTATUS(status));
            ++failures;
        }
        fflush(stdout);
    }
    ggml_free(ctx);
    return failures ? 2 : 0;
}
