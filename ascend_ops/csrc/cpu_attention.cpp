// CPU paged attention that reads the block-structured KV cache in place (no gathered copy).
// Built once by ascend_ops/cpu_kernels.py (torch.utils.cpp_extension.load_inline) and registered as
// torch.ops.rollbus_cpu.*. Layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
//
// paged_attention_rows: every query row r attends to the first row_len[r] tokens of the sequence whose
// block table is tables[row_table[r]] (row_table empty: tables[r]); with window > 0, to the last `window` of
// them only (a sliding-window layer as HF masks it: the keys at positions [row_len[r] - window, row_len[r])); with
// sinks (gpt-oss), each query head's softmax has one more logit, its sink, in the denominator only.
// Work is split over (row, kv head); each item computes the G = Hq / Hk query heads that share the kv head:
// scores q.k * scale in fp32, a two-pass softmax (max, then exp and sum), and the weighted sum of V, all in fp32 whatever the dtypes;
// the output is written in q's dtype. q / out and the caches share one dtype (fp32 or bf16), or q is fp32
// and the caches bf16 or fp16 (--kv-cache-dtype: the cached keys and values are read exactly, widened).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROLLBUS_AVX512 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Ask for a token record (all kv heads of one token, contiguous) of the next block while this one is computed.
template <typename T>
inline void prefetch_record(const T* rec, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(rec);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// The same into L2 only (the next row's keys and values, a row ahead: L1 holds the chunk being computed).
inline void prefetch_l2(const void* rec, int64_t bytes) {
  const char* p = static_cast<const char*>(rec);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpMin = -87.0f;  // e^-87 ~ 1.6e-38: inputs below flush to it (softmax numerators only)
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f, kP3 = 4.1665795894E-2f,
                kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;  // Cephes expf's polynomial

// exp(x) for x <= 0: Cody-Waite reduction to [-ln2/2, ln2/2], the degree-6 polynomial, 2^n through the
// exponent bits. Relative error ~1e-7.
inline float exp_neg(float x) {
  const float v = std::max(x, kExpMin);
  const float r = std::nearbyint(v * kLog2e);
  const float f = v - r * kLn2Hi + r * kLn2Lo;
  float p = kP0;
  p = p * f + kP1;
  p = p * f + kP2;
  p = p * f + kP3;
  p = p * f + kP4;
  p = p * f + kP5;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// --- the portable loops (any CPU) ------------------------------------------------------------------

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

// s[j * stride] = q_j . k for the g query heads q_j = q + j * d that share one kv head.
template <typename T>
inline void group_dots_plain(const float* q, const T* k, int64_t g, int64_t d, float* s, int64_t stride) {
  for (int64_t j = 0; j < g; ++j) s[j * stride] = dot(q + j * d, k, d);
}

// s[0 .. n) = exp(s - m); returns their sum.
inline float exp_sum_plain(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = exp_neg(s[t] - m));
  return sum;
}

// acc[j * d + i] += sum over tokens of p_j[t] * v_t[i] for the g query heads of one kv head; base[b]: the
// head's row of token 0 of block b, vt: the token stride; p: the g rows of numerators, row stride len; the
// len tokens start `skip` tokens into block 0 (a sliding window's first key).
template <typename T>
void weighted_sum_plain(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g,
                        int64_t d, float* acc, int64_t skip) {
  for (int64_t pos = 0; pos < len; ++pos) {
    const T* v = base[(pos + skip) / bs] + ((pos + skip) % bs) * vt;
    for (int64_t j = 0; j < g; ++j) {
      const float w = p[j * len + pos];
      float* a = acc + j * d;
      for (int64_t i = 0; i < d; ++i) a[i] += w * to_float(v[i]);
    }
  }
}

#ifdef __AVX2__
// --- AVX2 + FMA (compiled only where the CPU has both; see cpu_kernels.py) --------------------------
// Token at a time, on purpose. Measured on an AMD EPYC Zen 2 (2026-12-04; SmolLM2's 9 query / 3 kv heads of
// 64, 1,024 rows of ~130 positions over fp32 blocks of 16 at random places, one thread): this loop takes 27 ms
// a layer, 7.5 GB/s of keys and values, where a plain read of the same blocks runs at 11-13 GB/s. Scoring 8
// positions at once (no horizontal sum per key) and a one-pass kernel (online softmax, keys and values of a
// chunk together) ran 1.2-1.6x faster with the cache in L2 but no faster from memory (26-28 ms), and slower
// over a bf16 cache (25 against 17.5 ms); no prefetch distance, locality or spacing did better than the
// one-block-ahead requests here.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the 16 bits moved to the top
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {  // fp16 -> fp32 is exact (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

template <typename T, int G>
inline void dots(const float* q, const T* k, int64_t d, float* s, int64_t stride) {
  __m256 acc[G];
  for (int j = 0; j < G; ++j) acc[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 kv = load8(k + i);
    for (int j = 0; j < G; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), kv, acc[j]);
  }
  for (int j = 0; j < G; ++j) {
    float t = hsum(acc[j]);
    for (int64_t r = i; r < d; ++r) t += q[j * d + r] * to_float(k[r]);
    s[j * stride] = t;
  }
}

template <typename T>
inline void group_dots(const float* q, const T* k, int64_t g, int64_t d, float* s, int64_t stride) {
  int64_t j = 0;
  for (; j + 4 <= g; j += 4) dots<T, 4>(q + j * d, k, d, s + j * stride, stride);
  switch (g - j) {
    case 1: dots<T, 1>(q + j * d, k, d, s + j * stride, stride); break;
    case 2: dots<T, 2>(q + j * d, k, d, s + j * stride, stride); break;
    case 3: dots<T, 3>(q + j * d, k, d, s + j * stride, stride); break;
    default: break;
  }
}

inline __m256 exp8(__m256 x) {
  const __m256 v = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(r, _mm256_set1_ps(kLn2Hi), v);
  f = _mm256_fmadd_ps(r, _mm256_set1_ps(kLn2Lo), f);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, f), f, _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc) + exp_sum_plain(s + t, n - t, m);
}

