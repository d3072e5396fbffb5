"""The bandwidth floor (icecache.bench.floor): the bytes of weights a decode step reads."""

from __future__ import annotations

import math

import torch
from torch import nn

from icecache import weights as W
from icecache.bench import floor
from icecache.head import CheckedHead


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(128, 64, bias=False)
        self.b = nn.Linear(128, 64, bias=True)
        self.head = nn.Linear(64, 96, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_weight_bytes_count_each_layer_in_the_form_it_is_read():
    model = _TwoLayers()
    as_float = floor.weight_bytes(model)
    assert as_float == 4 * (128 * 64 + 128 * 64 + 64 + 64 * 96)
    model.a = W.Int4Linear(model.a)
    model.head = CheckedHead(model.head)
    # int4: half a byte a weight and a bfloat16 step and offset per group of 32; the head: a byte a
    # weight in tiles of 64 rows (96 rows are two tiles: the padding is read too), a float32 scale
    # and bound per row; b unchanged
    int4 = 128 * 64 // 2 + (128 // 32) * 64 * 2 * 2
    head = 64 * 128 + 96 * (4 + 4)
    assert floor.weight_bytes(model) == int4 + 4 * (128 * 64 + 64) + head


def test_the_floor_is_the_weights_at_the_measured_read_speed():
    speed = floor.read_speed(nbytes=8 << 20, passes=2)
    assert math.isfinite(speed) and speed > 1e8  # any machine reads 100 MB/s
    f = floor.Floor(10_000_000, speed)
    assert f.ms == 1000 * 10_000_000 / speed and "ms a token" in f.line()
