"""``python -m icecache_cli``."""

from .app import main

main()
