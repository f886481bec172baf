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

/* The row stride S16 of the transposed keys (and values, in the backward): S rounded up to 16, plus one 64-byte line
 * when that is an even number of lines, so that a column block's D rows fall in different cache sets (a stride of
 * 512 floats put all 64 rows of a head in 2 of L1's 64 sets: a decode step over 512 positions took 3x one over
 * 448). Layout only: every value and every order of a sum is unchanged. */
static inline int64_t kt_stride(int64_t S) {
  int64_t padded = (S + 15) / 16 * 16;
  return (padded / 16) % 2 == 0 ? padded + 16 : padded;
}

/* per (row, kv head): keys transposed [D, S16] and values [S, D] in fp32, for key indices [from, S) (the columns
 * before from are left as they are: a row sharing them with the one loaded before, see cached_attention) */
static void load_kv_from(const attn_shape *sh, const void *k, const void *v, int64_t r, int64_t kvh, float *kt,
                         float *vs, int64_t S16, int64_t from) {
  for (int64_t s = from; s < sh->S; s++) {
    int64_t base = r * sh->k_row + s * sh->k_s + kvh * sh->D;
    for (int64_t d = 0; d < sh->D; d++) {
      kt[d * S16 + s] = load1(k, base + d, sh->tk);
      vs[s * sh->D + d] = load1(v, base + d, sh->tk);
    }
  }
}

/* the whole row, the transposed keys' columns past S zeroed */
static void load_kv(const attn_shape *sh, const void *k, const void *v, int64_t r, int64_t kvh, float *kt,
                    float *vs, int64_t S16) {
  for (int64_t d = 0; d < sh->D; d++)
    for (int64_t s = sh->S; s < S16; s++) kt[d * S16 + s] = 0.0f;
  load_kv_from(sh, k, v, r, kvh, kt, vs, S16, 0);
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

#define HEAD_BLOCK 8 /* query heads of one key/value head computed in one pass over its keys and values */

typedef struct {
  float *kt, *vs, *sc, *p, *qv; /* sc, p: HEAD_BLOCK rows of S16 + 16; qv: HEAD_BLOCK rows of D + 16 */
  int64_t *allowed;
} attn_scratch;

static int scratch_alloc(attn_scratch *w, int64_t S, int64_t S16, int64_t D) {
  w->kt = malloc((size_t)(D * S16) * 4);
  w->vs = malloc((size_t)(S16 * D + 16) * 4);
  w->sc = malloc((size_t)(HEAD_BLOCK * (S16 + 16)) * 4);
  w->p = malloc((size_t)(HEAD_BLOCK * (S16 + 16)) * 4);
  w->qv = malloc((size_t)(HEAD_BLOCK * (D + 16)) * 4);
  w->allowed = malloc((size_t)(S + 1) * sizeof(int64_t));
  return w->kt && w->vs && w->sc && w->p && w->qv && w->allowed;
}

static void scratch_free(attn_scratch *w) {
  free(w->kt);
  free(w->vs);
  free(w->sc);
  free(w->p);
  free(w->qv);
  free(w->allowed);
}

/* Every query of row r through key/value head kvh (its G query heads, all T positions), over the keys and values
 * loaded in w (load_kv). The query heads of a position share its allowed keys; up to HEAD_BLOCK of them are
 * computed in one pass over the keys and one over the values (each head's sums in attention_fwd's order, its own
 * accumulators), so a head block reads the loaded keys and values once, not once per head. */
static void attend_row(const attn_shape *sh, const void *q, const int64_t *qpos, const int64_t *kpos,
                       const uint8_t *kvalid, void *out, float *lse, int64_t r, int64_t kvh, int64_t S16,
                       attn_scratch *w) {
  int64_t G = sh->H / sh->Hkv, T = sh->T, D = sh->D, H = sh->H, SS = S16 + 16, QS = D + 16;
  const int64_t *kp = kpos + (sh->pos_rows > 1 ? r * sh->S : 0);
  const uint8_t *kval = kvalid + (sh->pos_rows > 1 ? r * sh->S : 0);
  for (int64_t t = 0; t < T; t++) {
    int64_t qp = qpos[r * T + t], count = 0;
    if (qp >= 0)
      for (int64_t s = 0; s < sh->S; s++)
        if (kval[s] && kp[s] <= qp) w->allowed[count++] = s;
    for (int64_t g0 = 0; g0 < G; g0 += HEAD_BLOCK) {
      int nb = (int)(G - g0 < HEAD_BLOCK ? G - g0 : HEAD_BLOCK);
      int64_t qbase[HEAD_BLOCK];
      for (int b = 0; b < nb; b++) qbase[b] = r * sh->q_row + t * sh->q_t + (kvh * G + g0 + b) * D;
      if (count == 0) { /* a padding query, or one with no key: zeros, lse = -inf */
        for (int b = 0; b < nb; b++) {
          for (int64_t d = 0; d < D; d++) store1(out, qbase[b] + d, 0.0f, sh->tq);
          lse[(r * T + t) * H + kvh * G + g0 + b] = -INFINITY;
        }
        continue;
      }
      for (int b = 0; b < nb; b++)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          v16 x = load16(q, qbase[b] + d0, sh->tq, (int)(D - d0 < 16 ? D - d0 : 16));
          memcpy(w->qv + b * QS + d0, &x, 64);
        }
      /* scores: sequential over d, 16 keys per vector, up to the last allowed key (query_scores' sums) */
      int64_t end = w->allowed[count - 1] + 1;
      for (int64_t s = 0; s < end; s += 16) {
        v16 acc[HEAD_BLOCK];
        for (int b = 0; b < nb; b++) acc[b] = (v16){0};
        for (int64_t d = 0; d < D; d++) {
          v16 kv;
          memcpy(&kv, w->kt + d * S16 + s, 64);
          for (int b = 0; b < nb; b++) acc[b] += splat(w->qv[b * QS + d]) * kv;
        }
        for (int b = 0; b < nb; b++) {
          acc[b] = acc[b] * sh->scale;
          memcpy(w->sc + b * SS + s, &acc[b], 64);
        }
      }
      float mx[HEAD_BLOCK], l[HEAD_BLOCK];
      for (int b = 0; b < nb; b++) {
        const float *sc = w->sc + b * SS;
        mx[b] = -INFINITY;
        for (int64_t i = 0; i < count; i++)
          if (sc[w->allowed[i]] > mx[b] || sc[w->allowed[i]] != sc[w->allowed[i]]) mx[b] = sc[w->allowed[i]];
        allowed_exp(sc, w->allowed, count, mx[b], w->p + b * SS);
        v16 lacc = {0};
        for (int64_t i = 0; i < count; i += 16) {
          v16 pv;
          memcpy(&pv, w->p + b * SS + i, 64);
          lacc += pv;
        }
        l[b] = tree16(lacc);
      }
      /* weighted values: sequential over the allowed keys */
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        int n = (int)(D - d0 < 16 ? D - d0 : 16);
        v16 acc[HEAD_BLOCK];
        for (int b = 0; b < nb; b++) acc[b] = (v16){0};
        for (int64_t i = 0; i < count; i++) {
          v16 vv = load16(w->vs, w->allowed[i] * D + d0, F32, n);
          for (int b = 0; b < nb; b++) acc[b] += splat(w->p[b * SS + i]) * vv;
        }
        for (int b = 0; b < nb; b++) store16(out, qbase[b] + d0, acc[b] / l[b], sh->tq, n);
      }
      for (int b = 0; b < nb; b++) lse[(r * T + t) * H + kvh * G + g0 + b] = mx[b] + logf(l[b]);
    }
  }
}

