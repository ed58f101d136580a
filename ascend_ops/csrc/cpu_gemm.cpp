// fp32 linear layers on MKL's packed sgemm (cblas_sgemm_pack / cblas_sgemm_compute): ascend_ops.packed_linear's
// "mkl" backend. torch's CPU build links MKL statically into libtorch_cpu and exports these symbols; they are
// looked up at run time in the libtorch_cpu this process already loaded (dlopen with RTLD_NOLOAD), so a
// torch build without MKL still loads this library and only this backend is unavailable (mkl_gemm_unavailable
// says why). Compiled as one unit with cpu_attention.cpp (cpu_kernels.SOURCES).
//
// torch's own mkl._mkl_linear uses its packed weight only for the one batch size it was packed for and falls
// back to an unpacked sgemm for every other; cblas_sgemm_compute takes any number of rows on one pack (the
// m given to the pack is a hint for its layout), which a decode step, whose rows change every step, needs.

#include <dlfcn.h>
#include <sys/mman.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <string>

namespace {

// CBLAS enum values (mkl_cblas.h)
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

using PackSizeFn = size_t (*)(int, int, int, int);
using PackFn = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
using ComputeFn = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);

struct MklGemm {
  PackSizeFn pack_size = nullptr;
  PackFn pack = nullptr;
  ComputeFn compute = nullptr;
  std::string why;  // empty: usable
};

const MklGemm& mkl_gemm() {
  static const MklGemm m = [] {
    MklGemm g;
    void* lib = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_LAZY);
    if (lib == nullptr) {
      g.why = "libtorch_cpu.so is not loaded in this process";
      return g;
    }
    g.pack_size = reinterpret_cast<PackSizeFn>(dlsym(lib, "cblas_sgemm_pack_get_size"));
    g.pack = reinterpret_cast<PackFn>(dlsym(lib, "cblas_sgemm_pack"));
    g.compute = reinterpret_cast<ComputeFn>(dlsym(lib, "cblas_sgemm_compute"));
    if (g.pack_size == nullptr || g.pack == nullptr || g.compute == nullptr)
      g.why = "this torch build exports no MKL packed sgemm (cblas_sgemm_pack / cblas_sgemm_compute)";
    return g;
  }();
  return m;
}

std::string mkl_gemm_unavailable() { return mkl_gemm().why; }

constexpr int64_t kIntMax = 2147483647;  // MKL's LP64 interface: int dimensions

// weight [N, K] fp32 -> the packed B operand of x [M, K] @ weight^T, for any M (m_hint: the rows expected)
at::Tensor mkl_pack(const at::Tensor& weight, int64_t m_hint) {
  const MklGemm& g = mkl_gemm();
  TORCH_CHECK(g.why.empty(), "mkl_pack: ", g.why);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "mkl_pack: a 2-D float32 CPU weight [out_features, in_features]");
  TORCH_CHECK(weight.size(0) <= kIntMax && weight.size(1) <= kIntMax && m_hint >= 1 && m_hint <= kIntMax,
              "mkl_pack: dimensions beyond MKL's 32-bit interface");
  const at::Tensor w = weight.contiguous();
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  // MKL asks for up to 4x the weight's bytes, writes about the weight's bytes spread over 1-2x of them, and
  // its compute reads some words it did not write, expecting zeros (a NaN there shows in the product). So
  // the pack gets a mapping of its own: fresh anonymous pages are zero, and only those MKL writes become
  // resident (4 KiB pages: MADV_NOHUGEPAGE, else a huge page per touched 2 MiB would make ~1.6x resident).
  const size_t bytes = g.pack_size(kBMatrix, static_cast<int>(m_hint), n, k);
  const size_t words = (bytes + sizeof(float) - 1) / sizeof(float);
  const size_t len = words * sizeof(float);
  void* mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mem != MAP_FAILED, "mkl_pack: could not map ", len, " bytes for the pack");
  madvise(mem, len, MADV_NOHUGEPAGE);
  at::Tensor dest = at::from_blob(mem, {static_cast<int64_t>(words)}, [len](void* p) { munmap(p, len); },
                                  w.options());
  g.pack(kRowMajor, kBMatrix, kTrans, static_cast<int>(m_hint), n, k, 1.0f, w.data_ptr<float>(), k,
         dest.data_ptr<float>());
  return dest;
}

// x [M, K] @ weight^T (+ bias) on the pack of weight [N, K] (n, k: the weight's shape, checked against x and
// against the pack's size, so a pack of another weight's shape is an error rather than a read past its end)
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k_in,
                             const std::optional<at::Tensor>& bias) {
  const MklGemm& g = mkl_gemm();
  TORCH_CHECK(g.why.empty(), "mkl_packed_linear: ", g.why);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && packed.scalar_type() == at::kFloat,
              "mkl_packed_linear: x is a 2-D float32 CPU tensor [rows, in_features]");
  TORCH_CHECK(x.size(0) <= kIntMax && x.size(1) <= kIntMax && n >= 1 && n <= kIntMax,
              "mkl_packed_linear: dimensions beyond MKL's 32-bit interface");
  TORCH_CHECK(x.size(1) == k_in, "mkl_packed_linear: x has ", x.size(1), " features, the weight ", k_in);
  TORCH_CHECK(packed.is_contiguous() &&
                  static_cast<size_t>(packed.numel()) * sizeof(float) >=
                      g.pack_size(kBMatrix, 1, static_cast<int>(n), static_cast<int>(k_in)),
              "mkl_packed_linear: the pack is smaller than a [", n, ", ", k_in, "] weight's");
  const at::Tensor a = x.contiguous();
  const int m = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1));
  at::Tensor out = at::empty({a.size(0), n}, a.options());
  if (m == 0) return out;
  float beta = 0.0f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "mkl_packed_linear: bias [out_features] float32");
    out.copy_(bias->view({1, n}).expand({a.size(0), n}));
    beta = 1.0f;
  }
  g.compute(kRowMajor, kNoTrans, kPacked, m, static_cast<int>(n), k, a.data_ptr<float>(), k, packed.data_ptr<float>(),
            k, beta, out.data_ptr<float>(), static_cast<int>(n));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollbus_cpu, m) {
  m.def("mkl_gemm_unavailable() -> str");
  m.def("mkl_pack(Tensor weight, int m_hint) -> Tensor");
  m.def("mkl_packed_linear(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CPU, m) {
  m.impl("mkl_pack", &mkl_pack);
  m.impl("mkl_packed_linear", &mkl_packed_linear);
}

TORCH_LIBRARY_IMPL(rollbus_cpu, CompositeExplicitAutograd, m) { m.impl("mkl_gemm_unavailable", &mkl_gemm_unavailable); }
