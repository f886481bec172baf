/* Fused kernels for passes that record no gradient (a decode step, scoring): each replaces a chain of the
 * fixed-order operations the trainer differentiates (rlrunbook/engines/decoder.py) with one call, and gives
 * every output element the bits that chain gives it. The rotation's gradient is here too: the trainer's pass
 * takes the rotation and its gradient from rotary and rotary_grad (kernels/ops.py), the chain's bits both ways.
 *
 * That holds by construction: every sum is computed by the same kernel as in the chain (row_sumsq, gemm_nt,
 * gemm_seq, sigmoid_row, attention_fwd are called, not rewritten), and the elementwise steps between them
 * round where the chain's separate operations round (to the storage type after each step, float32 inside
 * it). This file is compiled without contracting a multiply and an add into one fused multiply-add (the
 * chain runs them as two operations, each rounded); the sums it calls keep their own files' flags.
 */
#include "fixed_order.h"

#ifdef __clang__
#define NO_CONTRACT
#define CONTRACT_OFF _Pragma("clang fp contract(off)")
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define CONTRACT_OFF
#endif

int gemm_nt(const void *A, int ta, int64_t lda, const void *B, int tb, int64_t ldb, const float *bias, void *C,
            int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads);
int gemm_seq(const void *A, int ta, int64_t sam, int64_t sak, const void *B, int tb, int64_t ldb, const float *bias,
             void *C, int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads);
void row_sumsq(const void *X, int tx, int64_t ldx, int64_t M, int64_t E, float *out, int nthreads);
void sigmoid_row(const float *x, float *y, int64_t n);
int attention_fwd(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                  const uint8_t *kvalid, void *out, float *lse, int64_t R, int64_t T, int64_t S, int64_t H,
                  int64_t Hkv, int64_t D, int64_t q_row, int64_t k_row, int64_t pos_rows, int tq, int tk,
                  float scale, int nthreads);
int attention_fwd_parts(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                        const uint8_t *kvalid, void *out, float *lse, int64_t R, int64_t S, int64_t H, int64_t Hkv,
                        int64_t D, int64_t q_row, int64_t k_row, int tq, int tk, float scale, const int64_t *order,
                        const int64_t *starts, const int64_t *reload, int64_t parts, int nthreads);

int gemm_nt_coded(const float *A, int64_t lda, int kind, const uint8_t *codes, const float *scales,
                  const float *offsets, const float *bias, void *C, int tc, int64_t ldc, int64_t M, int64_t N,
                  int64_t K, int nthreads);

#define SMALL_K 64 /* as rlrunbook/kernels/ops.py: products over at most this many terms are sequential */

/* A base weight's coded form (products.c: gemm_nt_coded), or kind 0: none */
typedef struct {
  int64_t kind;
  const uint8_t *codes;
  const float *scales, *offsets;
} coded_form;

static inline size_t esize(int type) { return type == BF16 ? 2 : 4; }

/* x rounded to storage type t (float32: unchanged) */
static inline float rounded(float x, int t) { return t == BF16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* rounded() in each of 16 lanes */
static inline v16 rounded16(v16 x, int t) {
  if (t != BF16) return x;
  v16u bits = to_bf16_bits(x) << 16;
  v16 f;
  memcpy(&f, &bits, 64);
  return f;
}

/* ops.product: C = A @ B^T (+ bias), A [M, K], B [N, K]; lanes16/pairs16 over k, or sequential for K <= 64
 * (over B transposed, as ops.product passes it). */
static int product(const void *A, int ta, int64_t lda, const void *B, int tb, int64_t ldb, const float *bias,
                   void *C, int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads) {
  if (K > SMALL_K) return gemm_nt(A, ta, lda, B, tb, ldb, bias, C, tc, ldc, M, N, K, nthreads);
  size_t e = esize(tb);
  char *bt = malloc((size_t)(N * K + 1) * e);
  if (!bt) return 1;
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) memcpy(bt + (k * N + n) * e, (const char *)B + (n * ldb + k) * e, e);
  int status = gemm_seq(A, ta, lda, 1, bt, tb, N, bias, C, tc, ldc, M, N, K, nthreads);
  free(bt);
  return status;
}

