import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft.errors import SamplingError
from specdraft.sampling import Sampling, make_generator, next_tokens, probabilities, sample


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -1},
        {"top_k": -1},
        {"top_k": 2.5},
        {"seed": -3},
    ],
)
def test_invalid_settings_raise_one_line(kwargs):
    with pytest.raises(SamplingError) as e:
        Sampling(**kwargs)
    assert "\n" not in str(e.value)


def test_greedy_is_one_hot_at_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    p = probabilities(logits, Sampling())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_matches_softmax():
    logits = torch.randn(3, 50)
    p = probabilities(logits, Sampling(temperature=0.7))
    torch.testing.assert_close(p, torch.softmax(logits / 0.7, -1))


def test_top_k_keeps_k_tokens_renormalised():
    logits = torch.randn(4, 100)
    p = probabilities(logits, Sampling(temperature=1.0, top_k=5))
    assert ((p > 0).sum(-1) == 5).all()
    top = logits.topk(5, -1).indices
    assert torch.gather(p, -1, top).sum(-1).allclose(torch.ones(4))


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 1.0), st.integers(0, 2**31 - 1))
def test_top_p_keeps_smallest_set_reaching_mass(top_p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 30, generator=g) * 3
    full = torch.softmax(logits, -1)[0]
    p = probabilities(logits, Sampling(temperature=1.0, top_p=top_p))[0]
    kept = p > 0
    order = full.argsort(descending=True)
    n = int(kept.sum())
    # the kept tokens are exactly the n most likely ones
    assert set(order[:n].tolist()) == set(kept.nonzero().flatten().tolist())
    # their mass reaches top_p, and one fewer would not
    assert full[order[:n]].sum() >= top_p - 1e-6
    if n > 1:
        assert full[order[: n - 1]].sum() < top_p + 1e-6
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    torch.testing.assert_close(p[kept], full[kept] / full[kept].sum())


def test_seeded_generators_reproduce():
    probs = torch.softmax(torch.randn(1, 1000), -1)
    s = Sampling(temperature=1.0, seed=1234)
    a = [int(sample(probs, make_generator(s, "cpu"))) for _ in range(3)]
    g1, g2 = make_generator(s, "cpu"), make_generator(s, "cpu")
    seq1 = [int(sample(probs, g1)) for _ in range(20)]
    seq2 = [int(sample(probs, g2)) for _ in range(20)]
    assert seq1 == seq2
    assert len(set(a)) == 1


def test_sampled_frequencies_follow_the_distribution():
    # chi-square goodness of fit at a 0.001 significance level (critical value for 9 dof: 27.88)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2, -2.0, 0.8]])
    s = Sampling(temperature=1.3, seed=7)
    g = make_generator(s, "cpu")
    n = 20000
    probs = probabilities(logits, s).expand(n, -1)
    counts = torch.bincount(sample(probs, g), minlength=10).double()
    expected = probabilities(logits, s)[0].double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88


def test_next_tokens_greedy_ignores_generator():
    logits = torch.randn(5, 20)
    assert next_tokens(logits, Sampling(), None).tolist() == logits.argmax(-1).tolist()
