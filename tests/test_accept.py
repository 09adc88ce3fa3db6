"""Acceptance: greedy walks on hand-built trees, and the lossless property of rejection
sampling, tested statistically (chains and trees, sampled and deterministic drafts,
temperature / top-k / top-p), including deliberately wrong samplers that the same check
must reject; then the lossless property through the whole engine on a tiny model.

Statistics: Pearson's chi-square goodness-of-fit test at significance 0.001. scipy is not a
dependency, so the critical value is computed here from the regularized incomplete gamma
function (series / continued fraction, as in Numerical Recipes) and bisection; the helper is
itself checked against textbook table values. Every draw is seeded, so each test is
deterministic: a correct sampler passes and a wrong one fails the same way on every run.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specdraft.accept as accept_module
from specdraft.accept import Acceptance, accept, accept_greedy, residual
from specdraft.draft import Draft
from specdraft.engine import Engine
from specdraft.metrics import SpecStats
from specdraft.model.loader import LoadedModel, load
from specdraft.policy import Policy, PolicyConfig
from specdraft.model.tokenizer import Tokenizer
from specdraft.model.transformer import Transformer
from specdraft.proposers.base import Proposer
from specdraft.proposers.ngram import NgramConfig, NgramProposer
from specdraft.sampling import GREEDY, Sampling, probabilities
from specdraft.sequence import GenerationConfig

ALPHA = 0.001

# =========================================================================== chi-square helpers


def _gamma_p(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x)."""
    if x <= 0:
        return 0.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-15 and n < 10_000:
            n += 1
            term *= x / (a + n)
            total += term
        return total * math.exp(log_front)
    # continued fraction for Q(a, x) (modified Lentz)
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return 1.0 - math.exp(log_front) * h


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square with ``dof`` degrees of freedom."""
    return 1.0 - _gamma_p(dof / 2, x / 2)


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """The value c with P(X > c) = alpha (bisection on chi2_sf)."""
    lo, hi = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, dof) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@pytest.mark.parametrize(
    "dof, table",  # chi-square 0.999 quantiles from standard tables
    [(1, 10.828), (2, 13.816), (5, 20.515), (8, 26.124), (10, 29.588), (20, 45.315), (35, 66.619), (40, 73.402)],
)
def test_chi2_critical_values_match_tables(dof: int, table: float) -> None:
    assert chi2_critical(dof) == pytest.approx(table, abs=2e-3)


@dataclass(frozen=True)
class GofResult:
    statistic: float
    dof: int
    critical: float

    @property
    def rejects(self) -> bool:
        return self.statistic > self.critical


def chi_square_gof(observed: Counter, probs: dict, n: int, min_expected: float = 5.0) -> GofResult:
    """Pearson's goodness of fit of ``observed`` counts (cell -> count, n draws in all) to
    ``probs`` (cell -> probability). Cells whose expected count is under ``min_expected`` are
    pooled into one cell (folded into the largest cell if the pool is still too small); a draw
    in a cell of probability zero (or unknown) makes the statistic infinite."""
    if any(c not in probs or probs[c] <= 0 for c in observed):
        return GofResult(math.inf, 1, chi2_critical(1))
    cells = [c for c in probs if probs[c] > 0]
    big = [c for c in cells if n * probs[c] >= min_expected]
    small = [c for c in cells if n * probs[c] < min_expected]
    exp = [n * probs[c] for c in big]
    obs = [observed.get(c, 0) for c in big]
    if small:
        e_small = n * sum(probs[c] for c in small)
        o_small = sum(observed.get(c, 0) for c in small)
        if e_small >= min_expected:
            exp.append(e_small)
            obs.append(o_small)
        else:
            j = int(np.argmax(exp))
            exp[j] += e_small
            obs[j] += o_small
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = max(len(exp) - 1, 1)
    return GofResult(stat, dof, chi2_critical(dof))


# =========================================================================== greedy acceptance


def logits_with_argmax(rows: Sequence[int], vocab: int = 10) -> torch.Tensor:
    """[len(rows), vocab] logits whose argmax in row r is rows[r] (random elsewhere)."""
    g = torch.Generator().manual_seed(len(rows))
    out = torch.rand(len(rows), vocab, generator=g)
    out[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return out


def test_greedy_longest_matching_path_in_a_tree() -> None:
    #        root
    #      /   |    \
    #    4(0) 2(1)  7(2)
    #     |   /  \
    #   3(3) 5(4) 1(5)
    #         |
    #        8(6)
    draft = Draft((4, 2, 7, 3, 5, 1, 8), (-1, -1, -1, 0, 1, 1, 4))
    # argmax: root -> 2, node 1 -> 5, node 4 -> 8, node 6 -> 9 (bonus); others arbitrary
    logits = logits_with_argmax([2, 0, 5, 0, 0, 8, 0, 9])
    acc = accept(draft, logits, GREEDY)
    assert acc.path == (1, 4, 6)
    assert acc.tokens == (2, 5, 8, 9)
    assert acc.accepted == 3


def test_greedy_stops_where_no_child_matches() -> None:
    draft = Draft((4, 2, 3, 5), (-1, -1, 1, 1))
    logits = logits_with_argmax([2, 0, 6, 0, 0])  # node 1's argmax 6 matches neither child
    acc = accept_greedy(draft, logits)
    assert acc.path == (1,) and acc.tokens == (2, 6)


def test_greedy_first_token_rejected_gives_only_the_bonus() -> None:
    acc = accept(Draft.chain([1, 2, 3]), logits_with_argmax([7, 2, 3, 4]), GREEDY)
    assert acc.path == () and acc.tokens == (7,)


def test_greedy_whole_chain_accepted_plus_bonus() -> None:
    acc = accept(Draft.chain([1, 2, 3]), logits_with_argmax([1, 2, 3, 4]), GREEDY)
    assert acc.path == (0, 1, 2) and acc.tokens == (1, 2, 3, 4)


def test_greedy_empty_draft_gives_just_the_bonus() -> None:
    acc = accept(Draft.empty(), logits_with_argmax([6]), GREEDY)
    assert acc == Acceptance((), (6,))


def test_greedy_ties_follow_sibling_order_and_first_argmax() -> None:
    # two siblings carry the same token: the first in sibling order is taken
    draft = Draft((3, 3, 9), (-1, -1, 1))
    logits = logits_with_argmax([3, 1, 9, 0])
    assert accept(draft, logits, GREEDY).path == (0,)
    # a tie in the logits: the first maximal index counts as the argmax (as plain decoding)
    tie = torch.zeros(2, 10)
    tie[0, 4] = tie[0, 6] = 1.0
    tie[1, 2] = 1.0
    assert accept(Draft.chain([6]), tie, GREEDY).tokens == (4,)
    assert accept(Draft.chain([4]), tie, GREEDY).tokens == (4, 2)


def test_padding_rows_are_ignored() -> None:
    logits = logits_with_argmax([1, 2, 7, 7, 7])  # rows 2.. are padding for a 1-node draft
    assert accept(Draft.chain([1]), logits, GREEDY).tokens == (1, 2)
    sampled = accept(Draft.chain([1]), logits * 100, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.tokens == (1, 2)


# =========================================================================== sampled acceptance: unit checks


def test_residual() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(residual(p, p), p)  # nothing left: unchanged


def test_draft_equal_to_target_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=g)
    s = Sampling(temperature=0.7)
    p = probabilities(logits, s)
    for _ in range(200):
        toks = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        # p_draft row i is the distribution node i was drawn from: the target at its parent
        acc = accept(Draft.chain(toks, p[:3].clone()), logits, s, g)
        assert acc.path == (0, 1, 2)


def test_token_outside_the_target_support_is_never_accepted() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.0]])
    s = Sampling(temperature=1.0, top_k=2)  # support {0, 1}
    for _ in range(200):
        acc = accept(Draft.chain([4]), logits, s, g)
        assert acc.path == () and acc.tokens[0] in (0, 1)


# =========================================================================== the lossless property, statistically
#
# The target is a small Markov model over V tokens: its next-token logits after a prefix are
# A[depth][last token] (A[0] at the root). Draft node i's logits row is the target's logits
# after the draft tokens on the path to i, exactly what the verifier would compute. The draft
# model Q has the same shape: the target's logits plus noise (close, so drafts get accepted,
# but not equal). Sampled cases draw every node's token from Q (siblings i.i.d., duplicates
# possible) and attach p_draft; deterministic cases take Q's most likely distinct tokens and
# attach nothing (one-hot).
#
# One step of accept() emits Y1 (always) and Y2 only when Y1 was an accepted draft token. The
# generation process continues with a later step in the other case, which by induction draws
# Y2 from the target's distribution after Y1; we complete it here with a plain sample from
# p_target(. | Y1). Then lossless means: Y1 ~ p_target(. | root) and
# (Y1, Y2) ~ p_target(Y1 | root) * p_target(Y2 | Y1). Both are tested on the same draws.

V = 6
DEPTHS = 4


@dataclass(frozen=True)
class MarkovModel:
    logits: list[torch.Tensor]  # [DEPTHS] of [V] (depth 0) or [V, V] (indexed by the last token)

    @classmethod
    def random(cls, seed: int, scale: float) -> "MarkovModel":
        g = torch.Generator().manual_seed(seed)
        return cls([torch.randn(V, generator=g) * scale] + [torch.randn(V, V, generator=g) * scale
                                                            for _ in range(DEPTHS - 1)])

    def perturbed(self, seed: int, noise: float) -> "MarkovModel":
        """A draft model: these logits plus Gaussian noise (close to the target, not equal)."""
        other = MarkovModel.random(seed, noise)
        return MarkovModel([a + b for a, b in zip(self.logits, other.logits)])

    def at(self, prefix: Sequence[int]) -> torch.Tensor:
        return self.logits[0] if not prefix else self.logits[len(prefix)][prefix[-1]]


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # children per node at each depth: (1, 1, 1) = a 3-token chain
    sampled: bool  # True: siblings drawn i.i.d. from Q (p_draft given); False: Q's top tokens
    sampling: Sampling
    scale: float = 1.5  # spread of the target's logits
    noise: float = 1.5  # spread of the draft's logits around the target's
    target_seed: int = 11
    draft_seed: int = 12


def _children_tokens(case: Case, q: np.ndarray, cdf: np.ndarray, count: int, rng: np.random.Generator) -> list[int]:
    if case.sampled:
        return np.minimum(np.searchsorted(cdf, rng.random(count), side="right"), V - 1).tolist()
    return np.argsort(-q, kind="stable")[:count].tolist()  # distinct, most likely first


def build_draft(case: Case, q_cache: dict, rng: np.random.Generator) -> tuple[Draft, list[tuple[int, ...]]]:
    """A random draft of the case's shape (breadth first) and each node's token prefix.
    q_cache: (depth, last token) -> the draft model's distribution there (tensor, array, cdf)."""
    tokens: list[int] = []
    parents: list[int] = []
    prefixes: list[tuple[int, ...]] = []
    q_rows: list[torch.Tensor] = []
    frontier: list[tuple[int, tuple[int, ...]]] = [(-1, ())]
    for count in case.shape:
        nxt = []
        for parent, prefix in frontier:
            q_t, q, cdf = q_cache[_key(prefix)]
            for tok in _children_tokens(case, q, cdf, count, rng):
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                prefixes.append(prefix + (tok,))
                q_rows.append(q_t)
                nxt.append((node, prefix + (tok,)))
        frontier = nxt
    p_draft = torch.stack(q_rows) if case.sampled else None
    return Draft(tuple(tokens), tuple(parents), p_draft), prefixes


