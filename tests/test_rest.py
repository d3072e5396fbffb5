"""``rest_estimate``: the tree pages a step does not load attend as one row each (mean key and
value, log(members) on the score). The attention against its reference, the estimate rows
against a NumPy reference built from the host store and the tree, and the effect on a tiny
model's logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from icecache.cache.paged import paged_decode_reference, paged_decode_rest, paged_decode_rest_reference
from icecache.cache.selectors import make_selector

from .test_ice_cache import full_cache, ice_cache, run_steps, spec, tiny_model


def test_rest_attention_matches_its_reference_and_one_row_groups_are_exact():
    g = torch.Generator().manual_seed(3)
    H, G, L, P, d = 2, 3, 20, 7, 8
    q, k, v = (torch.randn(H, G, d, generator=g), torch.randn(H, L, d, generator=g),
               torch.randn(H, L, d, generator=g))
    valid = torch.rand(H, L, generator=g) > 0.3
    valid[:, 0] = True
    rk, rv = torch.randn(H, P, d, generator=g), torch.randn(H, P, d, generator=g)
    bias = torch.rand(H, P, generator=g) * 3
    bias[1, 2] = float("-inf")  # a page with nothing left
    rkt = rk.transpose(1, 2)  # a group's keys come transposed (H, d, P)
    groups = [(rkt, rv, bias), ((rk[:, :3] * 2).transpose(1, 2), rv[:, :3], torch.zeros(H, 3))]
    torch.testing.assert_close(paged_decode_rest(q, k, v, valid, groups, 0.4),
                               paged_decode_rest_reference(q, k, v, valid, groups, 0.4))
    # groups of one row, weight 1 (log 1 = 0): attention over the resident rows and those rows
    got = paged_decode_rest(q, k, v, valid, [(rkt, rv, torch.zeros(H, P))], 0.4)
    every = paged_decode_reference(q, torch.cat([k, rk], 1), torch.cat([v, rv], 1),
                                   torch.cat([valid, torch.ones(H, P, dtype=torch.bool)], 1), 0.4)
    torch.testing.assert_close(got, every)
    # a group of n equal rows counts n times: one row with log(n) added is the same attention
    twice = paged_decode_reference(q, torch.cat([k, rk, rk], 1), torch.cat([v, rv, rv], 1),
                                   torch.cat([valid, torch.ones(H, 2 * P, dtype=torch.bool)], 1), 0.4)
    torch.testing.assert_close(paged_decode_rest(q, k, v, valid, [(rkt, rv, torch.full((H, P), np.log(2.0)))], 0.4),
                               twice)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_rest_rows_at_one_remapped_distance_score_as_keys_the_model_turned_there(cap):
    """With remapped positions the estimate rows' mean keys are un-rotated and every one sits
    at one position: scoring them with the query turned to that distance (``rest_q``) is the
    reference attention over those keys rotated there by the model's own RoPE, the query at its
    true position."""
    from icecache.cache.positions import RopeFrame

    from .test_positions import ROPES, llama, model_rope

    model = llama(ROPES["default"])
    frame = RopeFrame.from_model(model)
    g = torch.Generator().manual_seed(5)
    H, G, L, P, d, pos, at = 2, 2, 12, 9, 32, 3000, 2300
    q = model_rope(model, torch.randn(H * G, 1, d, generator=g), torch.tensor([pos]))[:, 0].reshape(H, G, d)
    k, v = torch.randn(H, L, d, generator=g), torch.randn(H, L, d, generator=g)
    valid = torch.rand(H, L, generator=g) > 0.3
    valid[:, 0] = True
    raw, rv = torch.randn(H, P, d, generator=g), torch.randn(H, P, d, generator=g)
    bias = torch.rand(H, P, generator=g) * 3
    turned = model_rope(model, raw, torch.full((P,), at))
    rest_q = frame.rotate(q.reshape(-1, d), pos, pos - at).view(q.shape)
    got = paged_decode_rest(q, k, v, valid, [(raw.transpose(1, 2), rv, bias)], 0.3, cap, rest_q)
    want = paged_decode_rest_reference(q, k, v, valid, [(turned.transpose(1, 2), rv, bias)], 0.3, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the rows' distance matters: unturned, the query scores them differently
    assert (paged_decode_rest(q, k, v, valid, [(raw.transpose(1, 2), rv, bias)], 0.3, cap) - want).abs().max() > 1e-3


@pytest.mark.parametrize("cap", [None, 3.0])
def test_rest_rows_in_the_cpu_kernel_equal_the_reference(cap):
    """The CPU kernel's estimate rows (paged_decode_fused with groups: blocks of the same
    softmax) give the reference attention: one group handed as whole tables of which the first
    pages count, and two groups; -inf biases left out, a query of their own for the rows, a
    capped score, more rows than one block holds."""
    from icecache.cache.rest import RestPages, kernel_groups
    from icecache.cache.score_kernels import DECODE_ROWS, paged_decode_fused

    g = torch.Generator().manual_seed(7)
    H, G, L, d, cap_pages = 2, 4, 40, 16, 3 * DECODE_ROWS
    q, rest_q = torch.randn(H, G, d, generator=g), torch.randn(H, G, d, generator=g)
    k, v = torch.randn(H, L, d, generator=g), torch.randn(H, L, d, generator=g)
    valid = torch.rand(H, L, generator=g) > 0.3
    valid[:, 0] = True
    rest = RestPages(H, d, "cpu")
    rest._grow(cap_pages)
    rest.keys_t.copy_(torch.randn(H, d, rest.keys_t.shape[2], generator=g))
    rest.values.copy_(torch.randn(H, rest.values.shape[1], d, generator=g))
    for n in (2 * DECODE_ROWS + 37, 5):
        bias = torch.rand(H, n + 1, generator=g) * 3
        bias[0, 3] = bias[1, :n // 2] = float("-inf")  # pages loaded whole: no row
        whole = [(rest.keys_t[:, :, :n], rest.values[:, :n], bias[:, :n])]
        small = (torch.randn(H, d, 6, generator=g), torch.randn(H, 6, d, generator=g), torch.rand(H, 6, generator=g))
        for groups in (whole, whole + [small]):
            arrays = kernel_groups(rest, groups)
            assert arrays[0].shape[2] > n and arrays[3] == n  # the whole table, not a copy of its pages
            out = np.full((H, G, d), 9.0, np.float32)
            paged_decode_fused(q.numpy(), k.numpy(), v.numpy(), valid.numpy(), np.float32(0.3),
                               np.float32(cap or 0.0), out, None, rest_q.numpy(), arrays)
            want = paged_decode_rest(q, k, v, valid, groups, 0.3, cap, rest_q)
            torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-4, atol=1e-5)
    # without groups it is the plain kernel
    out = np.empty((H, G, d), np.float32)
    paged_decode_fused(q.numpy(), k.numpy(), v.numpy(), valid.numpy(), np.float32(0.3), np.float32(0.0), out)
    torch.testing.assert_close(torch.from_numpy(out), paged_decode_reference(q, k, v, valid, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions,spans", [("true", 0), ("remap", 0), ("remap", 2)])
def test_a_gemma_shaped_rest_step_in_one_cpu_call_equals_its_torch_path(positions, spans, monkeypatch):
    """Gemma 3's shape (window layers, a global layer with one KV head) with estimate rows that
    count (a budget of a few pages): its global layer's steps in one numba call (the placement
    under remapped positions, the estimate rows, the attention) give the logits of the torch path
    (the placed copy of the keys, the turned query, paged_decode_rest), step by step, with the
    answer passages pinned (two groups of rows) and without."""
    from icecache.cache.ice_step import DecodeStep
    from icecache.methods import make_cache

    from .lab import lab_settings
    from .test_ice_cache import tiny_model

    model = tiny_model("gemma3", 1)
    rng = np.random.default_rng(8)
    prompt, forced = rng.integers(0, 97, 300).tolist(), rng.integers(0, 97, 12).tolist()
    s = lab_settings(page_size=4, budget=16, sink_pages=2, window_pages=6, dense_layers=1, chunk_size=64,
                     prefill_budget=64, prefill_queries=4, dense_window=4096, max_context=8192, prefill="sparse",
                     host_dtype="float32", positions=positions, answer_spans=spans, rest_estimate=True)
    out = {}
    for route in ("numba", "torch"):
        if route == "torch":
            monkeypatch.setattr(DecodeStep, "_cpu_rows", lambda self, q, _rows, pages_at, scale, softcap:
                                self._attend_tensors(q, scale, softcap, pages_at))
        cache = make_cache("ice", model, s)
        logits = []
        with torch.inference_mode():
            cache.begin_prefill(len(prompt))
            for lo in range(0, len(prompt), 64):
                model(input_ids=torch.tensor([prompt[lo : lo + 64]]), past_key_values=cache, use_cache=True)
            for t in forced:
                logits.append(model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1])
        layers = cache.ice_layers()
        assert layers and all(layer.kernel == "rest" for layer in layers)
        assert all(layer.rest is not None and layer.rest.npages > 8 for layer in layers)  # rows that count
        assert (cache.remap is not None) == (positions == "remap")
        out[route] = torch.stack(logits)
    torch.testing.assert_close(out["numba"], out["torch"], rtol=1e-4, atol=1e-4)


def rest_spec(budget: int, on: bool = True, **changes):
    return dataclasses.replace(spec(budget_pages=budget, rest_estimate=on), **changes)


def padded(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    return torch.cat([t, torch.full((rows - len(t), *t.shape[1:]), fill)])


@pytest.mark.parametrize("spans", [0, 2])
def test_rest_rows_equal_a_numpy_reference_after_evictions(spans):
    """After a prefill and 40 steps (pages left the window, tree pages changed versions), each
    layer's estimate rows stand for every tree page's non-resident members, each counted once:
    attention over them equals attention over the resident rows and NumPy's page means. The
    pool holds whole tree pages (loaded pages masked) or whole pages and pinned answer passages
    (spans 2: the passages' pages less their rows, kept from step to step; also against the
    general path)."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(4)
    prompt, forced = rng.integers(0, 97, 150).tolist(), rng.integers(0, 97, 40).tolist()
    cache = ice_cache(model, rest_spec(budget=2, answer_spans=spans))
    run_steps(model, cache, prompt, forced)
    g = torch.Generator().manual_seed(5)
    pages_checked = 0
    for layer in cache.ice_layers():
        groups = layer.rest_rows()
        assert (layer.passages is not None and layer.passages.pinned is not None) == bool(spans)
        if spans:
            assert layer.rest._pinned is not None  # rest_pinned ran, not the general path
            general = layer.rest_rows(general=True)
        r, store = layer.resident, layer.store
        n, d = store.rows, layer.head_dim
        K, V = store.keys[:, :n].float().numpy(), store.values[:, :n].float().numpy()
        k, v, valid = r.tensors()
        ref_k, ref_v, ref_b = [], [], []
        for h in range(layer.heads):
            members, count, _version, npages, row_page = layer.selector.tree_pages(h)
            in_pool = r.valid[h, r.pool_at : r.window_at]
            resident = set(r.pool_row[h][in_pool].tolist())
            assert resident, "the pool holds rows"
            rows_k, rows_v, rows_b = [], [], []
            for p in range(npages):
                assert all(row_page[x] == p for x in members[p, : count[p]])
                rows = [int(x) for x in members[p, : count[p]] if int(x) not in resident]
                if rows:
                    rows_k.append(K[h, rows].mean(0))
                    rows_v.append(V[h, rows].mean(0))
                    rows_b.append(np.log(len(rows)))
            # every offloaded row is counted once: resident, or in a page's estimate
            left = sum(float(gb[h][torch.isfinite(gb[h])].exp().sum()) for _k, _v, gb in groups)
            assert round(left) + len(resident) == n == round(float(np.exp(rows_b).sum())) + len(resident)
            pages_checked += len(rows_b)
            ref_k.append(torch.tensor(np.array(rows_k)))
            ref_v.append(torch.tensor(np.array(rows_v)))
            ref_b.append(torch.tensor(rows_b, dtype=torch.float32))
        # pad the heads' reference rows to one length (-inf: no row)
        P = max(len(b) for b in ref_b)
        reference = [(torch.stack([padded(x, P, 0.0) for x in ref_k]).transpose(1, 2),
                      torch.stack([padded(x, P, 0.0) for x in ref_v]),
                      torch.stack([padded(x, P, float("-inf")) for x in ref_b]))]
        q = torch.randn(layer.heads, 2, d, generator=g)
        torch.testing.assert_close(paged_decode_rest(q, k, v, torch.as_tensor(valid), groups, 0.3),
                                   paged_decode_rest_reference(q, k, v, torch.as_tensor(valid), reference, 0.3),
                                   rtol=1e-4, atol=1e-5)
        if spans:
            torch.testing.assert_close(paged_decode_rest(q, k, v, torch.as_tensor(valid), groups, 0.3),
                                       paged_decode_rest(q, k, v, torch.as_tensor(valid), general, 0.3),
                                       rtol=1e-4, atol=1e-5)
    assert pages_checked > 20


