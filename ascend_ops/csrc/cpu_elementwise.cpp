// Fused elementwise kernels of the default (not batch-invariant) CPU path: RMSNorm (alone, or after the
// residual add that precedes it), rotary embedding on q and k, SiLU(gate) * up. One pass over
// the data and one call instead of torch's chain of ops (each its own pass, allocation and dispatch).
// Compiled as one unit with cpu_attention.cpp (cpu_kernels.SOURCES, this file after it), whose helpers
// (load8, hsum, exp8 under AVX2; exp_neg, to_float) it uses. The arithmetic is torch's, step by step:
// fp32 throughout for fp32; for bf16 each step is rounded to bf16 where the torch op would round
// (-ffp-contract=off keeps a * b + c two roundings, as torch's kernels compute it). Only RMSNorm's sum of
// squares runs in another order (8 lanes, then their sum) than torch's reduction.

#include <ATen/ops/empty.h>

#include <tuple>
#include <type_traits>

namespace {

inline float round_as(float x, float) { return x; }
inline float round_as(float x, c10::BFloat16) { return static_cast<float>(static_cast<c10::BFloat16>(x)); }

#ifdef __AVX2__
// fp32 -> nearest-even bf16, kept in fp32 (c10's rounding; a NaN stays a quiet NaN).
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 round8(__m256 v, float) { return v; }
inline __m256 round8(__m256 v, c10::BFloat16) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif
#ifdef ROLLBUS_AVX512
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline __m512 round16(__m512 v, float) { return v; }
inline __m512 round16(__m512 v, c10::BFloat16) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#endif

// sum of x[i]^2 in fp32
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 u = load8(x + i), v = load8(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 u = load8(x + i);
    a = _mm256_fmadd_ps(u, u, a);
  }
  s = hsum(_mm256_add_ps(a, b));
#endif
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  return s;
}

// out = w * (x * rsqrt(mean(x^2) + eps)), x normalised in fp32 then rounded to T, as HF's LlamaRMSNorm.
template <typename T>
inline void norm_row(const T* x, const T* w, int64_t n, float eps, T* out) {
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 rv = _mm256_set1_ps(r);
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(load8(w + i), round8(_mm256_mul_ps(load8(x + i), rv), T())));
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(to_float(w[i]) * round_as(to_float(x[i]) * r, T()));
}

// x: [R, H] or [R, h, D] (last dim contiguous, any other strides); normalised over the last dim.
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t n = x.size(-1), outer = x.dim() == 3 ? x.size(1) : 1;
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0) * outer, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm_row(xp + (i / outer) * s0 + (i % outer) * s1, wp, n, eps, op + i * n);
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, op,
              ": x is a CPU tensor [R, H] or [R, h, D] with a contiguous last dim");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              op, ": weight is [last dim of x], contiguous, of x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 only");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, eps, out);
  else rms_norm_impl<c10::BFloat16>(x, w, eps, out);
  return out;
}

// (s, rms_norm(s)) with s = x + h rounded to T (the residual add before a norm), x and h [R, H].
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w, double eps, at::Tensor& s,
                       at::Tensor& out) {
  const int64_t n = x.size(1), xs = x.stride(0), hs = h.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* sp = s.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* srow = sp + r * n;
      for (int64_t i = 0; i < n; ++i) srow[i] = static_cast<T>(to_float(xp[r * xs + i]) + to_float(hp[r * hs + i]));
      norm_row(srow, wp, n, eps, op + r * n);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type() && h.stride(1) == 1,
              "add_rms_norm: x and h are [R, H] of one dtype, last dim contiguous");
  at::Tensor s = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(x, h, w, eps, s, out);
  else add_rms_norm_impl<c10::BFloat16>(x, h, w, eps, s, out);
  return {s, out};
}

// out = x * cos + rotate_half(x) * sin (HF's rotate-half layout) for x [T, heads, D] (rows strided, as the
// q or k slice of the q/k/v product), cos/sin [T, D]; out contiguous.
template <typename T>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t heads = x.size(1), d = x.size(2), half = d / 2, s0 = x.stride(0), s1 = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0) * heads, std::max<int64_t>(1, 16384 / d), [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / heads;
      const T* v = xp + t * s0 + (item % heads) * s1;
      const T* c = cp + t * d;
      const T* s = sp + t * d;
      T* o = op + item * d;
      int64_t i = 0;
#ifdef __AVX2__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // fp32's loop vectorises itself; bf16's roundings do not
        for (; i + 8 <= half; i += 8) {  // the same products, roundings and sums as the loop below, 8 at a time
          const __m256 x1 = load8(v + i), x2 = load8(v + i + half);
          store8(o + i, _mm256_sub_ps(round8(_mm256_mul_ps(x1, load8(c + i)), T()),
                                      round8(_mm256_mul_ps(x2, load8(s + i)), T())));
          store8(o + i + half, _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c + i + half)), T()),
                                             round8(_mm256_mul_ps(x1, load8(s + i + half)), T())));
        }
      }
