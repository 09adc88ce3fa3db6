"""The retrieval datastore: a tokenized corpus and its suffix array, in one file.

Built once (``specdraft datastore build``) with the target's tokenizer: documents are
tokenized, concatenated with a separator (-1, never a token) and indexed by a suffix array
(:mod:`specdraft.suffix_array`). A lookup finds the longest suffix of the context that occurs
in the corpus and reads the tokens that followed its occurrences.

File layout (little-endian)::

    magic (8 bytes) | format version u32 | header length u32 | CRC-32 u32 | 4 zero bytes
    header: UTF-8 JSON (fingerprint, tokens, documents, description, model, created)
    zero padding to a multiple of 64 | tokens int32 [n] | padding | suffix array int32 [n]

The CRC-32 covers the header and everything after it. Loading refuses, with one line, a
missing file, another kind of file, another format version, a truncated or corrupt file and a
datastore built for another tokenizer (its fingerprint, a hash of the vocabulary and special
ids, differs from the target's). The arrays are memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from tqdm import tqdm

from specdraft.corpus import CorpusSpec, read_text
from specdraft.errors import SpecdraftError
from specdraft.suffix_array import find_range, longest_match, suffix_array

if TYPE_CHECKING:
    from specdraft.model.tokenizer import Tokenizer

MAGIC = b"SDDSTORE"
FORMAT_VERSION = 1
SEPARATOR = -1
SUFFIX = ".sdds"
_PREAMBLE = struct.Struct("<8sIII4x")  # magic, version, header length, CRC-32
_ALIGN = 64
_TOKEN_DTYPE = np.dtype("<i4")
_CHUNK = 1 << 24


class DatastoreError(SpecdraftError):
    """A datastore file is missing, of another format, stale, truncated or corrupt."""


@dataclass(frozen=True, slots=True)
class DatastoreInfo:
    """The header of a datastore file."""

    fingerprint: str  # of the tokenizer it was built with (tokenizer_fingerprint)
    tokens: int  # length of the token array, separators included
    documents: int
    description: str
    model: str = ""  # the model file whose tokenizer was used
    created: str = ""


@dataclass(frozen=True, slots=True)
class Retrieved:
    """The result of a lookup: the matched suffix length (0 = none), how many occurrences have
    a continuation, and the continuations read (at most max_matches)."""

    suffix: int
    occurrences: int
    paths: list[list[int]]


@dataclass(frozen=True, slots=True)
class Datastore:
    tokens: np.ndarray  # [n] int32 token ids, SEPARATOR after every document
    sa: np.ndarray  # [n] int32 suffix array of tokens
    info: DatastoreInfo
    nbytes: int  # file size when loaded from disk (memory-mapped), else the arrays' size

    @classmethod
    def from_documents(cls, documents: Sequence[Sequence[int]], info: DatastoreInfo) -> "Datastore":
        """Index token-id documents (in memory); info.tokens/documents are filled in here."""
        parts = [np.asarray(list(d) + [SEPARATOR], dtype=np.int64) for d in documents]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # [n]
        if tokens.size and (tokens.max() >= 2**31 or tokens.min() < SEPARATOR):
            raise DatastoreError("token ids must be in 0..2^31-1")
        tokens = tokens.astype(_TOKEN_DTYPE)
        sa = suffix_array(tokens).astype(_TOKEN_DTYPE)  # [n]
        info = DatastoreInfo(**{**asdict(info), "tokens": int(tokens.size), "documents": len(parts)})
        return cls(tokens, sa, info, tokens.nbytes + sa.nbytes)

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Start positions of every occurrence of ``pattern`` [m]: [count] int32, in suffix order."""
        lo, hi = find_range(self.tokens, self.sa, pattern)
        return self.sa[lo:hi]

    def continuations(
        self, context: Sequence[int], depth: int, *, min_suffix: int, max_suffix: int, max_matches: int
    ) -> Retrieved:
        """What followed the longest suffix of ``context`` (min_suffix..max_suffix tokens) in the
        corpus: up to ``depth`` tokens after each of at most ``max_matches`` occurrences, spread
        evenly over all of them (the suffix array groups equal continuations, so an even spread
        keeps their proportions). A continuation stops at the end of its document; occurrences
        at a document's end (first among them: the separator is the smallest id) are skipped."""
        m, lo, hi = longest_match(self.tokens, self.sa, context[-max_suffix:], min_suffix, max_suffix)
        if m == 0 or depth <= 0:
            return Retrieved(0, 0, [])
        lo = find_range(self.tokens, self.sa, [*context[len(context) - m :], SEPARATOR], lo, hi)[1]
        if lo >= hi:
            return Retrieved(m, 0, [])
        picks = np.unique(np.linspace(lo, hi - 1, num=min(max_matches, hi - lo)).round().astype(np.int64))  # [M]
        return Retrieved(m, hi - lo, self._following(self.sa[picks].astype(np.int64) + m, depth))

    def _following(self, starts: np.ndarray, depth: int) -> list[list[int]]:
        """Up to ``depth`` tokens from each start [M], each cut at its document's end."""
        n = self.tokens.shape[0]
        idx = starts[:, None] + np.arange(depth)  # [M, depth]
        window = np.where(idx < n, self.tokens[np.minimum(idx, n - 1)], SEPARATOR)  # [M, depth]
        rows = [row[: row.index(SEPARATOR)] if SEPARATOR in row else row for row in window.tolist()]
        return [row for row in rows if row]


