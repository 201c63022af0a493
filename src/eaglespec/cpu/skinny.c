/* y = x @ w.T (+ bias) for few rows of x (a decode step or a draft tree): AVX-512 or AVX2, OpenMP.
 * x and y are fp32; w is fp32 (skinny_linear), 4-bit with a scale and a minimum per 32 inputs
 * (skinny_linear_q4, dequantized in registers), or bf16 (skinny_linear_bf16: widened to fp32 in
 * registers, exactly, by a 16-bit shift; the sums are then those of fp32 weights). With AVX512-BF16,
 * skinny_linear_bf16dot takes x rounded to bf16 too and sums products of pairs (VDPBF16PS): half
 * the multiply-add instructions, for trees whose verify the arithmetic, not memory, limits; and
 * skinny_linear_q4dot does the same over 4-bit weights (int4's bytes, bf16-dot's arithmetic).
 *
 * Decoding a small model streams every weight once per forward. BLAS kernels are tuned for big
 * matrices: on a 2-core Xeon, torch's default path costs 1.6x a one-token step at 4 rows and 2x
 * at 8. Here each block of 32 output columns is streamed from memory once, with software
 * prefetch, and reused from registers for several rows at a time (12 with AVX-512's 32 registers,
 * 3 with AVX2's 16; later passes over a block read it from L2), so the weights' bytes, not the
 * arithmetic, set the time until ~16 rows.
 *
 * Weight layout (see kernels.pack_weight): wp[n / 32][k][32], i.e. each block of 32 rows of w
 * transposed, so one k step of a block is NV contiguous vectors. The same layout serves both
 * instruction sets, which are chosen at build time (-mavx512f or -mavx2).
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NR 32   /* output columns per block */
#define PFD 64  /* prefetch distance in k steps (64 * 128 bytes ahead) */

#ifdef __AVX512F__
typedef __m512 vec;
#define VW 16   /* floats per vector */
#define MR 12   /* rows of x per pass over a block: 24 accumulators of the 32 registers */
#define MRQ 12
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
/* 16 codes (bytes) -> 16 floats */
#define CODES(b) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
/* 16 bf16 -> 16 floats (a bf16 is the top half of a float) */
#define BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
typedef __m256 vec;
#define VW 8
#define MR 3    /* 12 accumulators + 4 weight vectors of the 16 registers */
#define MRQ 2   /* the 4-bit kernel also holds 8 scale and minimum vectors */
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
/* the low 8 codes (bytes) -> 8 floats */
#define CODES(b) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
#define BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#define NV (NR / VW) /* vectors per k step of a block */

static inline void store(int mr, vec acc[][NV], float *y, long ldy, const float *bias) {
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++)
            vstore(y + i * ldy + v * VW, bias ? vadd(acc[i][v], vload(bias + v * VW)) : acc[i][v]);
}

/* a constant row count per case lets the compiler keep every accumulator in a register */
#define CAP(r, max) ((r) < (max) ? (r) : (max))
#define CASES(STEPS, MAXR)                                                                    \
    switch (mr) {                                                                             \
        case 1: STEPS(CAP(1, MAXR)) break; case 2: STEPS(CAP(2, MAXR)) break; case 3: STEPS(CAP(3, MAXR)) break;\
        case 4: STEPS(CAP(4, MAXR)) break; case 5: STEPS(CAP(5, MAXR)) break; case 6: STEPS(CAP(6, MAXR)) break;\
        case 7: STEPS(CAP(7, MAXR)) break; case 8: STEPS(CAP(8, MAXR)) break; case 9: STEPS(CAP(9, MAXR)) break;\
        case 10: STEPS(CAP(10, MAXR)) break; case 11: STEPS(CAP(11, MAXR)) break; default: STEPS(MAXR) break;\
    }

/* one k step for R rows: broadcast each row's input (XB) and multiply-add it into its accumulators (MAC) */
#define ROWS_OP(R, XB, MAC)                                                                   \
    _Pragma("GCC unroll 12") for (int i = 0; i < (R); i++) {                                  \
        vec b = XB(x + i * K + k);                                                            \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[i][v] = MAC(b, w[v], acc[i][v]); \
    }
#define XFLOAT(p) vset1(*(p))
#define ROWS(R) ROWS_OP(R, XFLOAT, vfma)

/* One kernel per weight type (SKINNY): NAME##_STEPS walks a block's k steps with WSTEPS, whose
 * WLOAD(p) turns VW weights at p into a vector (fp32: a load; bf16: a widening load); the rest is
 * shared, so every type sums a row in the same order. */
