"""Where an ice layer's resident keys sit when positions are remapped (:mod:`.positions`).

The host store holds keys un-rotated (position-free). At a step, the pool's rows are placed to
end just before the window, the sink just before them, and the keys rotated there once; the
query stays at its true position. The pool rows go in token order, one position apart, the
pinned answer passages nearest the window (:func:`placing_order`, ``remap_pin_gap``); on a
model with sliding-window layers, beyond its window (:meth:`~.positions.Remap.pages_end`).
"""

from __future__ import annotations

import numpy as np
import torch

from .positions import Remap, ordered_offsets, place_keys
from .resident import ResidentKV
from .spans import AnswerPassages


def placed(k: torch.Tensor, r: ResidentKV, remap: Remap, passages: AnswerPassages | None, length: int,
           pages_at: int) -> torch.Tensor:
    """A copy of the resident keys ``k`` of a layer holding ``length`` tokens, with the pool rows
    (un-rotated) placed to end at ``pages_at`` (in token order) and the sink just before them."""
    offset, count = placing(r, remap, passages, length, pages_at)
    return place_keys(remap.frame, k, r.sink_fill, r.pool_at, r.window_at, pages_at, offset, count)


def placing(r: ResidentKV, remap: Remap, passages: AnswerPassages | None, length: int,
            pages_at: int, fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`placed`'s placement without the keys: each pool row's offset before ``pages_at``
    (H, P) and each head's span (H,), the sink just before it (:func:`~.positions.place_keys`).
    ``fast``: one numba call (:func:`~.kernels.pinned_offsets_nb` of :func:`placing_args`);
    otherwise, and as its reference, :func:`placing_order`, :func:`~.positions.ordered_offsets`
    and :func:`behind_pinned`."""
    if fast:
        from .kernels import pinned_offsets_nb

        offset, count = pinned_offsets_nb(*placing_args(r, remap, passages, length, pages_at))
        return torch.from_numpy(offset), torch.from_numpy(count)
    valid = r.valid[:, r.pool_at : r.window_at]
    top, keep, room = _bounds(r, remap, length, pages_at)
    pinned = passages is not None and passages.pinned is not None
    with_sink = passages.with_sink(remap.pin_gap) if pinned else None  # once for both calls
    offset, count = ordered_offsets(placing_order(r, remap, passages, valid, with_sink), valid, top, keep)
    if remap.pin_gap and pinned:
        offset, count = behind_pinned(offset, count, valid, room, r, remap, passages, with_sink)
    return offset, count


_NO_ROWS = np.zeros(0, np.int64)


def placing_args(r: ResidentKV, remap: Remap, passages: AnswerPassages | None, length: int,
                 pages_at: int) -> tuple:
    """The arguments of :func:`~.kernels.pinned_offsets_nb` for :func:`placing`: without pinned
    passages, none of the pool's slots pinned and no gap (the kernel is then
    :func:`~.positions.ordered_offsets` of the pool's host rows)."""
    valid = r.valid[:, r.pool_at : r.window_at]
    top, keep, room = _bounds(r, remap, length, pages_at)
    if passages is None or passages.pinned is None:
        return r.pool_row, valid, top, keep, valid.shape[1], 0, False, _NO_ROWS, _NO_ROWS, 0, 0, 0, room, -1
    votes = passages.votes
    cut = (r.pool_pages - r.pinned_slots) * r.page_size
    return (r.pool_row, valid, top, keep, cut, passages.with_sink(remap.pin_gap), bool(remap.pin_gap),
            *votes.rank_table(), votes.spans, remap.pin_gap, room, votes.best)


def _bounds(r: ResidentKV, remap: Remap, length: int, pages_at: int) -> tuple[int, int, int]:
    """The placement's host row ``top`` of the token at ``pages_at``, its ``keep`` and its ``room``."""
    top = pages_at - r.sink_fill  # the host row of the token at pages_at
    # positions beyond pages_at that the pool rows and the sink may take in the trained context
    room = remap.frame.trained - (length - pages_at) - r.sink_fill
    # keep 0 (while the packed rows fit the room): a loaded row at host row ``top`` sits at its
    # true offset, 0, and the step from it to the next row in order is their true distance
    keep = min(0, room + 1 - (r.window_at - r.pool_at))
    return top, keep, room


def behind_pinned(offset: torch.Tensor, count: torch.Tensor, valid: np.ndarray, room: int, r: ResidentKV,
                  remap: Remap, passages: AnswerPassages,
                  with_sink: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``remap_pin_gap``: the ordered offsets (and the span, where the sink goes) with the sink,
    the selected pages' rows and the rows that stay with the sink
    (:meth:`AnswerPassages.with_sink`) ``pin_gap`` positions farther back (less where the trained
    context has no room for it); the other pinned passages stay nearest the window. So the
    document's opening is not cut apart, and nothing comes before the sink (with the sink kept
    near, after the moved pages, the needle of a 16k passkey at depth 5% was lost). When the
    best-voted passage is the one that stays with the sink, nothing moves: that passage is the
    answer's, and it must stay near."""
    gap = min(remap.pin_gap, room - int(count.max()) if count.numel() else 0)
    if gap <= 0:
        return offset, count
    with_sink = passages.with_sink(remap.pin_gap) if with_sink is None else with_sink
    if passages.votes.best < with_sink:  # the best passage continues the sink: it stays near, with the sink
        return offset, count
    cut = (r.pool_pages - r.pinned_slots) * r.page_size
    far = valid.copy()
    far[:, cut:] &= r.pool_row[:, cut:] < with_sink  # of the pinned passages, those that stay with the sink
    return offset + torch.from_numpy(np.where(far, gap, 0)), count + gap


def placing_order(r: ResidentKV, remap: Remap, passages: AnswerPassages | None, valid: np.ndarray,
                  with_sink: int | None = None) -> np.ndarray:
    """The pool rows' order keys for the ordered placement: host rows (token order), except that
    pinned answer passages come after the selected rows, nearest the window, in their own order
    (a passage that stays with the sink, :meth:`AnswerPassages.with_sink`, stays where token
    order puts it, after the sink). With ``remap_pin_gap`` the passages are ordered by their
    votes, the best nearest the window (a filler passage voted third, read between the needle
    and the question, cost the answer)."""
    if passages is None or passages.pinned is None:
        return r.pool_row
    keys = r.pool_row.copy()
    cut = (r.pool_pages - r.pinned_slots) * r.page_size
    pin, ok = keys[:, cut:], valid[:, cut:]
    last = np.where(valid[:, :cut], keys[:, :cut], -1).max(axis=1, keepdims=True)
    move = ok & (pin >= (passages.with_sink(remap.pin_gap) if with_sink is None else with_sink))
    if remap.pin_gap:  # by votes: the best passage nearest the window, each in token order
        worse = passages.votes.spans - passages.votes.passage_rank(pin)
        pin = worse * (int(pin.max()) + 1) + pin
    keys[:, cut:] = np.where(move, np.maximum(last, 0) + 1 + pin, keys[:, cut:])
    return keys
