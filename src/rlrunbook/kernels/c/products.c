/* Products: gemm_nt (lanes16, pairs16 for two bf16 inputs) and gemm_seq (sequential) (orders and contract: fixed_order.h) */
#include "fixed_order.h"

#include <unistd.h>

/* -- gemm_nt: C[m, n] = bias[n] + sum over k of A[m, k] B[n, k] ----------------------------------------
 * float32 inputs: lanes16 order. Two bfloat16 inputs: pairs16 order, the order of the VDPBF16PS
 * instruction: in each block of 32 k, lane j adds the product at k = 2j + 1, then the one at k = 2j (each
 * product exact in float32), and the lanes are added by the lanes16 tree. On CPUs with AVX512-BF16 the
 * instruction itself computes each step; elsewhere the same two additions in float32. Other dtype pairs
 * are converted to float32 first. */

#if defined(__AVX512F__) /* a micro-tile's 16-lane accumulators must fit the vector registers (32 on AVX-512) */
/* 24 accumulators, the 6 rows of A held and B's rows loaded one at a time: 10 loads per 24 multiply-adds (a 4 x 4
 * tile: 8 per 16), so a third less of B read from L2 per multiply-add (4-13% faster on an Intel Xeon's training
 * shapes, paired). At 7, 8 and 13-16 rows (a decode step's), where 6-row groups would compute rows in vain, an
 * 8 x 3 tile (also 24 accumulators) computes none: 6% faster at 16 rows on that Xeon, paired. */
#define NT_ROWS 6
#define NT_COLS 4
#define NT_TALL_ROWS 8
#define NT_TALL_COLS 3
#else
#define NT_ROWS 2
#define NT_COLS 3
#endif
#define NT_TILE_MAX 24 /* accumulators of the largest tile */
#define NT_PANEL 64 /* B rows per work item (twice as many for products of many rows where L2 allows: nt_panel_rows) */
#define NT_PREFETCH_ROWS 64 /* work items of at most this many A rows fetch the next panel ahead */

typedef struct {
  const void *a, *b;
  int64_t lda, ldb, K;
  int rows, cols;
  const char *ahead; /* lines of the next panel to request into L2 during this tile, spread over its k steps */
  int64_t ahead_lines;
} nt_args;

/* Where a tile requests the lines of t->ahead: `per_step` of them at each of its k steps (all by its last step), so
 * the memory stays busy while it computes. A decode step's 16-row products over weights read at 10.5-11.7 GB/s on an
 * Intel Xeon went 29.4 -> 26.7 ms (paired) from asking for the same lines at each tile's start. */
typedef struct {
  const char *line;
  int64_t left, per_step; /* lines still to request, and how many per step */
} ahead_cursor;

static inline ahead_cursor ahead_of(const nt_args *t, int64_t steps) {
  return (ahead_cursor){t->ahead, t->ahead_lines, (t->ahead_lines + steps - 1) / steps};
}

static inline void request_ahead(ahead_cursor *c) {
  int64_t n = c->per_step < c->left ? c->per_step : c->left;
  for (int64_t q = 0; q < n; q++, c->line += 64) __builtin_prefetch(c->line, 0, 2);
  c->left -= n;
}

/* out[i] = tree16(acc[i]) for a micro-tile's n accumulators (16 at once where there are 16 or 24) */
static inline void reduce_tile(const v16 *acc, int n, float *out) {
  if (n == 16 || n == 24) {
    v16 sums = tree16x16(acc);
    memcpy(out, &sums, 64);
    if (n == 24) {
      const v16 rest[16] = {acc[16], acc[17], acc[18], acc[19], acc[20], acc[21], acc[22], acc[23]};
      v16 more = tree16x16(rest);
      memcpy(out + 16, &more, 32);
    }
    return;
  }
  for (int i = 0; i < n; i++) out[i] = tree16(acc[i]);
}

#define TILE_ROWS NT_ROWS /* the tiles of large products, without requests ahead; and of small ones, with */
#define TILE_COLS NT_COLS
#define TILE_NAME nt_tile_f32
#define TILE_AHEAD 0
#include "nt_tile_f32.h"
#undef TILE_NAME
#undef TILE_AHEAD
#define TILE_NAME nt_tile_f32_ahead
#define TILE_AHEAD 1
#include "nt_tile_f32.h"
#undef TILE_NAME
#undef TILE_AHEAD
#undef TILE_ROWS
#undef TILE_COLS
#ifdef NT_TALL_ROWS /* only ever for a few rows */
#define TILE_ROWS NT_TALL_ROWS
#define TILE_COLS NT_TALL_COLS
#define TILE_NAME nt_tile_f32_tall
#define TILE_AHEAD 1
#include "nt_tile_f32.h"
#undef TILE_NAME
#undef TILE_AHEAD
#undef TILE_ROWS
#undef TILE_COLS
#endif

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

/* Rows of the pairs16 tile: where the step is two float32 multiply-adds with masks, their temporaries need registers
 * that a 6-row tile's accumulators take (it spills on AVX-512 without the bf16 instruction). */
#if NT_BF16_INSTRUCTION || NT_ROWS < 4
#define NT_PAIR_ROWS NT_ROWS
#else
#define NT_PAIR_ROWS 4
#endif

static void nt_tile_bf16(const nt_args *t, float *out) {
  v16 acc[NT_PAIR_ROWS * NT_COLS];
  const uint16_t *ar[NT_PAIR_ROWS], *br[NT_COLS];
  for (int i = 0; i < NT_PAIR_ROWS; i++) ar[i] = (const uint16_t *)t->a + (i < t->rows ? i : 0) * t->lda;
  for (int j = 0; j < NT_COLS; j++) br[j] = (const uint16_t *)t->b + (j < t->cols ? j : 0) * t->ldb;
  for (int i = 0; i < NT_PAIR_ROWS * NT_COLS; i++) acc[i] = (v16){0};
  int64_t k = 0, K = t->K;
  ahead_cursor ahead = ahead_of(t, (K + 31) / 32);
  for (; k + 32 <= K; k += 32) {
    request_ahead(&ahead); /* a test and no request once every line is asked for (a bf16 tile: no hot loop here) */
    v16u av[NT_PAIR_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_PAIR_ROWS; i++) LOAD_HELD(av[i], ar[i] + k);
    for (int j = 0; j < NT_COLS; j++) {
      LOAD_HELD(bv[j], br[j] + k);
      for (int i = 0; i < NT_PAIR_ROWS; i++) acc[i * NT_COLS + j] = pair_step(acc[i * NT_COLS + j], av[i], bv[j]);
    }
  }
  if (k < K) {
    request_ahead(&ahead);
    v16u av[NT_PAIR_ROWS], bv[NT_COLS];
    for (int i = 0; i < NT_PAIR_ROWS; i++) av[i] = load32h(ar[i] + k, (int)(K - k));
    for (int j = 0; j < NT_COLS; j++) bv[j] = load32h(br[j] + k, (int)(K - k));
    for (int i = 0; i < NT_PAIR_ROWS; i++)
      for (int j = 0; j < NT_COLS; j++) acc[i * NT_COLS + j] = pair_step(acc[i * NT_COLS + j], av[i], bv[j]);
  }
  reduce_tile(acc, NT_PAIR_ROWS * NT_COLS, out);
}

