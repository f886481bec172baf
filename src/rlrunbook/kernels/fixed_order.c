/* Fixed-order CPU kernels: every sum that reaches a logprob is added in an order written here.
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define F32 0
#define BF16 1

#if defined(__AVX512F__)
#define SEQ_ROWS 6 /* gemm_seq micro-tile: rows x 32 columns in registers */
#else
#define SEQ_ROWS 3
#endif

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

static inline v16 splat(float x) { return (v16){0} + x; }

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

static int threads_for(int64_t items, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  return items < nthreads ? (int)(items > 0 ? items : 1) : nthreads;
}

/* An fp32 copy of a [rows, cols] matrix with row stride ld (a contiguous [rows, cols] buffer). */
static float *to_f32(const void *p, int type, int64_t rows, int64_t cols, int64_t ld) {
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

/* -- gemm_nt: C[m, n] = bias[n] + sum over k of A[m, k] B[n, k] ----------------------------------------
 * float32 inputs: lanes16 order. Two bfloat16 inputs: pairs16 order, the order of the VDPBF16PS
 * instruction: in each block of 32 k, lane j adds the product at k = 2j + 1, then the one at k = 2j (each
 * product exact in float32), and the lanes are added by the lanes16 tree. On CPUs with AVX512-BF16 the
 * instruction itself computes each step; elsewhere the same two additions in float32. Other dtype pairs
 * are converted to float32 first. */

#if defined(__AVX512F__) /* a micro-tile's 16-lane accumulators must fit the vector registers (32 on AVX-512) */
#define NT_ROWS 4
#define NT_COLS 4
#else
#define NT_ROWS 2
#define NT_COLS 3
#endif
#define NT_PANEL 64 /* B rows per work item */

typedef struct {
  const void *a, *b;
  int64_t lda, ldb, K;
  int rows, cols;
} nt_args;

/* out[i] = tree16(acc[i]) for a micro-tile's accumulators (16 at once where the tile has 16) */
static inline void reduce_tile(const v16 acc[NT_ROWS * NT_COLS], float out[NT_ROWS * NT_COLS]) {
#if NT_ROWS * NT_COLS == 16
  v16 sums = tree16x16(acc);
  memcpy(out, &sums, 64);
#else
  for (int i = 0; i < NT_ROWS * NT_COLS; i++) out[i] = tree16(acc[i]);
#endif
}

static void nt_tile_f32(const nt_args *t, float out[NT_ROWS * NT_COLS]) {
  v16 acc[NT_ROWS * NT_COLS];
  const float *ar[NT_ROWS], *br[NT_COLS];
  for (int i = 0; i < NT_ROWS; i++) ar[i] = (const float *)t->a + (i < t->rows ? i : 0) * t->lda;
  for (int j = 0; j < NT_COLS; j++) br[j] = (const float *)t->b + (j < t->cols ? j : 0) * t->ldb;
  for (int i = 0; i < NT_ROWS * NT_COLS; i++) acc[i] = (v16){0};
  int64_t k = 0, K = t->K;
  for (; k + 16 <= K; k += 16) {
    v16 av[NT_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_ROWS; i++) memcpy(&av[i], ar[i] + k, 64);
    for (int j = 0; j < NT_COLS; j++) memcpy(&bv[j], br[j] + k, 64);
    for (int i = 0; i < NT_ROWS; i++)
      for (int j = 0; j < NT_COLS; j++) acc[i * NT_COLS + j] += av[i] * bv[j];
  }
  if (k < K) {
    v16 av[NT_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_ROWS; i++) av[i] = load16(ar[i], k, F32, (int)(K - k));
    for (int j = 0; j < NT_COLS; j++) bv[j] = load16(br[j], k, F32, (int)(K - k));
    for (int i = 0; i < NT_ROWS; i++)
      for (int j = 0; j < NT_COLS; j++) acc[i * NT_COLS + j] += av[i] * bv[j];
  }
  reduce_tile(acc, out);
}

/* 32 bf16 values from p (the first n of them; the rest 0) as 16 words: element 2j in the low half of word j */
static inline v16u load32h(const uint16_t *p, int n) {
  v16u w;
  if (n >= 32) {
    memcpy(&w, p, 64);
    return w;
  }
  uint16_t tmp[32] = {0};
  memcpy(tmp, p, (size_t)n * 2);
  memcpy(&w, tmp, 64);
  return w;
}

static inline v16 as_float(v16u u) {
  v16 f;
  memcpy(&f, &u, 64);
  return f;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define NT_BF16_INSTRUCTION 1
static inline v16 pair_step(v16 acc, v16u a, v16u b) {
  __m512 r = _mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)a, (__m512bh)(__m512i)b);
  return (v16)r;
}
#else
#define NT_BF16_INSTRUCTION 0
static inline v16 pair_step(v16 acc, v16u a, v16u b) {
  const v16u high = (v16u){0} + 0xffff0000u;
  acc += as_float(a & high) * as_float(b & high);
  acc += as_float(a << 16) * as_float(b << 16);
  return acc;
}
#endif