# --------------------------------------------------------------------------- tokenizer identity


def tokenizer_fingerprint(tokenizer: "Tokenizer") -> str:
    """A hash of the vocabulary (token strings by id) and the special ids: equal fingerprints
    mean token ids mean the same thing."""
    identity = {
        "tokens": tokenizer.token_strings(),
        "special": [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id, sorted(tokenizer.eos_ids)],
    }
    return hashlib.sha256(json.dumps(identity, ensure_ascii=True).encode()).hexdigest()


def load_tokenizer(model: str | Path | None) -> tuple["Tokenizer", Path]:
    """The tokenizer of a model (a .gguf file or a Hugging Face folder; None = the default
    model) without loading its weights, and the model's path."""
    from specdraft.model.loader import default_model_path
    from specdraft.model.tokenizer import Tokenizer

    source = default_model_path() if model is None else Path(model).expanduser()
    if source.is_dir():
        return Tokenizer.from_hf_folder(source), source
    from specdraft.model.load_gguf import open_gguf

    return Tokenizer.from_gguf(open_gguf(source)), source


def datastore_dir() -> Path:
    """Where datastores live by default: $SPECDRAFT_DATASTORES or ~/.cache/specdraft/datastores."""
    env = os.environ.get("SPECDRAFT_DATASTORES")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdraft" / "datastores"


def default_datastore_path(tokenizer: "Tokenizer", name: str = "stdlib") -> Path:
    return datastore_dir() / f"{name}-{tokenizer_fingerprint(tokenizer)[:12]}{SUFFIX}"


# --------------------------------------------------------------------------- building


@dataclass(frozen=True, slots=True)
class Built:
    store: Datastore
    path: Path
    files: int  # files read
    skipped: int  # files that were not UTF-8 text, or empty
    seconds: float


def build_datastore(
    spec: CorpusSpec, tokenizer: "Tokenizer", out: str | Path, *, max_tokens: int, model: str = "",
    progress: bool = False,
) -> Built:
    """Tokenize the corpus of ``spec`` with ``tokenizer`` (at most ``max_tokens`` tokens,
    separators included: later files are cut), index it and save it to ``out``."""
    if not 1 <= max_tokens < 2**31:
        raise DatastoreError(f"--max-tokens must be in 1..{2**31 - 1}, got {max_tokens}")
    start = time.perf_counter()
    files = spec.files()
    documents, skipped = _tokenize(files, tokenizer, max_tokens, progress)
    if not documents:
        raise DatastoreError("the corpus has no text to index")
    info = DatastoreInfo(tokenizer_fingerprint(tokenizer), 0, 0, spec.description(), model,
                         datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if progress:
        print(f"indexing {sum(len(d) + 1 for d in documents):,} tokens...", file=sys.stderr, flush=True)
    store = Datastore.from_documents(documents, info)
    path = save(store, out)
    return Built(store, path, len(documents), skipped, time.perf_counter() - start)


def _tokenize(files: Sequence[Path], tokenizer: "Tokenizer", max_tokens: int, progress: bool) -> tuple[list[list[int]], int]:
    """Token ids of each readable file, cut so that ids + one separator each fit max_tokens."""
    documents: list[list[int]] = []
    room, skipped = max_tokens, 0
    bar = tqdm(files, desc="tokenizing", unit="file", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for path in bar:
        text = read_text(path)
        ids = tokenizer.encode(text, add_bos=False, add_eos=False, parse_special=False) if text else []
        if not ids:
            skipped += 1
            continue
        documents.append(ids[: room - 1])
        room -= len(documents[-1]) + 1
        bar.set_postfix(tokens=f"{max_tokens - room:,}", refresh=False)
        if room < 2:
            break
    bar.close()
    return documents, skipped


# --------------------------------------------------------------------------- the file


def save(store: Datastore, path: str | Path) -> Path:
    """Write ``store`` to ``path`` (atomically: a temporary file, then a rename)."""
    path = Path(path).expanduser()
    try:
        _write(store, path)
    except OSError as e:
        raise DatastoreError(f"cannot write the datastore to {path}: {e.strerror or e}") from None
    return path


def _write(store: Datastore, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps(asdict(store.info), ensure_ascii=True).encode()
    tokens_at = _aligned(_PREAMBLE.size + len(header))
    sa_at = _aligned(tokens_at + store.tokens.nbytes)
    body = [b"\0" * (tokens_at - _PREAMBLE.size - len(header)), _le_bytes(store.tokens),
            b"\0" * (sa_at - tokens_at - store.tokens.nbytes), _le_bytes(store.sa)]
    crc = zlib.crc32(header)
    for part in body:
        crc = zlib.crc32(part, crc)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header), crc))
        f.write(header)
        for part in body:
            f.write(part)
    os.replace(tmp, path)


