// The segmented LoRA product of a mixed step (workers/lora.py), one call per projection: for every adapter g
// and each of its rows r (rows[bounds[g] .. bounds[g+1]): an adapter's rows together),
//   out[r] += Bt_g^T (A_g x[r])
// where A_g [K*rank, in] stacks the adapter's A of the K targeted parts of this fused projection, and Bt_g
// holds their B^T times the scaling, part k on its columns ranges_g[k] = [c0, c1) of out only, in panels of
// kPanel columns (the last one zero-padded): part after part, [panels][rank][kPanel]. The expand then walks
// memory in order (in a real step the adapters stream from DRAM: a row-major [K*rank, out] B^T, read as 16-32
// strided streams, measured twice as slow as when cached) and never reads the zeros of the other parts.
// One call replaces, per adapter, a gather, two small GEMMs and a scatter-add, whose calls cost more than
// their arithmetic at decode sizes.
//
// Batch invariance by construction: a row's arithmetic is the same sequence of fp32 operations whoever its
// batch-mates are (each dot product in 16 fixed lanes summed in a fixed order; each delta column a chain over
// j in order; then one add into out); rows are blocked only to share the loads of A and B. Compiled as one
// unit after cpu_elementwise.cpp (round_as, round16, store16) and cpu_attention.cpp (load16). bf16 x, out, A
// and B are widened to fp32, the delta rounded once, then its sum with out.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int kRows = 8;    // rows sharing each load of A and B
constexpr int kPanel = 32;  // B^T's panel width (workers/lora.py packs it)
constexpr int kLanes = 16;  // the portable dot product's lanes

template <typename T, int NR>
void lora_block(const T* const* xr, T* const* orow, const T* a, const T* bt, const int64_t* ranges, int64_t parts,
                int64_t rank, int64_t in) {
  const int64_t kr = parts * rank;
  std::vector<float> s(static_cast<size_t>(NR * kr));
  for (int64_t k = 0; k < kr; ++k) {  // shrink: s[n][k] = A[k] . x[n]
    const T* ak = a + k * in;
    float acc[NR][kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes)
      for (int n = 0; n < NR; ++n)
        for (int l = 0; l < kLanes; ++l) acc[n][l] += static_cast<float>(xr[n][i + l]) * static_cast<float>(ak[i + l]);
    for (int l = 0; i + l < in; ++l)
      for (int n = 0; n < NR; ++n) acc[n][l] += static_cast<float>(xr[n][i + l]) * static_cast<float>(ak[i + l]);
    for (int n = 0; n < NR; ++n) {
      float* v = acc[n];
      for (int w = kLanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) v[l] += v[l + w];
      s[n * kr + k] = v[0];
    }
  }
  const T* panel = bt;
  for (int64_t p = 0; p < parts; ++p) {  // expand: out[n][c] += sum_j s[n][j] Bt[j][c] on part p's columns
    const int64_t c0 = ranges[2 * p], c1 = ranges[2 * p + 1];
    for (int64_t c = c0; c < c1; c += kPanel, panel += rank * kPanel) {
      const int64_t w = std::min<int64_t>(kPanel, c1 - c);
      float d[NR][kPanel] = {};
      for (int64_t j = 0; j < rank; ++j) {
        const T* bj = panel + j * kPanel;
        for (int n = 0; n < NR; ++n) {
          const float sj = s[n * kr + p * rank + j];
          for (int l = 0; l < kPanel; ++l) d[n][l] += sj * static_cast<float>(bj[l]);
        }
      }
      for (int n = 0; n < NR; ++n)
        for (int64_t l = 0; l < w; ++l)
          orow[n][c + l] = static_cast<T>(round_as(static_cast<float>(orow[n][c + l]) + round_as(d[n][l], T()), T()));
    }
  }
}

#ifdef ROLLBUS_AVX512
using v512::load16;