int nt_uses_bf16_instruction(void) { return NT_BF16_INSTRUCTION; }

static void nt_tile_bf16(const nt_args *t, float out[NT_ROWS * NT_COLS]) {
  v16 acc[NT_ROWS * NT_COLS];
  const uint16_t *ar[NT_ROWS], *br[NT_COLS];
  for (int i = 0; i < NT_ROWS; i++) ar[i] = (const uint16_t *)t->a + (i < t->rows ? i : 0) * t->lda;
  for (int j = 0; j < NT_COLS; j++) br[j] = (const uint16_t *)t->b + (j < t->cols ? j : 0) * t->ldb;
  for (int i = 0; i < NT_ROWS * NT_COLS; i++) acc[i] = (v16){0};
  int64_t k = 0, K = t->K;
  for (; k + 32 <= K; k += 32) {
    v16u av[NT_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_ROWS; i++) memcpy(&av[i], ar[i] + k, 64);
    for (int j = 0; j < NT_COLS; j++) memcpy(&bv[j], br[j] + k, 64);
    for (int i = 0; i < NT_ROWS; i++)
      for (int j = 0; j < NT_COLS; j++) acc[i * NT_COLS + j] = pair_step(acc[i * NT_COLS + j], av[i], bv[j]);
  }
  if (k < K) {
    v16u av[NT_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_ROWS; i++) av[i] = load32h(ar[i] + k, (int)(K - k));
    for (int j = 0; j < NT_COLS; j++) bv[j] = load32h(br[j] + k, (int)(K - k));
    for (int i = 0; i < NT_ROWS; i++)
      for (int j = 0; j < NT_COLS; j++) acc[i * NT_COLS + j] = pair_step(acc[i * NT_COLS + j], av[i], bv[j]);
  }
  reduce_tile(acc, out);
}

int gemm_nt(const void *A, int ta, int64_t lda, const void *B, int tb, int64_t ldb, const float *bias, void *C,
            int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads) {
  int pairs = ta == BF16 && tb == BF16;
  float *a32 = NULL, *b32 = NULL;
  const void *a = A, *b = B;
  int64_t la = lda, lb = ldb;
  if (!pairs && ta != F32) {
    if (!(a32 = to_f32(A, ta, M, K, lda))) return 1;
    a = a32, la = K;
  }
  if (!pairs && tb != F32) {
    if (!(b32 = to_f32(B, tb, N, K, ldb))) {
      free(a32);
      return 1;
    }
    b = b32, lb = K;
  }
  size_t esize = pairs ? 2 : 4;
  /* work items: panels of B rows x groups of A rows, enough groups to feed every thread */
  int64_t panels = (N + NT_PANEL - 1) / NT_PANEL, rowblocks = (M + NT_ROWS - 1) / NT_ROWS;
  int64_t chunks = panels >= 4 * (int64_t)nthreads ? 1 : (4 * (int64_t)nthreads + panels - 1) / panels;
  if (chunks > rowblocks) chunks = rowblocks;
  int64_t items = panels * chunks;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) {
    int64_t p = item % panels, c = item / panels;
    int64_t n0 = p * NT_PANEL, n1 = n0 + NT_PANEL < N ? n0 + NT_PANEL : N;
    int64_t m0 = rowblocks * c / chunks * NT_ROWS, m1 = rowblocks * (c + 1) / chunks * NT_ROWS;
    if (m1 > M) m1 = M;
    for (int64_t m = m0; m < m1; m += NT_ROWS)
      for (int64_t n = n0; n < n1; n += NT_COLS) {
        nt_args t = {(const char *)a + m * la * esize, (const char *)b + n * lb * esize, la, lb, K,
                     (int)(m1 - m < NT_ROWS ? m1 - m : NT_ROWS), (int)(n1 - n < NT_COLS ? n1 - n : NT_COLS)};
        float out[16];
        if (pairs) nt_tile_bf16(&t, out);
        else nt_tile_f32(&t, out);
        for (int i = 0; i < t.rows; i++) {
          float *row = out + i * NT_COLS;
          if (bias)
            for (int j = 0; j < t.cols; j++) row[j] = row[j] + bias[n + j];
          if (tc == F32 && t.cols == NT_COLS) memcpy((float *)C + (m + i) * ldc + n, row, NT_COLS * 4);
          else
            for (int j = 0; j < t.cols; j++) store1(C, (m + i) * ldc + n + j, row[j], tc);
        }
      }
  }
  free(a32);
  free(b32);
  return 0;
}