#endif
      for (; i < half; ++i) {
        const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
        o[i] = static_cast<T>(round_as(x1 * to_float(c[i]), T()) - round_as(x2 * to_float(s[i]), T()));
        o[i + half] = static_cast<T>(round_as(x2 * to_float(c[i + half]), T()) + round_as(x1 * to_float(s[i + half]), T()));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->stride(2) == 1 && x->size(2) % 2 == 0 &&
                    x->size(0) == cos.size(0) && x->size(2) == cos.size(1) && x->scalar_type() == cos.scalar_type(),
                "rope: q, k [T, heads, D] (D even, contiguous) of cos's dtype");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && sin.sizes() == cos.sizes() &&
                  sin.scalar_type() == cos.scalar_type(),
              "rope: cos and sin are contiguous [T, D] of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "rope: float32 or bfloat16 only");
  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  if (q.scalar_type() == at::kFloat) {
    rope_impl<float>(q, cos, sin, qo);
    rope_impl<float>(k, cos, sin, ko);
  } else {
    rope_impl<c10::BFloat16>(q, cos, sin, qo);
    rope_impl<c10::BFloat16>(k, cos, sin, ko);
  }
  return {qo, ko};
}

// silu(g) = g / (1 + e^-g). The vector exp takes min(-g, kExpMax): from ~88.4 on its 2^n is +inf (the
// exponent bits all ones), so a very negative g gives g / inf = -0, as torch's silu.
constexpr float kExpMax = 89.0f;
inline float silu1(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
void silu_mul_impl(const at::Tensor& g, const at::Tensor& u, at::Tensor& out) {
  const int64_t n = g.size(1), gs = g.stride(0), us = u.stride(0);
  const T* gp = g.data_ptr<T>();
  const T* up = u.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, g.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* gr = gp + r * gs;
      const T* ur = up + r * us;
      T* o = op + r * n;
      int64_t i = 0;
#ifdef ROLLBUS_AVX512
      const __m512 one16 = _mm512_set1_ps(1.0f), two16 = _mm512_set1_ps(2.0f), top16 = _mm512_set1_ps(kExpMax);
      for (; i + 16 <= n; i += 16) {
        const __m512 x = v512::load16(gr + i);
        const __m512 d = _mm512_add_ps(one16, v512::exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), top16)));
        __m512 s;
        if constexpr (std::is_same_v<T, float>) {  // x / d as x * (1 / d): rcp14 and one Newton step (~1 ulp);
          // below x = -88 (d ~ e^88 and up, where the step loses the reciprocal) x * 0, as x / d ~ -0 there
          const __m512 dm = _mm512_min_ps(d, _mm512_set1_ps(1e38f));
          __m512 y = _mm512_rcp14_ps(dm);
          y = _mm512_mul_ps(y, _mm512_fnmadd_ps(dm, y, two16));
          s = _mm512_mask_mul_ps(_mm512_mul_ps(x, y), _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), x,
                                 _mm512_setzero_ps());
        } else {  // the division itself: bf16 rounds the result where torch's would round it
          s = _mm512_div_ps(x, d);
        }
        store16(o + i, _mm512_mul_ps(round16(s, T()), v512::load16(ur + i)));
      }
#endif
#ifdef __AVX2__
      const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(kExpMax), neg = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = load8(gr + i);
        const __m256 t = exp8(_mm256_min_ps(_mm256_xor_ps(x, neg), top));
        store8(o + i, _mm256_mul_ps(round8(_mm256_div_ps(x, _mm256_add_ps(one, t)), T()), load8(ur + i)));
      }
#endif
      for (; i < n; ++i) o[i] = static_cast<T>(round_as(silu1(to_float(gr[i])), T()) * to_float(ur[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.device().is_cpu() && g.dim() == 2 && u.sizes() == g.sizes() && g.stride(1) == 1 && u.stride(1) == 1 &&
                  u.scalar_type() == g.scalar_type(),
              "silu_and_mul: gate and up are CPU [R, I] of one dtype, last dim contiguous");
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16,
              "silu_and_mul: float32 or bfloat16 only");
  at::Tensor out = at::empty(g.sizes(), g.options());
  if (g.scalar_type() == at::kFloat) silu_mul_impl<float>(g, u, out);
  else silu_mul_impl<c10::BFloat16>(g, u, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor h, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_and_mul", &silu_and_mul);
}
