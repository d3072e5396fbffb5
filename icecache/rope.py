"""RoPE scaling of the model for one run: the peer a user would try instead of remapped positions.

``rope_scaling`` (profile key, ``--rope-scaling``): ``none`` keeps the model's own RoPE;
``linear`` (position interpolation), ``dynamic`` (NTK-aware, the base grows with the sequence)
and ``yarn`` are transformers' own RoPE types, set on the model's config for a run whose prompt
and generation outgrow the trained context, with ``factor`` = (prompt + generation) / trained
(``dynamic``: 2, transformers' usual example; its base follows the length by itself). Within
the trained context the model's own RoPE is used. The model object is shared by runs: every run
sets the RoPE it needs (:func:`apply`), restoring the original where none is asked for.
"""

from __future__ import annotations

from typing import Any

SCALINGS = ("none", "linear", "dynamic", "yarn")
_ORIGINAL = "_icecache_rope_original"


def _rotary(model: Any):
    inner = getattr(model, "model", None)
    return getattr(inner, "rotary_emb", None) if inner is not None else None


def parameters(model: Any, scaling: str, tokens: int) -> dict:
    """The ``rope_parameters`` a run of ``tokens`` (prompt + generation) uses."""
    original, trained = getattr(model, _ORIGINAL, None) or (dict(model.config.rope_parameters),
                                                            int(model.config.max_position_embeddings))
    if scaling == "none" or tokens <= trained:
        return dict(original)
    factor = 2.0 if scaling == "dynamic" else tokens / trained
    return {**original, "rope_type": scaling, "factor": factor,
            "original_max_position_embeddings": trained}


def apply(model: Any, scaling: str, tokens: int) -> None:
    """Give ``model`` the RoPE of :func:`parameters` (rebuilding its rotary embedding on change).

    ``ValueError`` for an unknown scaling or a model whose RoPE cannot be re-created this way.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"rope_scaling must be one of {', '.join(SCALINGS)}")
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        if scaling == "none":
            return
        raise ValueError("rope_scaling: this model's RoPE settings are not a single rope_parameters mapping")
    if not hasattr(model, _ORIGINAL):
        setattr(model, _ORIGINAL, (dict(params), int(cfg.max_position_embeddings)))
    want = parameters(model, scaling, tokens)
    if params == want:
        return
    rot = _rotary(model)
    if rot is None:
        raise ValueError("rope_scaling: the model has no rotary embedding to rescale")
    cfg.rope_parameters = want
    fresh = type(rot)(config=cfg)
    model.model.rotary_emb = fresh.to(next(model.parameters()).device)


def current(model: Any) -> str:
    """The RoPE type the model runs with now (``default`` when unscaled)."""
    params = getattr(model.config, "rope_parameters", None) or {}
    return str(params.get("rope_type", "default")) if isinstance(params, dict) else "default"