/* -- gemm_seq: C[m, n] = bias[n] + sum over k of A(m, k) B[k, n], in increasing k ----------------------------
 * A(m, k) = A[m * sam + k * sak] (sam = lda, sak = 1 for A [M, K]; sam = 1, sak = lda for A^T of a [K, M]
 * matrix), B [K, N] with row stride ldb. Vectorised over n, 32 columns per micro-tile. With two bfloat16
 * inputs and A row-major, k goes in pairs (k = 2i + 1, then 2i, per pair in increasing i: the VDPBF16PS step
 * of gemm_nt's pairs16, with lanes over n); otherwise one term at a time. */

#define SEQ_PANEL 32
#define SEQ_KCHUNK 512

typedef struct {
  const float *a; /* fp32 A, row stride lda (f32 path) */
  const uint32_t *a2; /* bf16 A as pair words, row stride lda2 (pairs path) */
  int64_t lda, lda2;
} seq_a;

/* One work item's rows [rb0, rb1) (in blocks of SEQ_ROWS) against one 32-column panel of B, k in chunks. */
static void seq_item(const seq_a *A, int pairs, const void *B, int tb, int64_t ldb, int64_t M, int64_t K, int64_t n0,
                     int64_t width, int64_t rb0, int64_t rb1, float *bp, float *store) {
  int64_t step = pairs ? 2 : 1, chunk = SEQ_KCHUNK;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    int64_t kn = K - k0 < chunk ? K - k0 : chunk, steps = (kn + step - 1) / step;
    /* the panel of B for this chunk: per step, 32 columns (fp32 values, or pair words) */
    for (int64_t i = 0; i < steps; i++) {
      v16 lo, hi;
      if (pairs) {
        int64_t k = k0 + 2 * i;
        v16u w[2];
        for (int half = 0; half < 2; half++) {
          int n = (int)(width - 16 * half);
          n = n < 0 ? 0 : n > 16 ? 16 : n;
          v16u even = (v16u){0}, odd = (v16u){0};
          if (n > 0) { /* bf16 bits as the low half of 32-bit words: load16 gives them in the high half */
            v16 e = load16(B, k * ldb + n0 + 16 * half, BF16, n);
            memcpy(&even, &e, 64);
            even >>= 16;
            if (k + 1 < K) {
              v16 o = load16(B, (k + 1) * ldb + n0 + 16 * half, BF16, n);
              memcpy(&odd, &o, 64);
              odd = odd >> 16 << 16;
            }
          }
          w[half] = even | odd;
        }
        memcpy(&lo, &w[0], 64);
        memcpy(&hi, &w[1], 64);
      } else {
        lo = load16(B, (k0 + i) * ldb + n0, tb, (int)width);
        hi = width > 16 ? load16(B, (k0 + i) * ldb + n0 + 16, tb, (int)(width - 16)) : (v16){0};
      }
      memcpy(bp + i * SEQ_PANEL, &lo, 64);
      memcpy(bp + i * SEQ_PANEL + 16, &hi, 64);
    }
    for (int64_t rb = rb0; rb < rb1; rb++) {
      int64_t m = rb * SEQ_ROWS;
      int rows = (int)(M - m < SEQ_ROWS ? M - m : SEQ_ROWS);
      float *st = store + (rb - rb0) * SEQ_ROWS * SEQ_PANEL;
      v16 acc0[SEQ_ROWS], acc1[SEQ_ROWS];
      for (int i = 0; i < SEQ_ROWS; i++) {
        memcpy(&acc0[i], st + i * SEQ_PANEL, 64);
        memcpy(&acc1[i], st + i * SEQ_PANEL + 16, 64);
      }
      if (pairs) {
        const uint32_t *ar[SEQ_ROWS];
        for (int i = 0; i < SEQ_ROWS; i++) ar[i] = A->a2 + (m + (i < rows ? i : 0)) * A->lda2 + k0 / 2;
        for (int64_t i = 0; i < steps; i++) {
          v16u b0, b1;
          memcpy(&b0, bp + i * SEQ_PANEL, 64);
          memcpy(&b1, bp + i * SEQ_PANEL + 16, 64);
          for (int r = 0; r < SEQ_ROWS; r++) {
            v16u av = (v16u){0} + ar[r][i];
            acc0[r] = pair_step(acc0[r], av, b0);
            acc1[r] = pair_step(acc1[r], av, b1);
          }
        }
      } else {
        const float *ar[SEQ_ROWS];
        for (int i = 0; i < SEQ_ROWS; i++) ar[i] = A->a + (m + (i < rows ? i : 0)) * A->lda + k0;
        for (int64_t i = 0; i < steps; i++) {
          v16 b0, b1;
          memcpy(&b0, bp + i * SEQ_PANEL, 64);
          memcpy(&b1, bp + i * SEQ_PANEL + 16, 64);
          for (int r = 0; r < SEQ_ROWS; r++) {
            v16 av = splat(ar[r][i]);
            acc0[r] += av * b0;
            acc1[r] += av * b1;
          }
        }
      }
      for (int i = 0; i < SEQ_ROWS; i++) {
        memcpy(st + i * SEQ_PANEL, &acc0[i], 64);
        memcpy(st + i * SEQ_PANEL + 16, &acc1[i], 64);
      }
    }
  }
}