int attention_fwd(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                  const uint8_t *kvalid, void *out, float *lse, int64_t R, int64_t T, int64_t S, int64_t H,
                  int64_t Hkv, int64_t D, int64_t q_row, int64_t k_row, int64_t pos_rows, int tq, int tk,
                  float scale, int nthreads) {
  attn_shape sh = {R, T, S, H, Hkv, D, q_row, H * D, k_row, Hkv * D, pos_rows, tq, tk, scale};
  int64_t S16 = kt_stride(S), items = R * Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) {
    int64_t r = item / Hkv, kvh = item % Hkv;
    attn_scratch w;
    if (!scratch_alloc(&w, S, S16, D)) {
      failed = 1;
    } else {
      load_kv(&sh, k, v, r, kvh, w.kt, w.vs, S16);
      attend_row(&sh, q, qpos, kpos, kvalid, out, lse, r, kvh, S16, &w);
    }
    scratch_free(&w);
  }
  return failed;
}

/* attention_fwd (one query per row) with rows taken in parts: part c is the rows order[starts[c]..starts[c+1]),
 * and each row after a part's first shares the keys and values of its indices below reload[row] with the part's
 * first row, bit for bit (the caller guarantees it: copies of the same prefix). A part's first row loads its whole
 * cache row; each later one loads only its indices from reload[row] on, so a prefix shared by a part's rows is read
 * from memory once per (part, key/value head), not once per row. Every row's queries, scores and sums are those of
 * attention_fwd: the same values in the same order. */
int attention_fwd_parts(const void *q, const void *k, const void *v, const int64_t *qpos, const int64_t *kpos,
                        const uint8_t *kvalid, void *out, float *lse, int64_t R, int64_t S, int64_t H, int64_t Hkv,
                        int64_t D, int64_t q_row, int64_t k_row, int tq, int tk, float scale, const int64_t *order,
                        const int64_t *starts, const int64_t *reload, int64_t parts, int nthreads) {
  attn_shape shape = {R, 1, S, H, Hkv, D, q_row, H * D, k_row, Hkv * D, 1, tq, tk, scale};
  const attn_shape *sh = &shape;
  int64_t S16 = kt_stride(sh->S), items = parts * sh->Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) {
    int64_t c = item / sh->Hkv, kvh = item % sh->Hkv;
    attn_scratch w;
    if (!scratch_alloc(&w, sh->S, S16, sh->D)) {
      failed = 1;
    } else {
      for (int64_t j = starts[c]; j < starts[c + 1]; j++) {
        int64_t r = order[j];
        if (j == starts[c])
          load_kv(sh, k, v, r, kvh, w.kt, w.vs, S16);
        else
          load_kv_from(sh, k, v, r, kvh, w.kt, w.vs, S16, reload[r] < sh->S ? reload[r] : sh->S);
        attend_row(sh, q, qpos, kpos, kvalid, out, lse, r, kvh, S16, &w);
      }
    }
    scratch_free(&w);
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
  int64_t G = H / Hkv, S16 = kt_stride(S), items = R * Hkv;
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
