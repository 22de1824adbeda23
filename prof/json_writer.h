// A small buffered writer for large JSON/HTML outputs (millions of records): appends to a
// string and spills to a FILE in 1 MiB pieces. Externally synchronized; owns the FILE.
#pragma once

#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>

#include "base/status.h"

namespace tiermem::prof {

class OutputFile {
 public:
  static StatusOr<std::unique_ptr<OutputFile>> Create(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return ErrnoToStatus(errno, "open " + path + " for writing");
    return std::unique_ptr<OutputFile>(new OutputFile(f, path));
  }
  ~OutputFile() {
    if (f_ != nullptr) std::fclose(f_);
  }
  OutputFile& operator<<(std::string_view s) {
    buf_.append(s);
    if (buf_.size() > (1u << 20)) Spill();
    return *this;
  }
  OutputFile& operator<<(char c) {
    buf_.push_back(c);
    return *this;
  }
  OutputFile& Uint(uint64_t v) {
    char tmp[24];
    auto res = std::to_chars(tmp, tmp + sizeof(tmp), v);
    buf_.append(tmp, res.ptr);
    return *this;
  }
  // ns as microseconds with 3 decimals ("12.345").
  OutputFile& Micros(uint64_t ns) {
    Uint(ns / 1000);
    char frac[5] = {'.', char('0' + ns % 1000 / 100), char('0' + ns % 100 / 10),
                    char('0' + ns % 10), 0};
    buf_.append(frac, 4);
    return *this;
  }
  // A JSON string literal with escaping.
  OutputFile& Quoted(std::string_view s) {
    buf_.push_back('"');
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        buf_.push_back('\\');
        buf_.push_back(static_cast<char>(c));
      } else if (c < 0x20) {
        char esc[8];
        std::snprintf(esc, sizeof(esc), "\\u%04x", c);
        buf_.append(esc);
      } else if (c == '<') {
        buf_.append("\\u003c");  // keeps "</script>" out of inline HTML data
      } else {
        buf_.push_back(static_cast<char>(c));
      }
    }
    buf_.push_back('"');
    return *this;
  }
  Status Close() {
    Spill();
    const bool err = std::ferror(f_) != 0;
    const int rc = std::fclose(f_);
    f_ = nullptr;
    if (err || rc != 0) return IOError("write " + path_ + " failed");
    return OkStatus();
  }

 private:
  OutputFile(std::FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  void Spill() {
    std::fwrite(buf_.data(), 1, buf_.size(), f_);
    buf_.clear();
  }
  std::FILE* f_;
  std::string path_;
  std::string buf_;
};

}  // namespace tiermem::prof