int gemm_seq(const void *A, int ta, int64_t sam, int64_t sak, const void *B, int tb, int64_t ldb, const float *bias,
             void *C, int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads) {
  int pairs = ta == BF16 && tb == BF16 && sak == 1;
  seq_a a = {0};
  float *a32 = NULL;
  uint32_t *a2 = NULL;
  if (pairs) { /* A's rows as pair words, zero-padded to an even length */
    a.lda2 = (K + 1) / 2;
    a2 = calloc((size_t)(M * a.lda2 + 16), 4);
    if (!a2) return 1;
    for (int64_t m = 0; m < M; m++) memcpy(a2 + m * a.lda2, (const uint16_t *)A + m * sam, (size_t)K * 2);
    a.a2 = a2;
  } else if (ta == F32 && sak == 1) {
    a.a = A, a.lda = sam;
  } else {
    a32 = malloc((size_t)(M * K + 16) * sizeof(float));
    if (!a32) return 1;
    if (sak == 1) {
      for (int64_t m = 0; m < M; m++) {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
          v16 x = load16(A, m * sam + k, ta, 16);
          memcpy(a32 + m * K + k, &x, 64);
        }
        for (; k < K; k++) a32[m * K + k] = load1(A, m * sam + k, ta);
      }
    } else {
      for (int64_t k = 0; k < K; k++)
        for (int64_t m = 0; m < M; m++) a32[m * K + k] = load1(A, m * sam + k * sak, ta);
    }
    a.a = a32, a.lda = K;
  }
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL;
  int64_t rowblocks = (M + SEQ_ROWS - 1) / SEQ_ROWS;
  /* work items: column panels x groups of row blocks, so that few wide panels still split across threads */
  int64_t groups = nthreads > 1 && panels < 4 * nthreads ? (rowblocks < 4 * nthreads ? rowblocks : 4 * nthreads) : 1;
  int64_t items = panels * groups;
  int failed = 0;
  int64_t most_blocks = (rowblocks + groups - 1) / groups;
