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

/* One round of the 16 x 16 transpose: rows i and i + B (i's bit B clear) swap their off-diagonal B x B blocks. */
#define SWAP_BLOCKS(B)                                                                                     \
  do {                                                                                                   \
    v16i keep, take;                                                                                     \
    for (int c = 0; c < 16; c++) {                                                                       \
      keep[c] = (c & (B)) ? 16 + c - (B) : c;                                                            \
      take[c] = (c & (B)) ? 16 + c : c + (B);                                                            \
    }                                                                                                    \
    for (int i = 0; i < 16; i++)                                                                         \
      if (!(i & (B))) {                                                                                  \
        v16 x = __builtin_shuffle(r[i], r[i + (B)], keep), y = __builtin_shuffle(r[i], r[i + (B)], take); \
        r[i] = x, r[i + (B)] = y;                                                                        \
      }                                                                                                  \
  } while (0)

/* dst[c * dst_stride + i] = src[i * src_stride + c] for i < rows, c < cols: 16 x 16 blocks transposed in registers
 * (four rounds of two-source shuffles), the edges one value at a time. A copy: every value is unchanged. */
static void transpose_f32(const float *src, int64_t src_stride, int64_t rows, int64_t cols, float *dst,
                          int64_t dst_stride) {
  int64_t i0 = 0;
  for (; i0 + 16 <= rows; i0 += 16) {
    int64_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) {
      v16 r[16];
      for (int i = 0; i < 16; i++) memcpy(&r[i], src + (i0 + i) * src_stride + c0, 64);
      SWAP_BLOCKS(8);
      SWAP_BLOCKS(4);
      SWAP_BLOCKS(2);
      SWAP_BLOCKS(1);
      for (int c = 0; c < 16; c++) memcpy(dst + (c0 + c) * dst_stride + i0, &r[c], 64);
    }
    for (int64_t i = i0; i < i0 + 16; i++)
      for (int64_t c = c0; c < cols; c++) dst[c * dst_stride + i] = src[i * src_stride + c];
  }
  for (int64_t i = i0; i < rows; i++)
    for (int64_t c = 0; c < cols; c++) dst[c * dst_stride + i] = src[i * src_stride + c];
}

/* per (row, kv head): keys transposed [D, S16] and values [S, D] in fp32 (none where vs is NULL), for key indices
 * [from, S) (the columns before from are left as they are: a row sharing them with the one loaded before, see
 * cached_attention) */
