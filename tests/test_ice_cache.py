"""The IceCache manager inside transformers: exactness against the dense cache, pool accounting,
the attention kernels against their reference, architectures, and a passkey check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from icecache.cache import IceCache, IceSpec, paged_decode_reference
from icecache.cache.paged import paged_decode_sdpa
from icecache.cache.selectors.dci import DCISettings
from icecache.cache.window import WindowLayer, window_sizes
from icecache.index import IndexConfig
from icecache.methods import make_cache, prepare_model


def tiny_model(arch: str, kv_heads: int = 2):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=16),
        # Gemma 3's pattern: window layers (a window shorter than the prompt) and a global layer,
        # head_dim 32 with one KV head, its own RoPE base per layer kind
        "gemma3": lambda: tf.Gemma3TextConfig(**{**common, "num_key_value_heads": 1}, head_dim=32, sliding_window=24,
                                              layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        # Phi 3: one fused qkv projection and one fused gate/up projection
        "phi3": lambda: tf.Phi3Config(**common, pad_token_id=0, eos_token_id=1, bos_token_id=1),
        # Gemma 2: window and global layers alternating, attention scores capped (softcapping)
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=16, sliding_window=24),
    }[arch]()
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
           "phi3": tf.Phi3ForCausalLM, "gemma2": tf.Gemma2ForCausalLM}[arch]
    model = cls(cfg).eval()
    return model


# The tests' DCI search: the authors' beam rule, without the shipped extras (carried pages, the
# rest estimate, a wider prefill beam), which their own tests switch on.
LAB_DCI = DCISettings(index_beam=48, index_beam_frac=0.001, index_pages="projection", carry_pages=0,
                      rest_estimate=False, prefill_beam=0)


def spec(budget_pages: int, sink: int = 8, window: int = 8, page: int = 4, selector: str = "dci",
         pages: str = "projection", **tuning) -> IceSpec:
    """A small cache's layout; ``tuning``: DCISettings fields changed from LAB_DCI."""
    tuned = dataclasses.replace(LAB_DCI, index_pages=pages, **tuning) if selector == "dci" else None
    return IceSpec(page_size=page, budget_pages=budget_pages, sink_tokens=sink,
                   window_tokens=window, selector=selector, tuning=tuned)


def run_steps(model, cache, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Prefill ``prompt`` in two chunks, then feed ``forced`` one token at a time; logits per step."""
    out = []
    with torch.inference_mode():
        half = len(prompt) // 2
        model(input_ids=torch.tensor([prompt[:half]]), past_key_values=cache, use_cache=True)
        r = model(input_ids=torch.tensor([prompt[half:]]), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        out.append(r.logits[0, -1])
        for t in forced:
            r = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1])
    return out


def test_pool_and_host_store_invariants_hold_at_every_step():
    """After every decode step of every sparse layer: the pool holds exactly the selected pages,
    each once and at its current version (:meth:`ResidentKV.check`); the host store holds every
    offloaded token once, in order (sink + store + window = the tokens seen)."""
    from icecache.cache.ice_layer import IceLayer

    model = tiny_model("llama", 2)
    rng = np.random.default_rng(8)
    prompt, forced = rng.integers(0, 97, 160).tolist(), rng.integers(0, 97, 40).tolist()
    cache = ice_cache(model, spec(budget_pages=3))
    steps = 0
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        for t in forced:
            model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                if isinstance(layer, IceLayer) and layer.offloaded:
                    layer.wait()
                    layer.resident.check(layer.selected, layer.selector.page_table)
                    r = layer.resident
                    assert r.sink_fill + layer.store.rows + r.window_fill == layer.length
                    steps += 1
    sparse = [layer for layer in cache.layers if isinstance(layer, IceLayer)]
    assert sparse and steps == len(forced) * len(sparse)  # every sparse layer, every step
    broken = sparse[0]
    broken.resident.slot_fill[0, 0] += 1
    with pytest.raises(AssertionError):
        broken.resident.check(broken.selected, broken.selector.page_table)


def ice_cache(model, s: IceSpec, dense: int = 1, reuse: int = 1) -> IceCache:
    prepare_model("ice", model)
    n = model.config.num_hidden_layers
    return IceCache(n, s, dense_layers=dense, reuse_every=reuse, windows=window_sizes(model.config, n))


def full_cache(model):
    from transformers import DynamicCache

    prepare_model("full", model)
    return DynamicCache(config=model.config)


@pytest.mark.parametrize("arch,kv_heads,pages", [("llama", 2, "projection"), ("llama", 4, "projection"),
                                                 ("mistral", 2, "projection"), ("qwen2", 1, "projection"),
                                                 ("qwen3", 2, "projection"), ("llama", 2, "similar"),
                                                 ("gemma3", 1, "projection"), ("phi3", 2, "projection"),
                                                 ("gemma2", 2, "projection")])
def test_budget_covering_everything_equals_full(arch, kv_heads, pages):
    """With room for every page, ice decodes exactly like the dense cache, through evictions
    (Gemma 2 with its scores capped: tests/test_architectures.py has a cap that bites)."""
    model = tiny_model(arch, kv_heads)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 40).tolist()  # 40 steps: the window (8 + 4) evicts pages
    ref = run_steps(model, full_cache(model), prompt, forced)
    cache = ice_cache(model, spec(budget_pages=256, pages=pages))
    got = run_steps(model, cache, prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    layer = cache.ice_layers()[0]
    assert layer.length == 190 and layer.resident.sink_fill + layer.store.rows + layer.resident.window_fill == 190
    assert layer.store.rows > 150 - 8 - 8  # pages left the window for the host store and the index
    assert cache.stats.steps == 40 and cache.stats.pages_loaded > 0
    windows = [x for x in cache.layers if isinstance(x, WindowLayer)]
    assert len(windows) == {"gemma3": 3, "gemma2": 2}.get(arch, 0)  # a model's window layers hold their window only
    assert all(x.keys.shape[2] <= x.sliding_window and x.in_order()[0].shape[2] < x.sliding_window for x in windows)


def test_float16_host_store_halves_host_bytes_and_stays_close():
    """Offloaded keys and values kept in float16: half the host bytes, logits near full's (and
    not bit-equal: the rounding is real)."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 24).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    wide = ice_cache(model, spec(budget_pages=256))
    run_steps(model, wide, prompt, forced)
    half_spec = IceSpec(**{**spec(budget_pages=256).__dict__, "host_dtype": "float16"})
    half = ice_cache(model, half_spec)
    got = run_steps(model, half, prompt, forced)
    layer = half.ice_layers()[0]
    assert layer.store.keys.dtype == torch.float16 and layer.resident.keys.dtype == torch.float32
    assert 2 * half.host_kv_bytes() == wide.host_kv_bytes() > 0
    err = max(float((b - a).abs().max()) for a, b in zip(ref, got, strict=True))
    assert 0 < err < 2e-2


