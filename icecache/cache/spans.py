"""Passages pinned for the answer (``answer_spans``).

A fact copied from a long document (a number, a name) must be read in token order: its tokens
one after the other, at distances one apart. The pages of a DCI-tree group keys by similarity, so
a 7-digit number's digits sit in pages beside the document's other digits, and a decode step's
selection brings back some of them: the answer starts with the number's first digits and stops
(docs/results.md, "Accuracy beyond the trained context").

:class:`SpanVotes` finds the places the question points to and keeps them whole. The prompt's
last steps that run one token at a time (a sparse prefill's tail, a question after a saved
document; at most 32) vote: every sparse layer scores its query heads' exact attention weights
over the offloaded tokens (softmax over them), and a token keeps its largest weight over the
heads, layers and steps. The prompt's last step then pins the passages, so the first answer
token reads them. A prompt whose end came in a chunk (a full prefill) has no such steps: its
chunk's last queries, kept as the chunk computed them, vote the same way before the first
generated token's step, which pins (with remapped positions, where the index sees queries
turned to the pages' place, the first generated token votes and the steps after it read the
passages). At 16k, Gemma 3's first answer digit was written without the passages before the
prefill's queries voted (docs/results.md, "Gemma 3 270M at 16k"). The first version summed the
weights over the heads at the prompt's last step and the first generated token's: that
favoured the early sentence ends that many heads attend a little. In a 16k report its best
passages held the three facts only 4th, 7th and past the 16th, where the largest weight over
the question's steps put each fact first: the few heads that look a fact up weigh it highly.
After that, the ``answer_spans`` tokens with the most votes, each at least a passage away from
the ones before, become anchors, and each anchor's passage (a page of tokens before it, two pages
from it on, in token order) stays resident in every sparse layer for every generated token,
beside the budget's own pages. With remapped positions (``ordered``) the passages are placed
after the selected rows, nearest the window, each in its own token order, so a passage reads as
the text just before the question; a passage that continues the sink stays right after it. In
token order among the selected rows, a mid-document passage found 1 of 4 prose needles at 32k
where placed nearest the window it found 2 (docs/results.md, "Accuracy beyond the trained context").
"""

from __future__ import annotations

import numpy as np
import torch

from .chunked import soft_cap
from .score_kernels import half_scores
from .selectors.tokens import TokenPages
from .spec import SPAN_PAGES, VOTE_STEPS

VOTE_BLOCK = 2048  # keys per block of the reference's scores
HALVES = (torch.float16, torch.bfloat16)