#define SKINNY(NAME, XT, WT)                                                                  \
static inline void NAME##_block(int mr, const XT *x, long K, const WT *wp, float *y, long ldy, \
                                const float *bias) {                                          \
    vec acc[MR][NV];                                                                          \
    for (int i = 0; i < mr; i++)                                                              \
        for (int v = 0; v < NV; v++) acc[i][v] = vzero();                                     \
    CASES(NAME##_STEPS, MR)                                                                   \
    store(mr, acc, y, ldy, bias);                                                             \
}                                                                                             \
void NAME(const XT *x, long M, long K, const WT *wp, long N, const float *bias, float *y, int threads) { \
    long blocks = N / NR;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                         \
    for (long b = 0; b < blocks; b++) {                                                       \
        for (long m0 = 0; m0 < M; m0 += MR) {                                                 \
            int mr = (M - m0) < MR ? (int)(M - m0) : MR;                                      \
            NAME##_block(mr, x + m0 * K, K, wp + b * K * NR, y + m0 * N + b * NR, N, bias ? bias + b * NR : 0); \
        }                                                                                     \
    }                                                                                         \
}
/* each k step of a block: prefetch its cache lines PFD steps ahead, load NV weight vectors, use them for R rows */
#define WSTEPS_OP(R, WT, WLOAD, XB, MAC)                                                      \
    for (long k = 0; k < K; k++) {                                                            \
        for (int c = 0; c < (int)(NR * sizeof(WT)); c += 64)                                  \
            _mm_prefetch((const char *)(wp + (k + PFD) * NR) + c, _MM_HINT_T0);               \
        vec w[NV];                                                                            \
        for (int v = 0; v < NV; v++) w[v] = WLOAD(wp + k * NR + v * VW);                      \
        ROWS_OP(R, XB, MAC)                                                                   \
    }
#define WSTEPS(R, WT, WLOAD) WSTEPS_OP(R, WT, WLOAD, XFLOAT, vfma)

/* x: (M, K) row-major; wp: packed (N / 32, K, 32); bias: N floats or NULL; y: (M, N). N % 32 == 0. */
#define skinny_linear_STEPS(R) WSTEPS(R, float, vload)
SKINNY(skinny_linear, float, float)

/* The bf16 variant: wp is (N / 32, K, 32) bf16, fp32's layout at half the bytes. Each weight is
 * widened exactly, so a row's sums are skinny_linear's on the bf16-rounded weight. */
#define skinny_linear_bf16_STEPS(R) WSTEPS(R, unsigned short, BF16)
SKINNY(skinny_linear_bf16, float, unsigned short)

#ifdef __AVX512BF16__
/* The bf16-dot variant: x is (M, K / 2) pairs of bf16 and wp (N / 32, K / 2, 32) pairs, the two
 * inputs of a pair side by side, so one k step here is two of the others: lane j adds
 * x[2k] * w[j][2k] + x[2k + 1] * w[j][2k + 1] (each product exact in fp32) to its sum. K here is
 * the pair count. Rows are still summed alike whatever their number: a tree verifies to a step's numbers. */
#define XPAIR(p) _mm512_castsi512_ps(_mm512_set1_epi32((int)*(p)))
#define WPAIRS(p) _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(p)))
#define DOTBF16(b, w, acc) _mm512_dpbf16_ps((acc), (__m512bh)(w), (__m512bh)(b))
#define skinny_linear_bf16dot_STEPS(R) WSTEPS_OP(R, unsigned int, WPAIRS, XPAIR, DOTBF16)
SKINNY(skinny_linear_bf16dot, unsigned int, unsigned int)

/* The int4-dot variant: int4-dot is to int4 what bf16-dot is to bf16. x is (M, K / 2) pairs of bf16;
 * qp (N / 32, K / 2, 32) bytes: byte 2j + t of pair step p holds input 2p + t of column j in its low
 * nibble and of column 16 + j in its high one; sp, mp (N / 32, K / 32, 32) fp32: scale s and
 * m' = minimum - 128 * s. A code q becomes the bf16 128 + q exactly (q in the low mantissa bits of
 * 128.0, no conversion), so VDPBF16PS sums x * (128 + q) over a group of 32 inputs exactly as
 * products, in fp32; then y += s * sum + m' * (sum of the group's x), the group sums computed per row
 * before the blocks. Two weight vectors cost 4 integer instructions from 32 bytes: a one-token step
 * streams a third of bf16's bytes, and a tree's rows share the dequantization. K here is the pair
 * count, K % 16 == 0; every row is summed alike whatever the row count. */
#define MRD 6   /* 2 sums + 2 group sums per row in registers */
static inline void block_q4dot(int mr, const unsigned int *x, const float *xs, long K, const unsigned char *qp,
                               const float *sp, const float *mp, float *y, long ldy, const float *bias) {
    __m512 acc[MRD][2];
    const __m512i low = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
    const long G = K / 16;
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
#define STEPS_Q4DOT(R)                                                                        \
    for (long g = 0; g < G; g++) {                                                            \
        __m512 gs[R][2];                                                                      \
        for (int i = 0; i < (R); i++) gs[i][0] = gs[i][1] = _mm512_setzero_ps();              \
        for (long k = g * 16; k < g * 16 + 16; k++) {                                         \
            if (!(k & 1)) _mm_prefetch((const char *)(qp + (k + 2 * PFD) * 32), _MM_HINT_T0);  \
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qp + k * 32))); \
            __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(b, low, magic, 0xEA);          \
            __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), magic);          \
            _Pragma("GCC unroll 6") for (int i = 0; i < (R); i++) {                           \
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[i * K + k]);                  \
                gs[i][0] = _mm512_dpbf16_ps(gs[i][0], w0, xb);                                \
                gs[i][1] = _mm512_dpbf16_ps(gs[i][1], w1, xb);                                \
            }                                                                                 \
        }                                                                                     \
        __m512 s0 = _mm512_loadu_ps(sp + g * NR), s1 = _mm512_loadu_ps(sp + g * NR + 16);     \
        __m512 m0 = _mm512_loadu_ps(mp + g * NR), m1 = _mm512_loadu_ps(mp + g * NR + 16);     \
        _Pragma("GCC unroll 6") for (int i = 0; i < (R); i++) {                               \
            __m512 sx = _mm512_set1_ps(xs[i * G + g]);                                        \
            acc[i][0] = _mm512_fmadd_ps(sx, m0, _mm512_fmadd_ps(gs[i][0], s0, acc[i][0]));    \
            acc[i][1] = _mm512_fmadd_ps(sx, m1, _mm512_fmadd_ps(gs[i][1], s1, acc[i][1]));    \
        }                                                                                     \
    }
    switch (mr) {
        case 1: STEPS_Q4DOT(1) break; case 2: STEPS_Q4DOT(2) break; case 3: STEPS_Q4DOT(3) break;
        case 4: STEPS_Q4DOT(4) break; case 5: STEPS_Q4DOT(5) break; default: STEPS_Q4DOT(MRD) break;
    }
    store(mr, acc, y, ldy, bias);
}

void skinny_linear_q4dot(const unsigned int *x, long M, long K, const unsigned char *qp, const float *sp,
                         const float *mp, long N, const float *bias, float *y, int threads) {
    long blocks = N / NR, G = K / 16;
    float *xs = (float *)malloc(sizeof(float) * (M * G + 1));
    for (long i = 0; i < M * G; i++) { /* each group's sum of x, in one order for every row count */
        float sum = 0.0f;
        for (int t = 0; t < 16; t++) {
            unsigned int pair = x[i * 16 + t];
            union { unsigned int u; float f; } lo = {pair << 16}, hi = {pair & 0xFFFF0000u};
            sum += lo.f;
            sum += hi.f;
        }
        xs[i] = sum;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        for (long m0 = 0; m0 < M; m0 += MRD) {
            int mr = (M - m0) < MRD ? (int)(M - m0) : MRD;
            block_q4dot(mr, x + m0 * K, xs + m0 * G, K, qp + b * K * 32, sp + b * G * NR, mp + b * G * NR,
                        y + m0 * N + b * NR, N, bias ? bias + b * NR : 0);
        }
    }
    free(xs);
}

/* x (M, 2K) fp32 -> (M, K) pairs of bf16, rounded as torch's .to(torch.bfloat16) rounds: to nearest
 * even (NaN stays a NaN). The -dot kernels' _f32 entry points take fp32 x and round it here: one
 * torch conversion (~4 us of a ~15 us call on one token) less per linear layer. */
