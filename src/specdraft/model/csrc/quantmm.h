// Weight-only quantized products for few rows, batch-invariant by construction (included by
// decode.cpp): 4-bit layer matrices and the 8-bit (GGUF Q8_0) LM head.
//
// 4 bits: w[n, k] = q[n, k] * d[n, g] + m[n, g], g = k / 32 (quant.py's (q - 8) * scale + zero,
// with d = scale and m = zero - 8 scale: a GGUF Q4_1 block's own d and m, Q4_0's d and -8 d).
// 8 bits: w[n, k] = q[n, k] * d[n, g] (a Q8_0 block: q in -128..127).
// The weights are kept in tiles of 16 outputs, per pair of inputs (k = 2p, 2p + 1):
//   4 bits: tiles [N/16, K/2, 16] uint8, byte (p, lane) holding q[16 t + lane, 2p] in its low
//           nibble and q[16 t + lane, 2p + 1] in its high one;
//   8 bits: tiles [N/16, K/2, 2, 16] int8 (the pair's first input for the 16 lanes, then its second);
// and their per-group parameters [N/16, G, P, 16] float16 (P = 2: d, m; P = 1: d), GGUF's own
// precision, so as many bytes as the file's blocks (a one-row product is bound by DRAM).
// Each output is computed the same way whatever the number of rows in the call, the tile
// grouping or the thread:
//   per group g: a = sum over the group's first, third, ... input pairs of x[k] q[k] (in order),
//                b = the same over its other pairs, then
//                out = fma(d, a + b, out), then (4 bits) out = fma(m, sx[g], out)
//   (sx[g]: the row's sum over the group)
// with explicit fused multiply-adds (AVX-512 intrinsics), so no compiler choice can differ
// between the code paths for 1 to 8 rows; bfloat16 rows use AVX-512 BF16 dot products (each
// pair's two products at once: q is exact in bfloat16, so are its products with the rows).
// Each tile's values are widened once per group and used by every row of the pass (torch's
// CPU int4 kernel widens them again for every few rows, so its cost grows with the rows).
// Measured on 2 cores of an AMD EPYC Zen 5, the default model's 30 layers' 4-bit products:
// 4.0 ms at one row (torch's kernel the same: DRAM-bound), 8.1 ms at eight (12.4).
//
// Where AVX-512 is not compiled in (-march=native on a CPU without it), supports() is false
// and quant.py keeps torch's int4 kernel (and a bfloat16 LM head).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace quantmm {

using at::Tensor;

constexpr int64_t kTile = 16;   // outputs per tile
constexpr int64_t kGroup = 32;  // inputs per (scale, zero) pair
constexpr int kMaxRows = 8;     // rows per pass

inline bool supports(int64_t n, int64_t k) {
#if defined(__AVX512F__)
  return n % kTile == 0 && k % kGroup == 0 && n > 0 && k > 0;
#else
  (void)n;
  (void)k;
  return false;
#endif
}

// Which pass bfloat16 rows take here: "dot" (AVX-512 BF16 dot products), "fma" (float32
// fused multiply-adds) or "none" (no AVX-512: torch's kernel). Part of verify's conditions.
inline std::string path() {
#if defined(__AVX512BF16__)
  return "dot";
#elif defined(__AVX512F__)
  return "fma";
#else
  return "none";
#endif
}

// [N, G] -> [N/16, G, 16]: a tile's 16 outputs side by side
inline Tensor by_tile(const Tensor& t) {
  const int64_t n = t.size(0), g = t.size(1);
  return t.contiguous().view({n / kTile, kTile, g}).transpose(1, 2);
}

// q [N, K] uint8 (0..15), scale, zero [N, K/32] float32 (quant.py's Int4Weight) -> (tiles
// [N/16, K/2, 16] uint8, params [N/16, K/32, 2, 16] float16: d = scale, m = zero - 8 scale)
inline std::tuple<Tensor, Tensor> pack4(const Tensor& q, const Tensor& scale, const Tensor& zero) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % kTile == 0 && k % kGroup == 0, "quantmm: need N % 16 == 0 and K % 32 == 0");
  Tensor qt = q.to(at::kByte).contiguous().view({n / kTile, kTile, k / 2, 2});  // [T, 16, K/2, 2]
  Tensor tiles = at::bitwise_or(qt.select(3, 0), at::bitwise_left_shift(qt.select(3, 1), 4))
                     .transpose(1, 2)
                     .contiguous();  // [T, K/2, 16]
  Tensor d = scale.to(at::kDouble), m = zero.to(at::kDouble) - 8 * d;
  return {tiles, at::stack({by_tile(d), by_tile(m)}, 2).to(at::kHalf).contiguous()};  // [T, G, 2, 16]
}

