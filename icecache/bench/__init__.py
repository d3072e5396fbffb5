"""Benchmarks behind ``icecache bench``: measured figures, ratios taken within one run."""
