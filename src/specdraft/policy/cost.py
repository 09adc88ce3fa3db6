"""What speculation costs: the target's measured forward latency against the tokens per row
(``CostModel``), and the proposer's time against the draft budget (``ProposeCost``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from specdraft.errors import SpecdraftError
from specdraft.model.linear import PACKED_FROM_ROWS
from specdraft.model.transformer import SPLIT_SHARE, Transformer, splits


OBSERVED_DECAY = 0.9  # weight an observed forward's running mean keeps at each new observation
OBSERVED_MIN = 3  # observations of a token count before they correct the measured curve


@dataclass(slots=True)
class CostModel:
    """Measured latency (seconds) of one target forward over q new tokens per row, per batch
    size. Measured on first use of a batch size (a handful of dummy forwards), or given.
    ``batch_grid`` (a continuous batch, whose size changes every few steps): a batch size is
    priced as the next size up in the grid, so that only those are ever measured (a size past
    the grid's largest is measured as itself).

    The measurement runs at a ``prefix`` of 128 cached tokens and equal rows; real rows are
    longer and ragged, and attention grows with them. So the engine reports each verification
    forward it runs (``observe``), as its ratio to the measured curve at its own batch size
    (interpolated between the grid sizes around it: a forward of 9 rows priced against the
    curve of 16 would make the token counts drafted mostly as the batch drains look cheap).
    Once a token count has ``OBSERVED_MIN`` observations, the measured point times their running
    mean replaces it, and the points in between are scaled by the observed ratios (interpolated,
    held constant past the observed ones), made non-decreasing again. A table given without a
    model is not corrected unless ``learns``.

    Verification is packed (``Transformer.forward``'s ``real``): the per-token work follows the
    tokens the rows really carry, but attention keeps the padded layout, as wide as the widest
    row. ``verification`` prices such a forward as the full curve at its mean tokens per row
    plus its *padding* slots (rows x width - nodes) at the cost per slot of that width: what a
    forward with ``lone_rows`` rows drafting that width beside plain rows costs beyond the full
    curve at its tokens, per padding slot (``lone``, measured with the table; none in a table
    given without it). Enough rows draft in that measurement that its attention is not split
    (``transformer.splits``): a split forward's price is then too high, and its correction
    (below, apart from the unsplit ones) brings it down. Measured on the default model at
    batch 64 and 300 cached tokens: plain 335 ms; one row drafting 4 tokens 429 ms packed (376
    with the split attention), ~1,010 ms padded; 8 rows drafting 4, 441-450 ms packed, ~1,070
    padded."""

    model: Transformer | None = None
    table: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> q -> seconds
    prefix: int = 128  # cached tokens per row during measurement
    batch_grid: tuple[int, ...] = ()
    learns: bool | None = None  # correct the curve with observed forwards (None: when it measures itself)
    lone: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> 1 + width -> seconds, lone_rows drafting
    observed: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # batch -> q -> [mean ratio, count], even forwards
    ragged: dict[int, dict[tuple[int, bool], list[float]]] = field(default_factory=dict)  # batch -> (width, split) -> [mean ratio, count]
    _curves: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> the corrected curve

    def _bucket(self, batch: int) -> int:
        return min((b for b in self.batch_grid if b >= batch), default=batch)

    def latency(self, batch: int, q: float, q_max: int) -> float:
        """Seconds of a forward of ``batch`` rows over ``q`` new tokens per row; a fraction is
        a packed forward's tokens per row (rows that drafted fewer nodes than others)."""
        batch = self._bucket(batch)
        if batch not in self.table:
            if self.model is None:
                raise SpecdraftError(f"cost model has no measurement for batch {batch}")
            full, lone = measure_latency(self.model, batch, _grid(q_max), self.prefix, lone=True)
            self.table[batch], self.lone[batch] = monotone(full), monotone(lone)
        curve = self._curves.get(batch)
        if curve is None:
            curve = self._curves[batch] = self._corrected(batch)
        return _interpolate(curve, q)

    def verification(self, batch: int, per_row: float, width: int, q_max: int, deep: int | None = None) -> float:
        """Seconds of a packed verification forward of ``batch`` rows carrying ``per_row`` draft
        nodes each on average, the widest row ``width``, ``deep`` of the rows drafting (None:
        taken as too many to split the attention): the full curve at 1 + per_row tokens per
        row, plus its padding slots (rows x width - nodes) at the padding cost per slot of that
        width (see the class doc): none when every row drafts ``width``. A ragged forward (some
        rows narrower than the widest) is then scaled by what the ragged forwards of its width,
        split or not, really took against this price (``observe``)."""
        price = self.latency(batch, 1.0 + per_row, q_max) + self.padded(batch, per_row, width)
        if not _ragged(per_row, width):
            return price
        o = self.ragged.get(self._bucket(batch), {}).get(self._ragged_key(batch, width, deep))
        return price * o[0] if o is not None and o[1] >= OBSERVED_MIN else price

    def _ragged_key(self, batch: int, width: int, deep: int | None) -> tuple[int, bool]:
        return width, deep is not None and splits(deep, batch, 1 + width)

    def padded(self, batch: int, per_row: float, width: int) -> float:
        """The padding slots' share of ``verification``: rows x width - nodes slots, at what
        one slot of the lone forward's padding cost."""
        bucket = self._bucket(batch)
        if bucket <= 1 or width <= 0:
            return 0.0
        return bucket * max(0.0, width - per_row) * self.slot(batch, width)

    def slot(self, batch: int, width: int) -> float:
        """What one padding slot of a forward ``width`` draft tokens wide costs: the lone
        forward (``lone_rows`` rows drafting ``width``, the others plain) as measured, less the
        full curve at its tokens, over its (rows - lone_rows) x width padding slots (0 where not
        measured)."""
        bucket = self._bucket(batch)
        lone = self.lone.get(bucket)
        if width <= 0 or not lone or bucket not in self.table or bucket <= 1:
            return 0.0
        r = lone_rows(bucket)
        extra = _interpolate(lone, 1 + width) - _interpolate(self.table[bucket], 1.0 + r * width / bucket)
        return max(0.0, extra) / ((bucket - r) * width)

    def observe(self, batch: int, q: float, seconds: float, width: int | None = None,
                deep: int | None = None) -> None:
        """A real forward of ``batch`` rows over ``q`` new tokens each (a packed forward's mean;
        ``width``: its widest row's draft, None = every row q; ``deep``: its rows that drafted)
        took ``seconds``.

        An even forward (every row the same tokens: plain decoding, a static batch's drafts)
        corrects the curve: its ratio to the measured curve is counted at its token count. A
        ragged one (packed, some rows narrower than the widest) is counted apart, by its width
        and whether its attention was split, as its ratio to the whole current price
        (``verification``). Counted with the even ones at its rounded mean, a ragged forward
        whose padding was underpriced raised the plain step's price (most ragged forwards
        carry 1.1-1.5 tokens per row) and so made drafting look cheaper still."""
        if not (self.learns if self.learns is not None else self.model is not None):
            return  # a given table (a test's, a simulation's) is taken as it is
        bucket = self._bucket(batch)
        expected = self._measured_at(batch, q)
        if expected is None or seconds <= 0:
            return  # nothing measured to compare with (a fixed policy never prices this batch)
        if width is not None and _ragged(q - 1.0, width):
            price = expected * self._even_ratio(bucket, q) + self.padded(batch, q - 1.0, width)
            key = self._ragged_key(batch, width, deep)
            _update(self.ragged.setdefault(bucket, {}).setdefault(key, [1.0, 0.0]), seconds / price)
            return
        o = self.observed.setdefault(bucket, {}).setdefault(max(1, round(q)), [1.0, 0.0])
        if _update(o, seconds / expected) >= OBSERVED_MIN:
            self._curves.pop(bucket, None)

    def _measured_at(self, batch: int, q: float) -> float | None:
        """The measured curve's latency for ``batch`` rows: its bucket's, or, between two
        measured grid sizes, interpolated linearly in the rows (None: the bucket is not
        measured, or the size below it is not and the batch is not a grid size itself)."""
        bucket = self._bucket(batch)
        if bucket not in self.table:
            return None
        high = _interpolate(self.table[bucket], q)
        if batch == bucket:
            return high
        below = [b for b in self.batch_grid if b < batch]
        if not below or below[-1] not in self.table:
            return None
        low_b = below[-1]
        low = _interpolate(self.table[low_b], q)
        return low + (high - low) * (batch - low_b) / (bucket - low_b)

    def _ratios(self, batch: int) -> dict[int, float]:
        """The even forwards' observed ratios to the curve, per token count counted enough."""
        return {q: o[0] for q, o in self.observed.get(batch, {}).items() if o[1] >= OBSERVED_MIN}

    def _even_ratio(self, batch: int, q: float) -> float:
        ratios = self._ratios(batch)
        return _held(ratios, q) if ratios else 1.0

    def _corrected(self, batch: int) -> dict[int, float]:
        base = self.table[batch]
        ratios = self._ratios(batch)
        if not ratios:
            return base
        points = sorted(set(base) | set(ratios))
        return monotone({q: _interpolate(base, q) * _held(ratios, q) for q in points})


def lone_rows(batch: int) -> int:
    """The rows that draft in the padding's measurement (``measure_latency``'s ``lone``): the
    fewest whose attention is not split (``transformer.splits``), at most all rows but one."""
    return max(1, min(batch - 1, int(SPLIT_SHARE * batch) + 1))


def _ragged(per_row: float, width: int) -> bool:
    """Whether a forward carrying ``per_row`` draft nodes per row on average, the widest
    ``width``, has rows narrower than the widest (and so padding)."""
    return width > 0 and per_row < width - 1e-9


def _update(running: list[float], ratio: float) -> float:
    """Fold ``ratio`` into a [decayed mean, count] pair; returns the new count."""
    running[0] = OBSERVED_DECAY * running[0] + (1 - OBSERVED_DECAY) * ratio if running[1] else ratio
    running[1] += 1
    return running[1]


def _held(points: dict[int, float], q: float) -> float:
    """Linear interpolation between the points, held constant past the first and last."""
    xs = sorted(points)
    if q <= xs[0]:
        return points[xs[0]]
    if q >= xs[-1]:
        return points[xs[-1]]
    return _interpolate(points, q)


def _grid(q_max: int) -> list[int]:
    """The token counts measured: every one up to one past the CPU's kernel switch
    (``PACKED_FROM_ROWS``, see ``model/linear.py``: the curve is not linear there), then 9,
    17, 33, ... and q_max; latencies in between are interpolated."""
    qs, q = list(range(1, min(q_max, PACKED_FROM_ROWS + 1) + 1)), 9
    while q < q_max:
        qs.append(q)
        q = 2 * q - 1
    return sorted(set(qs + [q_max]))


def monotone(points: dict[int, float]) -> dict[int, float]:
    """The closest (least squares) non-decreasing curve through measured latencies: a forward
    over more tokens never costs less, and a noisy point must not make the policy think so
    (pool-adjacent-violators: neighbours out of order are replaced by their mean)."""
    xs = sorted(points)
    blocks: list[list[float]] = []  # [sum, count] per pooled run of points
    for x in xs:
        blocks.append([points[x], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(xs, values))


def _interpolate(points: dict[int, float], q: float) -> float:
    xs = sorted(points)
    if q in points:
        return points[q]
    lo = max((x for x in xs if x < q), default=xs[0])
    hi = min((x for x in xs if x > q), default=xs[-1])
    if lo == hi:  # outside the grid: extend the last segment linearly
        a, b = (xs[-2], xs[-1]) if q > xs[-1] and len(xs) > 1 else (xs[0], xs[min(1, len(xs) - 1)])
        slope = (points[b] - points[a]) / (b - a) if b != a else 0.0
        return max(points[lo] + slope * (q - lo), 1e-9)
    w = (q - lo) / (hi - lo)
    return points[lo] * (1 - w) + points[hi] * w


@torch.inference_mode()
def measure_latency(model: Transformer, batch: int, qs: Seq[int], prefix: int = 128, repeats: int = 5,
                    clock: Callable[[], float] = time.perf_counter, lone: bool = False
                    ) -> Any:
    """Median seconds of a forward over q new tokens per row after ``prefix`` cached tokens.
    With ``lone``: (that, the same for a packed forward in which the first ``lone_rows`` rows
    carry q tokens and the others one each), the second measured in the same rounds.
    Measured within the model's context: the prefix shrinks (and the widest q is capped) so
    that prefix + q never passes it. The token counts take turns, one forward each per round
    (after a warm-up round): a slow spell of a shared machine then slows every count alike
    instead of the one measured during it, so the curve's shape, which decides how much
    speculation pays, survives it."""
    device = model.device
    limit = model.config.max_context
    qs = sorted({min(q, limit) for q in qs})
    prefix = max(0, min(prefix, limit - max(qs)))
    cache = model.new_cache(batch, prefix + max(qs))
    vocab = model.config.vocab_size
    if prefix:
        model(torch.randint(0, vocab, (batch, prefix), device=device),
              torch.arange(prefix, device=device).expand(batch, prefix), cache, logits=False)
    inputs = {q: (torch.randint(0, vocab, (batch, q), device=device),  # [B, q]
                  (prefix + torch.arange(q, device=device)).expand(batch, q)) for q in qs}  # [B, q]
    kinds = [(q, False) for q in qs] + ([(q, True) for q in qs if q > 1] if lone else [])
    times: dict[tuple[int, bool], list[float]] = {kind: [] for kind in kinds}
    for i in range(repeats + 1):
        for q, alone in kinds:
            r = lone_rows(batch)
            packed = {"real": [q] * r + [1] * (batch - r)} if alone else {}
            t0 = clock()
            model(*inputs[q], cache, **packed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            cache.truncate(prefix)
            if i:  # the first round is a warm-up
                times[(q, alone)].append(clock() - t0)
    full = {q: statistics.median(times[(q, False)]) for q in qs}
    if not lone:
        return full
    return full, {1: full[min(qs)], **{q: statistics.median(times[(q, True)]) for q in qs if q > 1}}


@dataclass(slots=True)
class ProposeCost:
    """The proposer's time per step as a + b * budget (the largest draft budget a row had),
    fitted by least squares over the last ``window`` drafting steps: what asking for a draft
    of that size costs. A lookup proposer costs a constant; a draft model one forward per
    token; a tree drafter one step per level up to its depth. Until the budgets vary, all of
    the time is charged per token (the cautious reading: it discourages long drafts). (The
    policy leaves out the proposer's very first drafting step, which pays one-time costs.)"""

    window: int = 64
    samples: list[tuple[int, float]] = field(default_factory=list)
    fitted: tuple[float, float] | None = None  # fit() of the current samples (the policy asks ~10 times a step)

    def observe(self, budget: int, seconds: float) -> None:
        if budget <= 0:
            return
        self.samples.append((budget, seconds))
        if len(self.samples) > self.window:
            del self.samples[0]
        self.fitted = None

    def estimate(self, budget: int) -> float:
        if budget <= 0 or not self.samples:
            return 0.0
        if self.fitted is None:
            self.fitted = self.fit()
        a, b = self.fitted
        return max(a + b * budget, 0.0)

    def fit(self) -> tuple[float, float]:
        ds = [float(d) for d, _ in self.samples]
        ts = [t for _, t in self.samples]
        mean_d, mean_t = statistics.fmean(ds), statistics.fmean(ts)
        var = statistics.fmean([(d - mean_d) ** 2 for d in ds])
        if var < 0.25:
            return 0.0, mean_t / mean_d
        b = statistics.fmean([(d - mean_d) * (t - mean_t) for d, t in zip(ds, ts)]) / var
        b = max(b, 0.0)
        if mean_t - b * mean_d < 0.0:  # the line through the origin that fits best, not a steeper one
            return 0.0, sum(d * t for d, t in zip(ds, ts)) / sum(d * d for d in ds)
        return mean_t - b * mean_d, b