/* The first B row of panel p of `panels` over `units` micro-tiles of `cols` columns (N rows in all; p = panels: N) */
static inline int64_t panel_start(int64_t p, int64_t panels, int64_t units, int64_t cols, int64_t N) {
  if (p >= panels) return N;
  int64_t n = p * units / panels * cols;
  return n < N ? n : N;
}

/* n rounded up to a multiple of `to` */
static inline int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

typedef void (*nt_tile_fn)(const nt_args *, float *);

/* What every work item of one gemm_nt shares */
typedef struct {
  const char *a, *b;
  int64_t la, lb, K, M, N;
  size_t esize;
  const float *bias;
  void *C;
  int tc;
  int64_t ldc, units, panels, rowblocks, chunks;
  int64_t b_first; /* the row of B that b points to (0; a coded product's panel: its first row) */
  int ahead;       /* whether items of few rows request the next panel of B ahead (not from a decoded panel) */
} nt_work;

/* Work item `item`: panel item % panels of B's rows, A's row group item / panels, in `rows` x `cols` tiles (constants
 * at each call, so that the stores unroll), by `tile`, or by `ahead_tile` where the item requests lines ahead. */
static inline __attribute__((always_inline)) void nt_item(const nt_work *w, int64_t item, nt_tile_fn tile,
                                                          nt_tile_fn ahead_tile, const int rows, const int cols) {
  int64_t p = item % w->panels, c = item / w->panels, N = w->N;
  int64_t n0 = panel_start(p, w->panels, w->units, cols, N), n1 = panel_start(p + 1, w->panels, w->units, cols, N);
  int64_t m0 = w->rowblocks * c / w->chunks * rows, m1 = w->rowblocks * (c + 1) / w->chunks * rows;
  if (m1 > w->M) m1 = w->M;
  /* With few rows (a decode step) the panel's first row group waits on memory and the others compute from L2: the
   * next panel's lines are requested into L2, a share per tile spread over its steps, so its reads overlap this
   * panel's work. */
  const char *next = NULL;
  int64_t next_lines = 0, per_tile = 0;
  if (w->ahead && m1 - m0 <= NT_PREFETCH_ROWS && n1 < N) {
    int64_t next_rows = panel_start(p + 2, w->panels, w->units, cols, N) - n1;
    int64_t tiles = (m1 - m0 + rows - 1) / rows * ((n1 - n0 + cols - 1) / cols);
    next = w->b + n1 * w->lb * (int64_t)w->esize;
    next_lines = (next_rows * w->lb * (int64_t)w->esize + 63) / 64;
    per_tile = (next_lines + tiles - 1) / tiles;
    tile = ahead_tile;
  }
  int64_t fetched = 0;
  for (int64_t m = m0; m < m1; m += rows)
    for (int64_t n = n0; n < n1; n += cols) {
      int64_t ahead = next_lines - fetched < per_tile ? next_lines - fetched : per_tile;
      nt_args t = {w->a + m * w->la * (int64_t)w->esize, w->b + (n - w->b_first) * w->lb * (int64_t)w->esize, w->la,
                   w->lb, w->K,
                   (int)(m1 - m < rows ? m1 - m : rows), (int)(n1 - n < cols ? n1 - n : cols),
                   next ? next + fetched * 64 : NULL, ahead};
      fetched += ahead;
      float out[rows * cols];
      tile(&t, out);
      for (int i = 0; i < t.rows; i++) {
        float *row = out + i * cols;
        if (w->bias)
          for (int j = 0; j < t.cols; j++) row[j] = row[j] + w->bias[n + j];
        if (w->tc == F32 && t.cols == cols) memcpy((float *)w->C + (m + i) * w->ldc + n, row, cols * 4);
        else
          for (int j = 0; j < t.cols; j++) store1(w->C, (m + i) * w->ldc + n + j, row[j], w->tc);
      }
    }
}

/* B rows per work item: 2 x NT_PANEL for a product of more than NT_PREFETCH_ROWS rows where such a panel takes at most
 * a quarter of a core's L2, else NT_PANEL. Each A row group then reads twice as many B rows per pass: the training
 * shapes' products ([2,019 x 576] by 576-3,072 rows) were 5-10% faster on an Intel Xeon with a 2 MiB L2, the 16-row
 * ones of decode slower (they keep NT_PANEL); a 1 MiB L2 (AMD Zen 4) keeps NT_PANEL for K = 576 too, and two
 * bfloat16 inputs keep it. The sums do not depend on the panels. */
/* A core's L2 cache in bytes (0 where the system does not say) */
static long l2_bytes(void) {
  static long l2 = -1;
  if (l2 < 0) {
    long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    l2 = size > 0 ? size : 0;
  }
  return l2;
}

static int64_t nt_panel_rows(int64_t M, int64_t K) { /* float32 panels: two bfloat16 inputs keep NT_PANEL */
  if (M <= NT_PREFETCH_ROWS) return NT_PANEL;
  return 2 * NT_PANEL * K * 4 <= l2_bytes() / 4 ? 2 * NT_PANEL : NT_PANEL;
}

