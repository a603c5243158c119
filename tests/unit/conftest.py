"""Unit tests of the pure core: no sockets, no clock, no sleeping."""

from hypothesis import settings

# The test machine is shared: a per-example deadline would turn a busy moment into a failure.
settings.register_profile("kvproxy-unit", deadline=None)
settings.load_profile("kvproxy-unit")
