// Batch-invariant attention by construction (included by decode.cpp).
//
// Each query's output is computed from its own visible keys alone, in an order that depends on
// nothing but their count: the same bits whatever the number of rows or tokens in the forward,
// the cache's capacity, or the thread that runs it. One task per (query, key/value head), run
// side by side. Per task: the group's queries (pre-scaled by 1/sqrt(D)) dot every visible key
// (16-lane vectors over D, then a fixed pairwise sum), a softmax (16-lane exponentials over the
// keys, a fixed lane-wise sum), and the values weighted key by key in order. Float32 throughout,
// inputs in bfloat16 or float32.
//
// It replaces one flash-attention call per query (at::scaled_dot_product_attention), whose
// per-call overhead made a batch of 8 decoding rows cost ~170 us a layer on 2 cores; this takes
// ~100 (measured on an AMD EPYC Zen 5, -march=native). fastpath.py builds with -march=native on
// x86-64. With AVX-512 a 16-lane vector is one register; without it, two 8-lane halves with the
// same lane-wise arithmetic (the same bits: 300 random shapes compared with the 16-lane build's
// output on an AVX2-only EPYC), where GCC's lowering of the 64-byte type had made the kernel 5x
// slower (4.5 ms a layer for 9 queries over 1,000 keys, now 0.7).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attend {

using at::Tensor;

typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

#ifdef __AVX512F__
typedef float f16v __attribute__((vector_size(64)));  // 16 float lanes, one register
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline f8v lo8(f16v a) { return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7); }
inline f8v hi8(f16v a) { return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15); }
inline f16v select_max(f16v x, f16v floor) { return x < floor ? floor : x; }
inline f16v shift_exponent(f16v p, f16v k) {  // p * 2^k, k integral
  i16v bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(k, i16v) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}
#else
// Without AVX-512, 16 lanes as two 8-lane halves (lanes 0-7, 8-15), each op done half by half:
// the same arithmetic lane for lane as the 16-lane type, so the same bits. (GCC's own lowering
// of a 64-byte vector on AVX2 went through memory: 5x slower.)
struct f16v {
  f8v lo, hi;
};
inline f16v operator+(f16v a, f16v b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline f16v operator-(f16v a, f16v b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline f16v operator*(f16v a, f16v b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline f16v operator+(f16v a, float b) { return {a.lo + b, a.hi + b}; }
inline f16v operator-(f16v a, float b) { return {a.lo - b, a.hi - b}; }
inline f16v operator*(f16v a, float b) { return {a.lo * b, a.hi * b}; }
inline f16v operator*(float a, f16v b) { return {a * b.lo, a * b.hi}; }
inline f16v& operator+=(f16v& a, f16v b) { return a = a + b; }
inline f8v lo8(f16v a) { return a.lo; }
inline f8v hi8(f16v a) { return a.hi; }
inline f16v select_max(f16v x, f16v floor) {
  return {x.lo < floor.lo ? floor.lo : x.lo, x.hi < floor.hi ? floor.hi : x.hi};
}
inline f8v shift_exponent8(f8v p, f8v k) {
  i8v bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(k, i8v) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}
inline f16v shift_exponent(f16v p, f16v k) { return {shift_exponent8(p.lo, k.lo), shift_exponent8(p.hi, k.hi)}; }
#endif

constexpr int kLanes = 16;
constexpr int kMaxChunks = 16;  // head dim <= 256
constexpr int kMaxGroup = 16;   // query heads per key/value head
constexpr int64_t kTasksPerThread = 4;  // at::parallel_for's grain

inline f16v load(const float* p) {
  f16v r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline f8v load8(const at::BFloat16* p) {  // bfloat16 -> float is a 16-bit shift: exact
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f8v r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}

inline f16v load(const at::BFloat16* p) {
#ifdef __AVX512F__
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f16v r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
#else
  return {load8(p), load8(p + 8)};
#endif
}

inline void store(float* p, f16v a) { std::memcpy(p, &a, sizeof(a)); }  // lanes 0-15 in order

inline float hsum(f16v a) {  // a fixed pairwise order
  f8v b = lo8(a) + hi8(a);
  f4v c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) for x <= 0 (a softmax's shifted scores): 2^k * p(r) with r = x - k ln2, |r| <= ln2 / 2,
// p a degree-7 polynomial (relative error ~2e-7); below -87 it returns exp(-87) ~ 1.6e-38.
inline f16v vexp(f16v x) {
  const f16v floor_x = f16v{} - 87.0f;
  x = select_max(x, floor_x);
  f16v k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  f16v r = x - k * 0.693145751953125f;
  r = r - k * 1.428606765330187e-06f;
  f16v p = f16v{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return shift_exponent(p, k);
}

// Scores [G, n] -> probabilities in place (unnormalised); returns 1 / each row's sum in inv.
inline void softmax_rows(float* s, int64_t g_count, int64_t n, float* inv) {
  for (int64_t g = 0; g < g_count; ++g) {
    float* sg = s + g * n;
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    f16v acc{};
    for (int64_t i = 0; i < n; i += kLanes) {
      const int64_t left = n - i < kLanes ? n - i : kLanes;
      float lanes[kLanes] = {};
      std::memcpy(lanes, sg + i, left * sizeof(float));
      store(lanes, vexp(load(lanes) - m));
      for (int64_t l = left; l < kLanes; ++l) lanes[l] = 0.0f;
      std::memcpy(sg + i, lanes, left * sizeof(float));
      acc += load(lanes);
    }
    inv[g] = 1.0f / hsum(acc);
  }
}

// One task: query j's G heads of key/value head h over its visible keys (key index i of
// ``keys``: keys[i] < 0 means i itself, the first-n case).
template <typename T>
void one_task(const T* q, const T* k, const T* v, T* out, int64_t g_count, int64_t d, int64_t n,
              const int64_t* picks, int64_t k_step, int64_t v_step, std::vector<float>& s) {
  const int64_t chunks = d / kLanes;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  f16v qv[kMaxGroup][kMaxChunks];
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t c = 0; c < chunks; ++c) qv[g][c] = load(q + g * d + c * kLanes) * scale;
  s.resize(g_count * n);
  for (int64_t i = 0; i < n; ++i) {
    const T* kr = k + (picks ? picks[i] : i) * k_step;
    f16v kv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load(kr + c * kLanes);
    for (int64_t g = 0; g < g_count; ++g) {
      f16v acc = qv[g][0] * kv[0];
      for (int64_t c = 1; c < chunks; ++c) acc += qv[g][c] * kv[c];
      s[g * n + i] = hsum(acc);
    }
  }
  float inv[kMaxGroup];
  softmax_rows(s.data(), g_count, n, inv);
  f16v o[kMaxGroup][kMaxChunks];
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t c = 0; c < chunks; ++c) o[g][c] = f16v{};
  for (int64_t i = 0; i < n; ++i) {
    const T* vr = v + (picks ? picks[i] : i) * v_step;
    f16v vv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) vv[c] = load(vr + c * kLanes);
    for (int64_t g = 0; g < g_count; ++g) {
      const float p = s[g * n + i];
      for (int64_t c = 0; c < chunks; ++c) o[g][c] += p * vv[c];
    }
  }
  float lanes[kLanes];
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      store(lanes, o[g][c]);
      for (int l = 0; l < kLanes; ++l) out[g * d + c * kLanes + l] = static_cast<T>(lanes[l] * inv[g]);
    }
}

template <typename T>
void run(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const std::vector<int64_t>& rows,
         const std::vector<int64_t>& n_of, const std::vector<const int64_t*>& pick_of) {
  const int64_t hkv = q.size(1), g = q.size(2), d = q.size(3);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // a few tasks (one decoding row) stay on the calling thread: waking another costs what they do
  at::parallel_for(0, q.size(0) * hkv, kTasksPerThread, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t j = w / hkv, h = w % hkv;
      const int64_t at_q = (j * hkv + h) * g * d;
      if (n_of[j] == 0) {  // nothing visible (never in a causal model): zeros
        for (int64_t e = 0; e < g * d; ++e) op[at_q + e] = static_cast<T>(0.0f);
        continue;
      }
      one_task<T>(qp + at_q, kp + rows[j] * k.stride(0) + h * k.stride(1), vp + rows[j] * v.stride(0) + h * v.stride(1),
                  op + at_q, g, d, n_of[j], pick_of[j], k.stride(2), v.stride(2), scores);
    }
  });
}