static void load_kv_from(const attn_shape *sh, const void *k, const void *v, int64_t r, int64_t kvh, float *kt,
                         float *vs, int64_t S16, int64_t from) {
  if (sh->tk == F32 && from < sh->S) {
    int64_t base = r * sh->k_row + from * sh->k_s + kvh * sh->D;
    transpose_f32((const float *)k + base, sh->k_s, sh->S - from, sh->D, kt + from, S16);
    if (vs)
      for (int64_t s = from; s < sh->S; s++)
        memcpy(vs + s * sh->D, (const float *)v + base + (s - from) * sh->k_s, (size_t)sh->D * 4);
    return;
  }
  for (int64_t s = from; s < sh->S; s++) {
    int64_t base = r * sh->k_row + s * sh->k_s + kvh * sh->D;
    for (int64_t d = 0; d < sh->D; d++) {
      kt[d * S16 + s] = load1(k, base + d, sh->tk);
      if (vs) vs[s * sh->D + d] = load1(v, base + d, sh->tk);
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

#define HEAD_BLOCK 8 /* query heads of one key/value head computed in one pass over its keys and values */
#define INLINE static inline __attribute__((always_inline))

/* CALL(NB) with NB the constant 1..8 that equals nb (HEAD_BLOCK at most): one inlined copy per head count, so a
 * head block's accumulators are a fixed number and stay in registers. */
#define BY_HEAD_COUNT(nb, CALL) \
  switch (nb) {                 \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    case 4: CALL(4); break;     \
    case 5: CALL(5); break;     \
    case 6: CALL(6); break;     \
    case 7: CALL(7); break;     \
    default: CALL(8); break;    \
  }

/* The allowed keys of a query at position qp, in increasing s, into allowed; returns how many (0 for a padding
 * query). */
static int64_t allowed_keys(int64_t S, const int64_t *kpos, const uint8_t *kvalid, int64_t qp, int64_t *allowed) {
  int64_t count = 0;
  if (qp < 0) return 0;
  for (int64_t s = 0; s < S; s++)
    if (kvalid[s] && kpos[s] <= qp) allowed[count++] = s;
  return count;
}

/* Whether the allowed keys are exactly 0 .. count - 1 (they increase, so the last one says it). */
static inline int allowed_from_zero(const int64_t *allowed, int64_t count) {
  return count > 0 && allowed[count - 1] == count - 1;
}

/* Where a row's values lie, index range by index range: indices below end[0] at base[0], then below end[1] at
 * base[1], ..., up to end[n - 1] (each base the start of a cache row's values, indexed as the row's own). */
typedef struct {
  const float **base;
  int64_t *end;
  int n;
} vsegments;

/* Sequential dot products: out[b * OS + s] = sum over d in increasing d of a[b * AS + d] * kt[d * S16 + s], for
 * NB rows of a and the KB blocks of 16 columns starting at s. Each output is one accumulator over d, as a loop over
 * one column at a time would add it; the NB x KB accumulators only keep more of those sums in flight at once. */
INLINE void dots_tile(const float *a, int64_t AS, const float *kt, int64_t S16, int64_t D, int64_t s, float *out,
                      int64_t OS, const int NB, const int KB) {
  v16 acc[HEAD_BLOCK][8];
  for (int b = 0; b < NB; b++)
    for (int j = 0; j < KB; j++) acc[b][j] = (v16){0};
  for (int64_t d = 0; d < D; d++) {
    v16 kv[8];
    for (int j = 0; j < KB; j++) LOAD_HELD(kv[j], kt + d * S16 + s + 16 * j);
    for (int b = 0; b < NB; b++)
      for (int j = 0; j < KB; j++) acc[b][j] = fma16(splat(a[b * AS + d]), kv[j], acc[b][j]);
  }
  for (int b = 0; b < NB; b++)
    for (int j = 0; j < KB; j++) memcpy(out + b * OS + s + 16 * j, &acc[b][j], 64);
}

/* dots_tile over the columns [0, end), 16 at a time (end rounded up: the columns past the keys are zeros). */
INLINE void column_dots(const float *a, int64_t AS, const float *kt, int64_t S16, int64_t D, int64_t end, float *out,
                        int64_t OS, const int NB) {
  const int KB = NB == 1 ? 8 : NB == 2 ? 6 : NB <= 4 ? 4 : 2;
  int64_t s = 0;
  for (; s + 16 * KB <= end; s += 16 * KB) dots_tile(a, AS, kt, S16, D, s, out, OS, NB, KB);
  for (; s < end; s += 16) dots_tile(a, AS, kt, S16, D, s, out, OS, NB, 1);
}

/* The weighted rows of one chunk of d, [d0, d0 + 16 DB) within D: for each of NB weight rows b,
 *   sum over the allowed keys i in increasing i of w[b * WS + i] * rows[allowed[i] * D + d]   (one accumulator per d)
 * divided by div[b] when div is given, stored at out + obase[b] + d in storage type tout. Row i starts at
 * rows + i * RS, or, with segments (SEGMENTED, vseg), at the base of the segment holding i (where that base holds the
 * same values: a prefix shared with other cache rows, read where they read it, already in the core's cache); a vector
 * read past D's last multiple of 16 must stay inside the buffer (16 floats of slack). */
INLINE void weighted_rows_tile(const float *w, int64_t WS, const float *rows, int64_t RS, int64_t D,
                               const int64_t *allowed, int64_t count, const vsegments *vseg,
                               int64_t d0, const float *div, void *out, const int64_t *obase,
                               int tout, const int NB, const int DB, const int SEGMENTED) {
  v16 acc[HEAD_BLOCK][4];
  int nv = (int)((D - d0 + 15) / 16), seg = 0;
  for (int b = 0; b < NB; b++)
    for (int j = 0; j < DB; j++) acc[b][j] = (v16){0};
  for (int64_t i = 0; i < count; i++) {
    const float *base = rows;
    if (SEGMENTED) { /* the keys increase: the segment only moves forward */
      while (allowed[i] >= vseg->end[seg]) seg++;
      base = vseg->base[seg];
    }
    const float *row = base + allowed[i] * RS + d0;
    for (int j = 0; j < DB; j++) {
      if (j >= nv) break;
      v16 x;
      LOAD_HELD(x, row + 16 * j);
      for (int b = 0; b < NB; b++) acc[b][j] = fma16(splat(w[b * WS + i]), x, acc[b][j]);
    }
  }
  for (int b = 0; b < NB; b++)
    for (int j = 0; j < DB && j < nv; j++) {
      int n = (int)(D - d0 - 16 * j < 16 ? D - d0 - 16 * j : 16);
      store16(out, obase[b] + d0 + 16 * j, div ? acc[b][j] / div[b] : acc[b][j], tout, n);
    }
}

INLINE void weighted_rows(const float *w, int64_t WS, const float *rows, int64_t RS, int64_t D,
                          const int64_t *allowed, int64_t count, const vsegments *vseg, const float *div, void *out,
                          const int64_t *obase, int tout, const int NB) {
  const int DB = NB <= 3 ? 4 : 2;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * DB)
    if (vseg) /* a copy of the loop of its own: the common one keeps its code */
      weighted_rows_tile(w, WS, rows, RS, D, allowed, count, vseg, d0, div, out, obase, tout, NB, DB, 1);
    else
      weighted_rows_tile(w, WS, rows, RS, D, allowed, count, NULL, d0, div, out, obase, tout, NB, DB, 0);
}

/* acc[allowed[i] * D + d] += w[b * WS + i] * x[b * XS + d], for each allowed key i and then b = 0 .. NB - 1 in
 * that order (x's rows have 16 floats of slack). */
INLINE void scatter_rows(float *acc, int64_t D, const int64_t *allowed, int64_t count, const float *w, int64_t WS,
                         const float *x, int64_t XS, const int NB) {
  const int DB = NB <= 3 ? 4 : 2;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * DB) {
    int nv = (int)((D - d0 + 15) / 16);
    v16 xv[HEAD_BLOCK][4];
    for (int b = 0; b < NB; b++)
      for (int j = 0; j < DB; j++) {
        xv[b][j] = (v16){0};
        if (j < nv) memcpy(&xv[b][j], x + b * XS + d0 + 16 * j, 64);
      }
    for (int64_t i = 0; i < count; i++) {
      float *row = acc + allowed[i] * D + d0;
      for (int j = 0; j < DB; j++) {
        if (j >= nv) break;
        int n = (int)(D - d0 - 16 * j < 16 ? D - d0 - 16 * j : 16);
        v16 a = load16(row, 16 * j, F32, n);
        for (int b = 0; b < NB; b++) a = fma16(splat(w[b * WS + i]), xv[b][j], a);
        store16(row, 16 * j, a, F32, n);
      }
    }
  }
}

/* The largest allowed score: a scan in increasing i that keeps a NaN once seen (so the result is the same bits
 * whatever the path); allowed keys 0 .. count - 1 without a NaN take a vector max (max is exact). */
static float allowed_max(const float *sc, const int64_t *allowed, int64_t count) {
  if (allowed_from_zero(allowed, count)) {
    int any_nan;
    float mx = vector_max(sc, count, &any_nan);
    if (!any_nan) return mx;
  }
  float mx = -INFINITY;
  for (int64_t i = 0; i < count; i++)
    if (sc[allowed[i]] > mx || sc[allowed[i]] != sc[allowed[i]]) mx = sc[allowed[i]];
  return mx;
}

/* p_i = exp(score_{allowed i} - shift) into p (zero-padded to a multiple of 16) */
static void allowed_exp(const float *sc, const int64_t *allowed, int64_t count, float shift, float *p) {
  int64_t i = 0;
  if (allowed_from_zero(allowed, count))
    for (; i + 16 <= count; i += 16) {
      v16 x;
      memcpy(&x, sc + i, 64);
      v16 e = fexp16(x - shift);
      memcpy(p + i, &e, 64);
    }
  for (; i < count; i += 16) {
    int n = (int)(count - i < 16 ? count - i : 16);
    v16 x = splat(shift);
    for (int j = 0; j < n; j++) x[j] = sc[allowed[i + j]];
    v16 e = fexp16(x - shift);
    for (int j = 0; j < 16; j++) p[i + j] = j < n ? e[j] : 0.0f;
  }
}

typedef struct {
  float *kt, *vs, *sc, *p, *qv; /* sc, p: HEAD_BLOCK rows of S16 + 16; qv: HEAD_BLOCK rows of D + 16 */
  int64_t *allowed;
  const float *vrows; /* the values the weighted sum reads: vs, or the float32 input itself (use_values) */
  int64_t vstride;
  vsegments *vseg; /* values read in place and shared with the rows before (attention_fwd_parts), else NULL */
} attn_scratch;

/* Where the forward reads row r's values through head kvh: float32 values whose head dimension is whole vectors
 * are read where they are (no copy: at long windows a copy outgrows the core's cache); others from the float32
 * copy in vs. Returns the vs to fill (NULL: none). The values and their order are the same either way. */
static float *use_values(const attn_shape *sh, const void *v, int64_t r, int64_t kvh, attn_scratch *w) {
  w->vseg = NULL;
  if (sh->tk == F32 && sh->D % 16 == 0) {
    w->vrows = (const float *)v + r * sh->k_row + kvh * sh->D;
    w->vstride = sh->k_s;
    return NULL;
  }
  w->vrows = w->vs;
  w->vstride = sh->D;
  return w->vs;
}

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

/* NB query heads at qbase[] (one position, count > 0 allowed keys in w->allowed): their values into w->qv, then
 * score_i = scale * (sequential sum over d), m, p_i, l (lanes16 over p in i order), and out = weighted values / l,
 * lse = m + log(l). */
INLINE void attend_heads(const attn_shape *sh, const void *q, const int64_t *qbase, int64_t count, void *out,
                         float *lse, int64_t S16, attn_scratch *w, const int NB) {
  int64_t D = sh->D, SS = S16 + 16, QS = D + 16;
  for (int b = 0; b < NB; b++)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      v16 x = load16(q, qbase[b] + d0, sh->tq, (int)(D - d0 < 16 ? D - d0 : 16));
      memcpy(w->qv + b * QS + d0, &x, 64);
    }
  int64_t end = w->allowed[count - 1] + 1;
  column_dots(w->qv, QS, w->kt, S16, D, end, w->sc, SS, NB);
  float l[HEAD_BLOCK];
  for (int b = 0; b < NB; b++) {
    float *sc = w->sc + b * SS;
    for (int64_t s = 0; s < end; s += 16) {
      v16 x;
      memcpy(&x, sc + s, 64);
      x = x * sh->scale;
      memcpy(sc + s, &x, 64);
    }
    float mx = allowed_max(sc, w->allowed, count);
    allowed_exp(sc, w->allowed, count, mx, w->p + b * SS);
    v16 lacc = {0};
    for (int64_t i = 0; i < count; i += 16) {
      v16 pv;
      memcpy(&pv, w->p + b * SS + i, 64);
      lacc += pv;
    }
    l[b] = tree16(lacc);
    lse[b] = mx + logf(l[b]);
  }
  weighted_rows(w->p, SS, w->vrows, w->vstride, D, w->allowed, count, w->vseg, l, out, qbase, sh->tq, NB);
}

