// fp32 linear layers on kernels of our own over weights packed in column panels: ascend_ops.packed_linear's
// "avx2" backend (16-wide panels; the default for fp32 on x86 CPUs with AVX2 but no AVX-512 and no MKL
// advantage, i.e. AMD Zen 2/3) and its "avx512" backend (32-wide panels; the default on Intel CPUs with
// AVX-512). Compiled as one unit with cpu_attention.cpp (cpu_kernels.SOURCES).
//
// Why: a decode step multiplies a few dozen rows by every weight. At 16-64 rows oneDNN's packed product ran at
// 70-80% of its large-M rate on an AMD EPYC (Zen 3, one thread: 36.5 / 48.3 / 54.0 GFLOP/s at 16 / 32 / 64
// rows over SmolLM2's layer shapes, 68 at 128+), the AVX2 kernel at 51.3 / 57.2 / 65.1 (71 at 128). On an
// Intel Xeon (AVX-512 and AMX, one thread) MKL's packed sgemm ran 32 rows at 104-110 GFLOP/s and 64 at
// 153-159 against 160-187 at 128-1024; packed_linear's docstring has what the AVX-512 kernel measured there.
//
// Layout: the weight [N, K] becomes ceil(N/W) panels, each [K][W] (W = 16 or 32, the pack's width): for
// every k the W weights of W consecutive output features (the last panel zero-padded). A micro-kernel keeps a
// tile of rows x W outputs in vector accumulators (AVX2: up to 6 rows x 2 ymm, BLIS's 6x16 shape; AVX-512:
// up to 12 rows x 2 zmm), and for each k loads the panel's W weights once and broadcasts each row's x[k]. K
// is walked in chunks so a panel's chunk (16 KiB) stays in L1 while every row tile of the step passes over
// it; rows are walked 120 at a time so their chunk stays in L2. Threads take whole panels
// (at::parallel_for): each streams its own share of the weight, and every tile prefetches a share of the
// chunk its thread multiplies next, spread over its k loop. Without that, each chunk's first tile waited on
// memory for the weights: on the Xeon, one thread, 32 rows, the AVX-512 kernel ran at 96 GFLOP/s without it
// and 131 with it, the AVX2 kernel at 70 and 90. x is first copied tile by tile as [k][tile rows] (pack_rows,
// once per call, shared by the threads; bf16 x widened in the same pass), so a tile reads its x as one
// sequential stream from one pointer. Read in place, a 12-row tile's rows were 12 streams 4K bytes apart
// (at K = 1,536 they share two L1 sets) and the compiler spilled their pointers: one tile alone, its data
// in L1, ran 206 GFLOP/s in place against 224 packed (2026-12-05, the Xeon, one thread; the FMA peak is ~246).
// Tried and not kept (no gain above noise on the Xeon, same bits): a tile over two adjacent panels (up to 7
// rows x 4 zmm: 4 weight loads and 7 broadcasts per 28 FMAs; 226 GFLOP/s in L1, no faster over SmolLM2's
// layers at 16-2,336 rows, with 64-deep chunks slower), depth chunks of 64 / 96 / 192 / 256 / all of K, row
// passes of 48-96 or 240 rows, 14-row tiles, a contiguous scratch for the sums between depth chunks, and
// prefetching the output lines for writing (bench/decode_gemm.py's "Decode-sized GEMMs" in docs/benchmarks.md).
//
// Every output sums each block of kSumDepth (128) products from zero, one fused multiply-add per k in order,
// and adds the block's sum to the bias (or 0) and the blocks before it, whatever the number of rows, the tile
// a row falls in, the number of threads or the width: a row's result is the same bits in any batch and on
// either kernel (batch_invariant.py's row invariance holds by construction, and its
// start-up self-check measures it).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowChunk = 120; // rows per pass over a thread's panels (a multiple of both tiles' rows)
// k per block of the summation: each output sums each block of kSumDepth products from zero, one FMA per k in
// order, and adds the block's sum to the bias (or 0) and the blocks before it. Both kernels' depth chunks are
// these blocks, so they give the same bits (a single chain over all of K carried ~4x MKL's rounding error at K =
// 1,536 and ~15x at 8,192: the mean error against fp64, 2026-12-06)
constexpr int64_t kSumDepth = 128;

