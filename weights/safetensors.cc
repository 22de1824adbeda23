// Safetensors header parsing and formatting (see safetensors.h for the rules enforced).
#include "weights/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace tiermem::weights {
namespace {

using nlohmann::json;

struct DTypeRow {
  DType dtype;
  std::string_view name;
  uint32_t bits;
};

constexpr std::array<DTypeRow, 22> kDTypes = {{
    {DType::kBool, "BOOL", 8},
    {DType::kU8, "U8", 8},
    {DType::kI8, "I8", 8},
    {DType::kF8E5M2, "F8_E5M2", 8},
    {DType::kF8E4M3, "F8_E4M3", 8},
    {DType::kF8E8M0, "F8_E8M0", 8},
    {DType::kF8E4M3Fnuz, "F8_E4M3FNUZ", 8},
    {DType::kF8E5M2Fnuz, "F8_E5M2FNUZ", 8},
    {DType::kF4, "F4", 4},
    {DType::kF6E2M3, "F6_E2M3", 6},
    {DType::kF6E3M2, "F6_E3M2", 6},
    {DType::kI16, "I16", 16},
    {DType::kU16, "U16", 16},
    {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},
    {DType::kI32, "I32", 32},
    {DType::kU32, "U32", 32},
    {DType::kF32, "F32", 32},
    {DType::kF64, "F64", 64},
    {DType::kC64, "C64", 64},
    {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},
}};

const DTypeRow& Row(DType d) { return kDTypes[static_cast<size_t>(d)]; }

Status PReadAll(int fd, void* p, size_t n, uint64_t off, std::string_view path) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = pread(fd, c, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "reading " + std::string(path));
    }
    if (r == 0) return DataLossError(std::string(path) + " ends before its header does");
    c += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return OkStatus();
}

// A non-negative integer of the header (a JSON number without fraction), or nullopt.
std::optional<uint64_t> Unsigned(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// One tensor entry of the header, validated alone (its offsets against the others later).
StatusOr<TensorInfo> ParseEntry(const std::string& key, const json& v, const std::string& where) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(where + ": tensor '" + key + "' " + what);
  };
  if (!v.is_object()) return bad("is not a JSON object");
  TensorInfo t;
  t.key = key;
  const auto dtype = v.find("dtype");
  if (dtype == v.end() || !dtype->is_string()) return bad("has no dtype");
  const std::optional<DType> d = ParseDType(dtype->get<std::string>());
  if (!d) return bad("has the unknown dtype '" + dtype->get<std::string>() + "'");
  t.dtype = *d;
  const auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) return bad("has no shape");
  for (const json& dim : *shape) {
    const std::optional<uint64_t> n = Unsigned(dim);
    if (!n) return bad("has a shape entry that is not a non-negative integer: " + dim.dump());
    if (*n != 0 && t.numel > (uint64_t{1} << 62) / *n) return bad("has too many elements");
    t.shape.push_back(*n);
    t.numel *= *n;
  }
  const auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2) {
    return bad("has no data_offsets [begin, end]");
  }
  const std::optional<uint64_t> b = Unsigned((*off)[0]), e = Unsigned((*off)[1]);
  if (!b || !e || *b > *e) return bad("has bad data_offsets " + off->dump());
  t.begin = *b;
  t.end = *e;
  const uint64_t bits = t.numel * DTypeBits(t.dtype);
  if (bits % 8 != 0) {
    return bad("is " + std::to_string(t.numel) + " elements of " + std::string(DTypeName(t.dtype)) +
               ", not a whole number of bytes");
  }
  if (t.bytes() != bits / 8) {
    return bad("holds " + std::to_string(t.bytes()) + " bytes, but " + std::to_string(t.numel) +
               " elements of " + std::string(DTypeName(t.dtype)) + " are " +
               std::to_string(bits / 8));
  }
  return t;
}

// The tensors sorted by offset must tile the data section exactly: from 0, without holes or
// overlaps, to its end. A data section shorter than the tensors need is a truncated file.
Status CheckTiling(const Header& h, const std::string& where) {
  const uint64_t data_bytes = h.file_bytes - h.data_start;
  uint64_t at = 0;
  const TensorInfo* last = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin != at) {
      return InvalidArgumentError(
          where + ": tensor '" + t.key + "' starts at data byte " + std::to_string(t.begin) +
          (t.begin > at ? ", leaving a hole after byte " : ", overlapping the bytes before ") +
          std::to_string(at) + " (safetensors tensors are contiguous)");
    }
    at = t.end;
    if (t.bytes() > 0) last = &t;
  }
  if (at > data_bytes) {
    return DataLossError(where +
                         " is shorter than its header says (torn or partially "
                         "downloaded): tensor '" +
                         (last ? last->key : std::string()) + "' ends at data byte " +
                         std::to_string(at) + ", the file holds " + std::to_string(data_bytes) +
                         " bytes of tensor data");
  }
  if (at < data_bytes) {
    return InvalidArgumentError(
        where + " has " + std::to_string(data_bytes - at) + " bytes after its last tensor" +
        (last ? " '" + last->key + "'" : std::string()) + " that no tensor of its header covers");
  }
  return OkStatus();
}

}  // namespace