static unsigned int *bf16_pairs(const float *x, long n) {
    unsigned short *b = (unsigned short *)malloc(sizeof(unsigned short) * (n + 2));
    for (long i = 0; i < n; i++) {
        union { float f; unsigned int u; } v = {x[i]};
        b[i] = (v.u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (unsigned short)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    }
    return (unsigned int *)b;
}

void skinny_linear_q4dot_f32(const float *x, long M, long K, const unsigned char *qp, const float *sp,
                             const float *mp, long N, const float *bias, float *y, int threads) {
    unsigned int *pairs = bf16_pairs(x, M * K * 2);
    skinny_linear_q4dot(pairs, M, K, qp, sp, mp, N, bias, y, threads);
    free(pairs);
}

void skinny_linear_bf16dot_f32(const float *x, long M, long K, const unsigned int *wp, long N, const float *bias,
                               float *y, int threads) {
    unsigned int *pairs = bf16_pairs(x, M * K * 2);
    skinny_linear_bf16dot(pairs, M, K, wp, N, bias, y, threads);
    free(pairs);
}
#endif

#ifdef __AVX512VNNI__
/* The int4 x int8 variant (VPDPBUSD), int4-q8: each row of x is quantized per group of 32 inputs to
 * int8, as llama.cpp quantizes activations for its Q4 weights: d = max|x| / 127, xq = round(x / d).
 * The codes q (0..15, unsigned) are summed against xq exactly in int32, four products per lane per
 * instruction (twice VDPBF16PS's), then y += (s * d) * sum + m * (d * sum of xq) per group in fp32,
 * which is y = w @ (d * xq) with w = q * s + m. qp (N / 32, K / 4, 64) bytes: byte 4j + t of quad
 * step p holds input 4p + t of column j in its low nibble and of column 16 + j in its high one;
 * sp, mp (N / 32, K / 32, 32) fp16 scale and minimum (GGUF Q4_1's). Two weight vectors cost 3 integer
 * instructions from 64 bytes (int4-dot: 4 from 32). Every row is quantized and summed alike
 * whatever the row count, so a tree row is a decode step's. K % 32 == 0. */
#define MRB 6
#define HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))  /* 16 fp16 -> 16 floats, exactly */
static inline void block_q4q8(int mr, const signed char *xq, const float *xd, const float *xs, long K,
                              const unsigned char *qp, const unsigned short *sp, const unsigned short *mp, float *y,
                              long ldy, const float *bias) {
    __m512 acc[MRB][2];
    const __m512i low = _mm512_set1_epi8(0x0F);
    const long G = K / 32;
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
#define STEPS_Q4Q8(R)                                                                         \
    for (long g = 0; g < G; g++) {                                                            \
        __m512i is[R][2];                                                                     \
        for (int i = 0; i < (R); i++) is[i][0] = is[i][1] = _mm512_setzero_si512();           \
        for (long p = g * 8; p < g * 8 + 8; p++) {                                            \
            _mm_prefetch((const char *)(qp + (p + PFD) * 64), _MM_HINT_T0);                   \
            __m512i b = _mm512_loadu_si512((const void *)(qp + p * 64));                      \
            __m512i w0 = _mm512_and_si512(b, low);                                            \
            __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);                      \
            _Pragma("GCC unroll 6") for (int i = 0; i < (R); i++) {                           \
                int quad;                                                                     \
                memcpy(&quad, xq + i * K + p * 4, 4);                                         \
                __m512i xb = _mm512_set1_epi32(quad);                                         \
                is[i][0] = _mm512_dpbusd_epi32(is[i][0], w0, xb);                             \
                is[i][1] = _mm512_dpbusd_epi32(is[i][1], w1, xb);                             \
            }                                                                                 \
        }                                                                                     \
        __m512 s0 = HALF(sp + g * NR), s1 = HALF(sp + g * NR + 16);                             \
        __m512 m0 = HALF(mp + g * NR), m1 = HALF(mp + g * NR + 16);                             \
        _Pragma("GCC unroll 6") for (int i = 0; i < (R); i++) {                               \
            __m512 d = _mm512_set1_ps(xd[i * G + g]), sx = _mm512_set1_ps(xs[i * G + g]);     \
            acc[i][0] = _mm512_fmadd_ps(sx, m0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][0]), _mm512_mul_ps(s0, d), acc[i][0])); \
            acc[i][1] = _mm512_fmadd_ps(sx, m1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][1]), _mm512_mul_ps(s1, d), acc[i][1])); \
        }                                                                                     \
    }
    switch (mr) {
        case 1: STEPS_Q4Q8(1) break; case 2: STEPS_Q4Q8(2) break; case 3: STEPS_Q4Q8(3) break;
        case 4: STEPS_Q4Q8(4) break; case 5: STEPS_Q4Q8(5) break; default: STEPS_Q4Q8(MRB) break;
    }
    store(mr, acc, y, ldy, bias);
}

/* x (M, K) fp32 -> per group of 32: int8 codes, d and d * (sum of the codes). VCVTPS2DQ rounds to
 * nearest even, as nearbyintf; |x / d| <= 127 up to a rounding, which the saturating narrowing keeps. */