def test_auto_host_dtype_follows_the_model_dtype(cpu_settings):
    from icecache.methods import host_dtype

    assert host_dtype(cpu_settings.replace(host_dtype="auto")) == "float16"
    assert host_dtype(cpu_settings.replace(host_dtype="auto", dtype="bfloat16")) is None
    assert host_dtype(cpu_settings.replace(host_dtype="float32")) is None
    assert host_dtype(cpu_settings.replace(host_dtype="bfloat16")) == "bfloat16"


def test_quest_selector_with_full_budget_equals_full():
    model = tiny_model("qwen2", 2)
    rng = np.random.default_rng(6)
    prompt, forced = rng.integers(0, 97, 130).tolist(), rng.integers(0, 97, 30).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    got = run_steps(model, ice_cache(model, spec(budget_pages=256, selector="quest")), prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_quest_index_matches_bound_reference():
    from icecache.bench.index_bench import quest_pages
    from icecache.cache.selectors import QuestIndex

    rng = np.random.default_rng(8)
    keys = rng.standard_normal((203, 8)).astype(np.float32)
    idx = QuestIndex(8, 16, capacity=16)
    idx.insert(keys[:100])
    dirty = idx.insert(keys[100:])  # the partial page 6 is completed, pages 7..12 are new
    assert dirty.tolist() == list(range(6, 13)) and idx.npages == 13 and idx.count[12] == 203 - 192
    for p in range(idx.npages):
        assert idx.members[p, : idx.count[p]].tolist() == list(range(16 * p, min(16 * p + 16, 203)))
    qs = rng.standard_normal((3, 8)).astype(np.float32)
    got = idx.select_group(qs[:1], 64, 5)
    assert got.tolist() == quest_pages(keys, qs[0], 16, 5).tolist()


def test_snapkv_selector_keeps_prompt_tokens_fixed():
    """With a budget over the whole prompt SnapKV equals full until generated tokens age out of
    the window (it never selects them); its selection never changes between steps."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(9)
    prompt, forced = rng.integers(0, 97, 120).tolist(), rng.integers(0, 97, 4).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    cache = ice_cache(model, spec(budget_pages=64, selector="snapkv"))
    got = run_steps(model, cache, prompt, forced)
    for a, b in zip(ref, got, strict=True):  # 4 steps: nothing left the window yet
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    small = ice_cache(model, spec(budget_pages=3, selector="snapkv"))
    run_steps(model, small, prompt, forced)
    layer = small.ice_layers()[0]
    before = [s.copy() for s in layer.selected]
    run_steps_more = rng.integers(0, 97, 10).tolist()
    with torch.inference_mode():
        for t in run_steps_more:
            model(input_ids=torch.tensor([[t]]), past_key_values=small, use_cache=True)
    assert all((a == b).all() for a, b in zip(before, layer.selected, strict=True))
    tree = layer.selector.indexes[0]
    assert tree.npages == 3 and tree.count.sum() == 12  # 3 pages x 4 tokens chosen by the votes


def test_reuse_variant_with_full_budget_equals_full():
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(2)
    prompt, forced = rng.integers(0, 97, 120).tolist(), rng.integers(0, 97, 30).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    cache = ice_cache(model, spec(budget_pages=256), dense=1, reuse=2)
    got = run_steps(model, cache, prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    layers = cache.ice_layers()
    assert layers[0].anchor is None and layers[1].anchor is layers[0] and layers[2].anchor is None
    assert layers[1].selector is None and layers[0].selector.indexes


def test_small_budget_pool_accounting():
    """Small pool: resident slots hold exactly their pages' host rows; sizes stay fixed."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(3)
    cache = ice_cache(model, spec(budget_pages=3))
    prompt = rng.integers(0, 97, 300).tolist()
    run_steps(model, cache, prompt, rng.integers(0, 97, 5).tolist())
    layer = cache.ice_layers()[1]
    size_before = layer.device_bytes()
    run_steps_more = rng.integers(0, 97, 30).tolist()
    with torch.inference_mode():
        for t in run_steps_more:
            model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    assert layer.device_bytes() == size_before  # the pool does not grow with the context
    S, P = 4, 3
    r, store = layer.resident, layer.store
    assert layer.length == 335 and r.sink_fill + store.rows + r.window_fill == 335
    for h in range(layer.heads):
        tree = layer.selector.indexes[h]
        want = set(layer.selected[h].tolist())
        assert 0 < len(want) <= P
        pool_valid = r.valid[h, r.pool_at : r.window_at].reshape(P, S)
        for s in range(P):
            page = int(r.slot_page[h, s])
            if page not in want:
                assert not pool_valid[s].any()
                continue
            members = tree.members[page, : tree.count[page]]
            assert pool_valid[s].sum() == len(members)
            rows = r.keys[h, r.pool_at + s * S : r.pool_at + s * S + len(members)]
            torch.testing.assert_close(rows, store.keys[h, members])
        assert {int(p) for p in r.slot_page[h] if p >= 0} >= want
    # Everything the model saw is somewhere: sink + host store + window.
    assert cache.host_kv_bytes() > 0 and cache.device_kv_bytes() > 0


def test_paged_decode_sdpa_matches_reference():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 3, 16), torch.randn(3, 40, 16), torch.randn(3, 40, 16)
    valid = torch.rand(3, 40) > 0.4
    valid[:, 0] = True
    torch.testing.assert_close(paged_decode_sdpa(q, k, v, valid, 0.25),
                               paged_decode_reference(q, k, v, valid, 0.25), atol=1e-5, rtol=1e-5)
    # masked rows really are ignored
    k2 = k.clone()
    k2[~valid] = 1e4
    torch.testing.assert_close(paged_decode_sdpa(q, k2, v, valid, 0.25),
                               paged_decode_sdpa(q, k, v, valid, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_paged_decode_kernel_matches_the_reference(G, cap):
    """The numba decode over resident rows (the CPU's float32 path of paged_decode_sdpa) against
    the plain reference: rows over several of its blocks, a whole block masked out, a head with
    a single valid row, capped scores; SDPA (torch's) agrees too where nothing is capped."""
    from icecache.cache.score_kernels import DECODE_ROWS, paged_decode_fused

    g = torch.Generator().manual_seed(G)
    L = 2 * DECODE_ROWS + 100
    q, k, v = (torch.randn(3, G, 64, generator=g) * 2, torch.randn(3, L, 64, generator=g) * 2,
               torch.randn(3, L, 64, generator=g))
    valid = torch.rand(3, L, generator=g) > 0.3
    valid[0, :DECODE_ROWS] = False  # a block with no row
    valid[1] = False
    valid[1, L - 1] = True  # one row only
    want = paged_decode_reference(q, k, v, valid, 0.125, cap or None)
    out = torch.empty(3, G, 64)
    paged_decode_fused(q.numpy(), k.numpy(), v.numpy(), valid.numpy(), np.float32(0.125), np.float32(cap), out.numpy())
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], v[1, L - 1].expand(G, 64))
    # rows the mask leaves out are never read into the sums (an empty slot may hold anything)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[~valid], v_nan[~valid] = float("nan"), float("nan")
    again = torch.empty(3, G, 64)
    paged_decode_fused(q.numpy(), k_nan.numpy(), v_nan.numpy(), valid.numpy(), np.float32(0.125), np.float32(cap),
                       again.numpy())
    torch.testing.assert_close(again, out)
    torch.testing.assert_close(paged_decode_sdpa(q, k, v, valid, 0.125, cap or None), out)
    if not cap:
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[:, None], k[:, None], v[:, None], attn_mask=valid[:, None, None, :], scale=0.125)[:, 0]
        torch.testing.assert_close(sdpa, out, atol=2e-5, rtol=1e-4)


