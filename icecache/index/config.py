"""How a DCI-tree is built and searched: :class:`IndexConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from .kernels.shared import MERGES  # the GQA merge rules, in the order of their kernel codes

WALK_KEYS = ("float32", "int8")  # what a shared walk scores (IndexConfig.walk_keys)


@dataclass(frozen=True)
class IndexConfig:
    """How a tree is built and searched.

    ``ratio_bottom`` / ``ratio_upper``: share of points promoted from the bottom level and from
    each higher level. ``promotion``: ``deterministic`` (every 1/ratio-th point in insertion
    order) or ``random`` (independent draws with ``seed``). ``exact_parent_max``: a batch of
    points (a bulk build, an evicted chunk) whose level above holds at most this many points
    gets exact nearest parents by matrix products, else parents by a tree walk (single points:
    exact up to 512). At a 128k-key bulk build (random keys, 2 cores) exact parents over the
    4k-point level took 0.6 s against the walk's 1.8 s; at 256k (8k points) 2.4 vs 4.3 s.
    ``beam``: nodes expanded per level in a query (at least; ``beam_frac`` x n if larger).
    ``visit_frac``: share of an expanded node's children scored (nearest projections first).
    ``pages``: how a node's children are cut into pages: ``projection`` (runs along a random
    direction; a full page splits in half along it) or ``similar`` (balanced k-means groups at a
    bulk build; a new child joins its nearest sibling's page; a full page splits by balanced
    2-means). ``merge``: how a GQA group's queries share one KV head's pages: ``ranks`` (each
    query's pages by best member, interleaved rank by rank), ``mass`` (the pages holding the
    most of the group's summed attention, estimated from the scanned scores) or ``peaks`` (the
    same estimate from each page's best scanned member: one exponential per page and query).
    ``refine``: Lloyd passes over the bottom level's grouping after a build or a batch insert of
    at least ``refine_min`` keys (0: none): each bottom point of the parents that batch touched
    moves to the parent, among its parent's ``refine_candidates`` nearest, whose children's mean
    is nearest; the parents whose children changed are cut into pages again (``pages``'s rule).
    Parents stay points of the level above; a walk still scores them by their own keys.
    ``walk_keys``: the keys a shared walk (a decode step's search) scores: ``float32`` (the
    transformed keys themselves) or ``int8`` (a copy of each key rounded to int8 with a step of
    its own, ``max |k| / 127``, kept beside them page by page: a page's 16 keys in 1 KiB against
    4 KiB; see :func:`~icecache.index.kernels.shared.quantize_pages`). The builds, the lone
    queries and the parents' searches always read the float keys.
    ``top_rows``: a shared walk scans the levels above the bottom whole, from the top down to the
    lowest level at which they hold at most this many points, from one contiguous copy of their
    keys (:func:`~icecache.index.kernels.shared.top_copy`, made again after an insert that adds
    points above the bottom), and walks level by level from there (0: every level walked).
    Walked, those levels are a chain of small dependent reads (a node's pages, their keys, the
    next level's nodes); at 16k keys a walk scanned most of the points above the bottom anyway.

    Defaults: the authors promote 1 in 100 bottom points with a field of view of 30; on this
    model's real keys at 8k tokens, 1 in 32 with a beam of 48 gives pages that hold more
    attention mass (0.797 vs 0.758 at budget 256, per query head) at a shorter query (184 vs
    259 us per head) and about the same recall@64 (0.973 vs 0.987); see docs/index.md.
    """

    page_size: int = 16
    ratio_bottom: float = 1 / 32
    ratio_upper: float = 0.2
    promotion: str = "deterministic"
    seed: int = 0
    exact_parent_max: int = 16384
    beam: int = 48
    beam_frac: float = 0.001
    visit_frac: float = 1.0
    parent_beam: int = 8
    shared_walk: bool = True
    pages: str = "projection"
    merge: str = "ranks"
    refine: int = 0
    refine_candidates: int = 8
    refine_min: int = 256
    walk_keys: str = "float32"
    top_rows: int = 2048

    def __post_init__(self):
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {', '.join(MERGES)}")
        if self.walk_keys not in WALK_KEYS:
            raise ValueError(f"walk_keys must be one of {', '.join(WALK_KEYS)}")
        if self.pages not in ("projection", "similar"):
            raise ValueError("pages must be 'projection' or 'similar'")
        if self.promotion not in ("deterministic", "random"):
            raise ValueError("promotion must be 'deterministic' or 'random'")
        if not (0 < self.ratio_bottom < 1 and 0 < self.ratio_upper < 1):
            raise ValueError("promotion ratios must be in (0, 1)")
        if self.refine < 0 or self.refine_candidates < 1 or self.refine_min < 1:
            raise ValueError("refine must be >= 0, refine_candidates and refine_min >= 1")
        if self.top_rows < 0:
            raise ValueError("top_rows must be 0 (off) or more")
        if self.page_size < 2:
            raise ValueError("page_size must be >= 2")