static void quantize_q8(const float *x, long M, long K, signed char *xq, float *xd, float *xs) {
    for (long i = 0; i < M * (K / 32); i++) {
        __m512 a = _mm512_loadu_ps(x + i * 32), b = _mm512_loadu_ps(x + i * 32 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f, id = amax > 0.0f && amax <= 3.4e38f ? 127.0f / amax : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
        _mm_storeu_si128((__m128i *)(xq + i * 32), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + i * 32 + 16), _mm512_cvtsepi32_epi8(qb));
        xd[i] = d;
        xs[i] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

void skinny_linear_q4q8(const float *x, long M, long K, const unsigned char *qp, const unsigned short *sp,
                        const unsigned short *mp, long N, const float *bias, float *y, int threads) {
    long blocks = N / NR, G = K / 32;
    signed char *xq = (signed char *)malloc(M * K + 64);
    float *xd = (float *)malloc(sizeof(float) * (2 * M * G + 2)), *xs = xd + M * G + 1;
    quantize_q8(x, M, K, xq, xd, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        for (long m0 = 0; m0 < M; m0 += MRB) {
            int mr = (M - m0) < MRB ? (int)(M - m0) : MRB;
            block_q4q8(mr, xq + m0 * K, xd + m0 * G, xs + m0 * G, K, qp + b * K * 16, sp + b * G * NR,
                       mp + b * G * NR, y + m0 * N + b * NR, N, bias ? bias + b * NR : 0);
        }
    }
    free(xq);
    free(xd);
}
#endif

/* The 4-bit variant. qp: (N / 32, K, 16) bytes, byte j of step k holding column j in its low
 * nibble and column 16 + j in its high one; sp, mp: (N / 32, K / 32, 32) fp32 scale and minimum,
 * w = q * scale + minimum (one fused rounding, the same for every row count). K % 32 == 0.
 * A block streams 16 bytes per k step instead of 128: the dequantization, not memory, sets the
 * time, and it is paid once per k step for all rows of a pass. */
/* a 4- or 8-bit block's k steps: per group of GS inputs its scale and minimum, then per k step the NV
 * weight vectors w = code * scale + minimum (QLOAD(), one fused rounding) used for R rows */
#define GROUP_STEPS_OF(R, QLOAD, GS)                                                          \
    for (long g = 0; g < K / GS; g++) {                                                       \
        vec s[NV], m[NV];                                                                     \
        for (int v = 0; v < NV; v++) s[v] = vload(sp + g * NR + v * VW), m[v] = vload(mp + g * NR + v * VW); \
        for (long k = g * GS; k < g * GS + GS; k++) {                                         \
            vec w[NV];                                                                        \
            QLOAD()                                                                           \
            ROWS(R)                                                                           \
        }                                                                                     \
    }
#define GROUP_STEPS(R, QLOAD) GROUP_STEPS_OF(R, QLOAD, 32)
#if NV == 2 /* columns 0-15 in the low nibbles, 16-31 in the high ones */
#define DEQUANT w[0] = vfma(CODES(lo), s[0], m[0]); w[1] = vfma(CODES(hi), s[1], m[1]);
#else
#define DEQUANT                                                                               \
    w[0] = vfma(CODES(lo), s[0], m[0]); w[1] = vfma(CODES(_mm_srli_si128(lo, 8)), s[1], m[1]); \
    w[2] = vfma(CODES(hi), s[2], m[2]); w[3] = vfma(CODES(_mm_srli_si128(hi, 8)), s[3], m[3]);
#endif
#define Q4_LOAD()                                                                             \
    if (!(k & 3)) _mm_prefetch((const char *)(qp + (k + 4 * PFD) * 16), _MM_HINT_T0);        \
    __m128i b = _mm_loadu_si128((const __m128i *)(qp + k * 16));                              \
    __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);       \
    DEQUANT
#define STEPS_Q4(R) GROUP_STEPS(R, Q4_LOAD)
static inline void block_q4(int mr, const float *x, long K, const unsigned char *qp, const float *sp,
                            const float *mp, float *y, long ldy, const float *bias) {
    vec acc[MRQ][NV];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = vzero();
    CASES(STEPS_Q4, MRQ)
    store(mr, acc, y, ldy, bias);
}

/* The 4- and 8-bit kernels' outer loop: blocks over the threads, rows MRQ at a time (BYTES: code
 * bytes per k step of a block; GS: inputs per scale group) */
#define QUANT_LINEAR(NAME, BLOCK, BYTES, GS)                                                  \
void NAME(const float *x, long M, long K, const unsigned char *qp, const float *sp, const float *mp, \
          long N, const float *bias, float *y, int threads) {                                \
    long blocks = N / NR;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                         \
    for (long b = 0; b < blocks; b++) {                                                       \
        for (long m0 = 0; m0 < M; m0 += MRQ) {                                                \
            int mr = (M - m0) < MRQ ? (int)(M - m0) : MRQ;                                    \
            BLOCK(mr, x + m0 * K, K, qp + b * K * BYTES, sp + b * (K / GS) * NR, mp + b * (K / GS) * NR, \
                  y + m0 * N + b * NR, N, bias ? bias + b * NR : 0);                          \
        }                                                                                     \
    }                                                                                         \
}
QUANT_LINEAR(skinny_linear_q4, block_q4, 16, 32)

/* The 8-bit variant (ExactInt8Linear: a dequantized GGUF Q8_0 weight as its codes). qp: (N / 32, K, 32)
 * bytes, byte j of step k holding column j; sp, mp as skinny_linear_q4's. w = q * scale + minimum in
 * one fused rounding, summed in skinny_linear's order, so exact codes give its bits. K % 32 == 0. */
#ifdef __AVX512F__
#define CODE_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
#else
#define CODE_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#endif
#define Q8_LOAD()                                                                             \
    if (!(k & 1)) _mm_prefetch((const char *)(qp + (k + 2 * PFD) * 32), _MM_HINT_T0);        \
    for (int v = 0; v < NV; v++) w[v] = vfma(CODES(CODE_BYTES(qp + k * 32 + v * VW)), s[v], m[v]);
#define STEPS_Q8(R) GROUP_STEPS(R, Q8_LOAD)
#define STEPS_Q8G16(R) GROUP_STEPS_OF(R, Q8_LOAD, 16)
#define BLOCK_Q8(NAME, STEPS)                                                                 \
static inline void NAME(int mr, const float *x, long K, const unsigned char *qp, const float *sp, \
                        const float *mp, float *y, long ldy, const float *bias) {             \
    vec acc[MRQ][NV];                                                                         \
    for (int i = 0; i < mr; i++)                                                              \
        for (int v = 0; v < NV; v++) acc[i][v] = vzero();                                     \
    CASES(STEPS, MRQ)                                                                         \
    store(mr, acc, y, ldy, bias);                                                             \
}
BLOCK_Q8(block_q8, STEPS_Q8)
QUANT_LINEAR(skinny_linear_q8, block_q8, 32, 32)
/* The same with a scale and minimum per 16 inputs (a dequantized GGUF Q6_K weight: 6-bit codes times
 * an fp16 d times an 8-bit scale per 16). sp, mp: (N / 32, K / 16, 32). K % 16 == 0. */
BLOCK_Q8(block_q8g16, STEPS_Q8G16)
QUANT_LINEAR(skinny_linear_q8g16, block_q8g16, 32, 16)

#ifdef __AVX512F__
/* Row-exact attention for few query rows (see attention.py): each (row, head) attends over its own
 * list of keys, the first n cache positions and then `tail` positions (a tree node's ancestors), in
 * that order, with one fixed sequence of operations: scores (one dot product per key), their max,
 * exp and sum in lanes of 16 by key index, then the weighted sum of values. A row's result depends
 * on its key list only, so a tree node gets the bits a decode step at its position gets.
 *
 * q, out: (B, M, H, D) fp32; k, v: fp32 with rows of D at position stride D, batch stride kb / vb and
 * head stride kh / vh; plan row r: batch pb[r], query pi[r], n = pn[r], tail = pt[po[r]..po[r+1]).
 * D % 16 == 0, D <= 256. */
/* the lanes of a 16-wide step that hold one of the n values left */
static inline __mmask16 tail16(long n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

static inline __m512 exp512(__m512 x) { /* Cephes' expf: Cody-Waite reduction, degree-6 polynomial */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

void attend_rows(const float *q, long M, long H, long D, const float *k, const float *v, long Hkv, long kb,
                 long kh, long vb, long vh, long R, const long *pb, const long *pi, const long *pn, const long *po,
                 const long *pt, float scale, float *out, int threads) {
    long C = D / 16, group = H / Hkv, lmax = 1;
    for (long r = 0; r < R; r++) lmax = pn[r] + po[r + 1] - po[r] > lmax ? pn[r] + po[r + 1] - po[r] : lmax;
    float *scratch = (float *)malloc(sizeof(float) * threads * lmax); /* each thread's scores */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long task = 0; task < R * H; task++) {
        long r = task / H, h = task % H, b = pb[r], n = pn[r], t = po[r + 1] - po[r];
        const long *tail = pt + po[r];
        const float *qp = q + ((b * M + pi[r]) * H + h) * D;
        const float *kp = k + b * kb + (h / group) * kh, *vp = v + b * vb + (h / group) * vh;
        float *s = scratch + (long)omp_get_thread_num() * lmax;
        long L = n + t;
        __m512 qv[16], acc[16];
        for (long c = 0; c < C; c++) qv[c] = _mm512_loadu_ps(qp + c * 16), acc[c] = _mm512_setzero_ps();
        float mx = -3.0e38f;
        for (long j = 0; j < L; j++) {
            const float *kr = kp + (j < n ? j : tail[j - n]) * D;
            __m512 a = _mm512_setzero_ps();
            for (long c = 0; c < C; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + c * 16), a);
            s[j] = _mm512_reduce_add_ps(a) * scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        __m512 sum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
        for (long j = 0; j < L; j += 16) {
            __mmask16 m = tail16(L - j);
            __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
            _mm512_mask_storeu_ps(s + j, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        for (long j = 0; j < L; j++) {
            const float *vr = vp + (j < n ? j : tail[j - n]) * D;
            __m512 p = _mm512_set1_ps(s[j]);
            for (long c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + c * 16), acc[c]);
        }
        __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
        float *o = out + ((b * M + pi[r]) * H + h) * D;
        for (long c = 0; c < C; c++) _mm512_storeu_ps(o + c * 16, _mm512_div_ps(acc[c], total));
    }
    free(scratch);
}
#endif

/* RMSNorm of M rows of H floats: y = w * (x * 1 / sqrt(mean(x^2) + eps)), as transformers' Llama /
 * Qwen2 norms compute it in fp32. Each row is summed in the same order whatever M is, so tree rows
 * equal one-by-one rows bit for bit. transformers' module spends ~16 us per call in six small torch
 * ops on a 576-wide row, and a SmolLM2 forward makes 61 such calls. */
void rms_norm(const float *x, long M, long H, const float *w, float eps, float *y) {
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * H;
        float *yr = y + m * H;
        vec acc = vzero();
        long i = 0;
        for (; i + VW <= H; i += VW) acc = vfma(vload(xr + i), vload(xr + i), acc);
        float part[VW], ss = 0.0f;
        vstore(part, acc);
        for (int j = 0; j < VW; j++) ss += part[j];
        for (; i < H; i++) ss += xr[i] * xr[i];
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

#ifdef __AVX512F__
/* A whole decoder layer in one call (lean.py's one-call path): Llama / Qwen2's pre-norm layer on
 * the rows of x, in place: RMSNorm, fused q/k/v, RoPE on q and k, k and v written into the KV cache,
 * row-exact attention (attend_rows), o, residual, RMSNorm, fused gate/up, SiLU(gate) * up, down,
 * residual. The same kernels as the per-module path, without the ~20 torch calls around them
 * (~150 us per layer on 2 cores, over half a one-token int4 step). Every step is row by row, so a
 * tree row still gets a decode step's bits. RoPE is torch's expression, x * cos + rotate_half(x) *
 * sin, rounded as torch rounds it (built with -ffp-contract=off); SiLU uses exp512, not torch's exp. */
typedef struct { long kind, K, N; const void *w0, *w1, *w2; const float *bias; } lin_t;
typedef struct {
    lin_t qkv, o, gate_up, down;
    const float *norm1, *norm2; /* norm1 NULL: none (EAGLE-1's draft layer reads the FC's output as is) */
    long nq, nkv, D, inter;
    float eps, scale;
    const float *hnorm; /* EAGLE-3's mid layer: q/k/v read [norm1(embedding) ; hnorm(x)] (2H), residual x */
} layer_t;

enum { LIN_F32, LIN_BF16, LIN_Q4, LIN_BF16DOT, LIN_Q4DOT, LIN_Q4Q8, LIN_Q8, LIN_Q8G16 };

static void run_linear(const lin_t *l, const float *x, long M, float *y, int threads) {
    switch (l->kind) {
        case LIN_F32: skinny_linear(x, M, l->K, (const float *)l->w0, l->N, l->bias, y, threads); break;
        case LIN_BF16: skinny_linear_bf16(x, M, l->K, (const unsigned short *)l->w0, l->N, l->bias, y, threads); break;
        case LIN_Q4:
            skinny_linear_q4(x, M, l->K, (const unsigned char *)l->w0, (const float *)l->w1, (const float *)l->w2,
                             l->N, l->bias, y, threads);
            break;
        case LIN_Q8:
            skinny_linear_q8(x, M, l->K, (const unsigned char *)l->w0, (const float *)l->w1, (const float *)l->w2,
                             l->N, l->bias, y, threads);
            break;
        case LIN_Q8G16:
            skinny_linear_q8g16(x, M, l->K, (const unsigned char *)l->w0, (const float *)l->w1, (const float *)l->w2,
                                l->N, l->bias, y, threads);
            break;
#ifdef __AVX512BF16__
        case LIN_BF16DOT:
            skinny_linear_bf16dot_f32(x, M, l->K, (const unsigned int *)l->w0, l->N, l->bias, y, threads);
            break;
        case LIN_Q4DOT:
            skinny_linear_q4dot_f32(x, M, l->K, (const unsigned char *)l->w0, (const float *)l->w1,
                                    (const float *)l->w2, l->N, l->bias, y, threads);
            break;
#endif
#ifdef __AVX512VNNI__
        case LIN_Q4Q8:
            skinny_linear_q4q8(x, M, l->K, (const unsigned char *)l->w0, (const unsigned short *)l->w1,
                               (const unsigned short *)l->w2, l->N, l->bias, y, threads);
            break;
#endif
    }
}

/* out = x * c + rotate_half(x) * s over one head of D, rotate_half(x) = (-x[D/2:], x[:D/2]) */
static inline void rope(const float *x, const float *c, const float *s, float *out, long D) {
    long half = D / 2;
    for (long j = 0; j < half; j++) {
        float a = x[j] * c[j], b = -x[j + half] * s[j];
        float e = x[j + half] * c[j + half], f = x[j] * s[j + half];
        out[j] = a + b;
        out[j + half] = e + f;
    }
}

/* x: (B * M, H) fp32, updated in place; cos, sin: (B * M, D); kc / vc: the layer's cache buffers with
 * batch strides kb / vb and head strides kh / vh (rows of D), row i of batch b written at position
 * slot + i; the plan (R, pb, pi, pn, po, pt) as attend_rows takes it, over the cache after the write. */
static void layer_rows(const layer_t *L, float *x, const float *emb, long B, long M, long H, const float *cos,
                       const float *sin, float *kc, float *vc, long kb, long kh, long vb, long vh, long slot, long R,
                       const long *pb, const long *pi, const long *pn, const long *po, const long *pt, int threads) {
    long rows = B * M, D = L->D, nq = L->nq, nkv = L->nkv, I = L->inter, W = (nq + 2 * nkv) * D;
    long big = W > 2 * I ? W : 2 * I, in = L->hnorm ? 2 * H : H;
    float *h = (float *)malloc(sizeof(float) * rows * in), *t = (float *)malloc(sizeof(float) * rows * big);
    float *q = (float *)malloc(sizeof(float) * rows * nq * D), *a = (float *)malloc(sizeof(float) * rows * nq * D);
    float *y = (float *)malloc(sizeof(float) * rows * H); /* o's and down's outputs */
    if (L->hnorm)
        for (long r = 0; r < rows; r++) {
            rms_norm(emb + r * H, 1, H, L->norm1, L->eps, h + r * in);
            rms_norm(x + r * H, 1, H, L->hnorm, L->eps, h + r * in + H);
        }
    else if (L->norm1)
        rms_norm(x, rows, H, L->norm1, L->eps, h);
    else
        memcpy(h, x, sizeof(float) * rows * H);
    run_linear(&L->qkv, h, rows, t, threads);
    for (long r = 0; r < rows; r++) {
        long b = r / M, pos = slot + r % M;
        const float *row = t + r * W, *c = cos + r * D, *s = sin + r * D;
        for (long j = 0; j < nq; j++) rope(row + j * D, c, s, q + (r * nq + j) * D, D);
        for (long j = 0; j < nkv; j++) {
            rope(row + (nq + j) * D, c, s, kc + b * kb + j * kh + pos * D, D);
            const float *v = row + (nq + nkv + j) * D;
            float *dst = vc + b * vb + j * vh + pos * D;
            for (long e = 0; e < D; e++) dst[e] = v[e];
        }
    }
    attend_rows(q, M, nq, D, kc, vc, nkv, kb, kh, vb, vh, R, pb, pi, pn, po, pt, L->scale, a, threads);
    run_linear(&L->o, a, rows, y, threads);
    for (long i = 0; i < rows * H; i++) x[i] = x[i] + y[i];
    rms_norm(x, rows, H, L->norm2, L->eps, h);
    run_linear(&L->gate_up, h, rows, t, threads);
    float *act = (float *)malloc(sizeof(float) * rows * I);
    for (long r = 0; r < rows; r++) { /* SiLU(g) * u = g / (1 + exp(-g)) * u */
        const float *g = t + r * 2 * I, *u = g + I;
        float *o = act + r * I;
        long j = 0;
        for (; j + 16 <= I; j += 16) {
            __m512 gv = _mm512_loadu_ps(g + j);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(sg, _mm512_loadu_ps(u + j)));
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    run_linear(&L->down, act, rows, y, threads);
    for (long i = 0; i < rows * H; i++) x[i] = x[i] + y[i];
    free(h), free(t), free(q), free(a), free(y), free(act);
}

void decoder_layer(const layer_t *L, float *x, long B, long M, long H, const float *cos, const float *sin,
                   float *kc, float *vc, long kb, long kh, long vb, long vh, long slot, long R, const long *pb,
                   const long *pi, const long *pn, const long *po, const long *pt, int threads) {
    layer_rows(L, x, 0, B, M, H, cos, sin, kc, vc, kb, kh, vb, vh, slot, R, pb, pi, pn, po, pt, threads);
}

/* n consecutive decoder layers in one call (lean.py's decoder forward): layers[i] is the address of
 * layer i's layer_t, kcs[i] / vcs[i] of its cache buffers (all alike in shape); the rest as
 * decoder_layer. A SmolLM2 step makes 30 layer calls; from Python each cost ~15 us around its work. */
void decoder_stack(const long *layers, long n, float *x, long B, long M, long H, const float *cos, const float *sin,
                   const long *kcs, const long *vcs, long kb, long kh, long vb, long vh, long slot, long R,
                   const long *pb, const long *pi, const long *pn, const long *po, const long *pt, int threads) {
    for (long i = 0; i < n; i++)
        decoder_layer((const layer_t *)layers[i], x, B, M, H, cos, sin, (float *)kcs[i], (float *)vcs[i], kb, kh, vb,
                      vh, slot, R, pb, pi, pn, po, pt, threads);
}

/* EAGLE's draft head over M rows of one sequence in one call (head.py's `draft_step`): per row,
 * h = fc([f ; embed[token]]) (+ fuse of the RMS-normed aux features after f, where feat has them:
 * W > H), then the head's decoder layers as decoder_layer runs them (their entries written into the
 * head cache at slot..); out = h. With k > 0, rows first..M-1 also get their k best draft
 * log-probabilities at temperature 1 / inv_temp (the draft LM head's N logits, then the context
 * rows' nctx dot products) and those tokens' target ids (ids[draft index]), best first, ties to the
 * lower index; with probs, also the whole draft law softmax(logits * inv_temp), (M - first, N + nctx)
 * (sampled drafts draw from it). The head's torch path made ~40 small calls around these kernels:
 * ~0.6 ms of a ~1.1 ms drafted round on 2 cores.
 * An EAGLE-3 head (final_norm set) instead takes h = fc(the aux features) where feat has them, else
 * h = f (its own last output, at tree levels); its one mid layer also reads embed[token]; its draft
 * LM head reads final_norm(out). */
typedef struct {
    lin_t fc, fuse, lm;     /* fuse.kind < 0: no aux features */
    const float *embed, *aux_norm, *cos, *sin; /* embed (V, H); cos, sin: (P, D) tables by position */
    const long *layers;     /* layer_t addresses */
    long H, naux, nlayers, D;
    float aux_eps;
    const float *final_norm; /* EAGLE-3 */
    float final_eps;
} head_t;

static void top_logprobs(const head_t *E, const float *x, long M, const float *ctx, long nctx, const long *ids,
                         float inv_temp, long k, float *topv, long *topi, float *probs, int threads) {
    long N = E->lm.N, H = E->H;
    float *lg = (float *)malloc(sizeof(float) * M * N), *cg = (float *)malloc(sizeof(float) * (M * nctx + 1));
    run_linear(&E->lm, x, M, lg, threads);
    for (long r = 0; r < M; r++)
        for (long c = 0; c < nctx; c++) {
            __m512 a = _mm512_setzero_ps();
            long j = 0;
            for (; j + 16 <= H; j += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * H + j), _mm512_loadu_ps(ctx + c * H + j), a);
            float d = _mm512_reduce_add_ps(a);
            for (; j < H; j++) d += x[r * H + j] * ctx[c * H + j];
            cg[r * nctx + c] = d;
        }
    for (long r = 0; r < M; r++) {
        const float *parts[2] = {lg + r * N, cg + r * nctx};
        long lens[2] = {N, nctx}, bi[64], have = 0;
        float bv[64];
        __m512 vmax = _mm512_set1_ps(-3.0e38f);
        for (int p = 0; p < 2; p++) /* the max, and the k largest (an insertion list: k is small) */
            for (long j = 0; j < lens[p]; j += 16) {
                __mmask16 m = tail16(lens[p] - j);
                __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-3.0e38f), m, parts[p] + j);
                vmax = _mm512_max_ps(vmax, v);
                __m512 bar = _mm512_set1_ps(have == k ? bv[k - 1] : -INFINITY);
                for (__mmask16 hit = _mm512_mask_cmp_ps_mask(m, v, bar, _CMP_GT_OQ); hit; hit &= hit - 1) {
                    long at, i = j + __builtin_ctz(hit);
                    float x = parts[p][i];
                    if (have == k && !(x > bv[k - 1])) continue;
                    for (at = have < k ? have++ : k - 1; at > 0 && x > bv[at - 1]; at--)
                        bv[at] = bv[at - 1], bi[at] = bi[at - 1];
                    bv[at] = x, bi[at] = p ? N + i : i;
                }
            }
        float mx = _mm512_reduce_max_ps(vmax);
        /* (v - max) * inv_temp, as softmax shifts: exact near the max, where the mass is */
        __m512 sum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx), it = _mm512_set1_ps(inv_temp);
        for (int p = 0; p < 2; p++)
            for (long j = 0; j < lens[p]; j += 16) {
                __mmask16 m = tail16(lens[p] - j);
                __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, parts[p] + j), vmx), it);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, exp512(z)));
            }
        float total = _mm512_reduce_add_ps(sum), lse = logf(total);
        if (probs) { /* the whole draft law: softmax(logits * inv_temp) over the N + nctx tokens */
            __m512 inv = _mm512_set1_ps(1.0f / total);
            for (int p = 0; p < 2; p++)
                for (long j = 0; j < lens[p]; j += 16) {
                    __mmask16 m = tail16(lens[p] - j);
                    __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, parts[p] + j), vmx), it);
                    /* down to expf's underflow as torch's softmax goes (exp512 alone stops at -87.3): which
                     * tokens have any mass decides which a sampled draft can pick */
                    __mmask16 live = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-103.9f), _CMP_GE_OQ);
                    __m512 e = _mm512_mul_ps(exp512(_mm512_add_ps(z, _mm512_set1_ps(16.0f))), _mm512_set1_ps(1.12535175e-7f));
                    _mm512_mask_storeu_ps(probs + r * (N + nctx) + (p ? N : 0) + j, m, _mm512_maskz_mul_ps(live, e, inv));
                }
        }
        for (long j = 0; j < k; j++) {
            topv[r * k + j] = j < have ? (bv[j] - mx) * inv_temp - lse : -INFINITY;
            topi[r * k + j] = ids[j < have ? bi[j] : 0];
        }
    }
    free(lg), free(cg);
}

