"""Locally generated evaluation tasks (no downloads) and their scorers."""
