// fp32 linear layers on an AVX2/FMA kernel of our own over weights packed in column panels:
// ascend_ops.packed_linear's "avx2" backend (the default for fp32 on x86 CPUs with AVX2 but no AVX-512 and no
// MKL advantage, i.e. AMD Zen 2/3). Compiled as one unit with cpu_attention.cpp (cpu_kernels.SOURCES).
//
// Why: a decode step multiplies a few dozen rows by every weight. At 16-64 rows oneDNN's packed product ran at
// 70-80% of its large-M rate on an AMD EPYC (Zen 3, one thread: 36.5 / 48.3 / 54.0 GFLOP/s at 16 / 32 / 64
// rows over SmolLM2's layer shapes, 68 at 128+), this kernel at 51.3 / 57.2 / 65.1 (71 at 128).
//
// Layout: the weight [N, K] becomes ceil(N/16) panels, each [K][16]: for every k the 16 weights of 16
// consecutive output features (the last panel zero-padded). A micro-kernel keeps a tile of up to 6 rows x 16
// outputs in 12 ymm accumulators, and for each k loads the panel's 16 weights once and broadcasts each row's
// x[k] (BLIS's 6x16 shape for AVX2). K is walked in chunks of 256 so a panel's chunk (16 KiB) stays in L1
// while every row tile of the step passes over it; rows are walked 120 at a time so their chunk stays in L2.
// Threads take whole panels (at::parallel_for): each streams its own share of the weight.
//
// Every output is bias (or 0) followed by one fused multiply-add per k, k = 0..K-1 in order, whatever the
// number of rows, the tile a row falls in or the number of threads: a row's result is the same bits in any
// batch (batch_invariant.py's row invariance holds by construction, and its start-up self-check measures it).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;     // output features per panel
constexpr int64_t kDepth = 256;    // k per chunk: a panel's chunk is 16 KiB
constexpr int64_t kTileRows = 6;   // rows per micro-kernel tile
constexpr int64_t kRowChunk = 120; // rows per pass over a thread's panels (20 tiles)

std::string panel_gemm_unavailable() {
#if defined(__AVX2__) && defined(__FMA__)
  return "";
#else
  return "the CPU kernels were compiled without AVX2 and FMA (this CPU lacks them, or ROLLBUS_CPU_KERNELS=portable)";
#endif
}

int64_t panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// weight [N, K] fp32 -> panels [ceil(N/16)][K][16], flattened
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "panel_pack: a 2-D float32 CPU weight [out_features, in_features]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), p = panels(n);
  at::Tensor out = at::zeros({p * k * kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, p, 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < kPanel && q * kPanel + j < n; ++j) {
        const float* row = src + (q * kPanel + j) * k;
        float* col = dst + q * k * kPanel + j;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)

#define PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// rows [0, R) of x (stride ldx) times one panel's k in [k0, k1) into c (stride ldc, `cols` valid outputs of
// 16); first: start from the bias (or 0), else from what c holds (the previous chunk's sums)
template <int R>
void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* c, int64_t ldc,
                int64_t cols, const float* bias, bool first) {
  const __m256 zero = _mm256_setzero_ps();
#define PANEL_DECL(r) __m256 lo##r = zero, hi##r = zero;
  PANEL_ROWS(PANEL_DECL)
  alignas(32) float tmp[kPanel];
  if (first) {
    __m256 b0 = zero, b1 = zero;
    if (bias != nullptr) {
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, bias, cols * sizeof(float));
      b0 = _mm256_load_ps(tmp);
      b1 = _mm256_load_ps(tmp + 8);
    }
#define PANEL_BIAS(r) if (R > r) { lo##r = b0; hi##r = b1; }
    PANEL_ROWS(PANEL_BIAS)
  } else {
#define PANEL_LOAD(r)                                                          \
  if (R > r) {                                                                 \
    if (cols == kPanel) {                                                      \
      lo##r = _mm256_loadu_ps(c + r * ldc);                                    \
      hi##r = _mm256_loadu_ps(c + r * ldc + 8);                                \
    } else {                                                                   \
      std::memset(tmp, 0, sizeof(tmp));                                        \
      std::memcpy(tmp, c + r * ldc, cols * sizeof(float));                     \
      lo##r = _mm256_load_ps(tmp);                                             \
      hi##r = _mm256_load_ps(tmp + 8);                                         \
    }                                                                          \
  }
    PANEL_ROWS(PANEL_LOAD)
  }
  const float* b = panel + k0 * kPanel;
  const float* a = x + k0;
  for (int64_t i = k0; i < k1; ++i, b += kPanel, ++a) {
    const __m256 w0 = _mm256_loadu_ps(b), w1 = _mm256_loadu_ps(b + 8);
#define PANEL_FMA(r)                                         \
  if (R > r) {                                               \
    const __m256 v = _mm256_broadcast_ss(a + r * ldx);       \
    lo##r = _mm256_fmadd_ps(v, w0, lo##r);                   \
    hi##r = _mm256_fmadd_ps(v, w1, hi##r);                   \
  }
    PANEL_ROWS(PANEL_FMA)
  }