void draft_step(const head_t *E, const float *feat, long M, long W, const long *tokens, const long *pos,
                const long *kcs, const long *vcs, long kb, long kh, long vb, long vh, long slot, long R,
                const long *pb, const long *pi, const long *pn, const long *po, const long *pt, float *out,
                long first, const float *ctx, long nctx, const long *ids, float inv_temp, long k, float *topv,
                long *topi, float *probs, int threads) {
    long H = E->H, D = E->D, e3 = E->final_norm != 0, A = E->naux * H;
    float *cs = (float *)malloc(sizeof(float) * 2 * M * D), *emb = (float *)malloc(sizeof(float) * M * H);
    for (long r = 0; r < M; r++) {
        memcpy(emb + r * H, E->embed + tokens[r] * H, sizeof(float) * H);
        memcpy(cs + r * D, E->cos + pos[r] * D, sizeof(float) * D);
        memcpy(cs + (M + r) * D, E->sin + pos[r] * D, sizeof(float) * D);
    }
    float *aux = 0; /* the aux features after f, where feat has them (a tree level's parents bring f alone) */
    if (W > H && (e3 || E->fuse.kind >= 0)) {
        aux = (float *)malloc(sizeof(float) * M * A);
        for (long r = 0; r < M; r++) memcpy(aux + r * A, feat + r * W + H, sizeof(float) * A);
    }
    if (e3 && aux) /* the target's layers through the FC */
        run_linear(&E->fc, aux, M, out, threads);
    else if (e3) /* a tree level: the head's own output */
        for (long r = 0; r < M; r++) memcpy(out + r * H, feat + r * W, sizeof(float) * H);
    else {
        float *xin = (float *)malloc(sizeof(float) * M * 2 * H);
        for (long r = 0; r < M; r++) {
            memcpy(xin + r * 2 * H, feat + r * W, sizeof(float) * H);
            memcpy(xin + r * 2 * H + H, emb + r * H, sizeof(float) * H);
        }
        run_linear(&E->fc, xin, M, out, threads);
        free(xin);
        if (aux) {
            float *y = (float *)malloc(sizeof(float) * M * H);
            rms_norm(aux, M * E->naux, H, E->aux_norm, E->aux_eps, aux);
            run_linear(&E->fuse, aux, M, y, threads);
            for (long i = 0; i < M * H; i++) out[i] = out[i] + y[i];
            free(y);
        }
    }
    free(aux);
    long *causal = 0;
    if (R == 0) { /* row i sees the cache and the rows up to itself */
        causal = (long *)calloc(4 * M + 2, sizeof(long));
        pb = causal, pi = causal + M, pn = causal + 2 * M, po = causal + 3 * M, pt = causal + 4 * M + 1, R = M;
        for (long r = 0; r < M; r++) ((long *)pi)[r] = r, ((long *)pn)[r] = slot + r + 1;
    }
    for (long i = 0; i < E->nlayers; i++)
        layer_rows((const layer_t *)E->layers[i], out, emb, 1, M, H, cs, cs + M * D, (float *)kcs[i], (float *)vcs[i],
                   kb, kh, vb, vh, slot, R, pb, pi, pn, po, pt, threads);
    if (k > 0 && e3) {
        float *normed = (float *)malloc(sizeof(float) * (M - first) * H);
        rms_norm(out + first * H, M - first, H, E->final_norm, E->final_eps, normed);
        top_logprobs(E, normed, M - first, ctx, nctx, ids, inv_temp, k, topv, topi, probs, threads);
        free(normed);
    } else if (k > 0)
        top_logprobs(E, out + first * H, M - first, ctx, nctx, ids, inv_temp, k, topv, topi, probs, threads);
    free(cs), free(emb), free(causal);
}
#endif

