"""moescope agent."""

import os

from moescope import compiled

# The compiled hot path (moescope/compiled.py) where it matches the sources: before any module of
# this package is imported.
compiled.install()

# The agent does no heavy linear algebra. Asking numpy's BLAS for one thread (instead of the pool
# it starts when numpy loads) keeps the agent single-threaded until it drops its privileges, which
# has to happen before any other thread exists (agent/privileges.py); it also saves the pool's
# buffers. A command the agent launches gets the variable as the agent found it (agent/targets.py).
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"
INHERITED_BLAS_THREADS = os.environ.get(BLAS_THREADS_ENV)
if INHERITED_BLAS_THREADS is None:
    os.environ[BLAS_THREADS_ENV] = "1"


def inherited_environ() -> dict[str, str]:
    """The environment as it reached the agent, for the processes it launches."""
    env = dict(os.environ)
    if INHERITED_BLAS_THREADS is None:
        env.pop(BLAS_THREADS_ENV, None)
    return env