// G query heads x V vectors of 8 accumulators in registers over all tokens, for columns [c, c + 8V) of d.
template <typename T, int G, int V>
inline void wsum_cols(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t c,
                      int64_t d, float* acc, int64_t skip) {
  __m256 a[G][V];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < V; ++u) a[j][u] = _mm256_setzero_ps();
  for (int64_t b = 0, pos = 0; pos < len; ++b) {
    const int64_t tb = b == 0 ? skip : 0;  // the first token of this block that is read
    const T* row = base[b] + c + tb * vt;
    const int64_t n = std::min(bs - tb, len - pos);
    for (int64_t t = 0; t < n; ++t, ++pos) {
      __m256 x[V];
      for (int u = 0; u < V; ++u) x[u] = load8(row + t * vt + 8 * u);
      for (int j = 0; j < G; ++j) {
        const __m256 w = _mm256_broadcast_ss(p + j * len + pos);
        for (int u = 0; u < V; ++u) a[j][u] = _mm256_fmadd_ps(w, x[u], a[j][u]);
      }
    }
  }
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < V; ++u) _mm256_storeu_ps(acc + j * d + c + 8 * u, a[j][u]);
}

template <typename T, int G>
inline void wsum_group(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t d,
                       float* acc, int64_t skip) {
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) wsum_cols<T, G, 4>(p, len, base, bs, vt, c, d, acc, skip);
  for (; c + 8 <= d; c += 8) wsum_cols<T, G, 1>(p, len, base, bs, vt, c, d, acc, skip);
  for (; c < d; ++c) {  // columns past the last multiple of 8
    for (int j = 0; j < G; ++j) {
      float s = 0.f;
      for (int64_t pos = 0; pos < len; ++pos)
        s += p[j * len + pos] * to_float(base[(pos + skip) / bs][((pos + skip) % bs) * vt + c]);
      acc[j * d + c] = s;
    }
  }
}

