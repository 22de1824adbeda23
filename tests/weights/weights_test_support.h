// Test helpers for weights/: temporary directories and safetensors files written byte by byte
// (so that malformed ones can be made too).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tiermem::weights::testing {

inline std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "tiermem_weights_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl;
}

// A fixture with a temporary directory of its own, removed after the test.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = TempDir(); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

// u64 n | header | data, with n = header.size() unless given.
inline void WriteRaw(const std::string& path, const std::string& header, const std::string& data,
                     int64_t n = -1) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t len = n >= 0 ? static_cast<uint64_t>(n) : header.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header << data;
}

// A well-formed file of F32 tensors, in the order given, values i + 100 * tensor.
struct F32Tensor {
  std::string key;
  std::vector<uint64_t> shape;
};
inline std::string F32Values(size_t t, uint64_t numel) {
  std::string out(numel * 4, '\0');
  for (uint64_t i = 0; i < numel; ++i) {
    const float v = static_cast<float>(i + 100 * t);
    std::memcpy(out.data() + i * 4, &v, 4);
  }
  return out;
}
inline void WriteF32File(const std::string& path, const std::vector<F32Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string data;
  for (size_t t = 0; t < tensors.size(); ++t) {
    uint64_t numel = 1;
    for (uint64_t d : tensors[t].shape) numel *= d;
    h[tensors[t].key] = {{"dtype", "F32"},
                         {"shape", tensors[t].shape},
                         {"data_offsets", {data.size(), data.size() + numel * 4}}};
    data += F32Values(t, numel);
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  WriteRaw(path, text, data);
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace tiermem::weights::testing
