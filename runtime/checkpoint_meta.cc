// The checkpoint metadata format (see checkpoint_meta.h): encoding, decoding, the two earlier
// binding shapes, and the checks a load makes against the binding before it changes anything.
// Messages name the entry or key; the session adds the file's path ("checkpoint PATH: ...").
#include "runtime/checkpoint_meta.h"

#include <array>
#include <cstdint>

namespace tiermem::session {
namespace {

using nlohmann::json;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
constexpr const char* kHyperKeys[] = {"lr", "betas", "eps", "weight_decay"};

// The key of the Python binding's object in a file of an earlier build.
constexpr char kLegacyPython[] = "tiermem.python";

Status Number(const json& group, const std::string& where, const char* key, double* out) {
  const auto it = group.find(key);
  if (it == group.end()) return InvalidArgumentError(where + " has no '" + key + "'");
  if (!it->is_number()) {
    return InvalidArgumentError(where + " '" + key + "' is not a number: " + it->dump());
  }
  *out = it->get<double>();
  return OkStatus();
}

json GroupJson(const CheckpointGroup& g) {
  json o = g.other.is_object() ? g.other : json::object();
  o["lr"] = g.hyper.lr;
  o["betas"] = {g.hyper.beta1, g.hyper.beta2};
  o["eps"] = g.hyper.eps;
  o["weight_decay"] = g.hyper.weight_decay;
  return o;
}

Status Neither(const std::string& what) {
  return InvalidArgumentError(
      what +
      ": it holds no optimizer param groups in either shape earlier tiermem builds "
      "wrote (the Python binding's {\"" +
      std::string(kLegacyPython) +
      "\": {\"param_groups\": [...], ...}}, the LibTorch API's {\"param_groups\": [...]}); "
      "nothing was loaded");
}

}  // namespace

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(bytes[i])} << 16) |
                       (uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8) |
                       static_cast<uint8_t>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (const size_t rest = bytes.size() - i; rest > 0) {
    uint32_t v = uint32_t{static_cast<uint8_t>(bytes[i])} << 16;
    if (rest == 2) v |= uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

StatusOr<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) {
    return InvalidArgumentError("base64 text of " + std::to_string(text.size()) +
                                " characters (not a multiple of 4)");
  }
  std::array<int, 256> value;
  value.fill(-1);
  for (int k = 0; k < 64; ++k) value[static_cast<uint8_t>(kAlphabet[k])] = k;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=') : 0;
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const int d = k >= 4 - pad ? 0 : value[static_cast<uint8_t>(text[i + k])];
      if (d < 0) return InvalidArgumentError("base64 text has a character outside the alphabet");
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return out;
}

StatusOr<std::vector<CheckpointGroup>> ParseCheckpointGroups(const json& groups) {
  if (!groups.is_array()) {
    return InvalidArgumentError("'param_groups' is not an array: " + groups.dump());
  }
  std::vector<CheckpointGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const json& o = groups[g];
    const std::string where = "param_groups[" + std::to_string(g) + "]";
    if (!o.is_object()) return InvalidArgumentError(where + " is not an object: " + o.dump());
    CheckpointGroup cg;
    TIERMEM_RETURN_IF_ERROR(Number(o, where, "lr", &cg.hyper.lr));
    TIERMEM_RETURN_IF_ERROR(Number(o, where, "eps", &cg.hyper.eps));
    TIERMEM_RETURN_IF_ERROR(Number(o, where, "weight_decay", &cg.hyper.weight_decay));
    const auto betas = o.find("betas");
    if (betas == o.end()) return InvalidArgumentError(where + " has no 'betas'");
    if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() ||
        !(*betas)[1].is_number()) {
      return InvalidArgumentError(where + " 'betas' is not a pair of numbers: " + betas->dump());
    }
    cg.hyper.beta1 = (*betas)[0].get<double>();
    cg.hyper.beta2 = (*betas)[1].get<double>();
    cg.other = o;
    for (const char* k : kHyperKeys) cg.other.erase(k);
    out.push_back(std::move(cg));
  }
  return out;
}

