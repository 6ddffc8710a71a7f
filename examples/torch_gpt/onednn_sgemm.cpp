// examples/torch_gpt/onednn_sgemm.cpp: torch_gpt's single-precision GEMM (the Fortran BLAS
// `sgemm_` that libtorch calls for every float32 matmul / Linear / bmm on the CPU), routed to
// oneDNN's `dnnl_sgemm`.
//
// Why: Debian's libtorch (1.13, BLAS_INFO=generic) calls `sgemm_` from libblas.so.3, which the
// distribution's alternatives point at the NETLIB REFERENCE BLAS: a plain triple loop, 2.3
// GFLOP/s here, so one inner step of the gpt1m preset took 3 s. oneDNN (libdnnl.so.2) is already
// loaded, because libtorch links it, and ships a JIT-compiled AVX2/AVX-512 sgemm. Defining
// `sgemm_` in the executable interposes it (the dynamic linker resolves libtorch's call to the
// executable's definition first), with no new package and no change to the maths: the same
// C = alpha op(A) op(B) + beta C, only a different summation order (float rounding).
// What it is not: a BLAS. Only `sgemm_` is replaced; if oneDNN's symbol cannot be found, the call
// goes on to the next `sgemm_` in the search order (the system BLAS), so results never change
// meaning. TORCH_GPT_REFERENCE_BLAS=1 in the environment forces that fallback (for timing).
// The same file builds libonednn_sgemm.so (examples/python/CMakeLists.txt), which
// examples/python/train_gpt.py loads into the Python interpreter for the same reason.
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>

namespace {

// oneDNN's C API (dnnl.h, not installed here): row-major C = alpha op(A) op(B) + beta C,
// returns dnnl_success (0) on success.
using DnnlSgemm = int (*)(char transa, char transb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                          std::int64_t ldc);
// The Fortran BLAS signature (column-major, every argument by pointer).
using FortranSgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                              const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                              const float* beta, float* c, const int* ldc);

struct Backends {
  DnnlSgemm dnnl = nullptr;
  FortranSgemm next = nullptr;
  Backends() {
    const char* force = std::getenv("TORCH_GPT_REFERENCE_BLAS");
    const bool use_dnnl = force == nullptr || force[0] != '1';
    if (use_dnnl) dnnl = reinterpret_cast<DnnlSgemm>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
    next = reinterpret_cast<FortranSgemm>(dlsym(RTLD_NEXT, "sgemm_"));
    // Loaded into Python (examples/python: ctypes, RTLD_GLOBAL, before `import torch`), libtorch and
    // its libdnnl / libblas are in the local scope of torch's extension module, which neither
    // RTLD_DEFAULT nor RTLD_NEXT searches: ask for the already loaded libraries by name (NOLOAD
    // loads nothing new; the handles keep them referenced, which they are anyway).
    if (use_dnnl && dnnl == nullptr) {
      if (void* h = dlopen("libdnnl.so.2", RTLD_LAZY | RTLD_NOLOAD))
        dnnl = reinterpret_cast<DnnlSgemm>(dlsym(h, "dnnl_sgemm"));
    }
    if (next == nullptr) {
      if (void* h = dlopen("libblas.so.3", RTLD_LAZY | RTLD_NOLOAD))
        next = reinterpret_cast<FortranSgemm>(dlsym(h, "sgemm_"));
    }
  }
};

const Backends& backends() {
  static const Backends b;  // thread-safe initialisation
  return b;
}

/// BLAS 'C' (conjugate transpose) is 'T' for real matrices; oneDNN knows only N and T.
char real_trans(char t) { return (t == 'C' || t == 'c') ? 'T' : t; }

}  // namespace

/// True when torch_gpt's float32 GEMMs run on oneDNN (for --profile).
bool torch_gpt_sgemm_is_onednn() { return backends().dnnl != nullptr; }

extern "C" __attribute__((visibility("default"))) void sgemm_(const char* transa, const char* transb, const int* m,
                                                              const int* n, const int* k, const float* alpha,
                                                              const float* a, const int* lda, const float* b,
                                                              const int* ldb, const float* beta, float* c,
                                                              const int* ldc) {
  const Backends& be = backends();
  if (be.dnnl != nullptr) {
    // Column-major C (m x n, leading dimension ldc) is row-major C^T (n x m, row stride ldc), and
    // C^T = alpha op(B)^T op(A)^T + beta C^T: the row-major call swaps the operands and m, n.
    const int status = be.dnnl(real_trans(*transb), real_trans(*transa), *n, *m, *k, *alpha, b, *ldb, a, *lda, *beta,
                               c, *ldc);
    if (status == 0) return;
  }
  if (be.next == nullptr) std::abort();  // no BLAS at all: libtorch could not have been loaded
  be.next(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