def _key(prefix: tuple[int, ...]) -> tuple[int, int]:
    return (len(prefix), prefix[-1] if prefix else -1)


def _q_cache(draft_model: MarkovModel) -> dict:
    out = {}
    for depth in range(DEPTHS):
        for last in ([-1] if depth == 0 else range(V)):
            prefix = () if depth == 0 else (0,) * (depth - 1) + (last,)
            q_t = torch.softmax(draft_model.at(prefix), -1)
            q = q_t.double().numpy()
            out[(depth, last)] = (q_t, q, np.cumsum(q / q.sum()))
    return out


@dataclass(frozen=True)
class LosslessResult:
    first: GofResult  # Y1 against p_target(. | root)
    joint: GofResult  # (Y1, Y2) against p_target(Y1) p_target(Y2 | Y1)
    mean_accepted: float

    @property
    def rejects(self) -> bool:
        return self.first.rejects or self.joint.rejects


Sampler = Callable[[Draft, torch.Tensor, Sampling, torch.Generator], Acceptance]


def lossless_check(case: Case, draws: int, seed: int = 0, sampler: Sampler = accept) -> LosslessResult:
    """Run ``sampler`` (accept()) ``draws`` times on fresh random drafts and test the emitted tokens."""
    target = MarkovModel.random(case.target_seed, case.scale)
    draft_model = target.perturbed(case.draft_seed, case.noise)
    q_cache = _q_cache(draft_model)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    p_root = probabilities(target.logits[0], case.sampling).double()  # [V]
    p_next = probabilities(target.logits[1], case.sampling).double()  # [V, V]: row a = p_target(. | a)
    cdf_next = np.cumsum(p_next.numpy(), -1)
    logits_by_key = {(d, last): target.at(() if d == 0 else (0,) * (d - 1) + (last,))
                     for d in range(DEPTHS) for last in ([-1] if d == 0 else range(V))}
    root_row = target.logits[0]
    first: Counter = Counter()
    joint: Counter = Counter()
    accepted = 0
    for _ in range(draws):
        draft, prefixes = build_draft(case, q_cache, rng)
        logits = torch.stack([root_row] + [logits_by_key[_key(p)] for p in prefixes])  # [1 + N, V]
        acc = sampler(draft, logits, case.sampling, gen)
        accepted += acc.accepted
        y1 = acc.tokens[0]
        if len(acc.tokens) >= 2:
            y2 = acc.tokens[1]
        else:  # the next step would draw it from the target after y1
            y2 = min(int(np.searchsorted(cdf_next[y1], rng.random(), side="right")), V - 1)
        first[y1] += 1
        joint[(y1, y2)] += 1
    p_first = {a: float(p_root[a]) for a in range(V)}
    p_joint = {(a, b): float(p_root[a] * p_next[a, b]) for a in range(V) for b in range(V)}
    return LosslessResult(chi_square_gof(first, p_first, draws), chi_square_gof(joint, p_joint, draws),
                          accepted / draws)


