"""The synthetic default data: one generator per task, each writing the benchmark's real on-disk
format with the real datasets' quirks (see each module), used when no ``--data-dir`` is given."""
