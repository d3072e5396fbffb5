"""H2O (heavy-hitter oracle) as a selector: keep the tokens that have gathered the most attention.

Every offloaded token has an accumulated score: the attention weight the prompt's queries gave
it, plus what each decode step's queries give it while it is kept. The kept set is the
``budget`` tokens of highest score among those not yet evicted; a token that drops out is gone
for good (H2O evicts, it does not recall). Sink and window are the method's recent tokens.

Where this differs from the paper's: past ``PROMPT_QUERIES`` prompt tokens, the prompt's share
is estimated from about that many query positions on a uniform grid over the prompt (each
weighted by the stretch of positions it stands for) plus its last ``observation`` queries (``ObservationSettings``);
a decode step's weights are normalized over the kept tokens (the sink's and window's share left
out); a token leaving the window is credited with what the last ``window + page`` decode queries
gave it, again over the kept tokens and it. Scores are summed over a GQA group's query heads.
"""

from __future__ import annotations

import numpy as np
import torch

from ..chunked import soft_cap
from .base import register
from .snapkv import ObservationSettings
from .token_base import TokenSelector
from .tokens import QueryGrid, group_weights, top_tokens

PROMPT_QUERIES = 1024  # prompt query positions whose attention is accumulated (at most)


def prompt_scores(queries: np.ndarray, positions: np.ndarray, weights: np.ndarray, keys: np.ndarray,
                  lo: int, hi: int, scale: float, softcap: float | None = None) -> np.ndarray:
    """Accumulated causal attention of a group's prompt queries on keys ``lo .. hi-1``.

    queries (G, n, d) at prompt ``positions`` (n,), each counted ``weights`` (n,) times; keys
    (T, d) the prompt's keys. The query at position p attends to keys 0..p (softmax over them).
    Returns (hi - lo,) float64. (The plain reference is a loop over the queries, in the tests.)
    ``softcap``: the scores capped as the model caps them.
    """
    G, n, d = queries.shape
    T = keys.shape[0]
    out = torch.zeros(hi - lo, dtype=torch.float64)
    K = torch.from_numpy(np.ascontiguousarray(keys, np.float32))
    Q = torch.from_numpy(np.ascontiguousarray(queries, np.float32))
    block = max(8, min(256, (1 << 23) // max(1, G * T)))  # scores of at most 32 MB at a time
    cols = torch.arange(T)
    for b in range(0, n, block):
        pos = torch.from_numpy(positions[b : b + block])
        s = soft_cap(torch.einsum("gnd,td->gnt", Q[:, b : b + block], K) * scale, softcap)
        s.masked_fill_(cols[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(s, dim=2)[:, :, lo:hi].double()
        out += torch.einsum("gnt,n->t", p, torch.from_numpy(weights[b : b + block]).double())
    return out.numpy()


@register("h2o")
class H2OSelector(TokenSelector):
    Settings = ObservationSettings
    waits_for_queries = True  # the prompt's queries score the prompt's tokens
    budget_in_index = True  # tokens evicted for one budget are gone

    def __init__(self, spec):
        super().__init__(spec)
        self.grid = QueryGrid(PROMPT_QUERIES, self.settings.observation)  # the prompt's queries
        self.acc: list[np.ndarray] = []  # per KV head: accumulated score per host row
        self.alive: list[np.ndarray] = []  # per KV head: not evicted
        self.kept: list[np.ndarray] = []  # per KV head: the current kept rows
        self.recent: list[np.ndarray] = []  # the last decode steps' queries (H, G, d) each
        self.window_acc: np.ndarray | None = None  # (H, T) prompt scores of every prompt token
        self.first_row = 0  # prompt position of host row 0 (the sink's length)

    def observe(self, queries: torch.Tensor, positions: np.ndarray | None = None) -> None:
        """A prefill chunk's queries (Hq, C, d) at prompt ``positions`` (default: the C
        positions after the last one seen), kept on a :class:`QueryGrid`."""
        self.grid.add(queries, positions)

    def prepared(self, prompt_keys: torch.Tensor, lo: int, hi: int, mid: np.ndarray) -> None:
        keys = prompt_keys[0] if prompt_keys.dim() == 4 else prompt_keys
        keys = keys.detach().float().cpu().numpy()  # (H, T, d) at their positions
        H, T, _ = keys.shape
        q, pos, weights = self.grid.arrays(T)
        self.grid = QueryGrid(PROMPT_QUERIES, self.settings.observation)
        G = q.shape[0] // H if len(pos) else 1
        self.first_row = lo
        self.window_acc = np.zeros((H, T))
        take = self.pages[0].capacity
        self.acc, self.alive, self.kept, self.recent = [], [], [], []
        for h in range(H):
            if len(pos):
                self.window_acc[h] = prompt_scores(q[h * G : (h + 1) * G], pos, weights, keys[h], 0, T, self.scale,
                                                   self.spec.softcap)
            acc = np.zeros(max(16, 2 * (hi - lo)))
            acc[: hi - lo] = self.window_acc[h, lo:hi]
            alive = np.zeros(len(acc), bool)
            kept = top_tokens(acc[: hi - lo], take)
            alive[kept] = True
            self.acc.append(acc)
            self.alive.append(alive)
            self.kept.append(kept)

    def added(self, head: int, ids: np.ndarray, keys: np.ndarray) -> None:
        acc, alive = self.acc[head], self.alive[head]
        if ids[-1] >= len(acc):
            size = max(ids[-1] + 1, 2 * len(acc))
            acc = np.concatenate([acc, np.zeros(size - len(acc))])
            alive = np.concatenate([alive, np.zeros(size - len(alive), bool)])
            self.acc[head], self.alive[head] = acc, alive
        at = ids + self.first_row  # prompt positions (a prompt token keeps its prompt share)
        inside = at < self.window_acc.shape[1]
        acc[ids[inside]] = self.window_acc[head, at[inside]]
        if self.recent:
            kept = self.kept[head]
            both = np.concatenate([kept, ids])
            rows = self.keys[head].all()[both]
            for q in self.recent:
                acc[ids] += group_weights(q[head], rows, self.scale, self.spec.softcap)[len(kept) :]
        alive[ids] = True

    def choose(self, head: int, queries: np.ndarray, take: int) -> np.ndarray:
        acc, alive = self.acc[head], self.alive[head]
        n = self.keys[head].n
        cand = np.flatnonzero(alive[:n])
        keep = cand[top_tokens(acc[cand], take)]
        alive[cand] = False
        alive[keep] = True  # the others are evicted for good
        self.kept[head] = keep
        acc[keep] += group_weights(queries, self.keys[head].all()[keep], self.scale, self.spec.softcap)
        return keep

    def select(self, queries: np.ndarray, max_pages: int, wide: float = 0.0) -> list[np.ndarray]:
        out = super().select(queries, max_pages, wide)
        self.recent.append(np.asarray(queries, np.float32).copy())
        room = self.spec.window_tokens + self.spec.page_size
        del self.recent[: max(0, len(self.recent) - room)]
        return out

    def release(self) -> None:
        super().release()
        self.acc, self.alive, self.kept, self.recent = [], [], [], []
        self.window_acc = None
