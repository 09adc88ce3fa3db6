// The decoder layers' loop in C++: the very ATen calls that transformer.py's Block makes, in
// the same order on the same shapes, so the bits are the same (tests compare them); only the
// Python interpreter between the calls is gone (about a third of a 4-bit decode step on a
// 2-core CPU). transformer.py stays the reference and the path for what this does not cover
// (prompt chunks). See fastpath.py.
#include <torch/extension.h>

#include "attend.h"
#include "quantmm.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

using at::Tensor;

namespace {

// One linear layer as linear.py's Linear.forward computes it (int4, oneDNN packed or widened, or plain).
struct Linear {
  Tensor int4, int4_sz;     // 4-bit weights: torch's pack and its [K/32, N, 2] scales, or quantmm.h's tiles and
                            // their [N/16, K/32, P, 16] parameters (undefined: none)
  Tensor packed;            // oneDNN-packed weight (undefined: none)
  Tensor weight, bias;      // plain weight; bias may be undefined
  int64_t out_features;
  bool single_rows;         // batch-invariant: one row runs as two
  bool widened;             // packed is a float32 copy of a lower-precision weight (rows cast to float32 and back)
  int64_t from_rows;        // the fewest rows that take the packed copy
};

Tensor linear_pointwise(const Tensor& x, const Tensor& w, const Tensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  std::optional<Tensor> bias = b.defined() ? std::optional<Tensor>(b) : std::nullopt;
  return op.call(x, w, bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

Tensor apply(const Linear& l, const Tensor& x, bool wide) {
  const int64_t in = x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = l.out_features;
  if (l.int4.defined() && !wide) {
    Tensor out = l.int4_sz.dim() == 4 ? quantmm::matmul(x.reshape({-1, in}), l.int4, l.int4_sz).view(shape)  // tiles
                                      : at::_weight_int4pack_mm_for_cpu(x.reshape({-1, in}), l.int4, 32, l.int4_sz).view(shape);
    return l.bias.defined() ? out + l.bias : out;
  }
  if (l.packed.defined() && x.numel() / in >= l.from_rows) {
    const Tensor rows = l.widened ? x.to(at::kFloat) : x;
    const Tensor bias = l.widened && l.bias.defined() ? l.bias.to(at::kFloat) : l.bias;
    Tensor out;
    if (l.single_rows && x.numel() == in) {
      Tensor twice = rows.reshape({1, in}).repeat({2, 1});
      out = linear_pointwise(twice, l.packed, bias).slice(0, 0, 1).view(shape);
    } else {
      out = linear_pointwise(rows, l.packed, bias);
    }
    return l.widened ? out.to(x.scalar_type()) : out;
  }
  return at::linear(x, l.weight, l.bias.defined() ? std::optional<Tensor>(l.bias) : std::nullopt);
}

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  const int64_t h = w.size(0);
  if ((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.scalar_type() == w.scalar_type()) {
    return at::rms_norm(x, {h}, w, eps);
  }
  return at::rms_norm(x.to(at::kFloat), {h}, w.to(at::kFloat), eps).to(x.scalar_type());
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return at::addcmul(x * cos, x.roll({x.size(-1) / 2}, {-1}), sin);
}

struct Layer {
  Tensor attn_norm, ffn_norm;
  double eps;
  Linear wqkv, wo, gate_up, down;
};

struct Dims {
  int64_t hq, hkv, d;
};

// KVCache.write: row b's new keys at lengths[b] + arange(t); returns the keys up to the longest
// row's new end
std::pair<Tensor, Tensor> write(Tensor kl, Tensor vl, const Tensor& k, const Tensor& v,
                                const std::vector<int64_t>& lengths) {
  const int64_t t = k.size(2);
  int64_t lo = lengths[0], hi = lengths[0];
  for (int64_t n : lengths) { lo = std::min(lo, n); hi = std::max(hi, n); }
  if (lo == hi) {
    kl.narrow(2, lo, t).copy_(k);
    vl.narrow(2, lo, t).copy_(v);
  } else {
    const int64_t b = kl.size(0);
    auto opts = at::TensorOptions().dtype(at::kLong).device(kl.device());
    Tensor rows = at::arange(b, opts).unsqueeze(1);
    Tensor cols = at::tensor(lengths, opts).unsqueeze(1) + at::arange(t, opts);
    using at::indexing::Slice;
    kl.index_put_({rows, Slice(), cols}, k.transpose(1, 2));
    vl.index_put_({rows, Slice(), cols}, v.transpose(1, 2));
  }
  return {kl.slice(2, 0, hi + t), vl.slice(2, 0, hi + t)};
}

// Whether a bfloat16 attention call gives the same bits inside at::parallel_for (where it runs
// on one thread) as outside it, for this head shape: checked once per process on fixed inputs
// over key counts from 1 to 1,100, because a batch-invariant model must not trust it blindly.
bool same_bits_in_parallel(const Dims& n) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(n.hkv, n.hq, n.d);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  const int64_t g = n.hq / n.hkv;
  auto fixed = [](int64_t count, double step) {  // deterministic values in [-1, 1], no RNG state used
    return at::sin(at::arange(count, at::kFloat) * step).to(at::kBFloat16);
  };
  bool same = true;
  Tensor q = fixed(n.hkv * g * n.d, 0.37).view({1, n.hkv, g, n.d});
  for (int64_t s : {1, 2, 3, 5, 8, 13, 31, 64, 100, 257, 513, 1100}) {
    Tensor k = fixed(n.hkv * s * n.d, 0.11).view({1, n.hkv, s, n.d});
    Tensor v = fixed(n.hkv * s * n.d, 0.23).view({1, n.hkv, s, n.d});
    Tensor alone = at::scaled_dot_product_attention(q, k, v);
    Tensor inside;
    at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
      if (lo == 0) inside = at::scaled_dot_product_attention(q, k, v);
    });
    same = same && at::equal(alone, inside);
  }
  known[key] = same;
  return same;
}

