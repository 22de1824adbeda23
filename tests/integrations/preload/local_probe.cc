// Loads the CUDA-using library like Python loads an extension (RTLD_LOCAL), then calls it.
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    std::printf("dlopen: %s\n", dlerror());
    return 2;
  }
  auto fn = reinterpret_cast<int (*)(size_t)>(dlsym(h, "local_user_alloc_free"));
  if (fn == nullptr) return 2;
  const int rc = fn(1 << 20);
  std::printf("local rc=%d\n", rc);
  return rc;
}
