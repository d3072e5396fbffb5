"""Method variants on the command line: ``ice[carry_pages=8,answer_spans=3]`` is ``ice`` with
those profile keys changed for its own rows (``bench decode --methods``, ``eval --methods``), so
two settings are compared in one run, on the same cases and the same machine."""

from __future__ import annotations

from .errors import UsageError

# Keys one run shares between its methods: the loaded model (its weights, dtype, device, threads
# and RoPE scaling) and, in ``eval``, the full prefill a case's methods start from.
RUN_KEYS = ("device", "dtype", "weights", "rope_scaling", "cpu_threads", "chunk_size", "chat_template")


def split_methods(text: str, flag: str = "--methods") -> list[str]:
    """``text`` split at the commas outside brackets: 'full,ice[a=1,b=2]' -> two."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise UsageError(f"{flag}: unbalanced brackets in '{text}'")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if depth:
        raise UsageError(f"{flag}: unbalanced brackets in '{text}'")
    out.append(cur.strip())
    return [m for m in out if m]


def base_method(label: str) -> str:
    """The method a variant's label names: 'ice[carry_pages=8]' -> 'ice'."""
    return label.partition("[")[0].strip()


def parse_variant(text: str, settings, flag: str = "--methods", fixed: tuple[str, ...] = ()):
    """'ice' or 'ice[key=value,...]' -> (label, method, settings with the profile keys changed;
    values read as YAML, checked as a profile's). ``fixed``: keys a variant may not change."""
    import yaml

    from .config import ProfileError, apply

    if "[" not in text:
        return text, text, settings
    method, _, rest = text.partition("[")
    if not rest.endswith("]"):
        raise UsageError(f"{flag}: '{text}' must end with ']'")
    values = {}
    for item in rest[:-1].split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"{flag}: '{item}' in '{text}' is not key=value")
        if key.strip() in fixed:
            raise UsageError(f"{flag}: '{text}': {key.strip()} is the same for every method of a run; "
                             "set it with the profile or its own option")
        values[key.strip()] = yaml.safe_load(value.strip())
    try:
        changed = apply(settings, values, f"{flag} {text}")
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    return text, method.strip(), changed


def parse_methods(text: str, settings, fixed: tuple[str, ...] = RUN_KEYS, flag: str = "--methods"):
    """Every method of ``--methods``, parsed as ``parse_variant`` does: [(label, method, settings)].
    A label named twice is refused (its rows could not be told apart), as is a key in ``fixed``."""
    from .methods import check_method

    out = []
    for part in split_methods(text, flag):
        label, method, changed = parse_variant(part, settings, flag, fixed)
        check_method(method)
        if any(label == seen for seen, _m, _s in out):
            raise UsageError(f"{flag}: '{label}' is named twice")
        out.append((label, method, changed))
    return out