std::optional<DType> ParseDType(std::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (r.name == name) return r.dtype;
  }
  return std::nullopt;
}

std::string_view DTypeName(DType dtype) { return Row(dtype).name; }
uint32_t DTypeBits(DType dtype) { return Row(dtype).bits; }

const TensorInfo* Header::Find(std::string_view key) const {
  const auto it = by_key.find(std::string(key));
  return it == by_key.end() ? nullptr : &tensors[it->second];
}

StatusOr<std::string> ReadHeaderText(int fd, std::string_view path, uint64_t* file_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat " + std::string(path));
  *file_bytes = static_cast<uint64_t>(st.st_size);
  const std::string where = "safetensors file " + std::string(path);
  if (*file_bytes < 8) {
    return InvalidArgumentError(where + " has " + std::to_string(*file_bytes) +
                                " bytes: too short for a header");
  }
  uint64_t n = 0;
  TIERMEM_RETURN_IF_ERROR(PReadAll(fd, &n, 8, 0, path));
  if (n == 0 || n > kMaxHeaderBytes) {
    return InvalidArgumentError(where + ": header length " + std::to_string(n) + " is not in [1, " +
                                std::to_string(kMaxHeaderBytes) + "] (not a safetensors file?)");
  }
  if (n > *file_bytes - 8) {
    return DataLossError(where +
                         " is shorter than its header says (torn or partially "
                         "downloaded): a header of " +
                         std::to_string(n) + " bytes in a file of " + std::to_string(*file_bytes));
  }
  std::string text(n, '\0');
  TIERMEM_RETURN_IF_ERROR(PReadAll(fd, text.data(), n, 8, path));
  return text;
}

StatusOr<Header> ParseHeader(std::string_view path, std::string_view text, uint64_t file_bytes) {
  const std::string where = "safetensors file " + std::string(path);
  // Duplicate top-level keys: nlohmann keeps the last silently; the callback sees each one.
  std::set<std::string> seen;
  std::string duplicate;
  const json::parser_callback_t on_key = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json h;
  try {
    h = json::parse(text.begin(), text.end(), on_key);
  } catch (const json::exception& e) {
    return InvalidArgumentError(where + ": the header is not valid JSON (" + e.what() + ")");
  }
  if (!h.is_object()) return InvalidArgumentError(where + ": the header is not a JSON object");
  if (!duplicate.empty()) {
    return InvalidArgumentError(where + ": the header names tensor '" + duplicate + "' twice");
  }
  Header out;
  out.path = std::string(path);
  out.file_bytes = file_bytes;
  out.data_start = 8 + text.size();
  for (const auto& [key, v] : h.items()) {
    if (key == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) return InvalidArgumentError(where + ": __metadata__ is not an object");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string()) {
          return InvalidArgumentError(where + ": __metadata__ entry '" + mk +
                                      "' is not a string (safetensors metadata maps strings "
                                      "to strings)");
        }
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    TIERMEM_ASSIGN_OR_RETURN(TensorInfo t, ParseEntry(key, v, where));
    out.tensors.push_back(std::move(t));
  }
  std::stable_sort(out.tensors.begin(), out.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  TIERMEM_RETURN_IF_ERROR(CheckTiling(out, where));
  for (size_t i = 0; i < out.tensors.size(); ++i) out.by_key[out.tensors[i].key] = i;
  return out;
}

StatusOr<Header> ReadHeader(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "opening safetensors file " + path);
  uint64_t file_bytes = 0;
  StatusOr<std::string> text = ReadHeaderText(fd, path, &file_bytes);
  close(fd);
  if (!text.ok()) return text.status();
  return ParseHeader(path, *text, file_bytes);
}

std::string HeaderText(const std::vector<TensorInfo>& tensors,
                       const std::map<std::string, std::string>& metadata, uint64_t align) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const TensorInfo& t : tensors) {
    h[t.key] = {{"dtype", std::string(DTypeName(t.dtype))},
                {"shape", t.shape},
                {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = h.dump();
  align = std::max<uint64_t>(align, 8);
  const uint64_t padded = (8 + text.size() + align - 1) / align * align;
  text.append(padded - 8 - text.size(), ' ');
  return text;
}

}  // namespace tiermem::weights