class SpanVotes:
    """The votes of one sequence's answer start, shared by its sparse layers."""

    def __init__(self, spans: int, page_size: int):
        self.spans = spans
        self.before = page_size  # rows of a passage before its anchor
        self.after = (SPAN_PAGES - 1) * page_size  # rows from the anchor on
        self.votes = np.zeros(0, np.float64)
        self.chosen: np.ndarray | None = None  # the pinned host rows, once chosen
        self.anchors: list[int] = []  # the passages' anchors (host rows), best voted first, once chosen
        self._row_rank = np.empty(0, np.int64)  # each chosen row's passage rank (passage_rank)
        self.step = 0  # the cache length at the latest vote (0: none yet)

    @property
    def best(self) -> int:
        """The most-voted host row (the first anchor; -1: none chosen)."""
        return self.anchors[0] if self.anchors else -1

    def passage_rank(self, rows: np.ndarray) -> np.ndarray:
        """Each host row's passage rank by votes: a run of pinned rows (passages that join are
        one) ranks as its best anchor (0: the best voted); a row in no passage ranks
        ``len(anchors)``. The runs and their ranks are found once, when the passages are chosen
        (:meth:`rows`); a step only looks its rows up."""
        rows = np.asarray(rows)
        out = np.full(rows.shape, len(self.anchors), np.int64)
        chosen = self.chosen
        if chosen is None or not len(chosen):
            return out
        at = np.searchsorted(chosen, rows)
        hit = (at < len(chosen)) & (chosen[np.minimum(at, len(chosen) - 1)] == rows)
        out[hit] = self._row_rank[at[hit]]
        return out

    def rank_table(self) -> tuple[np.ndarray, np.ndarray, int]:
        """:meth:`passage_rank`'s lookup as arrays, for a kernel: the chosen host rows (sorted,
        int64), each one's passage rank, and the rank of a row in no passage."""
        chosen = self.chosen if self.chosen is not None else ()
        return np.asarray(chosen, np.int64), np.asarray(self._row_rank, np.int64), len(self.anchors)

    def add(self, weights: np.ndarray, step: int = 0) -> None:
        """One layer's votes at the step where the cache holds ``step`` tokens: (n,) over host
        rows 0 .. n-1; a row keeps its best vote."""
        if self.chosen is not None:
            return
        self.step = max(self.step, step)
        n = len(weights)
        if n > len(self.votes):
            grown = np.zeros(n, np.float64)
            grown[: len(self.votes)] = self.votes
            self.votes = grown
        np.maximum(self.votes[:n], weights, out=self.votes[:n])

    def rows(self, limit: int, merge: bool = False) -> np.ndarray:
        """The pinned host rows (sorted, below ``limit``), chosen at the first call (``merge``:
        passages may join, :func:`pinned_anchors`)."""
        if self.chosen is None:
            votes = self.votes[:limit]
            self.anchors = pinned_anchors(votes, self.spans, self.before, self.after, merge)
            self.chosen = passage_rows(self.anchors, len(votes), self.before, self.after)
            self._row_rank = run_ranks(self.chosen, self.anchors)
        return self.chosen[self.chosen < limit]


def pinned_anchors(votes: np.ndarray, spans: int, before: int, after: int, merge: bool = False) -> list[int]:
    """The anchors of :func:`pinned_rows`, best voted first. ``merge``: an anchor may be any
    row outside the passages taken so far, so a well-voted row just outside one extends it
    (the passages then overlap and join into one longer passage)."""
    if len(votes) == 0 or spans == 0:
        return []
    taken = np.zeros(len(votes), np.bool_)
    anchors: list[int] = []
    for a in np.argsort(-votes, kind="stable"):
        if len(anchors) == spans or votes[a] <= 0:
            break
        if taken[a]:
            continue
        anchors.append(int(a))
        if merge:  # the passage's own rows
            taken[max(0, a - before) : a + after] = True
        else:  # a later anchor's passage must not reach into this one's
            taken[max(0, a - before - after + 1) : a + after + before] = True
    return anchors


def pinned_rows(votes: np.ndarray, spans: int, before: int, after: int, merge: bool = False) -> np.ndarray:
    """Rows of the ``spans`` passages around the most-voted rows: anchors taken greedily by votes,
    each outside the reach of those taken before (no two passages overlap; ``merge``: outside
    their rows, :func:`pinned_anchors`); a passage is ``anchor - before .. anchor + after - 1``,
    clipped to the rows there are."""
    return passage_rows(pinned_anchors(votes, spans, before, after, merge), len(votes), before, after)


