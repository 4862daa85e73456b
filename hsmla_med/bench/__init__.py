"""Benchmarks (``hsmla-med bench``): one module per table, :mod:`hsmla_med.bench.main` for the
command line; the tables share :mod:`hsmla_med.bench.common` and import no module that imports
them back."""
