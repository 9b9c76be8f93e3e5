/* Per-row reductions of expert-count matrices for agent/routing_health.py `layer_table`.
 *
 * A DeepSeek-V3 step is a [58, 256] matrix of tokens per expert; numpy needs ~30 whole-matrix
 * passes and as many calls on per-layer vectors to get every layer's health (entropy, Gini, CV,
 * max share, drop fraction), and that was most of the agent's CPU per step at production shape
 * (~500 µs). This does it per row in one pass for the sums and one histogram pass; the other
 * sums run over the row's distinct values.
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

/* One row's sums. Pass 1 (branch-free): total, drops, max, min. Then, for counts below hist_n / 2,
 * a histogram of the row (two, filled from alternate entries: equal counts in a row would make one
 * long chain of increments to a single slot), and every other sum is taken over the distinct
 * values instead of over the experts (a step's counts are small: 512 tokens over 256 experts hold
 * ~10 distinct values): n_v values v give n_v c log2 c terms, n_v squares, and the ranks r_v+1 ..
 * r_v+n_v of the Gini rank sum (r_v counts below v). Larger counts take a per-entry pass and a
 * sorted copy. `hist` holds hist_n int64. Returns 0; -1 (no memory for the copy); -2 (a negative
 * count); -3 (a count of 2^24 or more: sums of squares could leave int64). */
#define ROW_FN(NAME, T)                                                                      \
    static int NAME(const T *row, const T *drow, int64_t e, const double *clog,              \
                    int64_t clog_n, int64_t *hist, int64_t hist_n, int64_t *n_out,           \
                    int64_t *dn_out, int64_t *top_out, int64_t *sq_out, int64_t *rank_out,   \
                    double *cl_out) {                                                        \
        int64_t n = 0, dn = 0, top = 0, low = 0;                                             \
        for (int64_t j = 0; j < e; j++) {                                                    \
            int64_t v = (int64_t)row[j], w = (int64_t)drow[j];                               \
            n += v;                                                                          \
            dn += w;                                                                         \
            top = v > top ? v : top;                                                         \
            low = v < low ? v : low;                                                         \
            low = w < low ? w : low;                                                         \
        }                                                                                    \
        if (low < 0) return -2;                                                              \
        if (top >= (1 << 24)) return -3;                                                     \
        int64_t sq = 0, rank = 0;                                                            \
        double cl = 0.0;                                                                     \
        int64_t half = hist_n / 2; /* two histograms: a run of equal counts is two chains */ \
        if (top < half && top < clog_n) {                                                    \
            int64_t *h2 = hist + half;                                                       \
            for (int64_t v = 0; v <= top; v++) hist[v] = h2[v] = 0;                          \
            int64_t j = 0;                                                                   \
            for (; j + 1 < e; j += 2) {                                                      \
                hist[row[j]]++;                                                              \
                h2[row[j + 1]]++;                                                            \
            }                                                                                \
            if (j < e) hist[row[j]]++;                                                       \
            int64_t below = hist[0] + h2[0];                                                 \
            for (int64_t v = 1; v <= top; v++) {                                             \
                int64_t n_v = hist[v] + h2[v];                                               \
                if (n_v) {                                                                   \
                    sq += n_v * v * v;                                                       \
                    cl += (double)n_v * clog[v];                                             \
                    rank += v * (n_v * below + n_v * (n_v + 1) / 2);                         \
                    below += n_v;                                                            \
                }                                                                            \
            }                                                                                \
        } else {                                                                             \
            int64_t *copy = malloc((size_t)e * sizeof(int64_t));                             \
            if (!copy) return -1;                                                            \
            for (int64_t j = 0; j < e; j++) {                                                \
                int64_t v = (int64_t)row[j];                                                 \
                copy[j] = v;                                                                 \
                if (v > 0) {                                                                 \
                    sq += v * v;                                                             \
                    cl += v < clog_n ? clog[v] : (double)v * log2((double)v);                \
                }                                                                            \
            }                                                                                \
            qsort(copy, (size_t)e, sizeof(int64_t), cmp_i64);                                \
            for (int64_t j = 0; j < e; j++) rank += (j + 1) * copy[j];                       \
            free(copy);                                                                      \
        }                                                                                    \
        *n_out = n;                                                                          \
        *dn_out = dn;                                                                        \
        *top_out = top;                                                                      \
        *sq_out = sq;                                                                        \
        *rank_out = rank;                                                                    \
        *cl_out = cl;                                                                        \
        return 0;                                                                            \
    }

ROW_FN(row_i32, int32_t)
ROW_FN(row_i64, int64_t)

/* For each of `rows` rows of `c` (and of `d`, the over-capacity counts of the same shape; strides
 * in elements: row i is row i % rows_per_block of block i / rows_per_block, so a [k, R, E] stack of
 * steps whose blocks lie apart in one buffer is one call), the layer's routing health as
 * routing_health.layer_table defines it:
 * ints [total, dropped, max] and doubles [entropy bits, Gini, CV, max share, drop fraction] (NaN
 * for a row with no tokens). c log2 c comes from `clog` below clog_n. Returns 0; -1 (no memory
 * for a row copy); -2 (a negative count); -3 (a count of 2^24 or more, or E > 2^16: sums of
 * squares could leave int64, the caller's float path handles those); -4 (rows_per_block < 1). */
#define ROWS_FN(NAME, T, ROW)                                                                \
    EXPORT int NAME(const T *c, const T *d, int64_t rows, int64_t e, int64_t stride_c,       \
                    int64_t stride_d, int64_t rows_per_block, int64_t block_stride_c,        \
                    int64_t block_stride_d, const double *clog, int64_t clog_n,              \
                    int64_t *hist, int64_t hist_n, int64_t *ints, double *floats) {          \
        if (e > (1 << 16)) return -3;                                                        \
        if (rows_per_block < 1) return -4;                                                   \
        const double nan = NAN;                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                 \
            int64_t n, dn, top, sq, rank;                                                    \
            double cl;                                                                       \
            int64_t blk = i / rows_per_block, r = i % rows_per_block;                        \
            int status = ROW(c + blk * block_stride_c + r * stride_c,                        \
                             d + blk * block_stride_d + r * stride_d, e, clog, clog_n, hist, \
                             hist_n, &n, &dn, &top, &sq, &rank, &cl);                        \
            if (status) return status;                                                       \
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

ROWS_FN(moescope_count_rows_i32, int32_t, row_i32)
ROWS_FN(moescope_count_rows_i64, int64_t, row_i64)
