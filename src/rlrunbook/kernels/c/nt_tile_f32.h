/* A float32 gemm_nt micro-tile (lanes16 order): TILE_ROWS rows of A by TILE_COLS rows of B, 16 k per step, each
 * accumulator's lane j adding the terms at k = j (mod 16) in increasing k, then reduce_tile. products.c includes this
 * file once per tile, with TILE_NAME, TILE_ROWS, TILE_COLS and TILE_AHEAD defined, so that each tile's loops unroll
 * and its accumulators stay in registers. Every output element has a sum of its own: the tiles give the same bits.
 * TILE_AHEAD 1: the tile requests t->ahead's lines as it goes (request_ahead at each step); 0: it has none to. */

static void TILE_NAME(const nt_args *t, float *out) {
  v16 acc[TILE_ROWS * TILE_COLS];
  const float *ar[TILE_ROWS], *br[TILE_COLS];
  for (int i = 0; i < TILE_ROWS; i++) ar[i] = (const float *)t->a + (i < t->rows ? i : 0) * t->lda;
  for (int j = 0; j < TILE_COLS; j++) br[j] = (const float *)t->b + (j < t->cols ? j : 0) * t->ldb;
  for (int i = 0; i < TILE_ROWS * TILE_COLS; i++) acc[i] = (v16){0};
  int64_t k = 0, K = t->K;
#if TILE_AHEAD
  ahead_cursor ahead = ahead_of(t, (K + 15) / 16);
#endif
  for (; k + 16 <= K; k += 16) {
#if TILE_AHEAD
    request_ahead(&ahead);
#endif
    v16 av[TILE_ROWS], bv[TILE_COLS];
    for (int i = 0; i < TILE_ROWS; i++) LOAD_HELD(av[i], ar[i] + k);
    for (int j = 0; j < TILE_COLS; j++) {
      LOAD_HELD(bv[j], br[j] + k);
      for (int i = 0; i < TILE_ROWS; i++) acc[i * TILE_COLS + j] += av[i] * bv[j];
    }
  }
  if (k < K) {
#if TILE_AHEAD
    request_ahead(&ahead);
#endif
    v16 av[TILE_ROWS], bv[TILE_COLS];
    for (int i = 0; i < TILE_ROWS; i++) av[i] = load16(ar[i], k, F32, (int)(K - k));
    for (int j = 0; j < TILE_COLS; j++) bv[j] = load16(br[j], k, F32, (int)(K - k));
    for (int i = 0; i < TILE_ROWS; i++)
      for (int j = 0; j < TILE_COLS; j++) acc[i * TILE_COLS + j] += av[i] * bv[j];
  }
  reduce_tile(acc, TILE_ROWS * TILE_COLS, out);
}