T1 = Sampling(temperature=1.0)
CASES = [
    Case("chain, sampled draft", (1, 1, 1), True, T1),
    Case("chain, deterministic draft, T=0.8", (1, 1, 1), False, Sampling(temperature=0.8)),
    Case("tree, 3 i.i.d. siblings x 2", (3, 2), True, T1),
    Case("tree, 2 i.i.d. siblings x 2 x 1, T=1.3", (2, 2, 1), True, Sampling(temperature=1.3)),
    Case("tree, 3 distinct deterministic siblings x 2", (3, 2), False, T1),
    Case("chain, sampled, top-k 3, T=0.7", (1, 1, 1), True, Sampling(temperature=0.7, top_k=3)),
    Case("tree, sampled, top-p 0.9", (3, 2), True, Sampling(temperature=1.0, top_p=0.9), scale=1.0),
    Case("tree, deterministic, top-k 4 + top-p 0.9", (2, 2), False, Sampling(temperature=1.0, top_k=4, top_p=0.9),
         scale=1.0, noise=0.7),
]
DRAWS = 10_000


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_accept_is_lossless(case: Case) -> None:
    result = lossless_check(case, DRAWS, seed=CASES.index(case))
    assert result.mean_accepted > 0.3, "the drafts should be accepted often enough to matter"
    assert not result.first.rejects, result
    assert not result.joint.rejects, result


