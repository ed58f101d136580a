// CPU paged attention that reads the block-structured KV cache in place (no gathered copy).
// Built once by ascend_ops/cpu_kernels.py (torch.utils.cpp_extension.load_inline) and registered as
// torch.ops.rollbus_cpu.*. Layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
//
// paged_attention_rows: every query row r attends to the first row_len[r] tokens of the sequence whose
// block table is tables[row_table[r]] (row_table empty: tables[r]). Work is split over (row, kv head);
// each item computes the G = Hq / Hk query heads that share the kv head: scores q.k * scale in fp32, a
// two-pass softmax (max, then exp and sum), and the weighted sum of V, all in fp32 whatever the cache
// dtype (fp32 or bf16); the output is written in q's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Ask for a token record (all kv heads of one token, contiguous) of the next block while this one is computed.
template <typename T>
inline void prefetch_record(const T* rec, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(rec);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

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
// head's row of token 0 of block b, vt: the token stride; p: the g rows of numerators, row stride len.
template <typename T>
void weighted_sum_plain(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g,
                        int64_t d, float* acc) {
  for (int64_t pos = 0; pos < len; ++pos) {
    const T* v = base[pos / bs] + (pos % bs) * vt;
    for (int64_t j = 0; j < g; ++j) {
      const float w = p[j * len + pos];
      float* a = acc + j * d;
      for (int64_t i = 0; i < d; ++i) a[i] += w * to_float(v[i]);
    }
  }
}

#ifdef __AVX2__
// --- AVX2 + FMA (compiled only where the CPU has both; see cpu_kernels.py) --------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the 16 bits moved to the top
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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
                      int64_t d, float* acc) {
  __m256 a[G][V];
  for (int j = 0; j < G; ++j)
    for (int u = 0; u < V; ++u) a[j][u] = _mm256_setzero_ps();
  for (int64_t b = 0, pos = 0; pos < len; ++b) {
    const T* row = base[b] + c;
    const int64_t n = std::min(bs, len - pos);
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
                       float* acc) {
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) wsum_cols<T, G, 4>(p, len, base, bs, vt, c, d, acc);
  for (; c + 8 <= d; c += 8) wsum_cols<T, G, 1>(p, len, base, bs, vt, c, d, acc);
  for (; c < d; ++c) {  // columns past the last multiple of 8
    for (int j = 0; j < G; ++j) {
      float s = 0.f;
      for (int64_t pos = 0; pos < len; ++pos) s += p[j * len + pos] * to_float(base[pos / bs][(pos % bs) * vt + c]);
      acc[j * d + c] = s;
    }
  }
}

template <typename T>
void weighted_sum(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g, int64_t d,
                  float* acc) {
  int64_t j = 0;  // query heads three at a time: 12 accumulators + 4 loaded vectors fit the 16 registers
  for (; j + 3 <= g; j += 3) wsum_group<T, 3>(p + j * len, len, base, bs, vt, d, acc + j * d);
  if (g - j == 2) wsum_group<T, 2>(p + j * len, len, base, bs, vt, d, acc + j * d);
  if (g - j == 1) wsum_group<T, 1>(p + j * len, len, base, bs, vt, d, acc + j * d);
}
#else
template <typename T>
inline void group_dots(const float* q, const T* k, int64_t g, int64_t d, float* s, int64_t stride) {
  group_dots_plain(q, k, g, d, s, stride);
}
inline float exp_sum(float* s, int64_t n, float m) { return exp_sum_plain(s, n, m); }
template <typename T>
void weighted_sum(const float* p, int64_t len, const T* const* base, int64_t bs, int64_t vt, int64_t g, int64_t d,
                  float* acc) {
  std::fill(acc, acc + g * d, 0.f);
  weighted_sum_plain(p, len, base, bs, vt, g, d, acc);
}
#endif

