"""An all-dense run past the trained context: the prompt at true positions, decode steps attend
to the keys farther than the trained context at the farthest trained distance (``GrowingLayer.clamp``)."""

from __future__ import annotations

import pytest
import torch

from .test_positions import ROPES, llama


def _frame(trained: int, d: int = 16):
    from icecache.cache.positions import RopeFrame

    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return RopeFrame(inv, trained)


def _reference(frame, q0, k0, v, scale):
    """Attention of a query (un-rotated q0 (Hq, d)) at position n - 1 over un-rotated keys k0
    (H, n, d): key j at its own position, or at ``n - trained`` (distance ``trained - 1``) if it
    is farther; the keys and the query rotated there as the model would, in float64."""
    H, n, d = k0.shape
    far = max(0, n - frame.trained)
    pos = torch.arange(n)
    placed = torch.where(pos < far, torch.full_like(pos, n - frame.trained), pos)
    assert int((n - 1 - placed).max()) <= frame.trained - 1  # every distance a trained one
    keys = frame.rotate(k0.double(), torch.zeros(n, dtype=torch.long), placed)
    q = frame.rotate(q0.double(), 0, n - 1).reshape(H, -1, d)
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys) * scale, dim=-1)
    return torch.einsum("hgn,hnd->hgd", probs, v.double())


@pytest.mark.parametrize("T, half", [(40, False), (4200, False), (300, True)])
def test_a_clamped_decode_equals_keys_placed_at_the_farthest_trained_distance(T, half):
    """Steps from within the trained context to past it (the un-rotated copies made a few at a
    time), after a crop too, on the fused numba step in float32 (its clamped rows scored in the
    kernel) and the bfloat16 decode."""
    from icecache.cache.dense import GrowingLayer, dense_decode

    trained = T - 5
    frame = _frame(trained)
    g = torch.Generator().manual_seed(T)
    H, G, d = 2, 3, 16
    k0 = torch.randn(H, T + 12, d, generator=g)  # un-rotated keys of every position
    v = torch.randn(H, T + 12, d, generator=g)
    rotated = frame.rotate(k0, torch.zeros(T + 12, dtype=torch.long), torch.arange(T + 12))
    layer = GrowingLayer(torch.bfloat16 if half else None, clamp=frame)
    layer.clamp_ahead = 4  # (several blocks of un-rotated copies)
    layer.update(rotated[None, :, : T - 8], v[None, :, : T - 8])  # the prompt
    scale = d**-0.5

    def step(n):
        keys, values = layer.update(rotated[None, :, n - 1 : n], v[None, :, n - 1 : n])
        q0 = torch.randn(H * G, d, generator=g)
        query = frame.rotate(q0, 0, n - 1)[None, :, None]  # (1, Hq, 1, d) at position n - 1
        clamp = layer.clamped(query)
        assert (clamp is None) == (n <= trained)
        out = dense_decode(query, keys, values, scale, clamp=clamp)[0, 0].reshape(H, G, d)
        kk, vv = (k0[:, :n], v[:, :n]) if not half else (  # what the layer holds, un-rotated again
            frame.rotate(keys[0].float(), torch.arange(n), torch.zeros(n, dtype=torch.long)), values[0].float())
        ref = _reference(frame, q0, kk, vv, scale)
        tol = 2e-2 if half else 1e-4
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        return out

    for n in range(T - 7, T + 8):
        step(n)
    c = T + 7 - trained
    assert c <= layer._c0 <= c + 4  # un-rotated copies made a block ahead
    layer.crop(-6)  # back to T + 1 rows (then steps over the cut rows again)
    assert layer._c0 <= T + 1
    for n in range(T + 2, T + 12):
        step(n)


def test_the_plan_of_an_all_dense_run_past_the_trained_context():
    from icecache.methods import all_dense, dense_plan

    from .lab import lab_settings

    model = llama(ROPES["default"])  # trained on 4096 positions
    s = lab_settings(prefill="auto", positions="auto", max_context=10**6, dense_until=5000)
    dense, clamp = dense_plan("ice", model, s, 4500, 4000)  # the prompt fits, the generation goes past
    assert dense and clamp is not None and clamp.trained == 4096
    assert dense_plan("ice", model, s, 4000, 3900) == (True, None)  # within: exact, true positions
    assert dense_plan("ice", model, s, 4500, 4097) == (False, None)  # the prompt itself past it: pages
    assert dense_plan("ice", model, s, 5001, 4000) == (False, None)  # past dense_until
    assert not all_dense("ice", model, s, 4500)  # the prompt's length not known: pages
    assert dense_plan("ice", model, s.replace(positions="true"), 4500, 4000) == (True, None)  # asked for
    assert dense_plan("quest", model, s, 4500, 4000) == (False, None)
    dynamic = llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert dense_plan("ice", dynamic, s, 4500, 4000) == (True, None)  # auto keeps its true positions


