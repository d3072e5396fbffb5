"""Compile the numba kernels (and convert the embedded model) ahead of the first run.

numba compiles a kernel on its first call and caches the machine code on disk (``cache=True``,
next to the sources), so only the first run after an install pays it: tens of seconds on two
cores, in front of the user. ``make setup`` runs ``python -m icecache.warmup`` once, so that
``icecache summarize`` with the ice cache starts as fast as with the dense one. The layer walk
over all KV heads (:func:`~icecache.index.walk.select_layer`) is compiled per head count: the
common ones are done here, another compiles on its first use. It also converts the embedded
GGUF into the cache folder (:func:`convert_embedded`), which the first run would otherwise do.
"""

from __future__ import annotations

import sys
import time

import numpy as np

KV_HEADS = (1, 2, 3, 4, 8)


def compile_index(head_dim: int = 64, group: int = 3, kv_heads=KV_HEADS) -> None:
    """Build, insert into and query small DCI-trees (every kernel the cache calls), with the
    walks on float keys and on their int8 copy (``index_walk_keys``)."""
    from .index.config import WALK_KEYS

    for walk_keys in WALK_KEYS:
        _compile_trees(head_dim, group, kv_heads, walk_keys)


def _compile_trees(head_dim: int, group: int, kv_heads, walk_keys: str) -> None:
    from .index import DCITree, IndexConfig, select_layer

    cfg = IndexConfig(walk_keys=walk_keys)
    rng = np.random.default_rng(0)
    trees = []
    for _ in range(max(kv_heads)):
        keys = rng.standard_normal((3000, head_dim)).astype(np.float32)
        tree = DCITree(head_dim, cfg, capacity=len(keys))
        tree.insert(keys[:-cfg.page_size])  # the bulk build
        for lo in range(len(keys) - cfg.page_size, len(keys), 4):
            tree.insert(keys[lo : lo + 4])  # point-by-point insertion
        trees.append(tree)
    queries = rng.standard_normal((max(kv_heads), group, head_dim)).astype(np.float32)
    trees[0].refine(None, 1)  # the Lloyd refinement (profile key index_refine)
    trees[0].search(queries[0], 64)
    trees[0].search_group(queries[0], 64)
    trees[0].select_group(queries[0], 64, 4)
    for h in kv_heads:
        select_layer(trees[:h], queries[:h], 64, 4)
    _compile_picks(trees, queries, kv_heads)


def _compile_picks(trees, queries, kv_heads) -> None:
    """``index_pick``'s packing of a layer's picks (:func:`~icecache.cache.kernels.choose_layer`),
    per KV head count like the walk (its pick is the walk's own call, compiled above)."""
    from .cache.kernels import choose_layer
    from .cache.selectors.tokens import TokenPages

    S, P = trees[0].cfg.page_size, 2
    for h in kv_heads:
        picks = [TokenPages(S, P) for _ in range(h)]
        choose_layer(tuple(t.members for t in picks), tuple(t.count for t in picks), tuple(t.version for t in picks),
                     tuple(np.zeros(P * S + 1, np.int64) for _ in range(h)),
                     np.tile(np.arange(P * S, dtype=np.int32), (h, 1)), np.full(h, P * S, np.int64),
                     np.empty((h, P), np.int32), np.zeros(h, np.int64))


def compile_loads(kv_heads=KV_HEADS) -> None:
    """A decode step's page loads in one call (:func:`~icecache.cache.kernels.load_pool`),
    compiled per KV head count (its page tables come as one tuple per layer): from a 16-bit host
    store (the CPU profile's float16) for each count, from a float32 store for the embedded
    model's 3 heads (another count compiles on its first use, a few seconds)."""
    from .cache.kernels import FLOAT16, FLOAT32, load_pool

    S, P, d = 4, 3, 4
    rows = 1 + P * S + 2
    for H, bits in [(h, np.uint16) for h in kv_heads] + [(3, np.uint32)]:
        kind = FLOAT16 if bits is np.uint16 else FLOAT32
        load_pool(np.zeros((H, 1), np.int64), np.ones(H, np.int64), np.full((H, P), -1, np.int64),
                  np.zeros((H, P), np.int64), np.zeros((H, P), np.int64),
                  tuple(np.zeros(4, np.int64) for _ in range(H)),
                  tuple(np.zeros((4, S), np.int32) for _ in range(H)),
                  tuple(np.full(4, S, np.int32) for _ in range(H)), np.zeros(0, np.int64),
                  np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64),
                  np.zeros(0, np.int64), P, S, 1, np.zeros((H, rows), np.bool_),
                  np.full((H, P * S), -1, np.int64), True, np.zeros((H, 8, d), bits), np.zeros((H, 8, d), bits),
                  kind, np.zeros((H, rows, d), np.uint32), np.zeros((H, rows, d), np.uint32),
                  np.empty(P * S, np.int64), np.empty(P * S, np.int64))


