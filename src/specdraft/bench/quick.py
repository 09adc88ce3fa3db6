"""The quick benchmark's method list: every registered method, with settings that work out of
the box, and what those settings need prepared once (cached between runs):

- ``draft``: no smaller model with SmolLM2's tokenizer ships with specdraft, so the quick run
  drafts with the target's own first layers exported as a separate model
  (``runs/drafts/<model>-l<N>``; a stand-in for a real draft such as a distilled one);
- ``rest``: the Python standard-library datastore for the target's tokenizer, built if missing;
- trained heads (``medusa``, ``eagle``, ``mtp``): the heads the package ships for the model (``shipped_heads``);
  a method with none for it is skipped with a note.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specdraft.heads.shipped import shipped_heads
from specdraft.proposers import method_names

if TYPE_CHECKING:
    from specdraft.corpus import CorpusSpec

QUICK_DRAFT_LAYERS = 8  # of SmolLM2-135M's 30: a cheap stand-in (accepted rarely: early layers are untrained exits)
QUICK_DATASTORE_TOKENS = 20_000_000  # as `specdraft datastore build` (the stdlib is ~3.4M tokens)


def quick_methods(model: str | None, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                  corpus: "CorpusSpec | None" = None) -> list[str]:
    """Method specs (as ``--methods`` takes them) for every registered method but plain.
    ``corpus``: what the default datastore indexes when it must be built (the stdlib)."""
    specs = []
    for name in method_names():
        if name == "plain":
            continue
        if name == "draft":
            specs.append(f"draft:path={ensure_truncated_draft(model, QUICK_DRAFT_LAYERS, log)}")
        elif name == "rest":
            ensure_default_datastore(model, log, corpus)
            specs.append("rest")
        elif name in TRAINED:
            path = shipped_heads(name, model)
            if path is None:
                log(f"quick: {name} skipped: no trained heads ship for this model (make them with `specdraft train`)")
                continue
            specs.append(f"{name}:path={path}")
        else:
            specs.append(name)
    return specs


TRAINED = ("medusa", "eagle", "mtp")  # methods that need trained weights


def ensure_truncated_draft(model: str | None, layers: int, log: Callable[[str], None]) -> Path:
    from specdraft.model.export import export_truncated
    from specdraft.model.loader import default_model_path, load

    source = default_model_path() if model is None else Path(model).expanduser()
    folder = Path("runs") / "drafts" / f"{source.stem}-l{layers}"
    if not (folder / "config.json").exists():
        log(f"quick: exporting the target's first {layers} layers as a draft model to {folder}")
        target = load(source)
        export_truncated(target, min(layers, target.config.num_layers - 1), folder)
    return folder


def ensure_default_datastore(model: str | None, log: Callable[[str], None], corpus: "CorpusSpec | None" = None) -> Path:
    from specdraft.corpus import CorpusSpec
    from specdraft.datastore import build_datastore, default_datastore_path, load_tokenizer

    tokenizer, source = load_tokenizer(model)
    path = default_datastore_path(tokenizer)
    if not path.exists():
        log(f"quick: building the standard-library datastore for rest ({path}; once)")
        build_datastore(corpus or CorpusSpec(stdlib=True), tokenizer, path, max_tokens=QUICK_DATASTORE_TOKENS,
                        model=source.name, progress=True)
    return path