def test_rest_estimate_brings_a_small_budget_near_full_and_is_off_by_default():
    """Two pages of budget: the logits move far from full's; with the estimate rows they stay
    near them (a tiny random model's keys are not peaked, so page means stand in well)."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(1)
    prompt, forced = rng.integers(0, 97, 150).tolist(), rng.integers(0, 97, 40).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    errors = {}
    for on in (False, True):
        got = run_steps(model, ice_cache(model, rest_spec(budget=2, on=on)), prompt, forced)
        errors[on] = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
    assert errors[True] < 1e-2 < errors[False] and errors[True] < errors[False] / 10
    assert make_selector(spec(budget_pages=2)).rest_estimate is False


def test_rest_estimate_is_a_profile_key_of_the_tree_selector(cpu_settings):
    """On by default (the shipped value), off through the profile key, and only for the
    selector with a tree (not streaming's, nor quest's)."""
    from icecache.config import ProfileError, apply
    from icecache.methods import METHODS, ice_spec

    assert cpu_settings.tuned("rest_estimate") is True
    off = apply(cpu_settings, {"rest_estimate": False}, "test")

    def rests(settings, method):
        return make_selector(ice_spec(settings, METHODS[method])).rest_estimate

    assert rests(cpu_settings, "ice") is True
    assert rests(cpu_settings, "streaming") is False and rests(cpu_settings, "quest") is False
    assert rests(off, "ice") is False
    with pytest.raises(ProfileError, match="rest_estimate"):
        apply(cpu_settings, {"rest_estimate": 2}, "test")