/* Products of at most this many rows read a base weight from its coded form: a few rows (a decode step's) compute
 * little per weight, so the weight's bytes bound them; more rows reuse each panel of B across their rows (as
 * rlrunbook/kernels/coded_weights.py: FEW_ROWS). */
#define CODED_MAX_ROWS 64

/* product() of a base weight B, read from its coded form where it has one and the product has few rows (the same
 * values, so the same bits: a float32 product over more than SMALL_K terms) */
static int base_product(const void *A, int ta, int64_t lda, const void *B, int tb, int64_t ldb,
                        const coded_form *coded, const float *bias, void *C, int tc, int64_t ldc, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
  if (coded && coded->kind && M <= CODED_MAX_ROWS && K > SMALL_K && ta == F32 && tb == F32)
    return gemm_nt_coded(A, lda, (int)coded->kind, coded->codes, coded->scales, coded->offsets, bias, C, tc, ldc, M, N,
                         K, nthreads);
  return product(A, ta, lda, B, tb, ldb, bias, C, tc, ldc, M, N, K, nthreads);
}

/* -- RMSNorm ------------------------------------------------------------------------------------------ */

/* Y[m, e] = w[e] * round(x[m, e] * 1 / sqrt(sumsq[m] / E + eps)), rounded to the storage type */
NO_CONTRACT static void scale_rows(const void *X, int64_t ldx, int64_t M, int64_t E, const void *W, float eps,
                                   const float *sumsq, void *Y, int64_t ldy, int t, int nthreads) {
  CONTRACT_OFF
#pragma omp parallel for schedule(static) num_threads(threads_for(M, nthreads))
  for (int64_t m = 0; m < M; m++) {
    float mean = sumsq[m] / (float)E;
    float r = 1.0f / sqrtf(mean + eps);
    for (int64_t e = 0; e < E; e++) {
      float y = rounded(load1(X, m * ldx + e, t) * r, t);
      store1(Y, m * ldy + e, load1(W, e, t) * y, t);
    }
  }
}

/* RMSNorm of the rows of X [M, E] with weight W [E] (one storage type t for all): the decoder's
 * fixed-numerics _norm. */
int rms_norm(const void *X, int64_t ldx, int64_t M, int64_t E, const void *W, float eps, void *Y, int64_t ldy,
             int t, int nthreads) {
  float *sumsq = malloc((size_t)(M + 1) * sizeof(float));
  if (!sumsq) return 1;
  row_sumsq(X, t, ldx, M, E, sumsq, nthreads);
  scale_rows(X, ldx, M, E, W, eps, sumsq, Y, ldy, t, nthreads);
  free(sumsq);
  return 0;
}

NO_CONTRACT static void add_rows(const void *H, const void *D, void *S, int64_t n, int t) {
  CONTRACT_OFF
  for (int64_t i = 0; i < n; i++) store1(S, i, load1(H, i, t) + load1(D, i, t), t);
}

/* S = H + D (the residual stream, contiguous [M, E]), then Y = RMSNorm(S) with weight W. */
int add_rms_norm(const void *H, const void *D, void *S, int64_t M, int64_t E, const void *W, float eps, void *Y,
                 int t, int nthreads) {
  add_rows(H, D, S, M * E, t);
  return rms_norm(S, E, M, E, W, eps, Y, E, t, nthreads);
}

/* -- rotary positions ------------------------------------------------------------------------------- */

/* In place on each of the first `heads` heads (size Dh) of the N rows of X (row stride ld), cos and sin [N, Dh] in
 * the same type t: forward, x = round(round(x * cos) + round(rotate_half(x) * sin)); backward (X holds the output's
 * gradient g), the gradient autograd gives through that chain: round(round(g * cos) + r), where r is
 * round(g[i + half] * sin[i + half]) for i < half and -round(g[i - half] * sin[i - half]) after (rotate_half's
 * transpose applied to round(g * sin)), the two terms added as autograd adds a tensor's two uses. */
