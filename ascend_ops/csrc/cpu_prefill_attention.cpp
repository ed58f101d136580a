// Causal attention of one sequence's prefill chunk over its paged KV cache, read in place (no gathered copy, no
// repeated KV heads): default mode's CPU attention for chunks of more than a few rows (ascend_ops/attention.py).
// Compiled into the one unit of ascend_ops/cpu_kernels.py after cpu_attention.cpp (its loads and exp: v512::load16,
// exp16; load8, exp8) and cpu_elementwise.cpp (its bf16 rounding: round16, round8).
//
// prefill_attention(out, q, k_cache, v_cache, table, first, scale, window): q / out [rows, Hq, D], the rows at
// positions first .. first + rows - 1 of the sequence whose blocks are `table`; row i attends to the keys at
// positions 0 .. first + i (written into the cache before the call), or with window > 0 (a sliding-window layer,
// as HF masks it) to those after first + i - window only; the blocks wholly before the first row's window are
// not read (a scheduler may have given them back). q fp32 over caches of fp32, bf16 or fp16
// (widened exactly), or q bf16 over bf16 caches (computed in fp32, the softmax numerators rounded to bf16 before
// they weigh the values and the output rounded to bf16 once, as torch's CPU flash attention rounds).
//
// Work items are (a tile of query rows, one kv head): the tile's rows times the G query heads that share the kv
// head make up to kQueries query vectors, laid out across the lanes of three registers (48 lanes with AVX-512, 24
// with AVX2). Per item, over every key up to the tile's last position:
//   scores  s[pos][m] = (q_m . k_pos) * scale, one FMA chain over d per score (keys broadcast, queries in
//           lanes: eight keys (AVX2: four) by three registers of queries per step, no horizontal sums), a key
//           after the query's own position (or before its window) -inf; the keys before the window of the
//           tile's first query are not read;
//   softmax the exact maximum per query, then p = exp(s - max) (0 where -inf) and their sum, in position order;
//   values  o[m][:] = sum over positions, in order, of p[pos][m] * v_pos (six queries by 64 columns a step;
//           AVX2: by 16).
// Every query's arithmetic is the same whatever tile it falls in and however many rows the chunk has (a key
// past its position, or before its window, adds an exact 0), so a row's output does not depend on the chunking
// or on other rows.
// The AVX2 and AVX-512 builds give the same bits. torch's CPU flash attention (the path before this kernel, still
// used where it is not compiled: a portable build) sums in another order: outputs agree to rounding.
//
// Measured: docs/serving.md ("Attention over the paged cache").