/* The work items of a product of M rows of A by N rows of B over K: its tile (`tall`: NT_TALL_ROWS x NT_TALL_COLS,
 * else NT_ROWS x NT_COLS, or NT_PAIR_ROWS x NT_COLS for two bfloat16 inputs), panels of B rows and groups of A rows,
 * enough groups to feed every thread. The panels (about NT_PANEL rows, whole micro-tiles) are as many as a multiple
 * of the threads where there are at least as many: 9 panels of a 576-row B on 2 threads left one thread idle for a
 * ninth of the product. A and B's pointers are left for the caller. */
static nt_work nt_plan(int pairs, int64_t M, int64_t N, int64_t K, const float *bias, void *C, int tc, int64_t ldc,
                       int nthreads, int *tall) {
  int64_t tile_rows = pairs ? NT_PAIR_ROWS : NT_ROWS, tile_cols = NT_COLS;
  *tall = 0;
#ifdef NT_TALL_ROWS
  if (!pairs && M <= 2 * NT_TALL_ROWS && padded(M, NT_TALL_ROWS) < padded(M, NT_ROWS)) { /* 7, 8, 13-16 rows */
    tile_rows = NT_TALL_ROWS, tile_cols = NT_TALL_COLS;
    *tall = 1;
  }
#endif
  int64_t panel_rows = pairs ? NT_PANEL : nt_panel_rows(M, K);
  int64_t units = (N + tile_cols - 1) / tile_cols, panels = (N + panel_rows - 1) / panel_rows;
  int64_t rowblocks = (M + tile_rows - 1) / tile_rows;
  if (nthreads > 1 && panels >= nthreads && panels % nthreads) {
    panels += nthreads - panels % nthreads;
    if (panels > units) panels = units;
  }
  int64_t chunks = panels >= 4 * (int64_t)nthreads ? 1 : (4 * (int64_t)nthreads + panels - 1) / panels;
  if (chunks > rowblocks) chunks = rowblocks;
  return (nt_work){NULL, NULL, 0, 0, K, M, N, pairs ? 2 : 4, bias, C, tc, ldc, units, panels, rowblocks, chunks, 0, 1};
}

/* One work item of a plan by its tile */
static inline void nt_run_item(const nt_work *w, int64_t item, int pairs, int tall) {
#ifdef NT_TALL_ROWS
  if (tall) nt_item(w, item, nt_tile_f32_tall, nt_tile_f32_tall, NT_TALL_ROWS, NT_TALL_COLS);
  else
#endif
  if (pairs) nt_item(w, item, nt_tile_bf16, nt_tile_bf16, NT_PAIR_ROWS, NT_COLS);
  else nt_item(w, item, nt_tile_f32, nt_tile_f32_ahead, NT_ROWS, NT_COLS);
  (void)tall;
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
  int tall;
  nt_work w = nt_plan(pairs, M, N, K, bias, C, tc, ldc, nthreads, &tall);
  w.a = a, w.b = b, w.la = la, w.lb = lb;
  int64_t items = w.panels * w.chunks;
#pragma omp parallel for schedule(static) num_threads(threads_for(items, nthreads))
  for (int64_t item = 0; item < items; item++) nt_run_item(&w, item, pairs, tall);
  free(a32);
  free(b32);
  return 0;
}

/* -- coded weights: a float32 matrix stored in fewer bytes, decoded to the very same values --------------------
 * A frozen weight whose values all have a short exact form (a checkpoint quantized before it was converted to float32,
 * or one stored in bfloat16) is kept in that form too, and a product over it decodes each panel of B rows into a
 * float32 buffer that the tile then reads as it reads B: the same values in the same order, so the same bits, with
 * 2-5.3 times fewer of the weight's bytes read from memory (a decode step's products wait on them). Per row, in blocks
 * of CODED_BLOCK values along K (K a multiple of it):
 *   CODED_Q4: 4-bit codes q (block byte j: value j in its low half, value j + 16 in its high half) with a float32
 *             scale d and offset m per block: value = d * q + m, as coded_row computes it;
 *   CODED_Q8: signed 8-bit codes with a scale per block: value = d * q;
 *   CODED_BF16: the value's upper 16 bits (its lower 16 are zero).
 * code_weight finds the codes and checks every value by decoding it with the function the product uses. */
#define CODED_BLOCK 32
#define CODED_Q4 1
#define CODED_Q8 2
#define CODED_BF16 3

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* 16 bytes (unsigned or signed) or 16 half-words at p, each widened to a 32-bit lane (one instruction on AVX-512 and
 * two on AVX2: GCC lowers a generic vector conversion of bytes to one lane at a time) */
static inline v16i widen_u8(const uint8_t *p) {
  v16i out;
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  memcpy(&out, &w, 64);
#elif defined(__AVX2__)
  __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
  memcpy(&out, &lo, 32);
  memcpy((char *)&out + 32, &hi, 32);
#else
  for (int j = 0; j < 16; j++) out[j] = p[j];
#endif
  return out;
}

static inline v16i widen_i8(const uint8_t *p) {
  v16i out;
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
  memcpy(&out, &w, 64);
#elif defined(__AVX2__)
  __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
  __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
  memcpy(&out, &lo, 32);
  memcpy((char *)&out + 32, &hi, 32);
#else
  for (int j = 0; j < 16; j++) out[j] = (int8_t)p[j];
#endif
  return out;
}

static inline v16i widen_u16(const uint8_t *p) {
  v16i out;
#if defined(__AVX512F__)
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  memcpy(&out, &w, 64);
#elif defined(__AVX2__)
  __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
  memcpy(&out, &lo, 32);
  memcpy((char *)&out + 32, &hi, 32);
#else
  for (int j = 0; j < 16; j++) {
    uint16_t h;
    memcpy(&h, p + 2 * j, 2);
    out[j] = h;
  }
#endif
  return out;
}

/* Bytes of codes per row of K values */
static inline int64_t coded_row_bytes(int kind, int64_t K) {
  return kind == CODED_Q4 ? K / 2 : kind == CODED_Q8 ? K : 2 * K;
}

/* Row n's K values into out. One compiled copy (never inlined), which the encoder's check and every product call:
 * whatever the compiler does with a product and a sum (a fused multiply-add or not), the values checked are the
 * values read. */
