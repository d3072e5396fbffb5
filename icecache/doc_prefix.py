"""A session's use of the document cache (:mod:`.doc_cache`): where a prompt's prefix is saved
to or loaded from, and the saving and loading itself. :class:`DocPrefixes` is a part of
:class:`~.generation.Session` (its cache, model, method and run settings)."""

from __future__ import annotations

from .cache.state import load_layers, save_layers
from .cache.window import kv_in_order, seen
from .doc_cache import SHAPING_IF_SET, STATE_NEUTRAL
from .methods import get, reads_prompt_queries


class DocPrefixes:
    # The most prompt tokens after a document that a sparse prefill with the document cache runs
    # as decode steps (so that the saved state ends where the document does).
    DOC_TAIL_MAX = 256

    def _doc_plan(self, prefix: int, start: int, cut: int, total: int):
        """Where this run's prompt is saved to / loaded from the document cache, and the cache's
        view for it: (0, None) when not. A full prefill's entry is the dense KV of the shared
        prefix (the same for every method); a sparse prefill's is the cache's whole state (host
        store, index, window: :mod:`.cache.state`), for this method and these exact settings.
        Not for SnapKV or H2O (their selection also reads the prompt's queries) nor remapped
        positions in a full prefill."""

        run, m = self.run_settings, get(self.method)
        if (self.doc_cache is None or prefix < max(1, self.doc_min_tokens) or prefix <= start
                or prefix >= total or reads_prompt_queries(m)):
            return 0, None
        if run.prefill == "full":
            if run.positions != "true" or prefix >= cut:
                return 0, None
            return prefix, self.doc_cache
        if not m.cache.saves_state or (prefix >= cut and total - prefix > self.DOC_TAIL_MAX) or start:
            return 0, None
        # The state at the document's end depends neither on what follows it (one entry serves a
        # summary and questions of any length) nor on the decode budget while that fits in the
        # chunks' pool (``IceCache.forked``'s rule: the same pool size): pages are re-selected.
        budget = 0 if run.budget <= run.prefill_budget else run.budget
        settings = {k: v for k, v in run.replace(budget=budget).as_dict().items()
                    if SHAPING_IF_SET.get(k, object()) != v  # later settings at their defaults: left out
                    and k not in STATE_NEUTRAL}
        # "state" counts the layouts of a saved layer: a layout change makes older entries unseen
        # (2: an ice layer's answer passages in one object; 3: a selector holds its own settings)
        kind = {"state": 3, "method": self.method, "settings": settings}
        return prefix, self.doc_cache.with_kind(kind)

    def _save_prefix(self, ids: list[int], dc) -> None:
        dtype = self.loaded.model.dtype
        if any(layer.values is not None and layer.values.dtype != dtype for layer in self.cache.layers):
            return  # values already taken to a decode dtype (dense_kv) are not the prompt's exact ones
        if dc is self.doc_cache:  # a full prefill: every layer's keys and values (a window layer's window)
            windows = [layer.sliding_window if layer.is_sliding else 0 for layer in self.cache.layers]
            dc.save(ids, [kv_in_order(layer) for layer in self.cache.layers], windows)
            return
        try:
            skeleton, tensors = save_layers(self.cache)
        except Exception as exc:  # noqa: BLE001  (an unsaveable state never fails the task)
            dc.warn(f"document cache: not saved ({exc})")
            return
        dc.save_entry(ids, lambda: tensors, {"skeleton": skeleton})

    def _load_prefix(self, ids: list[int], limit: int, start: int, cut: int, dc) -> bool:
        """Load the longest saved prefix of ``ids`` (at most ``limit`` tokens, more than the
        ``start`` tokens already cached) into a fresh cache; False when there is none."""
        n = dc.find(ids, limit)
        if n <= start:
            return False
        device = self.loaded.model.device
        if dc is self.doc_cache:
            kv = dc.load(ids[:n], device)
            if kv is None:
                return False
            self.cache = self._new_cache(len(ids))
            if self.ice is not None:
                self.ice.begin_prefill(cut, tail=len(ids) - cut)
            for i, (k, v) in enumerate(kv):
                self.cache.update(k, v, i)
                seen(self.cache.layers[i], n)  # a window layer's entry holds its window of the prefix
        else:
            got = dc.load_entry(ids[:n], "cpu", lazy=True)
            if got is None:
                return False
            cache = self._new_cache(len(ids))
            try:
                load_layers(cache, got[0]["skeleton"], got[1])
            except Exception as exc:  # noqa: BLE001
                dc.warn(f"document cache: entry not used ({exc}); prefilling again")
                self.cache = self._new_cache(len(ids))
                return False
            self.cache = cache
            self.cache.begin_prefill(cut - n, tail=len(ids) - cut)
        self.cached_ids = list(ids[:n])
        return True

