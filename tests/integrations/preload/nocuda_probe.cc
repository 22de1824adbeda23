// A program that loads no CUDA runtime: under the preload shim it must behave exactly as
// without it (no output from the shim, no timeline file, same exit code).
#include <cstdio>
#include <cstdlib>

int main() {
  void* p = std::malloc(1 << 20);
  std::printf("nocuda ok\n");
  std::free(p);
  return 3;
}
