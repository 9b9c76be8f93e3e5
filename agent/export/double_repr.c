/* The text float.__repr__ gives for a finite double: the shortest decimal that reads back as the
 * same double, the closest to it of those (a tie to an even last digit), in repr's layout (fixed
 * notation for decimal exponents -4 < e <= 16, else d.ddde±XX; ".0" after a whole number).
 *
 * CPython gets it from David Gay's dtoa, in arbitrary precision: ~10,000 instructions for the
 * 16-17-digit values the agent's spans carry (a layer span has ~26 doubles, and their formatting
 * was 60 % of the OTLP-JSON encoder's instructions at the reference load). This computes it with
 * 64 x 128-bit products, after the method of Ulf Adams' Ryu (PLDI 2018), written here from its
 * description: the double's rounding interval [vm, vp] around vr, scaled by a power of ten held as
 * a 125-bit approximation of a power of five; digits dropped while the interval still holds a
 * shorter candidate; the last kept digit rounded (exactness tracked through the dropped digits).
 * The tables of powers of five are computed exactly with Python's integers at module init, and
 * checked against the bit-length approximations the scaling uses. tests/export/test_double_repr.py
 * holds the text to repr() over millions of doubles. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "double_repr.h"

typedef unsigned __int128 u128;

#define MANTISSA_BITS 52
#define EXPONENT_BIAS 1023
#define POW5_BITS 125      /* each table entry's precision, in bits */
#define POW5_INV_COUNT 342 /* decimal exponents of doubles >= 1: q < 342 */
#define POW5_COUNT 326     /* powers of five that doubles < 1 need: i < 326 */

static uint64_t pow5_inv[POW5_INV_COUNT][2]; /* [lo, hi] of floor(2^(bits(5^q) - 1 + 125) / 5^q) + 1 */
static uint64_t pow5[POW5_COUNT][2];         /* [lo, hi] of 5^i scaled to exactly 125 bits (floor) */

/* bits(5^e) = ceil(log2 5^e) for e >= 1, 1 for e = 0 (checked against the tables at init) */
static inline int32_t pow5_bits(int32_t e) { return (int32_t)(((uint32_t)e * 1217359u) >> 19) + 1; }
/* floor(log10 2^e), floor(log10 5^e) in the ranges used (tests/export/test_double_repr.py) */
static inline uint32_t log10_pow2(int32_t e) { return ((uint32_t)e * 78913u) >> 18; }
static inline uint32_t log10_pow5(int32_t e) { return ((uint32_t)e * 732923u) >> 20; }

/* floor(m * mul / 2^j), mul a 128-bit [lo, hi], 64 <= j < 192 */
static inline uint64_t mul_shift(uint64_t m, const uint64_t *mul, int32_t j) {
    u128 low = (u128)m * mul[0];
    u128 high = (u128)m * mul[1];
    return (uint64_t)(((low >> 64) + high) >> (j - 64));
}

static inline int multiple_of_pow5(uint64_t v, uint32_t p) { /* v > 0 */
    uint32_t count = 0;
    while (v % 5 == 0) {
        v /= 5;
        count++;
    }
    return count >= p;
}

static inline int multiple_of_pow2(uint64_t v, uint32_t p) { return (v & ((1ULL << p) - 1)) == 0; }

/* One decimal digit off the interval and its value; vr stays exact while every digit dropped is 0. */
static inline void drop_digit(uint64_t *vr, uint64_t *vp, uint64_t *vm, uint32_t *last, int *vr_exact) {
    *vr_exact &= *last == 0;
    *last = (uint32_t)(*vr % 10);
    *vr /= 10;
    *vp /= 10;
    *vm /= 10;
}

