#include "base/env.h"

#include <cstdlib>
#include <memory>

namespace tiermem {

EnvGetter ProcessEnv() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

EnvGetter MapEnv(std::map<std::string, std::string> vars) {
  auto owned = std::make_shared<const std::map<std::string, std::string>>(std::move(vars));
  return [owned](const char* name) -> const char* {
    auto it = owned->find(name);
    return it == owned->end() ? nullptr : it->second.c_str();
  };
}

}  // namespace tiermem