def test_make_cache_for_methods(cpu_settings, loaded):
    cache = make_cache("ice", loaded.model, cpu_settings)
    assert isinstance(cache, IceCache) and len(cache.ice_layers()) == 28
    assert loaded.model.config._attn_implementation == "icecache"
    reuse = make_cache("ice-reuse", loaded.model, cpu_settings)
    assert sum(layer.anchor is None for layer in reuse.ice_layers()) == 10  # layers 2, 5, ..., 29
    make_cache("full", loaded.model, cpu_settings)
    assert loaded.model.config._attn_implementation == "sdpa"


@pytest.mark.slow  # (51 s; tests/test_prompt_suite.py asks ice and full for standard passkeys in the default suite)
def test_passkey_ice_answers_what_full_answers(cpu_settings, loaded):
    """The embedded model at ~1k tokens, budget 64; streaming (sink + window) shows it can fail."""
    from icecache.evals import passkey
    from icecache.generation import Session

    tok = loaded.tokenizer
    results = {}
    for method, settings in [("full", cpu_settings), ("ice", cpu_settings.replace(budget=64)),
                             ("streaming", cpu_settings)]:
        for case in passkey.cases(tok, 1000, 3, seed=4):  # depths 0, 0.5, 1
            out, _ = Session(loaded, settings, method).generate(tok(case.prompt)["input_ids"], 7)
            results.setdefault((method, settings.budget), []).append(passkey.score(tok.decode(out), case.answer))
    assert results[("full", 256)] == [1.0, 1.0, 1.0]
    assert results[("ice", 64)] == results[("full", 256)]
    assert results[("streaming", 256)][1] == 0.0  # sink and window only: the middle needle is lost


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_matches_cpu():
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(5)
    prompt, forced = rng.integers(0, 97, 200).tolist(), rng.integers(0, 97, 30).tolist()
    cpu = run_steps(model, ice_cache(model, spec(budget_pages=6)), prompt, forced)
    model = model.cuda()
    prepare_model("ice", model)
    cache = IceCache(4, spec(budget_pages=6), dense_layers=1, device="cuda")
    with torch.inference_mode():
        half = len(prompt) // 2
        model(input_ids=torch.tensor([prompt[:half]], device="cuda"), past_key_values=cache)
        r = model(input_ids=torch.tensor([prompt[half:]], device="cuda"), past_key_values=cache)
        gpu = [r.logits[0, -1].cpu()]
        for t in forced:
            r = model(input_ids=torch.tensor([[t]], device="cuda"), past_key_values=cache)
            gpu.append(r.logits[0, -1].cpu())
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)


