"""The CUDA path against the CPU path: page loading through pinned memory and the copy stream,
and every method (full and sparse prefill, positions true and remapped) step by step.

Run on a machine with a CUDA GPU: ``pytest -m gpu``. Skipped without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.methods import make_cache
from tests.test_pinned import CASES, SETTINGS, prompt, selected_pages, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_CASES = {
    **CASES,
    "ice-remap": ("ice", {"positions": "remap"}),
    "ice-sparse-remap": ("ice", {"prefill": "sparse", "positions": "remap"}),
    "ice-reuse-remap": ("ice-reuse", {"positions": "remap", "reuse_every": 2}),
    # the baselines of issue 20 (written after the last GPU lease)
    **{m: (m, {}) for m in ("h2o", "arkvale", "omnikv", "pqcache", "magicpig")},
    # answer_spans: pinned passages in their own pool slots
    "ice-spans": ("ice", {"answer_spans": 2}),
    "ice-spans-remap": ("ice", {"answer_spans": 2, "positions": "remap", "window_pages": 3}),
    "ice-rest": ("ice", {"rest_estimate": True}),
}
STEPS = 24


@pytest.fixture(autouse=True)
def exact_float32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@torch.inference_mode()
def run_forced(model, method: str, settings, forced: list[int] | None):
    """Prefill the pinned prompt in chunks, then decode ``STEPS`` tokens: greedy when ``forced``
    is None, else fed ``forced``. Returns (tokens fed, last-position logits per step on the CPU,
    selected pages per step)."""
    ids, dev = prompt(), model.device
    cache = make_cache(method, model, settings)
    if hasattr(cache, "begin_prefill"):
        cache.begin_prefill(len(ids))
    for lo in range(0, len(ids), settings.chunk_size):
        x = torch.tensor([ids[lo : lo + settings.chunk_size]], device=dev)
        out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if hasattr(cache, "end_prefill"):
        cache.end_prefill()
    tokens, logits, pages = [], [out.logits[0, -1].float().cpu()], []
    for i in range(STEPS):
        t = int(torch.argmax(logits[-1])) if forced is None else forced[i]
        tokens.append(t)
        out = model(input_ids=torch.tensor([[t]], device=dev), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float().cpu())
        pages.append((selected_pages(cache), pinned_rows(cache)))
    return tokens, logits, pages


def pinned_rows(cache) -> list:
    """Per ice layer, the rows answer_spans pinned ([] before they are chosen or without it)."""
    if not hasattr(cache, "ice_layers"):
        return []
    return [[] if layer.passages is None or layer.passages.pinned is None else sorted(int(r) for r in layer.passages.pinned.tokens())
            for layer in cache.ice_layers()]


@pytest.fixture(scope="module")
def models():
    cpu = tiny_model()
    gpu = tiny_model().cuda()
    return cpu, gpu


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_method_on_cuda_matches_cpu(models, case):
    cpu_model, gpu_model = models
    method, changes = GPU_CASES[case]
    settings = SETTINGS.replace(**changes)
    tokens, want_logits, want_pages = run_forced(cpu_model, method, settings, None)
    _, got_logits, got_pages = run_forced(gpu_model, method, settings.replace(device="cuda"), tokens)
    for step, (a, b) in enumerate(zip(want_logits, got_logits, strict=True)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3, msg=lambda m, s=step: f"step {s}: {m}")
    assert got_pages == want_pages


def test_load_rows_cuda_matches_cpu():
    """Many loads in a row through the pinned staging buffer and the copy stream (a staging
    buffer reused before its copy finished would show as wrong rows)."""
    from icecache.cache.backend import TorchBackend

    rng = np.random.default_rng(3)
    R, Q, d = 5000, 512, 64
    host_k = torch.from_numpy(rng.standard_normal((R, d)).astype(np.float16))
    host_v = torch.from_numpy(rng.standard_normal((R, d)).astype(np.float16))
    pools = {}
    for dev in ("cpu", "cuda"):
        be = TorchBackend(dev)
        hk, hv = be.to_host(host_k), be.to_host(host_v)
        pk = be.device_zeros((Q, d), torch.float32)
        pv = be.device_zeros((Q, d), torch.float32)
        steps = np.random.default_rng(11)
        for _ in range(200):
            m = int(steps.integers(1, Q))
            src = torch.from_numpy(steps.choice(R, m, replace=False))
            dst = torch.from_numpy(steps.choice(Q, m, replace=False))
            moved = be.load_rows(hk, hv, src, pk, pv, dst)
            assert moved == 2 * m * d * 2
        be.synchronize()
        pools[dev] = (pk.cpu(), pv.cpu())
    assert torch.equal(pools["cpu"][0], pools["cuda"][0]) and torch.equal(pools["cpu"][1], pools["cuda"][1])
    assert pools["cpu"][0].abs().sum() > 0


def test_host_store_is_pinned_on_cuda():
    from icecache.cache.backend import TorchBackend

    be = TorchBackend("cuda")
    assert be.host_empty((4, 8), torch.float16).is_pinned()
    assert be.device_zeros((4, 8), torch.float16).is_cuda