def run_ranks(chosen: np.ndarray, anchors: list[int]) -> np.ndarray:
    """For each of the sorted pinned rows ``chosen``: the rank of the best anchor in its run of
    consecutive rows (passages that join are one run)."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(chosen) != 1) + 1]) if len(chosen) else np.empty(0, np.int64)
    run_rank = np.full(len(starts), len(anchors), np.int64)
    for i, a in enumerate(anchors):
        run = np.searchsorted(chosen[starts], a, side="right") - 1
        run_rank[run] = min(run_rank[run], i)
    return run_rank[np.searchsorted(starts, np.arange(len(chosen)), side="right") - 1]


def passage_rows(anchors: list[int], n: int, before: int, after: int) -> np.ndarray:
    """The sorted rows of the passages around ``anchors`` (``anchor - before .. anchor + after -
    1``, within rows 0 .. n-1)."""
    rows = [np.arange(max(0, a - before), min(n, a + after)) for a in anchors]
    return np.unique(np.concatenate(rows)) if rows else np.empty(0, np.int64)


def head_weights(queries: torch.Tensor, keys: torch.Tensor, n: int, scale: float,
                 softcap: float | None = None) -> np.ndarray:
    """queries (H, G, d), keys (H, >= n, d) (a host store's buffer; rows 0 .. n-1 are voted
    over) -> (n,) float64: each query head's softmax over the n keys; a key's weight is its
    largest over the query heads. 16-bit keys in host memory are scored by
    :func:`~icecache.cache.score_kernels.half_scores`, others by :func:`vote_scores_reference`;
    ``softcap``: the scores capped as the model caps them before the softmax."""
    H = keys.shape[0]
    if n == 0:
        return np.zeros(0)
    q = queries.float() * scale
    if keys.dtype in HALVES and keys.device.type == "cpu" and keys.is_contiguous():
        bits = keys.view(torch.int16).numpy().view(np.uint16)
        out = np.empty((H, q.shape[1], n), np.float32)
        half_scores(np.ascontiguousarray(q.cpu().numpy()), bits, n, keys.dtype == torch.bfloat16, out)
        s = torch.from_numpy(out)
    else:
        s = vote_scores_reference(q, keys[:, :n])
    return torch.softmax(soft_cap(s, softcap), dim=-1).amax(dim=(0, 1)).double().cpu().numpy()


def vote_scores_reference(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q (H, G, d) float32 (scaled) times keys (H, n, d) of any float dtype -> (H, G, n) float32:
    the plain product, the keys converted to float32 a block at a time (one float32 copy of a
    100k float16 store cost more than the product itself: 67 vs 27 ms per layer and step)."""
    H, n, _ = keys.shape
    s = torch.empty(H, q.shape[1], n, dtype=torch.float32, device=keys.device)
    q = q.to(keys.device)
    for a in range(0, n, VOTE_BLOCK):
        torch.matmul(q, keys[:, a : a + VOTE_BLOCK].float().transpose(1, 2), out=s[:, :, a : a + VOTE_BLOCK])
    return s


