"""Datasets: dataset JSON handling, content checks and the synthetic BTCV-format default data."""