/* Row-wise argmax of x (R, V): the first index of each row's maximum, torch.argmax's choice (greedy
 * decoding and verification read it every step; torch's took ~17 us a 49k-token row, scalar).
 * Returns 0 if a row holds a NaN (torch ranks NaN highest: the caller asks torch), else 1. */
int argmax_rows(const float *x, long R, long V, long *out) {
    for (long r = 0; r < R; r++) {
        const float *row = x + r * V;
        float m = -INFINITY;
        long j = 0;
#ifdef __AVX512F__
        __m512 vm = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; j + 16 <= V; j += 16) {
            __m512 v = _mm512_loadu_ps(row + j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vm = _mm512_max_ps(vm, v);
        }
        if (nan) return 0;
        m = _mm512_reduce_max_ps(vm);
#endif
        for (; j < V; j++) {
            if (row[j] != row[j]) return 0;
            m = row[j] > m ? row[j] : m;
        }
        long i = 0;
#ifdef __AVX512F__
        for (__m512 vmax = _mm512_set1_ps(m); i + 16 <= V; i += 16) {
            __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), vmax, _CMP_EQ_OQ);
            if (eq) {
                i += __builtin_ctz(eq);
                break;
            }
        }
#endif
        while (row[i] != m) i++; /* m is in the row, so this stops */
        out[r] = i;
    }
    return 1;
}