template <typename T>
void weighted_sum(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g, int64_t d,
                  float* acc, int64_t skip) {
  int64_t j = 0;  // query heads three at a time: 12 accumulators + 4 loaded vectors fit the 16 registers
  for (; j + 3 <= g; j += 3) wsum_group<T, 3>(p + j * len, len, base, bs, vt, d, acc + j * d, skip);
  if (g - j == 2) wsum_group<T, 2>(p + j * len, len, base, bs, vt, d, acc + j * d, skip);
  if (g - j == 1) wsum_group<T, 1>(p + j * len, len, base, bs, vt, d, acc + j * d, skip);
}
#else
template <typename T>
inline void group_dots(const float* q, const T* k, int64_t g, int64_t d, float* s, int64_t stride) {
  group_dots_plain(q, k, g, d, s, stride);
}
inline float exp_sum(float* s, int64_t n, float m) { return exp_sum_plain(s, n, m); }
template <typename T>
void weighted_sum(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g, int64_t d,
                  float* acc, int64_t skip) {
  std::fill(acc, acc + g * d, 0.f);
  weighted_sum_plain(p, len, base, bs, vt, g, d, acc, skip);
}
#endif

#ifdef ROLLBUS_AVX512
// --- AVX-512 (F, BW, VL; compiled only where the CPU has them): 16 positions at a time ---------------
// Scores: for each query head, 16 accumulators (one per position, its chain of FMAs over the head
// dimension in 16-lane pieces) reduced together by one transpose tree, so no horizontal sum per key.
// Weighted sum: the G x d accumulators of a kv head's query heads stay in registers over the 16
// positions. Positions stream in table order, keys then values, one 16-position chunk of all the item's
// kv heads at a time (contiguous within a block).
namespace v512 {

constexpr int64_t kChunk = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// r[t] = the sum of the 16 lanes of a[t], t = 0..15, in a fixed order (pairs of lanes, then of pairs, ...).
inline __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of tokens 2i, 2i+1
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: tokens 4i .. 4i+3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[j * stride + t] = q_j . k_t for the g query heads of one kv head and the chunk's positions t < n
// (k[t] + off: position t's key of this head; the pointers past n repeat a valid one, their sums unused).
template <typename T>
inline void chunk_scores(const float* q, const T* const* k, int64_t off, int64_t g, int64_t d, float* s,
                         int64_t stride, __mmask16 keep) {
  const int64_t full = d / 16;
  const __mmask16 tail = first(d % 16);
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = q + j * d;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t u = 0; u < full; ++u) {
      const __m512 qv = _mm512_loadu_ps(qj + 16 * u);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qv, load16(k[t] + off + 16 * u), acc[t]);
    }
    if (tail) {
      const __m512 qv = _mm512_maskz_loadu_ps(tail, qj + 16 * full);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qv, load16(k[t] + off + 16 * full, tail), acc[t]);
    }
    _mm512_mask_storeu_ps(s + j * stride, keep, reduce16(acc));
  }
}

// acc[j * d + c ..] += sum over the chunk's n positions of p_j[t] * v_t[c ..] for G query heads and the
// columns [c, c + 16V) (the last vector masked by `last`).
template <typename T, int G, int V>
inline void wsum_cols(const float* p, int64_t stride, const T* const* v, int64_t off, int64_t n, int64_t c,
                      __mmask16 last, int64_t d, float* acc) {
  __m512 a[G][V];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < V; ++u) a[j][u] = _mm512_maskz_loadu_ps(u == V - 1 ? last : 0xFFFF, acc + j * d + c + 16 * u);
  for (int64_t t = 0; t < n; ++t) {
    __m512 x[V];
    for (int u = 0; u < V; ++u) x[u] = load16(v[t] + off + c + 16 * u, u == V - 1 ? last : __mmask16(0xFFFF));
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * stride + t]);
      for (int u = 0; u < V; ++u) a[j][u] = _mm512_fmadd_ps(w, x[u], a[j][u]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < V; ++u) _mm512_mask_storeu_ps(acc + j * d + c + 16 * u, u == V - 1 ? last : 0xFFFF, a[j][u]);
}