// s[n][k0 + q] for q < KB: KB rows of A share each load of x, NR rows of x each load of A.
template <typename T, int NR, int KB>
inline void shrink16(const T* const* xr, const T* a, int64_t in, int64_t k0, int64_t kr, float* s) {
  const int64_t full = in / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (in % 16)) - 1);
  __m512 acc[NR][KB];
  for (int n = 0; n < NR; ++n)
    for (int q = 0; q < KB; ++q) acc[n][q] = _mm512_setzero_ps();
  for (int64_t u = 0; u < full; ++u) {
    __m512 av[KB];
    for (int q = 0; q < KB; ++q) av[q] = load16(a + (k0 + q) * in + 16 * u);
    for (int n = 0; n < NR; ++n) {
      const __m512 xv = load16(xr[n] + 16 * u);
      for (int q = 0; q < KB; ++q) acc[n][q] = _mm512_fmadd_ps(xv, av[q], acc[n][q]);
    }
  }
  if (tail) {
    __m512 av[KB];
    for (int q = 0; q < KB; ++q) av[q] = load16(a + (k0 + q) * in + 16 * full, tail);
    for (int n = 0; n < NR; ++n) {
      const __m512 xv = load16(xr[n] + 16 * full, tail);
      for (int q = 0; q < KB; ++q) acc[n][q] = _mm512_fmadd_ps(xv, av[q], acc[n][q]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int q = 0; q < KB; ++q) s[n * kr + k0 + q] = _mm512_reduce_add_ps(acc[n][q]);
}

// out[n][c .. c1) += sum_j s[n][j0 + j] panel[j][...]: one panel (rank rows of kPanel columns, zero-padded).
template <typename T, int NR>
inline void expand16(T* const* orow, const T* panel, const float* s, int64_t kr, int64_t j0, int64_t rank,
                     int64_t c, int64_t c1) {
  constexpr int CV = kPanel / 16;
  __mmask16 m[CV];
  for (int v = 0; v < CV; ++v) {
    const int64_t w = std::clamp<int64_t>(c1 - c - 16 * v, 0, 16);
    m[v] = static_cast<__mmask16>(w == 16 ? 0xFFFF : (1u << w) - 1);
  }
  __m512 d[NR][CV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < CV; ++v) d[n][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < rank; ++j) {
    __m512 bv[CV];
    for (int v = 0; v < CV; ++v) bv[v] = load16(panel + j * kPanel + 16 * v);
    for (int n = 0; n < NR; ++n) {
      const __m512 sv = _mm512_set1_ps(s[n * kr + j0 + j]);
      for (int v = 0; v < CV; ++v) d[n][v] = _mm512_fmadd_ps(sv, bv[v], d[n][v]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < CV; ++v) {
      if (!m[v]) continue;
      T* o = orow[n] + c + 16 * v;
      const __m512 sum = round16(_mm512_add_ps(load16(o, m[v]), round16(d[n][v], T())), T());
      if (m[v] == 0xFFFF) {
        store16(o, sum);
      } else {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, sum);
        for (int l = 0; l < 16 && ((m[v] >> l) & 1); ++l) o[l] = static_cast<T>(tmp[l]);
      }
    }
}

// The product on AVX-512 registers: each dot product in 16 lanes with FMA then _mm512_reduce_add_ps, each delta
// column a chain of FMAs over j in order, then one add into out.
template <typename T, int NR>
void lora_block16(const T* const* xr, T* const* orow, const T* a, const T* bt, const int64_t* ranges,
                  int64_t parts, int64_t rank, int64_t in) {
  const int64_t kr = parts * rank;
  std::vector<float> s(static_cast<size_t>(NR * kr));
  int64_t k = 0;
  for (; k + 2 <= kr; k += 2) shrink16<T, NR, 2>(xr, a, in, k, kr, s.data());
  for (; k < kr; ++k) shrink16<T, NR, 1>(xr, a, in, k, kr, s.data());
  const T* panel = bt;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t c0 = ranges[2 * p], c1 = ranges[2 * p + 1];
    for (int64_t c = c0; c < c1; c += kPanel, panel += rank * kPanel)
      expand16<T, NR>(orow, panel, s.data(), kr, p * rank, rank, c, c1);
  }
}
#define ROLLBUS_LORA_BLOCK lora_block16
#else
#define ROLLBUS_LORA_BLOCK lora_block
#endif

template <typename T, int NR>
void lora_rows(const T* x, int64_t in, T* out, int64_t out_cols, const int64_t* rows, const T* a, const T* bt,
               const int64_t* ranges, int64_t parts, int64_t rank) {
  const T* xr[NR];
  T* orow[NR];
  for (int n = 0; n < NR; ++n) xr[n] = x + rows[n] * in, orow[n] = out + rows[n] * out_cols;
  ROLLBUS_LORA_BLOCK<T, NR>(xr, orow, a, bt, ranges, parts, rank, in);
}

template <typename T>
void lora_add_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& bounds,
                   const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
                   const std::vector<at::Tensor>& ranges) {
  const int64_t* rp = rows.template data_ptr<int64_t>();
  const int64_t* bp = bounds.template data_ptr<int64_t>();
  struct Task { int64_t g, first, n; };
  std::vector<Task> tasks;
  for (int64_t g = 0; g + 1 < bounds.numel(); ++g)
    if (a[g].numel() > 0)
      for (int64_t i = bp[g]; i < bp[g + 1]; i += kRows) tasks.push_back({g, i, std::min<int64_t>(kRows, bp[g + 1] - i)});
  const int64_t in = x.size(1), out_cols = out.size(1);
  const T* xp = x.template data_ptr<T>();
  T* op = out.template data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const Task& k = tasks[t];
      const int64_t parts = ranges[k.g].size(0), rank = a[k.g].size(0) / parts;
      const T* ap = a[k.g].template data_ptr<T>();
      const T* btp = bt[k.g].template data_ptr<T>();
      const int64_t* rg = ranges[k.g].template data_ptr<int64_t>();
      const int64_t* r = rp + k.first;
      switch (k.n) {
#define ROLLBUS_LORA_CASE(N) \
  case N: lora_rows<T, N>(xp, in, op, out_cols, r, ap, btp, rg, parts, rank); break;
        ROLLBUS_LORA_CASE(8) ROLLBUS_LORA_CASE(7) ROLLBUS_LORA_CASE(6) ROLLBUS_LORA_CASE(5)
        ROLLBUS_LORA_CASE(4) ROLLBUS_LORA_CASE(3) ROLLBUS_LORA_CASE(2)
#undef ROLLBUS_LORA_CASE
        default: lora_rows<T, 1>(xp, in, op, out_cols, r, ap, btp, rg, parts, rank);
      }
    }
  });
}
#undef ROLLBUS_LORA_BLOCK