std::map<std::string, std::string> EncodeCheckpointMeta(const CheckpointMeta& meta) {
  json groups = json::array();
  for (const CheckpointGroup& g : meta.groups) groups.push_back(GroupJson(g));
  return {{"param_groups", groups.dump()},
          {"rng_state", Base64Encode(meta.rng_state)},
          {"extra", meta.extra.dump()}};
}

StatusOr<CheckpointMeta> DecodeCheckpointMeta(const std::map<std::string, std::string>& entries) {
  auto entry = [&](const char* key) -> StatusOr<std::string> {
    const auto it = entries.find(key);
    if (it == entries.end()) {
      return InvalidArgumentError(std::string("its metadata has no '") + key +
                                  "' entry (a version-3 file has param_groups, rng_state and "
                                  "extra): nothing was loaded");
    }
    return it->second;
  };
  CheckpointMeta meta;
  TIERMEM_ASSIGN_OR_RETURN(const std::string groups_text, entry("param_groups"));
  const json groups = json::parse(groups_text, nullptr, /*allow_exceptions=*/false);
  if (groups.is_discarded()) return InvalidArgumentError("its 'param_groups' entry is not JSON");
  TIERMEM_ASSIGN_OR_RETURN(meta.groups, ParseCheckpointGroups(groups));
  TIERMEM_ASSIGN_OR_RETURN(const std::string rng, entry("rng_state"));
  StatusOr<std::string> bytes = Base64Decode(rng);
  if (!bytes.ok()) return bytes.status().WithContext("its 'rng_state' entry");
  meta.rng_state = *std::move(bytes);
  TIERMEM_ASSIGN_OR_RETURN(const std::string extra, entry("extra"));
  meta.extra = json::parse(extra, nullptr, /*allow_exceptions=*/false);
  if (meta.extra.is_discarded()) return InvalidArgumentError("its 'extra' entry is not JSON");
  return meta;
}

StatusOr<CheckpointMeta> ParseLegacyCheckpointMeta(std::string_view binding) {
  if (binding.empty()) return Neither("its binding metadata is empty");
  const json j = json::parse(binding, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Neither("its binding metadata is not a JSON object");
  }
  CheckpointMeta meta;
  if (const auto py = j.find(kLegacyPython); py != j.end()) {
    if (!py->is_object() || !py->contains("param_groups")) {
      return Neither(std::string("its \"") + kLegacyPython + "\" object has no \"param_groups\"");
    }
    TIERMEM_ASSIGN_OR_RETURN(meta.groups, ParseCheckpointGroups(py->at("param_groups")));
    if (const auto rng = py->find("torch_rng"); rng != py->end() && !rng->is_null()) {
      if (!rng->is_string()) return InvalidArgumentError("its \"torch_rng\" is not a string");
      StatusOr<std::string> bytes = Base64Decode(rng->get<std::string>());
      if (!bytes.ok()) return bytes.status().WithContext("its \"torch_rng\"");
      meta.rng_state = *std::move(bytes);
    }
    meta.extra = py->value("extra", json());
    return meta;
  }
  if (const auto groups = j.find("param_groups"); groups != j.end()) {
    TIERMEM_ASSIGN_OR_RETURN(meta.groups, ParseCheckpointGroups(*groups));
    return meta;
  }
  const std::string shown =
      binding.size() <= 80 ? std::string(binding) : std::string(binding.substr(0, 77)) + "...";
  return Neither("its binding metadata " + shown + " has no \"" + kLegacyPython +
                 "\" object and no \"param_groups\" array");
}

Status CheckCheckpointMeta(const CheckpointMeta& meta, const CheckpointLoad& how) {
  if (how.num_groups && meta.groups.size() != *how.num_groups) {
    return InvalidArgumentError("it has " + std::to_string(meta.groups.size()) +
                                " optimizer param groups, the optimizer has " +
                                std::to_string(*how.num_groups) + ": nothing was loaded");
  }
  if (how.rng_state_bytes && !meta.rng_state.empty() &&
      meta.rng_state.size() != *how.rng_state_bytes) {
    return InvalidArgumentError("its RNG state has " + std::to_string(meta.rng_state.size()) +
                                " bytes, this torch's CPU generator state has " +
                                std::to_string(*how.rng_state_bytes) + ": nothing was loaded");
  }
  return OkStatus();
}

}  // namespace tiermem::session
