"""``icecache bench prefill``: prefill wall time, throughput and memory per prefill mode.

Modes (all on generated text of ``ctx`` tokens, in the profile's chunks):

- ``full``: transformers' dense cache and attention (the baseline);
- ``ice``: the same full-attention prefill into the ice cache, each layer offloaded and indexed
  in the background as soon as the prompt's last chunk has passed it (pipelined);
- ``ice-serial``: the same with the offload and index build after the prefill;
- ``sparse``: sparse prefill (chunks attend to sink + selected pages + window; evicted chunks
  indexed in the background), ``sparse-serial`` without the background worker.

The time of an ice mode includes its index: the prefill ends when every layer is offloaded and
indexed. Peak RSS is sampled every 20 ms while the mode runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..measure import PeakRss, kv_bytes

MODES = {
    "full": ("full", {}),
    "dense": ("dense", {}),
    "ice": ("ice", {"pipeline": True, "prefill": "full"}),
    "ice-serial": ("ice", {"pipeline": False, "prefill": "full"}),
    "sparse": ("ice", {"pipeline": True, "prefill": "sparse"}),
    "sparse-serial": ("ice", {"pipeline": False, "prefill": "sparse"}),
}


@dataclass
class PrefillResult:
    mode: str
    ctx: int
    seconds: float
    tokens_per_s: float
    index_build_s: float
    index_insert_s: float
    device_kv_bytes: int
    host_kv_bytes: int
    peak_rss_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def run(loaded, settings, mode: str, ids: list[int], on_progress=None) -> PrefillResult:
    import gc

    import torch

    from ..generation import Session
    from . import sync_timers

    sync_timers()
    method, changes = MODES[mode]
    s = settings.replace(**changes)
    session = Session(loaded, s, method)
    gc.collect()
    with PeakRss() as peak, torch.inference_mode():
        _, stats = session.generate(ids, 1, on_progress=on_progress)
    dev, host, _ = kv_bytes(session.cache, s.dense_layers)
    st = getattr(session.cache, "stats", None)
    result = PrefillResult(
        mode=mode, ctx=len(ids), seconds=stats.prefill_seconds,
        tokens_per_s=len(ids) / stats.prefill_seconds, index_build_s=st.index_build_s if st else 0.0,
        index_insert_s=st.index_insert_s if st else 0.0, device_kv_bytes=dev, host_kv_bytes=host,
        peak_rss_bytes=peak.peak)
    del session
    gc.collect()
    return result


def warm_up(loaded, settings, modes, ids: list[int]) -> None:
    """Each mode once on a short prompt, untimed (numba compiles its kernels on first use)."""
    for mode in modes:
        run(loaded, settings, mode, ids)