namespace {

#if defined(ROLLBUS_AVX512) || defined(__AVX2__)
namespace prefill {

// The vector operations the kernel is written in, for the widest instruction set compiled: AVX-512 (16 lanes, 32
// registers) or AVX2 + FMA (8 lanes, 16 registers; CPUs such as AMD Zen 2/3). Both compute every value the same
// way (one FMA chain per score over d, the same exp, sums in position order), so they give the same bits.
#ifdef ROLLBUS_AVX512
struct Isa {
  using V = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kVecs = 3;     // query vectors per item: 48 lanes
  static constexpr int kKeys = 8;     // keys per scoring step: 8 x 3 accumulators
  static constexpr int kRowsPv = 6;   // queries per weighted-sum step: 6 x 4 accumulators
  static constexpr int kColVecs = 4;  // value vectors per weighted-sum step (64 columns)
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V load_t(const T* p) { return v512::load16(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  // y in the lanes whose query position is before `pos`, x elsewhere
  static V past(int32_t pos, I qpos, V x, V y) {
    return _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(pos), qpos), y);
  }
  // y in the lanes whose query position is after `lim`, x elsewhere
  static V after(int32_t lim, I qpos, V x, V y) {
    return _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(qpos, _mm512_set1_epi32(lim)), y);
  }
  // e, 0 in the lanes where x is -inf
  static V drop_masked(V x, V e) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(-INFINITY), _CMP_NEQ_OQ), e); }
  static V exp(V x) { return v512::exp16(x); }  // x <= 0
  template <typename Q>
  static V round(V x, Q q) { return round16(x, q); }  // to Q (fp32: as is; bf16: nearest even), kept in fp32
};
#else
struct Isa {
  using V = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kVecs = 3;     // 24 lanes
  static constexpr int kKeys = 4;     // 4 x 3 accumulators
  static constexpr int kRowsPv = 6;   // 6 x 2 accumulators
  static constexpr int kColVecs = 2;  // 16 columns
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V load_t(const T* p) { return load8(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static I load_i(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V past(int32_t pos, I qpos, V x, V y) {
    return _mm256_blendv_ps(x, y, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(pos), qpos)));
  }
  static V after(int32_t lim, I qpos, V x, V y) {
    return _mm256_blendv_ps(x, y, _mm256_castsi256_ps(_mm256_cmpgt_epi32(qpos, _mm256_set1_epi32(lim))));
  }
  static V drop_masked(V x, V e) { return _mm256_and_ps(e, _mm256_cmp_ps(x, set1(-INFINITY), _CMP_NEQ_OQ)); }
  static V exp(V x) { return exp8(x); }
  template <typename Q>
  static V round(V x, Q q) { return round8(x, q); }
};
#endif

using V = Isa::V;
constexpr int kLanes = Isa::kLanes, kKeys = Isa::kKeys, kRowsPv = Isa::kRowsPv, kColVecs = Isa::kColVecs;
constexpr int64_t kQueries = Isa::kLanes * Isa::kVecs;  // query lanes per item
constexpr int64_t kValueBlock = 128;  // positions whose numerators and values are weighed together

// s[r * mpad + lane] = (sum over i of k_r[i] * qt[i * mpad + lane]) * scale for the kKeys keys k[0..] at positions
// p0 + r (rows past nk unused), -inf where the key is after the lane's query (qpos; checked where `masked`) or, with
// `window` > 0, before its window (keys at qpos - window and earlier; checked where `windowed`); mx[lane] = the
// running maximum. Not inlined: its accumulators need the registers the caller keeps its own values in.
template <int MV>
__attribute__((noinline)) void score_keys(const float* qt, int64_t mpad, const float* const* k, int nk, int64_t d,
                                          float scale, int64_t p0, bool masked, bool windowed, int64_t window,
                                          const int32_t* qpos, float* mx, float* s) {
  V acc[kKeys][MV];
#pragma GCC unroll 8
  for (int r = 0; r < kKeys; ++r)
    for (int u = 0; u < MV; ++u) acc[r][u] = Isa::zero();
  for (int64_t i = 0; i < d; ++i) {
    V qv[MV];
    for (int u = 0; u < MV; ++u) qv[u] = Isa::load(qt + i * mpad + kLanes * u);
#pragma GCC unroll 8
    for (int r = 0; r < kKeys; ++r) {
      const V kv = Isa::set1(k[r][i]);
      for (int u = 0; u < MV; ++u) acc[r][u] = Isa::fma(kv, qv[u], acc[r][u]);
    }
  }
  const V sc = Isa::set1(scale), neg = Isa::set1(-INFINITY);
  for (int u = 0; u < MV; ++u) {
    V m = Isa::load(mx + kLanes * u);
    const Isa::I qp = Isa::load_i(qpos + kLanes * u);
    for (int r = 0; r < nk; ++r) {
      V x = Isa::mul(acc[r][u], sc);
      if (masked) x = Isa::past(static_cast<int32_t>(p0 + r), qp, x, neg);  // keys after a query's position: -inf
      if (windowed) x = Isa::after(static_cast<int32_t>(p0 + r + window - 1), qp, x, neg);  // before its window
      Isa::store(s + r * mpad + kLanes * u, x);
      m = Isa::max(m, x);
    }
    Isa::store(mx + kLanes * u, m);
  }
}

// o[r * d + c ..] += sum over positions of p[pos * mpad + r] * v_pos[c ..], R queries, CV vectors of columns.
template <typename T, int R, int CV>
__attribute__((noinline)) void weigh_values(const float* p, int64_t mpad, const T* const* v, int64_t len, int64_t c,
                                            int64_t d, float* o) {
  V acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < CV; ++u) acc[r][u] = Isa::load(o + r * d + c + kLanes * u);
  for (int64_t pos = 0; pos < len; ++pos) {
    V x[CV];
    for (int u = 0; u < CV; ++u) x[u] = Isa::load_t(v[pos] + c + kLanes * u);
    const float* pr = p + pos * mpad;
    for (int r = 0; r < R; ++r) {
      const V w = Isa::set1(pr[r]);
      for (int u = 0; u < CV; ++u) acc[r][u] = Isa::fma(w, x[u], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < CV; ++u) Isa::store(o + r * d + c + kLanes * u, acc[r][u]);
}

template <typename T, int R>
inline void weigh_rows(const float* p, int64_t mpad, const T* const* v, int64_t len, int64_t d, float* o) {
  int64_t c = 0;
  for (; c + kColVecs * kLanes <= d; c += kColVecs * kLanes) weigh_values<T, R, kColVecs>(p, mpad, v, len, c, d, o);
  for (; c < d; c += kLanes) weigh_values<T, R, 1>(p, mpad, v, len, c, d, o);
}

// o[m][:] += the weighted values of `len` positions for the m queries (o: [m][d], p: [len][mpad]).
template <typename T>
void weigh(const float* p, int64_t mpad, int64_t m, const T* const* v, int64_t len, int64_t d, float* o) {
  int64_t r = 0;
  for (; r + kRowsPv <= m; r += kRowsPv) weigh_rows<T, kRowsPv>(p + r, mpad, v, len, d, o + r * d);
  switch (m - r) {
    case 1: weigh_rows<T, 1>(p + r, mpad, v, len, d, o + r * d); break;
    case 2: weigh_rows<T, 2>(p + r, mpad, v, len, d, o + r * d); break;
    case 3: weigh_rows<T, 3>(p + r, mpad, v, len, d, o + r * d); break;
    case 4: weigh_rows<T, 4>(p + r, mpad, v, len, d, o + r * d); break;
    case 5: weigh_rows<T, 5>(p + r, mpad, v, len, d, o + r * d); break;
    default: break;
  }
}

inline const float* as_floats(const float* k, int64_t, float*) { return k; }
template <typename T>
inline const float* as_floats(const T* k, int64_t d, float* buf) {  // bf16 / fp16 widened exactly
  for (int64_t i = 0; i < d; i += kLanes) Isa::store(buf + i, Isa::load_t(k + i));
  return buf;
}

struct Scratch {
  std::vector<float> qt, s, o, kf;
  std::vector<int32_t> qpos;
};

// One item: query rows [i0, i0 + rows) of the chunk (positions first + i0 ..), kv head h. Q: q's and out's dtype.
// kptr / vptr: the records of the positions from `base` on. window > 0: a sliding window (the file's comment).
template <typename Q, typename T, int MV>
void attend_tile(const Q* qp, int64_t qs0, int64_t qs1, Q* op, int64_t os0, int64_t os1, const T* const* kptr,
                 const T* const* vptr, int64_t base, int64_t first, int64_t i0, int64_t rows, int64_t h, int64_t g,
                 int64_t d, float scale, int64_t window, Scratch& w) {
  const int64_t m = rows * g, mpad = kLanes * MV;
  const int64_t len = first + i0 + rows;  // keys up to the tile's last position
  // the first key any query of the tile sees (its first row's window start); keys before `open_until` are before
  // the window of some query of the tile (its last row's)
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first + i0 - window + 1) : 0;
  const int64_t open_until = window > 0 ? len - window : 0;
  const int64_t span = len - lo;
  kptr += lo - base;
  vptr += lo - base;
  w.qt.assign(d * mpad, 0.f);
  w.qpos.resize(mpad);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const Q* src = qp + (i0 + i) * qs0 + (h * g + j) * qs1;
      for (int64_t c = 0; c < d; ++c) w.qt[c * mpad + i * g + j] = to_float(src[c]);
    }
  for (int64_t lane = 0; lane < mpad; ++lane)  // the lanes past m see every key (their q is 0, outputs unused)
    w.qpos[lane] = static_cast<int32_t>(lane < m ? first + i0 + lane / g : len - 1);
  if (static_cast<int64_t>(w.s.size()) < span * mpad) w.s.resize(span * mpad);
  if (static_cast<int64_t>(w.kf.size()) < kKeys * d) w.kf.resize(kKeys * d);
  float* s = w.s.data();
  float mx[kQueries];
  std::fill(mx, mx + mpad, -INFINITY);
  const int64_t masked_from = first + i0;  // keys before it are seen by every query of the tile
  for (int64_t p0 = lo; p0 < len; p0 += kKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeys, len - p0));
    const float* k[kKeys];
    for (int r = 0; r < kKeys; ++r) k[r] = as_floats(kptr[p0 - lo + std::min(r, nk - 1)], d, w.kf.data() + r * d);
    score_keys<MV>(w.qt.data(), mpad, k, nk, d, scale, p0, p0 + nk > masked_from, p0 < open_until, window,
                   w.qpos.data(), mx, s + (p0 - lo) * mpad);
  }
  V sum[MV];
  for (int u = 0; u < MV; ++u) sum[u] = Isa::zero();
  // Numerators and values a block of positions at a time (the block's scores and values stay in cache across the
  // queries); every sum still runs over the positions in order.
  if (static_cast<int64_t>(w.o.size()) < m * d) w.o.resize(m * d);
  std::fill(w.o.begin(), w.o.begin() + m * d, 0.f);
  for (int64_t b0 = 0; b0 < span; b0 += kValueBlock) {
    const int64_t n = std::min(kValueBlock, span - b0);
    for (int64_t at = b0; at < b0 + n; ++at)
      for (int u = 0; u < MV; ++u) {
        float* sp = s + at * mpad + kLanes * u;
        const V x = Isa::load(sp);
        V e = Isa::exp(Isa::sub(x, Isa::load(mx + kLanes * u)));
        if (lo + at >= masked_from || lo + at < open_until)
          e = Isa::drop_masked(x, e);  // a key past the query's position or before its window: exactly 0
        sum[u] = Isa::add(sum[u], e);
        // bf16 queries: as torch's CPU flash attention does for reduced types, the normaliser sums the fp32
        // numerators and the weighted sum of V takes them rounded to bf16 (accumulating in fp32)
        Isa::store(sp, Isa::round(e, Q()));
      }
    weigh<T>(s + b0 * mpad, mpad, m, vptr + b0, n, d, w.o.data());
  }
  float inv[kQueries];
  for (int u = 0; u < MV; ++u) Isa::store(inv + kLanes * u, Isa::div(Isa::set1(1.0f), sum[u]));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t lane = i * g + j;
      const float* a = w.o.data() + lane * d;
      Q* dst = op + (i0 + i) * os0 + (h * g + j) * os1;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<Q>(a[c] * inv[lane]);
    }
}