#pragma omp parallel num_threads(threads_for(items, nthreads))
  {
    /* per thread: one panel of B and the accumulators of one item's rows */
    float *bp = malloc((size_t)SEQ_KCHUNK * SEQ_PANEL * sizeof(float));
    size_t store_floats = (size_t)(most_blocks * SEQ_ROWS * SEQ_PANEL + 16);
    float *store = malloc(store_floats * sizeof(float));
    if (!bp || !store) failed = 1;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < items; item++) {
    int64_t p = item % panels, g = item / panels;
    int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
    int64_t rb0 = rowblocks * g / groups, rb1 = rowblocks * (g + 1) / groups;
    if (bp && store) {
      memset(store, 0, (size_t)((rb1 - rb0) * SEQ_ROWS * SEQ_PANEL) * sizeof(float));
      seq_item(&a, pairs, B, tb, ldb, M, K, n0, width, rb0, rb1, bp, store);
      for (int64_t rb = rb0; rb < rb1; rb++) {
        int64_t m = rb * SEQ_ROWS;
        int rows = (int)(M - m < SEQ_ROWS ? M - m : SEQ_ROWS);
        const float *st = store + (rb - rb0) * SEQ_ROWS * SEQ_PANEL;
        for (int i = 0; i < rows; i++)
          for (int64_t j = 0; j < width; j++) {
            float v = st[i * SEQ_PANEL + j];
            if (bias) v = v + bias[n0 + j];
            store1(C, (m + i) * ldc + n0 + j, v, tc);
          }
      }
    }
  }
    free(bp);
    free(store);
  }
  free(a32);
  free(a2);
  return failed;
}

/* -- row reductions --------------------------------------------------------------------------------- */

/* out[m] = lanes16 sum over e of X[m, e]^2 */
void row_sumsq(const void *X, int tx, int64_t ldx, int64_t M, int64_t E, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(M, nthreads))
  for (int64_t m = 0; m < M; m++) {
    v16 acc = {0};
    for (int64_t e = 0; e < E; e += 16) {
      v16 x = load16(X, m * ldx + e, tx, (int)(E - e));
      acc += x * x;
    }
    out[m] = tree16(acc);
  }
}

/* out[m] = log sum_v exp(X[m, v]): max, then lanes64 sum of exp(x - max), then max + log(sum).
 * A row of -inf gives -inf; a row with a NaN gives NaN. */
void row_logsumexp(const float *X, int64_t ldx, int64_t M, int64_t V, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(M, nthreads))
  for (int64_t m = 0; m < M; m++) {
    const float *x = X + m * ldx;
    float mx = -INFINITY;
    int nan = 0;
    for (int64_t v = 0; v < V; v++) {
      if (x[v] != x[v]) nan = 1;
      else if (x[v] > mx) mx = x[v];
    }
    if (nan) {
      out[m] = NAN;
      continue;
    }
    if (mx == -INFINITY || mx == INFINITY) {
      out[m] = mx;
      continue;
    }
    v16 acc[4] = {{0}, {0}, {0}, {0}}; /* lanes64: lane j takes v = j (mod 64) */
    for (int64_t v = 0; v < V; v += 16) {
      int n = (int)(V - v < 16 ? V - v : 16);
      v16 xv = load16(x, v, F32, n);
      v16 e = fexp16(xv - mx);
      if (n < 16) {
        v16i keep;
        for (int j = 0; j < 16; j++) keep[j] = j < n ? -1 : 0;
        e = select16(keep, e, splat(0.0f));
      }
      acc[(v >> 4) & 3] += e;
    }
    out[m] = mx + logf(tree16((acc[0] + acc[2]) + (acc[1] + acc[3])));
  }
}

/* -- elementwise ------------------------------------------------------------------------------------ */

void exp_f32(const float *x, float *y, int64_t n, int nthreads) {
  int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads_for(blocks / 256 + 1, nthreads))
  for (int64_t b = 0; b < blocks; b++) {
    int k = (int)(n - b * 16 < 16 ? n - b * 16 : 16);
    store16(y, b * 16, fexp16(load16(x, b * 16, F32, k)), F32, k);
  }
}

/* y = 1 / (1 + exp(-x)) */
void sigmoid_f32(const float *x, float *y, int64_t n, int nthreads) {
  int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads_for(blocks / 256 + 1, nthreads))
  for (int64_t b = 0; b < blocks; b++) {
    int k = (int)(n - b * 16 < 16 ? n - b * 16 : 16);
    v16 v = load16(x, b * 16, F32, k);
    store16(y, b * 16, 1.0f / (1.0f + fexp16(-v)), F32, k);
  }
}

/* cos and sin of (position * inv_freq[i]) rounded to float32 as the angle (as transformers computes it),
 * evaluated in double by libm and rounded once: out [P, F]. */
