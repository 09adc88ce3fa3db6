"""Token-tree utilities: structure (depths, children, paths), constructors and the verifier's
inputs (ancestor mask, positions), checked as properties over random trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.draft import Draft, verify_inputs

# --------------------------------------------------------------------------- strategies


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 24, vocab: int = 9) -> Draft:
    """A random draft: node i's parent is drawn from -1 .. i - 1 (topological order)."""
    n = draw(st.integers(0, max_nodes))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
    return Draft(tokens, parents)


def ancestors(draft: Draft, node: int) -> set[int]:
    """Strict ancestors of ``node`` (draft indices), by walking parents."""
    out = set()
    p = draft.parents[node]
    while p >= 0:
        out.add(p)
        p = draft.parents[p]
    return out


SETTINGS = settings(max_examples=150, deadline=None)

# --------------------------------------------------------------------------- structure


@SETTINGS
@given(trees())
def test_depths_count_edges_to_the_root(draft: Draft) -> None:
    depths = draft.depths()
    assert len(depths) == len(draft)
    for i, p in enumerate(draft.parents):
        assert depths[i] == (1 if p < 0 else depths[p] + 1)
        assert depths[i] == len(ancestors(draft, i)) + 1


@SETTINGS
@given(trees())
def test_children_invert_parents(draft: Draft) -> None:
    kids = draft.children()
    assert len(kids) == len(draft) + 1
    seen = sorted(c for group in kids for c in group)
    assert seen == list(range(len(draft)))  # every node is exactly one node's child
    for parent_slot, group in enumerate(kids):
        assert group == sorted(group)  # in node order (= sibling order used by acceptance)
        for c in group:
            assert draft.parents[c] == parent_slot - 1


@SETTINGS
@given(trees())
def test_paths_cover_each_leaf_once(draft: Draft) -> None:
    kids = draft.children()
    leaves = {i for i in range(len(draft)) if not kids[i + 1]}
    paths = draft.paths()
    assert sorted(p[-1] for p in paths) == sorted(leaves)  # one path per leaf, no other paths
    for path in paths:
        assert draft.parents[path[0]] == -1  # starts at a child of the root
        for a, b in zip(path, path[1:]):
            assert draft.parents[b] == a  # consecutive nodes are parent and child
        assert path == draft.path_to(path[-1])
    covered = {i for p in paths for i in p}
    assert covered == set(range(len(draft)))  # every node lies on some root-to-leaf path


@SETTINGS
@given(trees())
def test_path_to_walks_up_to_the_root(draft: Draft) -> None:
    depths = draft.depths()
    for i in range(len(draft)):
        path = draft.path_to(i)
        assert path[-1] == i and len(path) == depths[i]
        assert set(path[:-1]) == ancestors(draft, i)
        assert path == sorted(path)  # topological order: ancestors have smaller indices
    assert draft.path_to(-1) == []


# --------------------------------------------------------------------------- constructors


@SETTINGS
@given(st.lists(st.integers(0, 50), max_size=20))
def test_chain(tokens: list[int]) -> None:
    d = Draft.chain(tokens)
    assert d.tokens == tuple(tokens)
    assert d.parents == tuple(range(-1, len(tokens) - 1))
    assert d.is_chain and d.depths() == list(range(1, len(tokens) + 1))
    assert d.paths() == ([list(range(len(tokens)))] if tokens else [])
    assert d.p_draft is None


def test_chain_keeps_p_draft_and_empty_draft() -> None:
    p = torch.full((3, 5), 0.2)
    d = Draft.chain([1, 2, 3], p)
    assert d.p_draft is p
    e = Draft.empty()
    assert len(e) == 0 and e.is_chain and e.paths() == [] and e.children() == [[]]
    with pytest.raises(ValueError):
        Draft.chain([1, 2, 3], torch.full((2, 5), 0.2))  # one row per node


def test_is_chain_is_false_for_branches() -> None:
    assert not Draft((1, 2), (-1, -1)).is_chain
    assert not Draft((1, 2, 3), (-1, 0, 0)).is_chain


paths_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=0, max_size=8)


def _node_sequence(draft: Draft, node: int) -> tuple[int, ...]:
    return tuple(draft.tokens[i] for i in draft.path_to(node))


@SETTINGS
@given(paths_strategy)
def test_from_paths_is_a_trie(paths: list[list[int]]) -> None:
    d = Draft.from_paths(paths)
    prefixes = {tuple(p[:n]) for p in paths for n in range(1, len(p) + 1)}
    assert len(d) == len(prefixes)  # one node per distinct non-empty prefix
    node_seqs = [_node_sequence(d, i) for i in range(len(d))]
    assert set(node_seqs) == prefixes and len(set(node_seqs)) == len(node_seqs)
    for p in paths:  # every input path is a root-to-node path
        if p:
            assert tuple(p) in node_seqs
    for group in d.children():  # siblings are distinct tokens
        toks = [d.tokens[c] for c in group]
        assert len(toks) == len(set(toks))
    if paths and paths[0]:  # earlier paths come first: the first path is nodes 0, 1, 2, ...
        assert node_seqs[: len(paths[0])] == [tuple(paths[0][:n]) for n in range(1, len(paths[0]) + 1)]


