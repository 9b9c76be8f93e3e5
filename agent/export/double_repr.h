/* float.__repr__'s text of a double, without CPython's arbitrary-precision dtoa (double_repr.c). */
#ifndef MOESCOPE_DOUBLE_REPR_H
#define MOESCOPE_DOUBLE_REPR_H

#include <stddef.h>

/* Fills the tables; 0 on success, -1 with a Python exception set. Call once, holding the GIL. */
int double_repr_init(void);

/* Writes repr(v) for a finite v into out (at least DOUBLE_REPR_MAX bytes, no terminator);
 * returns its length. */
#define DOUBLE_REPR_MAX 32
size_t double_repr(double v, char *out);

#endif