/* Every query of row r through key/value head kvh (its G query heads, all T positions), over the keys and values
 * loaded in w (load_kv). The query heads of a position share its allowed keys; up to HEAD_BLOCK of them are
 * computed in one pass over the keys and one over the values (each head's sums in the order above, its own
 * accumulators), so a head block reads the loaded keys and values once, not once per head. */
static void attend_row(const attn_shape *sh, const void *q, const int64_t *qpos, const int64_t *kpos,
                       const uint8_t *kvalid, void *out, float *lse, int64_t r, int64_t kvh, int64_t S16,
                       attn_scratch *w) {
  int64_t G = sh->H / sh->Hkv, T = sh->T, D = sh->D, H = sh->H;
  const int64_t *kp = kpos + (sh->pos_rows > 1 ? r * sh->S : 0);
  const uint8_t *kval = kvalid + (sh->pos_rows > 1 ? r * sh->S : 0);
  for (int64_t t = 0; t < T; t++) {
    int64_t count = allowed_keys(sh->S, kp, kval, qpos[r * T + t], w->allowed);
    for (int64_t g0 = 0; g0 < G; g0 += HEAD_BLOCK) {
      int nb = (int)(G - g0 < HEAD_BLOCK ? G - g0 : HEAD_BLOCK);
      int64_t qbase[HEAD_BLOCK];
      float *lse_at = lse + (r * T + t) * H + kvh * G + g0;
      for (int b = 0; b < nb; b++) qbase[b] = r * sh->q_row + t * sh->q_t + (kvh * G + g0 + b) * D;
      if (count == 0) { /* a padding query, or one with no key: zeros, lse = -inf */
        for (int b = 0; b < nb; b++) {
          for (int64_t d = 0; d < D; d++) store1(out, qbase[b] + d, 0.0f, sh->tq);
          lse_at[b] = -INFINITY;
        }
        continue;
      }
#define ATTEND(NB) attend_heads(sh, q, qbase, count, out, lse_at, S16, w, NB)
      BY_HEAD_COUNT(nb, ATTEND)
#undef ATTEND
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
      load_kv(&sh, k, v, r, kvh, w.kt, use_values(&sh, v, r, kvh, &w), S16);
      attend_row(&sh, q, qpos, kpos, kvalid, out, lse, r, kvh, S16, &w);
    }
    scratch_free(&w);
  }
  return failed;
}