// invariant_attention for a plan: per query, a key count (>= 0: the first n keys) or -1, which
// takes the next of ``picks`` (a tree node's visible key indices [n], in order).
// Where attend.h covers the shapes (as transformer.py decides through fastpath.attend): its
// kernel, invariant by construction. Otherwise one flash-attention call per query. In bfloat16 the queries' calls run side by side (at::parallel_for, each call then on one
// thread): CPU flash attention gives the same bits on one thread as on several in bfloat16
// (checked for 1-2,100 keys on this project's machines, once per process at the first call
// (same_bits_in_parallel), and by the tests that compare batched rows with single ones), so a
// row's result is unchanged; in float32 it does not, and the calls stay one after another.
Tensor invariant(const Dims& n, const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts,
                 const std::vector<Tensor>& picks) {
  const int64_t b = q.size(0), t = q.size(2), g = n.hq / n.hkv;
  if (attend::supports(n.d, g, q.scalar_type())) {  // attend.h: invariant by construction
    Tensor by_query = q.transpose(1, 2).reshape({b * t, n.hkv, g, n.d});  // [B*T, Hkv, G, D]
    std::vector<int64_t> rows(b * t);
    for (int64_t j = 0; j < b * t; ++j) rows[j] = j / t;
    return attend::attention(by_query, k, v, rows, counts, picks).view({b, t, n.hq, n.d}).transpose(1, 2);
  }
  if (b == 1 && t == 1 && counts[0] == k.size(2)) {
    Tensor qt = q.reshape({1, n.hkv, g, n.d}).contiguous();
    return at::scaled_dot_product_attention(qt, k, v).view({1, n.hq, 1, n.d});
  }
  Tensor by_token = q.transpose(1, 2).contiguous();  // [B, T, Hq, D]
  std::vector<int64_t> pick_of(b * t, -1);  // query -> its index in picks (-1: a key count)
  int64_t next = 0;
  for (int64_t j = 0; j < b * t; ++j) {
    if (counts[j] < 0) pick_of[j] = next++;
  }
  auto one = [&](int64_t j) {
    const int64_t r = j / t, i = j % t, sel = counts[j];
    Tensor kb, vb;
    if (sel >= 0) {
      kb = k.slice(0, r, r + 1).slice(2, 0, sel);
      vb = v.slice(0, r, r + 1).slice(2, 0, sel);
    } else {  // k[r:r+1, :, idx] in Python: a gather, then the same call
      const Tensor& idx = picks.at(pick_of[j]);
      kb = k.slice(0, r, r + 1).index_select(2, idx);
      vb = v.slice(0, r, r + 1).index_select(2, idx);
    }
    Tensor qt = by_token.select(0, r).select(0, i).view({1, n.hkv, g, n.d});
    return at::scaled_dot_product_attention(qt, kb, vb);  // [1, Hkv, G, D]
  };
  if (q.scalar_type() != at::kBFloat16 || !same_bits_in_parallel(n)) {
    std::vector<Tensor> outs;
    outs.reserve(b * t);
    for (int64_t j = 0; j < b * t; ++j) outs.push_back(one(j));
    return at::stack(outs).view({b, t, n.hq, n.d}).transpose(1, 2);
  }
  Tensor out = at::empty({b * t, 1, n.hkv, g, n.d}, q.options());
  at::parallel_for(0, b * t, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) out.select(0, j).copy_(one(j));
  });
  return out.view({b, t, n.hq, n.d}).transpose(1, 2);
}