NO_CONTRACT static int rotate_rows(void *X, int64_t ld, int64_t N, int64_t heads, int64_t Dh, const void *cos_,
                                   const void *sin_, int t, int backward, int nthreads) {
  CONTRACT_OFF
  int64_t half = Dh / 2;
  int failed = 0;
#pragma omp parallel num_threads(threads_for(N, nthreads))
  {
    float *x = malloc((size_t)(Dh + 1) * sizeof(float));
    if (!x) failed = 1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      if (!x) continue;
      for (int64_t h = 0; h < heads; h++) {
        int64_t base = n * ld + h * Dh;
        for (int64_t i = 0; i < Dh; i++) x[i] = load1(X, base + i, t);
        for (int64_t i = 0; i < Dh; i++) {
          float a = rounded(x[i] * load1(cos_, n * Dh + i, t), t), b;
          if (!backward) {
            float turned = i < half ? -x[i + half] : x[i - half];
            b = rounded(turned * load1(sin_, n * Dh + i, t), t);
          } else {
            int64_t j = i < half ? i + half : i - half;
            float moved = rounded(x[j] * load1(sin_, n * Dh + j, t), t);
            b = i < half ? moved : -moved;
          }
          store1(X, base + i, a + b, t);
        }
      }
    }
    free(x);
  }
  return failed;
}

int rotary(void *X, int64_t ld, int64_t N, int64_t heads, int64_t Dh, const void *cos_, const void *sin_, int t,
           int nthreads) {
  return rotate_rows(X, ld, N, heads, Dh, cos_, sin_, t, 0, nthreads);
}

int rotary_grad(void *G, int64_t ld, int64_t N, int64_t heads, int64_t Dh, const void *cos_, const void *sin_, int t,
                int nthreads) {
  return rotate_rows(G, ld, N, heads, Dh, cos_, sin_, t, 1, nthreads);
}

/* -- gated MLP ---------------------------------------------------------------------------------------- */

/* Row n of the gated activation (g: the row's gate in float32, s: its sigmoid): forward (D NULL) Y = round(round(g *
 * s) * u); backward, for the output's gradient D, Y = d gate and DU = d up (Y's and DU's rows ldy apart), each step
 * rounded where the chain's
 * autograd rounds it (ops.silu, then the product with up):
 *   act = round(g * s);  ds = round(d * u);  DU = round(d * act);
 *   d gate = round(ds * s + ((ds * g) * s) * (1 - s))   (the product's and the sigmoid's terms, in float32) */
NO_CONTRACT static void silu_mul_row(const float *g, const float *s, const void *U, const void *D, void *Y, void *DU,
                                     int64_t n, int64_t ldu, int64_t ldd, int64_t ldy, int64_t I, int t) {
  CONTRACT_OFF
  if (t == F32) { /* the same steps, 16 at a time (float32 rounds nothing between them) */
    for (int64_t i = 0; i < I; i += 16) {
      int k = (int)(I - i < 16 ? I - i : 16);
      v16 sig = load16(s, i, F32, k), x = load16(g, i, F32, k), u = load16(U, n * ldu + i, F32, k);
      if (!D) {
        store16(Y, n * ldy + i, (x * sig) * u, F32, k);
        continue;
      }
      v16 d = load16(D, n * ldd + i, F32, k), ds = d * u;
      store16(DU, n * ldy + i, d * (x * sig), F32, k);
      v16 through_product = ds * sig, through_sigmoid = ds * x;
      through_sigmoid = through_sigmoid * sig;
      through_sigmoid = through_sigmoid * (1.0f - sig);
      store16(Y, n * ldy + i, through_product + through_sigmoid, F32, k);
    }
    return;
  }
  for (int64_t i = 0; i < I; i++) {
    float sig = s[i], x = g[i], u = load1(U, n * ldu + i, t), act = rounded(x * sig, t);
    if (!D) {
      store1(Y, n * ldy + i, act * u, t);
      continue;
    }
    float d = load1(D, n * ldd + i, t), ds = rounded(d * u, t);
    store1(DU, n * ldy + i, d * act, t);
    float through_product = ds * sig, through_sigmoid = ds * x;
    through_sigmoid = through_sigmoid * sig;
    through_sigmoid = through_sigmoid * (1.0f - sig);
    store1(Y, n * ldy + i, through_product + through_sigmoid, t);
  }
}

