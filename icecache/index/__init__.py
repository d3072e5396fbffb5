"""The DCI-tree index over keys (one tree per KV head) and page selection on top of it."""

from .select import merge_group_pages
from .tree import DCITree, IndexConfig

__all__ = ["DCITree", "IndexConfig", "merge_group_pages"]
