/* y = x @ w.T (+ bias) for few rows of x (a decode step or a draft tree): AVX-512, OpenMP.
 * x and y are fp32; w is fp32 (skinny_linear) or 4-bit with a scale and a minimum per 32 inputs
 * (skinny_linear_q4, dequantized in registers).
 *
 * Decoding a small model streams every weight once per forward. BLAS kernels are tuned for big
 * matrices: on a 2-core Xeon, torch's default path costs 1.6x a one-token step at 4 rows and 2x
 * at 8. Here each block of 32 output columns is streamed from memory once, with software
 * prefetch, and reused from registers for up to 12 rows at a time, so the weights' bytes, not
 * the arithmetic, set the time until ~16 rows.
 *
 * Weight layout (see kernels.pack_weight): wp[n / 32][k][32], i.e. each block of 32 rows of w
 * transposed, so one k step of a block is two contiguous 16-float vectors.
 */
#include <immintrin.h>
#include <omp.h>

#define NR 32   /* output columns per block: two zmm registers */
#define MR 12   /* rows of x per pass over a block: 24 accumulators of the 32 zmm registers */
#define PFD 64  /* prefetch distance in k steps (64 * 128 bytes ahead) */

static inline void store(int mr, __m512 acc[][2], float *y, long ldy, const float *bias) {
    for (int i = 0; i < mr; i++) {
        __m512 a0 = acc[i][0], a1 = acc[i][1];
        if (bias) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(bias));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(bias + 16));
        }
        _mm512_storeu_ps(y + i * ldy, a0);
        _mm512_storeu_ps(y + i * ldy + 16, a1);
    }
}

static inline void block(int mr, const float *x, long K, const float *wp, float *y, long ldy, const float *bias) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
#define ROWS(R)                                                                               \
    _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                    \
        __m512 b = _mm512_set1_ps(x[i * K + k]);                                              \
        acc[i][0] = _mm512_fmadd_ps(b, w0, acc[i][0]);                                        \
        acc[i][1] = _mm512_fmadd_ps(b, w1, acc[i][1]);                                        \
    }
#define STEPS(R)                                                                              \
    for (long k = 0; k < K; k++) {                                                            \
        _mm_prefetch((const char *)(wp + (k + PFD) * NR), _MM_HINT_T0);                       \
        _mm_prefetch((const char *)(wp + (k + PFD) * NR + 16), _MM_HINT_T0);                  \
        __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + k * NR + 16);     \
        ROWS(R)                                                                               \
    }
    /* a constant row count per case lets the compiler keep every accumulator in a register */
    switch (mr) {
        case 1: STEPS(1) break;   case 2: STEPS(2) break;   case 3: STEPS(3) break;
        case 4: STEPS(4) break;   case 5: STEPS(5) break;   case 6: STEPS(6) break;
        case 7: STEPS(7) break;   case 8: STEPS(8) break;   case 9: STEPS(9) break;
        case 10: STEPS(10) break; case 11: STEPS(11) break; default: STEPS(12) break;
    }
    store(mr, acc, y, ldy, bias);
}

/* x: (M, K) row-major; wp: packed (N / 32, K, 32); bias: N floats or NULL; y: (M, N). N % 32 == 0. */
void skinny_linear(const float *x, long M, long K, const float *wp, long N, const float *bias, float *y,
                   int threads) {
    long blocks = N / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        for (long m0 = 0; m0 < M; m0 += MR) {
            int mr = (M - m0) < MR ? (int)(M - m0) : MR;
            block(mr, x + m0 * K, K, wp + b * K * NR, y + m0 * N + b * NR, N, bias ? bias + b * NR : 0);
        }
    }
}

/* The 4-bit variant. qp: (N / 32, K, 16) bytes, byte j of step k holding column j in its low
 * nibble and column 16 + j in its high one; sp, mp: (N / 32, K / 32, 32) fp32 scale and minimum,
 * w = q * scale + minimum (one fused rounding, the same for every row count). K % 32 == 0.
 * A block streams 16 bytes per k step instead of 128: the dequantization, not memory, sets the
 * time, and it is paid once per k step for all rows of a pass. */
static inline void block_q4(int mr, const float *x, long K, const unsigned char *qp, const float *sp,
                            const float *mp, float *y, long ldy, const float *bias) {
    __m512 acc[MR][2];
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
#define STEPS_Q4(R)                                                                           \
    for (long g = 0; g < K / 32; g++) {                                                       \
        __m512 s0 = _mm512_loadu_ps(sp + g * NR), s1 = _mm512_loadu_ps(sp + g * NR + 16);     \
        __m512 m0 = _mm512_loadu_ps(mp + g * NR), m1 = _mm512_loadu_ps(mp + g * NR + 16);     \
        for (long k = g * 32; k < g * 32 + 32; k++) {                                         \
            if (!(k & 3)) _mm_prefetch((const char *)(qp + (k + 4 * PFD) * 16), _MM_HINT_T0); \
            __m128i v = _mm_loadu_si128((const __m128i *)(qp + k * 16));                     \
            __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low); \
            __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), s0, m0); \
            __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), s1, m1); \
            ROWS(R)                                                                           \
        }                                                                                     \
    }
    switch (mr) {
        case 1: STEPS_Q4(1) break;   case 2: STEPS_Q4(2) break;   case 3: STEPS_Q4(3) break;
        case 4: STEPS_Q4(4) break;   case 5: STEPS_Q4(5) break;   case 6: STEPS_Q4(6) break;
        case 7: STEPS_Q4(7) break;   case 8: STEPS_Q4(8) break;   case 9: STEPS_Q4(9) break;
        case 10: STEPS_Q4(10) break; case 11: STEPS_Q4(11) break; default: STEPS_Q4(12) break;
    }
    store(mr, acc, y, ldy, bias);
}

void skinny_linear_q4(const float *x, long M, long K, const unsigned char *qp, const float *sp, const float *mp,
                      long N, const float *bias, float *y, int threads) {
    long blocks = N / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        for (long m0 = 0; m0 < M; m0 += MR) {
            int mr = (M - m0) < MR ? (int)(M - m0) : MR;
            block_q4(mr, x + m0 * K, K, qp + b * K * 16, sp + b * (K / 32) * NR, mp + b * (K / 32) * NR,
                     y + m0 * N + b * NR, N, bias ? bias + b * NR : 0);
        }
    }
}