// "" when the kernel of this pack width (16: AVX2/FMA, 32: AVX-512) was compiled in, else why not
std::string panel_gemm_unavailable(int64_t width) {
  if (width == 16) {
#if defined(__AVX2__) && defined(__FMA__)
    return "";
#else
    return "the CPU kernels were compiled without AVX2 and FMA (this CPU lacks them, or ROLLBUS_CPU_KERNELS=portable)";
#endif
  }
  if (width == 32) {
#if defined(__AVX512F__)
    return "";
#else
    return "the CPU kernels were compiled without AVX-512 (this CPU lacks it, or ROLLBUS_CPU_KERNELS caps it)";
#endif
  }
  return "a panel width is 16 (AVX2) or 32 (AVX-512), not " + std::to_string(width);
}

void check_width(const char* op, int64_t width) {
  const std::string why = panel_gemm_unavailable(width);
  TORCH_CHECK(why.empty(), op, ": ", why);
}

int64_t panels(int64_t n, int64_t width) { return (n + width - 1) / width; }

// where column j of a W-wide panel sits in its row of k: fp32 panels in order; bf16 panels interleave the two
// halves (columns j < W/2 at 2j, the others at 2(j - W/2) + 1), so a kernel widens a row's W bf16 weights to
// two fp32 vectors with one shift (the even 16-bit words) and one mask (the odd ones), no shuffle
int64_t panel_slot(int64_t j, int64_t width, bool bf16) {
  return !bf16 ? j : j < width / 2 ? 2 * j : 2 * (j - width / 2) + 1;
}

template <typename T>
void pack_into(const T* src, T* dst, int64_t n, int64_t k, int64_t p, int64_t width, bool bf16) {
  at::parallel_for(0, p, 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < width && q * width + j < n; ++j) {
        const T* row = src + (q * width + j) * k;
        T* col = dst + q * k * width + panel_slot(j, width, bf16);
        for (int64_t i = 0; i < k; ++i) col[i * width] = row[i];
      }
  });
}

// weight [N, K] fp32 or bf16 -> panels [ceil(N/W)][K][W] of the same dtype, flattened (bf16: panel_slot's order);
// a stack of weights [G, N, K] (an MoE layer's experts) -> [G, ceil(N/W) * K * W], each packed as alone
at::Tensor panel_pack(const at::Tensor& weight, int64_t width) {
  check_width("panel_pack", width);
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 3) && (weight.scalar_type() == at::kFloat || bf16) &&
                  weight.device().is_cpu(),
              "panel_pack: a float32 or bfloat16 CPU weight [out_features, in_features] or a stack of them");
  const at::Tensor w = weight.contiguous();
  const int64_t groups = w.dim() == 3 ? w.size(0) : 1, n = w.size(-2), k = w.size(-1), p = panels(n, width);
  at::Tensor out = w.dim() == 3 ? at::zeros({groups, p * k * width}, w.options()) : at::zeros({p * k * width}, w.options());
  for (int64_t g = 0; g < groups; ++g) {
    if (bf16)
      pack_into(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + g * n * k,
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + g * p * k * width, n, k, p, width, true);
    else
      pack_into(w.data_ptr<float>() + g * n * k, out.data_ptr<float>() + g * p * k * width, n, k, p, width, false);
  }
  return out;
}

// the tile's x rows packed (pack_rows), panel (float or bf16 bits), k0, k1, c, ldc, cols, bias, first chunk,
// prefetch from, prefetch lines
template <typename W>
using PanelTile = void (*)(const float*, const W*, int64_t, int64_t, float*, int64_t, int64_t, const float*, bool,
                           const char*, int64_t);

// a row chunk's tiles of at most `most` rows, as even as they go (85 rows on 6-row tiles: 10 tiles of 6 and 5 of
// 5, not a tile of 1): a tile of few rows loads the panel's weights for little work; tile t has rows(t) rows
struct TileSplit {
  int64_t count, base, extra;
  TileSplit(int64_t chunk_rows, int64_t most)
      : count((chunk_rows + most - 1) / most), base(chunk_rows / count), extra(chunk_rows % count) {}
  int64_t rows(int64_t t) const { return base + (t < extra ? 1 : 0); }
};

// h rows of x (stride k) into dst as [k][h]: k outer, so the writes are one sequential stream (h fixed: the
// rows' pointers stay in registers); rows read in place are h sequential streams
template <int H, typename X>
void pack_tile(const X* x, int64_t k, float* dst) {
  const X* src[H];
  for (int j = 0; j < H; ++j) src[j] = x + j * k;
  for (int64_t i = 0; i < k; ++i, dst += H)
    for (int j = 0; j < H; ++j) dst[j] = static_cast<float>(src[j][i]);
}

