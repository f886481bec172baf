/* Row reductions (row_sumsq lanes16, row_logsumexp lanes64), elementwise exp and sigmoid, the rotary table (orders and contract: fixed_order.h) */
#include "fixed_order.h"

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
    int nan;
    float mx = vector_max(x, V, &nan);
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

/* The gradient of log_softmax(X)[m, t[m]] for the logprobs' gradient g (X [M, V] float32 with row stride ldx, lse its
 * rows' log-sum-exps, out [M, V] contiguous): out[m, v] = (v == t[m] ? g[m] : 0) + (-g[m]) * exp(X[m, v] - lse[m]),
 * each step rounded where ops.log_softmax_at's autograd chain rounds it (row_logsumexp's backward: the difference,
 * exp_f32's exp, compiled here with exp_f32's flags, the product by the negated gradient; then the gather's zeros
 * and gradient added), in one pass over X and out instead of the chain's five [M, V] tensors. A product of -0 is
 * stored as +0, the chain's 0 + -0. */
void log_softmax_at_grad(const float *X, int64_t ldx, const float *lse, const int64_t *t, const float *g, float *out,
                         int64_t M, int64_t V, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(M, nthreads))
  for (int64_t m = 0; m < M; m++) {
    const float *x = X + m * ldx;
    float *o = out + m * V;
    v16 ng = splat(-g[m]), l = splat(lse[m]);
    for (int64_t v = 0; v < V; v += 16) {
      int n = (int)(V - v < 16 ? V - v : 16);
      v16 p = ng * fexp16(load16(x, v, F32, n) - l);
      store16(o, v, select16(p == splat(0.0f), splat(0.0f), p), F32, n);
    }
    o[t[m]] = o[t[m]] + (0.0f + g[m]);
  }
}

static inline v16 sigmoid16(v16 v) { return 1.0f / (1.0f + fexp16(-v)); }

/* y = 1 / (1 + exp(-x)) */
void sigmoid_f32(const float *x, float *y, int64_t n, int nthreads) {
  int64_t blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads_for(blocks / 256 + 1, nthreads))
  for (int64_t b = 0; b < blocks; b++) {
    int k = (int)(n - b * 16 < 16 ? n - b * 16 : 16);
    store16(y, b * 16, sigmoid16(load16(x, b * 16, F32, k)), F32, k);
  }
}

/* sigmoid_f32's values of n floats on the calling thread (sigmoid16 too: for kernels that fuse it) */
void sigmoid_row(const float *x, float *y, int64_t n) {
  for (int64_t b = 0; b < n; b += 16) {
    int k = (int)(n - b < 16 ? n - b : 16);
    store16(y, b, sigmoid16(load16(x, b, F32, k)), F32, k);
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

/* -- gathering rows ------------------------------------------------------------------------------------ */

/* Row m of out (row_bytes bytes, rows packed) is a copy of the row_bytes bytes at address rows[m]: rows of several
 * tensors gathered in one pass (a copy: no arithmetic, any storage type). */
void gather_rows(const int64_t *rows, int64_t row_bytes, void *out, int64_t M, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(M / 16 + 1, nthreads))
  for (int64_t m = 0; m < M; m++)
    memcpy((char *)out + m * row_bytes, (const void *)(intptr_t)rows[m], (size_t)row_bytes);
}