/* attention_fwd (one query per row) with rows taken in parts: part c is the rows order[starts[c]..starts[c+1]),
 * and each row after a part's first shares the keys and values of its indices below reload[row] with the row before
 * it in the part, bit for bit (the caller guarantees it: copies of the same prefix). A part's first row loads its whole
 * cache row; each later one loads only its indices from reload[row] on, so a prefix shared by a part's rows is
 * transposed once per (part, key/value head), not once per row; values read in place (use_values) are read below
 * reload[row] where the row before read them, so a shared prefix's values come from memory once per part too.
 * Every row's queries, scores and sums are those of attention_fwd: the same values in the same order. */
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
    int64_t c = item / sh->Hkv, kvh = item % sh->Hkv, size = starts[c + 1] - starts[c];
    attn_scratch w;
    /* values read in place: each row reads its indices below reload[row] where the row before it read them */
    vsegments seg = {malloc((size_t)(size + 1) * sizeof(float *)), malloc((size_t)(size + 1) * sizeof(int64_t)), 0};
    if (!scratch_alloc(&w, sh->S, S16, sh->D) || !seg.base || !seg.end) {
      failed = 1;
    } else {
      for (int64_t j = starts[c]; j < starts[c + 1]; j++) {
        int64_t r = order[j], cut = j == starts[c] ? 0 : reload[r] < sh->S ? reload[r] : sh->S;
        float *vs = use_values(sh, v, r, kvh, &w);
        if (j == starts[c])
          load_kv(sh, k, v, r, kvh, w.kt, vs, S16);
        else
          load_kv_from(sh, k, v, r, kvh, w.kt, vs, S16, cut);
        if (!vs) { /* the segments below cut as the row before had them, then this row's own values */
          int n = 0;
          while (n < seg.n && (n == 0 ? 0 : seg.end[n - 1]) < cut) {
            if (seg.end[n] > cut) seg.end[n] = cut;
            n++;
          }
          seg.base[n] = w.vrows, seg.end[n] = INT64_MAX, seg.n = n + 1;
          w.vseg = &seg;
        }
        attend_row(sh, q, qpos, kpos, kvalid, out, lse, r, kvh, S16, &w);
      }
    }
    scratch_free(&w);
    free(seg.base);
    free(seg.end);
  }
  return failed;
}