// transformer.py's split_attention: every row's root in one call, the deep rows' other slots
// in one call over their keys alone; q [B, Hq, T, D], k, v [B, Hkv, S, D], mask [B, 1, G*T, S]
Tensor split(const Dims& n, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const Tensor& deep) {
  const int64_t b = q.size(0), t = q.size(2), g = n.hq / n.hkv, r = deep.size(0), s = mask.size(-1);
  Tensor m = mask.view({b, 1, g, t, s});
  Tensor roots = at::scaled_dot_product_attention(q.select(2, 0).reshape({b, n.hkv, g, n.d}), k, v, m.select(3, 0));
  Tensor out = at::zeros({b, n.hq, t, n.d}, q.options());
  out.select(2, 0).copy_(roots.view({b, n.hq, n.d}));
  Tensor qd = q.index_select(0, deep).slice(2, 1).reshape({r, n.hkv, g * (t - 1), n.d});
  Tensor md = m.index_select(0, deep).slice(3, 1).reshape({r, 1, g * (t - 1), s});
  Tensor rest = at::scaled_dot_product_attention(qd, k.index_select(0, deep), v.index_select(0, deep), md);
  out.slice(2, 1).index_copy_(0, deep, rest.view({r, n.hq, t - 1, n.d}));
  return out;
}

// Block.attention after the norm: x [B, T, In] -> [B, T, H], or [N, In] -> [N, H] with index
// (transformer.py's Packing: the real tokens' flat positions, padded around attention);
// kl, vl: this layer's cache [B, Hkv, S, D]
Tensor attention(const Dims& n, const Linear& wqkv, const Linear& wo, const Tensor& x, const Tensor& cos,
                 const Tensor& sin, const Tensor& kl, const Tensor& vl, const std::vector<int64_t>& lengths,
                 const std::optional<Tensor>& mask, const std::vector<int64_t>& counts, const std::vector<Tensor>& picks,
                 bool wide, const std::optional<Tensor>& index, const std::optional<Tensor>& deep) {
  const int64_t b = cos.size(0), t = cos.size(1), g = n.hq / n.hkv;
  Tensor qkv = apply(wqkv, x, wide);
  if (index) qkv = at::zeros({b * t, qkv.size(-1)}, qkv.options()).index_copy_(0, *index, qkv);  // Packing.pad
  qkv = qkv.view({b, t, n.hq + 2 * n.hkv, n.d});
  Tensor qk = rope(qkv.slice(2, 0, n.hq + n.hkv), cos, sin);
  Tensor q = qk.slice(2, 0, n.hq).transpose(1, 2);
  Tensor k = qk.slice(2, n.hq).transpose(1, 2);
  Tensor v = qkv.slice(2, n.hq + n.hkv).transpose(1, 2);
  auto [keys, values] = write(kl, vl, k, v, lengths);
  Tensor o;
  if (counts.empty() && index && deep && mask) {
    o = split(n, q, keys, values, *mask, *deep);
  } else if (counts.empty()) {  // grouped_attention
    Tensor qg = q.reshape({b, n.hkv, g * t, n.d});
    o = at::scaled_dot_product_attention(qg, keys, values, mask).view({b, n.hq, t, n.d});
  } else {
    o = invariant(n, q, keys, values, counts, picks);
  }
  Tensor flat = o.transpose(1, 2).reshape({b, t, n.hq * n.d});
  if (index) flat = flat.reshape({b * t, n.hq * n.d}).index_select(0, *index);  // Packing.pick
  return apply(wo, flat, wide);
}

