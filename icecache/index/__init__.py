"""The DCI-tree index over keys (one tree per KV head) and page selection on top of it; the
index knows nothing of the cache."""

from .config import IndexConfig
from .select import merge_group_pages
from .tree import DCITree
from .walk import select_layer

__all__ = ["DCITree", "IndexConfig", "merge_group_pages", "select_layer"]
