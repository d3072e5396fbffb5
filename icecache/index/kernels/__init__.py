"""numba kernels of the DCI-tree, by stage: :mod:`.build` (placing points), :mod:`.query` (a lone
query's walk), :mod:`.shared` (a group's shared walk, heads in parallel), :mod:`.pages` (points ->
ranked pages, the GQA merge), :mod:`.pairs` (the integer sums of the walks' int8 keys). All are
``nogil``, so several heads' trees can be searched at once.

Layout (one tree, one KV head; ``n`` points, ``D = head_dim + 1`` after the inner-product
transform). Node ids: 0 is the root, ``i + 1`` is point ``i``.

- The transformed keys (D float32 each) live only in ``PX``, page-major, at the point's
  ``tok_page``/``tok_slot``; the kernels that place or parent new points take those points' rows
  (``rows``) from the caller. ``proj``: (cap,) float32 projection on the tree's random
  direction; ``level``: (cap,) int8, 0 = bottom; ``parent``: (cap,) int32 node id.
- ``first_page``: (cap + 1,) int32, a node's first child page (-1: none); ``node_size``:
  (cap + 1,) int32 children per node.
- pages: ``members`` (pcap, S) int32 point ids; ``count`` (pcap,); ``next_page`` (pcap,) the
  node's next page in projection order; ``owner`` (pcap,) node id; ``lo``/``hi`` (pcap,) float32
  projection range of the members; ``dirty`` (pcap,) bool.
- ``tok_page``/``tok_slot``: (cap,) int32, where each point sits.
- ``K8`` (pcap, ceil(head_dim / 2), S rounded up to 8, 2) int8 and ``K8_steps`` (pcap, S)
  float32: with ``walk_keys: int8`` the keys rounded for the shared walks, laid out by pairs of
  coordinates for their integer sums (:func:`~.shared.quantize_pages`, :mod:`.pairs`), made
  again for every page an insert or a refinement marks dirty; no rows otherwise.
"""

from .build import attach_sorted, insert_child, insert_children, nearest_among, parents_by_tree
from .pages import group_pages, merge_ranked, ranked_pages
from .query import query_tree, search_many, select_group, topk_indices
from .shared import (
           MERGES,
           best_pages,
           kth_largest,
           peak_pages,
           quantize_pages,
           search_group_shared,
           select_group_shared,
           select_heads_shared,
           split_heads,
           top_copy,
           top_rows,
)

__all__ = ["MERGES", "attach_sorted", "best_pages", "group_pages", "insert_child", "insert_children", "kth_largest",
           "merge_ranked", "nearest_among", "parents_by_tree", "peak_pages", "quantize_pages", "query_tree", "ranked_pages",
           "search_group_shared", "search_many", "select_group", "select_group_shared", "select_heads_shared",
           "split_heads", "top_copy", "top_rows", "topk_indices"]
