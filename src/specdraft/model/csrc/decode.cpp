// The decoder layers' loop in C++: the very ATen calls that transformer.py's Block makes, in
// the same order on the same shapes, so the bits are the same (tests compare them); only the
// Python interpreter between the calls is gone (about a third of a 4-bit decode step on a
// 2-core CPU). transformer.py stays the reference and the path for what this does not cover
// (prompt chunks, tree plans). See fastpath.py.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <vector>

using at::Tensor;

namespace {

// One linear layer as linear.py's Linear.forward computes it (int4, oneDNN packed, or plain).
struct Linear {
  Tensor int4, int4_sz;     // 4-bit pack and its [K/32, N, 2] scales (undefined: none)
  Tensor packed;            // oneDNN-packed weight (undefined: none)
  Tensor weight, bias;      // plain weight; bias may be undefined
  int64_t out_features;
  bool single_rows;         // batch-invariant: one row runs as two
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
    Tensor out = at::_weight_int4pack_mm_for_cpu(x.reshape({-1, in}), l.int4, 32, l.int4_sz).view(shape);
    return l.bias.defined() ? out + l.bias : out;
  }
  if (l.packed.defined()) {
    if (l.single_rows && x.numel() == in) {
      Tensor twice = x.reshape({1, in}).repeat({2, 1});
      return linear_pointwise(twice, l.packed, l.bias).slice(0, 0, 1).view(shape);
    }
    return linear_pointwise(x, l.packed, l.bias);
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

}  // namespace

class Layers {
 public:
  Layers(int64_t hq, int64_t hkv, int64_t head_dim) : hq_(hq), hkv_(hkv), d_(head_dim) {}

  void add_layer(Tensor attn_norm, Tensor ffn_norm, double eps, std::vector<std::optional<Tensor>> tensors,
                 std::vector<int64_t> out_features, std::vector<bool> single_rows) {
    // tensors: 4 linears x (int4, int4_sz, packed, weight, bias), None where absent
    Layer layer{attn_norm, ffn_norm, eps, {}, {}, {}, {}};
    Linear* lins[4] = {&layer.wqkv, &layer.wo, &layer.gate_up, &layer.down};
    auto get = [&](size_t i) { return tensors[i].has_value() ? *tensors[i] : Tensor(); };
    for (size_t i = 0; i < 4; ++i) {
      const size_t o = 5 * i;
      *lins[i] = Linear{get(o), get(o + 1), get(o + 2), get(o + 3), get(o + 4), out_features[i], single_rows[i]};
    }
    layers_.push_back(std::move(layer));
  }

  // x: [B, T, H]; cos, sin: [B, T, 1, D]; k_cache, v_cache: [L, B, Hkv, S, D];
  // lengths: committed length of each row; mask: [B, 1, G*T, S] bool or undefined;
  // counts: batch-invariant plan, B*T key counts (empty: one fused attention call);
  // ids: the layers to run; taps: layer outputs to return (i + 1 after layer i; 0 = x).
  std::vector<Tensor> forward(Tensor x, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,
                              std::vector<int64_t> lengths, std::optional<Tensor> mask, std::vector<int64_t> counts,
                              std::vector<int64_t> ids, std::vector<int64_t> taps, bool wide) {
    std::vector<Tensor> out;
    auto tapped = [&](int64_t i) {
      for (int64_t t : taps) if (t == i) return true;
      return false;
    };
    if (tapped(0)) out.push_back(x);
    for (int64_t i : ids) {
      x = block(layers_[i], x, cos, sin, k_cache, v_cache, i, lengths, mask, counts, wide);
      if (tapped(i + 1)) out.push_back(x);
    }
    out.insert(out.begin(), x);
    return out;
  }

 private:
  Tensor block(const Layer& p, Tensor x, const Tensor& cos, const Tensor& sin, const Tensor& kc, const Tensor& vc,
               int64_t layer, const std::vector<int64_t>& lengths, const std::optional<Tensor>& mask,
               const std::vector<int64_t>& counts, bool wide) {
    x = x + attention(p, rms_norm(x, p.attn_norm, p.eps), cos, sin, kc, vc, layer, lengths, mask, counts, wide);
    auto gu = apply(p.gate_up, rms_norm(x, p.ffn_norm, p.eps), wide).chunk(2, -1);
    return x + apply(p.down, at::silu(gu[0]) * gu[1], wide);
  }

  Tensor attention(const Layer& p, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& kc,
                   const Tensor& vc, int64_t layer, const std::vector<int64_t>& lengths,
                   const std::optional<Tensor>& mask, const std::vector<int64_t>& counts, bool wide) {
    const int64_t b = x.size(0), t = x.size(1), g = hq_ / hkv_;
    Tensor qkv = apply(p.wqkv, x, wide).view({b, t, hq_ + 2 * hkv_, d_});
    Tensor qk = rope(qkv.slice(2, 0, hq_ + hkv_), cos, sin);
    Tensor q = qk.slice(2, 0, hq_).transpose(1, 2);
    Tensor k = qk.slice(2, hq_).transpose(1, 2);
    Tensor v = qkv.slice(2, hq_ + hkv_).transpose(1, 2);
    auto [keys, values] = write(kc.select(0, layer), vc.select(0, layer), k, v, lengths);
    Tensor o;
    if (counts.empty()) {  // grouped_attention
      Tensor qg = q.reshape({b, hkv_, g * t, d_});
      o = at::scaled_dot_product_attention(qg, keys, values, mask).view({b, hq_, t, d_});
    } else {
      o = invariant(q, keys, values, counts);
    }
    return apply(p.wo, o.transpose(1, 2).reshape({b, t, hq_ * d_}), wide);
  }

  // KVCache.write
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

  // invariant_attention for a plan of key counts
  Tensor invariant(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts) {
    const int64_t b = q.size(0), t = q.size(2), g = hq_ / hkv_;
    if (b == 1 && t == 1 && counts[0] == k.size(2)) {
      Tensor qt = q.reshape({1, hkv_, g, d_}).contiguous();
      return at::scaled_dot_product_attention(qt, k, v).view({1, hq_, 1, d_});
    }
    Tensor by_token = q.transpose(1, 2).contiguous();
    std::vector<Tensor> outs;
    outs.reserve(b * t);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t i = 0; i < t; ++i) {
        const int64_t sel = counts[r * t + i];
        Tensor kb = k.slice(0, r, r + 1).slice(2, 0, sel);
        Tensor vb = v.slice(0, r, r + 1).slice(2, 0, sel);
        Tensor qt = by_token.select(0, r).select(0, i).view({1, hkv_, g, d_});
        outs.push_back(at::scaled_dot_product_attention(qt, kb, vb));
      }
    }
    return at::stack(outs).view({b, t, hq_, d_}).transpose(1, 2);
  }

  int64_t hq_, hkv_, d_;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Layers>(m, "Layers")
      .def(pybind11::init<int64_t, int64_t, int64_t>())
      .def("add_layer", &Layers::add_layer)
      .def("forward", &Layers::forward);
}
