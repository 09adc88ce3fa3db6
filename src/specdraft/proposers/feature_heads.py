"""Drafting from a feature head (an EAGLE-3 head, :mod:`specdraft.heads.eagle`, or an MTP
module, :mod:`specdraft.heads.mtp`): chains, and EAGLE-2's dynamic trees.

Each row keeps the head's keys/values of its committed positions (``HeadCache``) and the
target's tap features of positions it has not fed yet (the prompt after the prefill, then the
root and the accepted nodes of each verification). A proposal first feeds those (exact
entries: the target's fused taps and the committed tokens); the last one is the anchor,
whose output predicts the token after the bonus token. The prompt is fed at the row's first
proposal, not in the prefill: a row that never drafts (a busy server, where the policy keeps
speculation off) never pays for it. Such a backlog is priced for the policy
(``setup_seconds``, from a measured time per entry), as a draft model's catch-up is, and fed
row by row so that the other rows' few entries are not padded to its length. Then:

- depth 1: the anchor's ``topk`` likeliest tokens;
- depth d + 1: the ``topk`` depth-d nodes with the highest cumulative draft log-probability
  are fed to the head (each with its parent's state and seeing only its own ancestors'
  entries), and each gives its ``topk`` likeliest children;
- the draft keeps the ``N`` nodes of highest cumulative log-probability (N = the row's
  budget), which is a tree since a child never scores above its parent. Each node carries
  its path's probability as its ``confidence``: the adaptive policy calibrates it against
  what is accepted and keeps as many nodes as pay for their verification.

``topk=1`` is a chain. Drafts are deterministic (the top k of the head's distribution), so
sampled rows stay exact. Drafted entries are scratch: the committed length only grows by
exact entries.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.accept import Acceptance
from specdraft.draft import Draft
from specdraft.errors import SpecdraftError
from specdraft.heads.eagle_checkpoint import load_eagle
from specdraft.heads.feature_head import FeatureHead
from specdraft.heads.mtp_checkpoint import load_mtp, load_native_mtp
from specdraft.heads.shipped import shipped_heads
from specdraft.model import fastpath
from specdraft.model.kv_cache import KVCache
from specdraft.proposers.base import FeatureRequest, Features, ProposerContext, Verified
from specdraft.proposers.head_state import HeadCache, PendingTaps
from specdraft.sequence import Sequence

BACKLOG_MIN = 32  # pending entries from which a row's catch-up is priced and fed on its own

@dataclass(frozen=True, slots=True)
class EagleOptions:
    """path: a head folder (``specdraft train eagle``; empty: the head shipped for the model).
    depth: draft steps; topk: children per expanded node and nodes expanded per depth (1 = a
    chain). The tree's size is the policy's budget."""

    path: str = ""
    depth: int = 6
    topk: int = 4

    def __post_init__(self) -> None:
        _check_tree(self.depth, self.topk, "eagle")


@dataclass(frozen=True, slots=True)
class MtpOptions:
    """path: an MTP module folder (``specdraft train mtp``; empty: the one shipped for the
    model); native: use the MTP layer the target's own checkpoint ships (DeepSeek-V3,
    Qwen3-Next or MiMo names) instead. depth, topk: as for eagle (the module is chained)."""

    path: str = ""
    native: bool = False
    depth: int = 6
    topk: int = 4

    def __post_init__(self) -> None:
        _check_tree(self.depth, self.topk, "mtp")


def _check_tree(depth: int, topk: int, name: str) -> None:
    if not 1 <= depth <= 32 or not 1 <= topk <= 16:
        raise SpecdraftError(f"{name}: need 1 <= depth <= 32 and 1 <= topk <= 16, got {depth}, {topk}")


class FeatureHeadProposer:
    def __init__(self, head: FeatureHead, context: ProposerContext, options: EagleOptions | MtpOptions,
                 name: str = "eagle") -> None:
        self.name = name
        target = context.target
        self.head = head.to(device=target.device, dtype=target.dtype).eval()
        if getattr(target.lm_head, "packed", None) is not None:  # the target runs packed: so does the head
            for m in self.head.modules():
                if hasattr(m, "pack"):
                    m.pack()
        if options.topk > head.config.draft_vocab:
            raise SpecdraftError(f"{name}: topk={options.topk} is more than the head's {head.config.draft_vocab} tokens")
        self.features = FeatureRequest(taps=head.config.taps, prompt=True)
        self.label = name
        self.embed = target.embed
        self.cos, self.sin = target.rope_cos, target.rope_sin  # [S, D]
        self.options = options
        self.trees = options.topk > 1  # a budget of nodes, not of depth (engine: caps by the room)
        self.vocab_ids = head.target_ids.to(target.device)  # [N]
        self.cache = HeadCache(head.config.num_kv_heads, head.config.head_dim, target.dtype, target.device)
        self.rows = PendingTaps(head.config.taps)
        self.fast = fastpath.head_layer(self.head)  # the head's step from C++ (None: the Python layer)
        self.seconds_per_entry: float | None = None  # catch-up time per fed entry (measured)
        self.setup_spent = 0.0  # seconds the last propose spent on catch-ups (priced as setup, not drafting)

    # -- row lifecycle -------------------------------------------------------------------------
    def begin(self, row: int, seq: Sequence) -> None:
        self.rows.begin(row)

    def prefilled(self, row: int, features: Features) -> None:
        """Keep the prompt's features: they are fed at the row's first proposal (module doc)."""
        self.rows.prefilled(row, features)

    def observe(self, row: int, draft: Draft, acceptance: Acceptance, verified: Verified) -> None:
        self.rows.observe(row, acceptance, verified)

    def end(self, row: int) -> None:
        self.rows.end(row)

    def move(self, src: int, dst: int) -> None:
        self.rows.move(src, dst, self.cache)

    # -- cost ---------------------------------------------------------------------------------
    def setup_seconds(self, seqs: Seq[Sequence | None]) -> list[float]:
        """Per row: the estimated time to feed its backlog before it can draft (0 under
        ``BACKLOG_MIN`` entries: feeding those is part of an ordinary proposal)."""
        backlog = [self.rows.backlog(r) if s is not None else 0 for r, s in enumerate(seqs)]
        if max(backlog, default=0) < BACKLOG_MIN:
            return [0.0] * len(seqs)
        rate = self._rate()
        return [rate * n if n >= BACKLOG_MIN else 0.0 for n in backlog]

    @torch.inference_mode()
    def _rate(self) -> float:
        """Seconds per fed entry: measured on real catch-ups, or, before the first one, on two
        feeds of ``BACKLOG_MIN`` zero features into a spare row (the first warms up)."""
        if self.seconds_per_entry is None:
            n, c = BACKLOG_MIN, self.head.config
            feats = torch.zeros(n, len(c.taps) * c.hidden_size, dtype=self.cache.k.dtype, device=self.embed.weight.device)
            rows = self.cache
            self.cache = HeadCache(c.num_kv_heads, c.head_dim, rows.k.dtype, rows.k.device)
            try:  # into a cache of its own: the rows' entries stay untouched
                for _ in range(2):
                    t0 = time.perf_counter()
                    self._feed([0], [feats], [0], [[0] * n], scratch=0)
                    self.seconds_per_entry = (time.perf_counter() - t0) / n
            finally:
                self.cache = rows
        return self.seconds_per_entry

    def memory_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.head.parameters())
        return params + self.cache.nbytes

    # -- drafting --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence | None], budgets: Seq[int], cache: KVCache) -> list[Draft]:
        drafts = [Draft.empty() for _ in seqs]
        self.setup_spent = 0.0
        rows = [r for r, (s, b) in enumerate(zip(seqs, budgets)) if s is not None and b > 0 and self.rows.ready(r)]
        if not rows:
            return drafts
        reach = {r: min(budgets[r], seqs[r].room - 1) for r in rows}  # the deepest node a row can emit
        depth = min(self.options.depth, max(reach.values()))
        k = self.options.topk
        state, logp = self._feed_pending(rows, [seqs[r] for r in rows], k * depth)  # [R, H], [R, N]
        keep = torch.tensor([budgets[r] for r in rows], device=state.device)  # [R]
        tokens, parents, scores = self._grow(rows, state, logp, depth, k, keep)  # [R, M] each
        for i, r in enumerate(rows):
            drafts[r] = _best_tree(tokens[i], parents[i], scores[i], budgets[r], reach[r], self.label)
        return drafts

    def _feed_pending(self, rows: list[int], seqs: list[Sequence], scratch: int) -> tuple[Tensor, Tensor]:
        """Feed each row's pending exact entries (with room for ``scratch`` drafted ones after
        them); return the anchor's state [R, H] and log-probs [R, N]."""
        for row, seq in zip(rows, seqs):  # a long backlog alone, all but its last entry
            if self.rows.backlog(row) >= BACKLOG_MIN:
                self._catch_up(row, seq)
        feats, starts = self.rows.take(rows)  # [P_r, taps * H] each; each row's first new slot
        ids = [seq.tokens[s + 1 : s + 1 + len(f)] for f, s, seq in zip(feats, starts, seqs)]
        state = self._feed(rows, feats, starts, ids, scratch)  # [R, H]
        return state, self._logp(state)

    def _catch_up(self, row: int, seq: Sequence) -> None:
        """Feed a row's backlog but its last entry (which stays the anchor), timing it."""
        [feats], [start] = self.rows.take([row])  # [P, taps * H]
        self.rows.put_back(row, feats[-1:])
        t0 = time.perf_counter()
        self._feed([row], [feats[:-1]], [start], [seq.tokens[start + 1 : start + len(feats)]], scratch=0)
        spent = time.perf_counter() - t0
        self.setup_spent += spent
        self.seconds_per_entry = spent / (len(feats) - 1)

    def _feed(self, rows: list[int], feats: list[Tensor], starts: list[int], ids: list[list[int]],
              scratch: int) -> Tensor:
        """Feed exact entries (row i: features [P_i, taps * H] with the tokens after them, from
        slot starts[i]); return each row's last state [R, H]."""
        dev = self.embed.weight.device
        width = max(len(f) for f in feats)
        self.cache.ensure(max(rows) + 1, max(starts) + width + scratch + 1)
        taps = torch.zeros(len(rows), width, feats[0].shape[-1], dtype=feats[0].dtype, device=dev)  # [R, P, taps*H]
        tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [R, P]
        for i, (f, row_ids) in enumerate(zip(feats, ids)):
            taps[i, : len(f)] = f
            tokens[i, : len(f)] = torch.tensor(row_ids)
        slots = torch.tensor(starts, device=dev)[:, None] + torch.arange(width, device=dev)  # [R, P]
        visible = torch.arange(int(slots.max()) + 1, device=dev)[None, None, :] <= slots[:, :, None]  # [R, P, S]
        last = torch.tensor([len(f) - 1 for f in feats], device=dev)
        positions = torch.minimum(slots, (slots[:, 0] + last)[:, None])  # padding: the row's last real position
        out = self._run(rows, tokens.to(dev), self.head.fuse(taps), positions, slots, visible)  # [R, P, H]
        return out[torch.arange(len(rows), device=dev), last]

    def _run(self, rows: list[int], ids: Tensor, hidden: Tensor, positions: Tensor, slots: Tensor,
             visible: Tensor) -> Tensor:
        """One head step for every query: ids, positions [R, Q]; slots [R, Q], consecutive in each
        row; hidden [R, Q, H]; visible [R, Q, S], nothing visible past the last slot."""
        cos = self.cos[positions].unsqueeze(2).to(hidden.dtype)  # [R, Q, 1, D]
        sin = self.sin[positions].unsqueeze(2).to(hidden.dtype)
        emb = self.embed(ids)  # [R, Q, H]
        group = self.head.config.group_size
        first = rows[0]
        if self.fast is not None and rows == list(range(first, first + len(rows))):  # a view of the rows' cache
            starts = slots[:, 0].tolist()
            s = max(starts) + slots.shape[1]
            mask = visible[:, :, :s].repeat(1, group, 1)[:, None]  # [R, 1, G*Q, S]: stacked-query order
            k, v = self.cache.k[first : first + len(rows)], self.cache.v[first : first + len(rows)]
            return self.fast.step(emb, hidden, cos, sin, k, v, starts, mask)
        attend = self.cache.attend(torch.tensor(rows, device=hidden.device), slots, visible, group)
        return self.head.layer(emb, hidden, cos, sin, attend)

    def _logp(self, state: Tensor) -> Tensor:
        """[..., H] head states -> [..., N] float32 log-probabilities over the draft vocabulary."""
        if self.fast is not None:
            return self.fast.logp(state)
        return self.head.logits(state).log_softmax(-1)

    def _grow(self, rows: list[int], state: Tensor, logp: Tensor, depth: int, k: int, keep: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
        """EAGLE-2's expansion. Returns every candidate node's target token, parent (-1: the
        root) and cumulative log-probability: [R, M] each, parents before children. It stops
        early once no row's frontier can place a node among its ``keep`` [R] best (a child
        never scores above its parent): deeper levels would change no draft. With the C++ step
        and consecutive rows (a view of their cache), the whole loop runs in C++
        (``HeadLayer::grow``: the same calls, so the same tree)."""
        first = rows[0]
        if self.fast is not None and rows == list(range(first, first + len(rows))):
            base = [self.rows.length[r] for r in rows]
            k_rows, v_rows = self.cache.k[first : first + len(rows)], self.cache.v[first : first + len(rows)]
            return self.fast.grow(state, logp, depth, k, keep.tolist(), base, k_rows, v_rows, self.vocab_ids,
                                  self.embed.weight, self.cos, self.sin)
        return self._grow_python(rows, state, logp, depth, k, keep)

    def _grow_python(self, rows: list[int], state: Tensor, logp: Tensor, depth: int, k: int, keep: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """``_grow`` one level at a time from Python (the reference for the C++ loop)."""
        dev = state.device
        r_n = len(rows)
        top = logp.topk(k, dim=-1)  # [R, k]
        tokens, parents, scores = [top.indices], [torch.full((r_n, k), -1, device=dev)], [top.values]
        front = torch.arange(k, device=dev).expand(r_n, k)  # [R, k] frontier node ids
        front_state = state[:, None].expand(r_n, k, -1)  # [R, k, H] the frontier's parents' states
        base = torch.tensor([self.rows.length[r] for r in rows], device=dev)  # [R] first scratch slot
        prefix = torch.arange(int(base.max()) + k * depth, device=dev)[None, :] < base[:, None]  # [R, S]
        seen = torch.zeros(r_n, k, prefix.shape[1], dtype=torch.bool, device=dev)  # [R, k, S] ancestors' slots
        count = k
        for d in range(1, depth):
            so_far = torch.cat(scores, 1)  # [R, M so far]
            if _settled(so_far, so_far.gather(1, front), keep):
                break
            slots = base[:, None] + (d - 1) * k + torch.arange(k, device=dev)  # [R, k]
            seen = seen.clone()
            seen.scatter_(2, slots[:, :, None], True)
            ids = torch.cat(tokens, 1).gather(1, front)  # [R, k] draft ids of the frontier
            positions = (base - 1 + d)[:, None].expand(r_n, k)  # [R, k]
            out = self._run(rows, self.vocab_ids[ids], front_state, positions, slots, seen | prefix[:, None])
            child = self._logp(out).topk(k, dim=-1)  # [R, k, k]
            cum = torch.cat(scores, 1).gather(1, front)[:, :, None] + child.values  # [R, k, k]
            tokens.append(child.indices.flatten(1))
            parents.append(front[:, :, None].expand(r_n, k, k).flatten(1))
            scores.append(cum.flatten(1))
            best = cum.flatten(1).topk(k, dim=-1).indices  # [R, k] into this depth's k*k children
            front = count + best
            front_state = out.gather(1, (best // k)[:, :, None].expand(-1, -1, out.shape[-1]))  # [R, k, H]
            seen = seen.gather(1, (best // k)[:, :, None].expand(-1, -1, seen.shape[-1]))
            count += k * k
        ids = self.vocab_ids[torch.cat(tokens, 1)]  # [R, M] target ids
        return ids.cpu(), torch.cat(parents, 1).cpu(), torch.cat(scores, 1).float().cpu()


def _settled(scores: Tensor, frontier: Tensor, keep: Tensor) -> bool:
    """Whether every row's ``keep`` best scores so far are at least its best frontier score:
    scores [R, M], frontier [R, k] (the nodes the next level would expand), keep [R]."""
    m = scores.shape[1]
    kth = scores.sort(dim=1, descending=True).values.gather(1, (keep.clamp(1, m) - 1)[:, None])  # [R, 1]
    return bool(((keep <= m) & (frontier.max(dim=1).values <= kth[:, 0])).all())


def _best_tree(tokens: Tensor, parents: Tensor, scores: Tensor, budget: int, depth: int, label: str) -> Draft:
    """The ``budget`` candidates at most ``depth`` deep of highest cumulative log-probability,
    each with its path's probability as its confidence (``Draft.top``: a child never scores
    above its parent). tokens, parents, scores: [M], parents before children."""
    conf = scores.nan_to_num(float("-inf")).exp().tolist()  # [M]
    draft = Draft(tuple(tokens.tolist()), tuple(parents.tolist()), label=label, confidence=tuple(conf))
    return draft.up_to_depth(depth).top(budget)


def eagle_from_context(options: EagleOptions, context: ProposerContext | None) -> FeatureHeadProposer:
    if context is None:
        raise SpecdraftError("method 'eagle' needs the target model")
    path = options.path or (shipped_heads("eagle", context.source) if context.source else None)
    if not path:
        raise SpecdraftError("method 'eagle' needs a trained head for this model: pass --opt path=DIR "
                             "(made by `specdraft train eagle`)")
    return FeatureHeadProposer(load_eagle(path, context.target.config), context, options, "eagle")


def mtp_from_context(options: MtpOptions, context: ProposerContext | None) -> FeatureHeadProposer:
    if context is None:
        raise SpecdraftError("method 'mtp' needs the target model")
    target = context.target
    if options.native:
        if options.path:
            raise SpecdraftError("mtp: give path= or native=true, not both")
        head = load_native_mtp(context.source, target.config, target.lm_head.weight)
        return FeatureHeadProposer(head, context, options, "mtp")
    path = options.path or (shipped_heads("mtp", context.source) if context.source else None)
    if not path:
        raise SpecdraftError("method 'mtp' needs a trained module for this model: pass --opt path=DIR (made by "
                             "`specdraft train mtp`) or --opt native=true for a model that ships one")
    return FeatureHeadProposer(load_mtp(path, target.config), context, options, "mtp")
