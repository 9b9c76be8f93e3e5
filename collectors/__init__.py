"""moescope collectors: the agent's event sources."""

from moescope import compiled

# The compiled hot path (moescope/compiled.py) where it matches the sources: before any module of
# this package is imported.
compiled.install()