/* Gradients of attention_fwd given dout (same layout as out) and the forward's out and lse:
 *   P_i = exp(score_i - lse);  Dq = sequential sum over d of dout[d] out[d]
 *   dP_i = sequential sum over d of dout[d] v_i[d];  dS_i = P_i (dP_i - Dq) scale
 *   dq[d] = sequential sum over allowed i of dS_i k_i[d]
 *   dk_i += dS_i q, dv_i += P_i dout, over queries t then heads g in increasing order.
 * dq has q's layout; dk and dv are contiguous [R, S, Hkv, D] in k's storage type. */

typedef struct {
  float *kt, *vs, *vt, *ks, *sc, *p, *dp, *qv, *dov, *dkacc, *dvacc; /* sc, p, dp: HEAD_BLOCK rows of S16 + 16 */
  int64_t *allowed;
} grad_scratch;

static int grad_alloc(grad_scratch *w, int64_t S, int64_t S16, int64_t D) {
  size_t rows = (size_t)(HEAD_BLOCK * (S16 + 16)) * 4, heads = (size_t)(HEAD_BLOCK * (D + 16)) * 4;
  w->kt = malloc((size_t)(D * S16) * 4);
  w->vt = malloc((size_t)(D * S16) * 4);
  w->vs = malloc((size_t)(S16 * D + 16) * 4);
  w->ks = malloc((size_t)(S16 * D + 16) * 4);
  w->sc = malloc(rows);
  w->p = malloc(rows);
  w->dp = malloc(rows);
  w->qv = malloc(heads);
  w->dov = malloc(heads);
  w->dkacc = calloc((size_t)(S * D + 16), 4);
  w->dvacc = calloc((size_t)(S * D + 16), 4);
  w->allowed = malloc((size_t)(S + 1) * sizeof(int64_t));
  return w->kt && w->vt && w->vs && w->ks && w->sc && w->p && w->dp && w->qv && w->dov && w->dkacc && w->dvacc &&
         w->allowed;
}