def _resample_from_target(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """A classic bug: after a rejection, draw from p_target instead of the residual."""
    return p_target


def _uniform_draft(draft: Draft, node: int, like: torch.Tensor) -> torch.Tensor:
    """Another: the acceptance ratio uses a distribution other than the one the draft token
    was drawn from (here: uniform)."""
    return torch.full_like(like, 1.0 / like.shape[-1])


def _rows_off_by_one(draft: Draft, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> Acceptance:
    """And an indexing bug: node i judged by its parent's logits (row i, not row i + 1). The
    first token is still right; only the joint test of the first two can see it."""
    return accept(draft, torch.cat([logits[:1], logits[:-1]]), sampling, gen)


WRONG = [
    pytest.param(CASES[0], "residual", _resample_from_target, id="chain sampled: resample from p_target"),
    pytest.param(CASES[4], "residual", _resample_from_target, id="tree deterministic: resample from p_target"),
    pytest.param(CASES[0], "_draft_distribution", _uniform_draft, id="chain sampled: wrong p_draft"),
    pytest.param(CASES[2], "accept", _rows_off_by_one, id="tree sampled: logits rows off by one"),
]


@pytest.mark.parametrize("case, name, bug", WRONG)
def test_wrong_sampler_is_rejected(case: Case, name: str, bug: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "accept":
        result = lossless_check(case, DRAWS, seed=CASES.index(case), sampler=bug)
    else:
        monkeypatch.setattr(accept_module, name, bug)
        result = lossless_check(case, DRAWS, seed=CASES.index(case))  # the same draws as the correct test
    assert result.rejects, result
    # the bias is large: far past the critical value, not a borderline call
    assert max(result.first.statistic / result.first.critical, result.joint.statistic / result.joint.critical) > 3


# =========================================================================== lossless through the engine
#
# The tiny random model is nearly uniform at temperature 1 (perplexity ~190 over 320 tokens)
# and never repeats itself, so n-gram drafts would almost never be proposed or accepted. The
# test model is the tiny model with its attention output scaled down (it leans on the last
# token, so its text loops) and its LM head scaled up (peaked next-token distributions). The
# prompt holds the model's own greedy continuations of its likely first tokens, so the n-gram
# proposer drafts (and gets tokens accepted) in the first verification step.
#
# Reference: the exact distribution of the first two generated tokens, p(x1 | P) p(x2 | P x1),
# computed with one batched forward over P + [x] for every token x, and of the first three for
# the likely (x1, x2) pairs. Each row of one batched generate() call is an independent sample
# (its own seed). x1 comes from the prefill; x2 and x3 are the first tokens speculation decides.

ENGINE_ROWS = 2000


def _peaked_loopy_model(tiny: LoadedModel) -> torch.nn.Module:
    model = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for layer in model.layers:
            layer.wo.weight.mul_(0.2)
        model.lm_head.weight.mul_(3.0)
    return model


@torch.inference_mode()
def _next_probs(model: torch.nn.Module, prefixes: list[list[int]], sampling: Sampling) -> torch.Tensor:
    """p_target of the next token after each prefix (all of one length): [len(prefixes), V] float64."""
    n = len(prefixes[0])
    cache = model.new_cache(len(prefixes), n)
    out = model(torch.tensor(prefixes), torch.arange(n).expand(len(prefixes), n), cache)
    return probabilities(out.logits[:, -1], sampling).double()


def _sampled(tiny_hf, siblings: bool):
    """(model, tokenizer, prompt, p1, p2, pairs, p3, reference) for ``_engine_lossless_check``
    (``reference``: the exact probabilities of the first token, the first two and the first
    three, as ``chi_square_gof`` takes them). Built once per session for each kind. With
    ``siblings``, after each likely first token c the prompt also shows c followed by its second
    and third most likely next tokens (each with the model's own continuation): a tree proposer
    then offers several siblings there, and the first is rejected often enough for later
    siblings to be accepted often (the case that tests the residual between siblings)."""
    key = (str(tiny_hf), siblings)
    if key not in _SETUPS:
        _SETUPS[key] = _build_sampled(tiny_hf, siblings)
    return _SETUPS[key]


_SETUPS: dict[tuple[str, bool], tuple] = {}  # every proposer's test module shares the two setups


def _build_sampled(tiny_hf, siblings: bool):
    tiny = load(tiny_hf)
    model = _peaked_loopy_model(tiny)
    plain = Engine(model, tiny.tokenizer)
    base = tiny.tokenizer.encode("a b a b")
    likely = _next_probs(model, [base], T1)[0].topk(4).indices.tolist()
    def build(starts: list[list[int]]) -> list[int]:
        runs = plain.generate([base + s for s in starts], GenerationConfig(max_new_tokens=6, ignore_eos=True))
        return [t for st, r in zip(reversed(starts), reversed(runs)) for t in [*st, *r.tokens]] + base

    prompt = build([[c] for c in likely])
    for _ in range(3 if siblings else 0):  # the next tokens depend on the prompt: settle them
        after = _next_probs(model, [prompt + [c] for c in likely], T1)  # [4, V]
        # c followed by each of its three most likely next tokens, the likeliest first
        prompt = build([[c, int(x)] for c, row in zip(likely, after) for x in row.topk(3).indices])
    p1 = _next_probs(model, [prompt], T1)[0]  # [V]
    vocab = p1.shape[0]
    p2 = _next_probs(model, [prompt + [x] for x in range(vocab)], T1)  # [V, V]
    joint = p1[:, None] * p2  # [V, V]: p(x1 = a, x2 = b)
    pairs = [(a, b) for a, b in (joint > 0.004).nonzero().tolist()]
    p3 = _next_probs(model, [prompt + [a, b] for a, b in pairs], T1)  # [pairs, V]
    return model, tiny.tokenizer, prompt, p1, p2, pairs, p3, _reference(p1, joint, pairs, p3)


def _reference(p1: torch.Tensor, joint: torch.Tensor, pairs: list[tuple[int, int]], p3: torch.Tensor) -> tuple[dict, dict, dict]:
    """The exact probabilities of the first token, of the first two, and of the first three
    where the first two are a likely pair ("other" for the rest)."""
    vocab = p1.shape[0]
    first = dict(enumerate(p1.tolist()))
    joint_probs = {(a, b): q for a, row in enumerate(joint.tolist()) for b, q in enumerate(row)}
    triple = torch.tensor([joint_probs[pair] for pair in pairs], dtype=p3.dtype)[:, None] * p3  # [pairs, V]
    triple_probs: dict = {(a, b, c): q for (a, b), row in zip(pairs, triple.tolist()) for c, q in zip(range(vocab), row)}
    triple_probs["other"] = 1.0 - sum(joint_probs[pair] for pair in pairs)
    return first, joint_probs, triple_probs


@pytest.fixture(scope="module")
def sampled_setup(tiny_hf):
    return _sampled(tiny_hf, siblings=False)


@pytest.fixture(scope="module")
def sibling_setup(tiny_hf):
    return _sampled(tiny_hf, siblings=True)


class SiblingsProposer:
    """A deterministic tree proposer for the first step: after x1 it offers the three most
    likely second tokens as distinct siblings (the first with one child), so rejected siblings
    hand a residual to the next. Its drafts depend on the context only, as they must."""

    name = "siblings"

    def __init__(self, prompt_len: int, p2: torch.Tensor) -> None:
        self.prompt_len, self.p2 = prompt_len, p2

    def begin(self, row, seq) -> None:
        pass

    def end(self, row) -> None:
        pass

    def observe(self, row, draft, acceptance, verified=None) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0

    def propose(self, seqs, budgets, cache=None) -> list[Draft]:
        out = []
        for seq, budget in zip(seqs, budgets):
            if seq is None or len(seq.tokens) != self.prompt_len + 1:
                out.append(Draft.empty())
                continue
            a, b, c = self.p2[seq.tokens[-1]].topk(3).indices.tolist()
            out.append(Draft.from_paths([[a, seq.tokens[-1]], [b], [c]], max_nodes=budget))
        return out


def _engine_lossless_check(
    setup, proposer: "str | Callable[[Transformer, Tokenizer], Proposer]" = "ngram", k: int = 4
) -> tuple[GofResult, GofResult, GofResult, SpecStats]:
    """2,000 seeded rows at temperature 1 through the whole engine; the goodness of fit of
    the first token, the first two and the first three against the model's exact
    distribution. ``proposer``: "ngram", "siblings", or a function (model, tokenizer) ->
    proposer (used by every proposer's own lossless test)."""
    model, tokenizer, prompt, _, p2, pairs, _, (first_probs, joint_probs, triple_probs) = setup
    if callable(proposer):
        drafts = proposer(model, tokenizer)
    else:
        drafts = NgramProposer(NgramConfig(min_n=1, max_n=3)) if proposer == "ngram" else SiblingsProposer(len(prompt), p2)
    engine = Engine(model, tokenizer, drafts, Policy(PolicyConfig(kind="fixed", k=k)))
    stats = SpecStats()
    # 3 + k tokens, so that the first speculative step may draft all k (a row drafts at most
    # what it may still emit); the first three tokens are compared
    out = engine.generate([prompt] * ENGINE_ROWS, GenerationConfig(max_new_tokens=3 + k, ignore_eos=True),
                          [Sampling(temperature=1.0, seed=i) for i in range(ENGINE_ROWS)], stats=stats)
    assert all(len(r.tokens) == 3 + k for r in out)
    rows = [SimpleNamespace(tokens=r.tokens[:3]) for r in out]
    n = ENGINE_ROWS
    first = chi_square_gof(Counter(r.tokens[0] for r in rows), first_probs, n, 10)
    joint = chi_square_gof(Counter(tuple(r.tokens[:2]) for r in rows), joint_probs, n, 10)
    known = set(pairs)
    triples = Counter(tuple(r.tokens) if tuple(r.tokens[:2]) in known else "other" for r in rows)
    triple = chi_square_gof(triples, triple_probs, n, 10)
    return first, joint, triple, stats


@pytest.mark.parametrize("proposer", ["ngram", "siblings"])
def test_engine_sampling_is_lossless(sampled_setup, proposer: str) -> None:
    first, joint, triple, stats = _engine_lossless_check(sampled_setup, proposer)
    assert stats.accepted > 0.05 * ENGINE_ROWS, "n-gram drafts should be accepted in the first steps"
    assert not first.rejects, first
    assert not joint.rejects, joint
    assert not triple.rejects, triple


@pytest.mark.parametrize("proposer", ["ngram", "siblings"])
def test_engine_check_rejects_a_wrong_sampler(sampled_setup, proposer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept_module, "residual", _resample_from_target)
    first, joint, triple, _ = _engine_lossless_check(sampled_setup, proposer)
    assert not first.rejects  # the first token comes from the prefill, untouched by the bug
    assert joint.rejects and triple.rejects, (joint, triple)


# =========================================================================== siblings through the engine


def _no_residual_between_siblings(draft: Draft, logits: torch.Tensor, sampling: Sampling,
                                  generator: torch.Generator | None) -> Acceptance:
    """A subtle bug: every sibling is judged against the node's own p_target instead of the
    residual left by the siblings rejected before it (only the bonus token uses the residual).
    Chains are unaffected; only trees whose later siblings are accepted show it."""
    kids, path, node = draft.children(), [], -1
    while True:
        p_target = probabilities(logits[node + 1], sampling)  # [V]
        left, chosen = p_target, None
        for child in kids[node + 1]:
            token = draft.tokens[child]
            p_draft = accept_module._draft_distribution(draft, child, p_target)
            if float(torch.rand((), generator=generator)) < p_target[token] / p_draft[token].clamp_min(1e-20):
                chosen = child
                break
            left = residual(left, p_draft)
        if chosen is None:
            bonus = int(torch.multinomial(left[None], 1, generator=generator)[0, 0])
            return Acceptance(tuple(path), tuple([draft.tokens[i] for i in path] + [bonus]))
        path.append(chosen)
        node = chosen


def check_siblings_lossless(setup, make: "Callable[[Transformer, Tokenizer], Proposer]", k: int,
                            monkeypatch: pytest.MonkeyPatch, catches_the_bug: bool = True) -> int:
    """Every tree-drafting method's sibling test: through the engine, on ``sibling_setup``,
    the sampler passes; a later sibling is accepted in at least 5% of the rows; and the same
    check rejects a sampler that skips the residual between siblings (``catches_the_bug``:
    False only for a proposer whose first tree cannot depend on the first token, see
    test_medusa.py). Returns how many rows accepted a later sibling."""
    later = 0
    real = accept_module.accept_sampled

    def counting(draft, logits, sampling, generator):
        nonlocal later
        acc = real(draft, logits, sampling, generator)
        kids = draft.children()
        later += any(kids[(draft.parents[i] + 1)][0] != i for i in acc.path)
        return acc

    with monkeypatch.context() as m:
        m.setattr(accept_module, "accept_sampled", counting)
        first, joint, triple, _ = _engine_lossless_check(setup, proposer=make, k=k)
    assert not first.rejects and not joint.rejects and not triple.rejects, (first, joint, triple)
    assert later > 0.05 * ENGINE_ROWS, f"later siblings accepted in only {later} rows"
    if catches_the_bug:
        with monkeypatch.context() as m:
            m.setattr(accept_module, "accept_sampled", _no_residual_between_siblings)
            _, joint, triple, _ = _engine_lossless_check(setup, proposer=make, k=k)
        assert joint.rejects or triple.rejects, (joint, triple)
    return later


def test_siblings_through_the_engine(sibling_setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: ngram with three branches, and the hand-made siblings proposer."""
    check_siblings_lossless(sibling_setup, lambda _m, _t: NgramProposer(NgramConfig(min_n=1, max_n=3, branches=3)),
                            4, monkeypatch)
    _, _, prompt, _, p2 = sibling_setup[:5]
    check_siblings_lossless(sibling_setup, lambda _m, _t: SiblingsProposer(len(prompt), p2), 4, monkeypatch)