template <typename T, int G>
inline void wsum_group(const float* p, int64_t stride, const T* const* v, int64_t off, int64_t n, int64_t d,
                       float* acc) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) wsum_cols<T, G, 4>(p, stride, v, off, n, c, 0xFFFF, d, acc);
  for (; c < d; c += 16) wsum_cols<T, G, 1>(p, stride, v, off, n, c, first(d - c), d, acc);
}

// The g query heads of one kv head, four at a time (16 accumulators + 4 loaded vectors of 32 registers).
template <typename T>
inline void chunk_wsum(const float* p, int64_t stride, const T* const* v, int64_t off, int64_t n, int64_t g,
                       int64_t d, float* acc) {
  int64_t j = 0;
  for (; j + 4 <= g; j += 4) wsum_group<T, 4>(p + j * stride, stride, v, off, n, d, acc + j * d);
  switch (g - j) {
    case 1: wsum_group<T, 1>(p + j * stride, stride, v, off, n, d, acc + j * d); break;
    case 2: wsum_group<T, 2>(p + j * stride, stride, v, off, n, d, acc + j * d); break;
    case 3: wsum_group<T, 3>(p + j * stride, stride, v, off, n, d, acc + j * d); break;
    default: break;
  }
}

inline __m512 exp16(__m512 x) {
  const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(r, _mm512_set1_ps(kLn2Hi), v);
  f = _mm512_fmadd_ps(r, _mm512_set1_ps(kLn2Lo), f);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, f), f, _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, r);  // p * 2^r: exact, as the clamp keeps 2^r normal (exp8 builds its bits)
}

// s *= scale in place; returns the maximum (-inf for n = 0).
inline float scale_max(float* s, int64_t n, float scale) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = first(n - t);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + t), sc);
    _mm512_mask_storeu_ps(s + t, k, x);
    m = _mm512_mask_max_ps(m, k, m, x);
  }
  return _mm512_reduce_max_ps(m);
}