/* The shortest decimal digits and exponent of a positive finite double: value = digits * 10^exponent. */
static void shortest(uint64_t ieee_mantissa, uint32_t ieee_exponent, uint64_t *digits, int32_t *exponent) {
    int32_t e2;
    uint64_t m2;
    if (ieee_exponent == 0) { /* subnormal */
        e2 = 1 - EXPONENT_BIAS - MANTISSA_BITS - 2;
        m2 = ieee_mantissa;
    } else {
        e2 = (int32_t)ieee_exponent - EXPONENT_BIAS - MANTISSA_BITS - 2;
        m2 = (1ULL << MANTISSA_BITS) | ieee_mantissa;
    }
    const int even = (m2 & 1) == 0; /* round-half-even reading: the interval's bounds are included */
    /* the value and its rounding interval, times 4 (an exponent step down is a narrower lower half) */
    const uint64_t mv = 4 * m2;
    const uint32_t mm_shift = ieee_mantissa != 0 || ieee_exponent <= 1;
    const uint64_t mp = mv + 2, mm = mv - 1 - mm_shift;
    uint64_t vr, vp, vm;
    int32_t e10;
    int vm_exact = 0, vr_exact = 0; /* whether the dropped digits of vm / vr are all zero so far */
    if (e2 >= 0) {
        const uint32_t q = log10_pow2(e2) - (e2 > 3);
        e10 = (int32_t)q;
        const int32_t j = -e2 + (int32_t)q + POW5_BITS + pow5_bits((int32_t)q) - 1;
        vr = mul_shift(mv, pow5_inv[q], j);
        vp = mul_shift(mp, pow5_inv[q], j);
        vm = mul_shift(mm, pow5_inv[q], j);
        if (q <= 21) { /* (5^22 > 2^54 > mp: no larger q divides any of them) */
            if (mv % 5 == 0) {
                vr_exact = multiple_of_pow5(mv, q);
            } else if (even) {
                vm_exact = multiple_of_pow5(mm, q);
            } else {
                vp -= multiple_of_pow5(mp, q); /* an excluded upper bound that is exact */
            }
        }
    } else {
        const uint32_t q = log10_pow5(-e2) - (-e2 > 1);
        e10 = (int32_t)q + e2;
        const int32_t i = -e2 - (int32_t)q;
        const int32_t j = (int32_t)q - (pow5_bits(i) - POW5_BITS);
        vr = mul_shift(mv, pow5[i], j);
        vp = mul_shift(mp, pow5[i], j);
        vm = mul_shift(mm, pow5[i], j);
        if (q <= 1) { /* mv has 2 trailing zero bits; mm has 1 when mm_shift is 1 */
            vr_exact = 1;
            if (even) {
                vm_exact = mm_shift == 1;
            } else {
                --vp;
            }
        } else if (q < 63) {
            vr_exact = multiple_of_pow2(mv, q);
        }
    }
    int32_t removed = 0;
    uint32_t last = 0; /* the last digit dropped from vr */
    while (vp / 10 > vm / 10) {
        vm_exact &= vm % 10 == 0;
        drop_digit(&vr, &vp, &vm, &last, &vr_exact);
        removed++;
    }
    if (vm_exact) { /* vm itself is in the interval: its trailing zeros can go too */
        while (vm % 10 == 0) {
            drop_digit(&vr, &vp, &vm, &last, &vr_exact);
            removed++;
        }
    }
    if (vr_exact && last == 5 && vr % 2 == 0) last = 4; /* exactly halfway: the even digit */
    *digits = vr + ((vr == vm && (!even || !vm_exact)) || last >= 5);
    *exponent = e10 + removed;
}

/* "00" "01" ... "99": two decimal digits at a time */
static const char DIGIT_PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