__attribute__((noinline)) static void coded_row(int kind, const uint8_t *codes, const float *scales,
                                                const float *offsets, int64_t n, int64_t K, float *out) {
  int64_t blocks = K / CODED_BLOCK;
  const uint8_t *row = codes + n * coded_row_bytes(kind, K);
  for (int64_t b = 0; b < blocks; b++) {
    float *o = out + b * CODED_BLOCK;
    if (kind == CODED_BF16) {
      for (int h = 0; h < 2; h++) {
        v16i wide = widen_u16(row + (b * CODED_BLOCK + 16 * h) * 2) << 16;
        memcpy(o + 16 * h, &wide, 64);
      }
      continue;
    }
    v16 d = splat(scales[n * blocks + b]);
    if (kind == CODED_Q8) {
      for (int h = 0; h < 2; h++) {
        v16 x = __builtin_convertvector(widen_i8(row + b * CODED_BLOCK + 16 * h), v16) * d;
        memcpy(o + 16 * h, &x, 64);
      }
      continue;
    }
    v16i q = widen_u8(row + b * (CODED_BLOCK / 2));
    v16 m = splat(offsets[n * blocks + b]);
    v16 lo = __builtin_convertvector(q & 15, v16) * d, hi = __builtin_convertvector(q >> 4, v16) * d;
    lo = lo + m, hi = hi + m;
    memcpy(o, &lo, 64);
    memcpy(o + 16, &hi, 64);
  }
}

/* x rounded to the nearest half-precision value (ties to even; float32 arithmetic, no f16 type needed), and that
 * value's spacing; 0 where x is not a positive finite value within half precision's range. */
static float nearest_half(float x, float *spacing) {
  *spacing = 0.0f;
  if (!(x > 0.0f) || x > 65504.0f) return 0.0f;
  int e;
  frexpf(x, &e); /* x = f 2^e, f in [0.5, 1) */
  float ulp = ldexpf(1.0f, (e - 1 < -14 ? -14 : e - 1) - 10);
  *spacing = ulp;
  return nearbyintf(x / ulp) * ulp;
}

/* Block b of row n: codes, scale and offset such that coded_row gives back its values bit for bit; 1 where none
 * was found. The scale is tried at the half-precision value nearest the block's spread over the code range and at
 * its neighbours (quantizers store it in half precision); the offset is the block's least value (its code 0). */
static int code_block(int kind, const float *w, int64_t n, int64_t b, int64_t K, uint8_t *codes, float *scales,
                      float *offsets) {
  int64_t blocks = K / CODED_BLOCK;
  uint8_t *row = codes + n * coded_row_bytes(kind, K);
  if (kind == CODED_BF16) {
    for (int i = 0; i < CODED_BLOCK; i++) {
      uint32_t bits;
      memcpy(&bits, w + i, 4);
      if (bits & 0xffff) return 1;
      uint16_t top = (uint16_t)(bits >> 16);
      memcpy(row + (b * CODED_BLOCK + i) * 2, &top, 2);
    }
    return 0;
  }
  float lo = w[0], hi = w[0], amax = 0.0f;
  for (int i = 0; i < CODED_BLOCK; i++) {
    if (!isfinite(w[i])) return 1;
    lo = w[i] < lo ? w[i] : lo, hi = w[i] > hi ? w[i] : hi;
    amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
  }
  float spacing, est = nearest_half(kind == CODED_Q4 ? (hi - lo) / 15.0f : amax / 127.0f, &spacing);
  const float tries[4] = {est, est + spacing, est - spacing, est - spacing / 2};
  float out[CODED_BLOCK];
  for (int t = 0; t < 4; t++) {
    float d = hi == lo && kind == CODED_Q4 ? 0.0f : tries[t];
    if (d < 0.0f || (d == 0.0f && kind == CODED_Q8 && amax != 0.0f)) continue;
    scales[n * blocks + b] = d;
    if (kind == CODED_Q4) offsets[n * blocks + b] = lo;
    for (int i = 0; i < CODED_BLOCK; i++) {
      float q = d == 0.0f ? 0.0f : nearbyintf((kind == CODED_Q4 ? w[i] - lo : w[i]) / d);
      if (kind == CODED_Q4) {
        int c = q < 0.0f ? 0 : q > 15.0f ? 15 : (int)q;
        uint8_t *at = row + b * (CODED_BLOCK / 2) + i % 16;
        *at = i < 16 ? (uint8_t)((*at & 0xf0) | c) : (uint8_t)((*at & 0x0f) | (c << 4));
      } else {
        int c = q < -128.0f ? -128 : q > 127.0f ? 127 : (int)q;
        row[b * CODED_BLOCK + i] = (uint8_t)(int8_t)c;
      }
    }
    /* decode this block alone (a one-block row at its place) and compare bits */
    float one_scale = scales[n * blocks + b], one_offset = kind == CODED_Q4 ? offsets[n * blocks + b] : 0.0f;
    const uint8_t *block_codes = row + b * (kind == CODED_Q4 ? CODED_BLOCK / 2 : CODED_BLOCK);
    coded_row(kind, block_codes, &one_scale, &one_offset, 0, CODED_BLOCK, out);
    if (memcmp(out, w, sizeof out) == 0) return 0;
    if (d == 0.0f) break;
  }
  return 1;
}

/* Codes for W [N, K] (row stride ldw; K a multiple of CODED_BLOCK) in `kind`: codes [N, row bytes], scales and
 * offsets [N, K / CODED_BLOCK] (offsets for CODED_Q4 only). Returns 0 where every value decodes to its own bits,
 * 1 where some value has no such code (the outputs are then unspecified), 2 for a K or kind it does not take. */
int code_weight(const float *W, int64_t ldw, int64_t N, int64_t K, int kind, uint8_t *codes, float *scales,
                float *offsets, int nthreads) {
  if (K <= 0 || K % CODED_BLOCK || kind < CODED_Q4 || kind > CODED_BF16) return 2;
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(N, nthreads)) reduction(| : failed)
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < K / CODED_BLOCK && !failed; b++)
      failed |= code_block(kind, W + n * ldw + b * CODED_BLOCK, n, b, K, codes, scales, offsets);
  return failed;
}

/* The values of rows [0, N) of a coded weight into W [N, K] (contiguous) */
void decode_weight(int kind, const uint8_t *codes, const float *scales, const float *offsets, int64_t N, int64_t K,
                   float *W) {
  for (int64_t n = 0; n < N; n++) coded_row(kind, codes, scales, offsets, n, K, W + n * K);
}