def test_plan_head_matches_reference():
    from icecache.cache.kernels import plan_head, plan_head_reference

    rng = np.random.default_rng(7)
    S, P = 4, 5
    members = rng.integers(0, 500, (30, S)).astype(np.int32)
    count = rng.integers(1, S + 1, 30).astype(np.int32)
    for _ in range(200):
        version = rng.integers(0, 3, 30).astype(np.int64)
        slot_page = rng.choice(np.r_[-1, np.arange(30)], P).astype(np.int64)
        slot_version = rng.integers(0, 3, P).astype(np.int64)
        slot_fill = rng.integers(0, S + 1, P).astype(np.int64)
        want = rng.choice(30, rng.integers(0, P + 1), replace=False).astype(np.int64)
        a = [slot_page.copy(), slot_version.copy(), slot_fill.copy()]
        b = [slot_page.copy(), slot_version.copy(), slot_fill.copy()]
        src, dst = np.empty(P * S, np.int64), np.empty(P * S, np.int64)
        valid = np.zeros(P * S, np.bool_)
        m, loaded = plan_head(want, *a, version, members, count, 1000, 50, S, valid, src, dst, 0)
        rs, rd, rv, rl = plan_head_reference(want, *b, version, members, count, 1000, 50, S)
        assert loaded == rl and (src[:m] == rs).all() and (dst[:m] == rd).all() and (valid == rv).all()
        for x, y in zip(a, b, strict=True):
            assert (x == y).all()
        # every wanted page is resident afterwards, at its current version
        for p in want:
            assert any(a[0][s] == p and a[1][s] == version[p] for s in range(P))


def test_stable_order_is_numpys_stable_argsort():
    """The pool's placement sorts its slots' host rows by :func:`stable_order` (a radix sort):
    NumPy's stable argsort on empty slots (-1) among rows, ties, keys of one to three 8-bit
    digits and more, and no keys at all."""
    from icecache.cache.kernels import stable_order

    rng = np.random.default_rng(4)
    for n, top in [(0, 1), (1, 1), (7, 3), (400, 255), (400, 256), (400, 16384), (333, 2**17), (50, 2**40)]:
        key = rng.integers(-1, top, n).astype(np.int64)
        key[rng.random(n) < 0.2] = -1
        order, spare = np.empty(n, np.int64), np.empty(n, np.int64)
        stable_order(key, order, spare)
        np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_load_widens_every_16_bit_pattern_as_numpy_does(dtype):
    """:func:`load_pool`'s widening of a 16-bit host store (integer operations, vectorized)
    gives NumPy's float32 for every one of the 65536 patterns (subnormals, signed zeros,
    infinities and NaN payloads among them); float32 elements are copied bit for bit."""
    from icecache.cache.kernels import BFLOAT16, FLOAT16, FLOAT32, widen_bits, widening_table

    patterns = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = widen_bits(patterns, FLOAT16 if dtype == "float16" else BFLOAT16)
    np.testing.assert_array_equal(got, widening_table(dtype))
    words = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint32)
    np.testing.assert_array_equal(widen_bits(words, FLOAT32), words)


