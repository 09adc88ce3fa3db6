"""Tokenizers for GGUF files and Hugging Face model folders, chat templates and streaming.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Hugging Face Rust library). It is
built either from a folder's ``tokenizer.json`` or from the vocabulary a GGUF file stores
in its metadata, following what llama.cpp does with that metadata:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. ``tokenizer.ggml.pre`` names the
  regular expressions that split text before the merges run (see ``_PRE_TOKENIZERS``).
* ``tokenizer.ggml.model == "llama"``: sentencepiece BPE (Llama 1/2, Mistral v0.x,
  Mixtral, Phi-3...). The merge order is the token scores, as in llama.cpp's SPM tokenizer,
  with a ``▁`` prefix before each run of text and byte fallback.

Control (type 3), unknown (type 2) and user-defined (type 4) tokens are added tokens that
are matched whole in text; only control and unknown ones are "special" (skipped by
``decode(skip_special=True)`` and not parsed with ``parse_special=False``).

:class:`IncrementalDetokenizer` turns a stream of token ids into text without ever
emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

import tokenizers
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from specdraft.errors import ModelFileError, SpecdraftError, UnsupportedModelError

if TYPE_CHECKING:
    import gguf

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer regular expressions (as in the models' own tokenizer.json files) -------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (regexes applied one after the other, each splitting the previous pieces;
#          ignore_merges: a piece that is itself a token is kept whole, as llama.cpp does)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    # "default" (and a missing name) mean "unknown"; like transformers we use GPT-2's split.
    **dict.fromkeys(
        ("default", "gpt-2", "gpt2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"), ((_GPT2,), False)
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        ((r"\p{N}", _GPT2), False),
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), ((_LLAMA3,), True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ((_LLAMA3,), False)),
    **dict.fromkeys(("qwen2", "stablelm2", "megrez", "deepseek-r1-qwen"), ((_QWEN2,), False)),
    "tekken": ((_TEKKEN,), True),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False),
    "deepseek-v3": ((r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3), False),
}

#: The ``tokenizer.ggml.pre`` names a byte-level GGUF vocabulary may use.
SUPPORTED_PRE_TOKENIZERS = frozenset(_PRE_TOKENIZERS)

# Tokens that end a turn in common chat formats; they count as end-of-sequence when the
# chat template writes them.
_END_OF_TURN = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<|return|>", "<EOT>", "</s>",
)

# Tokens llama.cpp always treats as control tokens (its end-of-turn/end-of-message list).
_LLAMA_CPP_CONTROL = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<｜end▁of▁sentence｜>",
     "<|eom_id|>")
)

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPACE = "\u2581"  # sentencepiece's "▁"


# --- small helpers -----------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _one_line(text: object) -> str:
    """Collapse a message onto one line."""
    return " ".join(str(text).split())


def _first_ids(vocab: Sequence[str]) -> dict[str, int]:
    """Token string -> id, keeping the first id of a string that appears twice."""
    ids: dict[str, int] = {}
    for index, token in enumerate(vocab):
        ids.setdefault(token, index)
    return ids


def _optional_id(value: Any, vocab_size: int) -> int | None:
    """A token id from metadata, or None when absent or out of range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        return None
    return value