def _tiny():
    """A tiny model trained on 64 positions and settings that keep a run of 100 tokens dense."""
    import transformers as tf

    from icecache.models import LoadedModel

    from .lab import lab_settings

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    model = tf.LlamaForCausalLM(cfg).eval()
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny", context_length=64, load_seconds=0.0)
    s = lab_settings(device="cpu", dtype="float32", prefill="auto", positions="auto", dense_until=100,
                 page_size=4, budget=8, sink_pages=1, window_pages=2)
    return loaded, s


def test_a_session_past_the_trained_context_clamps_and_within_it_stays_exact():
    """A tiny model trained on 64 positions: a 56-token prompt and 20 new tokens. The run is
    every layer dense with clamped distances: its logits equal full attention's while the run is
    within 64 tokens, and differ past it (the oldest keys moved)."""
    from icecache.generation import Session

    loaded, s = _tiny()
    prompt = [int(t) for t in torch.randint(3, 97, (56,), generator=torch.Generator().manual_seed(1))]
    runs = {}
    for method in ("full", "ice"):  # (one after the other: a session sets the model's attention)
        session = Session(loaded, s, method)
        session.new_tokens = 20
        with torch.inference_mode():
            logits, _ = session.prefill(prompt)
            out = [logits]
            for _ in range(20):
                out.append(session.forward([int(runs["full"][len(out) - 1].argmax()) if runs else
                                            int(logits.argmax())]))
                logits = out[-1]
        runs[method] = out
        if method == "ice":
            assert session.all_dense and session.cache.clamped and session.positions == "remap"
            assert session.cache.layers[0]._c0 >= 56 + 20 - 64
    for i, (a, b) in enumerate(zip(runs["ice"], runs["full"], strict=True)):
        if 56 + i <= 64:  # (the prompt, then step i's query row): every key within the trained context
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # past it the oldest keys moved closer (12 of them at the last step)
    assert (runs["ice"][-1] - runs["full"][-1]).abs().max() > 1e-4  # (within: <= 1e-5)


@pytest.mark.parametrize("rope", list(ROPES))
def test_the_rotation_matrix_equals_the_rotation(rope):
    from icecache.cache.positions import RopeFrame

    frame = RopeFrame.from_model(llama(ROPES[rope]))
    partial = RopeFrame(frame.inv_freq[:4], frame.trained)  # rotary_dim 8 of 32: the rest kept
    x = torch.randn(5, 32)
    for f in (frame, partial):
        for src, dst in [(9000, 8191), (3, 0), (0, 4095)]:
            torch.testing.assert_close(x @ f.rotation_matrix(src, dst, 32), f.rotate(x, src, dst),
                                       atol=1e-5, rtol=1e-5)


def test_fidelity_plans_its_forced_run_for_the_tokens_it_feeds():
    """Teacher forcing 20 tokens after a 56-token prompt is a run of 76 tokens: past the tiny
    model's 64, so ice clamps (it had been planned for the prompt alone: true positions)."""
    from icecache.evals import fidelity
    from icecache.generation import Session

    loaded, s = _tiny()
    session = Session(loaded, s, "ice")
    got = fidelity._forced(session, list(range(3, 59)), list(range(10, 30)))
    assert len(got) == 20 and session.cache.clamped and session.positions == "remap"


def test_the_run_plan_line_says_the_distances_are_clamped():
    from icecache.tasks import Runner

    loaded, s = _tiny()
    runner = Runner(loaded, s, "ice")
    lines = []
    runner.note = lines.append
    assert runner.beyond_trained(56, 20) is None  # handled: no warning of untrained positions
    assert lines == ["full prefill, remap positions, every layer dense (the run fits dense_until, 100 tokens; "
                     "distances past 64 clamped to 63) (56 prompt tokens, 64 trained)"]
    runner.beyond_trained(40, 20)
    assert lines[-1] == ("full prefill, true positions, every layer dense (exact: the run fits dense_until, "
                         "100 tokens) (40 prompt tokens, 64 trained)")


def test_a_bench_row_says_a_clamped_run():
    from icecache.bench.full_bench import BenchRow
    from icecache_cli.bench import row_line

    row = BenchRow(method="ice", ctx=8192, positions="remap", all_dense=True, clamped=True,
                   status="skipped", reason="test")
    assert row_line(row).startswith("ice at 8192 tokens (remap positions, every layer dense: within "
                                    "dense_until, distances past the trained context clamped): skipped")
    row.clamped = False
    assert "clamped" not in row_line(row)
