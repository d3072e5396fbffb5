"""OmniKV as a selector: a filter layer scores every offloaded token exactly with its own
queries and keeps the top ones; the layers after it (up to the next filter layer) reuse its
choice of tokens (token ids are the same in every layer's host store).

The filter layers are the anchors of the paged cache's layer sharing (``Method.anchor_depths``:
the authors' layers 2, 8 and 18 of 32, scaled to the model's depth).
Where this differs from the paper's: our filter layer attends to the tokens it chose, as the
layers that reuse them do (OmniKV's filter layers keep their whole KV on the device and attend to
all of it); the group's query heads rank tokens by their summed softmax weights.
"""

from __future__ import annotations

import numpy as np

from .base import register
from .token_base import TokenSelector
from .tokens import group_weights, top_tokens


@register("omnikv")
class OmniKVSelector(TokenSelector):
    def choose(self, head: int, queries: np.ndarray, take: int) -> np.ndarray:
        keys = self.keys[head].all()
        return top_tokens(group_weights(queries, keys, self.scale, self.spec.softcap), take)
