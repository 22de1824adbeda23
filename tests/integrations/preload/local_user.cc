// A library that uses CUDA and is dlopen'ed with RTLD_LOCAL by local_probe.cc, the way
// Python loads PyTorch's libtorch_cuda.so: its libcudart is then not in the global lookup
// scope, so the shim's dlsym(RTLD_NEXT) does not find the real functions and the shim must
// find the already-loaded libcudart itself.
#include "integrations/preload/fake/fake_cudart.h"

extern "C" __attribute__((visibility("default"))) int local_user_alloc_free(size_t bytes) {
  void* p = nullptr;
  const int rc = cudaMalloc(&p, bytes);
  if (rc != 0) return rc;
  return cudaFree(p);
}