Tensor mlp(const Linear& gate_up, const Linear& down, const Tensor& x, bool wide) {
  auto gu = apply(gate_up, x, wide).chunk(2, -1);
  return apply(down, at::silu(gu[0]) * gu[1], wide);
}

// Per linear, in the order given: its output width and (single_rows, widened, from_rows) as linear.py's.
struct LinearRules {
  std::vector<int64_t> out_features;
  std::vector<bool> single_rows, widened;
  std::vector<int64_t> from_rows;
};

Linear linear_from(const std::vector<std::optional<Tensor>>& tensors, size_t i, const LinearRules& r) {
  // tensors: per linear (int4, int4_sz, packed, weight, bias), None where absent
  auto get = [&](size_t j) { return tensors[j].has_value() ? *tensors[j] : Tensor(); };
  const size_t o = 5 * i;
  return Linear{get(o), get(o + 1), get(o + 2), get(o + 3), get(o + 4), r.out_features[i], r.single_rows[i],
                r.widened[i], r.from_rows[i]};
}

}  // namespace

class Layers {
 public:
  Layers(int64_t hq, int64_t hkv, int64_t head_dim) : hq_(hq), hkv_(hkv), d_(head_dim) {}

  void add_layer(Tensor attn_norm, Tensor ffn_norm, double eps, std::vector<std::optional<Tensor>> tensors,
                 std::vector<int64_t> out_features, std::vector<bool> single_rows, std::vector<bool> widened,
                 std::vector<int64_t> from_rows) {
    // tensors: 4 linears (wqkv, wo, gate_up, down) x (int4, int4_sz, packed, weight, bias)
    Layer layer{attn_norm, ffn_norm, eps, {}, {}, {}, {}};
    Linear* lins[4] = {&layer.wqkv, &layer.wo, &layer.gate_up, &layer.down};
    const LinearRules rules{out_features, single_rows, widened, from_rows};
    for (size_t i = 0; i < 4; ++i) *lins[i] = linear_from(tensors, i, rules);
    layers_.push_back(std::move(layer));
  }

  // x: [B, T, H]; cos, sin: [B, T, 1, D]; k_cache, v_cache: [L, B, Hkv, S, D];
  // lengths: committed length of each row; mask: [B, 1, G*T, S] bool or undefined;
  // counts: batch-invariant plan, B*T key counts (empty: one fused attention call; -1: the next
  // of picks, a tree node's key indices);
  // ids: the layers to run; taps: layer outputs to return (i + 1 after layer i; 0 = x);
  // index: x is [N, H], these real tokens of the [B, T] layout (transformer.py's Packing), or none;
  // deep: the rows whose attention is split from the roots' (Packing.deep), or none.
  std::vector<Tensor> forward(Tensor x, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,
                              std::vector<int64_t> lengths, std::optional<Tensor> mask, std::vector<int64_t> counts,
                              std::vector<Tensor> picks, std::vector<int64_t> ids, std::vector<int64_t> taps,
                              bool wide, std::optional<Tensor> index, std::optional<Tensor> deep) {
    std::vector<Tensor> out;
    auto tapped = [&](int64_t i) {
      for (int64_t t : taps) if (t == i) return true;
      return false;
    };
    if (tapped(0)) out.push_back(x);
    for (int64_t i : ids) {
      x = block(layers_[i], x, cos, sin, k_cache, v_cache, i, lengths, mask, counts, picks, wide, index, deep);
      if (tapped(i + 1)) out.push_back(x);
    }
    out.insert(out.begin(), x);
    return out;
  }