template <typename Q, typename T>
void attend_chunk(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& table, int64_t first, double scale, int64_t window) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hk = k_cache.size(2), g = hq / hk;
  const int64_t len = first + rows;
  const int64_t base = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;  // the first key read
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t ts = table.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  // every key's and value's record of every kv head, by position from `base`: [hk][len - base]
  const int64_t npos = len - base;
  std::vector<const T*> kptr(hk * npos), vptr(hk * npos);
  for (int64_t pos = base; pos < len; ++pos) {
    const int64_t blk = tp[(pos / bs) * ts], off = (pos % bs);
    for (int64_t h = 0; h < hk; ++h) {
      kptr[h * npos + pos - base] = kp + blk * kb + off * kt + h * kh;
      vptr[h * npos + pos - base] = vp + blk * vb + off * vt + h * vh;
    }
  }
  const int64_t tile = std::max<int64_t>(1, kQueries / g);  // query rows per item
  const int64_t tiles = (rows + tile - 1) / tile;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
  // Items kv head by kv head, so that a thread's tiles read one head's keys and values (SmolLM2's: 256 B each a
  // position in fp32, 1 MiB for 2,048 positions) and they stay in its L2 from tile to tile, where items that cycled
  // through the heads read every head's (measured, 1 thread, a 2,048-token SmolLM2 chunk: ~10% faster; Qwen3-0.6B's
  // 128-wide heads the same speed); within a head, in pairs of a cheap and a dear tile (the first and the last, then
  // the second and the one before, ...), so that the contiguous ranges parallel_for hands the threads cost about the
  // same (later rows see more keys).
  at::parallel_for(0, tiles * hk, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch w;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t = item % tiles;
      const int64_t ti = t % 2 == 0 ? t / 2 : tiles - 1 - t / 2;
      const int64_t i0 = ti * tile, n = std::min(tile, rows - i0);
      const T* const* ks = kptr.data() + h * npos;
      const T* const* vs = vptr.data() + h * npos;
      switch ((n * g + kLanes - 1) / kLanes) {
        case 1:
          attend_tile<Q, T, 1>(qp, qs0, qs1, op, os0, os1, ks, vs, base, first, i0, n, h, g, d, fscale, window, w);
          break;
        case 2:
          attend_tile<Q, T, 2>(qp, qs0, qs1, op, os0, os1, ks, vs, base, first, i0, n, h, g, d, fscale, window, w);
          break;
        default:
          attend_tile<Q, T, 3>(qp, qs0, qs1, op, os0, os1, ks, vs, base, first, i0, n, h, g, d, fscale, window, w);
          break;
      }
    }
  });
}

}  // namespace prefill
#endif

