/* fp32 y = x @ w.T (+ bias) for few rows of x (a decode step or a draft tree): AVX-512, OpenMP.
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

static inline void block(int mr, const float *x, long K, const float *wp, float *y, long ldy, const float *bias) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
#define STEPS(R)                                                                              \
    for (long k = 0; k < K; k++) {                                                            \
        _mm_prefetch((const char *)(wp + (k + PFD) * NR), _MM_HINT_T0);                       \
        _mm_prefetch((const char *)(wp + (k + PFD) * NR + 16), _MM_HINT_T0);                  \
        __m512 w0 = _mm512_loadu_ps(wp + k * NR), w1 = _mm512_loadu_ps(wp + k * NR + 16);     \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++) {                                \
            __m512 b = _mm512_set1_ps(x[i * K + k]);                                          \
            acc[i][0] = _mm512_fmadd_ps(b, w0, acc[i][0]);                                    \
            acc[i][1] = _mm512_fmadd_ps(b, w1, acc[i][1]);                                    \
        }                                                                                     \
    }
    /* a constant row count per case lets the compiler keep every accumulator in a register */
    switch (mr) {
        case 1: STEPS(1) break;   case 2: STEPS(2) break;   case 3: STEPS(3) break;
        case 4: STEPS(4) break;   case 5: STEPS(5) break;   case 6: STEPS(6) break;
        case 7: STEPS(7) break;   case 8: STEPS(8) break;   case 9: STEPS(9) break;
        case 10: STEPS(10) break; case 11: STEPS(11) break; default: STEPS(12) break;
    }
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
