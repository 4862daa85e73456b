"""Benchmarks (``hsmla-med bench``): one module per benchmark, :mod:`hsmla_med.bench.index`
listing them by the name ``--only NAME`` takes, :mod:`hsmla_med.bench.main` the command line;
they share :mod:`hsmla_med.bench.common` and import no module that imports them back."""