static void grad_free(grad_scratch *w) {
  free(w->kt);
  free(w->vt);
  free(w->vs);
  free(w->ks);
  free(w->sc);
  free(w->p);
  free(w->dp);
  free(w->qv);
  free(w->dov);
  free(w->dkacc);
  free(w->dvacc);
  free(w->allowed);
}

/* The gradients of NB query heads at qbase[] (one position, count > 0 allowed keys): dq stored, dk and dv added
 * into w->dkacc and w->dvacc (each key's terms head after head). */
INLINE void grad_heads(const attn_shape *sh, const void *q, const void *out, const void *dout, const float *lse_at,
                       void *dq, const int64_t *qbase, int64_t count, int64_t S16, grad_scratch *w, const int NB) {
  int64_t D = sh->D, SS = S16 + 16, QS = D + 16;
  const int64_t *allowed = w->allowed;
  float dsum[HEAD_BLOCK];
  for (int b = 0; b < NB; b++) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      v16 x = load16(q, qbase[b] + d0, sh->tq, (int)(D - d0 < 16 ? D - d0 : 16));
      memcpy(w->qv + b * QS + d0, &x, 64);
    }
    float *dov = w->dov + b * QS, acc = 0.0f;
    for (int64_t d = 0; d < D; d++) {
      dov[d] = load1(dout, qbase[b] + d, sh->tq);
      acc += dov[d] * load1(out, qbase[b] + d, sh->tq);
    }
    for (int64_t d = D; d < QS; d++) dov[d] = 0.0f;
    dsum[b] = acc;
  }
  int64_t end = allowed[count - 1] + 1;
  column_dots(w->qv, QS, w->kt, S16, D, end, w->sc, SS, NB);  /* the forward's scores, before scaling */
  column_dots(w->dov, QS, w->vt, S16, D, end, w->dp, SS, NB); /* dP */
  int from_zero = allowed_from_zero(allowed, count);
  for (int b = 0; b < NB; b++) {
    float *sc = w->sc + b * SS, *p = w->p + b * SS, *dp = w->dp + b * SS;
    for (int64_t s = 0; s < end; s += 16) {
      v16 x;
      memcpy(&x, sc + s, 64);
      x = x * sh->scale;
      memcpy(sc + s, &x, 64);
    }
    allowed_exp(sc, allowed, count, lse_at[b], p);
    /* dS_i, in place of dP, compacted to i (allowed i's key is allowed[i] >= i: each is read before it is written) */
    int64_t i = 0;
    if (from_zero)
      for (; i + 16 <= count; i += 16) {
        v16 pv, dv;
        memcpy(&pv, p + i, 64);
        memcpy(&dv, dp + i, 64);
        v16 ds = pv * (dv - dsum[b]) * sh->scale;
        memcpy(dp + i, &ds, 64);
      }
    for (; i < count; i++) dp[i] = p[i] * (dp[allowed[i]] - dsum[b]) * sh->scale;
  }
  weighted_rows(w->dp, SS, w->ks, D, D, allowed, count, NULL, NULL, dq, qbase, sh->tq, NB);
  scatter_rows(w->dkacc, D, allowed, count, w->dp, SS, w->qv, QS, NB);
  scatter_rows(w->dvacc, D, allowed, count, w->p, SS, w->dov, QS, NB);
}

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
    grad_scratch w;
    if (!grad_alloc(&w, S, S16, D)) {
      failed = 1;
    } else {
      load_kv(&sh, k, v, r, kvh, w.kt, w.vs, S16);
      for (int64_t d = 0; d < D; d++)
        for (int64_t s = 0; s < S16; s++) {
          w.vt[d * S16 + s] = s < S ? w.vs[s * D + d] : 0.0f;
          if (s < S) w.ks[s * D + d] = w.kt[d * S16 + s];
        }
      const int64_t *kp = kpos + (pos_rows > 1 ? r * S : 0);
      const uint8_t *kval = kvalid + (pos_rows > 1 ? r * S : 0);
      for (int64_t t = 0; t < T; t++) {
        int64_t count = allowed_keys(S, kp, kval, qpos[r * T + t], w.allowed);
        for (int64_t g0 = 0; g0 < G; g0 += HEAD_BLOCK) {
          int nb = (int)(G - g0 < HEAD_BLOCK ? G - g0 : HEAD_BLOCK);
          int64_t qbase[HEAD_BLOCK];
          const float *lse_at = lse + (r * T + t) * H + kvh * G + g0;
          for (int b = 0; b < nb; b++) qbase[b] = r * q_row + t * sh.q_t + (kvh * G + g0 + b) * D;
          if (count == 0) {
            for (int b = 0; b < nb; b++)
              for (int64_t d = 0; d < D; d++) store1(dq, qbase[b] + d, 0.0f, tq);
            continue;
          }
#define GRAD(NB) grad_heads(&sh, q, out, dout, lse_at, dq, qbase, count, S16, &w, NB)
          BY_HEAD_COUNT(nb, GRAD)
#undef GRAD
        }
      }
      for (int64_t s = 0; s < S; s++) {
        int64_t base = ((r * S + s) * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; d++) {
          store1(dk, base + d, w.dkacc[s * D + d], tk);
          store1(dv, base + d, w.dvacc[s * D + d], tk);
        }
      }
    }
    grad_free(&w);
  }
  return failed;
}