# --- building a tokenizer from GGUF metadata --------------------------------------------


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The tokenizer keys of a ``gguf.GGUFReader`` (and the architecture) as Python values."""
    wanted = {key: field for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    if "general.architecture" in reader.fields:
        wanted["general.architecture"] = reader.fields["general.architecture"]
    return {key: field.contents() for key, field in wanted.items()}


def _gguf_tokens(meta: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    """The token strings and types, fixed up as llama.cpp does when it loads them: an empty
    token becomes ``[EMPTY_<id>]`` and end-of-turn tokens (``<|im_end|>``...) that the file
    left normal become control tokens."""
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokenizer.ggml.tokens"])]
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFileError(f"the GGUF file has {len(tokens)} tokens but {len(types)} token types")
    for i, token in enumerate(tokens):
        if token in _LLAMA_CPP_CONTROL and types[i] == _NORMAL:
            types[i] = _CONTROL
    return tokens, types


def _byte_level_vocab(tokens: Sequence[str], types: Sequence[int]) -> list[str]:
    """GGUF tokens spelled for a byte-level BPE model.

    Normal tokens are already in the byte alphabet; a normal token with other characters is
    respelled byte by byte (unless that spelling is taken). Added tokens stay as written:
    llama.cpp stores them as plain text and they are matched in the text before BPE runs.
    """
    table = _byte_alphabet()
    alphabet = set(table.values())
    taken = set(tokens)
    vocab = list(tokens)
    for index, token in enumerate(tokens):
        if types[index] in (_CONTROL, _USER_DEFINED, _UNKNOWN) or set(token) <= alphabet:
            continue
        respelled = "".join(table[b] for b in token.encode("utf-8"))
        if respelled not in taken:
            vocab[index] = respelled
            taken.add(respelled)
    return vocab


def _split_merge(merge: str, vocab: Mapping[str, int]) -> tuple[str, str] | None:
    """A GGUF merge "left right" as a pair, or None if it cannot be read."""
    if merge.count(" ") == 1:
        left, right = merge.split(" ")
        return left, right
    for i, char in enumerate(merge):
        if char == " " and 0 < i < len(merge) - 1 and merge[:i] in vocab and merge[i + 1 :] in vocab:
            return merge[:i], merge[i + 1 :]
    return None


def _byte_level_backend(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """A byte-level BPE tokenizer ("gpt2" GGUF model) with the named pre-tokenizer."""
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    if pre_name not in _PRE_TOKENIZERS:
        names = ", ".join(sorted(SUPPORTED_PRE_TOKENIZERS))
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre_name!r} is not supported (supported: {names})")
    if "tokenizer.ggml.merges" not in meta:
        raise ModelFileError("the GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    regexes, ignore_merges = _PRE_TOKENIZERS[pre_name]
    vocab = _byte_level_vocab(tokens, types)
    ids = _first_ids(vocab)
    merges = [pair for m in meta["tokenizer.ggml.merges"] if (pair := _split_merge(m, ids)) is not None]
    backend = tokenizers.Tokenizer(models.BPE(ids, merges, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _score_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce sentencepiece/llama.cpp score-ordered merging.

    llama.cpp repeatedly joins the adjacent pair whose concatenation is the token with the
    highest score. Listing every split ``(a, b)`` of each normal token (both halves being
    tokens), best score first, gives a BPE model that makes the same choices.
    """
    ids = _first_ids(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if types[index] != _NORMAL or len(token) < 2 or ids[token] != index:
            continue
        score = float(scores[index])
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[tokenizers.Tokenizer, list[str]]:
    """A sentencepiece-style BPE tokenizer ("llama" GGUF model), as llama.cpp runs it."""
    arch = meta.get("general.architecture", "")
    if arch.startswith("gemma"):
        raise UnsupportedModelError(
            f"the sentencepiece vocabulary of a {arch!r} GGUF is not supported; use the model's HF folder"
        )
    if "tokenizer.ggml.scores" not in meta:
        raise ModelFileError("the GGUF sentencepiece tokenizer has no tokenizer.ggml.scores")
    vocab = list(tokens)
    ids = _first_ids(vocab)
    merges = _score_merges(vocab, meta["tokenizer.ggml.scores"], types)
    unk_id = _optional_id(meta.get("tokenizer.ggml.unknown_token_id", 0), len(vocab))
    unk = vocab[unk_id] if unk_id is not None else None
    backend = tokenizers.Tokenizer(models.BPE(ids, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    chain = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*chain, decoders.Strip(" ", 1, 0)] if prefix else chain)
    return backend, vocab


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, vocab: Sequence[str], types: Sequence[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as plain added tokens."""
    special = [t for t, kind in zip(vocab, types) if kind in (_CONTROL, _UNKNOWN)]
    plain = [t for t, kind in zip(vocab, types) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


# --- building a tokenizer from a Hugging Face folder --------------------------------------


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"cannot read {path}: {_one_line(exc)}") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an {"content": ...} dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    """generation_config.json's eos_token_id: an int, a list of ints, or missing."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _folder_template(folder: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json, else chat_template.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _adds_by_default(backend: tokenizers.Tokenizer, token_id: int | None, *, first: bool) -> bool:
    """Whether the folder's post-processor puts ``token_id`` first (or last) in an encoding."""
    if token_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    if len(with_special) <= len(plain):
        return False
    return (with_special[0] if first else with_special[-1]) == token_id


# --- chat templates -----------------------------------------------------------------------


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (used to mark assistant text for
    training masks) and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    """Called by templates to reject a conversation."""
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """The current local time, formatted (some templates print today's date)."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without HTML escaping, as chat templates expect."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed Jinja environment set up like Hugging Face's chat template renderer."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _check_messages(messages: Any) -> None:
    """Reject anything but a list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, (list, tuple)):
        kind = type(messages).__name__
        raise SpecdraftError(f"chat messages must be a list of {{'role', 'content'}} dicts, got {kind}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            kind = type(message).__name__
            raise SpecdraftError(f"chat message {i} must be a dict with 'role' and 'content', got {kind}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise SpecdraftError(f"chat message {i} needs a string {key!r}")


# --- the tokenizer ------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Attributes: ``vocab_size`` (number of ids, added tokens included), ``bos_id``,
    ``eos_id`` (the model's own end-of-sequence id), ``eos_ids`` (every id that ends
    generation), ``pad_id``, ``unk_id``, ``add_bos``/``add_eos`` (what ``encode`` adds by
    default) and ``chat_template`` (None when the model has none).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        tokens: Sequence[str] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        extra_eos_ids: Iterable[int] = (),
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._tokens = list(tokens) if tokens is not None else self._backend_tokens(backend)
        self.vocab_size = len(self._tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.add_eos = bool(add_eos and eos_id is not None)
        self.chat_template = chat_template
        ends = {eos_id, *extra_eos_ids, *self._template_end_ids()}
        self.eos_ids: frozenset[int] = frozenset(i for i in ends if i is not None and 0 <= i < self.vocab_size)

    @staticmethod
    def _backend_tokens(backend: tokenizers.Tokenizer) -> list[str]:
        """id -> token string for every id up to the largest (gaps become "")."""
        vocab = backend.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values(), default=-1) + 1)
        for token, index in vocab.items():
            tokens[index] = token
        return tokens

    def _template_end_ids(self) -> list[int]:
        """End-of-turn tokens (e.g. ``<|im_end|>``) that the chat template writes."""
        template = self.chat_template or _CHATML_TEMPLATE
        special = self._special_ids
        return [i for t in _END_OF_TURN if t in template and (i := self._backend.token_to_id(t)) in special]

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special."""
        added = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    # -- constructors --

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (``reader`` is a ``gguf.GGUFReader``)."""
        return cls.from_gguf_metadata(_metadata(reader))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata given as ``{"tokenizer.ggml.tokens": [...], ...}``."""
        model = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelFileError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        tokens, types = _gguf_tokens(meta)
        if model == "gpt2":
            backend, vocab = _byte_level_backend(meta, tokens, types)
        elif model == "llama":
            backend, vocab = _sentencepiece_backend(meta, tokens, types)
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece)"
            )
        _add_gguf_added_tokens(backend, vocab, types)
        return cls(backend, tokens=vocab, **cls._gguf_specials(meta, len(vocab)))

    @staticmethod
    def _gguf_specials(meta: Mapping[str, Any], size: int) -> dict[str, Any]:
        """Special ids and flags from GGUF metadata, with llama.cpp's defaults."""
        key = "tokenizer.ggml."
        sentencepiece = meta.get(key + "model") == "llama"
        default_bos = sentencepiece or meta.get(key + "pre") in ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken")
        extra = [meta.get(key + "eot_token_id"), meta.get(key + "eom_token_id")]
        return {
            "bos_id": _optional_id(meta.get(key + "bos_token_id", 1 if sentencepiece else None), size),
            "eos_id": _optional_id(meta.get(key + "eos_token_id", 2 if sentencepiece else None), size),
            "extra_eos_ids": [i for i in extra if _optional_id(i, size) is not None],
            "pad_id": _optional_id(meta.get(key + "padding_token_id"), size),
            "unk_id": _optional_id(meta.get(key + "unknown_token_id", 0 if sentencepiece else None), size),
            "add_bos": bool(meta.get(key + "add_bos_token", default_bos)),
            "add_eos": bool(meta.get(key + "add_eos_token", False)),
            "chat_template": meta.get("tokenizer.chat_template"),
        }

    @classmethod
    def from_hf_folder(cls, folder: pathlib.Path) -> Tokenizer:
        """Build from a Hugging Face model folder: ``tokenizer.json`` (required), plus
        ``tokenizer_config.json``, ``generation_config.json`` and ``chat_template.jinja``
        when present."""
        folder = pathlib.Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFileError(f"no tokenizer.json in {folder}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exception subclasses
            raise ModelFileError(f"cannot read {path}: {_one_line(exc)}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        return cls(backend, **cls._folder_specials(backend, config, generation, _folder_template(folder, config)))

    @staticmethod
    def _folder_specials(
        backend: tokenizers.Tokenizer, config: Mapping[str, Any], generation: Mapping[str, Any], template: str | None
    ) -> dict[str, Any]:
        """Special ids and flags from tokenizer_config.json and generation_config.json."""

        def lookup(name: str, generation_key: str) -> int | None:
            content = _token_content(config.get(name))
            found = backend.token_to_id(content) if content is not None else None
            fallback = _as_id_list(generation.get(generation_key))
            return found if found is not None else (fallback[0] if fallback else None)

        bos_id, eos_id = lookup("bos_token", "bos_token_id"), lookup("eos_token", "eos_token_id")
        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        return {
            "bos_id": bos_id,
            "eos_id": eos_id,
            "extra_eos_ids": _as_id_list(generation.get("eos_token_id")),
            "pad_id": lookup("pad_token", "pad_token_id"),
            "unk_id": lookup("unk_token", "unk_token_id"),
            "add_bos": add_bos if isinstance(add_bos, bool) else _adds_by_default(backend, bos_id, first=True),
            "add_eos": add_eos if isinstance(add_eos, bool) else _adds_by_default(backend, eos_id, first=False),
            "chat_template": template,
        }

    # -- encoding and decoding --

    @cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy that reads special tokens in text as plain text (``parse_special=False``)."""
        copy = tokenizers.Tokenizer.from_str(self._backend.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode(
        self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for ``text``. ``add_bos``/``add_eos`` None = the model's default.

        With ``parse_special`` special tokens written in the text (``<|im_start|>``) become
        their single id; without it they are tokenized as ordinary text.
        """
        backend = self._backend if parse_special else self._literal_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8 shows as U+FFFD)."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise SpecdraftError(f"token id out of range 0..{self.vocab_size - 1} in decode")
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def token_strings(self) -> list[str]:
        """The vocabulary as stored (byte-level tokens in their byte alphabet); index = id."""
        return list(self._tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for writing a Hugging Face model folder)."""
        return self._backend.to_str()

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """True when ``other`` has the same tokens at the same ids and the same BOS/EOS ids."""
        return (
            self._tokens == other._tokens
            and (self.bos_id, self.eos_id) == (other.bos_id, other.eos_id)
            and self._special_ids == other._special_ids
        )

    # -- chat --

    @cached_property
    def _compiled_template(self) -> Any:
        """The chat template compiled once (the ChatML fallback when the model has none)."""
        try:
            return _chat_environment().from_string(self.chat_template or _CHATML_TEMPLATE)
        except TemplateError as exc:
            raise SpecdraftError(f"the model's chat template does not compile: {_one_line(exc)}") from exc

    def _token_text(self, token_id: int | None) -> str:
        """The text of one special token, or "" when there is none."""
        return self.decode([token_id]) if token_id is not None else ""

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's Jinja chat template.

        Rendering follows Hugging Face (sandboxed, ``trim_blocks``/``lstrip_blocks``,
        ``raise_exception``, ``strftime_now``, ``bos_token``/``eos_token``...). A model
        without a template gets a plain ChatML fallback
        (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then
        ``<|im_start|>assistant\\n``). Bad messages or a template error raise SpecdraftError.
        """
        _check_messages(messages)
        template = self._compiled_template
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_id),
                pad_token=self._token_text(self.pad_id),
                unk_token=self._token_text(self.unk_id),
            )
        except TemplateError as exc:
            raise SpecdraftError(f"chat template error: {_one_line(exc)}") from exc

    def encode_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` and encode them; BOS is added (if the model wants it) only
        when the rendered text does not already start with it."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                          add_bos=False, add_eos=False)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)})"


# --- streaming ----------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Decode generated tokens a few at a time, as text becomes final.

    ``push`` returns only text that is complete: when the decoded text ends in U+FFFD (a
    character whose bytes are split across tokens) it is held back until more tokens
    arrive; ``flush`` returns what is left. Without a prompt, the concatenation of all
    pushes and the flush equals ``tokenizer.decode(all pushed ids)`` (with one exception:
    invalid byte sequences under sentencepiece byte fallback may show a different number
    of U+FFFD). With a prompt it equals the text the generated ids add after the prompt.

    Each push decodes a short window: the tokens of the previous emission (for context,
    e.g. sentencepiece's leading space) plus the new ones, so the cost is O(new tokens).
    ``prompt`` (its last few ids are used) gives the first generated token that context,
    so a sentencepiece ``▁word`` streams as `` word`` after a prompt.
    """

    _CONTEXT = 8  # prompt ids kept as context
    _MAX_CONTEXT = 32  # how far back to look for a character boundary in the prompt

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = (), *, skip_special: bool = False) -> None:
        self._decode: Callable[[Sequence[int]], str] = lambda ids: tokenizer.decode(ids, skip_special=skip_special)
        self._ids: list[int] = self._prompt_tail(prompt)
        self._read = len(self._ids)  # ids[:read] are already emitted (or were prompt)

    def _prompt_tail(self, prompt: Sequence[int]) -> list[int]:
        """The last few prompt ids, starting where a character starts (not mid-way through
        one spelled in several byte tokens)."""
        prompt = [int(i) for i in prompt[-self._MAX_CONTEXT :]]
        start = max(0, len(prompt) - self._CONTEXT)
        while start > 0 and self._decode(prompt[start:]).startswith("\ufffd"):
            start -= 1
        return prompt[start:]

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the newly finished text ("" if none yet)."""
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return any text still held back (it may end in U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        """Decode the window; emit what is new and, if emitted, slide the window forward."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        del self._ids[: self._read]
        self._read = len(self._ids)
        return after[len(before) :]