// s = exp(s - m) in place; returns their sum.
inline float exp_sum(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = first(n - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
    _mm512_mask_storeu_ps(s + t, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// ptr[t] = the record of position p0 + t (t < n; past n: position p0 + n - 1) in a cache of block stride
// cb and token stride ct, heads from h0 (stride ch).
template <typename T>
inline void chunk_records(const T* cache, const int64_t* table, int64_t ts1, int64_t bs, int64_t cb, int64_t ct,
                          int64_t ch0, int64_t p0, int64_t n, const T** ptr) {
  for (int64_t t = 0; t < kChunk; ++t) {
    const int64_t pos = p0 + std::min(t, n - 1);
    ptr[t] = cache + table[(pos / bs) * ts1] * cb + (pos % bs) * ct + ch0;
  }
}

}  // namespace v512
#endif

// Q: the dtype of q and out; T: the caches'. window > 0: row r reads only its last `window` positions (a
// sliding-window layer; the blocks before them may have been given back: their table entries are not read).
// sk: gpt-oss's attention sinks, one fp32 logit per query head (nullptr: none), each one more term of its head's
// softmax denominator (taking part in the maximum, as HF's softmax over the scores and the sink does).
template <typename Q, typename T>
void attend_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& row_table, const at::Tensor& row_len, double scale,
                 int64_t window, const float* sk) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hk = k_cache.size(2);
  const int64_t g = hq / hk;
  const int64_t width = tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rt = row_table.numel() ? row_table.data_ptr<int64_t>() : nullptr;
  const int64_t* lp = row_len.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t ts0 = tables.stride(0), ts1 = tables.stride(1);
  const int64_t num_blocks = k_cache.size(0);
  // the first position row r reads
  const auto first_pos = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lp[r] - window) : int64_t(0); };
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {  // validate every block id a row will read, before any thread starts
    const int64_t tr = rt ? rt[r] : r;
    TORCH_CHECK(tr >= 0 && tr < tables.size(0), "paged_attention_rows: row_table[", r, "] out of range");
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= width * bs, "paged_attention_rows: row_len[", r, "] = ", lp[r],
                " does not fit its block table");
    for (int64_t b = first_pos(r) / bs; b < (lp[r] + bs - 1) / bs; ++b) {
      const int64_t blk = tp[tr * ts0 + b * ts1];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention_rows: block id ", blk, " out of range");
    }
    max_len = std::max(max_len, lp[r] - first_pos(r));
  }
  const float fscale = static_cast<float>(scale);

  // An item is one row and a range of its kv heads: all of them when there are enough rows to keep every
  // thread busy (a token's keys of all heads are one contiguous record, so the blocks stream in order),
  // else one head per item.
  const int64_t split = rows >= 4 * at::get_num_threads() ? 1 : hk;
  const int64_t per = hk / split;
  at::parallel_for(0, rows * split, 1, [&](int64_t begin, int64_t end) {
    const int64_t span = std::max<int64_t>(max_len, 1);
    const int64_t heads = per * g;  // query heads of an item
    std::vector<float> qf(heads * d), acc(heads * d), scores(heads * span), inv(heads);
    [[maybe_unused]] std::vector<const T*> vbase(span / bs + 2);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / split, h0 = (item % split) * per;
      const int64_t end_pos = lp[r], start = first_pos(r);
      const int64_t len = end_pos - start;  // the positions read: [start, end_pos); scores[j * len + pos - start]
      const int64_t* table = tp + (rt ? rt[r] : r) * ts0;
      [[maybe_unused]] const int64_t b0 = start / bs, nblk = (end_pos + bs - 1) / bs;
      for (int64_t j = 0; j < heads; ++j) {
        const Q* src = qp + r * qs0 + (h0 * g + j) * qs1;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(src[i]);
      }
#ifdef ROLLBUS_AVX512
      // The next item of this thread (none: this one again, already cached), prefetched into L2 meanwhile.
      const int64_t nitem = item + 1 < end ? item + 1 : item;
      const int64_t nr = nitem / split, nh0 = (nitem % split) * per, nlen = lp[nr], nstart = first_pos(nr);
      const int64_t* ntable = tp + (rt ? rt[nr] : nr) * ts0;
      // scores[j * len + pos] = q_j . k_pos, 16 positions at a time. Rows are a few cache blocks long, so
      // the prefetches run a whole item ahead: while this item reads chunk c of its keys (then of its
      // values), the next item's chunk c of keys (of values) is brought into L2.
      for (int64_t c0 = 0; c0 < len; c0 += v512::kChunk) {
        const int64_t p0 = start + c0, n = std::min(v512::kChunk, len - c0);
        const T* rec[v512::kChunk];
        v512::chunk_records(kp, table, ts1, bs, kb, kt, h0 * kh, p0, n, rec);
        const int64_t rec_bytes = per * kh * static_cast<int64_t>(sizeof(T));
        const char* pf[v512::kChunk];  // the next item's keys at this chunk's positions
        int64_t npf = 0;
        for (int64_t t = nstart + c0; t < std::min(nstart + c0 + v512::kChunk, nlen); ++t)
          pf[npf++] = reinterpret_cast<const char*>(kp + ntable[(t / bs) * ts1] * kb + (t % bs) * kt + nh0 * kh);
        for (int64_t h = 0; h < per; ++h) {  // the prefetches spread between the heads' computations
          for (int64_t i = h * npf / per; i < (h + 1) * npf / per; ++i) prefetch_l2(pf[i], rec_bytes);
          v512::chunk_scores(qf.data() + h * g * d, rec, h * kh, g, d, scores.data() + h * g * len + c0, len,
                             v512::first(n));
        }
        if (c0 + v512::kChunk >= len)  // this row's last chunk: the rest of the next one's keys
          for (int64_t t = nstart + c0 + v512::kChunk; t < nlen; ++t)
            prefetch_l2(kp + ntable[(t / bs) * ts1] * kb + (t % bs) * kt + nh0 * kh, rec_bytes);
      }
#else
      // scores[j * len + pos] = q_j . k_pos for query head j of this item; the blocks stream in table order.
      // Prefetched meanwhile: the next block's keys and this block's values (read in the second pass).
      for (int64_t b = b0; b < nblk; ++b) {
        const int64_t n = std::min(bs, end_pos - b * bs);
        const T* base = kp + table[b * ts1] * kb + h0 * kh;
        const T* next = b + 1 < nblk ? kp + table[(b + 1) * ts1] * kb + h0 * kh : nullptr;
        const T* vals = vp + table[b * ts1] * vb + h0 * vh;
        for (int64_t t = b == b0 ? start - b0 * bs : 0; t < n; ++t) {
          if (next) prefetch_record(next + t * kt, per * kh);
          prefetch_record(vals + t * vt, per * vh);
          for (int64_t h = 0; h < per; ++h)
            group_dots(qf.data() + h * g * d, base + t * kt + h * kh, g, d,
                       scores.data() + h * g * len + b * bs + t - start, len);
        }
      }
#endif
      for (int64_t j = 0; j < heads; ++j) {
        float* s = scores.data() + j * len;
#ifdef ROLLBUS_AVX512
        float m = v512::scale_max(s, len, fscale);  // (q . k) * scale, as SDPA
#else
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t] *= fscale);  // (q . k) * scale, as SDPA
#endif
        const float sink = sk ? sk[h0 * g + j] : -INFINITY;
        if (sk) m = std::max(m, sink);
#ifdef ROLLBUS_AVX512
        float sum = v512::exp_sum(s, len, m);
#else
        float sum = exp_sum(s, len, m);
#endif
        if (sk) sum += exp_neg(sink - m);
        if constexpr (!std::is_same_v<Q, float>) {
          // As torch's CPU flash attention does for reduced types: the normaliser sums the fp32 numerators,
          // the weighted sum of V takes them rounded to q's dtype (accumulating in fp32).
          for (int64_t t = 0; t < len; ++t) s[t] = static_cast<float>(static_cast<Q>(s[t]));
        }
        inv[j] = len ? 1.0f / sum : 0.f;
      }
      if (item + 1 < end) {  // the next item's first block of keys, while this one sums its values
        const int64_t r1 = (item + 1) / split, h1 = ((item + 1) % split) * per, s1 = first_pos(r1);
        const T* k1 = kp + tp[(rt ? rt[r1] : r1) * ts0 + (s1 / bs) * ts1] * kb + h1 * kh;
        for (int64_t t = s1 % bs; t < std::min(bs, lp[r1] - s1 / bs * bs); ++t) prefetch_record(k1 + t * kt, per * kh);
      }
