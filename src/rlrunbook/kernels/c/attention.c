/* Attention forward and backward: per query over its allowed keys in index order (orders and contract: fixed_order.h) */
#include "fixed_order.h"

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