 private:
  Tensor block(const Layer& p, Tensor x, const Tensor& cos, const Tensor& sin, const Tensor& kc, const Tensor& vc,
               int64_t layer, const std::vector<int64_t>& lengths, const std::optional<Tensor>& mask,
               const std::vector<int64_t>& counts, const std::vector<Tensor>& picks, bool wide,
               const std::optional<Tensor>& index, const std::optional<Tensor>& deep) {
    const Dims n{hq_, hkv_, d_};
    x = x + attention(n, p.wqkv, p.wo, rms_norm(x, p.attn_norm, p.eps), cos, sin, kc.select(0, layer),
                      vc.select(0, layer), lengths, mask, counts, picks, wide, index, deep);
    return x + mlp(p.gate_up, p.down, rms_norm(x, p.ffn_norm, p.eps), wide);
  }

  int64_t hq_, hkv_, d_;
  std::vector<Layer> layers_;
};

// One step of a feature head (heads/mtp.py's MtpHead.layer or heads/eagle.py's EagleHead.layer)
// with fused q/k/v and gate/up products, and its read-out (FeatureHead.logits + log_softmax).
// Drafts only: nothing here decides an output token, so it needs no bit-identity with Python.
class HeadLayer {
 public:
  // eagle: EAGLE-3's layer (attention over [norm(emb), norm(h)], residual h); else an MTP block
  // (eh_proj over [enorm(emb), hnorm(h)], then a Llama block)
  HeadLayer(int64_t hq, int64_t hkv, int64_t head_dim, bool eagle, double eps)
      : n_{hq, hkv, head_dim}, eagle_(eagle), eps_(eps) {}

  // norms: mtp (enorm, hnorm, input_layernorm, post_attention_layernorm, final norm);
  //        eagle (input_layernorm, hidden_norm, post_attention_layernorm, final norm).
  // tensors: per linear as Layers.add_layer; mtp (eh_proj, wqkv, wo, gate_up, down, lm_head),
  //          eagle (wqkv, wo, gate_up, down, lm_head).
  void set(std::vector<Tensor> norms, std::vector<std::optional<Tensor>> tensors, std::vector<int64_t> out_features,
           std::vector<bool> single_rows, std::vector<bool> widened, std::vector<int64_t> from_rows) {
    norms_ = std::move(norms);
    lins_.clear();
    const LinearRules rules{out_features, single_rows, widened, from_rows};
    for (size_t i = 0; i < out_features.size(); ++i) lins_.push_back(linear_from(tensors, i, rules));
  }

  // emb, hidden: [B, T, H]; cos, sin: [B, T, 1, D]; kc, vc: the rows' head cache [B, Hkv, S, D]
  // (row b's new entries written at lengths[b] + arange(T)); mask: [B, 1, G*T, max(lengths) + T]
  // bool. Returns the new pre-norm states [B, T, H].
  Tensor step(Tensor emb, Tensor hidden, Tensor cos, Tensor sin, Tensor kc, Tensor vc, std::vector<int64_t> lengths,
              std::optional<Tensor> mask) {
    const Tensor e = emb.to(hidden.scalar_type());
    const std::vector<int64_t> none;
    const std::vector<Tensor> no_picks;
    if (eagle_) {
      Tensor x = at::cat({rms_norm(e, norms_[0], eps_), rms_norm(hidden, norms_[1], eps_)}, -1);
      Tensor h = hidden + attention(n_, lins_[0], lins_[1], x, cos, sin, kc, vc, lengths, mask, none, no_picks, false, std::nullopt, std::nullopt);
      return h + mlp(lins_[2], lins_[3], rms_norm(h, norms_[2], eps_), false);
    }
    Tensor x = apply(lins_[0], at::cat({rms_norm(e, norms_[0], eps_), rms_norm(hidden, norms_[1], eps_)}, -1), false);
    x = x + attention(n_, lins_[1], lins_[2], rms_norm(x, norms_[2], eps_), cos, sin, kc, vc, lengths, mask, none, no_picks, false, std::nullopt, std::nullopt);
    return x + mlp(lins_[3], lins_[4], rms_norm(x, norms_[3], eps_), false);
  }

