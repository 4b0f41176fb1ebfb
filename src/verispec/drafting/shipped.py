"""Draft heads shipped with verispec: ``checkpoints/<model>-<method>/`` (e.g.
``checkpoints/smollm2-135m-eagle3``), trained by ``verispec train`` on this project's machine.

Looked up, first hit wins, in ``$VERISPEC_CHECKPOINTS``, ``./checkpoints`` and the ``checkpoints``
folder of the source checkout verispec runs from. Each folder carries a ``README.md`` model card.
"""
from __future__ import annotations

import os
from pathlib import Path


def model_stem(model_name: str) -> str:
    """``smollm2-135m`` for a known name, the file or folder name (no ``.gguf``) for a path."""
    name = Path(model_name).name
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def checkpoint_roots() -> list[Path]:
    roots = [Path(os.environ["VERISPEC_CHECKPOINTS"])] if os.environ.get("VERISPEC_CHECKPOINTS") else []
    roots += [Path.cwd() / "checkpoints", Path(__file__).resolve().parents[3] / "checkpoints"]
    return list(dict.fromkeys(p.resolve() for p in roots))


def in_checkpoints(path: str | Path) -> Path:
    """``path`` as given when it exists or is absolute, else under the first checkpoint root that
    holds it (e.g. a shipped draft vocabulary named relative to ``checkpoints/``)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return next((root / p for root in checkpoint_roots() if (root / p).exists()), p)


def shipped_folder(model_name: str, kind: str, marker: str) -> Path | None:
    """``<root>/<model>-<kind>`` under the first checkpoint root where it holds the file ``marker``."""
    name = f"{model_stem(model_name)}-{kind}"
    for root in checkpoint_roots():
        if (root / name / marker).exists():
            return root / name
    return None


def shipped_head(model_name: str, method: str) -> Path | None:
    """The shipped head folder for ``model_name`` and ``method`` (``eagle3``, ``medusa``, ...)."""
    return shipped_folder(model_name, method, "config.json")


def with_shipped_head(config, target):
    """``config`` with ``model`` filled in from the shipped head of ``target`` when it is missing;
    a ``SpecConfigError`` naming what to do when none is shipped."""
    from dataclasses import replace

    from .spec_config import SpecConfigError
    if config.model:
        return config
    method = config.method
    path = shipped_head(getattr(target, "name", ""), method)
    if path is None:
        raise SpecConfigError(f"method {method!r} needs 'model': a head checkpoint folder; no {method} head "
                              f"is shipped for {getattr(target, 'name', 'this model')!r} "
                              f"(looked for <root>/{model_stem(getattr(target, 'name', '?'))}-{method} in "
                              f"{', '.join(str(r) for r in checkpoint_roots())}); train one with "
                              f"`verispec train {method}`")
    return replace(config, model=str(path))
