/* The seeded draw of one decode step (rlrunbook/engines/token_draw.py, fused): per row, the counter-based Gumbel
 * noise, the argmax of scores + noise, and the logprobs of the drawn token, in one pass over the row's logits.
 *
 * Bit for bit the eager path (token_draw.draw_tokens with the fixed-order log_softmax_at):
 *   noise (engines/noise.py): z = splitmix64(base + v * golden) with base = splitmix64(seed ^ splitmix64(step)),
 *     all wrapping 64-bit arithmetic; u = ((double)(z >> 11) + 0.5) / 2^53; g = (float)(-log(-log(u))) in double;
 *   scores: the logits (T = 1), logits / (float)T, or the caller's filtered scores;
 *   token: the first index of the largest float32 score + g (a NaN wins, the first one, as torch.argmax);
 *   logprob: score[token] - row_logsumexp(scores) (rows.c, lanes64), for the T = 1 logits and the sampled scores.
 * The double log is libm's; PyTorch's vectorised double log may differ from it in the last bit of a double, which
 * the rounding to float32 absorbs (tests/unit/kernels/test_seeded_draw.py measures it).
 */
#include "fixed_order.h"

void row_logsumexp(const float *X, int64_t ldx, int64_t M, int64_t V, float *out, int nthreads);

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, MIX1 = 0xBF58476D1CE4E5B9ull, MIX2 = 0x94D049BB133111EBull;

