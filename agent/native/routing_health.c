/* Per-row reductions of expert-count matrices for agent/routing_health.py `layer_table`.
 *
 * A DeepSeek-V3 step is a [58, 256] matrix of tokens per expert; numpy needs ~30 whole-matrix
 * passes and as many calls on per-layer vectors to get every layer's health (entropy, Gini, CV,
 * max share, drop fraction), and that was most of the agent's CPU per step at production shape
 * (~500 µs). This does it in one pass per row plus a histogram pass for the Gini rank sum.
 *
 * Loaded with ctypes (agent/native/__init__.py); not a Python module. No state, no allocation
 * except a row copy when counts are too large for the histogram.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#ifndef NAN
#define NAN (0.0 / 0.0)
#endif

#define EXPORT __attribute__((visibility("default")))

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Rank sum of one row: sum over k = 1..e of k * x_(k), the ascending order statistics. Counts
 * below hist_n go through a histogram (n_v values v after r_v smaller ones hold ranks r_v+1 ..
 * r_v+n_v); larger ones through a sorted copy. Returns -1 when the copy cannot be allocated. */
#define RANK_FN(NAME, T)                                                                     \
    static int NAME(const T *row, int64_t e, int64_t top, int64_t *hist, int64_t hist_n,     \
                    int64_t *out) {                                                          \
        int64_t sum = 0;                                                                     \
        if (top < hist_n) {                                                                  \
            for (int64_t v = 0; v <= top; v++) hist[v] = 0;                                  \
            for (int64_t j = 0; j < e; j++) hist[row[j]]++;                                  \
            int64_t below = 0;                                                               \
            for (int64_t v = 1; v <= top; v++) {                                             \
                int64_t n_v = hist[v];                                                       \
                below += hist[v - 1];                                                        \
                if (n_v) sum += v * (n_v * below + n_v * (n_v + 1) / 2);                     \
            }                                                                                \
        } else {                                                                             \
            int64_t *copy = malloc((size_t)e * sizeof(int64_t));                             \
            if (!copy) return -1;                                                            \
            for (int64_t j = 0; j < e; j++) copy[j] = (int64_t)row[j];                       \
            qsort(copy, (size_t)e, sizeof(int64_t), cmp_i64);                                \
            for (int64_t j = 0; j < e; j++) sum += (j + 1) * copy[j];                        \
            free(copy);                                                                      \
        }                                                                                    \
        *out = sum;                                                                          \
        return 0;                                                                            \
    }

RANK_FN(rank_i32, int32_t)
RANK_FN(rank_i64, int64_t)

/* For each of `rows` rows of `c` (and of `d`, the over-capacity counts of the same shape; row
 * strides in elements), the layer's routing health as routing_health.layer_table defines it:
 * ints [total, dropped, max] and doubles [entropy bits, Gini, CV, max share, drop fraction] (NaN
 * for a row with no tokens). c log2 c comes from `clog` below clog_n. Returns 0; -1 (no memory
 * for a row copy); -2 (a negative count); -3 (a count of 2^24 or more, or E > 2^16: sums of
 * squares could leave int64, the caller's float path handles those). */
#define ROWS_FN(NAME, T, RANK)                                                               \
    EXPORT int NAME(const T *c, const T *d, int64_t rows, int64_t e, int64_t stride_c,       \
                    int64_t stride_d, const double *clog, int64_t clog_n, int64_t *hist,     \
                    int64_t hist_n, int64_t *ints, double *floats) {                         \
        if (e > (1 << 16)) return -3;                                                        \
        const double nan = NAN;                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                 \
            const T *row = c + i * stride_c;                                                 \
            const T *drow = d + i * stride_d;                                                \
            int64_t n = 0, dn = 0, top = 0, low = 0, sq = 0, rank = 0;                       \
            double cl = 0.0;                                                                 \
            for (int64_t j = 0; j < e; j++) {                                                \
                int64_t v = (int64_t)row[j], w = (int64_t)drow[j];                           \
                low = v < low ? v : low;                                                     \
                low = w < low ? w : low;                                                     \
                n += v;                                                                      \
                dn += w;                                                                     \
                top = v > top ? v : top;                                                     \
                if (v > 0) {                                                                 \
                    if (v >= (1 << 24)) return -3;                                           \
                    sq += v * v;                                                             \
                    cl += v < clog_n ? clog[v] : (double)v * log2((double)v);                \
                }                                                                            \
            }                                                                                \
            if (low < 0) return -2;                                                          \
            if (RANK(row, e, top, hist, hist_n, &rank)) return -1;                           \
            ints[i] = n;                                                                     \
            ints[rows + i] = dn;                                                             \
            ints[2 * rows + i] = top;                                                        \
            double *f = floats + i;                                                          \
            if (n == 0) {                                                                    \
                f[0] = f[rows] = f[2 * rows] = f[3 * rows] = f[4 * rows] = nan;              \
                continue;                                                                    \
            }                                                                                \
            double safe = (double)n, ed = (double)e;                                         \
            double h = log2(safe) - cl / safe;                                               \
            f[0] = h > 0.0 ? h : 0.0;                                                        \
            double g = 2.0 * (double)rank / (ed * safe) - (ed + 1.0) / ed;                   \
            f[rows] = g < 0.0 ? 0.0 : (g > 1.0 ? 1.0 : g);                                   \
            double mu = safe / ed;                                                           \
            f[2 * rows] = sqrt((double)(sq * e - n * n)) / ed / mu;                          \
            f[3 * rows] = (double)top / safe;                                                \
            f[4 * rows] = (double)dn / safe;                                                 \
        }                                                                                    \
        return 0;                                                                            \
    }

ROWS_FN(moescope_count_rows_i32, int32_t, rank_i32)
ROWS_FN(moescope_count_rows_i64, int64_t, rank_i64)