template <typename T>
void attend_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& row_table, const at::Tensor& row_len, double scale) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hk = k_cache.size(2);
  const int64_t g = hq / hk;
  const int64_t width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
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
  int64_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {  // validate every block id a row will read, before any thread starts
    const int64_t tr = rt ? rt[r] : r;
    TORCH_CHECK(tr >= 0 && tr < tables.size(0), "paged_attention_rows: row_table[", r, "] out of range");
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= width * bs, "paged_attention_rows: row_len[", r, "] = ", lp[r],
                " does not fit its block table");
    for (int64_t b = 0; b < (lp[r] + bs - 1) / bs; ++b) {
      const int64_t blk = tp[tr * ts0 + b * ts1];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention_rows: block id ", blk, " out of range");
    }
    max_len = std::max(max_len, lp[r]);
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
    std::vector<const T*> vbase((span + bs - 1) / bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / split, h0 = (item % split) * per;
      const int64_t len = lp[r];
      const int64_t* table = tp + (rt ? rt[r] : r) * ts0;
      const int64_t nblk = (len + bs - 1) / bs;
      for (int64_t j = 0; j < heads; ++j) {
        const T* src = qp + r * qs0 + (h0 * g + j) * qs1;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(src[i]);
      }
      // scores[j * len + pos] = q_j . k_pos for query head j of this item; the blocks stream in table order.
      // Prefetched meanwhile: the next block's keys and this block's values (read in the second pass).
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t n = std::min(bs, len - b * bs);
        const T* base = kp + table[b * ts1] * kb + h0 * kh;
        const T* next = b + 1 < nblk ? kp + table[(b + 1) * ts1] * kb + h0 * kh : nullptr;
        const T* vals = vp + table[b * ts1] * vb + h0 * vh;
        for (int64_t t = 0; t < n; ++t) {
          if (next) prefetch_record(next + t * kt, per * kh);
          prefetch_record(vals + t * vt, per * vh);
          for (int64_t h = 0; h < per; ++h)
            group_dots(qf.data() + h * g * d, base + t * kt + h * kh, g, d, scores.data() + h * g * len + b * bs + t, len);
        }
      }
      for (int64_t j = 0; j < heads; ++j) {
        float* s = scores.data() + j * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t] *= fscale);  // (q . k) * scale, as SDPA
        const float sum = exp_sum(s, len, m);
        if constexpr (!std::is_same_v<T, float>) {
          // As torch's CPU flash attention does for reduced types: the normaliser sums the fp32 numerators,
          // the weighted sum of V takes them rounded to the cache dtype (accumulating in fp32).
          for (int64_t t = 0; t < len; ++t) s[t] = static_cast<float>(static_cast<T>(s[t]));
        }
        inv[j] = len ? 1.0f / sum : 0.f;
      }
      if (item + 1 < end) {  // the next item's first block of keys, while this one sums its values
        const int64_t r1 = (item + 1) / split, h1 = ((item + 1) % split) * per;
        const T* k1 = kp + tp[(rt ? rt[r1] : r1) * ts0] * kb + h1 * kh;
        for (int64_t t = 0; t < std::min(bs, lp[r1]); ++t) prefetch_record(k1 + t * kt, per * kh);
      }
      for (int64_t h = 0; h < per; ++h) {
        for (int64_t b = 0; b < nblk; ++b) vbase[b] = vp + table[b * ts1] * vb + (h0 + h) * vh;
        weighted_sum(scores.data() + h * g * len, len, vbase.data(), bs, vt, g, d, acc.data() + h * g * d);
      }
      for (int64_t j = 0; j < heads; ++j) {
        T* o = op + r * os0 + (h0 * g + j) * os1;
        const float* a = acc.data() + j * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(a[i] * inv[j]);
      }
    }
  });
}

void paged_attention_rows(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& row_table,
                          const at::Tensor& row_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention_rows: q/out [R, Hq, D], caches [num_blocks, block_size, Hk, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention_rows: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_attention_rows: q, out and the caches must have one dtype");
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
  if (q.scalar_type() == at::kFloat) {
    attend_rows<float>(out, q, k_cache, v_cache, tables, row_table, row_len, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_rows<c10::BFloat16>(out, q, k_cache, v_cache, tables, row_table, row_len, scale);
  } else {
    TORCH_CHECK(false, "paged_attention_rows: float32 or bfloat16 only, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(rollbus_cpu, m) {
  m.def("paged_attention_rows(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor row_table, Tensor row_len, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) { m.impl("paged_attention_rows", &paged_attention_rows); }
