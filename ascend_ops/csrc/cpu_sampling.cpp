// The sampler's inverse-CDF draw from log-probabilities in one kernel: the common RL row (plain sampling at
// temperature 1, whose probabilities are exp(log_softmax(logits))) without materialising exp(logprobs) and a
// float64 cumulative sum over the whole vocabulary. Compiled as one unit with cpu_attention.cpp (its exp8 /
// v512::exp16 / exp_neg) and cpu_elementwise.cpp (cpu_kernels.SOURCES).
//
// draw_logprobs(lp [R, V] fp32, u [R] fp64) -> [R] int64: for each row, with p_i = exp(lp_i) in fp32 (0 for
// lp_i below -87, so a banned token's -inf is exactly 0) and sums in float64, the first token i whose
// cumulative sum p_0 + ... + p_i exceeds u * (p_0 + ... + p_{V-1}): the same rule as the torch path
// (torch.searchsorted(cumsum, target, right=True)), so a token of zero probability is never drawn. Pass one
// sums chunks of the row; pass two walks the chunk sums to the one that crosses the target and the tokens
// inside it. The sums run in another order than a sequential cumsum (last bits of a float64); a target
// that lands in that rounding falls through to the next chunks, and a target at or past the total (u
// rounding up) takes the last token of non-zero probability.

#include <ATen/ops/empty.h>

#include <vector>

namespace {

constexpr int64_t kDrawChunk = 256;

// buf[0, n) = exp(x[0, n)) for log-probabilities x (<= 0), zero below kExpMin.
inline void chunk_probs(const float* x, int64_t n, float* buf) {
  int64_t i = 0;
#ifdef ROLLBUS_AVX512
  const __m512 lo16 = _mm512_set1_ps(kExpMin);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(buf + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, lo16, _CMP_GE_OQ), v512::exp16(v)));
  }
#endif
#ifdef __AVX2__
  const __m256 lo = _mm256_set1_ps(kExpMin);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(buf + i, _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ), exp8(v)));
  }
#endif
  for (; i < n; ++i) buf[i] = x[i] < kExpMin ? 0.0f : exp_neg(x[i]);
}

inline double chunk_sum(const float* buf, int64_t n) {
  int64_t i = 0;
  double s = 0.0;
#ifdef ROLLBUS_AVX512
  __m512d a = _mm512_setzero_pd(), b = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(buf + i);
    a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    b = _mm512_add_pd(b, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(a, b));
#endif
  for (; i < n; ++i) s += static_cast<double>(buf[i]);
  return s;
}

int64_t draw_row(const float* x, int64_t vocab, double u, std::vector<double>& sums) {
  float buf[kDrawChunk];
  const int64_t chunks = (vocab + kDrawChunk - 1) / kDrawChunk;
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = std::min(kDrawChunk, vocab - c * kDrawChunk);
    chunk_probs(x + c * kDrawChunk, n, buf);
    total += (sums[c] = chunk_sum(buf, n));
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t c = 0;
  while (c < chunks && !(acc + sums[c] > target)) acc += sums[c++];
  int64_t last = -1;  // the last token of non-zero probability seen in the walk
  for (; c < chunks; ++c) {
    const int64_t n = std::min(kDrawChunk, vocab - c * kDrawChunk);
    chunk_probs(x + c * kDrawChunk, n, buf);
    for (int64_t i = 0; i < n; ++i) {
      if (buf[i] == 0.0f) continue;
      last = c * kDrawChunk + i;
      acc += static_cast<double>(buf[i]);
      if (acc > target) return last;
    }
  }
  if (last >= 0) return last;
  for (int64_t i = vocab - 1; i > 0; --i)  // the target was past every chunk: the last token that can be drawn
    if (x[i] >= kExpMin) return i;
  return 0;
}

at::Tensor draw_logprobs(const at::Tensor& lp, const at::Tensor& u) {
  TORCH_CHECK(lp.device().is_cpu() && lp.dim() == 2 && lp.scalar_type() == at::kFloat && lp.stride(1) == 1,
              "draw_logprobs: logprobs are CPU float32 [R, V], last dim contiguous");
  TORCH_CHECK(u.device().is_cpu() && u.dim() == 1 && u.size(0) == lp.size(0) && u.scalar_type() == at::kDouble &&
                  u.is_contiguous(),
              "draw_logprobs: u is one contiguous float64 per row");
  const int64_t rows = lp.size(0), vocab = lp.size(1), stride = lp.stride(0);
  at::Tensor out = at::empty({rows}, lp.options().dtype(at::kLong));
  TORCH_CHECK(vocab > 0 || rows == 0, "draw_logprobs: an empty vocabulary");
  const float* x = lp.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<double> sums((vocab + kDrawChunk - 1) / kDrawChunk);
    for (int64_t r = b; r < e; ++r) op[r] = draw_row(x + r * stride, vocab, up[r], sums);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) { m.def("draw_logprobs(Tensor logprobs, Tensor u) -> Tensor"); }

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) { m.impl("draw_logprobs", &draw_logprobs); }
