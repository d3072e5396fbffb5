"""The decode attention over ice's resident rows on a GPU: torch's SDPA with the rows' mask
against FlashInfer's paged decode, per step of a Llama-3.1-8B-shaped model (32 layers, 8 KV
heads of 4 query heads each, head_dim 128, bfloat16), the two alternated in one process.

Each step attends every layer once, with the host-side work each path does at a real step
(torch: the mask copied to the device; FlashInfer: the page lists planned and copied), and waits
for the device at its end. Prints the ms per step of each and their largest difference from the
float32 reference. Usage: python scripts/gpu/attention_ab.py [rows per head ...]"""

import sys
import time

import numpy as np
import torch

from icecache.cache.backend import TorchBackend
from icecache.cache.paged import paged_decode_reference, paged_decode_sdpa

LAYERS, H, G, D = 32, 8, 4, 128


def main(lengths: list[int]) -> None:
    for L in lengths:
        one_length(L)


def one_length(L: int) -> None:
    dev = torch.device("cuda")
    scale = D**-0.5
    g = torch.Generator(device="cpu").manual_seed(L)
    q = [torch.randn(H, G, D, generator=g).to(dev, torch.bfloat16) for _ in range(LAYERS)]
    k = [torch.randn(H, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(H, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(LAYERS)]
    rng = np.random.default_rng(L)
    valid = [rng.random((H, L)) < 0.9 for _ in range(LAYERS)]
    for m in valid:
        m[:, 0] = True
    be = TorchBackend(dev, "flashinfer")

    def torch_step():
        return [paged_decode_sdpa(q[i], k[i], v[i], torch.from_numpy(valid[i]).to(dev, non_blocking=True), scale)
                for i in range(LAYERS)]

    def flashinfer_step():
        return [be.decode_attention(i, q[i], k[i], v[i], valid[i], scale) for i in range(LAYERS)]

    ref = [paged_decode_reference(q[i], k[i], v[i], torch.from_numpy(valid[i]).to(dev), scale) for i in range(LAYERS)]
    times: dict[str, list[float]] = {"torch": [], "flashinfer": []}
    for rnd in range(4):  # alternated; the first round warms both up
        for name, step in (("torch", torch_step), ("flashinfer", flashinfer_step)):
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = step()
                torch.cuda.synchronize()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
            err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref, strict=True))
            if rnd == 3:
                ms = sorted(times[name])[len(times[name]) // 2] * 1e3
                print(f"rows/head {L}: {name:10s} {ms:.3f} ms per step ({LAYERS} layers), "
                      f"max |diff| to float32 reference {err:.4f}", flush=True)
    assert be.flashinfer, "FlashInfer fell back to torch"


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [352, 1088])
