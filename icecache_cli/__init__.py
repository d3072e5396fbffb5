"""The ``icecache`` command line: a thin Typer layer over the :mod:`icecache` library."""