@pytest.mark.parametrize("store_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pinned_slots", [0, 3])
def test_one_call_load_equals_the_general_path(store_dtype, pinned_slots):
    """``ResidentKV.load`` by :func:`load_pool` (one numba call) against its general path
    (per-head plans, torch's gather and scatter): the same slots, validity, host rows and pool
    contents over a run of steps whose pages change, move versions and overlap pinned rows;
    float16 stores with subnormal, infinite and NaN values widen exactly as torch's ``to``."""
    from icecache.cache.backend import TorchBackend
    from icecache.cache.host_store import HostStore
    from icecache.cache.resident import ResidentKV

    rng = np.random.default_rng(3)
    H, d, S, P, npages, rows = 3, 8, 4, 9, 40, 150
    backend = TorchBackend("cpu")
    store = HostStore(backend, H, d, store_dtype, rows + 10)
    keys = torch.from_numpy(rng.normal(size=(H, rows, d)).astype(np.float32))
    if store_dtype == torch.float16:  # the extremes of float16: subnormals, infinities, NaN, -0
        keys[0, :4, :4] = torch.tensor([3e-7, -6e-8, float("inf"), float("nan")])
        keys[1, 0, :2] = torch.tensor([-0.0, 65504.0])
    store.append(keys.to(store_dtype), torch.from_numpy(rng.normal(size=(H, rows, d)).astype(np.float32)).to(store_dtype))
    tables = []
    for _ in range(H):
        members = rng.integers(0, rows, (npages, S)).astype(np.int32)
        count = rng.integers(1, S + 1, npages).astype(np.int32)
        tables.append((members, count, np.zeros(npages, np.int64)))
    pools = [ResidentKV(backend, H, d, torch.float32, 4, S, P, 8, pinned_slots) for _ in range(2)]
    for r in pools:
        r.track_rows = True
    assert pools[0]._one_call(store) is not None
    pin_members = rng.integers(0, rows, (3, S)).astype(np.int32)
    pinned = (np.arange(3, dtype=np.int64), (pin_members, np.full(3, S, np.int32), np.zeros(3, np.int64)),
              np.unique(pin_members).astype(np.int64))
    for step in range(30):
        for members, _count, version in tables:  # some pages change members
            moved = rng.choice(npages, 2, replace=False)
            version[moved] += 1
            members[moved] = rng.integers(0, rows, (2, S))
        selected = [rng.choice(npages, rng.integers(0, P - pinned_slots + 1), replace=False).astype(np.int32)
                    for _ in range(H)]
        use_pins = pinned if pinned_slots and step % 4 else None
        got = [pools[0].load(selected, lambda h: tables[h], store, use_pins),
               pools[1].load_reference(selected, lambda h: tables[h], store, use_pins)]
        assert got[0] == got[1]
        a, b = pools
        for name in ("slot_page", "slot_version", "slot_fill", "valid", "pool_row"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        ok = torch.from_numpy(a.valid)
        torch.testing.assert_close(a.keys[ok], b.keys[ok], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(a.values[ok], b.values[ok], rtol=0, atol=0, equal_nan=True)
    assert int(a.valid[:, a.pool_at : a.window_at].sum()) > 0


@pytest.mark.parametrize("method", ["oracle", "oracle-qhead"])
def test_oracle_equals_full_with_room_and_differs_without(method):
    from .lab import lab_settings

    model = tiny_model("llama", 2)
    rng = np.random.default_rng(10)
    prompt, forced = rng.integers(0, 97, 200).tolist(), rng.integers(0, 97, 5).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    roomy = lab_settings(budget=256, sink_pages=1, window_pages=1, page_size=16, dense_layers=1)
    got = run_steps(model, make_cache(method, model, roomy), prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    tight = lab_settings(budget=16, sink_pages=1, window_pages=1, page_size=16, dense_layers=1)
    got = run_steps(model, make_cache(method, model, tight), prompt, forced)
    torch.testing.assert_close(got[0], ref[0])  # the prefill is full attention
    assert max(float((a - b).abs().max()) for a, b in zip(ref[1:], got[1:], strict=True)) > 1e-3
    prepare_model("full", model)


@pytest.mark.parametrize("carry,pick,rest", [(1, False, False), (80, False, False), (8, True, False), (8, True, True)])
def test_carried_pages_covering_everything_equal_full(carry, pick, rest):
    """With room for every token, carried pages (and token picks, ``index_pick``) decode exactly
    like the dense cache."""
    model = tiny_model("llama", 2)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 97, 150).tolist()
    forced = rng.integers(0, 97, 30).tolist()
    ref = run_steps(model, full_cache(model), prompt, forced)
    s = spec(budget_pages=64, carry_pages=carry, index_pick=pick, rest_estimate=rest)
    got = run_steps(model, ice_cache(model, s), prompt, forced)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("sparse", [False, True])
def test_token_picks_fill_the_pool_and_the_rest_counts_every_other_token(sparse):
    """``index_pick``: at every step of every sparse layer (a sparse prefill's chunks, its prompt
    end, then the decode budget: three pool sizes) the pool holds exactly the picked tokens, a
    budget's worth, each once at its current version; the rest estimate stands for every other
    offloaded token once (its rows' counts plus the pool's rows are the host store's rows)."""
    from icecache.cache.ice_layer import IceLayer

    model = tiny_model("llama", 2)
    rng = np.random.default_rng(8)
    s = spec(budget_pages=3, index_pick=True, rest_estimate=True, carry_pages=8)
    if sparse:
        s = dataclasses.replace(s, sparse_prefill=True, prefill_pages=8, tail_pages=5, chunk_tokens=32,
                                dense_window=64)
    cache = ice_cache(model, s)
    checked = 0
    tail = 6 if sparse else 0  # prompt tokens a sparse prefill steps through, 5 pages each
    with torch.inference_mode():
        if sparse:
            cache.begin_prefill(160, tail)
            for _ in range(5):
                model(input_ids=torch.tensor([rng.integers(0, 97, 32).tolist()]), past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        else:
            model(input_ids=torch.tensor([rng.integers(0, 97, 160).tolist()]), past_key_values=cache, use_cache=True)
        for step, t in enumerate(rng.integers(0, 97, tail + 12).tolist()):
            if sparse and step == tail:
                cache.end_prefill()
            model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            for layer in cache.layers:
                if not (isinstance(layer, IceLayer) and layer.offloaded):
                    continue
                layer.wait()
                r, picks = layer.resident, layer.selector.picks
                r.check(layer.selected, layer.selector.page_table)
                for h, tokens in enumerate(picks):
                    rows = r.pool_row[h][r.valid[h, r.pool_at : r.window_at]]
                    assert sorted(rows.tolist()) == sorted(tokens.tokens().tolist())
                    assert len(rows) == (5 if step < tail else 3) * s.page_size  # the walk scans more
                estimate = sum(torch.where(torch.isfinite(b), b.exp(), torch.zeros_like(b)).sum(1)
                               for _k, _v, b in layer.rest_rows())
                pooled = r.valid[:, r.pool_at : r.window_at].sum(1)
                np.testing.assert_allclose(estimate.numpy() + pooled, layer.store.rows, rtol=1e-5)
                checked += 1
    assert checked == (tail + 12) * 3  # every step, every sparse layer (one dense layer of four)


def test_token_picks_of_another_size_take_versions_no_page_had():
    """A pool whose slots held one size of picked pages (a sparse prefill's chunks) reloads every
    slot at the next size (its prompt end, the decode budget): the new pages' versions are above
    every old one, so no slot's (page, version) can match a page whose members differ."""
    from icecache.cache.selectors import make_selector

    rng = np.random.default_rng(13)
    sel = make_selector(IceSpec(page_size=4, budget_pages=3, tuning=dataclasses.replace(LAB_DCI, index_pick=True)))
    sel.build(torch.from_numpy(rng.normal(size=(2, 300, 16)).astype(np.float32)), 0, 300, 400)
    before = -1
    for size in (8, 8, 5, 3, 3, "build", 3):
        if size == "build":  # a new index: no picks until the next step, then new pages
            sel.build(torch.from_numpy(rng.normal(size=(2, 300, 16)).astype(np.float32)), 0, 300, 400)
            assert sel.picks == []
            continue
        resized = not sel.picks or sel.picks[0].npages != size
        got = sel.select(rng.normal(size=(2, 2, 16)).astype(np.float32), size)
        assert all(len(g) <= size for g in got) and len(sel.picks) == 2
        if resized:
            assert min(int(t.version.min()) for t in sel.picks) > before
        before = max(before, max(int(t.version.max()) for t in sel.picks))


def test_the_layer_pick_equals_the_per_head_reference():
    """``DCISelector.choose`` with ``index_pick`` (every KV head's walk, pick and packing in two
    numba calls) against :meth:`choose_reference` (per head: the tree's scanned points, the
    NumPy pick, the NumPy packing) from the same state, step after step, with and without
    carried pages: the same pages and the same page tables, up to picks whose weights lie
    within float32 rounding of the cut."""
    import copy

    from icecache.cache.selectors import make_selector

    rng = np.random.default_rng(14)
    sel = make_selector(IceSpec(page_size=4, budget_pages=3, tuning=dataclasses.replace(LAB_DCI, index_pick=True)))
    sel.build(torch.from_numpy(rng.normal(size=(3, 500, 16)).astype(np.float32)), 0, 500, 600)
    sel.select(rng.normal(size=(3, 2, 16)).astype(np.float32), 3)
    changed = same = 0
    for step in range(30):
        q = (rng.normal(size=(3, 2, 16)) * 1.5).astype(np.float32)
        extra = sel.carried if step % 2 else None
        before, start = copy.deepcopy(sel.picks), copy.deepcopy(sel.picks)
        got = sel.choose(q, 3, 0.0, 9, extra)
        fast, sel.picks = sel.picks, before
        want = sel.choose_reference(q, 3, 0.0, extra)
        if all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)) and all(
                np.array_equal(u, v) for x, y in zip(fast, sel.picks, strict=True)
                for u, v in zip(x.table(), y.table(), strict=True)):
            same += 1
        sel.picks = fast
        changed += sum(int((x.version != y.version).any()) for x, y in zip(fast, start, strict=True))
    assert changed  # the picks moved between steps (the packing was exercised)
    assert same >= 28  # a near-tie at the cut may pick another token (the kernel test bounds them)


@pytest.mark.parametrize("walk_keys", ["float32", "int8"])
def test_pick_kernel_equals_the_numpy_reference(walk_keys):
    """``DCITree.pick_group``'s tokens (numba, float32) against ``pick_tokens`` (NumPy, float64)
    among the points the same walk scans, on a real tree, several takes, over either of the keys
    a walk reads, with carried pages too: the same number of tokens in scan order, and where the
    two choices differ, only tokens whose weight is at the cut."""
    from icecache.cache.selectors.dci import pick_tokens
    from icecache.cache.selectors.tokens import group_weights
    from icecache.index import DCITree

    rng = np.random.default_rng(11)
    differ = total = 0
    d = 16
    tree = DCITree(d, IndexConfig(page_size=4, ratio_bottom=0.1, walk_keys=walk_keys, beam=4), capacity=800)
    tree.insert(rng.normal(size=(700, d)).astype(np.float32))
    for _ in range(25):
        tree.insert(rng.normal(size=(4, d)).astype(np.float32))
    partial = 0
    for i in range(20):
        q = (rng.normal(size=(3, d)) * 2).astype(np.float32)
        extra = tree.live_pages()[i::7][:5] if i % 2 else None
        rows = tree.scanned(q, 0.0, extra)
        partial += len(rows) < tree.n
        keys = tree.walk_rows(rows)
        weight = dict(zip(rows.tolist(), group_weights(q, keys, d ** -0.5), strict=True))
        for take in (8, 50, 10_000):
            pages, got = tree.pick_group(q, take, 10, 0.0, extra)
            want = pick_tokens(tree, q, rows, take)
            np.testing.assert_array_equal(pages, tree.select_group(q, 40, 10, 0.0, extra))
            assert len(got) == len(want) == min(take, len(rows))
            order = {r: i for i, r in enumerate(rows.tolist())}
            assert [order[r] for r in got.tolist()] == sorted(order[r] for r in got.tolist())  # scan order
            # float32 weights: only tokens at the cut may differ from the float64 reference's choice
            cut = sorted(weight.values(), reverse=True)[len(want) - 1]
            for r in set(got.tolist()) ^ set(want.tolist()):
                assert abs(weight[r] - cut) < 2e-5, (r, weight[r], cut)
            differ += len(set(got.tolist()) ^ set(want.tolist()))
            total += len(want)
    assert partial  # the walk left keys unscanned: the pick is among what it read
    assert differ <= total // 100  # near-ties are rare


def test_choose_kernel_equals_the_numpy_reference():
    """``TokenPages.choose`` (numba) against ``choose_reference`` over random choice sequences:
    the same members, counts, versions and page ids at every step, also where the stamps it
    shares hold another user's old stamps."""
    from icecache.cache.kernels import choose_tokens
    from icecache.cache.selectors.tokens import TokenPages

    rng = np.random.default_rng(12)
    fast, ref, stale = TokenPages(4, 6), TokenPages(4, 6), TokenPages(4, 6)
    mark = np.zeros(41, np.int64)
    for _ in range(200):
        tokens = rng.choice(40, size=int(rng.integers(0, 25)), replace=False)
        a, b = fast.choose(tokens), ref.choose_reference(tokens)
        # stamps that another user of the marks (a walk) left behind, none above its counter
        mark[0] += int(rng.integers(0, 3))
        mark[1:] = rng.integers(0, mark[0] + 1, 40)
        c = choose_tokens(*stale.table(), tokens.astype(np.int32), mark)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)
        for x, y, z in zip(fast.table(), ref.table(), stale.table(), strict=True):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(z, y)
        assert sorted(fast.tokens().tolist()) == sorted(tokens.tolist())
    with pytest.raises(ValueError, match="do not fit"):
        fast.choose(np.arange(25))