/* silu_mul_row over the N rows of gate G and up U ([N, I], row strides ldg and ldu; D with row stride ldd), into Y
 * (and DU), row stride ldy; each row's sigmoid computed from its gate (sigmoid_f32's values), nothing else kept. */
static int silu_mul_pass(const void *G, int64_t ldg, const void *U, int64_t ldu, const void *D, int64_t ldd, void *Y,
                         void *DU, int64_t ldy, int64_t N, int64_t I, int t, int nthreads) {
  int failed = 0;
#pragma omp parallel num_threads(threads_for(N, nthreads))
  {
    float *g = malloc((size_t)(2 * I + 16) * sizeof(float)), *s = g ? g + I + 16 : NULL;
    if (!g) failed = 1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      if (!g) continue;
      for (int64_t i = 0; i < I; i++) g[i] = load1(G, n * ldg + i, t);
      sigmoid_row(g, s, I);
      silu_mul_row(g, s, U, D, Y, DU, n, ldu, ldd, ldy, I, t);
    }
    free(g);
  }
  return failed;
}

/* The trainer's gated activation: Y = silu(gate) * up with the bits of ops.silu(gate) * up, one pass over the three. */
int silu_mul_rows(const void *G, int64_t ldg, const void *U, int64_t ldu, void *Y, int64_t N, int64_t I, int t,
                  int nthreads) {
  return silu_mul_pass(G, ldg, U, ldu, NULL, 0, Y, NULL, I, N, I, t, nthreads);
}

/* Its gradients for the output's gradient D: DG and DU (rows ldy apart: side by side in one [N, 2 I] tensor where
 * ldy is 2 I and DU is DG + I), the chain's bits (the sigmoid recomputed from the gate). */
int silu_mul_rows_backward(const void *G, int64_t ldg, const void *U, int64_t ldu, const void *D, int64_t ldd,
                           void *DG, void *DU, int64_t ldy, int64_t N, int64_t I, int t, int nthreads) {
  return silu_mul_pass(G, ldg, U, ldu, D, ldd, DG, DU, ldy, N, I, t, nthreads);
}

/* Y [N, I] = round(silu(gate)) * up, gate and up the two halves of GU's rows (row stride ld): the decode step's
 * gated activation, silu_mul_rows over the two halves. */
int silu_mul(const void *GU, int64_t ld, int64_t N, int64_t I, void *Y, int t, int nthreads) {
  const char *up = (const char *)GU + (size_t)I * esize(t);
  return silu_mul_pass(GU, ld, up, ld, NULL, 0, Y, NULL, I, N, I, t, nthreads);
}

/* -- projections with LoRA ------------------------------------------------------------------------------ */

/* lora_added's store: C[m, n] = H[m, n] + round(round(v) * scaling) for the update's sum v (v and the scaled value
 * rounded to the factors' type td, the sum in float32 rounded to C's type tc: peft's `result + lora_B(lora_A(x)) *
 * scaling`, as the chain's product then add_scaled round it). H may be C itself. K (NULL: none; row stride ldk):
 * the same sum stored a second time (the outputs a sampling pass keeps for the trainer). */
typedef struct {
  const void *H;
  int64_t ldh;
  void *C;
  int64_t ldc;
  void *K;
  int64_t ldk;
  float scaling;
  int td, tc;
} added_store;