void rope_table(const int64_t *positions, int64_t P, const float *inv_freq, int64_t F, float *cos_out,
                float *sin_out) {
  for (int64_t p = 0; p < P; p++)
    for (int64_t i = 0; i < F; i++) {
      float angle = (float)positions[p] * inv_freq[i];
      cos_out[p * F + i] = (float)cos((double)angle);
      sin_out[p * F + i] = (float)sin((double)angle);
    }
}

/* -- attention -------------------------------------------------------------------------------------------
 * q [R, T, H, D], k and v [R, S, Hkv, D] (row strides given, inner dims contiguous), query positions
 * [R, T] (-1: a padding query), key positions and validity [R or 1, S]. Query (r, t, h) reads the keys s
 * of row r with valid[s] and kpos[s] <= qpos[t], in increasing s (the caller lays a query's keys out in
 * position order), through key/value head h / (H / Hkv).
 *   score_s = scale * (sequential sum over d of q[d] k_s[d])
 *   m = max_s score_s;  p_s = exp(score_s - m);  l = lanes16 sum of p_s over the allowed keys in order
 *   o[d] = (sequential sum over allowed s of p_s v_s[d]) / l;  lse = m + log(l)
 * A query with no key gets zeros and lse = -inf. Work is split by (row, key/value head), whole. */

typedef struct {
  int64_t R, T, S, H, Hkv, D;
  int64_t q_row, q_t, k_row, k_s, pos_rows;
  int tq, tk;
  float scale;
} attn_shape;

/* per (row, kv head): keys transposed [D, S16] and values [S, D] in fp32 */
static void load_kv(const attn_shape *sh, const void *k, const void *v, int64_t r, int64_t kvh, float *kt,
                    float *vs, int64_t S16) {
  for (int64_t d = 0; d < sh->D; d++)
    for (int64_t s = sh->S; s < S16; s++) kt[d * S16 + s] = 0.0f;
  for (int64_t s = 0; s < sh->S; s++) {
    int64_t base = r * sh->k_row + s * sh->k_s + kvh * sh->D;
    for (int64_t d = 0; d < sh->D; d++) {
      kt[d * S16 + s] = load1(k, base + d, sh->tk);
      vs[s * sh->D + d] = load1(v, base + d, sh->tk);
    }
  }
}

/* the allowed keys' indices in increasing s, then their scores (sequential over d, 16 keys per vector, for
 * the keys up to the last allowed one); returns how many keys are allowed. */
static int64_t query_scores(const attn_shape *sh, const float *qv, const float *kt, int64_t S16, float *sc,
                            const int64_t *kpos, const uint8_t *kvalid, int64_t qpos, int64_t *allowed) {
  int64_t count = 0;
  for (int64_t s = 0; s < sh->S; s++)
    if (kvalid[s] && kpos[s] <= qpos) allowed[count++] = s;
  int64_t end = count ? allowed[count - 1] + 1 : 0;
  for (int64_t s = 0; s < end; s += 16) {
    v16 acc = {0};
    for (int64_t d = 0; d < sh->D; d++) {
      v16 kv;
      memcpy(&kv, kt + d * S16 + s, 64);
      acc += splat(qv[d]) * kv;
    }
    acc = acc * sh->scale;
    memcpy(sc + s, &acc, 64);
  }
  return count;
}

/* Query (r, t, h) at qbase: its values into qv, its allowed keys and their scores; 0 for a padding query. */
static int64_t prepare_query(const attn_shape *sh, const void *q, int64_t qbase, int64_t qp, const float *kt,
                             int64_t S16, float *qv, float *sc, const int64_t *kpos, const uint8_t *kvalid,
                             int64_t *allowed) {
  if (qp < 0) return 0;
  for (int64_t d0 = 0; d0 < sh->D; d0 += 16) {
    v16 x = load16(q, qbase + d0, sh->tq, (int)(sh->D - d0 < 16 ? sh->D - d0 : 16));
    memcpy(qv + d0, &x, 64);
  }
  return query_scores(sh, qv, kt, S16, sc, kpos, kvalid, qp, allowed);
}

