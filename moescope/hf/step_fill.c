/* The compact host step's reductions for moescope/hf/emit.py (_CompactFast): every layer's tokens
 * per expert and mean router entropy, written straight into the held moe.step vectors.
 *
 * Inside a forward pass of a small CPU model each torch call costs 10-40 µs (caches cold after the
 * model's own work), and the step end needed six of them (cat, softmax, entr, mv for the entropy;
 * cat and scatter_add for the counts): ~130 µs per forward of a 4-layer tiny model, about 1.4 % of
 * the forward. Here it is one call over the tensors' own memory, no copy and no allocation.
 *
 * Loaded with ctypes (moescope/hf/native.py); not a Python module; no state.
 *
 * ptrs: 2 * layers addresses: each layer's scores ([tokens, experts], rows contiguous), then each
 * layer's top-k indices (`assignments` contiguous integers). Scores are float32, float64 or
 * bfloat16 (score_type 0, 1, 2); indices int64 or int32 (index_bytes 8 or 4). kind 0: the scores
 * are router logits, the distribution is their softmax; kind 1: they are probabilities as
 * returned (negative entries count as 0), the definitions of moescope/hf/scoring.py.
 *
 * Writes per layer l: routing[l * row_stride + e] = tokens routed to expert e (e < experts; the
 * rest of the row is not touched) and entropy_bits[l] = mean over tokens of the entropy in bits.
 * Returns the indices outside 0..experts-1 (not counted: an expert-parallel "not here" marker),
 * or -1 for arguments it does not take.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

enum { SCORE_F32 = 0, SCORE_F64 = 1, SCORE_BF16 = 2 };
enum { KIND_SOFTMAX = 0, KIND_PROBABILITIES = 1 };

static inline double score_at(const void *base, int score_type, int64_t i) {
    switch (score_type) {
        case SCORE_F32:
            return (double)((const float *)base)[i];
        case SCORE_F64:
            return ((const double *)base)[i];
        default: { /* bfloat16: the high half of a float32 */
            uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            return (double)f;
        }
    }
}

/* Sum over tokens of the entropy (nats) of softmax(row): H = log Z - sum(e^z z) / Z with
 * z = s - max(s), Z = sum(e^z), in double. A zero weight (a -inf logit) adds nothing, as entr(0). */
static double softmax_entropy_sum(const void *s, int score_type, int64_t tokens, int64_t experts) {
    double total = 0.0;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t row = t * experts;
        double m = score_at(s, score_type, row);
        for (int64_t j = 1; j < experts; j++) {
            double v = score_at(s, score_type, row + j);
            m = v > m ? v : m;
        }
        double z_sum = 0.0, ez_sum = 0.0;
        for (int64_t j = 0; j < experts; j++) {
            double z = score_at(s, score_type, row + j) - m;
            double e = exp(z);
            z_sum += e;
            if (e > 0.0) ez_sum += e * z;
        }
        total += log(z_sum) - ez_sum / z_sum;
    }
    return total;
}

/* Sum over tokens of -sum(p log p) (nats), p clamped at 0 from below; NaN stays NaN. */
static double probability_entropy_sum(const void *s, int score_type, int64_t tokens, int64_t experts) {
    double total = 0.0;
    int64_t n = tokens * experts;
    for (int64_t i = 0; i < n; i++) {
        double p = score_at(s, score_type, i);
        if (p > 0.0)
            total -= p * log(p);
        else if (p != p)
            total = p;
    }
    return total;
}

#define COUNT_FN(NAME, T)                                                                       \
    static int64_t NAME(const T *idx, int64_t assignments, int64_t experts, int32_t *row) {    \
        int64_t outside = 0;                                                                    \
        for (int64_t i = 0; i < assignments; i++) {                                             \
            uint64_t e = (uint64_t)(int64_t)idx[i]; /* a negative index is huge unsigned */     \
            if (e < (uint64_t)experts)                                                          \
                row[e]++;                                                                       \
            else                                                                                \
                outside++;                                                                      \
        }                                                                                       \
        return outside;                                                                         \
    }

COUNT_FN(count_i64, int64_t)
COUNT_FN(count_i32, int32_t)

EXPORT int64_t moescope_hf_step_fill(const uintptr_t *ptrs, int64_t layers, int64_t tokens, int64_t experts,
                                     int64_t assignments, int32_t kind, int32_t score_type, int32_t index_bytes,
                                     int32_t *routing, int64_t row_stride, double *entropy_bits) {
    if (!ptrs || !routing || !entropy_bits || layers < 0 || tokens < 0 || experts <= 0 || assignments < 0 ||
        row_stride < experts || (kind != KIND_SOFTMAX && kind != KIND_PROBABILITIES) ||
        (score_type != SCORE_F32 && score_type != SCORE_F64 && score_type != SCORE_BF16) ||
        (index_bytes != 4 && index_bytes != 8))
        return -1;
    for (int64_t l = 0; l < 2 * layers; l++)
        if (!ptrs[l] && (l < layers ? tokens : assignments) > 0) return -1;
    const double scale = tokens > 0 ? 1.0 / ((double)tokens * log(2.0)) : 0.0;
    int64_t outside = 0;
    for (int64_t l = 0; l < layers; l++) {
        const void *scores = (const void *)ptrs[l];
        const void *indices = (const void *)ptrs[layers + l];
        double nats = kind == KIND_SOFTMAX ? softmax_entropy_sum(scores, score_type, tokens, experts)
                                           : probability_entropy_sum(scores, score_type, tokens, experts);
        entropy_bits[l] = nats * scale;
        int32_t *row = routing + l * row_stride;
        memset(row, 0, (size_t)experts * sizeof *row);
        outside += index_bytes == 8 ? count_i64((const int64_t *)indices, assignments, experts, row)
                                    : count_i32((const int32_t *)indices, assignments, experts, row);
    }
    return outside;
}