NO_CONTRACT static void add_update_row(const void *context, int64_t m, int64_t n0, float *row, int64_t width) {
  CONTRACT_OFF
  const added_store *s = context;
  for (int64_t j = 0; j < width; j += 16) { /* 16 elements at a time, each rounded as rounded() rounds it */
    int n = (int)(width - j < 16 ? width - j : 16);
    v16 delta = rounded16(rounded16(load16(row, j, F32, n), s->td) * s->scaling, s->td);
    v16 sum = load16(s->H, m * s->ldh + n0 + j, s->tc, n) + delta;
    store16(s->C, m * s->ldc + n0 + j, sum, s->tc, n);
    if (s->K) store16(s->K, m * s->ldk + n0 + j, sum, s->tc, n);
  }
}

/* C [M, N] = H + round(round(U @ Bt) * scaling): a LoRA update added to its base result in one pass, U [M, r] the input
 * times the first factor and Bt [r, N] the second factor transposed (row strides ldu, ldbt; r at most SMALL_K, so
 * the sum over r is gemm_seq's, in increasing index), both of type td; H and C of type tc (H may be C). The bits of
 * the chain gemm_seq -> add_scaled (td == tc), or of PyTorch's promoted `H + D * scaling` rounded to tc. */
static int lora_added_kept(const void *H, int64_t ldh, const void *U, int64_t ldu, const void *Bt, int64_t ldbt,
                           float scaling, void *C, int64_t ldc, void *K, int64_t ldk, int64_t M, int64_t N, int64_t r,
                           int td, int tc, int nthreads) {
  added_store s = {H, ldh, C, ldc, K, ldk, scaling, td, tc};
  return gemm_seq_to(U, td, ldu, 1, Bt, td, ldbt, M, N, r, add_update_row, &s, nthreads);
}

int lora_added(const void *H, int64_t ldh, const void *U, int64_t ldu, const void *Bt, int64_t ldbt, float scaling,
               void *C, int64_t ldc, int64_t M, int64_t N, int64_t r, int td, int tc, int nthreads) {
  return lora_added_kept(H, ldh, U, ldu, Bt, ldbt, scaling, C, ldc, NULL, 0, M, N, r, td, tc, nthreads);
}

/* C[m, n] += round(V[m, n] * scaling) over C's [M, cols] block (row stride ldc): add_update_row for an update
 * computed and stored beforehand (V contiguous [M, cols], type ta; its values are already rounded to ta, so
 * add_update_row's first rounding leaves them as they are). Returns 1 where its row buffer cannot be allocated. */
static int add_update(void *C, int tc, int64_t ldc, int64_t M, int64_t cols, const void *V, int ta, float scaling) {
  added_store s = {C, ldc, C, ldc, NULL, 0, scaling, ta, tc};
  float *row = malloc((size_t)(cols + 16) * sizeof(float));
  if (!row) return 1;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < cols; j++) row[j] = load1(V, m * cols + j, ta);
    add_update_row(&s, m, 0, row, cols);
  }
  free(row);
  return 0;
}

/* C [M, N] = X @ W^T (+ bias), W the stacked base weights of P projections (their outputs are C's columns
 * cols[p] .. cols[p + 1]; W read from `coded` where that is not NULL and has a kind: the same values); then each
 * projection p with an adapter adds peft's update round(round(round(round(X) @ A^T) @ B^T) * scaling) to its
 * columns (rounding to ta each step, the sum rounded to C's type tc): the decoder's fixed-numerics linears with one
 * LoRA adapter per projection.
 * Several adapters in one pass: the rows are cut into S slots, slot s being rows bounds[s] .. bounds[s + 1], and
 * slot s's rows take adapter p * S + s (A [ranks[.], K]; B [cols[p+1] - cols[p], ranks[.]], given transposed,
 * [ranks[.], cols[p+1] - cols[p]], where the rank is at most SMALL_K, as product() would transpose it; storage
 * type ta; A NULL: none). Every product is computed in a fixed order per element, so a row's bits do not depend on the
 * rows or slots beside it: a slot's rows get what a pass of that adapter alone gives them.
 * Kept (not NULL): the outputs written a second time, as [M, N] contiguous rows of type tc (what the trainer's pass
 * over the same tokens and weights computes: rlrunbook.engines.kept_products). */