#ifdef ROLLBUS_AVX512
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c0 = 0; c0 < len; c0 += v512::kChunk) {
        const int64_t p0 = start + c0, n = std::min(v512::kChunk, len - c0);
        const T* rec[v512::kChunk];
        v512::chunk_records(vp, table, ts1, bs, vb, vt, h0 * vh, p0, n, rec);
        // the next item's values at this chunk's positions (at the last chunk: all the rest), into L2
        const int64_t vrec = per * vh * static_cast<int64_t>(sizeof(T));
        const int64_t upto = c0 + v512::kChunk >= len ? nlen : std::min(nstart + c0 + v512::kChunk, nlen);
        for (int64_t t = nstart + c0; t < upto; ++t)
          prefetch_l2(vp + ntable[(t / bs) * ts1] * vb + (t % bs) * vt + nh0 * vh, vrec);
        for (int64_t h = 0; h < per; ++h)
          v512::chunk_wsum(scores.data() + h * g * len + c0, len, rec, h * vh, n, g, d, acc.data() + h * g * d);
      }
#else
      for (int64_t h = 0; h < per; ++h) {
        for (int64_t b = b0; b < nblk; ++b) vbase[b - b0] = vp + table[b * ts1] * vb + (h0 + h) * vh;
        weighted_sum(scores.data() + h * g * len, len, vbase.data(), bs, vt, g, d, acc.data() + h * g * d,
                     start - b0 * bs);
      }
