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

/* splitmix64 of 8 counters at once: the same wrapping arithmetic lane by lane. */
static inline v8u64 splitmix64x8(v8u64 z) {
  z += GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

/* Which scores cannot win the draw unless their noise is large. The noise g = -log(-log(u)) is at least
 * -log(-log(2^-54)) > -3.63 for every element, so the winner's key is at least M - 3.63 (M the largest score, less a
 * rounding); and where u < 1 - 2^-20 (SMALL_NOISE_BITS), g < -log(2^-20) < 13.87. A score below
 * M - 3.63 - 13.87 - slack whose u is that small therefore loses to the largest score's key, and its two logs need
 * not be computed: the token and the keys that decide it are those of the full scan. Returns that bound, or -inf
 * where the scan must be the full one (a NaN score, whose first occurrence is the token, or no finite largest). */
#define SMALL_NOISE_BITS ((1ull << 53) - (1ull << 33))
static float prune_below(const float *s, int64_t V) {
  int any_nan;
  float mx = vector_max(s, V, &any_nan);
  if (any_nan || !(mx > -INFINITY) || mx == INFINITY) return -INFINITY;
  return mx - 17.6f - fabsf(mx) * 0x1p-10f;
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
    int64_t best = 0;
    float top = 0.0f, cut = mode == 3 ? -INFINITY : prune_below(s, V);
    if (cut > -INFINITY) { /* the same argmax, without the noise of scores that cannot reach it */
      top = -INFINITY;
      const v8u64 lane = {0, 1, 2, 3, 4, 5, 6, 7};
      int64_t v = 0;
      for (; v + 8 <= V; v += 8) { /* 8 hashes at once; the few keys that can win, one at a time in order */
        v8u64 bits = splitmix64x8(base + ((uint64_t)v + lane) * GOLDEN) >> 11;
        v8f sv;
        memcpy(&sv, s + v, 32);
        v8i64 low = __builtin_convertvector(sv < cut, v8i64) & (v8i64)(bits < SMALL_NOISE_BITS);
        if (low[0] & low[1] & low[2] & low[3] & low[4] & low[5] & low[6] & low[7]) continue;
        for (int j = 0; j < 8; j++) {
          if (low[j]) continue;
          float key = s[v + j] + gumbel_of_bits(bits[j]);
          if (key > top) {
            top = key;
            best = v + j;
          }
        }
      }
      for (; v < V; v++) {
        if (s[v] < cut && splitmix64(base + (uint64_t)v * GOLDEN) >> 11 < SMALL_NOISE_BITS) continue;
        float key = s[v] + gumbel(base, v);
        if (key > top) {
          top = key;
          best = v;
        }
      }
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