  // [..., H] pre-norm states -> [..., N] float32 log-probabilities over the draft vocabulary
  Tensor logp(Tensor h) {
    return apply(lins_.back(), rms_norm(h, norms_.back(), eps_), false).to(at::kFloat).log_softmax(-1);
  }

  // EAGLE-2's expansion: feature_heads.py's FeatureHeadProposer._grow with this step, the same
  // calls level by level (so the same tree), without the interpreter between them.
  // state: [R, H] the anchors' states; anchor_logp: [R, N] their log-probs; keep, base: per row, the
  // nodes kept and the first scratch slot; kc, vc: the rows' head cache [R, Hkv, S, D];
  // vocab_ids: [N] draft -> target ids; embed: [V, H]; cos, sin: [P, D] rotary tables.
  // Returns every candidate's target id, parent (-1: the root) and cumulative log-probability,
  // [R, M] each on the CPU, parents before children.
  std::tuple<Tensor, Tensor, Tensor> grow(Tensor state, Tensor anchor_logp, int64_t depth, int64_t k, std::vector<int64_t> keep,
                                          std::vector<int64_t> base, Tensor kc, Tensor vc, Tensor vocab_ids,
                                          Tensor embed, Tensor cos, Tensor sin) {
    const auto longs = at::TensorOptions().dtype(at::kLong).device(state.device());
    const int64_t r_n = state.size(0), h = state.size(1), group = n_.hq / n_.hkv;
    const int64_t top_base = *std::max_element(base.begin(), base.end());
    auto [top_values, top_indices] = anchor_logp.topk(k, -1);  // [R, k]
    std::vector<Tensor> tokens{top_indices}, parents{at::full({r_n, k}, -1, longs)}, scores{top_values};
    Tensor front = at::arange(k, longs).expand({r_n, k});  // [R, k] frontier node ids
    Tensor front_state = state.unsqueeze(1).expand({r_n, k, h});  // [R, k, H] the frontier's parents' states
    Tensor base_t = at::tensor(base, longs);  // [R]
    Tensor keep_t = at::tensor(keep, longs);  // [R]
    Tensor prefix = at::arange(top_base + k * depth, longs).unsqueeze(0) < base_t.unsqueeze(1);  // [R, S]
    Tensor seen = at::zeros({r_n, k, prefix.size(1)}, longs.dtype(at::kBool));  // [R, k, S] ancestors' slots
    int64_t count = k;
    for (int64_t d = 1; d < depth; ++d) {
      Tensor so_far = at::cat(scores, 1);  // [R, M so far]
      Tensor front_scores = so_far.gather(1, front);  // [R, k]
      if (settled(so_far, front_scores, keep_t)) break;
      Tensor slots = base_t.unsqueeze(1) + (d - 1) * k + at::arange(k, longs);  // [R, k]
      seen = seen.clone();
      seen.scatter_(2, slots.unsqueeze(2), true);
      Tensor ids = at::cat(tokens, 1).gather(1, front);  // [R, k] draft ids of the frontier
      Tensor positions = (base_t - 1 + d).unsqueeze(1).expand({r_n, k});  // [R, k]
      Tensor c = cos.index({positions}).unsqueeze(2).to(front_state.scalar_type());  // [R, k, 1, D]
      Tensor s = sin.index({positions}).unsqueeze(2).to(front_state.scalar_type());
      Tensor emb = at::embedding(embed, vocab_ids.index({ids}));  // [R, k, H]
      std::vector<int64_t> starts(r_n);
      for (int64_t i = 0; i < r_n; ++i) starts[i] = base[i] + (d - 1) * k;
      const int64_t width = top_base + d * k;
      Tensor visible = (seen | prefix.unsqueeze(1)).slice(2, 0, width);  // [R, k, S']
      Tensor mask = visible.repeat({1, group, 1}).unsqueeze(1);  // [R, 1, G*k, S']: stacked-query order
      Tensor out = step(emb, front_state, c, s, kc, vc, starts, mask);  // [R, k, H]
      auto [child_values, child_indices] = this->logp(out).topk(k, -1);  // [R, k, k]
      Tensor cum = front_scores.unsqueeze(2) + child_values;  // [R, k, k]
      tokens.push_back(child_indices.flatten(1));
      parents.push_back(front.unsqueeze(2).expand({r_n, k, k}).flatten(1));
      scores.push_back(cum.flatten(1));
      Tensor best = std::get<1>(cum.flatten(1).topk(k, -1));  // [R, k] into this depth's k*k children
      Tensor from = at::floor_divide(best, k).unsqueeze(2);  // [R, k, 1] which frontier node each came from
      front = best + count;
      front_state = out.gather(1, from.expand({-1, -1, h}));  // [R, k, H]
      seen = seen.gather(1, from.expand({-1, -1, seen.size(2)}));
      count += k * k;
    }
    Tensor ids = vocab_ids.index({at::cat(tokens, 1)});  // [R, M] target ids
    return {ids.cpu(), at::cat(parents, 1).cpu(), at::cat(scores, 1).to(at::kFloat).cpu()};
  }

