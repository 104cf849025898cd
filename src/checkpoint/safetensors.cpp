// Our own safetensors writer and validating reader (format in safetensors.h).
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace viaduct::checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; a big-endian host "
              "would need byte swapping");

using nlohmann::json;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};

// The safetensors names LibTorch 1.13 and 2.x can both hold.
constexpr DtypeName kDtypeNames[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},
    {"BF16", at::kBFloat16}, {"I64", at::kLong}, {"I32", at::kInt},
    {"I16", at::kShort}, {"I8", at::kChar}, {"U8", at::kByte},
    {"BOOL", at::kBool},
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  VIADUCT_CHECK(false, "dtype ", c10::toString(dtype),
                " cannot be stored in a safetensors checkpoint");
  return {};
}

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypeNames) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

FileDigest write_safetensors(const std::filesystem::path& path,
                             const NamedTensors& tensors,
                             const StringMap& metadata) {
  struct Item {
    const std::string* name;
    const at::Tensor* tensor;
    size_t elem = 0;
    uint64_t nbytes = 0;
    uint32_t crc = 0;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  std::map<std::string, int> seen;
  for (const auto& [name, t] : tensors) {
    VIADUCT_CHECK(!name.empty() && name != "__metadata__",
                  "cannot save a tensor named '", name, "' to ", path.string());
    VIADUCT_CHECK(seen[name]++ == 0, "tensor '", name, "' is given twice for ",
                  path.string());
    VIADUCT_CHECK(t.defined(), "tensor '", name, "' is undefined (saving ",
                  path.string(), ")");
    dtype_name(t.scalar_type());  // refuses unsupported dtypes early
    const auto elem = static_cast<size_t>(t.element_size());
    items.push_back({&name, &t, elem, static_cast<uint64_t>(t.numel()) * elem, 0});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.elem != b.elem ? a.elem > b.elem : *a.name < *b.name;
  });

  // The header's length does not depend on the CRC values (8 hex digits
  // each), so it is written first with placeholders and rewritten at the
  // end; tensors stream through one CPU copy at a time.
  auto header_text = [&]() {
    json header = json::object();
    json crcs = json::object();
    uint64_t offset = 0;
    for (const auto& it : items) {
      std::vector<int64_t> shape(it.tensor->sizes().begin(),
                                 it.tensor->sizes().end());
      header[*it.name] = {{"dtype", dtype_name(it.tensor->scalar_type())},
                          {"shape", shape},
                          {"data_offsets", {offset, offset + it.nbytes}}};
      crcs[*it.name] = crc32_hex(it.crc);
      offset += it.nbytes;
    }
    json meta = json::object();
    for (const auto& [k, v] : metadata) {
      VIADUCT_CHECK(k != kTensorCrcKey, "metadata key '", k,
                    "' is reserved (saving ", path.string(), ")");
      meta[k] = v;
    }
    if (!items.empty()) meta[kTensorCrcKey] = crcs.dump();
    if (!meta.empty()) header["__metadata__"] = meta;
    std::string text = header.dump();
    // Pad with spaces so the byte buffer starts 8-byte aligned.
    text.append((8 - (8 + text.size()) % 8) % 8, ' ');
    return text;
  };

  const std::string placeholder = header_text();
  const uint64_t n = placeholder.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(n >> (8 * i));

  File f = File::create(path);
  f.write_all(len_bytes, 8);
  f.write_all(placeholder.data(), placeholder.size());
  uint32_t data_crc = 0;
  uint64_t data_bytes = 0;
  for (auto& it : items) {
    if (it.nbytes == 0) continue;
    // [numel] bytes of a contiguous CPU copy (no copy when already so).
    at::Tensor cpu = it.tensor->detach().cpu().contiguous();
    it.crc = crc32(cpu.data_ptr(), it.nbytes);
    f.write_all(cpu.data_ptr(), it.nbytes);
    data_crc = crc32_combine(data_crc, it.crc, it.nbytes);
    data_bytes += it.nbytes;
  }
  const std::string text = header_text();
  VIADUCT_ASSERT(text.size() == n, "safetensors header length changed");
  f.write_at(text.data(), text.size(), 8);
  f.sync();
  f.close();

  FileDigest digest;
  digest.bytes = 8 + n + data_bytes;
  digest.crc32 = crc32_update(crc32(len_bytes, 8), text.data(), text.size());
  digest.crc32 = crc32_combine(digest.crc32, data_crc, data_bytes);
  return digest;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : file_(File::open_read(path)) {
  const std::string where = "safetensors file " + path.string();
  const uint64_t size = file_.size();
  VIADUCT_CHECK_T(FileError, size >= 8, where, " is truncated: ", size,
                  " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  file_.read_at(len_bytes, 8, 0);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len_bytes[i]) << (8 * i);
  VIADUCT_CHECK_T(FileError, n <= kMaxHeaderBytes && n <= size - 8, where,
                  ": header length ", n, " does not fit the file of ", size,
                  " bytes (truncated, or not a safetensors file)");
  std::string text(n, '\0');
  file_.read_at(text.data(), n, 8);
  VIADUCT_CHECK_T(FileError, n > 0 && text[0] == '{', where,
                  ": the header does not start with '{' (not a safetensors "
                  "file, or a corrupt header)");
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    VIADUCT_CHECK_T(FileError, false, where, ": the header is not valid JSON (",
                    e.what(), ")");
  }
  VIADUCT_CHECK_T(FileError, header.is_object(), where,
                  ": the header is not a JSON object");
  data_start_ = 8 + n;
  const uint64_t data_len = size - data_start_;

  std::string crc_text;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      VIADUCT_CHECK_T(FileError, value.is_object(), where,
                      ": __metadata__ is not a JSON object");
      for (const auto& [k, v] : value.items()) {
        VIADUCT_CHECK_T(FileError, v.is_string(), where, ": __metadata__ key '",
                        k, "' is not a string");
        if (k == kTensorCrcKey) {
          crc_text = v.get<std::string>();
        } else {
          metadata_[k] = v.get<std::string>();
        }
      }
      continue;
    }
    const std::string tw = "tensor '" + name + "' in file " + path.string();
    VIADUCT_CHECK_T(FileError, value.is_object(), tw,
                    ": the header entry is not a JSON object");
    for (const auto& [k, v] : value.items()) {
      VIADUCT_CHECK_T(FileError,
                      k == "dtype" || k == "shape" || k == "data_offsets", tw,
                      ": unexpected header field '", k, "'");
    }
    VIADUCT_CHECK_T(FileError,
                    value.contains("dtype") && value["dtype"].is_string(), tw,
                    ": missing or non-string dtype");
    const std::string dname = value["dtype"].get<std::string>();
    auto dtype = dtype_from_name(dname);
    VIADUCT_CHECK_T(FileError, dtype.has_value(), tw, ": unknown dtype '",
                    dname, "'");
    TensorEntry e;
    e.name = name;
    e.dtype = *dtype;
    VIADUCT_CHECK_T(FileError,
                    value.contains("shape") && value["shape"].is_array(), tw,
                    ": missing shape");
    uint64_t nbytes = c10::elementSize(*dtype);
    for (const auto& d : value["shape"]) {
      VIADUCT_CHECK_T(FileError,
                      d.is_number_unsigned() &&
                          d.get<uint64_t>() <= uint64_t(
                              std::numeric_limits<int64_t>::max()),
                      tw, ": shape ", value["shape"].dump(),
                      " is not a list of non-negative integers");
      uint64_t dim = d.get<uint64_t>();
      VIADUCT_CHECK_T(FileError, !__builtin_mul_overflow(nbytes, dim, &nbytes),
                      tw, ": shape ", value["shape"].dump(), " overflows");
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = value.contains("data_offsets") ? value["data_offsets"]
                                                     : json();
    VIADUCT_CHECK_T(FileError,
                    off.is_array() && off.size() == 2 &&
                        off[0].is_number_unsigned() &&
                        off[1].is_number_unsigned(),
                    tw, ": data_offsets ", off.dump(),
                    " is not a pair of non-negative integers");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    VIADUCT_CHECK_T(FileError, e.begin <= e.end, tw, ": data_offsets [",
                    e.begin, ", ", e.end, "] run backwards");
    VIADUCT_CHECK_T(FileError, e.end - e.begin == nbytes, tw, ": shape ",
                    shape_text(e.shape), " × ", dname, " is ", nbytes,
                    " bytes but data_offsets [", e.begin, ", ", e.end,
                    "] span ", e.end - e.begin);
    VIADUCT_CHECK_T(FileError, e.end <= data_len, tw, ": data_offsets [",
                    e.begin, ", ", e.end, "] run past the file's ", data_len,
                    " data bytes (file truncated?)");
    entries_.emplace(name, std::move(e));
  }

  // No overlaps, no holes: sorted ranges tile [0, data_len).
  std::vector<const TensorEntry*> order;
  for (const auto& [name, e] : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  const TensorEntry* prev = nullptr;
  for (const auto* e : order) {
    VIADUCT_CHECK_T(FileError, e->begin >= cursor, "tensors '",
                    prev ? prev->name : "", "' and '", e->name, "' in file ",
                    path.string(), " overlap (bytes [", e->begin, ", ",
                    cursor, "))");
    VIADUCT_CHECK_T(FileError, e->begin == cursor, "file ", path.string(),
                    ": bytes [", cursor, ", ", e->begin,
                    ") before tensor '", e->name,
                    "' belong to no tensor (corrupt header)");
    cursor = e->end;
    prev = e;
  }
  VIADUCT_CHECK_T(FileError, cursor == data_len, "file ", path.string(),
                  ": ", data_len - cursor, " bytes after ",
                  prev ? "tensor '" + prev->name + "'" : std::string("the header"),
                  " belong to no tensor (corrupt header)");

  if (!crc_text.empty()) {
    json crcs;
    try {
      crcs = json::parse(crc_text);
    } catch (const json::exception& e) {
      VIADUCT_CHECK_T(FileError, false, where, ": __metadata__ ",
                      kTensorCrcKey, " is not valid JSON (", e.what(), ")");
    }
    VIADUCT_CHECK_T(FileError, crcs.is_object(), where, ": __metadata__ ",
                    kTensorCrcKey, " is not a JSON object");
    for (const auto& [name, v] : crcs.items()) {
      auto it = entries_.find(name);
      VIADUCT_CHECK_T(FileError, it != entries_.end() && v.is_string() &&
                                     v.get<std::string>().size() == 8,
                      "tensor '", name, "' in file ", path.string(),
                      ": bad checksum record in the header");
      it->second.crc32 = parse_crc32_hex(
          v.get<std::string>(), "tensor '" + name + "' in file " + path.string());
    }
  }
}

const TensorEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  VIADUCT_CHECK_T(FileError, it != entries_.end(), "tensor '", name,
                  "' not found in file ", path().string());
  return it->second;
}