def test_carry_pages_keeps_what_a_wider_search_found():
    """``carry_pages`` C: a decode step ranks the last search's best C pages (at least its
    choice) beside what its own (narrow) walk reaches. After an exact prompt-end search (``wide``
    1) the next narrow steps of the same queries keep its pages; without the carry the narrow
    walk misses some (so the test can tell them apart). What is carried is the last step's
    ranking, headed by its choice, and a new build forgets it."""
    from icecache.cache.selectors import make_selector
    from icecache.index.reference import exact_topk, ranked_pages

    from .test_index import clustered

    S, H, n, d = 8, 3, 6000, 32
    missed = 0
    for carry in (6, 20, 0):
        s = IceSpec(page_size=S, budget_pages=6,
                    tuning=dataclasses.replace(LAB_DCI, carry_pages=carry, index_beam=2, index_beam_frac=0.0,
                                                 index_walk_keys="float32"))  # (exact scores: ranked as exact search ranks)
        sel = make_selector(s)
        keys = np.stack([clustered(n, d=d, clusters=60, seed=30 + h) for h in range(H)]).astype(np.float32)
        sel.build(torch.from_numpy(keys), 0, n, n + 64)
        for trial in range(4):
            q = np.stack([clustered(1, d=d, clusters=60, seed=40 + 7 * trial + h) for h in range(H)]).astype(np.float32)
            exact = [np.asarray(ranked_pages(exact_topk(keys[h], q[h, 0], 6 * S).astype(np.int32), sel.indexes[h].tok_page, 6))
                     for h in range(H)]
            wide = sel.select_prefill(q, 6, 1.0)
            assert [w.tolist() for w in wide] == [e.tolist() for e in exact]
            for _ in range(2):
                got = sel.select(q, 6)
                if carry:
                    assert [g.tolist() for g in got] == [e.tolist() for e in exact]
                    assert all(6 <= len(c) <= carry for c in sel.carried)  # as many as were scanned
                    assert [c[:6].tolist() for c in sel.carried] == [g.tolist() for g in got]
                else:
                    missed += any(g.tolist() != e.tolist() for g, e in zip(got, exact, strict=True))
                    assert sel.carried is None
        if carry:
            sel.build(torch.from_numpy(keys), 0, n, n + 64)
            assert sel.carried is None
    assert missed