static inline uint64_t splitmix64(uint64_t z) {
  z += GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

/* The Gumbel noise of the 53 hash bits `bits` (float32, as noise.gumbel_noise stores it). */
static inline float gumbel_of_bits(uint64_t bits) {
  double u = ((double)(int64_t)bits + 0.5) / 9007199254740992.0;
  return (float)(-log(-log(u)));
}

/* The Gumbel noise of element v of a row whose base is `base`. */
static inline float gumbel(uint64_t base, int64_t v) {
  return gumbel_of_bits(splitmix64(base + (uint64_t)v * GOLDEN) >> 11);
}

typedef uint64_t v8u64 __attribute__((vector_size(64)));
typedef int64_t v8i64 __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

static inline v8f fabs8(v8f x) {
  v8i32 bits;
  memcpy(&bits, &x, 32);
  bits &= 0x7fffffff;
  memcpy(&x, &bits, 32);
  return x;
}

/* splitmix64 of 8 counters at once: the same wrapping arithmetic lane by lane. */
static inline v8u64 splitmix64x8(v8u64 z) {
  z += GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

/* The draw without the logs of keys that cannot win. The key of element v is s[v] + g(bits_v), g increasing in the
 * 53 hash bits. Once some key `best` is known, element v cannot beat it (nor tie it) when g(bits_v) < best - s[v]:
 * with k an integer at most best - s[v] less a slack that covers the float32 rounding of the difference and of the
 * key, it suffices that bits_v < noise_bound[k], the bits below which g < k - 0.01. Those keys need only their hash,
 * not the two double logs, and the token and logprobs are those of the full scan. The scan starts from the key of
 * the largest score (most of the others then fall below it by their bits alone) and keeps the first index of the
 * largest key, as the full scan does. */
#define NOISE_BOUNDS 41 /* k = 0 .. 40; from 38 on, every bits value but the last (g <= 36.04; the last rounds u to 1,
                          * g = +inf) */
#define FAR 8 /* the bound a whole block of 8 is tested against first */

/* bound[k] for k = 0 .. NOISE_BOUNDS - 1 (a few exps: computed per call) */
static void noise_bounds(uint64_t bound[NOISE_BOUNDS]) {
  for (int k = 0; k < NOISE_BOUNDS; k++) {
    /* u with g(u) = k - 0.01; bits with (bits + 0.5) / 2^53 below it, less 2 for the rounding of exp */
    double limit = exp(-exp(-((double)k - 0.01))) * 9007199254740992.0 - 0.5;
    bound[k] = k >= 38 ? (1ull << 53) - 1 : limit < 3.0 ? 0 : (uint64_t)limit - 2;
  }
}

/* The index of the largest score, or -1 where the pruned scan does not apply (a NaN, whose first occurrence is the
 * token, or no finite largest score). */
static int64_t finite_top(const float *s, int64_t V) {
  int any_nan;
  float mx = vector_max(s, V, &any_nan);
  if (any_nan || !(mx > -INFINITY) || mx == INFINITY) return -1;
  int64_t v = 0;
  while (s[v] != mx) v++;
  return v;
}

/* The token of the draw over scores s whose largest is at index a (finite_top), keys past their bound skipped. */
static int64_t pruned_draw(const float *s, int64_t V, uint64_t base, int64_t a,
                           const uint64_t noise_bound[NOISE_BOUNDS]) {
  const v8u64 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  float best = s[a] + gumbel(base, a);
  int64_t token = a;
  int64_t v = 0;
  for (; v < V; v += 8) {
    int n = V - v < 8 ? (int)(V - v) : 8;
    v8u64 bits = splitmix64x8(base + ((uint64_t)v + lane) * GOLDEN) >> 11;
    /* lane j is skipped where its bits are below noise_bound[k], k the integer part of best - s - slack (k >= 0, at
     * most the last bound). Most scores of a language model are far below the best key: a block whose lanes all
     * clear the bound of FAR is passed by vector compares alone; the others go lane by lane. */
    v8f x;
    memcpy(&x, s + v, (size_t)n * 4);
    for (int j = n; j < 8; j++) x[j] = -INFINITY;
    v8f d = (best - x) - (1e-3f + (fabsf(best) + fabs8(x)) * 0x1p-20f);
    v8i64 far = __builtin_convertvector(d >= (float)FAR, v8i64) & (v8i64)(bits < noise_bound[FAR]);
    if (far[0] & far[1] & far[2] & far[3] & far[4] & far[5] & far[6] & far[7]) continue;
    int skip[8];
    for (int j = 0; j < n; j++) {
      int k = d[j] >= (float)(NOISE_BOUNDS - 1) ? NOISE_BOUNDS - 1 : d[j] >= 0.0f ? (int)d[j] : -1;
      skip[j] = k >= 0 && bits[j] < noise_bound[k];
    }
    for (int j = 0; j < n; j++) {
      if (skip[j]) continue;
      float key = s[v + j] + gumbel_of_bits(bits[j]);
      if (key > best || (key == best && v + j < token)) {
        best = key;
        token = v + j;
      }
    }
  }
  return token;
}

/* mode 0: scores are the logits (T = 1); 1: logits / temperature; 2: `filtered` holds the scores; 3: greedy (the
 * argmax of the logits, no noise, both logprobs the T = 1 one).
 * Outputs: token[r * out_stride + column], sampled[...] and policy[...] (row strides of [R, W] buffers); where
 * `feed` is given, feed[feed_index[r]] = token too (the next step's input). Returns 1 if scratch memory ran out. */
int seeded_draw(const float *logits, int64_t ldl, const float *filtered, int64_t ldf, const int64_t *seeds,
                int64_t step, int64_t R, int64_t V, int mode, float temperature, int64_t *token, float *sampled,
                float *policy, int64_t out_stride, int64_t column, int64_t *feed, const int64_t *feed_index,
                int nthreads) {
  uint64_t step_mix = splitmix64((uint64_t)step);
  int failed = 0;
  uint64_t bound[NOISE_BOUNDS];
  noise_bounds(bound);
#pragma omp parallel for schedule(static) num_threads(threads_for(R, nthreads)) reduction(| : failed)
  for (int64_t r = 0; r < R; r++) {
    const float *x = logits + r * ldl;
    float *scratch = NULL;
    const float *s = x;
    if (mode == 1) {
      scratch = malloc((size_t)(V > 0 ? V : 1) * sizeof(float));
      if (!scratch) {
        failed = 1;
        continue;
      }
      for (int64_t v = 0; v < V; v++) scratch[v] = x[v] / temperature;
      s = scratch;
    } else if (mode == 2) {
      s = filtered + r * ldf;
    }
    uint64_t base = splitmix64((uint64_t)seeds[r] ^ step_mix);
    int64_t best = 0, a = mode == 3 ? -1 : finite_top(s, V);
    float top = 0.0f;
    if (a >= 0) {
      best = pruned_draw(s, V, base, a, bound);
    } else {
      for (int64_t v = 0; v < V; v++) {
        float key = mode == 3 ? s[v] : s[v] + gumbel(base, v);
        if (key != key) { /* NaN: torch.argmax returns the first one */
          best = v;
          break;
        }
        if (v == 0 || key > top) {
          top = key;
          best = v;
        }
      }
    }
    float lse_policy, lse_sampled;
    row_logsumexp(x, 0, 1, V, &lse_policy, 1);
    float lp_policy = x[best] - lse_policy, lp_sampled = lp_policy;
    if (mode == 1 || mode == 2) {
      row_logsumexp(s, 0, 1, V, &lse_sampled, 1);
      lp_sampled = s[best] - lse_sampled;
    }
    int64_t at = r * out_stride + column;
    token[at] = best;
    sampled[at] = lp_sampled;
    policy[at] = lp_policy;
    if (feed) feed[feed_index[r]] = best;
    free(scratch);
  }
  return failed;
}
