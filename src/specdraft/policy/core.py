"""How far to speculate: fixed draft length, or adaptive with batch-size gating.

The adaptive policy keeps, per request, an estimate of the per-token acceptance probability
alpha: decaying counts of accepted and rejected draft positions over the request's recent
drafts, plus a prior worth one draft position: ``prior`` for the first requests, then the
alpha of every earlier request's outcomes pooled (decayed), so that a method that is rarely
accepted on this traffic does not pay for optimistic first drafts in every new request. With alpha, a draft of k tokens is expected to emit
E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per target pass (bonus included). A cost model
gives the measured latency of one target forward over q new tokens per row at the current
batch size. Each step the policy picks the draft length K that makes the batch progress
fastest per second of (verification + proposing) time, and K = 0 (plain decoding) whenever
speculation would not pay. What "progress" means depends on how the batch is run:

- a *static* batch (``Engine.generate``: every row runs to its end, and the batch ends with its
  last row) finishes when its slowest row does. The caller passes each row's remaining tokens
  r and, with ``objective="batch-end"`` (the default), the policy minimises the time to the
  end, cost(K) * max_rows r_row / E_row(K): a row that nobody can draft for sets the pace,
  and speeding the others up only adds cost.
- a *continuously refilled* batch (``objective="throughput"``, or no remaining counts) is
  measured by throughput, sum_rows E_row(K) / cost(K).

Every speculative choice must beat plain decoding by ``margin`` (5%) in these estimates, not
merely match it: alpha and the cost curve are estimates, and a step priced as a small gain can
be a loss. At large batch the verification of extra tokens is no longer free, so speculation
switches itself off there.
While off, the policy probes (drafts up to ``probe_k`` tokens after ``probe_every`` idle steps)
only where a probe is cheap (its forward and its drafting together cost at most ``probe_cost``
plain steps; a costly proposer probes with fewer tokens, or not at all), so that a request whose
text becomes predictable again is noticed. A probe that is not repaid (its rows accepted fewer
tokens than its wider forward cost more than a plain one: at a large batch one accepted token is
not enough) doubles the wait before the next (up to ``PROBE_GAP_MAX`` steps); one that pays
resets it: on traffic where speculation does not pay, probing costs little. A probe asks only
an eighth of the live rows (``PROBE_ROWS``, at least one; the least setup first, then in turn):
the evidence is pooled, and a proposer that must catch up on each row pays for those alone.

Each request also keeps its own brake, whatever the pooled and label evidence say: once its
last ``stop_after`` drafts all had no token accepted, the row stops drafting for
``probe_every`` steps, then tries again; each failed retry doubles the wait (up to
``PROBE_GAP_MAX``) and a draft that pays releases it. A short request whose drafts keep failing
so loses at most a few failed verifications, however well the method did elsewhere.

A proposer may first have to catch up on a request's context before it can draft (a draft
model's own prefill of a long prompt): the caller passes that *setup* time per row. The policy
pays it only where the speculation it buys is expected to repay it over the rest of the
request (the time to the end with setup and drafts against plain decoding's). A probe may pay
a setup only if it is small next to the plain steps since the last probe
(``PROBE_SETUP_SHARE``), so that an idle proposer can still come back in a long generation.

A proposer whose drafting costs at most ``look_cost`` of a plain target step (measured: the
lookup methods) is not gated before it runs: it drafts the full k, and the gate, probes
included, acts on the drafts in ``trim`` (a draft's label says more than the row's alpha).

After proposing, drafts are *trimmed*, in two ways. First, a proposer may label a draft with the kind of evidence
behind it (the n-gram proposer: the length of the suffix it matched). The policy keeps decayed
accept/reject counts per label, across requests, and once a label has ``label_min`` outcomes
it cuts that label's drafts to the depth that maximises expected tokens per second with the
label's own alpha, down to nothing: a 2-token match in creative text is rarely worth the
verification it costs, a 4-token match in a summary is. Second, all drafts are cut to the one
depth that pays for the whole batch now that it is known which rows found a draft. The
verification forward is packed (``Engine._verify``): a row's projections, MLP and LM head are
paid for its own nodes, not for the widest row's, while attention keeps the padded width. So a
forward with N draft nodes over B rows, the widest W, is priced as B rows of 1 + N / B tokens
on the measured curve plus the measured padding cost of width W (``verifying``,
``CostModel.verification``). Trimming depends only on past outcomes and the drafts, so it
keeps the output exact.

A proposer may score its nodes (``Draft.confidence``: EAGLE's path probabilities; see
``policy/scored.py``). Its drafts are then priced by their own scores, calibrated per depth with
what was accepted, instead of by a chain's alpha: a tree of 8 nodes of which 2 are accepted on
average is worth 2 tokens however its nodes are spread. The budget is the number of nodes n with
the most progress per second, each row expected to yield what its recent drafts' n most
confident nodes did (every ``probe_every`` drafting steps, the whole k is asked for, so that
what more nodes would yield stays known); trimming keeps the n most confident nodes of every row's draft, for the n
that pays for the whole batch given the confidences actually drafted. Such drafts do not use the
per-request brake: each row's expectations are scaled by its own record instead (the tokens its
drafts yielded against what they were expected to).
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Sequence as Seq

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.policy.config import PolicyConfig
from specdraft.policy.cost import CostModel, ProposeCost
from specdraft.policy.evidence import (LABEL_DECAY, PROBE_GAP_MAX, Evidence, Hold, Realism, decay_add,
                                       expected_tokens, progress)
from specdraft.policy.plan import Plan, Probe
from specdraft.policy.scored import Calibration, Outlook
from specdraft.proposers.base import move_key

HORIZON_TOKENS = 64  # tokens a row is assumed to have left when the caller does not say
PROBE_SETUP_SHARE = 0.02  # probes' setups may cost up to this share of the time between probes
PROBE_ROWS = 0.125  # a probe (budgeted before drafting) asks this share of the live rows, at least one


def _share(sizes: Seq[int]) -> float:
    """The share of the rows with something to draft (a budget, a draft)."""
    return sum(n > 0 for n in sizes) / max(len(sizes), 1)


class Policy:
    def __init__(self, config: PolicyConfig = PolicyConfig(), cost: CostModel | None = None) -> None:
        if config.kind == "adaptive" and cost is None:
            raise SpecdraftError("the adaptive policy needs a cost model")
        self.config = config
        self.cost = cost
        self.evidence: dict[int, Evidence] = {}
        self.by_label: dict[str, Evidence] = {}  # across requests: draft label -> outcomes
        self.pooled = Evidence()  # across requests: every outcome (the prior of new requests)
        self.holds: dict[int, Hold] = {}  # per row: its failure streak and how long it waits
        self.idle_steps = 0  # consecutive steps the adaptive policy chose not to speculate
        self.probe: Probe | None = None  # the last step's probe, until the next budgets() settles it
        self.probe_gap = config.probe_every  # idle steps before the next probe
        self.propose_costs: dict[int, ProposeCost] = {}  # per batch size: the proposer's time against its budget
        self.propose_warm = False  # the proposer's first drafting step (one-time costs, not counted) is past
        self.calibration: dict[str, Calibration] = {}  # draft label -> its confidences against outcomes
        self.outlooks: dict[int, Outlook] = {}  # per row: what its confident drafts were expected to yield
        self.pooled_outlook = Outlook(trust=config.trust)  # the same across requests (where a new request starts)
        self.since_full = 0  # drafting steps since the last one with the whole budget k (scored drafts)
        self.realism = Realism()  # unscored drafts: the extra tokens expected against those accepted
        self.expected_extra: dict[int, float] = {}  # row -> what its kept draft was expected to add (this step)
        self.probe_turn = 0  # rotates the rows a probe asks (``_probe_rows``)

    # what the policy has learned (per row and across requests), without the cost model
    _MEMORY = ("evidence", "by_label", "pooled", "holds", "idle_steps", "probe", "probe_gap",
               "propose_costs", "propose_warm", "calibration", "outlooks", "pooled_outlook",
               "since_full", "realism", "expected_extra", "probe_turn")

    def snapshot(self) -> dict[str, object]:
        """A copy of what the policy has learned, for ``restore``: a benchmark's repeats each
        start from the same state (the measured cost model is kept, it is a property of the
        machine)."""
        return copy.deepcopy({name: getattr(self, name) for name in self._MEMORY})

    def restore(self, snapshot: dict[str, object]) -> None:
        for name, value in copy.deepcopy(snapshot).items():
            setattr(self, name, value)

    def prepare(self, batch: int) -> None:
        """Measure the cost model for this batch size now (it is measured once per size)."""
        if self.config.kind == "adaptive" and self.cost is not None:
            self.cost.latency(batch, 1, 1 + self.config.k)

    def begin(self, row: int) -> None:
        self.evidence[row] = Evidence(prior=self.pooled_alpha())
        self.holds[row] = Hold(gap=self.config.probe_every)
        self.outlooks[row] = self.pooled_outlook.restart(self._restart_weight)

    def pooled_alpha(self) -> float:
        """The alpha of all outcomes so far, once there are ``label_min`` of them (else the
        configured prior): what a new request starts from."""
        if self.pooled.outcomes < self.config.label_min:
            return self.config.prior
        return self.pooled.alpha(self.config.prior)

    def end(self, row: int) -> None:
        self.evidence.pop(row, None)
        self.holds.pop(row, None)
        self.outlooks.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        """The row's request moved to row ``dst`` (the scheduler packs its slots)."""
        for table in (self.evidence, self.holds, self.outlooks, self.expected_extra):
            move_key(table, src, dst)

    def held(self, row: int) -> bool:
        """Whether the row's own recent drafts all failed (``stop_after`` in a row) and it is
        waiting: it does not draft, whatever the pooled or label evidence says."""
        hold = self.holds.get(row)
        return hold is not None and hold.wait > 0

    def alpha(self, row: int) -> float:
        return self.evidence.get(row, Evidence()).alpha(self.config.prior)

    def budgets(self, caps: Seq[int], batch: int, remaining: Seq[int] | None = None,
                setup: Seq[float] | None = None) -> Plan:
        """This step's plan (``Plan``): the draft length per row, and what ``trim`` is to do with
        the drafts. caps[row]: the most that row may draft (0 = idle/finished). batch: rows in
        the target forward (its cost depends on it). remaining[row]: tokens the row may still
        emit, for a static batch (see the module doc); None = throughput. setup[row]: seconds the
        proposer must spend before it can draft for the row (None = none; see the module doc)."""
        k = self.config.k
        if self.config.kind == "fixed":
            return Plan([min(k, c) for c in caps], batch, "fixed", remaining)
        self._settle_probe()
        for hold in self.holds.values():
            hold.wait = max(0, hold.wait - 1)
        caps = [0 if self.held(row) else c for row, c in enumerate(caps)]
        paying = sum(t for t, c in zip(setup or (), caps) if c > 0)  # rows catch up together
        if paying == 0 and self._cheap_to_look(batch):  # drafting is nearly free: see the drafts first
            return Plan([min(k, c) for c in caps], batch, "look", remaining)
        if self.pooled_outlook.known:  # the proposer scores its nodes: budget by their expected yield
            best = self.scored_length(caps, batch, self._remaining(remaining))
            self.since_full = 0 if best == k else self.since_full + (best > 0)
            if self.since_full >= self.config.probe_every:  # now and then the whole budget: the
                best, self.since_full = k, 0  # outlook learns what more nodes would yield (trim still cuts)
        else:
            best = self.best_length(caps, batch, self._remaining(remaining))
        if best > 0 and paying > 0 and not self._repays(best, paying, caps, batch, remaining):
            best = 0
        if best == 0:  # a probe, if one is due, asks a few rows: their catch-ups are its price
            caps = self._probe_rows(caps, setup)
            paying = sum(t for t, c in zip(setup or (), caps) if c > 0)
        best, probe = self._gate(best, batch, paying, _share(caps))
        if probe:  # its outcome is settled at the next step (trim() adds what it must gain)
            self.probe = Probe()
            self.probe_turn += sum(c > 0 for c in caps)
        return Plan([min(best, c) for c in caps], batch, "probe" if probe else "draft", remaining)

    def _repays(self, k: int, setup: float, caps: Seq[int], batch: int, remaining: Seq[int] | None) -> bool:
        """Whether drafting k tokens per step for the rest of the batch, after ``setup``
        seconds, ends sooner than plain decoding (rows' remaining tokens: ``remaining``, else
        ``HORIZON_TOKENS`` each)."""
        assert self.cost is not None
        live = [row for row, c in enumerate(caps) if c > 0]
        left = [remaining[row] if remaining is not None else HORIZON_TOKENS for row in live]
        q_max = 1 + self.config.k
        steps = max(r / self.realism.scale(expected_tokens(self.alpha(row), min(k, caps[row]))) for row, r in zip(live, left))
        nodes = [min(k, c) for c in caps]
        spec = setup + steps * (self.verifying(batch, nodes) + self.proposing(batch, k))
        return spec * self.bar < max(left) * self.cost.latency(batch, 1, q_max)

    def _probe_rows(self, caps: Seq[int], setup: Seq[float] | None) -> list[int]:
        """The caps of a probe: ``PROBE_ROWS`` of the live rows (at least one) keep theirs, those
        with the least setup first, then in turn (``probe_turn``). The evidence a probe gathers
        is pooled across rows, so a few rows tell whether the method pays again; a proposer
        that must first catch up on each row (an MTP module or EAGLE head fed the backlog of a
        long plain spell) paid every live row's catch-up when a probe asked them all (at 16
        rows, MTP lost 3.5% to its probes)."""
        live = [row for row, c in enumerate(caps) if c > 0]
        n = max(1, math.ceil(PROBE_ROWS * len(live)))
        if n >= len(live):
            return list(caps)
        price = setup or [0.0] * len(caps)
        chosen = set(sorted(live, key=lambda row: (price[row], (row - self.probe_turn) % len(caps)))[:n])
        return [c if row in chosen else 0 for row, c in enumerate(caps)]

    def _settle_probe(self) -> None:
        """After a probe step: the next probe comes sooner if it paid, later if not."""
        if self.probe is not None:
            self.probe_gap = self.config.probe_every if self.probe.paid else min(2 * self.probe_gap, PROBE_GAP_MAX)
            self.probe = None

    def _gate(self, best: int, batch: int, setup: float = 0.0, share: float = 1.0) -> tuple[int, bool]:
        """(``best``, False) for a chosen draft length, or after ``probe_gap`` idle steps in a
        row a cheap probe of up to ``probe_k`` tokens (length, True); ``setup``: seconds the
        proposer would spend first, ``share``: of the rows, those that would draft (see
        ``_probe_length``)."""
        if best > 0:
            self.idle_steps = 0
            return best, False
        self.idle_steps += 1
        length = self._probe_length(batch, setup, share) if self.idle_steps >= self.probe_gap else 0
        if length:
            self.idle_steps = 0
        return length, length > 0

    def _cheap_to_look(self, batch: int) -> bool:
        """Whether drafting the full k costs at most ``look_cost`` of one plain target step, so
        the decision can wait until the drafts (and their labels) are seen."""
        assert self.cost is not None
        plain = self.cost.latency(batch, 1, 1 + self.config.k)
        look = self.config.look_cost
        return look > 0 and self.proposing(batch, self.config.k) <= look * plain

    def _remaining(self, remaining: Seq[int] | None) -> Seq[int] | None:
        """The remaining counts the objective uses (none for throughput)."""
        return remaining if self.config.objective == "batch-end" else None

    def _probe_length(self, batch: int, setup: float = 0.0, share: float = 1.0) -> int:
        """The longest probe (up to ``probe_k`` tokens) whose forward (``share`` of the rows
        drafting) and drafting cost at most ``probe_cost`` plain steps (0: none does). A
        proposer's setup must fit in what is left of that allowance, or in
        ``PROBE_SETUP_SHARE`` of the plain steps since the last step
        that drafted or probed (``idle_steps``): probing then costs at most that share of the time
        however it goes, and an idle draft model or head still catches up, after long enough,
        to find out whether drafting pays (measured against the gap between probes instead, a
        prompt backlog of a few plain steps was never fed: the row never drafted again)."""
        assert self.cost is not None
        q_max = 1 + self.config.k
        plain = self.cost.latency(batch, 1, q_max)
        allowed = self.config.probe_cost * plain
        for n in range(self.config.probe_k, 0, -1):
            probe = self.cost.verification(batch, n * share, n, q_max, round(share * batch)) + self.proposing(batch, n)
            if probe <= allowed and setup <= max(allowed - probe, PROBE_SETUP_SHARE * self.idle_steps * plain):
                return n
        return 0

    def best_length(self, caps: Seq[int], batch: int, remaining: Seq[int] | None = None) -> int:
        """The K in 0..k with the most progress per second (see the module doc). A row with
        caps 0 is not generating (when ``remaining`` is given, a live row with remaining > 0
        but caps 0 still counts, as a row that emits one token per step)."""
        assert self.cost is not None
        live = [row for row, c in enumerate(caps) if c > 0 or (remaining is not None and remaining[row] > 0)]
        if not any(caps[row] > 0 for row in live):
            return 0
        alphas = [(self.alpha(row), caps[row]) for row in live]
        left = None if remaining is None else [remaining[row] for row in live]
        best, best_rate = 0, 0.0
        for k in range(0, self.config.k + 1):
            gain = progress([self.realism.scale(expected_tokens(a, min(k, c))) for a, c in alphas], left)
            nodes = [min(k, c) for c in caps]
            cost = self.verifying(batch, nodes) + self.proposing(batch, k)
            rate = gain / cost * (self.bar if k == 0 else 1.0)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def scored_length(self, caps: Seq[int], batch: int, remaining: Seq[int] | None = None) -> int:
        """For a proposer whose drafts carry confidences: the budget n in 0..k with the most
        progress per second, each live row expected to gain its outlook's yield for n nodes
        (``scored``), at the cost of verifying n nodes and proposing with budget n."""
        assert self.cost is not None
        live = [row for row, c in enumerate(caps) if c > 0 or (remaining is not None and remaining[row] > 0)]
        if not any(caps[row] > 0 for row in live):
            return 0
        q_max = 1 + self.config.k
        left = None if remaining is None else [remaining[row] for row in live]
        outlooks = [self.outlooks.get(row, self.pooled_outlook) for row in live]
        best, best_rate = 0, self.bar * progress([1.0] * len(live), left) / self.cost.latency(batch, 1, q_max)
        for n in range(1, self.config.k + 1):
            gain = progress([1.0 + o.at(min(n, caps[row])) for o, row in zip(outlooks, live)], left)
            nodes = [min(n, c) for c in caps]
            rate = gain / (self.verifying(batch, nodes) + self.proposing(batch, n))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def observe(self, row: int, draft: Draft, acceptance: Acceptance) -> None:
        depth = max(draft.depths(), default=0)
        if depth == 0 or row not in self.evidence:
            return
        rejected = 1.0 if acceptance.accepted < depth else 0.0
        decay_add(self.evidence[row], self.config.decay, acceptance.accepted, rejected)
        decay_add(self.pooled, LABEL_DECAY, acceptance.accepted, rejected)
        scored = draft.confidence is not None
        if self.config.kind == "adaptive" and not scored:  # (the fixed policy always drafts k)
            self.holds[row].observe(acceptance.accepted, self.config.stop_after, self.config.probe_every)
        if self.probe is not None:
            self.probe.gain += acceptance.accepted
        if row in self.expected_extra:  # a draft whose yield trim() expected
            self.realism.observe(self.expected_extra.pop(row), acceptance.accepted)
        if draft.label:
            e = self.by_label.setdefault(draft.label, Evidence())
            decay_add(e, LABEL_DECAY, acceptance.accepted, rejected)
        if scored:  # the row's record against its drafts' expected yield (before they teach the calibration)
            calibration = self.calibration.setdefault(draft.label, Calibration())
            self.outlooks.setdefault(row, Outlook(trust=self.config.trust)).observe(calibration.gains(draft)[-1], acceptance.accepted,
                                                             self.config.decay)
            calibration.observe(draft, acceptance, LABEL_DECAY)

    def label_alpha(self, label: str) -> float | None:
        """The label's own alpha, once it has ``label_min`` outcomes (else None)."""
        e = self.by_label.get(label)
        if e is None or e.outcomes < self.config.label_min:
            return None
        return e.alpha(self.config.prior)

    def trim(self, drafts: list[Draft], plan: Plan, live: Seq[bool] | None = None) -> list[Draft]:
        """The drafts this step verifies, from the proposer's drafts for ``plan`` (what
        ``budgets`` chose): each labelled draft cut to the depth its label's alpha pays for, then
        every draft to the one depth that pays for the whole batch (``batch_depth``; not on a
        probe step; on a look step this is the gate). live[row]: the row is generating (default:
        every row). The fixed policy keeps the drafts as they are."""
        if plan.mode == "fixed" or self.config.kind != "adaptive":
            return drafts
        batch, remaining = plan.batch, self._remaining(plan.remaining)
        out = [Draft.empty() if self.held(row) else d for row, d in enumerate(self.trim_labels(drafts, batch))]
        scored = any(d.confidence is not None and len(d) for d in out)
        if scored:
            gains = self._expect(out, plan.budgets)
        if plan.mode == "probe":
            self.probe = Probe(needs=self._probe_needs(out, batch, live))  # (observe() adds its gain)
            return out
        if scored:
            size = self.batch_size_scored(out, gains, batch, live, remaining)
        else:
            size = self.batch_depth(out, batch, live, remaining)
        probe = False
        if plan.mode == "look" and any(len(d) for d in out):  # the budget was not gated: gate here
            size, probe = self._gate(size, batch, share=_share([len(d) for d in out]))
        kept = [d.top(size) if d.confidence is not None else d.up_to_depth(size) for d in out]
        if probe:  # the gate chose a probe (a cheap proposer's): its drafts are for evidence
            self.probe = Probe(needs=self._probe_needs(kept, batch, live))
        elif not scored:
            on = [True] * len(kept) if live is None else live
            self.realism.decay(LABEL_DECAY)
            self.expected_extra = {row: expected_tokens(self._draft_alpha(row, d), max(d.depths())) - 1.0
                                   for row, (d, o) in enumerate(zip(kept, on)) if o and len(d)}
        return kept

    def _probe_needs(self, drafts: Seq[Draft], batch: int, live: Seq[bool] | None) -> float:
        """The accepted tokens with which a probe of these drafts runs at plain decoding's rate:
        its live rows times the share its forward costs more than a plain one. A probe that
        gets fewer is not repaid (the next one waits longer) even if some row accepted: at a
        large batch one accepted token does not pay for a wider forward."""
        assert self.cost is not None
        q_max = 1 + self.config.k
        rows = sum(live) if live is not None else len(drafts)
        sizes = [len(d) for d in drafts]
        ratio = self.verifying(batch, sizes) / self.cost.latency(batch, 1, q_max)
        return rows * (ratio - 1.0)

    def _expect(self, drafts: Seq[Draft], asked: Seq[int]) -> list[list[float]]:
        """Each draft's calibrated expected yield per number of nodes kept (``scored``), scaled
        by its row's record; the unscaled yields are added to the row's outlook and the pooled one.
        asked[row]: the budget the row's draft was asked for."""
        out = []
        for row, d in enumerate(drafts):
            if d.confidence is None or not len(d):
                out.append([0.0])
                continue
            c = self.config
            if not self.pooled_outlook.known and c.outlook_prior > 0:  # the first scored draft: from the prior
                self.pooled_outlook = Outlook.prior(c.prior, c.k, c.outlook_prior, c.trust)
            if not self.outlooks.get(row, Outlook()).known:
                self.outlooks[row] = self.pooled_outlook.restart(self._restart_weight)
            gains = self.calibration.get(d.label, Calibration()).gains(d)
            gains += gains[-1:] * (asked[row] - len(d) if row < len(asked) else 0)  # asked for more: that was all it had
            outlook = self.outlooks[row]
            outlook.add(gains, self.config.decay)
            self.pooled_outlook.add(gains, LABEL_DECAY)
            out.append([g * outlook.realism for g in gains])
        return out

    def batch_size_scored(self, drafts: Seq[Draft], gains: Seq[Seq[float]], batch: int,
                          live: Seq[bool] | None = None, remaining: Seq[int] | None = None) -> int:
        """The number n of most confident nodes to keep in every row's draft that makes the
        batch progress fastest per second: row i emits 1 + gains[i][min(n, its nodes)] tokens,
        the forward costs what its nodes cost (``verifying``: packed, a row pays for its own)."""
        assert self.cost is not None
        live = [True] * len(drafts) if live is None else live
        widest = max(len(d) for d in drafts)
        rows = [g for g, on in zip(gains, live) if on]
        left = None if remaining is None else [r for r, on in zip(remaining, live) if on]
        q_max = 1 + self.config.k
        best, best_rate = 0, self.bar * progress([1.0] * len(rows), left) / self.cost.latency(batch, 1, q_max)
        for n in range(1, widest + 1):
            gain = progress([1.0 + g[min(n, len(g) - 1)] for g in rows], left)
            kept = [min(n, len(d)) for d in drafts]
            rate = gain / self.verifying(batch, kept)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def trim_labels(self, drafts: list[Draft], batch: int) -> list[Draft]:
        """Cut each labelled draft to the depth that maximises expected tokens per second with
        its label's alpha (drafts whose label has too little evidence are left alone)."""
        assert self.cost is not None
        out = []
        for d in drafts:
            alpha = self.label_alpha(d.label) if d.label and len(d) and d.confidence is None else None
            if alpha is None:
                out.append(d)
                continue
            depths = d.depths()
            rate = [self.realism.scale(expected_tokens(alpha, k))
                    / self.cost.latency(batch, 1 + sum(x <= k for x in depths), 1 + self.config.k)
                    * (self.bar if k == 0 else 1.0) for k in range(max(depths) + 1)]
            out.append(d.up_to_depth(max(range(len(rate)), key=rate.__getitem__)))
        return out

    def batch_depth(self, drafts: Seq[Draft], batch: int, live: Seq[bool] | None = None,
                    remaining: Seq[int] | None = None) -> int:
        """The depth K to cut every draft to that makes the batch progress fastest per second
        (``progress``): each live row emits E(alpha, min(K, its depth)) tokens (alpha its
        label's if known, else its row's; 1 for a row without a draft), and the forward costs
        what the nodes kept cost (``verifying``). The budget was chosen before the proposer
        ran; here the rows that got no draft gain nothing and, the forward being packed, cost
        nothing more either."""
        assert self.cost is not None
        live = [True] * len(drafts) if live is None else live
        depths = [sorted(d.depths()) for d in drafts]  # per row: its nodes' depths, ascending
        deepest = max((ds[-1] for ds in depths if ds), default=0)
        if deepest == 0:
            return 0
        alphas = [self._draft_alpha(row, d) for row, d in enumerate(drafts)]
        rows = [(a, ds[-1] if ds else 0) for a, ds, on in zip(alphas, depths, live) if on]
        left = None if remaining is None else [r for r, on in zip(remaining, live) if on]
        best, best_rate = 0, self.bar * progress([1.0] * len(rows), left) / self.cost.latency(batch, 1, 1 + self.config.k)
        for k in range(1, deepest + 1):
            gain = progress([self.realism.scale(expected_tokens(a, min(k, depth))) for a, depth in rows], left)
            kept = [bisect_right(ds, k) for ds in depths]  # per row: the nodes it keeps
            rate = gain / self.verifying(batch, kept)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _draft_alpha(self, row: int, d: Draft) -> float:
        alpha = self.label_alpha(d.label) if d.label else None
        return self.alpha(row) if alpha is None else alpha

    @property
    def _restart_weight(self) -> float:
        """The most drafts' weight a new request's outlook gives the pooled means."""
        return max(1.0, self.config.outlook_prior)

    @property
    def bar(self) -> float:
        """What plain decoding's rate is multiplied by before a speculative choice is compared
        with it (``PolicyConfig.margin``)."""
        return 1.0 + self.config.margin

    def observe_propose_time(self, budget: int, seconds: float, batch: int = 1) -> None:
        """One drafting step for ``batch`` rows, with budgets up to ``budget``, took ``seconds``.
        The proposer's very first one is not counted: it pays one-time costs (buffers, caches,
        lazy set-up; in int4 an MTP module's first proposal took 11 ms, the next 3), and an
        estimate that high kept the policy from ever drafting again. Only the first: left out
        at every batch size's first step, the sizes a draining batch passes through once each
        stayed unmeasured and were priced from much smaller ones (below)."""
        if budget <= 0:
            return
        if not self.propose_warm:
            self.propose_warm = True
            return
        self.propose_costs.setdefault(batch, ProposeCost()).observe(budget, seconds)

    def observe_verify_time(self, batch: int, q: float, seconds: float, width: int | None = None,
                            deep: int | None = None) -> None:
        """A verification forward of ``batch`` rows over ``q`` tokens each (packed: the mean;
        ``width``: the widest row's draft; ``deep``: the rows that drafted) took ``seconds``: it
        corrects the cost model's measured curve (``CostModel.observe``)."""
        if self.config.kind == "adaptive" and self.cost is not None:
            self.cost.observe(batch, q, seconds, width, deep)

    def verifying(self, batch: int, sizes: Seq[int]) -> float:
        """The expected seconds of a verification forward whose rows carry ``sizes`` draft
        nodes each, priced at ``batch`` rows. The forward is packed (``Engine._verify``): a row's
        projections and MLP are paid for its own nodes, not the widest row's; attention keeps
        the padded width (``CostModel.verification``)."""
        assert self.cost is not None
        deep = sum(n > 0 for n in sizes)
        return self.cost.verification(batch, sum(sizes) / max(len(sizes), 1), max(sizes, default=0),
                                      1 + self.config.k, deep)

    def proposing(self, batch: int, budget: int) -> float:
        """The proposer's expected seconds for a budget at this batch size: measured at this
        size; else the nearest sizes measured, scaled by the rows (drafting is mostly per row:
        an MTP module's 8-token tree took 5 ms for 8 rows and 50 ms for 63), a larger size's
        time being the bound above; else 0 (a proposer is taken as cheap until measured).
        Unscaled, a draining batch's new sizes were priced at a few rows' cost and the policy
        drafted whole trees at 60 rows to keep one token of each."""
        measured = {b: c for b, c in self.propose_costs.items() if c.samples}
        if batch in measured:
            return measured[batch].estimate(budget)
        below = max((b for b in measured if b < batch), default=None)
        above = min((b for b in measured if b > batch), default=None)
        bound = measured[above].estimate(budget) if above is not None else None
        if below is None:  # only larger sizes measured: their time per row (fixed costs make it more)
            return 0.0 if bound is None else bound * batch / above
        scaled = measured[below].estimate(budget) * batch / below
        return scaled if bound is None else min(scaled, bound)