/* Inverse-CDF draws without replacement from each row of p (R, V; fp32, >= 0, unnormalised): pick
 * j of row r is the first index whose cumulative mass, in double with picks 0..j-1 left out,
 * exceeds u[r * k + j] (in [0, 1)) times the mass left: a draw from the row with the earlier picks
 * removed, renormalised. Sampled decoding draws every token so (torch's double cumsum and
 * searchsorted took ~40 us a 49k row), and sampled drafts draw their siblings so (a Gumbel top-k
 * over torch's uniforms took ~200 us for 4 picks from 3 16k rows: a uniform per token). Sums per
 * block of DRAW_BLOCK, then one block scanned in order; where rounding leaves the scan short, the
 * next blocks, then the last index with mass. Once no mass is left, picks are the lowest unpicked
 * indices (zero-probability tokens, chosen deterministically). Returns 0 where a row holds a
 * negative, NaN or infinite entry (the caller asks torch), else 1. */
#define DRAW_BLOCK 1024
#ifdef __AVX512F__
/* 16 floats added to two double accumulators (low and high halves) */
#define ADD_PD16(a, b, v)                                                                         \
    a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));                             \
    b = _mm512_add_pd(b, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
#endif
static double block_mass(const float *x, long n) {
    double s = 0.0;
    long i = 0;
#ifdef __AVX512F__
    __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        ADD_PD16(a, b, v)
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(a, b));
#endif
    for (; i < n; i++) s += x[i];
    return s;
}