@SETTINGS
@given(paths_strategy, st.integers(0, 12))
def test_from_paths_respects_max_nodes(paths: list[list[int]], max_nodes: int) -> None:
    full = Draft.from_paths(paths)
    d = Draft.from_paths(paths, max_nodes=max_nodes)
    assert len(d) == min(max_nodes, len(full))
    # what it keeps is still a valid trie of prefixes of the inputs, parents first
    prefixes = {tuple(p[:n]) for p in paths for n in range(1, len(p) + 1)}
    node_seqs = [_node_sequence(d, i) for i in range(len(d))]
    assert set(node_seqs) <= prefixes and len(set(node_seqs)) == len(node_seqs)


def test_from_paths_example() -> None:
    d = Draft.from_paths([[5, 6, 7], [5, 8], [9]])
    assert d.tokens == (5, 6, 7, 8, 9)
    assert d.parents == (-1, 0, 1, 0, -1)
    assert d.paths() == [[0, 1, 2], [0, 3], [4]]
    assert Draft.from_paths([[5, 6, 7], [5, 8], [9]], max_nodes=2).tokens == (5, 6)


# --------------------------------------------------------------------------- verifier inputs


@SETTINGS
@given(st.lists(trees(), min_size=1, max_size=4), st.integers(0, 6))
def test_verify_inputs(drafts: list[Draft], extra: int) -> None:
    width = max(len(d) for d in drafts) + extra
    size = 1 + width
    last = [100 + r for r in range(len(drafts))]
    tokens, positions, mask = verify_inputs(drafts, last, width)
    assert tokens.dtype == positions.dtype == torch.long and tokens.shape == positions.shape == (len(drafts), size)
    assert mask.dtype == torch.bool and mask.shape == (len(drafts), size, size)
    for r, draft in enumerate(drafts):
        n = len(draft)
        assert tokens[r].tolist() == [last[r], *draft.tokens] + [0] * (width - n)
        assert positions[r, 0] == 0
        assert positions[r, 1 : n + 1].tolist() == draft.depths()
        assert mask[r, :, 0].all()  # everyone sees the root
        for a in range(n):
            anc = ancestors(draft, a)
            for b in range(n):
                assert bool(mask[r, a + 1, b + 1]) == (b == a or b in anc), (r, a, b)
            assert bool(mask[r, 0, a + 1]) is False  # the root sees no draft node
        for pad in range(n + 1, size):  # padding: sees only the root and itself, seen by nobody else
            assert mask[r, pad].nonzero().flatten().tolist() == [0, pad]
            assert mask[r, :, pad].nonzero().flatten().tolist() == [pad]
            assert positions[r, pad] == 1


@SETTINGS
@given(st.lists(st.integers(0, 8), min_size=1, max_size=5), st.integers(0, 3))
def test_verify_inputs_of_chains_equal_the_tree_walk(lengths: list[int], extra: int) -> None:
    """An all-chain batch takes a shortcut; a tree in the batch forces the general walk: the
    chains' rows must come out the same either way."""
    chains = [Draft.chain(range(n)) for n in lengths]
    tree = Draft((1, 2, 3), (-1, -1, 0))
    width = max(lengths + [3]) + extra
    alone = verify_inputs(chains, list(range(len(chains))), width)
    mixed = verify_inputs(chains + [tree], list(range(len(chains) + 1)), width)
    for x, y in zip(alone, mixed):
        assert torch.equal(x, y[: len(chains)])


def test_verify_inputs_chain_is_causal() -> None:
    _, positions, mask = verify_inputs([Draft.chain([3, 1, 4, 1])], [7], 4)
    assert torch.equal(mask[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert positions[0].tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- invalid drafts


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ((1, 2), (-1, 1)),  # a node is its own parent
        ((1, 2, 3), (-1, 2, 0)),  # parent after the child
        ((1,), (0,)),  # first node's parent must be the root
        ((1, 2), (-1, -2)),  # below -1
        ((1, 2), (-1,)),  # length mismatch
        ((1,), (-1, 0)),
    ],
)
def test_invalid_drafts_raise(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        Draft(tokens, parents)


@SETTINGS
@given(trees(max_nodes=10).filter(lambda d: len(d) > 0), st.data())
def test_any_forward_parent_is_rejected(draft: Draft, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(draft) - 1))
    bad = data.draw(st.integers(i, len(draft) + 3))
    parents = list(draft.parents)
    parents[i] = bad
    with pytest.raises(ValueError):
        Draft(draft.tokens, tuple(parents))


def test_p_draft_rows_must_match_nodes() -> None:
    with pytest.raises(ValueError):
        Draft((1, 2), (-1, 0), torch.full((3, 4), 0.25))