constexpr int64_t kMaxTileRows = 12;  // the most rows of any kernel's tile (AVX-512's)

template <typename X>
constexpr void (*kPackTiles[kMaxTileRows + 1])(const X*, int64_t, float*) = {
    nullptr,         pack_tile<1, X>, pack_tile<2, X>, pack_tile<3, X>,  pack_tile<4, X>,  pack_tile<5, X>,
    pack_tile<6, X>, pack_tile<7, X>, pack_tile<8, X>, pack_tile<9, X>, pack_tile<10, X>, pack_tile<11, X>,
    pack_tile<12, X>};

// x's rows (fp32, or bf16 widened here: exact) copied tile by tile in the order the tiles read them, group by group
// (group g: rows offsets[g] .. offsets[g + 1]; one group of all rows for a plain product): each group's rows in
// chunks of kRowChunk from its first row, each chunk's tiles of h rows (TileSplit) as [k][h] at the offset of the
// tile's first row times k, so no tile mixes two groups' rows. A tile then reads its x as one sequential stream
// (h floats per k) from one pointer, however long x's rows are: read in place, a tile's rows were h streams 4k
// bytes apart, which at k = 1,536 share two sets of the L1 cache, and their h addresses took more registers than
// the CPU has (the compiler spilled them)
template <typename X>
at::Tensor pack_rows(const X* x, const int64_t* offsets, int64_t groups, int64_t k, int64_t tile_rows) {
  at::Tensor out = at::empty({offsets[groups] * k}, at::TensorOptions().dtype(at::kFloat));
  float* xp = out.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [first row, end row) of every group's row chunks
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r0 = offsets[g]; r0 < offsets[g + 1]; r0 += kRowChunk)
      chunks.emplace_back(r0, std::min(r0 + kRowChunk, offsets[g + 1]));
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const auto [r0, r1] = chunks[c];
      const TileSplit split(r1 - r0, tile_rows);
      for (int64_t t = 0, r = r0; t < split.count; r += split.rows(t), ++t)
        kPackTiles<X>[split.rows(t)](x + r * k, k, xp + r * k);
    }
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)

