"""Retrieval-based speculation (REST): the suffix array against brute force, lookups and the
frequency tree, the datastore file (round trip and every way it can be refused, also through
the CLI), greedy equivalence and the lossless property through the engine, and building a
datastore from the command line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.cli import main
from specdraft.datastore import (
    FORMAT_VERSION, MAGIC, Datastore, DatastoreError, DatastoreInfo, default_datastore_path, load, save,
    tokenizer_fingerprint,
)
from specdraft.draft import Draft
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load as load_model
from specdraft.model.tokenizer import Tokenizer
from specdraft.policy import CostModel, Policy, PolicyConfig
from specdraft.proposers import make_proposer
from specdraft.proposers.base import ProposerContext
from specdraft.proposers.retrieval import RestConfig, RestProposer, frequency_tree
from specdraft.sequence import GenerationConfig, Sequence
from specdraft.suffix_array import longest_match, suffix_array
from test_accept import ENGINE_ROWS, _engine_lossless_check, check_siblings_lossless, sampled_setup, sibling_setup  # noqa: F401  (fixtures)

INFO = DatastoreInfo(fingerprint="f" * 64, tokens=0, documents=0, description="test")

# =========================================================================== suffix array

token_arrays = st.lists(st.integers(-1, 3), max_size=80).map(lambda xs: np.array(xs, dtype=np.int32))


@settings(max_examples=150, deadline=None)
@given(tokens=token_arrays, pattern=st.lists(st.integers(-1, 3), min_size=1, max_size=5))
def test_suffix_array_finds_every_occurrence_and_nothing_else(tokens: np.ndarray, pattern: list[int]) -> None:
    sa = suffix_array(tokens)
    n, m = len(tokens), len(pattern)
    assert sa.tolist() == sorted(range(n), key=lambda i: tokens[i:].tolist())
    store = Datastore(tokens, sa, INFO, 0)
    expected = {i for i in range(n - m + 1) if tokens[i : i + m].tolist() == pattern}
    assert set(store.occurrences(pattern).tolist()) == expected


@settings(max_examples=100, deadline=None)
@given(tokens=token_arrays, context=st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_longest_match_is_the_longest_suffix_that_occurs(tokens: np.ndarray, context: list[int]) -> None:
    text = tokens.tolist()
    occurs = [m for m in range(1, 9) if m <= len(context) and any(
        text[i : i + m] == context[-m:] for i in range(len(text) - m + 1))]
    m, lo, hi = longest_match(tokens, suffix_array(tokens), context, 1, 8)
    assert m == max(occurs, default=0)
    assert (hi - lo) == (sum(text[i : i + m] == context[-m:] for i in range(len(text) - m + 1)) if m else 0)


# =========================================================================== lookups and the tree


def corpus() -> Datastore:
    docs = [[1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 6], [9, 1, 2, 3, 4, 5, 8], [1, 2, 3, 7], [5, 5, 1, 2, 3]]
    return Datastore.from_documents(docs, INFO)


def test_continuations_follow_the_longest_suffix_and_stop_at_document_ends() -> None:
    store = corpus()
    found = store.continuations([0, 2, 3], 4, min_suffix=2, max_suffix=16, max_matches=64)
    assert sorted(found.paths) == [[4, 5, 8], [4, 5, 8], [4, 6], [7]]  # "2 3" ends doc 5: no continuation
    assert (found.suffix, found.occurrences) == (2, 4)
    longer = store.continuations([9, 1, 2, 3], 4, min_suffix=2, max_suffix=16, max_matches=64)
    assert (longer.suffix, longer.paths) == (4, [[4, 5, 8]])  # "9 1 2 3" occurs once
    assert store.continuations([0, 3], 4, min_suffix=3, max_suffix=16, max_matches=64).paths == []
    assert len(store.continuations([2, 3], 4, min_suffix=2, max_suffix=16, max_matches=2).paths) == 2


def test_frequency_tree_puts_the_most_frequent_continuation_first() -> None:
    paths = corpus().continuations([0, 2, 3], 4, min_suffix=2, max_suffix=16, max_matches=64).paths
    draft = frequency_tree(paths, budget=4)
    assert draft.tokens == (4, 5, 8, 7) and draft.parents == (-1, 0, 1, -1)  # 7 ties 6 but is shallower
    small = frequency_tree(paths, budget=2)
    assert small.tokens == (4, 5) and small.parents == (-1, 0)
    assert frequency_tree([[7], [4, 5], [4, 6]], budget=3).tokens == (4, 7, 5)  # ties: shallow, then first seen
    assert len(frequency_tree([], budget=4)) == 0


@settings(max_examples=100, deadline=None)
@given(paths=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12), budget=st.integers(0, 10))
def test_frequency_tree_respects_the_budget_and_keeps_parents_first(paths: list[list[int]], budget: int) -> None:
    draft = frequency_tree(paths, budget)  # Draft itself refuses a parent after its child
    assert len(draft) <= budget
    counts = [sum(p[: len(path)] == path for p in paths) for path in
              ([draft.tokens[i] for i in draft.path_to(n)] for n in range(len(draft)))]
    assert all(c > 0 for c in counts)
    assert counts == sorted(counts, reverse=True)  # most frequent nodes first
    distinct = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
    assert len(draft) == min(budget, len(distinct))


# =========================================================================== the file


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save(corpus(), tmp_path / "store.sdds")


def test_save_load_round_trip(saved: Path) -> None:
    store, loaded = corpus(), load(saved)
    assert np.array_equal(store.tokens, loaded.tokens) and np.array_equal(store.sa, loaded.sa)
    assert loaded.info == store.info and loaded.info.tokens == len(store.tokens) and loaded.info.documents == 5
    assert loaded.nbytes == saved.stat().st_size


def _rewrite(path: Path, edit) -> Path:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))
    return path


def _flip(offset: int):
    def edit(data: bytearray) -> bytearray:
        data[offset] ^= 0x40
        return data
    return edit


DAMAGE = {
    "missing": (lambda p: p.with_name("nope.sdds"), "not found"),
    "bad magic": (lambda p: _rewrite(p, lambda d: b"GGUF" + d[4:]), "not a specdraft datastore"),
    "older version": (lambda p: _rewrite(p, lambda d: d[:8] + struct.pack("<I", FORMAT_VERSION - 1) + d[12:]),
                      "older datastore format"),
    "truncated": (lambda p: _rewrite(p, lambda d: d[:-7]), "truncated"),
    "truncated header": (lambda p: _rewrite(p, lambda d: d[:20]), "truncated"),
    "flipped array byte": (lambda p: _rewrite(p, _flip(-5)), "checksum"),
    "flipped header byte": (lambda p: _rewrite(p, _flip(40)), "corrupt"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_bad_files_are_refused_with_one_line(saved: Path, case: str) -> None:
    damage, needle = DAMAGE[case]
    with pytest.raises(DatastoreError) as e:
        load(damage(saved))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", DAMAGE)
def test_bad_files_exit_2_with_one_line_through_the_cli(saved: Path, case: str, capsys) -> None:
    damage, needle = DAMAGE[case]
    code = main(["datastore", "info", str(damage(saved))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("specdraft: error:") and needle in err[0]


@pytest.fixture(scope="module")
def tiny(tiny_hf: Path) -> LoadedModel:
    return load_model(tiny_hf)


def test_a_datastore_for_another_tokenizer_is_stale(saved: Path, tiny: LoadedModel, tiny_gguf: Path, capsys) -> None:
    with pytest.raises(DatastoreError, match="stale: built for another tokenizer"):
        load(saved, tiny.tokenizer)
    code = main(["generate", "--model", str(tiny_gguf), "--prompt", "hi", "--method", "rest",
                 "--opt", f"datastore={saved}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "stale" in err[0]


def test_fingerprint_tells_tokenizers_apart(tiny: LoadedModel, tiny_hf: Path) -> None:
    again = Tokenizer.from_hf_folder(tiny_hf)
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tiny.tokenizer)
    backend = tokenizers.Tokenizer.from_file(str(tiny_hf / "tokenizer.json"))
    other = Tokenizer(backend, bos_id=again.bos_id, eos_id=again.eos_id, unk_id=1)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny.tokenizer)


@pytest.mark.parametrize("options", [{"min_suffix": "0"}, {"min_suffix": "5", "max_suffix": "4"},
                                     {"max_matches": "0"}, {"max_suffix": "65"}])
def test_bad_rest_options_are_refused(options: dict[str, str]) -> None:
    with pytest.raises(SpecdraftError, match="rest"):
        make_proposer("rest", options)


def test_missing_default_datastore_says_how_to_build_it(tiny: LoadedModel, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDRAFT_DATASTORES", str(tmp_path))
    context = ProposerContext(tiny.model, tiny.tokenizer)
    with pytest.raises(DatastoreError, match="specdraft datastore build --stdlib"):
        make_proposer("rest", {}, context)
    save(Datastore.from_documents([[5, 6, 7]], _info(tiny)), default_datastore_path(tiny.tokenizer))
    proposer = make_proposer("rest", {}, context)
    assert proposer.memory_bytes() == default_datastore_path(tiny.tokenizer).stat().st_size


# =========================================================================== through the engine


def _info(loaded: LoadedModel) -> DatastoreInfo:
    return DatastoreInfo(tokenizer_fingerprint(loaded.tokenizer), 0, 0, "the tiny model's own text")


GEN = GenerationConfig(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def own_text(tiny: LoadedModel) -> tuple[list[list[int]], list[list[int]], Datastore]:
    """Ragged prompts, their plain greedy outputs, and a datastore of the model's own text: the
    greedy continuations of some of the prompts (some cut short, one with a wrong token), so
    drafts are accepted, partly accepted and rejected."""
    g = torch.Generator().manual_seed(3)
    texts = ["a b a b a b", "The quick brown fox", "def add(a, b):\n", "Hello", "12345 12345"]
    prompts = [tiny.tokenizer.encode(t) for t in texts] + [torch.randint(3, 300, (n,), generator=g).tolist()
                                                           for n in (5, 19)]
    refs = [r.tokens for r in Engine(tiny.model, tiny.tokenizer).generate(prompts, GEN)]
    docs = [p + r for p, r in zip(prompts[:3], refs[:3])] + [prompts[3] + refs[3][:12]]
    docs.append(prompts[4] + refs[4][:6] + [(refs[4][6] + 1) % 300] + refs[4][7:])
    return prompts, refs, Datastore.from_documents(docs, _info(tiny))


def _cost(batch: int, k: int) -> CostModel:
    return CostModel(table={batch: {q: 1.0 + 0.001 * (q - 1) for q in range(1, k + 2)}})


@pytest.mark.parametrize("k, policy", [(4, "fixed"), (8, "fixed"), (8, "adaptive")])
def test_greedy_equals_plain_on_a_ragged_batch(tiny: LoadedModel, own_text, k: int, policy: str) -> None:
    prompts, refs, store = own_text
    proposer = RestProposer(store, RestConfig(min_suffix=2, max_suffix=8, max_matches=8))
    cost = _cost(len(prompts), k) if policy == "adaptive" else None
    config = PolicyConfig(kind=policy, k=k, objective="throughput")  # drafts for every row that finds one
    engine = Engine(tiny.model, tiny.tokenizer, proposer, Policy(config, cost))
    stats = SpecStats()
    results = engine.generate(prompts, GEN, stats=stats)
    assert [r.tokens for r in results] == refs
    assert stats.accepted >= 40, "drafts from the model's own text should be accepted"
    assert stats.proposed > stats.accepted  # and some rejected
    assert stats.steps < stats.emitted


def test_rows_are_independent(tiny: LoadedModel, own_text) -> None:
    prompts, _, store = own_text
    proposer = RestProposer(store)
    seqs = [Sequence(p, GEN, tiny.tokenizer) for p in prompts[:3]]
    together = proposer.propose([seqs[0], None, seqs[2]], [6, 6, 6], None)
    alone = [proposer.propose([s], [6], None)[0] for s in seqs]
    assert together[0] == alone[0] and together[2] == alone[2] and together[1] == Draft.empty()
    assert len(together[0]) == 6 and together[0].label.startswith("rest")


def test_sampling_through_the_engine_is_lossless(sampled_setup) -> None:
    _, tokenizer, prompt = sampled_setup[:3]
    store = Datastore.from_documents([prompt], DatastoreInfo(tokenizer_fingerprint(tokenizer), 0, 0, "prompt"))
    config = RestConfig(min_suffix=1, max_suffix=3)
    first, joint, triple, stats = _engine_lossless_check(
        sampled_setup, proposer=lambda model, tok: RestProposer(store, config), k=4)
    assert stats.accepted > 0.05 * ENGINE_ROWS, "drafts should be accepted in the first steps"
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


# =========================================================================== the command line


def test_datastore_build_and_info_on_a_corpus_folder(tiny_hf: Path, tiny: LoadedModel, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "corpus"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (folder / "notes.md").write_text("The quick brown fox jumps over the lazy dog.\n")
    (folder / "blob.bin").write_bytes(b"\xff\xfe\0\x01")
    out = tmp_path / "out" / "corpus.sdds"
    code = main(["datastore", "build", "--corpus", str(folder), "--model", str(tiny_hf), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert str(out) in captured.out and "from 2 files, 1 skipped" in captured.out
    store = load(out, tiny.tokenizer)
    assert store.info.documents == 2 and store.info.tokens == len(store.tokens)
    code = main(["datastore", "build", "--corpus", str(folder), "--glob", "**/*.py", "--model", str(tiny_hf),
                 "--out", str(out), "--max-tokens", "5"])
    assert code == 0 and load(out).info.tokens == 5 and load(out).info.documents == 1
    assert main(["datastore", "info", str(out)]) == 0
    assert "documents: 1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["datastore", "build"], "--stdlib and/or --corpus"),
    (["datastore", "build", "--corpus", "/nonexistent/folder"], "not found"),
    (["datastore", "build", "--corpus", ".", "--max-tokens", "0"], "--max-tokens"),
    (["datastore", "build", "--corpus", "{README}", "--out", "{README}/x.sdds"], "cannot write"),
])
def test_datastore_build_mistakes_exit_2(argv: list[str], needle: str, tiny_hf: Path, capsys) -> None:
    code = main([arg.replace("{README}", str(Path(__file__).parent.parent / "README.md")) for arg in argv]
                + ["--model", str(tiny_hf)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("tokenizing", "indexing"))]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("specdraft: error:") and needle in lines[0]


def test_siblings_are_lossless_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Trees whose later siblings are often accepted (the datastore holds the prompt, whose
    likely tokens are each followed by several likely continuations)."""
    _, tokenizer, prompt = sibling_setup[:3]
    store = Datastore.from_documents([prompt], DatastoreInfo(tokenizer_fingerprint(tokenizer), 0, 0, "prompt"))
    check_siblings_lossless(sibling_setup, lambda _m, _t: RestProposer(store, RestConfig(min_suffix=1, max_suffix=3)), 4,
                            monkeypatch)