/* gemm_nt with A float32 and B a coded weight [N, K]: each work item decodes its panel of B into its thread's
 * buffer, then runs gemm_nt's tiles over it. The plan, tiles and sums are gemm_nt's for a float32 B of these
 * values: the same bits. */
int gemm_nt_coded(const float *A, int64_t lda, int kind, const uint8_t *codes, const float *scales,
                  const float *offsets, const float *bias, void *C, int tc, int64_t ldc, int64_t M, int64_t N,
                  int64_t K, int nthreads) {
  if (K % CODED_BLOCK) return 2;
  int tall, failed = 0;
  nt_work plan = nt_plan(0, M, N, K, bias, C, tc, ldc, nthreads, &tall);
#ifdef NT_TALL_COLS
  const int64_t cols = tall ? NT_TALL_COLS : NT_COLS; /* B rows per micro-tile: panels are whole tiles */
#else
  const int64_t cols = NT_COLS;
#endif
  plan.a = (const char *)A, plan.la = lda, plan.lb = K, plan.ahead = 0;
  int64_t items = plan.panels * plan.chunks, widest = 0;
  for (int64_t p = 0; p < plan.panels; p++) {
    int64_t rows = panel_start(p + 1, plan.panels, plan.units, cols, N) -
                   panel_start(p, plan.panels, plan.units, cols, N);
    widest = rows > widest ? rows : widest;
  }
#pragma omp parallel num_threads(threads_for(items, nthreads)) reduction(| : failed)
  {
    float *panel = malloc((size_t)(widest * K + 16) * sizeof(float));
    int64_t decoded = -1; /* the panel in the buffer */
    if (!panel) failed = 1;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < items; j++) { /* panel by panel: a thread's items of one panel decode it once */
      if (!panel) continue;
      int64_t p = j / plan.chunks, item = j % plan.chunks * plan.panels + p;
      int64_t n0 = panel_start(p, plan.panels, plan.units, cols, N);
      int64_t n1 = panel_start(p + 1, plan.panels, plan.units, cols, N);
      if (p != decoded)
        for (int64_t n = n0; n < n1; n++) coded_row(kind, codes, scales, offsets, n, K, panel + (n - n0) * K);
      decoded = p;
      nt_work w = plan;
      w.b = (const char *)panel, w.b_first = n0;
      nt_run_item(&w, item, 0, tall);
    }
    free(panel);
  }
  return failed;
}

/* -- gemm_seq: C[m, n] = bias[n] + sum over k of A(m, k) B[k, n], in increasing k ----------------------------
 * A(m, k) = A[m * sam + k * sak] (sam = lda, sak = 1 for A [M, K]; sam = 1, sak = lda for A^T of a [K, M]
 * matrix), B [K, N] with row stride ldb. Vectorised over n, 32 columns per micro-tile. With two bfloat16
 * inputs and A row-major, k goes in pairs (k = 2i + 1, then 2i, per pair in increasing i: the VDPBF16PS step
 * of gemm_nt's pairs16, with lanes over n); otherwise one term at a time. */

#define SEQ_PANEL 32
#define SEQ_KCHUNK 512
#define SEQ_SHORT_K 64 /* at most this many terms (and SEQ_SHORT_ROWS rows): seq_short, for speed (same bits) */
#define SEQ_SHORT_ROWS 64 /* and at least this many rows (fewer: too few blocks to feed the threads) */
#define SEQ_LONG_K 4096 /* at least this many terms (a sum over a vocabulary) and 2 row blocks: seq_long */
#define SEQ_LONG_KCHUNK 128 /* seq_long's chunk of k: a thread's rows of A over one chunk stay in its core's cache */

typedef struct {
  const float *a; /* fp32 A, row stride lda (f32 path) */
  const uint32_t *a2; /* bf16 A as pair words, row stride lda2 (pairs path) */
  int64_t lda, lda2;
} seq_a;

/* The panel of B for k in [k0, k0 + kn) and columns n0 .. n0 + width into bp: per step (one k, or a pair of k for
 * pairs), 32 values (fp32, or pair words), zeros past width. */
static void seq_panel(int pairs, const void *B, int tb, int64_t ldb, int64_t K, int64_t n0, int64_t width, int64_t k0,
                      int64_t kn, float *bp) {
  int64_t steps = pairs ? (kn + 1) / 2 : kn;
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
}

/* The sums of rows m .. m + R (the first `rows` real; R a constant, at most SEQ_ROWS) over one panel and k chunk
 * [k0, k0 + kn): the accumulators st ([R, SEQ_PANEL] floats) are read, each term added in increasing k, and written
 * back. The panel's step i (one k, or a pair) is at bp + i * bstep. */
static inline __attribute__((always_inline)) void seq_rows_of(const int R, const seq_a *A, int pairs, int64_t m,
                                                              int rows, int64_t k0, int64_t kn, int64_t width,
                                                              const float *bp, int64_t bstep, float *st) {
  int64_t steps = pairs ? (kn + 1) / 2 : kn;
  v16 acc0[SEQ_ROWS], acc1[SEQ_ROWS];
  for (int i = 0; i < R; i++) {
    memcpy(&acc0[i], st + i * SEQ_PANEL, 64);
    memcpy(&acc1[i], st + i * SEQ_PANEL + 16, 64);
  }
  if (pairs) {
    const uint32_t *ar[SEQ_ROWS];
    for (int i = 0; i < R; i++) ar[i] = A->a2 + (m + (i < rows ? i : 0)) * A->lda2 + k0 / 2;
    for (int64_t i = 0; i < steps; i++) {
      v16u b0, b1;
      memcpy(&b0, bp + i * bstep, 64);
      memcpy(&b1, bp + i * bstep + 16, 64);
      for (int r = 0; r < R; r++) {
        v16u av = (v16u){0} + ar[r][i];
        acc0[r] = pair_step(acc0[r], av, b0);
        acc1[r] = pair_step(acc1[r], av, b1);
      }
    }
  } else {
    const float *ar[SEQ_ROWS];
    for (int i = 0; i < R; i++) ar[i] = A->a + (m + (i < rows ? i : 0)) * A->lda + k0;
    if (width <= 16) /* a panel of at most 16 columns: the second half would add zeros */
      for (int64_t i = 0; i < steps; i++) {
        v16 b0;
        memcpy(&b0, bp + i * bstep, 64);
        for (int r = 0; r < R; r++) acc0[r] += splat(ar[r][i]) * b0;
      }
    else
      for (int64_t i = 0; i < steps; i++) {
        v16 b0, b1;
        memcpy(&b0, bp + i * bstep, 64);
        memcpy(&b1, bp + i * bstep + 16, 64);
        for (int r = 0; r < R; r++) {
          v16 av = splat(ar[r][i]);
          acc0[r] += av * b0;
          acc1[r] += av * b1;
        }
      }
  }
  for (int i = 0; i < R; i++) {
    memcpy(st + i * SEQ_PANEL, &acc0[i], 64);
    memcpy(st + i * SEQ_PANEL + 16, &acc1[i], 64);
  }
}