// The vector width the kernel was compiled for (16: AVX-512, 8: AVX2), 0 where it was not (a portable build):
// ascend_ops/attention.py asks before it routes a chunk here.
int64_t prefill_attention_width() {
#if defined(ROLLBUS_AVX512) || defined(__AVX2__)
  return prefill::kLanes;
#else
  return 0;
#endif
}

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& table, int64_t first, double scale, int64_t window) {
  TORCH_CHECK(prefill_attention_width() > 0, "prefill_attention: built without AVX2 or AVX-512");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0, got ", window);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && table.dim() == 1,
              "prefill_attention: q/out [R, Hq, D], caches [num_blocks, block_size, Hk, D], table [blocks]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "prefill_attention: q and out must have one dtype");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "prefill_attention: the caches must share one dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 &&
                  out.sizes() == q.sizes(),
              "prefill_attention: shapes do not match");
  TORCH_CHECK(q.size(2) % 16 == 0, "prefill_attention: the head dimension must be a multiple of 16");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "prefill_attention: the head dimension must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong, "prefill_attention: the block table is int64");
  const int64_t rows = q.size(0), bs = k_cache.size(1);
  TORCH_CHECK(first >= 0, "prefill_attention: first position ", first, " is negative");
  const int64_t len = first + rows;
  TORCH_CHECK((len + bs - 1) / bs <= table.size(0), "prefill_attention: ", len, " positions do not fit the table");
  const int64_t* tp = table.data_ptr<int64_t>();
  // the blocks read: from the one that holds the first row's first key (its window's, with a window)
  for (int64_t b = (window > 0 ? std::max<int64_t>(0, first - window + 1) : 0) / bs; b < (len + bs - 1) / bs; ++b) {
    const int64_t blk = tp[b * table.stride(0)];
    TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "prefill_attention: block id ", blk, " out of range");
  }
  if (rows == 0) return;
#if defined(ROLLBUS_AVX512) || defined(__AVX2__)
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) {
    prefill::attend_chunk<float, float>(out, q, k_cache, v_cache, table, first, scale, window);
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    prefill::attend_chunk<float, c10::BFloat16>(out, q, k_cache, v_cache, table, first, scale, window);
  } else if (qt == at::kFloat && ct == at::kHalf) {
    prefill::attend_chunk<float, c10::Half>(out, q, k_cache, v_cache, table, first, scale, window);
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    prefill::attend_chunk<c10::BFloat16, c10::BFloat16>(out, q, k_cache, v_cache, table, first, scale, window);
  } else {
    TORCH_CHECK(false, "prefill_attention: q float32 over float32, bfloat16 or float16 caches, or q bfloat16 over "
                "bfloat16 caches; got q ", qt, ", caches ", ct);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("prefill_attention_width() -> int");
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int first, "
        "float scale, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
TORCH_LIBRARY_IMPL(rollbus_cpu, CompositeExplicitAutograd, m) {
  m.impl("prefill_attention_width", &prefill_attention_width);
}