int lora_linears(const void *X, int tx, int64_t ldx, int64_t M, int64_t K, const void *W, int64_t ldw,
                 const coded_form *coded, const float *bias, int64_t N, void *C, int tc, int64_t ldc, int P,
                 const int64_t *cols, const void *const *A, const void *const *B, const int64_t *ranks,
                 const float *scalings, int ta, int S, const int64_t *bounds, void *Kept, int nthreads) {
  size_t e = esize(tc);
  if (base_product(X, tx, ldx, W, tx, ldw, coded, bias, C, tc, ldc, M, N, K, nthreads)) return 1;
  for (int p = 0; p < P; p++) {
    for (int s = 0; s < S; s++) {
      int64_t at = p * S + s, first = bounds[s], rows = bounds[s + 1] - bounds[s];
      int64_t r = A[at] ? ranks[at] : 0, cols_p = cols[p + 1] - cols[p];
      char *c = (char *)C + (size_t)(first * ldc + cols[p]) * e; /* this projection's columns */
      char *k = Kept ? (char *)Kept + (size_t)(first * N + cols[p]) * e : NULL;
      if (rows <= 0) continue;
      int failed = 0, stored = 0; /* stored: the addition wrote the kept copy too */
      if (A[at]) {
        const char *x = (const char *)X + (size_t)(first * ldx) * esize(tx);
        char *u = malloc((size_t)(rows * r + 1) * esize(ta)), *v = NULL;
        failed = !u || product(x, tx, ldx, A[at], ta, K, NULL, u, ta, r, rows, r, K, nthreads);
        if (!failed && r <= SMALL_K) { /* the second product, scaled and added in place, in one pass */
          failed = lora_added_kept(c, ldc, u, r, B[at], cols_p, scalings[at], c, ldc, k, N, rows, cols_p, r, ta, tc,
                                   nthreads);
          stored = 1;
        } else if (!failed) { /* a rank over SMALL_K: its product in lanes16 order, then the same addition */
          failed = !(v = malloc((size_t)(rows * cols_p + 1) * esize(ta))) ||
                   product(u, ta, r, B[at], ta, r, NULL, v, ta, cols_p, rows, cols_p, r, nthreads);
          if (!failed) failed = add_update(c, tc, ldc, rows, cols_p, v, ta, scalings[at]);
        }
        free(u);
        free(v);
      }
      if (failed) return 1;
      if (k && !stored)
        for (int64_t m = 0; m < rows; m++)
          memcpy(k + (size_t)(m * N) * e, c + (size_t)(m * ldc) * e, (size_t)cols_p * e);
    }
  }
  return 0;
}

/* Out [M, N] (contiguous) = H + round(D * scaling), elementwise, H and D [M, N] with row strides ldh and ldd, all in
 * storage type t: add_update's arithmetic over whole tensors, for the trainer's pass (peft's
 * `result + lora_B(lora_A(x)) * scaling`; its autograd is rlrunbook.kernels.ops.add_scaled). One pass over the
 * three tensors instead of a product tensor written and read again. */
NO_CONTRACT int add_scaled(const void *H, int64_t ldh, const void *D, int64_t ldd, float scaling, void *Out, int64_t M,
                           int64_t N, int t, int nthreads) {
  CONTRACT_OFF
#pragma omp parallel for schedule(static) num_threads(threads_for(M, nthreads))
  for (int64_t m = 0; m < M; m++) {
    if (t == F32) {
      const float *h = (const float *)H + m * ldh, *d = (const float *)D + m * ldd;
      float *o = (float *)Out + m * N;
      for (int64_t n = 0; n < N; n++) {
        float delta = d[n] * scaling;
        o[n] = h[n] + delta;
      }
    } else {
      for (int64_t n = 0; n < N; n++) {
        float delta = rounded(load1(D, m * ldd + n, t) * scaling, t);
        store1(Out, m * N + n, load1(H, m * ldh + n, t) + delta, t);
      }
    }
  }
  return 0;
}