static inline void seq_rows(const seq_a *A, int pairs, int64_t m, int rows, int64_t k0, int64_t kn, int64_t width,
                            const float *bp, float *st) {
  seq_rows_of(SEQ_ROWS, A, pairs, m, rows, k0, kn, width, bp, SEQ_PANEL, st);
}

/* One work item's rows [rb0, rb1) (in blocks of `tile` rows: SEQ_ROWS, or SEQ_FEW_ROWS) against one 32-column panel
 * of B, k in chunks; block rb's accumulators at store + (rb - rb0) * SEQ_ROWS * SEQ_PANEL. */
static void seq_item(const seq_a *A, int pairs, const void *B, int tb, int64_t ldb, int64_t M, int64_t K, int64_t n0,
                     int64_t width, int64_t rb0, int64_t rb1, int64_t tile, float *bp, float *store) {
  for (int64_t k0 = 0; k0 < K; k0 += SEQ_KCHUNK) {
    int64_t kn = K - k0 < SEQ_KCHUNK ? K - k0 : SEQ_KCHUNK;
    seq_panel(pairs, B, tb, ldb, K, n0, width, k0, kn, bp);
    for (int64_t rb = rb0; rb < rb1; rb++) {
      int64_t m = rb * tile;
      int rows = (int)(M - m < tile ? M - m : tile);
      float *st = store + (rb - rb0) * SEQ_ROWS * SEQ_PANEL;
      if (tile == SEQ_FEW_ROWS) seq_rows_of(SEQ_FEW_ROWS, A, pairs, m, rows, k0, kn, width, bp, SEQ_PANEL, st);
      else seq_rows(A, pairs, m, rows, k0, kn, width, bp, st);
    }
  }
}

/* gemm_seq_to over at most SEQ_SHORT_K terms (a LoRA factor's rank): all of B's panels built once, then each thread
 * takes whole row blocks and goes along their rows, panel after panel, handing each block's sums to the store as
 * they are done. The same sums as seq_item's (one chunk of k, the accumulators from zero); the rows of C are
 * written along their length, where a panel at a time would write a 32-column strip of every row (each row of a
 * 1,536-column strip on its own page, beyond the prefetchers' reach). */
static int seq_short(const seq_a *A, int pairs, const void *B, int tb, int64_t ldb, int64_t M, int64_t N, int64_t K,
                     seq_store store_row, const void *context, int nthreads) {
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL, rowblocks = (M + SEQ_ROWS - 1) / SEQ_ROWS;
  int64_t steps = pairs ? (K + 1) / 2 : K;
  float *bp = malloc((size_t)(panels * steps * SEQ_PANEL + 16) * sizeof(float));
  if (!bp) return 1;
  for (int64_t p = 0; p < panels; p++) {
    int64_t n0 = p * SEQ_PANEL;
    seq_panel(pairs, B, tb, ldb, K, n0, N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL, 0, K, bp + p * steps * SEQ_PANEL);
  }
#pragma omp parallel for schedule(static) num_threads(threads_for(rowblocks, nthreads))
  for (int64_t rb = 0; rb < rowblocks; rb++) {
    int64_t m = rb * SEQ_ROWS;
    int rows = (int)(M - m < SEQ_ROWS ? M - m : SEQ_ROWS);
    float st[SEQ_ROWS * SEQ_PANEL];
    for (int64_t p = 0; p < panels; p++) {
      int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
      memset(st, 0, sizeof st);
      seq_rows(A, pairs, m, rows, 0, K, width, bp + p * steps * SEQ_PANEL, st);
      for (int i = 0; i < rows; i++) store_row(context, m + i, n0, st + i * SEQ_PANEL, width);
    }
  }
  free(bp);
  return 0;
}

/* gemm_seq_to over at least SEQ_LONG_K terms (the gradient through an output layer: A the [M, V] softmax terms, B the
 * [V, E] weight), where A and B each outgrow the caches. seq_item's order (each 32-column panel of B against all of
 * A, chunk after chunk of k) reads A from memory once per panel: 18 times for E = 576. Here each thread takes whole
 * row blocks, keeps their sums for every column, and goes along k in chunks of SEQ_LONG_KCHUNK: its rows of A over
 * one chunk stay in its core's cache while every panel of B's chunk passes over them, so A is read from memory once
 * and B once per thread. The same sums as seq_item's: each term added in increasing k, from zero. */
