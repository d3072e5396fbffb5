"""A ``dense`` decode step with float32 and with bfloat16 keys and values (``dense_kv``), in the
model, side by side (issue 18, session 45).

One process prefills CTX generated tokens once per setting (the cpu profile), decodes 4 warm-up
steps each, then times 16 steps per setting in ``ROUNDS`` turns taken in order, and prints ms per
step per turn. ``--products``: first, torch's float32 and bfloat16 products on the prefill's
shapes (GFLOP/s, two threads, warm).

    python scripts/dense_kv_speed.py CTX [ROUNDS] [--products]      e.g. 8192 4
"""

from __future__ import annotations

import sys
import time


def products() -> None:
    import torch
    import torch.nn.functional as F

    for m, k, n in [(2048, 576, 1536), (2048, 1536, 576), (512, 64, 8192), (2048, 8192, 64)]:
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            for _ in range(3):
                F.linear(x, w)
            t = time.perf_counter()
            for _ in range(10):
                F.linear(x, w)
            s = (time.perf_counter() - t) / 10
            print(f"{m} x {k} -> {n} {str(dtype).removeprefix('torch.')}: {2 * m * k * n / s / 1e9:.0f} GFLOP/s")


def main() -> None:
    import torch

    from icecache.bench.decode_bench import context_ids
    from icecache.config import resolve_settings
    from icecache.generation import Session
    from icecache.models import load_model

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ctx = int(args[0])
    rounds = int(args[1]) if len(args) > 1 else 4
    settings = resolve_settings("cpu").replace(doc_cache="off")
    loaded = load_model(None, settings)
    if "--products" in sys.argv:
        products()
    ids = context_ids(loaded.tokenizer, ctx)
    sessions = {}
    with torch.inference_mode():
        for kv in ("model", "bfloat16"):
            s = Session(loaded, settings.replace(dense_kv=kv), "dense")
            s.prefill(ids)
            for i in range(4):
                s.forward([100 + i])
            sessions[kv] = s
        times: dict[str, list[float]] = {kv: [] for kv in sessions}
        for r in range(rounds):
            for kv, s in sessions.items():
                s.activate()
                t = time.perf_counter()
                for i in range(16):
                    s.forward([200 + 16 * r + i])
                times[kv].append((time.perf_counter() - t) / 16 * 1e3)
    for kv, ms in times.items():
        dtype = sessions[kv].cache.layers[0].keys.dtype
        print(f"{ctx} tokens, dense_kv {kv} ({str(dtype).removeprefix('torch.')}): "
              + " ".join(f"{x:.1f}" for x in ms) + " ms per step")


if __name__ == "__main__":
    main()