// q [N, K] int8, d [N, K/32] float32 (quant.py's Q8Weight) -> (tiles [N/16, K/2, 2, 16] int8,
// params [N/16, K/32, 1, 16] float16)
inline std::tuple<Tensor, Tensor> pack8(const Tensor& q, const Tensor& d) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % kTile == 0 && k % kGroup == 0, "quantmm: need N % 16 == 0 and K % 32 == 0");
  Tensor tiles = q.to(at::kChar).contiguous().view({n / kTile, kTile, k / 2, 2}).permute({0, 2, 3, 1}).contiguous();
  return {tiles, by_tile(d.to(at::kDouble)).unsqueeze(2).to(at::kHalf).contiguous()};  // [T, G, 1, 16]
}

#if defined(__AVX512F__)

inline __m512 half(const at::Half* p) {  // 16 float16 values, widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

inline void store(at::BFloat16* out, __m512 v) {  // round to nearest even, as c10::BFloat16(float)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));  // NaN
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

// The stored values of one input pair for a tile's 16 outputs, as floats (first, second input).
template <int Bits>
struct Codes;

template <>
struct Codes<4> {
  static constexpr int64_t kPairBytes = 16, kParams = 2;
  static void widen(const uint8_t* p, __m512& first, __m512& second) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    first = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
    second = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
  }
};

template <>
struct Codes<8> {
  static constexpr int64_t kPairBytes = 32, kParams = 1;
  static void widen(const uint8_t* p, __m512& first, __m512& second) {
    first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kTile))));
  }
};

// The products of one input pair with one row, accumulated into acc: float32 rows in two fused
// multiply-adds, bfloat16 rows (where AVX-512 BF16 runs) in one dot product.
inline __m512 accumulate(__m512 acc, __m512 first, __m512 second, const float* x) {
  return _mm512_fmadd_ps(_mm512_set1_ps(x[1]), second, _mm512_fmadd_ps(_mm512_set1_ps(x[0]), first, acc));
}

#if defined(__AVX512BF16__)
inline __m512bh pair_bf16(__m512 first, __m512 second) {  // exact: the codes have at most 8 bits
  const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(first), 16);
  const __m512i hi = _mm512_and_si512(_mm512_castps_si512(second), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return (__m512bh)_mm512_or_si512(lo, hi);
}

inline __m512 accumulate(__m512 acc, __m512bh pair, const at::BFloat16* x) {
  int32_t two;
  std::memcpy(&two, x, sizeof(two));
  return _mm512_dpbf16_ps(acc, pair, (__m512bh)_mm512_set1_epi32(two));
}
#endif

// One pass: rows [R] of x (row stride ldx; float32, or bfloat16 for the dot products) against NB
// consecutive tiles; sx: the rows' group sums [R][G]; out: [R][16 NB] (row stride ldo).
template <int Bits, int R, int NB, typename X, typename Out>
void pass(const uint8_t* tiles, const at::Half* params, int64_t k, const X* x, int64_t ldx, const float* sx,
          int64_t ldsx, Out* out, int64_t ldo) {
  using C = Codes<Bits>;
  const int64_t groups = k / kGroup, tile_bytes = k / 2 * C::kPairBytes, tile_params = groups * C::kParams * kTile;
  __m512 acc[R][NB];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a[R][NB], b[R][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) a[r][j] = b[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kGroup / 2; p += 2) {
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
        const int64_t kk = g * kGroup + 2 * (p + h);
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
          __m512 first, second;
          C::widen(tiles + j * tile_bytes + (kk / 2) * C::kPairBytes, first, second);
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<X, at::BFloat16>) {
            const __m512bh pair = pair_bf16(first, second);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
              __m512& t = h == 0 ? a[r][j] : b[r][j];
              t = accumulate(t, pair, x + r * ldx + kk);
            }
            continue;
          }
#endif
          if constexpr (std::is_same_v<X, float>) {
            _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
              __m512& t = h == 0 ? a[r][j] : b[r][j];
              t = accumulate(t, first, second, x + r * ldx + kk);
            }
          }
        }
      }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
      const at::Half* pg = params + j * tile_params + g * C::kParams * kTile;
      const __m512 d = half(pg);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(d, _mm512_add_ps(a[r][j], b[r][j]), acc[r][j]);
        if constexpr (Bits == 4) acc[r][j] = _mm512_fmadd_ps(half(pg + kTile), _mm512_set1_ps(sx[r * ldsx + g]), acc[r][j]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) store(out + r * ldo + j * kTile, acc[r][j]);
}