static int seq_long(const seq_a *A, int pairs, const void *B, int tb, int64_t ldb, int64_t M, int64_t N, int64_t K,
                    seq_store store_row, const void *context, int nthreads) {
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL, rowblocks = (M + SEQ_ROWS - 1) / SEQ_ROWS;
  int threads = threads_for(rowblocks, nthreads), failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int part = 0; part < threads; part++) {
    int64_t rb0 = rowblocks * part / threads, rb1 = rowblocks * (part + 1) / threads, tile = SEQ_ROWS * SEQ_PANEL;
    int64_t m0 = rb0 * SEQ_ROWS, m1 = rb1 * SEQ_ROWS < M ? rb1 * SEQ_ROWS : M;
    float *bp = malloc((size_t)(SEQ_LONG_KCHUNK * SEQ_PANEL + 16) * sizeof(float));
    float *store = calloc((size_t)((rb1 - rb0) * panels * tile + 16), sizeof(float)); /* [block][panel] tiles */
    /* the thread's rows of A over one chunk, packed: A's own rows lie a multiple of 4 KiB apart (a vocabulary's
     * floats), where a chunk of each would fall in the same few cache sets */
    int64_t words = pairs ? SEQ_LONG_KCHUNK / 2 : SEQ_LONG_KCHUNK;
    uint32_t *ap = malloc((size_t)((m1 - m0) * words + 16) * 4);
    if (!bp || !store || !ap) {
      failed = 1;
    } else {
      seq_a chunk = {(const float *)ap, ap, SEQ_LONG_KCHUNK, words};
      for (int64_t k0 = 0; k0 < K; k0 += SEQ_LONG_KCHUNK) {
        int64_t kn = K - k0 < SEQ_LONG_KCHUNK ? K - k0 : SEQ_LONG_KCHUNK, used = pairs ? (kn + 1) / 2 : kn;
        for (int64_t m = m0; m < m1; m++) {
          const uint32_t *from = pairs ? A->a2 + m * A->lda2 + k0 / 2 : (const uint32_t *)(A->a + m * A->lda + k0);
          memcpy(ap + (m - m0) * words, from, (size_t)used * 4);
        }
        for (int64_t p = 0; p < panels; p++) {
          int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
          seq_panel(pairs, B, tb, ldb, K, n0, width, k0, kn, bp);
          for (int64_t rb = rb0; rb < rb1; rb++) {
            int64_t m = rb * SEQ_ROWS;
            int rows = (int)(M - m < SEQ_ROWS ? M - m : SEQ_ROWS);
            seq_rows(&chunk, pairs, m - m0, rows, 0, kn, width, bp, store + ((rb - rb0) * panels + p) * tile);
          }
        }
      }
      for (int64_t rb = rb0; rb < rb1; rb++) {
        int64_t m = rb * SEQ_ROWS;
        int rows = (int)(M - m < SEQ_ROWS ? M - m : SEQ_ROWS);
        for (int64_t p = 0; p < panels; p++) {
          int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
          float *st = store + ((rb - rb0) * panels + p) * tile;
          for (int i = 0; i < rows; i++) store_row(context, m + i, n0, st + i * SEQ_PANEL, width);
        }
      }
    }
    free(bp);
    free(store);
    free(ap);
  }
  return failed;
}

/* gemm_seq_to over fewer than SEQ_SHORT_ROWS rows (a decode step's) and at most SEQ_SHORT_K terms (a LoRA factor's
 * rank), A and B float32: the threads split B's 32-column panels, each read where it is in B (the last, partial one
 * copied with zeros past its width), and take each panel's rows in tiles of SEQ_FEW_ROWS where that computes fewer
 * rows in vain than SEQ_ROWS does (16 rows: 16 computed, not 24). Neither B's panels nor the threads' buffers are
 * built or allocated first. The same sums as seq_item's: each term added in increasing k, from zero. */
static void seq_few(const seq_a *A, const float *B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                    seq_store store_row, const void *context, int nthreads) {
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL;
  int few = padded(M, SEQ_FEW_ROWS) < padded(M, SEQ_ROWS);
#pragma omp parallel for schedule(static) num_threads(threads_for(panels, nthreads))
  for (int64_t p = 0; p < panels; p++) {
    int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL, bstep = ldb;
    float edge[SEQ_SHORT_K * SEQ_PANEL], st[SEQ_ROWS * SEQ_PANEL];
    const float *bp = B + n0;
    if (width < SEQ_PANEL) {
      seq_panel(0, B, F32, ldb, K, n0, width, 0, K, edge);
      bp = edge, bstep = SEQ_PANEL;
    }
    int64_t tile = few ? SEQ_FEW_ROWS : SEQ_ROWS;
    for (int64_t m = 0; m < M; m += tile) {
      int rows = (int)(M - m < tile ? M - m : tile);
      memset(st, 0, sizeof st);
      if (few) seq_rows_of(SEQ_FEW_ROWS, A, 0, m, rows, 0, K, width, bp, bstep, st);
      else seq_rows_of(SEQ_ROWS, A, 0, m, rows, 0, K, width, bp, bstep, st);
      for (int i = 0; i < rows; i++) store_row(context, m + i, n0, st + i * SEQ_PANEL, width);
    }
  }
}

/* gemm_seq's own store: row + bias (float32 additions, then rounded to C's type) */
typedef struct {
  const float *bias;
  void *C;
  int tc;
  int64_t ldc;
} seq_plain;

static void seq_plain_store(const void *context, int64_t m, int64_t n0, float *row, int64_t width) {
  const seq_plain *s = context;
  if (s->bias)
    for (int64_t j = 0; j < width; j++) row[j] = row[j] + s->bias[n0 + j];
  if (s->tc == F32) memcpy((float *)s->C + m * s->ldc + n0, row, (size_t)width * 4);
  else
    for (int64_t j = 0; j < width; j++) store1(s->C, m * s->ldc + n0 + j, row[j], s->tc);
}

int gemm_seq(const void *A, int ta, int64_t sam, int64_t sak, const void *B, int tb, int64_t ldb, const float *bias,
             void *C, int tc, int64_t ldc, int64_t M, int64_t N, int64_t K, int nthreads) {
  seq_plain plain = {bias, C, tc, ldc};
  return gemm_seq_to(A, ta, sam, sak, B, tb, ldb, M, N, K, seq_plain_store, &plain, nthreads);
}

/* gemm_seq's sums, each row's float32 values (columns n0 .. n0 + width) handed to store(context, m, n0, row, width)
 * once, by the thread that computed them (the row may be changed in place). */
/* gemm_seq_to over many rows (at least 8 row blocks per thread) and between SEQ_SHORT_K and SEQ_LONG_K terms (a
 * training pass's gradient through a frozen weight, [tokens, out] x [out, in]): B's panels are packed once, shared by
 * the threads; each work item takes a group of row blocks whose sums for every column, with their rows of A over one
 * chunk of k, fit half the core's L2, and goes chunk by chunk of SEQ_BLOCKED_KCHUNK steps, each chunk along every
 * panel of B (a panel's chunk, 16 KiB, stays in L1 while the group's row blocks pass over it). A is then read from
 * memory once and B once per group, where seq_item's order (one panel of B against all of A) read A once per panel:
 * 16-32% faster at a debate pass's shapes on an Intel Xeon ([2,019 x 576-3,072] by [576-3,072 x 576-3,072], paired).
 * The same sums as seq_item's: each term added in increasing k, from zero, in `tile`-row tiles. */