def test_prefill_beam_widens_only_the_prefill_search():
    """``prefill_beam``: a sparse prefill's chunk search expands that many nodes per level (here
    every node: the exact pages) while decode steps keep the narrow index beam."""
    from icecache.cache.selectors import make_selector
    from icecache.index.reference import exact_topk, ranked_pages

    from .test_index import clustered

    S, H, n, d = 8, 3, 6000, 32
    keys = np.stack([clustered(n, d=d, clusters=60, seed=30 + h) for h in range(H)]).astype(np.float32)
    narrow_missed = 0
    for beam in (0, n):
        s = IceSpec(page_size=S, budget_pages=6,
                    tuning=dataclasses.replace(LAB_DCI, prefill_beam=beam, index_beam=2, index_beam_frac=0.0,
                                                 index_walk_keys="float32"))  # (exact scores, as above)
        sel = make_selector(s)
        sel.build(torch.from_numpy(keys), 0, n, n + 64)
        for trial in range(4):
            q = np.stack([clustered(1, d=d, clusters=60, seed=40 + 7 * trial + h) for h in range(H)]).astype(np.float32)
            exact = [ranked_pages(exact_topk(keys[h], q[h, 0], 6 * S).astype(np.int32), sel.indexes[h].tok_page, 6)
                     for h in range(H)]
            chunk = [c.tolist() for c in sel.select_prefill(q, 6)]
            step = [c.tolist() for c in sel.select(q, 6)]
            if beam:
                assert chunk == [list(e) for e in exact]
            narrow_missed += step != [list(e) for e in exact]
            if not beam:
                assert chunk == step  # the same narrow search
    assert narrow_missed


