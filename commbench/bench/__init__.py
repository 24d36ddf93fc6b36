"""Benchmarks and the ``commbench`` command: sweeps, training comparisons, reports, launching."""
