// 4-bit weight products for few rows, batch-invariant by construction (included by decode.cpp).
//
// A weight is w[n, k] = q[n, k] * d[n, g] + m[n, g], g = k / 32 (quant.py's (q - 8) * scale +
// zero, with d = scale and m = zero - 8 scale: a GGUF Q4_1 block's own d and m, Q4_0's d and
// -8 d). The weights are kept in tiles of 16 outputs: tiles [N/16, K/2, 16] uint8, byte (p, lane)
// holding q[16 t + lane, 2p] in its low nibble and q[16 t + lane, 2p + 1] in its high one; their
// (d, m) pairs in groups [N/16, G, 2, 16] float16 (GGUF's own precision: 20 bytes per 32
// weights, as a Q4_1 block; DRAM bandwidth bounds a one-row product). Each output is computed
// the same way whatever the number of rows in the call, the tile grouping or the thread:
//   per group g: a = sum over the group's first, third, ... k pairs of x[k] q[k] (in order),
//                b = the same over its other pairs, then
//                out = fma(d, a + b, out), then out = fma(m, sx[g], out)   (sx[g] = sum of x over g)
// with explicit fused multiply-adds (AVX-512 intrinsics), so no compiler choice can differ
// between the code paths for 1 to 8 rows. Each tile's 4-bit values are widened once per group
// and used by every row of the pass (torch's CPU int4 kernel widens them again for every few
// rows, so its cost grows with the rows: 0.19 ms a layer at one row, 0.42 at eight, on 2 cores
// of an AMD EPYC Zen 5).
//
// Where AVX-512 is not compiled in (-march=native on a CPU without it), supports() is false
// and quant.py keeps torch's kernel.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace int4mm {

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

// q [N, K] uint8 (0..15), scale, zero [N, K/32] float32 (quant.py's Int4Weight) -> (tiles
// [N/16, K/2, 16] uint8, pairs [N/16, K/32, 2, 16] float16: d = scale, m = zero - 8 scale)
inline std::tuple<Tensor, Tensor> pack(const Tensor& q, const Tensor& scale, const Tensor& zero) {
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
  TORCH_CHECK(n % kTile == 0 && k % kGroup == 0, "int4mm: need N % 16 == 0 and K % 32 == 0");
  Tensor qt = q.to(at::kByte).contiguous().view({n / kTile, kTile, k / 2, 2});  // [T, 16, K/2, 2]
  Tensor tiles = at::bitwise_or(qt.select(3, 0), at::bitwise_left_shift(qt.select(3, 1), 4))
                     .transpose(1, 2)
                     .contiguous();  // [T, K/2, 16]
  auto by_tile = [&](const Tensor& t) {  // [N, G] -> [T, G, 16]
    return t.contiguous().view({n / kTile, kTile, g}).transpose(1, 2);
  };
  Tensor d = scale.to(at::kDouble), m = zero.to(at::kDouble) - 8 * d;
  Tensor pairs = at::stack({by_tile(d), by_tile(m)}, 2).to(at::kHalf).contiguous();  // [T, G, 2, 16]
  return {tiles, pairs};
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

// One pass: rows [R] of x (float32, row stride ldx) against NB consecutive tiles; sx: the rows'
// group sums [R][G]; out: [R][16 NB] (row stride ldo).
template <int R, int NB, typename Out>
void pass(const uint8_t* tiles, const at::Half* pairs, int64_t k, const float* x, int64_t ldx, const float* sx,
          int64_t ldsx, Out* out, int64_t ldo) {
  const int64_t groups = k / kGroup, tile_bytes = k / 2 * kTile, pair_halves = groups * 2 * kTile;
  __m512 acc[R][NB];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 even[R][NB], odd[R][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) even[r][j] = odd[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      const int64_t kk = g * kGroup + 2 * p;
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tiles + j * tile_bytes + (kk / 2) * kTile));
        const __m512i wide = _mm512_cvtepu8_epi32(bytes);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(wide, low));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
          even[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk]), lo, even[r][j]);
          odd[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk + 1]), hi, odd[r][j]);
        }
      }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
      const __m512 d = half(pairs + j * pair_halves + g * 2 * kTile);
      const __m512 m = half(pairs + j * pair_halves + g * 2 * kTile + kTile);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(sx[r * ldsx + g]);
        acc[r][j] = _mm512_fmadd_ps(m, s, _mm512_fmadd_ps(d, _mm512_add_ps(even[r][j], odd[r][j]), acc[r][j]));
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) store(out + r * ldo + j * kTile, acc[r][j]);
}