def test_the_auto_beam_follows_the_key_dimensions_a_step_walks():
    """``index_beam: 0``: 32 nodes per level at the embedded model's walk (28 sparse layers x 3 KV
    heads x 64 dims), wider in proportion where a step walks fewer key dimensions (a model with
    window layers counts its global ones past ``dense_layers``), never narrower; a set beam is
    taken as it is. The paged cache built for a model carries its beam into every tree."""
    from icecache.cache.selectors.dci import AUTO_WALK_DIMS, decode_beam
    from icecache.config import resolve_settings
    from icecache.methods.factory import walk_dims

    auto = DCISettings()
    assert auto.index_beam == 0
    assert decode_beam(auto, AUTO_WALK_DIMS) == decode_beam(auto, 0) == 32
    assert decode_beam(auto, 4 * AUTO_WALK_DIMS) == 32
    assert decode_beam(auto, AUTO_WALK_DIMS // 7) == 224
    assert decode_beam(DCISettings(index_beam=48), 8) == 48
    s = resolve_settings("cpu", dense_layers=1, dense_until=0)
    gemma = tiny_model("gemma3")  # one global layer of four, past dense_layers: 1 x 1 x 32
    llama = tiny_model("llama", 2)  # three sparse layers x 2 x 16
    assert walk_dims(gemma.config, s) == 32 and walk_dims(llama.config, s) == 96
    cache = make_cache("ice", gemma, s, tokens=400)
    assert cache.ice_layers()[0].selector.tree.beam == 32 * AUTO_WALK_DIMS // 32
    cache = make_cache("ice", llama, s.replace(index_beam=5), tokens=400)
    assert {layer.selector.tree.beam for layer in cache.ice_layers()} == {5}