size_t double_repr(double v, char *out) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    char *p = out;
    if (bits >> 63) *p++ = '-';
    const uint64_t mantissa = bits & ((1ULL << MANTISSA_BITS) - 1);
    const uint32_t exponent = (uint32_t)((bits >> MANTISSA_BITS) & 0x7ff);
    if (exponent == 0 && mantissa == 0) {
        memcpy(p, "0.0", 3);
        return (size_t)(p - out) + 3;
    }
    uint64_t d;
    int32_t e;
    shortest(mantissa, exponent, &d, &e);
    /* the decimal digits of d, written from the end two at a time (a double has at most 17) */
    char buffer[24];
    int at = (int)sizeof buffer;
    while (d >= 100) {
        const uint64_t pair = d % 100;
        d /= 100;
        at -= 2;
        memcpy(buffer + at, DIGIT_PAIRS + 2 * pair, 2);
    }
    if (d >= 10) {
        at -= 2;
        memcpy(buffer + at, DIGIT_PAIRS + 2 * d, 2);
    } else {
        buffer[--at] = (char)('0' + d);
    }
    const char *digits = buffer + at;
    int n = (int)sizeof buffer - at;
    const int32_t point = n + e; /* value = 0.digits x 10^point */
    while (n > 1 && digits[n - 1] == '0') n--; /* (a rounded-up last digit may leave a zero) */
    if (point <= -4 || point > 16) {
        *p++ = digits[0];
        if (n > 1) {
            *p++ = '.';
            memcpy(p, digits + 1, (size_t)(n - 1));
            p += n - 1;
        }
        int32_t x = point - 1;
        *p++ = 'e';
        *p++ = x < 0 ? '-' : '+';
        if (x < 0) x = -x;
        if (x >= 100) {
            *p++ = (char)('0' + x / 100);
            x %= 100;
        }
        *p++ = (char)('0' + x / 10);
        *p++ = (char)('0' + x % 10);
    } else if (point <= 0) {
        *p++ = '0';
        *p++ = '.';
        for (int32_t i = 0; i < -point; i++) *p++ = '0';
        memcpy(p, digits, (size_t)n);
        p += n;
    } else if (point >= n) {
        memcpy(p, digits, (size_t)n);
        p += n;
        for (int32_t i = 0; i < point - n; i++) *p++ = '0';
        *p++ = '.';
        *p++ = '0';
    } else {
        memcpy(p, digits, (size_t)point);
        p += point;
        *p++ = '.';
        memcpy(p, digits + point, (size_t)(n - point));
        p += n - point;
    }
    return (size_t)(p - out);
}

/* lo and hi 64 bits of a non-negative int below 2^128 */
static int store_u128(PyObject *x, uint64_t *out) {
    if (!x) return -1;
    out[0] = PyLong_AsUnsignedLongLongMask(x);
    PyObject *sixty_four = PyLong_FromLong(64);
    PyObject *high = sixty_four ? PyNumber_Rshift(x, sixty_four) : NULL;
    Py_XDECREF(sixty_four);
    Py_DECREF(x);
    if (!high) return -1;
    out[1] = PyLong_AsUnsignedLongLongMask(high);
    Py_DECREF(high);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *shifted(PyObject *x, long by) { /* x * 2^by (by may be negative: floor) */
    PyObject *n = PyLong_FromLong(by >= 0 ? by : -by);
    if (!n) return NULL;
    PyObject *out = by >= 0 ? PyNumber_Lshift(x, n) : PyNumber_Rshift(x, n);
    Py_DECREF(n);
    return out;
}

int double_repr_init(void) {
    PyObject *five = PyLong_FromLong(5), *one = PyLong_FromLong(1);
    PyObject *power = PyLong_FromLong(1); /* 5^i */
    int rc = -1;
    if (!five || !one || !power) goto done;
    for (int i = 0; i < POW5_INV_COUNT; i++) {
        if (i > 0) {
            PyObject *next = PyNumber_Multiply(power, five);
            Py_DECREF(power);
            power = next;
            if (!power) goto done;
        }
        PyObject *length = PyObject_CallMethod(power, "bit_length", NULL);
        if (!length) goto done;
        long bits = PyLong_AsLong(length);
        Py_DECREF(length);
        if (bits == -1 && PyErr_Occurred()) goto done;
        if (bits != pow5_bits(i)) {
            PyErr_Format(PyExc_RuntimeError, "bit length of 5^%d is %ld, not %d", i, bits, (int)pow5_bits(i));
            goto done;
        }
        if (i < POW5_COUNT && store_u128(shifted(power, POW5_BITS - bits), pow5[i]) < 0) goto done;
        PyObject *top = shifted(one, bits - 1 + POW5_BITS);
        PyObject *quotient = top ? PyNumber_FloorDivide(top, power) : NULL;
        Py_XDECREF(top);
        PyObject *inverse = quotient ? PyNumber_Add(quotient, one) : NULL;
        Py_XDECREF(quotient);
        if (store_u128(inverse, pow5_inv[i]) < 0) goto done;
    }
    rc = 0;
done:
    Py_XDECREF(five);
    Py_XDECREF(one);
    Py_XDECREF(power);
    return rc;
}
