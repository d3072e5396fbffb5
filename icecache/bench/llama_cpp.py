"""llama.cpp as a row of ``icecache bench`` (``--methods ...,llama.cpp``): the same GGUF file and
the same prompt tokens through llama-cpp-python, timed in the same run as the icecache methods.

llama-cpp-python is not a dependency. Where it is installed, the row runs llama.cpp's own
prefill of the context's token ids (the GGUF's vocabulary, which the converted model shares),
then greedy decode steps one token at a time with the same warm-up and, for each other method,
as many timed steps as it takes, in turns with its steps (``icecache.bench.full_bench``), with
as many threads as torch uses. Reported: the time to the second token (prefill + first step),
prefill tokens/s, TPOT (median, p90 and mean), peak RSS, and llama.cpp's KV cache size for its context
(float16 keys and values in every layer: its default cache type).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAME = "llama.cpp"
CHUNK = 2048  # prompt tokens per eval call (progress between them; llama.cpp batches within)


def missing() -> str | None:
    """Why llama.cpp cannot be timed here (its Python package is not installed), or None."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError:
        return ("the llama.cpp row needs llama-cpp-python, which icecache does not install "
                "(pip install llama-cpp-python)")
    return None


# a child process loads the GGUF and evaluates a few tokens (the first prefill is where a build
# for other instructions dies)
_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval([1, 2, 3, 4])
"""


def crashes(gguf: Path, timeout: float = 300.0) -> str | None:
    """Why llama.cpp dies on this machine, or None where it runs: its native library, built for
    instructions this CPU lacks (a build with AVX-512 on an AVX2-only CPU), kills the process
    with SIGILL at its first prefill, which no exception can catch, so a child process tries it
    first."""
    import signal
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None  # slow, not dead: the run itself will tell
    if done.returncode >= 0:
        return None
    sig = -done.returncode
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    if sig == signal.SIGILL:
        return (f"llama-cpp-python dies here ({name}): it was built for instructions this CPU lacks; "
                "rebuild it for this CPU (docs/usage.md, \"Building llama-cpp-python\")")
    return f"llama-cpp-python dies here ({name}) on its first prefill"


def gguf_of(spec: str | None) -> Path | None:
    """The GGUF file a ``--model`` value names (the embedded model's own file when none, Gemma 3
    270M's for ``gemma-3-270m``), or
    None for a model folder or an HF id (llama.cpp reads GGUF only). A ``.gguf`` path that does
    not exist is returned as it is: loading the model reports it."""
    from ..models import GEMMA_NAME, embedded_gguf_path, gemma_gguf_path, names_embedded

    if names_embedded(spec):
        return embedded_gguf_path()
    if spec == GEMMA_NAME:  # the file assembled from its packages (one line naming them if absent)
        return gemma_gguf_path()
    return Path(spec).expanduser() if spec.endswith(".gguf") else None


def kv_cache_bytes(config, n_ctx: int) -> int:
    """llama.cpp's KV cache for ``n_ctx`` positions: float16 keys and values of every layer."""
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * 2 * config.num_hidden_layers * heads * head_dim * n_ctx


@dataclass
class Timing:
    """What one llama.cpp run measured (seconds): the prefill, the time to the second token, each
    timed step, and the greedy tokens fed."""

    prefill_s: float
    tt2t_s: float
    times: list[float]
    tokens: list[int]

    @property
    def tpot_ms(self) -> float:
        return 1000 * float(np.median(self.times))

    @property
    def tpot_p90_ms(self) -> float:
        return 1000 * float(np.percentile(self.times, 90))

    @property
    def tpot_mean_ms(self) -> float:
        return 1000 * float(np.mean(self.times))


class LlamaSteps:
    """A llama.cpp run held open: the prompt ``ids`` prefilled into ``llm`` (``eval`` in chunks of
    :data:`CHUNK`) and ``warmup`` untimed greedy steps taken; :meth:`advance` times more steps,
    so that the bench can take them in turns with another method's (the two then see the same
    minutes of a machine whose speed drifts). ``logits_of(llm)`` -> the last evaluated token's
    logits. The time to the second token is the prefill plus the first step."""

    def __init__(self, llm, logits_of, ids: list[int], warmup: int, on_progress=None):
        self.llm, self.logits_of = llm, logits_of
        t0 = time.perf_counter()
        for at in range(0, len(ids), CHUNK):
            llm.eval(ids[at : at + CHUNK])
            if on_progress is not None:
                on_progress(min(at + CHUNK, len(ids)), len(ids))
        self.prefill_s = time.perf_counter() - t0
        self.token = int(np.argmax(logits_of(llm)))
        self.times: list[float] = []
        self.fed: list[int] = []
        self.tt2t = float("nan")
        for _ in range(warmup):
            self._step()

    def _step(self) -> float:
        self.fed.append(self.token)
        t = time.perf_counter()
        self.llm.eval([self.token])
        self.token = int(np.argmax(self.logits_of(self.llm)))
        dt = time.perf_counter() - t
        if len(self.fed) == 1:
            self.tt2t = self.prefill_s + dt
        return dt

    def advance(self, steps: int) -> None:
        """``steps`` more timed greedy steps."""
        for _ in range(steps):
            self.times.append(self._step())

    def timing(self) -> Timing:
        return Timing(self.prefill_s, self.tt2t, list(self.times), list(self.fed))


def last_logits(llm) -> np.ndarray:
    """The logits of the last token ``llm.eval`` evaluated (llama.cpp keeps them for the batch's
    last token when ``logits_all`` is off)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def open_run(gguf: Path, ids: list[int], steps: int, warmup: int, threads: int, on_progress=None) -> LlamaSteps:
    """A llama.cpp run of the GGUF file over ``ids`` held open (:class:`LlamaSteps`), its context
    room for the prompt and ``warmup + steps`` decode steps; :func:`close` frees it."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(ids) + warmup + steps + 1, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False)
    try:
        return LlamaSteps(llm, last_logits, ids, warmup, on_progress)
    except BaseException:
        close(llm)
        raise


def close(llm) -> None:
    """Free a llama.cpp context and its KV cache now, not at garbage collection."""
    if hasattr(llm, "close"):
        llm.close()
