/* Fixed-order CPU kernels: every sum that reaches a logprob is added in an order written here.
 * This header holds the contract, the orders and what every kernel file shares (types, loads and
 * stores, the lanes16 tree, exp); products.c, rows.c and attention.c hold the kernels.
 *
 * The contract (rlrunbook/kernels/__init__.py states it for users): the value of an output element
 * depends on the inputs it is a function of and on nothing else. No sum is split or reordered by the
 * number of rows, the thread count, the vector width of the CPU or where an element sits in its
 * tensor: threads only ever take whole output elements, vector code computes 16 lanes whatever the
 * hardware's register width (the compiler lowers a 16-lane vector to 1, 2 or 4 registers), and a
 * loop's last partial vector is computed as a whole vector of zero-padded inputs, never by a scalar
 * tail loop with other arithmetic.
 *
 * The orders:
 *   lanes16 (gemm_nt, row_sumsq, attention's normaliser): lane j in 0..15 accumulates the terms at
 *     indices i = j (mod 16) in increasing i; the lanes are then added by a fixed tree:
 *     s_j = l_j + l_{j+8} (j < 8), t_j = s_j + s_{j+4} (j < 4), u_j = t_j + t_{j+2} (j < 2), u_0 + u_1.
 *   lanes64 (row_logsumexp, over a vocabulary): 64 lanes as above, mod 64; lane j is added to lane j + 32,
 *     then j to j + 16 (j < 16), then the lanes16 tree.
 *   sequential (gemm_seq, attention's scores, weighted values and gradients): one accumulator, the terms
 *     in increasing index.
 * A product term is accumulated with a fused multiply-add where the compiler targets a CPU that has one
 * (-ffp-contract=fast with -march=native), else a multiply then an add: fixed per machine. For bf16 inputs
 * both give the same bits, since the product of two bf16 numbers is exact in float32.
 *
 * exp is computed here (fexp16), not by libm or SIMD libraries whose vector and scalar versions may
 * round differently; log, cos and sin are called only from scalar code, once per output element.
 * Storage types: float32 (code 0) and bfloat16 (code 1, converted exactly to float32 on load; results
 * rounded to nearest even on store).
 */
#ifndef RLRUNBOOK_FIXED_ORDER_H
#define RLRUNBOOK_FIXED_ORDER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define F32 0
#define BF16 1

#if defined(__AVX512F__)
#define SEQ_ROWS 12 /* gemm_seq micro-tile: rows x 32 columns in registers (24 of the 32) */
#define SEQ_FEW_ROWS 8 /* the tile for a few rows where 12-row tiles would compute rows in vain (16 of 24 at 16) */
#else
#define SEQ_ROWS 3
#define SEQ_FEW_ROWS 3
#endif

/* Where gemm_seq_to hands each row of its sums (products.c): columns n0 .. n0 + width of row m, in float32. */
typedef void (*seq_store)(const void *context, int64_t m, int64_t n0, float *row, int64_t width);
int gemm_seq_to(const void *A, int ta, int64_t sam, int64_t sak, const void *B, int tb, int64_t ldb, int64_t M,
                int64_t N, int64_t K, seq_store store_row, const void *context, int nthreads);

/* -- loads, stores, conversions ------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float load1(const void *p, int64_t i, int type) {
  return type == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, int type) {
  if (type == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
  else ((float *)p)[i] = v;
}

/* 16 values from p + i; only the first n (1..16) are read, the rest are 0. */
static inline v16 load16(const void *p, int64_t i, int type, int n) {
  if (n >= 16) {
    if (type == BF16) {
      v16h h;
      memcpy(&h, (const uint16_t *)p + i, sizeof h);
      v16u u = __builtin_convertvector(h, v16u) << 16;
      v16 f;
      memcpy(&f, &u, sizeof f);
      return f;
    }
    v16 f;
    memcpy(&f, (const float *)p + i, sizeof f);
    return f;
  }
  v16 f = {0};
  for (int j = 0; j < n; j++) f[j] = load1(p, i + j, type);
  return f;
}

/* bf16 bits (round to nearest even; NaN stays a quiet NaN) of 16 floats, in the low halves of 16 words */
static inline v16u to_bf16_bits(v16 v) {
  v16u u;
  memcpy(&u, &v, 64);
  v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  v16u nan = (u >> 16) | 0x40u;
  v16i is_nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
  return (rounded & (v16u)~is_nan) | (nan & (v16u)is_nan);
}

static inline void store16(void *p, int64_t i, v16 v, int type, int n) {
  if (n >= 16) {
    if (type == BF16) {
      v16h h = __builtin_convertvector(to_bf16_bits(v), v16h);
      memcpy((uint16_t *)p + i, &h, 32);
    } else {
      memcpy((float *)p + i, &v, 64);
    }
    return;
  }
  for (int j = 0; j < n; j++) store1(p, i + j, v[j], type);
}

static inline float tree16(v16 a) {
  float s[8], t[4], u[2];
  for (int j = 0; j < 8; j++) s[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; j++) t[j] = s[j] + s[j + 4];
  for (int j = 0; j < 2; j++) u[j] = t[j] + t[j + 2];
  return u[0] + u[1];
}

/* x in all 16 lanes. Written as a broadcast, not as (v16){0} + x: without -ffast-math that is an addition of +0 per
 * call (it turns -0 into +0), a scalar add and a register broadcast that took two of the vector ports from the
 * multiply-adds of gemm_seq's inner loop on Intel cores (about 60% of MKL's rate there); a broadcast from memory is
 * a load. */
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* Keeps a loaded vector in a register for its several uses: without it GCC folds the load into each use's
 * multiply-add, and a 4 x 4 tile of gemm_nt issued 20-21 loads per 16 multiply-adds (bound by the load ports, not
 * the FMA units); with it, 8. Values are unchanged. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif
/* v = the 64 bytes at p, held in a register for its uses (IN_REGISTER) */
#define LOAD_HELD(v, p)      \
  do {                       \
    memcpy(&(v), (p), 64);   \
    IN_REGISTER(v);          \
  } while (0)

/* a + b * c in each lane: one fused multiply-add where the target has a fast one, else a multiply, then an add (the
 * choice -ffp-contract=fast makes for a product term, here not left to where the compiler finds the pattern). */
static inline v16 fma16(v16 b, v16 c, v16 a) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)b, (__m512)c, (__m512)a);
#elif defined(__FMA__)
  v16 r;
  __m256 lo = _mm256_fmadd_ps(_mm256_loadu_ps((float *)&b), _mm256_loadu_ps((float *)&c), _mm256_loadu_ps((float *)&a));
  __m256 hi = _mm256_fmadd_ps(_mm256_loadu_ps((float *)&b + 8), _mm256_loadu_ps((float *)&c + 8),
                              _mm256_loadu_ps((float *)&a + 8));
  _mm256_storeu_ps((float *)&r, lo);
  _mm256_storeu_ps((float *)&r + 8, hi);
  return r;
#elif defined(__FP_FAST_FMAF)
  v16 r;
  for (int j = 0; j < 16; j++) r[j] = __builtin_fmaf(b[j], c[j], a[j]);
  return r;
#else
  return a + b * c;
#endif
}

static inline v16 select16(v16i mask, v16 a, v16 b) {
  v16i ai, bi;
  memcpy(&ai, &a, 64);
  memcpy(&bi, &b, 64);
  v16i r = (ai & mask) | (bi & ~mask);
  v16 out;
  memcpy(&out, &r, 64);
  return out;
}

/* exp(x) for 16 lanes: x = n ln2 + r (Cody-Waite), a degree-6 polynomial in r, scaled by 2^n in two steps
 * so results down to the subnormal range are right. About 1 ulp; exp(-inf) = 0, exp(NaN) = NaN. */
static inline v16 fexp16(v16 x) {
  const float hi = 88.7228390f, lo = -103.972084f;
  v16i overflow = x > hi, underflow = x < lo;
  v16 xc = select16(x > hi, splat(hi), select16(x < lo, splat(lo), x));
  v16 t = xc * 1.44269504088896341f + 12582912.0f; /* round to nearest integer by the 1.5 * 2^23 trick */
  v16 n = t - 12582912.0f;
  v16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  v16i ni = __builtin_convertvector(n, v16i);
  v16i n1 = ni >> 1, n2 = ni - (ni >> 1);
  v16i b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  v16 s1, s2;
  memcpy(&s1, &b1, 64);
  memcpy(&s2, &b2, 64);
  v16 y = p * s1 * s2;
  y = select16(overflow, splat(INFINITY), y);
  return select16(underflow, splat(0.0f), y); /* NaN compares false with both bounds and stays NaN */
}

/* The largest of x[0 .. n) (a max is exact: any order finds it), and in *any_nan whether one of them is NaN (the
 * largest then means nothing). */
static inline float vector_max(const float *x, int64_t n, int *any_nan) {
  v16 m = splat(-INFINITY);
  v16i nan = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 v;
    memcpy(&v, x + i, 64);
    nan |= (v16i)(v != v);
    m = select16((v16i)(v > m), v, m);
  }
  float mx = -INFINITY;
  int found = 0;
  for (int j = 0; j < 16; j++) {
    found |= nan[j] != 0;
    mx = m[j] > mx ? m[j] : mx;
  }
  for (; i < n; i++) {
    found |= x[i] != x[i];
    mx = x[i] > mx ? x[i] : mx;
  }
  *any_nan = found;
  return mx;
}

static inline int threads_for(int64_t items, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  return items < nthreads ? (int)(items > 0 ? items : 1) : nthreads;
}

/* An fp32 copy of a [rows, cols] matrix with row stride ld (a contiguous [rows, cols] buffer). */
static inline float *to_f32(const void *p, int type, int64_t rows, int64_t cols, int64_t ld) {
  float *out = malloc((size_t)(rows * cols + 16) * sizeof(float));
  if (!out) return NULL;
  for (int64_t i = 0; i < rows; i++) {
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
      v16 x = load16(p, i * ld + j, type, 16);
      memcpy(out + i * cols + j, &x, 64);
    }
    for (; j < cols; j++) out[i * cols + j] = load1(p, i * ld + j, type);
  }
  return out;
}

/* The lanes16 trees of 16 accumulators at once: out[i] = tree16(acc[i]), each the same additions as tree16. */
static inline v16 tree16x16(const v16 acc[16]) {
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 s[8], t[4], u[2];
  for (int i = 0; i < 8; i++)  /* [s of acc 2i | s of acc 2i+1] */
    s[i] = __builtin_shuffle(acc[2 * i], acc[2 * i + 1], lo8) + __builtin_shuffle(acc[2 * i], acc[2 * i + 1], hi8);
  for (int i = 0; i < 4; i++)  /* [t of acc 4i .. 4i+3] */
    t[i] = __builtin_shuffle(s[2 * i], s[2 * i + 1], lo4) + __builtin_shuffle(s[2 * i], s[2 * i + 1], hi4);
  for (int i = 0; i < 2; i++)  /* [u of acc 8i .. 8i+7] */
    u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo2) + __builtin_shuffle(t[2 * i], t[2 * i + 1], hi2);
  return __builtin_shuffle(u[0], u[1], lo1) + __builtin_shuffle(u[0], u[1], hi1);
}

#endif /* RLRUNBOOK_FIXED_ORDER_H */