// Rows [R] against the count tiles from tile t: NB at a time, then one by one.
template <int Bits, int R, int NB, typename X, typename Out>
void run_rows(const uint8_t* tiles, const at::Half* params, int64_t k, int64_t t, int64_t count, const X* x,
              int64_t ldx, const float* sx, int64_t ldsx, Out* out, int64_t ldo) {
  using C = Codes<Bits>;
  const int64_t tile_bytes = k / 2 * C::kPairBytes, tile_params = k / kGroup * C::kParams * kTile;
  int64_t i = t;
  for (; i + NB <= t + count; i += NB)
    pass<Bits, R, NB>(tiles + i * tile_bytes, params + i * tile_params, k, x, ldx, sx, ldsx, out + i * kTile, ldo);
  for (; i < t + count; ++i)
    pass<Bits, R, 1>(tiles + i * tile_bytes, params + i * tile_params, k, x, ldx, sx, ldsx, out + i * kTile, ldo);
}

template <typename X, typename Out>
using RowsFn = void (*)(const uint8_t*, const at::Half*, int64_t, int64_t, int64_t, const X*, int64_t,
                        const float*, int64_t, Out*, int64_t);

constexpr int64_t kSpan = 4;  // tiles per step of a thread: each row pass takes them together where it can

template <int Bits, typename X, typename Out>
RowsFn<X, Out> rows_fn(int r) {  // wider tile groups where few rows leave registers free
  static const RowsFn<X, Out> table[kMaxRows] = {
      run_rows<Bits, 1, 4, X, Out>, run_rows<Bits, 2, 4, X, Out>, run_rows<Bits, 3, 2, X, Out>,
      run_rows<Bits, 4, 2, X, Out>, run_rows<Bits, 5, 1, X, Out>, run_rows<Bits, 6, 1, X, Out>,
      run_rows<Bits, 7, 1, X, Out>, run_rows<Bits, 8, 1, X, Out>};
  return table[r - 1];
}

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 widen(const at::BFloat16* p) {  // bfloat16 -> float is a 16-bit shift: exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [M, K] -> xf [M, K] float32 and its group sums sx [M, K/32], each sum in a fixed order
template <typename In>
void prepare(const In* x, int64_t m, int64_t k, float* xf, float* sx) {
  for (int64_t i = 0; i < m * k; i += kGroup) {
    const __m512 a = widen(x + i), b = widen(x + i + kTile);
    _mm512_storeu_ps(xf + i, a);
    _mm512_storeu_ps(xf + i + kTile, b);
    sx[i / kGroup] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// Each thread takes a range of tiles, kSpan at a time, and runs every row over them before it
// moves on (a span's codes stay in cache across the rows' passes).
template <int Bits, typename In>
void run(const Tensor& x, const Tensor& tiles, const Tensor& params, Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), groups = k / kGroup;
  static thread_local std::vector<float> xf, sx;
  xf.resize(m * k);
  sx.resize(m * groups);
  prepare(x.data_ptr<In>(), m, k, xf.data(), sx.data());
  const uint8_t* tp = reinterpret_cast<const uint8_t*>(tiles.data_ptr());
  const at::Half* pp = params.data_ptr<at::Half>();
  const float* sp = sx.data();
  In* op = out.data_ptr<In>();
#if defined(__AVX512BF16__)
  constexpr bool dots = std::is_same_v<In, at::BFloat16>;  // the dot-product pass reads the rows as stored
#else
  constexpr bool dots = false;
#endif
  using X = std::conditional_t<dots, In, float>;
  const X* rows = dots ? reinterpret_cast<const X*>(x.data_ptr<In>()) : reinterpret_cast<const X*>(xf.data());
  const int64_t spans = (n / kTile + kSpan - 1) / kSpan;
  at::parallel_for(0, spans, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t = s * kSpan, count = std::min(kSpan, n / kTile - t);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        rows_fn<Bits, X, In>(r)(tp, pp, k, t, count, rows + r0 * k, k, sp + r0 * groups, groups, op + r0 * n, n);
      }
    }
  });
}

#endif

// x [M, K] (float32 or bfloat16) times the tiled weight (pack4 or pack8) -> [M, N] in x's dtype
inline Tensor matmul(const Tensor& x, const Tensor& tiles, const Tensor& params) {
  RECORD_FUNCTION("specdraft::quant_mm", std::vector<c10::IValue>());  // named in torch's profiler
  const int64_t k = x.size(1), n = tiles.size(0) * kTile;
  const bool eight = params.size(2) == 1;  // pack8's parameters: d alone
  TORCH_CHECK(supports(n, k) && tiles.size(1) * 2 == k, "quantmm: unsupported shape");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quantmm: float32 or bfloat16 rows");
  Tensor xc = x.contiguous();
  Tensor out = at::empty({x.size(0), n}, x.options());  // [M, N]
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    eight ? run<8, float>(xc, tiles, params, out) : run<4, float>(xc, tiles, params, out);
  } else {
    eight ? run<8, at::BFloat16>(xc, tiles, params, out) : run<4, at::BFloat16>(xc, tiles, params, out);
  }
#else
  (void)eight;
#endif
  return out;
}

}  // namespace quantmm