/* p_i = exp(score_{allowed i} - shift) into p (zero-padded to a multiple of 16) */
static void allowed_exp(const float *sc, const int64_t *allowed, int64_t count, float shift, float *p) {
  for (int64_t i = 0; i < count; i += 16) {
    int n = (int)(count - i < 16 ? count - i : 16);
    v16 x = splat(shift);
    for (int j = 0; j < n; j++) x[j] = sc[allowed[i + j]];
    v16 e = fexp16(x - shift);
    for (int j = 0; j < 16; j++) p[i + j] = j < n ? e[j] : 0.0f;
  }
}

int attention_fwd(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                  const uint8_t *kvalid, void *out, float *lse, int64_t R, int64_t T, int64_t S, int64_t H,
                  int64_t Hkv, int64_t D, int64_t q_row, int64_t k_row, int64_t pos_rows, int tq, int tk,
                  float scale, int nthreads) {
  attn_shape sh = {R, T, S, H, Hkv, D, q_row, H * D, k_row, Hkv * D, pos_rows, tq, tk, scale};
  int64_t G = H / Hkv, S16 = (S + 15) / 16 * 16, items = R * Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) {
    int64_t r = item / Hkv, kvh = item % Hkv;
    float *kt = malloc((size_t)(D * S16) * 4), *vs = malloc((size_t)(S16 * D + 16) * 4);
    float *sc = malloc((size_t)(S16 + 16) * 4), *p = malloc((size_t)(S16 + 16) * 4);
    float *qv = malloc((size_t)(D + 16) * 4);
    int64_t *allowed = malloc((size_t)(S + 1) * sizeof(int64_t));
    if (!kt || !vs || !sc || !p || !qv || !allowed) {
      failed = 1;
    } else {
      load_kv(&sh, k, v, r, kvh, kt, vs, S16);
      const int64_t *kp = kpos + (pos_rows > 1 ? r * S : 0);
      const uint8_t *kval = kvalid + (pos_rows > 1 ? r * S : 0);
      for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
          int64_t h = kvh * G + g, qbase = r * q_row + t * sh.q_t + h * D;
          int64_t count = prepare_query(&sh, q, qbase, qpos[r * T + t], kt, S16, qv, sc, kp, kval, allowed);
          if (count == 0) {
            for (int64_t d = 0; d < D; d++) store1(out, qbase + d, 0.0f, tq);
            lse[(r * T + t) * H + h] = -INFINITY;
            continue;
          }
          float mx = -INFINITY;
          for (int64_t i = 0; i < count; i++)
            if (sc[allowed[i]] > mx || sc[allowed[i]] != sc[allowed[i]]) mx = sc[allowed[i]];
          allowed_exp(sc, allowed, count, mx, p);
          v16 lacc = {0};
          for (int64_t i = 0; i < count; i += 16) {
            v16 pv;
            memcpy(&pv, p + i, 64);
            lacc += pv;
          }
          float l = tree16(lacc);
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            int n = (int)(D - d0 < 16 ? D - d0 : 16);
            v16 acc = {0};
            for (int64_t i = 0; i < count; i++) acc += splat(p[i]) * load16(vs, allowed[i] * D + d0, F32, n);
            store16(out, qbase + d0, acc / l, tq, n);
          }
          lse[(r * T + t) * H + h] = mx + logf(l);
        }
    }
    free(kt);
    free(vs);
    free(sc);
    free(p);
    free(qv);
    free(allowed);
  }
  return failed;
}

/* Gradients of attention_fwd given dout (same layout as out) and the forward's out and lse:
 *   P_i = exp(score_i - lse);  Dq = sequential sum over d of dout[d] out[d]
 *   dP_i = sequential sum over d of dout[d] v_i[d];  dS_i = P_i (dP_i - Dq) scale
 *   dq[d] = sequential sum over allowed i of dS_i k_i[d]
 *   dk_i += dS_i q, dv_i += P_i dout, over queries t then heads g in increasing order.
 * dq has q's layout; dk and dv are contiguous [R, S, Hkv, D] in k's storage type. */
