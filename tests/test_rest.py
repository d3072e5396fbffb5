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
    torch.testing.assert_close(paged_decode_rest(q, k, v, valid, rk, rv, bias, 0.4),
                               paged_decode_rest_reference(q, k, v, valid, rk, rv, bias, 0.4))
    # groups of one row, weight 1 (log 1 = 0): attention over the resident rows and those rows
    got = paged_decode_rest(q, k, v, valid, rk, rv, torch.zeros(H, P), 0.4)
    every = paged_decode_reference(q, torch.cat([k, rk], 1), torch.cat([v, rv], 1),
                                   torch.cat([valid, torch.ones(H, P, dtype=torch.bool)], 1), 0.4)
    torch.testing.assert_close(got, every)
    # a group of n equal rows counts n times: one row with log(n) added is the same attention
    twice = paged_decode_reference(q, torch.cat([k, rk, rk], 1), torch.cat([v, rv, rv], 1),
                                   torch.cat([valid, torch.ones(H, 2 * P, dtype=torch.bool)], 1), 0.4)
    torch.testing.assert_close(paged_decode_rest(q, k, v, valid, rk, rv, torch.full((H, P), np.log(2.0)), 0.4),
                               twice)


def rest_spec(budget: int, on: bool = True):
    return dataclasses.replace(spec(budget_pages=budget), rest_estimate=on)


def test_rest_rows_equal_a_numpy_reference_after_evictions():
    """After a prefill and 40 steps (pages left the window, tree pages changed versions), each
    layer's estimate rows are the means of every tree page's non-resident members."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(4)
    prompt, forced = rng.integers(0, 97, 150).tolist(), rng.integers(0, 97, 40).tolist()
    cache = ice_cache(model, rest_spec(budget=2))
    run_steps(model, cache, prompt, forced)
    checked = 0
    for layer in cache.ice_layers():
        got_k, got_v, got_b = layer.rest_rows()
        r, store = layer.resident, layer.store
        n = store.rows
        K, V = store.keys[:, :n].float().numpy(), store.values[:, :n].float().numpy()
        for h in range(layer.heads):
            members, count, _version, npages, row_page = layer.selector.tree_pages(h)
            in_pool = r.valid[h, r.pool_at : r.window_at]
            resident = set(r.pool_row[h][in_pool].tolist())
            assert resident, "the pool holds rows"
            for p in range(npages):
                rows = [int(x) for x in members[p, : count[p]] if int(x) not in resident]
                assert all(row_page[x] == p for x in members[p, : count[p]])
                if not rows:
                    assert got_b[h, p] == float("-inf")
                    continue
                np.testing.assert_allclose(got_k[h, p].numpy(), K[h, rows].mean(0), rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(got_v[h, p].numpy(), V[h, rows].mean(0), rtol=1e-4, atol=1e-5)
                assert float(got_b[h, p]) == pytest.approx(np.log(len(rows)))
                checked += 1
            assert np.isneginf(got_b[h, npages:].numpy()).all()  # padding past this head's pages
            # every offloaded row is counted once: resident, or in a page's estimate
            b = got_b[h].numpy()
            assert round(float(np.exp(b[np.isfinite(b)]).sum())) + len(resident) == n
    assert checked > 20


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
    assert spec(budget_pages=2).rest_estimate is False


def test_rest_estimate_is_a_profile_key_for_budgeted_methods(cpu_settings):
    from icecache.config import ProfileError, apply
    from icecache.methods import METHODS, ice_spec

    on = apply(cpu_settings, {"rest_estimate": True}, "test")
    assert ice_spec(on, METHODS["ice"]).rest_estimate is True
    assert ice_spec(on, METHODS["streaming"]).rest_estimate is False
    assert ice_spec(cpu_settings, METHODS["ice"]).rest_estimate is False
    with pytest.raises(ProfileError, match="rest_estimate"):
        apply(cpu_settings, {"rest_estimate": 2}, "test")
