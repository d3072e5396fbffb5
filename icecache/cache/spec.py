"""What fixes an ice cache's layout (:class:`IceSpec`) and what its decode steps add up to
(:class:`StepStats`).

Inside the cache every budget is in pages of ``page_size`` tokens; tokens appear only at the
user-facing edge (``Settings.budget``), converted once in :func:`icecache.methods.ice_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPAN_PAGES = 3  # a pinned answer passage: a page before its anchor token, two from it on
VOTE_STEPS = 32  # answer_spans: the prompt's last steps (run one token at a time) that vote


@dataclass(frozen=True)
class IceSpec:
    page_size: int = 16
    budget_pages: int = 16  # selected pages resident per KV head at a decode step (0: none)
    sink_tokens: int = 32
    window_tokens: int = 32
    selector: str = "dci"  # a name in icecache.cache.selectors.SELECTORS
    tuning: Any = None  # the selector's own settings (its ``Settings`` dataclass); None: its defaults
    pipeline: bool = True  # offload + index a layer in the background while the next computes
    sparse_prefill: bool = False  # chunks after the first attend to sink + selected pages + window
    prefill_pages: int = 64  # sparse prefill: pages a chunk selects per KV head
    tail_pages: int = 16  # sparse prefill: pages a prompt-end step selects per KV head
    tail_beam_frac: float = 1.0  # sparse prefill: share of the keys a prompt-end step's search covers
    chunk_tokens: int = 2048  # sparse prefill: room for one chunk in the window
    prefill_queries: int = 16  # sparse prefill: chunk positions whose queries select the pages
    dense_window: int = 4096  # sparse prefill: recent tokens the dense layers attend to
    answer_spans: int = 0  # passages pinned for the answer after the prompt's end voted (0: off)
    host_dtype: str | None = None  # the host store's dtype ("float16", ...); None: the KV's own
    # The model's cap on its attention scores (Gemma 2's attn_logit_softcapping; None: none):
    # the selectors' attention weights (SnapKV's and H2O's votes, OmniKV's and PQCache's
    # weights, the answer passages' votes) cap their scores as the model does. The DCI tree's
    # page search (numba, icecache/index) ranks by uncapped scores: the cap is monotone, so each
    # query's order of keys is the same, and only how much a page's mass outweighs another's
    # shifts (the attention itself is exact over whatever pages are loaded).
    softcap: float | None = None
    # the decode attention over the resident rows on a GPU: "torch", "flashinfer" or "auto"
    # (:class:`~.backend.TorchBackend`)
    attention_backend: str = "auto"
    # key dimensions a decode step's page searches cover: sparse layers x KV heads x head_dim
    # (the DCI selector's auto beam; 0: unknown)
    walk_dims: int = 0

    @property
    def span_pages(self) -> int:
        """Pool slots the pinned answer passages take (``answer_spans`` x three pages)."""
        return SPAN_PAGES * self.answer_spans if self.budget_pages else 0

    @property
    def pool_pages(self) -> int:
        """Pool slots during prefill (a sparse chunk's selection may be larger than decode's)."""
        if self.sparse_prefill and self.budget_pages:
            return max(self.budget_pages, self.prefill_pages) + self.span_pages
        return self.budget_pages + self.span_pages

    @property
    def decode_pool_pages(self) -> int:
        """Pool slots at decode: the budget's and the pinned passages'."""
        return self.budget_pages + self.span_pages

    @property
    def window_slack(self) -> int:
        """Window rows at decode: the kept window and one page that fills before it leaves."""
        return self.window_tokens + self.page_size


@dataclass
class StepStats:
    """Summed over ice layers and decode steps (``steps`` counts model steps)."""

    steps: int = 0
    layer_steps: int = 0
    pages_selected: int = 0
    pages_loaded: int = 0
    bytes_moved: int = 0
    query_s: float = 0.0
    load_s: float = 0.0
    attention_s: float = 0.0
    index_build_s: float = 0.0
    index_insert_s: float = 0.0

    def reset_step_counters(self) -> None:
        """Forget what prefill chunks selected and loaded (a sparse prefill's work is not the
        decode steps'); the index build and insert times stay."""
        self.layer_steps = self.pages_selected = self.pages_loaded = self.bytes_moved = 0
        self.query_s = self.load_s = self.attention_s = 0.0

    def as_dict(self) -> dict:
        per = max(1, self.steps)
        return {
            "decode_steps": self.steps,
            "pages_selected_per_step": self.pages_selected / per,
            "pages_loaded_per_step": self.pages_loaded / per,
            "bytes_moved_per_step": self.bytes_moved / per,
            "query_ms_per_step": 1000 * self.query_s / per,
            "load_ms_per_step": 1000 * self.load_s / per,
            "attention_ms_per_step": 1000 * self.attention_s / per,
            "index_build_s": self.index_build_s,
            "index_insert_s": self.index_insert_s,
        }