def compile_cache() -> None:
    """The cache's own kernels: the page-load plan (and the whole load, :func:`compile_loads`),
    the dense decode step (and the votes' scores over 16-bit host keys), the packing of chosen
    tokens into pages and the remapped positions' offsets and key placement, the checked LM
    head's int8 product, a GGUF layer's grouped bytes and the fused decoder layer."""
    from .cache.kernels import (
        choose_tokens,
        ordered_offsets_nb,
        pinned_offsets_nb,
        place_rows,
        placed_decode,
        plan_head,
    )
    from .cache.score_kernels import dense_decode_fused, half_scores, paged_decode_fused

    S, P = 4, 2
    members = np.arange(16, dtype=np.int32).reshape(4, S)
    slots = [np.full(P, -1, np.int64), np.zeros(P, np.int64), np.zeros(P, np.int64)]
    plan_head(np.array([1, 2], np.int64), *slots, np.zeros(4, np.int64), members,
              np.full(4, S, np.int32), 0, 0, S, np.zeros(P * S, np.bool_), np.empty(8, np.int64),
              np.empty(8, np.int64), 0)
    q, k = np.zeros((2, 3, 8), np.float32), np.zeros((2, 16, 8), np.float32)
    for keys, values in ((k, k), (np.zeros((2, 16, 8), np.int16), np.zeros((2, 16, 8), np.uint16))):
        # float32, and a dense layer's decode dtypes (float16 keys, bfloat16 values)
        dense_decode_fused(q, keys, values, 16, np.float32(1), np.float32(0), q, k, 0, np.empty((2, 3, 8), np.float32))
    sink = np.zeros((2, 2, 8), np.float32)  # a remapped dense layer: its sink's rows, then its window's
    dense_decode_fused(q, k, k, 8, np.float32(1), np.float32(0), q, sink, 2, np.empty((2, 3, 8), np.float32), sink, 4)
    for place in (None, (np.zeros((2, 3), np.int64), np.ones(2, np.int64), 1, 1, np.ones((4, 8), np.float32),
                         np.zeros((4, 8), np.float32), 8)):  # true positions; remapped ones, placed as scored
        paged_decode_fused(q, k, k, np.ones((2, 16), np.bool_), np.float32(1), np.float32(0),
                           np.empty((2, 3, 8), np.float32), place)
    for brain in (False, True):  # answer_spans' votes over a float16 or bfloat16 host store
        half_scores(np.zeros((2, 3, 8), np.float32), np.zeros((2, 16, 8), np.uint16), 16, brain,
                    np.empty((2, 3, 16), np.float32))
    choose_tokens(np.full((P, S), -1, np.int32), np.zeros(P, np.int32), np.zeros(P, np.int64),
                  np.arange(5, dtype=np.int32), np.zeros(7, np.int64))
    ordered_offsets_nb(np.arange(6, dtype=np.int64).reshape(2, 3), np.ones((2, 3), np.bool_), 10, -1)
    pool_valid = np.ones((2, 5), np.bool_)[:, 1:4]  # a view of the resident rows' mask, as a step passes it
    ordered_offsets_nb(np.arange(6, dtype=np.int64).reshape(2, 3), pool_valid, 10, -1)
    args = (np.arange(6, dtype=np.int64).reshape(2, 3), pool_valid, 10, -1, 2, 0, True, np.arange(3, dtype=np.int64),
            np.zeros(3, np.int64), 1, 3, 4, 100, 0)
    pinned_offsets_nb(*args)
    # an ice layer's remapped CPU step: the same placement, then the attention
    placed_decode(q, k, k, np.ones((2, 16), np.bool_), np.float32(1), np.float32(0), np.empty((2, 3, 8), np.float32),
                  args, 1, 1, np.ones((16, 8), np.float32), np.zeros((16, 8), np.float32), 8)
    # the same with rest_estimate's rows (Gemma 3's global layers), at true positions and remapped
    groups = (np.zeros((2, 8, 4), np.float32), np.zeros((2, 4, 8), np.float32), np.zeros((2, 4), np.float32), 3,
              np.zeros((2, 8, 0), np.float32), np.zeros((2, 0, 8), np.float32), np.zeros((2, 0), np.float32), 0)
    paged_decode_fused(q, k, k, np.ones((2, 16), np.bool_), np.float32(1), np.float32(0),
                       np.empty((2, 3, 8), np.float32), None, q, groups)
    placed_decode(q, k, k, np.ones((2, 16), np.bool_), np.float32(1), np.float32(0), np.empty((2, 3, 8), np.float32),
                  args, 1, 1, np.ones((16, 8), np.float32), np.zeros((16, 8), np.float32), 8, groups,
                  (np.ones(4, np.float32), 20, 10))
    place_rows(np.zeros((2, 5, 8), np.float32), np.zeros((2, 3), np.int64), np.ones(2, np.int64), 1, 1,
               np.ones((4, 8), np.float32), np.zeros((4, 8), np.float32), 8)
    compile_loads()
    from .int8_rows import bounded_product, grouped_product  # the checked head; a GGUF's layers

    z = np.zeros(1, np.float32)
    bounded_product(np.zeros((1, 2, 64), np.int8), z, z, z, np.float32(0), np.zeros(2, np.float32), z,
                    np.empty(1, np.float32), np.empty(1, np.float32))
    grouped_product(np.zeros((1, 32, 64), np.uint8), np.zeros((1, 1, 2, 64), np.float32),
                    np.zeros(32, np.float32), np.empty(1, np.float32))
    from . import fused_step as fs  # a dense step's layers

    tiles, tables = np.zeros((1, 64, 64), np.uint8), np.zeros((1, 2, 2, 64), np.float32)
    f32 = np.float32
    layer = (np.ones((2, 64), f32), f32(1e-6), (tiles,) * 7, (tables,) * 7, (fs.NO_BIAS,) * 7,
             np.full(7, 64, np.int64), np.zeros((0, 16), f32), fs.SILU, False)
    bufs = [(np.zeros((2, 8, 16), kd), np.zeros((2, 8, 16), vd))  # float32; float16 keys, bfloat16 values
            for kd, vd in ((f32, f32), (fs.HALF_KEYS, fs.HALF_VALUES))]
    for kbuf, vbuf in bufs:
        fs.decoder_layer(np.ones(64, f32), layer, np.ones(16, f32), np.zeros(16, f32), kbuf, vbuf, 0, 1,
                         f32(0.25), f32(0.0), 4, 2, 16, np.zeros((16, 16), f32), np.zeros((2, 8, 16), f32), 0)
    keys, key_at = fs.two_lists([k for k, _ in bufs], fs.HALF_KEYS)
    values, value_at = fs.two_lists([v for _, v in bufs], fs.HALF_VALUES)
    two = np.ones(2, np.int64)
    fs.decoder_layers(np.ones(64, f32), fs._typed_list([layer, layer]), keys, values,  # one float, one 16-bit
                      np.concatenate([key_at, value_at], axis=1), two - 1, two, two - 1, np.ones((1, 16), f32),
                      np.zeros((1, 16), f32), np.full(2, 0.25, f32), np.zeros(2, f32), 4, 2, 16)


def convert_embedded() -> None:
    """The embedded GGUF converted once into the cache folder (otherwise the first run does it)."""
    from .errors import ModelError
    from .models import resolve_model_source

    def say(msg: str) -> None:
        print(f"icecache: {msg}", file=sys.stderr)

    try:
        resolve_model_source(None, say)
    except ModelError as e:  # the embedded model is not installed: a run with --model still works
        say(f"embedded model not converted ({e})")


def main() -> None:
    t0 = time.perf_counter()
    compile_cache()
    compile_index()
    print(f"icecache: numba kernels compiled and cached ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    convert_embedded()


if __name__ == "__main__":
    main()
