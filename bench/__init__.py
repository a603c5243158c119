"""Benchmarks of kvproxy and its peer routers (not part of the installed package)."""