namespace avx2 {

constexpr int64_t kPanel = 16;   // output features per panel
constexpr int64_t kDepth = kSumDepth;  // k per chunk: a panel's chunk is 8 KiB
constexpr int64_t kTileRows = 6; // rows per micro-kernel tile: 12 ymm accumulators
static_assert(kTileRows <= kMaxTileRows);

#define PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// R rows of x (packed: xp[k * R + r] is row r's x[k]) times one panel's k in [k0, k1) into c (stride ldc,
// `cols` valid outputs of 16): the chunk's products summed from zero, then added to the bias (or 0) where
// `first`, else to what c holds (the previous chunks' sums); prefetches `lines` cache lines from `pf` on, spread evenly over the k loop
// a panel row's 16 weights as two fp32 vectors: fp32 loaded, bf16 widened exactly (its bits are an fp32's top half)
inline void load_row(const float* b, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(b);
  w1 = _mm256_loadu_ps(b + 8);
}

inline void load_row(const uint16_t* b, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int R, typename W>
void panel_tile(const float* xp, const W* panel, int64_t k0, int64_t k1, float* c, int64_t ldc, int64_t cols,
                const float* bias, bool first, const char* pf, int64_t lines) {
  const __m256 zero = _mm256_setzero_ps();
#define PANEL_DECL(r) __m256 lo##r = zero, hi##r = zero;
  PANEL_ROWS(PANEL_DECL)
  alignas(32) float tmp[kPanel];
  const W* b = panel + k0 * kPanel;
  const float* a = xp + k0 * R;
  const int64_t iters = k1 - k0;
  int64_t due = 0;
  for (int64_t i = k0; i < k1; ++i, b += kPanel, a += R) {
    for (due += lines; due >= iters; due -= iters, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
    __m256 w0, w1;
    load_row(b, w0, w1);
#define PANEL_FMA(r)                                         \
  if (R > r) {                                               \
    const __m256 v = _mm256_broadcast_ss(a + r);             \
    lo##r = _mm256_fmadd_ps(v, w0, lo##r);                   \
    hi##r = _mm256_fmadd_ps(v, w1, hi##r);                   \
  }
    PANEL_ROWS(PANEL_FMA)
  }
  // the chunk's sums added to the outputs' so far: the bias (or 0) before the first chunk
  __m256 b0 = zero, b1 = zero;
  if (first && bias != nullptr) {
    std::memset(tmp, 0, sizeof(tmp));
    std::memcpy(tmp, bias, cols * sizeof(float));
    b0 = _mm256_load_ps(tmp);
    b1 = _mm256_load_ps(tmp + 8);
  }
#define PANEL_STORE(r)                                                         \
  if (R > r) {                                                                 \
    __m256 s0 = b0, s1 = b1;                                                   \
    if (cols == kPanel) {                                                      \
      if (!first) {                                                            \
        s0 = _mm256_loadu_ps(c + r * ldc);                                     \
        s1 = _mm256_loadu_ps(c + r * ldc + 8);                                 \
      }                                                                        \
      _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(s0, lo##r));                 \
      _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(s1, hi##r));             \
    } else {                                                                   \
      if (!first) {                                                            \
        std::memset(tmp, 0, sizeof(tmp));                                      \
        std::memcpy(tmp, c + r * ldc, cols * sizeof(float));                   \
        s0 = _mm256_load_ps(tmp);                                              \
        s1 = _mm256_load_ps(tmp + 8);                                          \
      }                                                                        \
      _mm256_store_ps(tmp, _mm256_add_ps(s0, lo##r));                          \
      _mm256_store_ps(tmp + 8, _mm256_add_ps(s1, hi##r));                      \
      std::memcpy(c + r * ldc, tmp, cols * sizeof(float));                     \
    }                                                                          \
  }
  PANEL_ROWS(PANEL_STORE)
#undef PANEL_DECL
#undef PANEL_FMA
#undef PANEL_STORE
}

#undef PANEL_ROWS

template <typename W>
constexpr PanelTile<W> kTiles[kTileRows + 1] = {nullptr,           panel_tile<1, W>, panel_tile<2, W>,
                                                panel_tile<3, W>, panel_tile<4, W>, panel_tile<5, W>,
                                                panel_tile<6, W>};

}  // namespace avx2

#endif

#if defined(__AVX512F__)

namespace avx512 {

constexpr int64_t kPanel = 32;    // output features per panel: two zmm
constexpr int64_t kDepth = kSumDepth;  // k per chunk: a panel's chunk is 16 KiB
constexpr int64_t kTileRows = 12; // rows per micro-kernel tile: 24 zmm accumulators
static_assert(kTileRows <= kMaxTileRows);

#define PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

inline void load_row(const float* b, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(b);
  w1 = _mm512_loadu_ps(b + 16);
}

inline void load_row(const uint16_t* b, __m512& w0, __m512& w1) {
  const __m512i raw = _mm512_loadu_si512(b);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// as avx2::panel_tile, on 32-wide panels; the last panel's invalid outputs are masked off
template <int R, typename W>
void panel_tile(const float* xp, const W* panel, int64_t k0, int64_t k1, float* c, int64_t ldc, int64_t cols,
                const float* bias, bool first, const char* pf, int64_t lines) {
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
#define PANEL_DECL(r) __m512 lo##r = _mm512_setzero_ps(), hi##r = _mm512_setzero_ps();
  PANEL_ROWS(PANEL_DECL)
  const W* b = panel + k0 * kPanel;
  const float* a = xp + k0 * R;
  const int64_t iters = k1 - k0;
  int64_t due = 0;
  for (int64_t i = k0; i < k1; ++i, b += kPanel, a += R) {
    for (due += lines; due >= iters; due -= iters, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
    __m512 w0, w1;
    load_row(b, w0, w1);
#define PANEL_FMA(r)                                         \
  if (R > r) {                                               \
    const __m512 v = _mm512_set1_ps(a[r]);                   \
    lo##r = _mm512_fmadd_ps(v, w0, lo##r);                   \
    hi##r = _mm512_fmadd_ps(v, w1, hi##r);                   \
  }
    PANEL_ROWS(PANEL_FMA)
  }
  // the chunk's sums added to the outputs' so far: the bias (or 0) before the first chunk
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (first && bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
#define PANEL_STORE(r)                                                                                      \
  if (R > r) {                                                                                              \
    const __m512 s0 = first ? b0 : _mm512_maskz_loadu_ps(m0, c + r * ldc);                                  \
    const __m512 s1 = first ? b1 : _mm512_maskz_loadu_ps(m1, c + r * ldc + 16);                             \
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_add_ps(s0, lo##r));                                      \
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_add_ps(s1, hi##r));                                 \
  }
  PANEL_ROWS(PANEL_STORE)
#undef PANEL_DECL
#undef PANEL_FMA
#undef PANEL_STORE
}

#undef PANEL_ROWS

template <typename W>
constexpr PanelTile<W> kTiles[kTileRows + 1] = {
    nullptr,          panel_tile<1, W>, panel_tile<2, W>, panel_tile<3, W>,  panel_tile<4, W>,
    panel_tile<5, W>, panel_tile<6, W>, panel_tile<7, W>, panel_tile<8, W>,  panel_tile<9, W>,
    panel_tile<10, W>, panel_tile<11, W>, panel_tile<12, W>};

}  // namespace avx512

#endif

// one panel (its K x kPanel weights) times one chunk of at most kRowChunk rows (xp: packed as pack_rows laid
// them out, from the chunk's first row) into c (stride ldc, `cols` valid outputs), depth chunk by depth chunk;
// `more`: the memory right after this panel is the weights this thread multiplies next (the next panel of the
// same pack), prefetched during the last depth chunk
template <int64_t kPanel, int64_t kDepth, int64_t kTileRows, typename W>
void panel_chunk(const float* xp, const W* panel, float* c, int64_t rows, int64_t ldc, int64_t cols, int64_t k,
                 const float* bias, bool more, const PanelTile<W>* tiles) {
  const TileSplit split(rows, kTileRows);  // as pack_rows laid xp out
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t k1 = std::min(k, k0 + kDepth);
    // the weights this thread multiplies next start where this chunk ends (panels are contiguous: the next
    // chunk of this panel, or the next panel's first); their lines are shared out between the tiles
    const char* next = reinterpret_cast<const char*>(panel + k1 * kPanel);
    int64_t lines = 0;
    if (k1 < k || more) {
      const int64_t depth = k1 < k ? std::min(k, k1 + kDepth) - k1 : std::min(k, kDepth);
      lines = depth * kPanel * static_cast<int64_t>(sizeof(W)) / 64;
    }
    int64_t r = 0;
    for (int64_t t = 0; t < split.count; ++t) {
      const int64_t h = split.rows(t), from = lines * t / split.count, to = lines * (t + 1) / split.count;
      tiles[h](xp + r * k, panel, k0, k1, c + r * ldc, ldc, cols, bias, k0 == 0, next + from * 64, to - from);
      r += h;
    }
  }
}

// rows x @ panels^T on one kernel (avx2 or avx512: its panel width, depth chunk, tile rows and tiles), threads
// over panels
template <int64_t kPanel, int64_t kDepth, int64_t kTileRows, typename W>
void run_panels(const float* xp, const W* ws, float* cs, int64_t m, int64_t n, int64_t k, const float* bias_ptr,
                const PanelTile<W>* tiles) {
  at::parallel_for(0, panels(n, kPanel), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk)
      for (int64_t q = begin; q < end; ++q)
        panel_chunk<kPanel, kDepth, kTileRows, W>(xp + r0 * k, ws + q * k * kPanel, cs + r0 * n + q * kPanel,
                                                  std::min(kRowChunk, m - r0), n, std::min(kPanel, n - q * kPanel),
                                                  k, bias_ptr ? bias_ptr + q * kPanel : nullptr, q + 1 < end,
                                                  tiles);
  });
}

// groups of rows, each times its own packed weight (an MoE layer's experts: the rows sorted by expert, group g
// the rows offsets[g] .. offsets[g + 1]); threads over the (group, panel) pairs of the groups that have rows, so
// two threads split the experts between them instead of each expert's few rows. Each row's outputs are the same
// bits as panel_linear's on its group's weight alone
template <int64_t kPanel, int64_t kDepth, int64_t kTileRows, typename W>
void run_grouped(const float* xp, const W* ws, float* cs, const int64_t* offsets, int64_t groups, int64_t n,
                 int64_t k, const PanelTile<W>* tiles) {
  const int64_t per_group = panels(n, kPanel);
  std::vector<int64_t> active;  // the groups with rows, in order
  for (int64_t g = 0; g < groups; ++g)
    if (offsets[g + 1] > offsets[g]) active.push_back(g);
  const int64_t items = static_cast<int64_t>(active.size()) * per_group;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = active[item / per_group], q = item % per_group, m0 = offsets[g], m = offsets[g + 1] - m0;
      const W* panel = ws + (g * per_group + q) * k * kPanel;
      // the next item's weights follow this panel's in memory unless it starts another group that is not g + 1
      const bool more = item + 1 < end && (q + 1 < per_group || active[(item + 1) / per_group] == g + 1);
      for (int64_t r0 = 0; r0 < m; r0 += kRowChunk)
        panel_chunk<kPanel, kDepth, kTileRows, W>(xp + (m0 + r0) * k, panel, cs + (m0 + r0) * n + q * kPanel,
                                                  std::min(kRowChunk, m - r0), n, std::min(kPanel, n - q * kPanel),
                                                  k, nullptr, more && r0 + kRowChunk >= m, tiles);
    }
  });
}

// a contiguous bf16 tensor widened to fp32 (exact)
at::Tensor widen(const at::Tensor& t) {
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  const c10::BFloat16* src = t.data_ptr<c10::BFloat16>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<float>(src[i]);
  });
  return out;
}

// fp32 sums rounded to bf16 (nearest-even, as torch rounds)
at::Tensor narrow_bf16(const at::Tensor& t) {
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kBFloat16));
  const float* src = t.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, t.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
  });
  return out;
}

// x (fp32, or bf16 widened as it is packed) packed for, then multiplied on, the kernel of this pack width
template <typename X, typename W>
void run_width(const X* xs, const W* ws, float* cs, int64_t m, int64_t n, int64_t k, const float* bias_ptr,
               int64_t width) {
  const int64_t whole[2] = {0, m};  // one group of all rows
#if defined(__AVX2__) && defined(__FMA__)
  if (width == avx2::kPanel) {
    const at::Tensor xp = pack_rows(xs, whole, 1, k, avx2::kTileRows);
    run_panels<avx2::kPanel, avx2::kDepth, avx2::kTileRows, W>(xp.data_ptr<float>(), ws, cs, m, n, k, bias_ptr,
                                                          avx2::kTiles<W>);
  }
#endif
#if defined(__AVX512F__)
  if (width == avx512::kPanel) {
    const at::Tensor xp = pack_rows(xs, whole, 1, k, avx512::kTileRows);
    run_panels<avx512::kPanel, avx512::kDepth, avx512::kTileRows, W>(xp.data_ptr<float>(), ws, cs, m, n, k, bias_ptr,
                                                          avx512::kTiles<W>);
  }
#endif
}

// groups of x's rows, each times its group's packed weight, on the kernel of this pack width
template <typename X, typename W>
void run_grouped_width(const X* xs, const W* ws, float* cs, const int64_t* offsets, int64_t groups, int64_t n,
                       int64_t k, int64_t width) {
#if defined(__AVX2__) && defined(__FMA__)
  if (width == avx2::kPanel) {
    const at::Tensor xp = pack_rows(xs, offsets, groups, k, avx2::kTileRows);
    run_grouped<avx2::kPanel, avx2::kDepth, avx2::kTileRows, W>(xp.data_ptr<float>(), ws, cs, offsets, groups, n, k,
                                                                avx2::kTiles<W>);
  }
#endif
#if defined(__AVX512F__)
  if (width == avx512::kPanel) {
    const at::Tensor xp = pack_rows(xs, offsets, groups, k, avx512::kTileRows);
    run_grouped<avx512::kPanel, avx512::kDepth, avx512::kTileRows, W>(xp.data_ptr<float>(), ws, cs, offsets, groups,
                                                                      n, k, avx512::kTiles<W>);
  }
#endif
}

// x is a 2-D CPU tensor of the pack's dtype (float32 or bfloat16) with the weights' k_in features
void check_x(const char* op, const at::Tensor& x, at::ScalarType dtype, int64_t k_in, const char* weight) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  x.scalar_type() == dtype,
              op, ": x is a 2-D CPU tensor [rows, in_features] of the pack's dtype (float32 or bfloat16)");
  TORCH_CHECK(x.size(1) == k_in, op, ": x has ", x.size(1), " features, the ", weight, " ", k_in);
}