static inline long draw_block_len(long V, long b) {
    return V - b * DRAW_BLOCK < DRAW_BLOCK ? V - b * DRAW_BLOCK : DRAW_BLOCK;
}

/* block b of row into buf with the m picks so far zeroed; returns its length */
static long block_without(const float *row, long V, long b, const long *picks, long m, float *buf) {
    long lo = b * DRAW_BLOCK, n = draw_block_len(V, b);
    memcpy(buf, row + lo, sizeof(float) * n);
    for (long i = 0; i < m; i++)
        if (picks[i] >= lo && picks[i] < lo + n) buf[picks[i] - lo] = 0.0f;
    return n;
}

static int picked(const long *picks, long m, long i) {
    int taken = 0;
    for (long j = 0; j < m; j++) taken |= picks[j] == i;
    return taken;
}

static int bad_mass(const float *x, long n) { /* any entry negative or NaN (not >= 0), or infinite */
    int bad = 0;
    for (long i = 0; i < n; i++) bad |= !(x[i] >= 0.0f) | (x[i] == INFINITY);
    return bad;
}

int draw_rows(const float *p, long R, long V, long k, const double *u, long *picks) {
    long nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double *mass = malloc(sizeof(double) * (nb > 0 ? nb : 1));
    float buf[DRAW_BLOCK];
    int ok = mass != NULL;
    for (long r = 0; r < R && ok; r++) {
        const float *row = p + r * V;
        long *out = picks + r * k;
        if (bad_mass(row, V)) {
            ok = 0;
            break;
        }
        for (long b = 0; b < nb; b++) mass[b] = block_mass(row + b * DRAW_BLOCK, draw_block_len(V, b));
        for (long j = 0; j < k; j++) {
            double left = 0.0;
            for (long b = 0; b < nb; b++) left += mass[b];
            long pick = -1;
            if (left > 0.0) {
                double t = u[r * k + j] * left, acc = 0.0;
                long b = 0, last = -1;
                while (b < nb - 1 && acc + mass[b] <= t) acc += mass[b++];
                for (; b < nb && pick < 0; b++) { /* the block holding t; the next ones if rounding fell short */
                    long lo = b * DRAW_BLOCK, n = block_without(row, V, b, out, j, buf);
                    for (long i = 0; i < n; i++)
                        if (buf[i] > 0.0f) {
                            last = lo + i;
                            acc += buf[i];
                            if (acc > t) {
                                pick = lo + i;
                                break;
                            }
                        }
                }
                if (pick < 0) pick = last;
                if (pick < 0) /* the scan started past the row's mass: its last unpicked index with any */
                    for (long i = V - 1; i >= 0 && pick < 0; i--)
                        if (row[i] > 0.0f && !picked(out, j, i)) pick = i;
            }
            if (pick < 0) /* no mass left: the lowest unpicked index */
                for (long i = 0; i < V && pick < 0; i++)
                    if (!picked(out, j, i)) pick = i;
            out[j] = pick;
            if (pick >= 0 && row[pick] > 0.0f) { /* its block's mass, without every pick so far */
                long b = pick / DRAW_BLOCK, n = block_without(row, V, b, out, j + 1, buf);
                mass[b] = block_mass(buf, n);
            }
        }
    }
    free(mass);
    return ok;
}

/* out = max(0, p - q) / its sum (n fp32 values, the sum in double): speculative sampling's residual
 * law after a rejected draft (torch's subtract, clamp, sum and divide read 49k-token rows four
 * times). Returns the sum; 0 where nothing is left (out then holds zeros). */
double residual_law(const float *p, const float *q, long n, float *out) {
    double s = 0.0;
    long i = 0;
#ifdef __AVX512F__
    __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(q + i)), _mm512_setzero_ps());
        _mm512_storeu_ps(out + i, v);
        ADD_PD16(a, b, v)
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(a, b));
#endif
    for (; i < n; i++) {
        float d = p[i] - q[i];
        out[i] = d > 0.0f ? d : 0.0f;
        s += out[i];
    }
    if (!(s > 0.0)) return 0.0;
    float total = (float)s;
    for (i = 0; i < n; i++) out[i] /= total;
    return s;
}

/* KV cache compaction after verification, every layer in one call: in each buffer (bufs[i], fp32,
 * batch stride bs, head stride hs, rows of D) and batch row b, rows src + keep[j] (j in
 * koff[b]..koff[b+1], ascending) move to dst[b] + j - koff[b]. dst[b] <= src, so copying in order never
 * overwrites a row still to be read. The per-layer torch path made 2 index_select copies per layer. */
void kv_compact(const long *bufs, long nbuf, long B, long H, long D, long bs, long hs, const long *dst, long src,
                const long *keep, const long *koff) {
    for (long i = 0; i < nbuf; i++)
        for (long b = 0; b < B; b++)
            for (long h = 0; h < H; h++) {
                float *base = (float *)bufs[i] + b * bs + h * hs;
                for (long j = koff[b]; j < koff[b + 1]; j++)
                    memmove(base + (dst[b] + j - koff[b]) * D, base + (src + keep[j]) * D, sizeof(float) * D);
            }
}