#define SEQ_BLOCKED_KCHUNK 128
static int seq_blocked(const seq_a *A, int pairs, const void *B, int tb, int64_t ldb, int64_t M, int64_t N, int64_t K,
                       int64_t tile, seq_store store_row, const void *context, int nthreads) {
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL, steps = pairs ? (K + 1) / 2 : K;
  int64_t rowblocks = (M + tile - 1) / tile;
  float *packed = malloc((size_t)(panels * steps * SEQ_PANEL + 16) * sizeof(float)); /* panel p's step i at
                                                                                        (p steps + i) SEQ_PANEL */
  if (!packed) return 1;
#pragma omp parallel for schedule(static) num_threads(threads_for(panels, nthreads))
  for (int64_t p = 0; p < panels; p++) {
    int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
    seq_panel(pairs, B, tb, ldb, K, n0, width, 0, K, packed + p * steps * SEQ_PANEL);
  }
  /* row blocks per group: their sums for every column and their rows of A over one chunk within half the L2 */
  int64_t tile_bytes = (int64_t)SEQ_ROWS * (panels * SEQ_PANEL + SEQ_BLOCKED_KCHUNK) * 4;
  long l2 = l2_bytes() > 0 ? l2_bytes() : 1L << 20; /* unknown: 1 MiB (a Zen 4 core's) */
  int64_t per_group = l2 / 2 / tile_bytes;
  if (per_group < 1) per_group = 1;
  int64_t groups = (rowblocks + per_group - 1) / per_group;
  if (groups < 4 * (int64_t)nthreads) groups = rowblocks < 4 * (int64_t)nthreads ? rowblocks : 4 * (int64_t)nthreads;
  int64_t most_blocks = (rowblocks + groups - 1) / groups, sums = SEQ_ROWS * SEQ_PANEL; /* one tile's sums */
  int failed = 0;
#pragma omp parallel num_threads(threads_for(groups, nthreads)) reduction(| : failed)
  {
    float *store = malloc((size_t)(most_blocks * panels * sums + 16) * sizeof(float)); /* [block][panel] tiles */
    if (!store) failed = 1;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
      if (!store) continue;
      int64_t rb0 = rowblocks * g / groups, rb1 = rowblocks * (g + 1) / groups;
      memset(store, 0, (size_t)((rb1 - rb0) * panels * sums) * sizeof(float));
      for (int64_t k0 = 0; k0 < K; k0 += SEQ_BLOCKED_KCHUNK) {
        int64_t kn = K - k0 < SEQ_BLOCKED_KCHUNK ? K - k0 : SEQ_BLOCKED_KCHUNK;
        for (int64_t p = 0; p < panels; p++) {
          int64_t width = N - p * SEQ_PANEL < SEQ_PANEL ? N - p * SEQ_PANEL : SEQ_PANEL;
          const float *bp = packed + (p * steps + (pairs ? k0 / 2 : k0)) * SEQ_PANEL;
          for (int64_t rb = rb0; rb < rb1; rb++) {
            int64_t m = rb * tile;
            int rows = (int)(M - m < tile ? M - m : tile);
            float *st = store + ((rb - rb0) * panels + p) * sums;
            if (tile == SEQ_FEW_ROWS) seq_rows_of(SEQ_FEW_ROWS, A, pairs, m, rows, k0, kn, width, bp, SEQ_PANEL, st);
            else seq_rows(A, pairs, m, rows, k0, kn, width, bp, st);
          }
        }
      }
      for (int64_t rb = rb0; rb < rb1; rb++) {
        int64_t m = rb * tile;
        int rows = (int)(M - m < tile ? M - m : tile);
        for (int64_t p = 0; p < panels; p++) {
          int64_t n0 = p * SEQ_PANEL, width = N - n0 < SEQ_PANEL ? N - n0 : SEQ_PANEL;
          float *st = store + ((rb - rb0) * panels + p) * sums;
          for (int i = 0; i < rows; i++) store_row(context, m + i, n0, st + i * SEQ_PANEL, width);
        }
      }
    }
    free(store);
  }
  free(packed);
  return failed;
}

int gemm_seq_to(const void *A, int ta, int64_t sam, int64_t sak, const void *B, int tb, int64_t ldb, int64_t M,
                int64_t N, int64_t K, seq_store store_row, const void *context, int nthreads) {
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
  if (K <= SEQ_SHORT_K && M < SEQ_SHORT_ROWS && !pairs && tb == F32) {
    seq_few(&a, B, ldb, M, N, K, store_row, context, nthreads);
    free(a32);
    return 0;
  }
  if (K <= SEQ_SHORT_K && M >= SEQ_SHORT_ROWS) {
    int status = seq_short(&a, pairs, B, tb, ldb, M, N, K, store_row, context, nthreads);
    free(a32);
    free(a2);
    return status;
  }
  if (K >= SEQ_LONG_K && M >= 2 * SEQ_ROWS) {
    int status = seq_long(&a, pairs, B, tb, ldb, M, N, K, store_row, context, nthreads);
    free(a32);
    free(a2);
    return status;
  }
  int64_t panels = (N + SEQ_PANEL - 1) / SEQ_PANEL;
  /* rows in tiles of SEQ_FEW_ROWS where that computes fewer rows in vain than SEQ_ROWS does (a LoRA factor's
   * gradient: 16 rows computed, not 24, at rank 16); the sums do not depend on the tiles */
  int64_t tile = padded(M, SEQ_FEW_ROWS) < padded(M, SEQ_ROWS) ? SEQ_FEW_ROWS : SEQ_ROWS;
  int64_t rowblocks = (M + tile - 1) / tile;
  if (rowblocks >= 8 * (int64_t)nthreads) { /* many rows: seq_blocked's order */
    int status = seq_blocked(&a, pairs, B, tb, ldb, M, N, K, tile, store_row, context, nthreads);
    free(a32);
    free(a2);
    return status;
  }
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
      seq_item(&a, pairs, B, tb, ldb, M, K, n0, width, rb0, rb1, tile, bp, store);
      for (int64_t rb = rb0; rb < rb1; rb++) {
        int64_t m = rb * tile;
        int rows = (int)(M - m < tile ? M - m : tile);
        float *st = store + (rb - rb0) * SEQ_ROWS * SEQ_PANEL;
        for (int i = 0; i < rows; i++) store_row(context, m + i, n0, st + i * SEQ_PANEL, width);
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
