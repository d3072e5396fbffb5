"""Screening only: forced_answer.py with remap_rest kept out of the document cache's identity, so
the saved 100k document is reused (its prompt-end steps were computed without estimate rows)."""
import runpy, sys
from icecache import doc_cache
doc_cache.STATE_NEUTRAL = doc_cache.STATE_NEUTRAL | {"remap_rest"}
sys.argv = ["forced_answer.py", *sys.argv[1:]]
runpy.run_path("/work/main/scripts/forced_answer.py", run_name="__main__")
