"""Readers and datasets: dataset JSON, content checks, slides, frames, scans; the synthetic default
data lives in :mod:`hsmla_med.data.synthetic`."""
