"""Trained heads that ship inside the package, per model: ``specdraft/weights/<model file
stem>/<method>/`` (``config.json`` + ``model.safetensors``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_heads(method: str, model: str | Path | None) -> Path | None:
    """The package's trained heads of ``method`` for ``model`` (a path; None: the default
    model), or None when none ship."""
    from specdraft.model.loader import default_model_path

    if model is None or str(model) == "":
        try:
            source = default_model_path()
        except Exception:  # noqa: BLE001  (no default model installed: nothing ships for it)
            return None
    else:
        source = Path(model).expanduser()
    folder = resources.files("specdraft") / "weights" / source.stem / method
    return Path(str(folder)) if folder.is_dir() and (folder / "config.json").is_file() else None