/* -- attention over a per-row cache ------------------------------------------------------------------------ */

/* One decode step of R rows over their caches (RowCache): row r's new key and value (in QKV's row, after its H
 * query heads: Hkv key heads, then Hkv value heads, each of size D) are written at cache index lengths[r], then
 * its queries attend over the first S cache entries (attention_fwd, positions 0..S-1 all valid, the query at
 * position lengths[r]). Out [R, H * D]; Kc, Vc [R, capacity, Hkv, D] with row stride c_row. With order (not
 * NULL), rows that hold copies of one prefix read it once per part (attention_fwd_parts: order, starts, reload,
 * parts), with the same bits. */
int cached_attention(const void *QKV, int64_t qkv_row, void *Kc, void *Vc, int64_t c_row, const int64_t *lengths,
                     const int64_t *kpos, const uint8_t *kvalid, void *out, int64_t R, int64_t S, int64_t H,
                     int64_t Hkv, int64_t D, int t, float scale, const int64_t *order, const int64_t *starts,
                     const int64_t *reload, int64_t parts, int nthreads) {
  size_t e = esize(t), width = (size_t)(Hkv * D) * e;
  for (int64_t r = 0; r < R; r++) {
    const char *row = (const char *)QKV + (size_t)(r * qkv_row) * e;
    size_t at = (size_t)(r * c_row + lengths[r] * Hkv * D) * e;
    memcpy((char *)Kc + at, row + (size_t)(H * D) * e, width);
    memcpy((char *)Vc + at, row + (size_t)((H + Hkv) * D) * e, width);
  }
  float *lse = malloc((size_t)(R * H + 1) * sizeof(float));
  if (!lse) return 1;
  int status = order ? attention_fwd_parts(QKV, Kc, Vc, lengths, kpos, kvalid, out, lse, R, S, H, Hkv, D, qkv_row,
                                           c_row, t, t, scale, order, starts, reload, parts, nthreads)
                     : attention_fwd(QKV, Kc, Vc, lengths, kpos, kvalid, out, lse, R, 1, S, H, Hkv, D, qkv_row, c_row,
                                     1, t, t, scale, nthreads);
  free(lse);
  return status;
}

/* -- a decode step's layers in one call ------------------------------------------------------------------ */

/* One projection group as lora_linears takes it, less its input and outputs */
typedef struct {
  const void *W;
  int64_t ldw, N;
  coded_form coded;
  const float *bias;
  int64_t P;
  const int64_t *cols;
  const void *const *A;
  const void *const *B;
  const int64_t *ranks;
  const float *scalings;
  int64_t ta;
} lora_group;

/* One layer of a Llama-shaped decoder: its four groups (q/k/v, o, gate/up, down), the norm after attention and the
 * norm after the MLP (the next layer's input norm, the final norm after the last layer), the attention's scale. */
typedef struct {
  lora_group qkv, o, gate_up, down;
  const void *post_norm, *next_norm;
  float post_eps, next_eps, scale;
} decode_layer;

/* A decode step's L layers over M rows (one token each) in one call: for each layer, the calls FusedPass makes
 * one by one (rlrunbook/engines/fused_pass.py), in its order and with its arguments, so every output has their
 * bits:
 *   lora_linears(q/k/v) | rotary | cached_attention | lora_linears(o) | add_rms_norm | lora_linears(gate/up) |
 *   silu_mul | lora_linears(down) | add_rms_norm
 * H [M, E] holds the residual stream (updated in place), X [M, E] the first layer's normed input on entry and the
 * last layer's final-norm output on return (both contiguous, type t). Keys[l], Values[l]: layer l's cache (RowCache;
 * row stride c_row) and the cache arguments of cached_attention; cos, sin [M, D]; slots and bounds as lora_linears
 * takes them; kept (NULL, or 4 L pointers, NULL where not kept): where each group's base product is kept, group g of
 * layer l at 4 l + g. The intermediate rows live in one scratch allocation. Returns 1 where it cannot be allocated
 * (or a call fails), the state of H and X then unspecified. */