// x [M, K] @ weight^T (+ bias) on the panels of weight [N, K] (n, k: the weight's shape, checked against x
// and the pack's size; width: the pack's, 16 or 32). A bf16 pack takes bf16 x (and a bf16 or fp32 bias) and
// answers bf16: x (as it is packed) and the bias are widened to fp32 once (exact), the weights in registers (exact), every
// output summed in fp32 as above and rounded to bf16 once at the end (nearest-even, c10's rounding), as
// torch's bf16 linear rounds its fp32 sums; the same bits as the fp32 kernel on the widened operands, rounded.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_in,
                        const std::optional<at::Tensor>& bias, int64_t width) {
  check_width("panel_linear", width);
  const at::ScalarType dtype = packed.scalar_type();
  check_x("panel_linear", x, dtype, k_in, "weight");
  TORCH_CHECK(n >= 1 && packed.is_contiguous() && packed.numel() == panels(n, width) * k_in * width,
              "panel_linear: the pack is not a [", n, ", ", k_in, "] weight's of width ", width);
  const bool bf16 = dtype == at::kBFloat16;
  const float* bias_ptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n &&
                    (bias->scalar_type() == at::kFloat || (bf16 && bias->scalar_type() == at::kBFloat16)),
                "panel_linear: bias [out_features] float32 (or bfloat16 on a bfloat16 pack)");
    b = bias->contiguous();
    if (b.scalar_type() == at::kBFloat16) b = widen(b);
    bias_ptr = b.data_ptr<float>();
  }
  const at::Tensor a = x.contiguous();
  const int64_t m = a.size(0), k = k_in;
  at::Tensor out = at::empty({m, n}, a.options().dtype(at::kFloat));
  if (m == 0) return bf16 ? at::empty({m, n}, x.options()) : out;
  float* cs = out.data_ptr<float>();
  if (bf16) {
    run_width(a.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), cs,
              m, n, k, bias_ptr, width);
    return narrow_bf16(out);
  }
  run_width(a.data_ptr<float>(), packed.data_ptr<float>(), cs, m, n, k, bias_ptr, width);
  return out;
}

