"""Which files a datastore indexes: the Python standard library's source, or a user's corpus
(files and folders, with an optional glob for folders)."""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

# folders of the standard library that are not library code
_STDLIB_SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class CorpusSpec:
    """stdlib: the .py files of this Python's standard library (tests and site-packages
    skipped). paths: files or folders; glob: which files of a folder (default: all, hidden
    ones skipped; files that are not UTF-8 text are skipped when read)."""

    stdlib: bool = False
    paths: tuple[str, ...] = ()
    glob: str | None = None

    def __post_init__(self) -> None:
        if not self.stdlib and not self.paths:
            raise SpecdraftError("nothing to index: give --stdlib and/or --corpus PATH")

    def description(self) -> str:
        parts = [f"Python {sys.version.split()[0]} standard library"] if self.stdlib else []
        parts += [f"{p} ({self.glob})" if self.glob and Path(p).is_dir() else p for p in self.paths]
        return " + ".join(parts)

    def files(self) -> list[Path]:
        """Every file to index, each folder's files in sorted order."""
        out = stdlib_files() if self.stdlib else []
        for p in self.paths:
            out += corpus_files(Path(p).expanduser(), self.glob)
        return out


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in _walk(root, "**/*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]))


def corpus_files(path: Path, glob: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SpecdraftError(f"corpus path not found: {path}")
    files = sorted(_walk(path, glob or "**/*"))
    if not files:
        raise SpecdraftError(f"no files in {path}" + (f" match {glob!r}" if glob else ""))
    return files


def _walk(root: Path, glob: str) -> Iterator[Path]:
    for p in root.glob(glob):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts):
            yield p


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 text (or cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\0" in text else text