def load(path: str | Path, tokenizer: "Tokenizer | None" = None) -> Datastore:
    """Open a datastore file, checking it whole; with ``tokenizer``, also that it was built for
    that tokenizer. Raises DatastoreError (one line) on any problem."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatastoreError(f"datastore not found: {path}")
    try:
        info, tokens_at, sa_at, size = _check(path)
        tokens, sa = _mapped(path, tokens_at, info.tokens), _mapped(path, sa_at, info.tokens)
    except OSError as e:
        raise DatastoreError(f"cannot read {path}: {e.strerror or e}") from None
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != info.fingerprint:
        raise DatastoreError(
            f"{path} is stale: built for another tokenizer (fingerprint {info.fingerprint[:12]}, the model's is "
            f"{tokenizer_fingerprint(tokenizer)[:12]}); rebuild it with `specdraft datastore build --model ...`"
        )
    return Datastore(tokens, sa, info, size)


def _check(path: Path) -> tuple[DatastoreInfo, int, int, int]:
    """The header, where the two arrays start and the file size, once the whole file checks out."""
    size = path.stat().st_size
    with path.open("rb") as f:
        info, header_len, crc = _read_header(f, path, size)
        tokens_at = _aligned(_PREAMBLE.size + header_len)
        sa_at = _aligned(tokens_at + 4 * info.tokens)
        expected = sa_at + 4 * info.tokens
        if size != expected:
            raise DatastoreError(f"{path} is truncated or damaged: {size} bytes, its header says {expected}; rebuild it")
        if _crc_from(f, _PREAMBLE.size) != crc:
            raise DatastoreError(f"{path} is corrupt (checksum mismatch); rebuild it with `specdraft datastore build`")
    return info, tokens_at, sa_at, size


def _read_header(f: BinaryIO, path: Path, size: int) -> tuple[DatastoreInfo, int, int]:
    raw = f.read(_PREAMBLE.size)
    if raw[: len(MAGIC)] != MAGIC:
        raise DatastoreError(f"{path} is not a specdraft datastore (bad magic bytes)")
    if len(raw) < _PREAMBLE.size:
        raise DatastoreError(f"{path} is truncated ({size} bytes); rebuild it")
    _, version, header_len, crc = _PREAMBLE.unpack(raw)
    if version != FORMAT_VERSION:
        age = "an older" if version < FORMAT_VERSION else "a newer"
        raise DatastoreError(f"{path} is in {age} datastore format (version {version}; this specdraft reads "
                             f"version {FORMAT_VERSION}); rebuild it with `specdraft datastore build`")
    if _PREAMBLE.size + header_len > size:
        raise DatastoreError(f"{path} is truncated or damaged: its header runs past the end; rebuild it")
    header = f.read(header_len)
    try:
        fields = json.loads(header.decode())
        info = DatastoreInfo(**fields)
        if not isinstance(info.tokens, int) or info.tokens < 0:
            raise ValueError(info.tokens)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise DatastoreError(f"{path} is corrupt (unreadable header); rebuild it") from None
    return info, header_len, crc


def _crc_from(f: BinaryIO, start: int) -> int:
    """CRC-32 of the file from ``start`` to its end."""
    f.seek(start)
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
    return crc


def _mapped(path: Path, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=_TOKEN_DTYPE)
    return np.asarray(np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", offset=offset, shape=(count,)))  # [count]


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _le_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=_TOKEN_DTYPE).tobytes()