// x [R, K] (rows sorted by group) times a stack of packed weights [G, ...] (panel_pack of [G, N, K]): group g's
// rows offsets[g] .. offsets[g + 1] (int64 [G + 1], from 0 to R, non-decreasing) on weight g, as an MoE layer's
// experts each multiply the tokens routed to them. Each row's outputs are the bits panel_linear gives it on its
// group's weight alone (bf16: summed in fp32, rounded once)
at::Tensor panel_grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, int64_t n,
                                int64_t k_in, int64_t width) {
  check_width("panel_grouped_linear", width);
  const at::ScalarType dtype = packed.scalar_type();
  check_x("panel_grouped_linear", x, dtype, k_in, "weights");
  TORCH_CHECK(n >= 1 && packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == panels(n, width) * k_in * width,
              "panel_grouped_linear: the pack is not a stack of [", n, ", ", k_in, "] weights' of width ", width);
  const int64_t groups = packed.size(0);
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.device().is_cpu() &&
                  offsets.size(0) == groups + 1,
              "panel_grouped_linear: offsets is int64 [groups + 1]");
  const at::Tensor off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[groups] == x.size(0), "panel_grouped_linear: offsets run from 0 to the rows of x");
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(o[g + 1] >= o[g], "panel_grouped_linear: offsets decrease at group ", g);
  const at::Tensor a = x.contiguous();
  at::Tensor out = at::empty({a.size(0), n}, a.options().dtype(at::kFloat));
  if (a.size(0) == 0) return dtype == at::kBFloat16 ? at::empty({0, n}, x.options()) : out;
  if (dtype == at::kBFloat16) {
    run_grouped_width(a.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                      out.data_ptr<float>(), o, groups, n, k_in, width);
    return narrow_bf16(out);
  }
  run_grouped_width(a.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), o, groups, n, k_in, width);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("panel_gemm_unavailable(int width) -> str");
  m.def("panel_pack(Tensor weight, int width) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, int n, int k, Tensor? bias, int width) -> Tensor");
  m.def("panel_grouped_linear(Tensor x, Tensor packed, Tensor offsets, int n, int k, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_grouped_linear", &panel_grouped_linear);
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CompositeExplicitAutograd, m) {
  m.impl("panel_gemm_unavailable", &panel_gemm_unavailable);
}