#endif
      for (int64_t j = 0; j < heads; ++j) {
        Q* o = op + r * os0 + (h0 * g + j) * os1;
        const float* a = acc.data() + j * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<Q>(a[i] * inv[j]);
      }
    }
  });
}

void paged_attention_rows(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& row_table,
                          const at::Tensor& row_len, double scale, int64_t window,
                          const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "paged_attention_rows: window must be >= 0, got ", window);
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->is_contiguous() &&
                             sinks->size(0) == q.size(1) && sinks->device().is_cpu()),
              "paged_attention_rows: sinks are one contiguous float32 CPU logit per query head");
  const float* sk = has_sinks ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention_rows: q/out [R, Hq, D], caches [num_blocks, block_size, Hk, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention_rows: CPU tensors only");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_attention_rows: q and out must have one dtype, and the caches one dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0 && out.sizes() == q.sizes(),
              "paged_attention_rows: shapes do not match");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention_rows: the head dimension must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && row_len.scalar_type() == at::kLong &&
                  (row_table.numel() == 0 || row_table.scalar_type() == at::kLong),
              "paged_attention_rows: tables, row_table and row_len are int64");
  TORCH_CHECK(row_len.is_contiguous() && row_table.is_contiguous() && row_len.numel() == q.size(0) &&
                  (row_table.numel() == 0 || row_table.numel() == q.size(0)),
              "paged_attention_rows: one row_len (and row_table) per query row");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) {
    attend_rows<float, float>(out, q, k_cache, v_cache, tables, row_table, row_len, scale, window, sk);
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    attend_rows<float, c10::BFloat16>(out, q, k_cache, v_cache, tables, row_table, row_len, scale, window, sk);
  } else if (qt == at::kFloat && ct == at::kHalf) {
    attend_rows<float, c10::Half>(out, q, k_cache, v_cache, tables, row_table, row_len, scale, window, sk);
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    attend_rows<c10::BFloat16, c10::BFloat16>(out, q, k_cache, v_cache, tables, row_table, row_len, scale, window, sk);
  } else {
    TORCH_CHECK(false, "paged_attention_rows: q, out and the caches must have one dtype, float32 or bfloat16 (or q "
                "float32 over bfloat16 or float16 caches); got q ", qt, ", caches ", ct);
  }
}

// How many threads an at::parallel_for over `items` ran on in this library: what every kernel here gets
// (1 where the library was built without OpenMP, whatever torch.get_num_threads() says).
int64_t parallel_width(int64_t items) {
  std::mutex mu;
  std::vector<int> seen;
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    std::lock_guard<std::mutex> hold(mu);
    if (std::find(seen.begin(), seen.end(), tid) == seen.end()) seen.push_back(tid);
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

TORCH_LIBRARY(rollbus_cpu, m) {
  m.def("paged_attention_rows(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor row_table, Tensor row_len, float scale, int window=0, Tensor? sinks=None) -> ()");
  m.def("parallel_width(int items) -> int");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) { m.impl("paged_attention_rows", &paged_attention_rows); }
// No tensor argument to dispatch on: registered for every backend.
TORCH_LIBRARY_IMPL(rollbus_cpu, CompositeExplicitAutograd, m) { m.impl("parallel_width", &parallel_width); }