#if defined(__AVX512BF16__)
// pass() for bfloat16 rows: each k pair's two products in one bfloat16 dot-product instruction
// (the 4-bit values 0..15 are exact in bfloat16, so are their products with the rows), half
// the instructions of two fused multiply-adds. x: the rows as stored (bfloat16, row stride ldx),
// read two at a time; a and b: the group's even and odd k pairs.
template <int R, int NB>
void pass(const uint8_t* tiles, const at::Half* pairs, int64_t k, const at::BFloat16* x, int64_t ldx, const float* sx,
          int64_t ldsx, at::BFloat16* out, int64_t ldo) {
  const int64_t groups = k / kGroup, tile_bytes = k / 2 * kTile, pair_halves = groups * 2 * kTile;
  __m512 acc[R][NB];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a[R][NB], b[R][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) a[r][j] = b[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kGroup / 2; p += 2) {
      _Pragma("GCC unroll 2") for (int64_t h = 0; h < 2; ++h) {
        const int64_t kk = g * kGroup + 2 * (p + h);
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tiles + j * tile_bytes + (kk / 2) * kTile));
          const __m512i wide = _mm512_cvtepu8_epi32(bytes);
          const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_and_si512(wide, low)));
          const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4)));
          const __m512bh w = (__m512bh)_mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(hi, high_half));
          _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            int32_t two;
            std::memcpy(&two, x + r * ldx + kk, sizeof(two));
            const __m512bh xs = (__m512bh)_mm512_set1_epi32(two);
            if (h == 0) {
              a[r][j] = _mm512_dpbf16_ps(a[r][j], w, xs);
            } else {
              b[r][j] = _mm512_dpbf16_ps(b[r][j], w, xs);
            }
          }
        }
      }
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) {
      const __m512 d = half(pairs + j * pair_halves + g * 2 * kTile);
      const __m512 m = half(pairs + j * pair_halves + g * 2 * kTile + kTile);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(sx[r * ldsx + g]);
        acc[r][j] = _mm512_fmadd_ps(m, s, _mm512_fmadd_ps(d, _mm512_add_ps(a[r][j], b[r][j]), acc[r][j]));
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; ++j) store(out + r * ldo + j * kTile, acc[r][j]);
}
#endif

// Rows [R] against every tile from t0 to t1 (NB tiles a pass where they fit, then one by one).
// X: the rows as pass() reads them (float32, or bfloat16 where the dot-product pass exists).
template <int R, int NB, typename X, typename Out>
void run_rows(const uint8_t* tiles, const at::Half* pairs, int64_t k, int64_t t0, int64_t t1, const X* x,
              int64_t ldx, const float* sx, int64_t ldsx, Out* out, int64_t ldo) {
  const int64_t tile_bytes = k / 2 * kTile, pair_halves = k / kGroup * 2 * kTile;
  int64_t t = t0;
  for (; t + NB <= t1; t += NB)
    pass<R, NB>(tiles + t * tile_bytes, pairs + t * pair_halves, k, x, ldx, sx, ldsx, out + t * kTile, ldo);
  for (; t < t1; ++t)
    pass<R, 1>(tiles + t * tile_bytes, pairs + t * pair_halves, k, x, ldx, sx, ldsx, out + t * kTile, ldo);
}

template <typename X, typename Out>
using RowsFn = void (*)(const uint8_t*, const at::Half*, int64_t, int64_t, int64_t, const X*, int64_t,
                        const float*, int64_t, Out*, int64_t);

template <typename X, typename Out>
RowsFn<X, Out> rows_fn(int r) {  // wider tile groups where few rows leave registers free
  static const RowsFn<X, Out> table[kMaxRows] = {
      run_rows<1, 4, X, Out>, run_rows<2, 4, X, Out>, run_rows<3, 2, X, Out>, run_rows<4, 2, X, Out>,
      run_rows<5, 1, X, Out>, run_rows<6, 1, X, Out>, run_rows<7, 1, X, Out>, run_rows<8, 1, X, Out>};
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

template <typename In>
void run(const Tensor& x, const Tensor& tiles, const Tensor& pairs, Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), groups = k / kGroup;
  static thread_local std::vector<float> xf, sx;
  xf.resize(m * k);
  sx.resize(m * groups);
  prepare(x.data_ptr<In>(), m, k, xf.data(), sx.data());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const at::Half* pp = pairs.data_ptr<at::Half>();
  const float* xp = xf.data();
  const float* sp = sx.data();
  In* op = out.data_ptr<In>();
#if defined(__AVX512BF16__)
  constexpr bool dots = std::is_same_v<In, at::BFloat16>;  // the dot-product pass reads the rows as stored
#else
  constexpr bool dots = false;
#endif
  using X = std::conditional_t<dots, In, float>;
  const X* rows = dots ? reinterpret_cast<const X*>(x.data_ptr<In>()) : reinterpret_cast<const X*>(xp);
  at::parallel_for(0, n / kTile, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      rows_fn<X, In>(r)(tp, pp, k, t0, t1, rows + r0 * k, k, sp + r0 * groups, groups, op + r0 * n, n);
    }
  });
}

#endif

// x [M, K] (float32 or bfloat16) times the tiled weight -> [M, N] in x's dtype
inline Tensor matmul(const Tensor& x, const Tensor& tiles, const Tensor& pairs) {
  const int64_t k = x.size(1), n = tiles.size(0) * kTile;
  TORCH_CHECK(supports(n, k) && tiles.size(1) * 2 == k, "int4mm: unsupported shape");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4mm: float32 or bfloat16 rows");
  Tensor xc = x.contiguous();
  Tensor out = at::empty({x.size(0), n}, x.options());  // [M, N]
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    run<float>(xc, tiles, pairs, out);
  } else {
    run<at::BFloat16>(xc, tiles, pairs, out);
  }
#endif
  return out;
}

}  // namespace int4mm