class AnswerPassages:
    """One sparse layer's side of ``answer_spans``: the votes (shared by the sequence's sparse
    layers), the passages pinned for the answer once chosen (``pinned``), and what every step's
    load and placement read of them, fixed once chosen (``load``: page ids, page table, the host
    rows sorted; ``lead``: how many of those rows continue the sink)."""

    def __init__(self, votes: SpanVotes, page_size: int, span_pages: int):
        self.votes = votes
        self.page_size, self.span_pages = page_size, span_pages
        self.pinned = None  # a TokenPages of the pinned passages, once chosen
        self.load: tuple | None = None
        self.lead = 0
        # the prompt's last queries a prefill chunk computed: (positions, (query heads, m, d)),
        # at most VOTE_STEPS of them, the latest (:meth:`keep`)
        self.prompt_end: tuple[np.ndarray, torch.Tensor] | None = None

    def keep(self, queries: torch.Tensor, positions: np.ndarray) -> None:
        """Keep the latest ``VOTE_STEPS`` of a prefill's queries (query heads, n, d) at prompt
        ``positions`` (n,), for the votes of a prompt that comes whole (:meth:`prompt_votes`)."""
        positions = np.asarray(positions, np.int64)
        if self.prompt_end is not None:
            positions = np.concatenate([self.prompt_end[0], positions])
            queries = torch.cat([self.prompt_end[1], queries], dim=1)
        latest = np.argsort(positions, kind="stable")[-VOTE_STEPS:]
        self.prompt_end = (positions[latest], queries[:, torch.from_numpy(latest)].detach().float().cpu())

    def prompt_votes(self, heads: int, store, scale: float, softcap: float | None = None) -> None:
        """A prompt that came whole (a full prefill, no steps of its own): the queries
        :meth:`keep` holds of its last ``VOTE_STEPS`` tokens vote over the offloaded keys in
        ``store``, as those steps would have (each query head's softmax over them), so the first
        generated token's step already reads the passages. Once; none where nothing was kept."""
        if self.prompt_end is None or store is None or not store.rows or self.votes.chosen is not None:
            return
        positions, q = self.prompt_end
        self.prompt_end = None
        end = int(positions.max()) + 1  # the prompt's length
        q = q[:, torch.from_numpy(positions >= end - VOTE_STEPS)]
        Hq, m, d = q.shape  # query heads grouped by KV head, as the attention has them
        self.votes.add(head_weights(q.reshape(heads, Hq // heads * m, d), store.keys, store.rows, scale,
                                    softcap), end)

    def awaits_prompt_votes(self) -> bool:
        """Whether the votes are still to come from the prompt's kept queries: none cast yet
        (no stepped prompt end voted) and queries kept."""
        return self.prompt_end is not None and not self.votes.step and self.votes.chosen is None

    def clear(self) -> None:
        """Nothing pinned (a fork to another budget chooses again)."""
        self.pinned = self.load = None

    def step(self, length: int, answer_at: int, store, chooser: torch.Tensor, scale: float,
             merge: bool, softcap: float | None = None) -> None:
        """A step of a layer holding ``length`` tokens whose prompt ends at ``answer_at`` (0: not
        known yet). The prompt's last steps that run one token at a time (at most
        ``VOTE_STEPS``: a sparse prefill's tail, a question after a saved document) vote with
        this step's queries as the index sees them (``chooser``: H, G, d) over the offloaded
        keys in ``store``. The prompt's last step pins the passages those steps voted for, so the
        first answer token already reads them. A prompt whose end came in a chunk has voted with
        its chunk's last queries before the first generated token's step (:meth:`prompt_votes`),
        which pins; where none were kept (remapped positions) that step votes and the next pins.
        ``merge``: passages may join (:func:`pinned_anchors`; with ``remap_pin_gap`` the budget's
        pages sit far back and the passages carry the answer alone, so a well-voted row next to a
        passage joins it: a needle's first mention cut off otherwise). ``softcap``: the model's
        cap on its scores, applied to the votes' scores."""
        if not answer_at or length <= answer_at - VOTE_STEPS or store is None or self.pinned is not None:
            return
        if length >= answer_at and self.votes.step and self.votes.step < length:
            self.pinned = TokenPages(self.page_size, self.span_pages)
            ids = self.pinned.choose(self.votes.rows(store.rows, merge))
            rows = np.sort(self.pinned.tokens())
            self.load = (ids.astype(np.int64), self.pinned.table(), rows)
            self.lead = int(np.sum(rows == np.arange(len(rows))))  # rows 0 .. lead-1 continue the sink
        elif length <= answer_at + 1:
            self.votes.add(head_weights(chooser.cpu(), store.keys, store.rows, scale, softcap), length)

    def with_sink(self, pin_gap: int) -> int:
        """Pinned host rows below this stay in token order right after the sink instead of
        nearest the window: a passage that continues the sink; with ``pin_gap``, a passage that
        starts within a passage's length of it too (its whole run of rows). Text that runs
        across the sink's end (a needle at the document's start) then stays together: cut
        apart by the gap, a 16k passkey at depth 0 was lost."""
        if not pin_gap or self.load is None:
            return self.lead
        rows = self.load[2]
        if not len(rows) or rows[0] >= SPAN_PAGES * self.page_size:
            return self.lead
        breaks = np.flatnonzero(np.diff(rows) != 1)
        end = int(rows[breaks[0]]) + 1 if len(breaks) else int(rows[-1]) + 1  # the first run's end
        return max(self.lead, end)