inline bool supports(int64_t d, int64_t group, at::ScalarType dtype) {
  return d % kLanes == 0 && d / kLanes <= kMaxChunks && group <= kMaxGroup &&
         (dtype == at::kBFloat16 || dtype == at::kFloat);
}

// q [Q, Hkv, G, D] (Q queries); k, v [B, Hkv, S, D] with D contiguous; per query its cache row
// rows[j] and its keys: counts[j] >= 0 the first counts[j] positions, -1 the next of picks
// (a tree node's visible positions, in order). Returns [Q, Hkv, G, D] in q's dtype.
inline Tensor attention(const Tensor& q_in, const Tensor& k, const Tensor& v, const std::vector<int64_t>& rows,
                        const std::vector<int64_t>& counts, const std::vector<Tensor>& picks) {
  RECORD_FUNCTION("specdraft::attend", std::vector<c10::IValue>());  // named in torch's profiler
  const Tensor q = q_in.contiguous();
  const int64_t nq = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(supports(d, g, q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type() && k.stride(3) == 1 && v.stride(3) == 1,
              "attend: unsupported shapes or dtypes");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == nq && static_cast<int64_t>(counts.size()) == nq,
              "attend: one row and one key count per query");
  std::vector<const int64_t*> pick_of(nq, nullptr);
  std::vector<int64_t> n_of(nq);
  std::vector<Tensor> owned;
  size_t next = 0;
  for (int64_t j = 0; j < nq; ++j) {
    if (counts[j] >= 0) {
      n_of[j] = counts[j];
      continue;
    }
    owned.push_back(picks.at(next++).to(at::kLong).contiguous());
    pick_of[j] = owned.back().data_ptr<int64_t>();
    n_of[j] = owned.back().numel();
  }
  Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, out, rows, n_of, pick_of);
  } else {
    run<at::BFloat16>(q, k, v, out, rows, n_of, pick_of);
  }
  return out;
}

}  // namespace attend