#define PANEL_STORE(r)                                                         \
  if (R > r) {                                                                 \
    if (cols == kPanel) {                                                      \
      _mm256_storeu_ps(c + r * ldc, lo##r);                                    \
      _mm256_storeu_ps(c + r * ldc + 8, hi##r);                                \
    } else {                                                                   \
      _mm256_store_ps(tmp, lo##r);                                             \
      _mm256_store_ps(tmp + 8, hi##r);                                         \
      std::memcpy(c + r * ldc, tmp, cols * sizeof(float));                    \
    }                                                                          \
  }
  PANEL_ROWS(PANEL_STORE)
#undef PANEL_DECL
#undef PANEL_BIAS
#undef PANEL_LOAD
#undef PANEL_FMA
#undef PANEL_STORE
}

#undef PANEL_ROWS

using PanelTile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t,
                           const float*, bool);
constexpr PanelTile kTiles[kTileRows + 1] = {nullptr,        panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                             panel_tile<4>, panel_tile<5>, panel_tile<6>};

#endif

// x [M, K] @ weight^T (+ bias) on the panels of weight [N, K] (n, k: the weight's shape, checked against x
// and the pack's size)
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_in,
                        const std::optional<at::Tensor>& bias) {
  const std::string why = panel_gemm_unavailable();
  TORCH_CHECK(why.empty(), "panel_linear: ", why);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  packed.scalar_type() == at::kFloat,
              "panel_linear: x is a 2-D float32 CPU tensor [rows, in_features]");
  TORCH_CHECK(x.size(1) == k_in, "panel_linear: x has ", x.size(1), " features, the weight ", k_in);
  TORCH_CHECK(n >= 1 && packed.is_contiguous() && packed.numel() == panels(n) * k_in * kPanel,
              "panel_linear: the pack is not a [", n, ", ", k_in, "] weight's");
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "panel_linear: bias [out_features] float32");
    b = bias->contiguous();
    bias_ptr = b.data_ptr<float>();
  }
  const at::Tensor a = x.contiguous();
  const int64_t m = a.size(0), k = k_in;
  at::Tensor out = at::empty({m, n}, a.options());
  if (m == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  const float* xs = a.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  float* cs = out.data_ptr<float>();
  at::parallel_for(0, panels(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, m - r0);
      // the chunk's rows in tiles of at most 6, as even as they go (85 rows: 10 tiles of 6 and 5 of 5, not a
      // tile of 1): a tile of few rows loads the panel's weights for little work
      const int64_t tiles = (rows + kTileRows - 1) / kTileRows, base = rows / tiles, extra = rows % tiles;
      for (int64_t q = begin; q < end; ++q) {
        const int64_t cols = std::min(kPanel, n - q * kPanel);
        const float* panel = ws + q * k * kPanel;
        for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
          const int64_t k1 = std::min(k, k0 + kDepth);
          int64_t r = r0;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t h = base + (t < extra ? 1 : 0);
            kTiles[h](xs + r * k, k, panel, k0, k1, cs + r * n + q * kPanel, n, cols,
                      bias_ptr ? bias_ptr + q * kPanel : nullptr, k0 == 0);
            r += h;
          }
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("panel_gemm_unavailable() -> str");
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CompositeExplicitAutograd, m) {
  m.impl("panel_gemm_unavailable", &panel_gemm_unavailable);
}