  // feature_heads.py's _settled: whether every row's keep best scores so far are at least its
  // best frontier score. scores: [R, M]; frontier: [R, k]; keep: [R]
  static bool settled(const Tensor& scores, const Tensor& frontier, const Tensor& keep) {
    const int64_t m = scores.size(1);
    Tensor order = std::get<0>(scores.sort(1, true));  // [R, M]
    Tensor kth = order.gather(1, (keep.clamp(1, m) - 1).unsqueeze(1)).select(1, 0);  // [R]
    return ((keep <= m) & (std::get<0>(frontier.max(1)) <= kth)).all().item<bool>();
  }

 private:
  Dims n_;
  bool eagle_;
  double eps_;
  std::vector<Tensor> norms_;
  std::vector<Linear> lins_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Layers>(m, "Layers")
      .def(pybind11::init<int64_t, int64_t, int64_t>())
      .def("add_layer", &Layers::add_layer)
      .def("forward", &Layers::forward);
  pybind11::class_<HeadLayer>(m, "HeadLayer")
      .def(pybind11::init<int64_t, int64_t, int64_t, bool, double>())
      .def("set", &HeadLayer::set)
      .def("step", &HeadLayer::step)
      .def("logp", &HeadLayer::logp)
      .def("grow", &HeadLayer::grow);
  m.def("attend", &attend::attention, "batch-invariant attention (attend.h)");
  m.def("attend_supports", [](int64_t d, int64_t group) { return attend::supports(d, group, at::kFloat); });
  m.def("quant_supports", &quantmm::supports, "whether quantmm.h runs (N, K) products here");
  m.def("quant_path", &quantmm::path, "the pass bfloat16 rows take (quantmm.h)");
  m.def("quant_pack4", &quantmm::pack4, "q [N, K], scale, zero [N, K/32] -> (tiles, params) (quantmm.h)");
  m.def("quant_pack8", &quantmm::pack8, "q [N, K] int8, d [N, K/32] -> (tiles, params) (quantmm.h)");
  m.def("quant_mm", &quantmm::matmul, "x [M, K] times tiled 4- or 8-bit weights -> [M, N] (quantmm.h)");
}