void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& bounds,
              at::TensorList a, at::TensorList bt, at::TensorList ranges) {
  TORCH_CHECK(out.device().is_cpu() && x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.is_contiguous() && out.is_contiguous() && x.scalar_type() == out.scalar_type(),
              "lora_add: out [T, out] and x [T, in] contiguous CPU tensors of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "lora_add: float32 or bfloat16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bounds.scalar_type() == at::kLong && rows.is_contiguous() &&
                  bounds.is_contiguous() && bounds.numel() == static_cast<int64_t>(a.size()) + 1 &&
                  a.size() == bt.size() && a.size() == ranges.size(),
              "lora_add: int64 rows and bounds [G + 1], one A, B^T and ranges per adapter");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "lora_add: row ", rp[i], " outside the batch");
  const int64_t* bp = bounds.data_ptr<int64_t>();
  TORCH_CHECK(a.empty() || bp[0] == 0, "lora_add: bounds start at 0");
  for (size_t g = 0; g < a.size(); ++g) {
    TORCH_CHECK(bp[g] <= bp[g + 1] && bp[g + 1] <= rows.numel(), "lora_add: bounds out of order");
    if (a[g].numel() == 0) continue;  // this adapter does not target this projection
    const int64_t parts = ranges[g].dim() == 2 ? ranges[g].size(0) : 0;
    TORCH_CHECK(a[g].is_contiguous() && bt[g].is_contiguous() && a[g].scalar_type() == x.scalar_type() &&
                    bt[g].scalar_type() == x.scalar_type() && a[g].dim() == 2 && a[g].size(1) == x.size(1) &&
                    parts > 0 && a[g].size(0) % parts == 0 && ranges[g].scalar_type() == at::kLong &&
                    ranges[g].is_contiguous() && ranges[g].size(1) == 2,
                "lora_add: adapter ", g, ": A [K*rank, in] and B^T panels of x's dtype, ranges [K, 2]");
    const int64_t* rg = ranges[g].data_ptr<int64_t>();
    int64_t panels = 0;
    for (int64_t p = 0; p < parts; ++p) {
      TORCH_CHECK(0 <= rg[2 * p] && rg[2 * p] <= rg[2 * p + 1] && rg[2 * p + 1] <= out.size(1),
                  "lora_add: a column range outside out");
      panels += (rg[2 * p + 1] - rg[2 * p] + kPanel - 1) / kPanel;
    }
    const int64_t want = panels * (a[g].size(0) / parts) * kPanel;
    TORCH_CHECK(bt[g].numel() == want, "lora_add: adapter ", g, ": B^T holds ", bt[g].numel(), " values, ", want,
                " expected");
  }
  std::vector<at::Tensor> av(a.begin(), a.end()), bv(bt.begin(), bt.end()), rv(ranges.begin(), ranges.end());
  if (x.scalar_type() == at::kFloat) lora_add_impl<float>(out, x, rows, bounds, av, bv, rv);
  else lora_add_impl<c10::BFloat16>(out, x, rows, bounds, av, bv, rv);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor rows, Tensor bounds, Tensor[] a, Tensor[] bt, "
        "Tensor[] ranges) -> ()");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) { m.impl("lora_add", &lora_add); }