int decode_layers(void *H, void *X, int64_t M, int64_t E, int t, int64_t L, const decode_layer *layers,
                  void *const *keys, void *const *values, int64_t c_row, const int64_t *lengths,
                  const int64_t *kpos, const uint8_t *kvalid, int64_t S, int64_t heads, int64_t kv_heads,
                  int64_t D, const void *cos_, const void *sin_, const int64_t *order, const int64_t *starts,
                  const int64_t *reload, int64_t parts, int slots, const int64_t *bounds, void *const *kept,
                  int nthreads) {
  if (L <= 0 || M <= 0) return 0;
  size_t e = esize(t);
  int64_t wq = layers[0].qkv.N, wgu = layers[0].gate_up.N;
  for (int64_t l = 1; l < L; l++)
    if (layers[l].qkv.N != wq || layers[l].gate_up.N != wgu) return 1;
  /* scratch rows: q/k/v, the attention's output (rows as wide as q/k/v's, as cached_attention writes them), the
   * gate/up pair, the activation, and one [M, E] output shared by o and down */
  char *scratch = malloc((size_t)(M * (2 * wq + wgu + wgu / 2 + E) + 1) * e);
  if (!scratch) return 1;
  char *qkv = scratch, *att = qkv + (size_t)(M * wq) * e, *gu = att + (size_t)(M * wq) * e;
  char *act = gu + (size_t)(M * wgu) * e, *out = act + (size_t)(M * (wgu / 2)) * e;
  int failed = 0;
  for (int64_t l = 0; l < L && !failed; l++) {
    const decode_layer *y = &layers[l];
    const lora_group *g = &y->qkv;
    void *const *k = kept ? kept + 4 * l : NULL;
    failed = lora_linears(X, t, E, M, E, g->W, g->ldw, &g->coded, g->bias, g->N, qkv, t, wq, (int)g->P, g->cols,
                          g->A, g->B, g->ranks, g->scalings, (int)g->ta, slots, bounds, k ? k[0] : NULL,
                          nthreads) ||
             rotary(qkv, wq, M, heads + kv_heads, D, cos_, sin_, t, nthreads) ||
             cached_attention(qkv, wq, keys[l], values[l], c_row, lengths, kpos, kvalid, att, M, S, heads, kv_heads,
                              D, t, y->scale, order, starts, reload, parts, nthreads);
    if (failed) break;
    g = &y->o;
    failed = lora_linears(att, t, wq, M, heads * D, g->W, g->ldw, &g->coded, g->bias, g->N, out, t, E, (int)g->P,
                          g->cols, g->A, g->B, g->ranks, g->scalings, (int)g->ta, slots, bounds, k ? k[1] : NULL,
                          nthreads) ||
             add_rms_norm(H, out, H, M, E, y->post_norm, y->post_eps, X, t, nthreads);
    if (failed) break;
    g = &y->gate_up;
    failed = lora_linears(X, t, E, M, E, g->W, g->ldw, &g->coded, g->bias, g->N, gu, t, wgu, (int)g->P, g->cols,
                          g->A, g->B, g->ranks, g->scalings, (int)g->ta, slots, bounds, k ? k[2] : NULL,
                          nthreads) ||
             silu_mul(gu, wgu, M, wgu / 2, act, t, nthreads);
    if (failed) break;
    g = &y->down;
    failed = lora_linears(act, t, wgu / 2, M, wgu / 2, g->W, g->ldw, &g->coded, g->bias, g->N, out, t, E,
                          (int)g->P, g->cols, g->A, g->B, g->ranks, g->scalings, (int)g->ta, slots, bounds,
                          k ? k[3] : NULL, nthreads) ||
             add_rms_norm(H, out, H, M, E, y->next_norm, y->next_eps, X, t, nthreads);
  }
  free(scratch);
  return failed;
}