void SafetensorsFile::read_into(const TensorEntry& e, void* dst,
                                bool verify_checksum) const {
  if (e.nbytes() == 0) return;
  try {
    file_.read_at(dst, e.nbytes(), data_start_ + e.begin);
  } catch (const FileError& err) {
    VIADUCT_CHECK_T(FileError, false, "tensor '", e.name, "' in file ",
                    path().string(), ": ", err.what());
  }
  if (verify_checksum && e.crc32) {
    uint32_t got = crc32(dst, e.nbytes());
    VIADUCT_CHECK_T(FileError, got == *e.crc32, "tensor '", e.name,
                    "' in file ", path().string(),
                    ": checksum mismatch (stored crc32 ", crc32_hex(*e.crc32),
                    ", data has ", crc32_hex(got), "): the data is corrupt");
  }
}

void SafetensorsFile::read_range_into(const TensorEntry& e, uint64_t lo, uint64_t hi, void* dst,
                                      bool verify_checksum) const {
  VIADUCT_CHECK(lo <= hi && hi <= e.nbytes(), "tensor '", e.name, "': bytes [", lo, ", ", hi,
                ") are outside its ", e.nbytes());
  if (lo == 0 && hi == e.nbytes()) {
    read_into(e, dst, verify_checksum);
    return;
  }
  auto read = [&](void* to, uint64_t n, uint64_t at) {
    try {
      file_.read_at(to, n, data_start_ + e.begin + at);
    } catch (const FileError& err) {
      VIADUCT_CHECK_T(FileError, false, "tensor '", e.name, "' in file ", path().string(), ": ",
                      err.what());
    }
  };
  auto* out = static_cast<char*>(dst);
  if (!verify_checksum || !e.crc32) {
    if (hi > lo) read(out, hi - lo, lo);
    return;
  }
  std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(uint64_t{8} << 20, e.nbytes())));
  uint32_t c = 0;
  for (uint64_t off = 0; off < e.nbytes();) {
    const auto n = std::min<uint64_t>(buf.size(), e.nbytes() - off);
    read(buf.data(), n, off);
    c = crc32_update(c, buf.data(), static_cast<size_t>(n));
    const uint64_t a = std::max(off, lo), b = std::min(off + n, hi);
    if (a < b) std::memcpy(out + (a - lo), buf.data() + (a - off), static_cast<size_t>(b - a));
    off += n;
  }
  VIADUCT_CHECK_T(FileError, c == *e.crc32, "tensor '", e.name, "' in file ", path().string(),
                  ": checksum mismatch (stored crc32 ", crc32_hex(*e.crc32), ", data has ",
                  crc32_hex(c), "): the data is corrupt");
}

at::Tensor SafetensorsFile::read(const std::string& name,
                                 bool verify_checksum) const {
  const TensorEntry& e = entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read_into(e, t.data_ptr(), verify_checksum);
  return t;
}

std::vector<std::string> SafetensorsFile::damaged_tensors() const {
  std::vector<std::string> damaged;
  std::vector<char> buf(size_t{8} << 20);
  for (const auto& [name, e] : entries_) {
    if (!e.crc32) continue;
    uint32_t c = 0;
    for (uint64_t off = 0; off < e.nbytes();) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), e.nbytes() - off));
      file_.read_at(buf.data(), n, data_start_ + e.begin + off);
      c = crc32_update(c, buf.data(), n);
      off += n;
    }
    if (c != *e.crc32) damaged.push_back(name);
  }
  return damaged;
}

}  // namespace viaduct::checkpoint