int attention_bwd(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                  const uint8_t *kvalid, const void *out, const void *dout, const float *lse, void *dq, void *dk,
                  void *dv, int64_t R, int64_t T, int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t q_row,
                  int64_t k_row, int64_t pos_rows, int tq, int tk, float scale, int nthreads) {
  attn_shape sh = {R, T, S, H, Hkv, D, q_row, H * D, k_row, Hkv * D, pos_rows, tq, tk, scale};
  int64_t G = H / Hkv, S16 = (S + 15) / 16 * 16, items = R * Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) {
    int64_t r = item / Hkv, kvh = item % Hkv;
    float *kt = malloc((size_t)(D * S16) * 4), *vs = malloc((size_t)(S16 * D + 16) * 4);
    float *vt = malloc((size_t)(D * S16) * 4), *ks = malloc((size_t)(S16 * D + 16) * 4);
    float *sc = malloc((size_t)(S16 + 16) * 4), *p = malloc((size_t)(S16 + 16) * 4);
    float *dp = malloc((size_t)(S16 + 16) * 4);
    float *qv = malloc((size_t)(D + 16) * 4), *dov = malloc((size_t)(D + 16) * 4);
    float *dkacc = calloc((size_t)(S * D + 16), 4), *dvacc = calloc((size_t)(S * D + 16), 4);
    int64_t *allowed = malloc((size_t)(S + 1) * sizeof(int64_t));
    if (!kt || !vs || !vt || !ks || !sc || !p || !dp || !qv || !dov || !dkacc || !dvacc || !allowed) {
      failed = 1;
    } else {
      load_kv(&sh, k, v, r, kvh, kt, vs, S16);
      for (int64_t d = 0; d < D; d++)
        for (int64_t s = 0; s < S16; s++) {
          vt[d * S16 + s] = s < S ? vs[s * D + d] : 0.0f;
          if (s < S) ks[s * D + d] = kt[d * S16 + s];
        }
      const int64_t *kp = kpos + (pos_rows > 1 ? r * S : 0);
      const uint8_t *kval = kvalid + (pos_rows > 1 ? r * S : 0);
      for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
          int64_t h = kvh * G + g, qbase = r * q_row + t * sh.q_t + h * D;
          int64_t count = prepare_query(&sh, q, qbase, qpos[r * T + t], kt, S16, qv, sc, kp, kval, allowed);
          if (count == 0) {
            for (int64_t d = 0; d < D; d++) store1(dq, qbase + d, 0.0f, tq);
            continue;
          }
          float row_lse = lse[(r * T + t) * H + h];
          allowed_exp(sc, allowed, count, row_lse, p);
          float dsum = 0.0f;
          for (int64_t d = 0; d < D; d++) {
            dov[d] = load1(dout, qbase + d, tq);
            dsum += dov[d] * load1(out, qbase + d, tq);
          }
          for (int64_t s = 0; s < allowed[count - 1] + 1; s += 16) { /* dP, sequential over d */
            v16 acc = {0};
            for (int64_t d = 0; d < D; d++) {
              v16 vv;
              memcpy(&vv, vt + d * S16 + s, 64);
              acc += splat(dov[d]) * vv;
            }
            memcpy(dp + s, &acc, 64);
          }
          for (int64_t i = 0; i < count; i++) dp[allowed[i]] = p[i] * (dp[allowed[i]] - dsum) * scale;
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            int n = (int)(D - d0 < 16 ? D - d0 : 16);
            v16 acc = {0};
            for (int64_t i = 0; i < count; i++) acc += splat(dp[allowed[i]]) * load16(ks, allowed[i] * D + d0, F32, n);
            store16(dq, qbase + d0, acc, tq, n);
          }
          for (int64_t i = 0; i < count; i++) {
            int64_t s = allowed[i];
            v16 ds = splat(dp[s]), pi = splat(p[i]);
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
              int n = (int)(D - d0 < 16 ? D - d0 : 16);
              v16 dk = load16(dkacc, s * D + d0, F32, n) + ds * load16(qv, d0, F32, n);
              v16 dv = load16(dvacc, s * D + d0, F32, n) + pi * load16(dov, d0, F32, n);
              store16(dkacc, s * D + d0, dk, F32, n);
              store16(dvacc, s * D + d0, dv, F32, n);
            }
          }
        }
      for (int64_t s = 0; s < S; s++) {
        int64_t base = ((r * S + s) * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; d++) {
          store1(dk, base + d, dkacc[s * D + d], tk);
          store1(dv, base + d, dvacc[s * D + d], tk);
        }
      }
    }
    free(kt);
    free(vs);
    free(vt);
    free(ks);
    free(sc);
    free(p);
    free(dp);
    free(qv);
    free(dov);
    free(dkacc);
    free(dvacc);
    free(allowed);
  }
  return failed;
}
