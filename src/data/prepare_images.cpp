// prepare-images: the tar, JSONL and IDX readers, the decode on worker
// threads, the atomic write and the manifest (see prepare_images.h).
#include "data/prepare_images.h"

#include <zlib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"
#include "data/image_text_file.h"
#include "data/prepare.h"
#include "data/text_tokenizer.h"
#include "data/token_file.h"

namespace viaduct::data {
namespace fs = std::filesystem;

namespace {

constexpr size_t kChunk = 512;  // samples decoded together

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string read_whole(const std::string& path) {
  std::string data;
  File f = File::open_read(path);
  data.resize(f.size());
  if (!data.empty()) f.read_at(data.data(), data.size(), 0);
  return data;
}

// A tar header's octal number field (NUL- or space-terminated).
int64_t octal(const uint8_t* p, size_t n, bool& ok) {
  int64_t v = 0;
  size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) v = v * 8 + (p[i] - '0');
  ok = i == n || p[i] == ' ' || p[i] == '\0';
  return v;
}

// A tar header's size field: octal, or GNU's base-256 form (the first byte's
// high bit set, then a big-endian number) that tar writers use past 8 GiB.
int64_t size_field(const uint8_t* p, bool& ok) {
  if ((p[0] & 0x80) == 0) return octal(p, 12, ok);
  ok = (p[0] & 0x40) == 0;  // negative sizes do not exist
  uint64_t v = p[0] & 0x3f;
  for (size_t i = 1; i < 12 && ok; ++i) {
    ok = v < (uint64_t{1} << 55);
    v = (v << 8) | p[i];
  }
  ok = ok && v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  return static_cast<int64_t>(v);
}

// The records of a pax extended header ("LENGTH key=value\n", LENGTH counting
// the whole record) that matter to a reader of samples: `path`, the next
// entry's full name (long or non-ASCII names), and `size`, its data's size.
struct PaxRecords {
  std::string path;
  int64_t size = -1;
};
PaxRecords parse_pax(const uint8_t* p, size_t n, const std::string& shard, size_t at) {
  PaxRecords r;
  size_t i = 0;
  while (i < n && p[i] != '\0') {
    size_t len = 0, j = i;
    for (; j < n && j - i < 19 && p[j] >= '0' && p[j] <= '9'; ++j) len = len * 10 + (p[j] - '0');
    const size_t eq = j + 1;
    size_t k = eq;
    while (k < i + len && k < n && p[k] != '=') ++k;
    VIADUCT_CHECK_T(FileError, j > i && j < n && p[j] == ' ' && len > 0 && i + len <= n &&
                                   p[i + len - 1] == '\n' && k < i + len - 1,
                    "tar shard '", shard, "': a malformed pax record in the header at byte ", at);
    const std::string key(reinterpret_cast<const char*>(p + eq), k - eq);
    const std::string value(reinterpret_cast<const char*>(p + k + 1), i + len - 1 - (k + 1));
    if (key == "path") {
      r.path = value;
    } else if (key == "size") {
      const bool digits = !value.empty() && value.size() < 19 &&
                          std::all_of(value.begin(), value.end(),
                                      [](char c) { return c >= '0' && c <= '9'; });
      VIADUCT_CHECK_T(FileError, digits, "tar shard '", shard, "': pax size \"", value,
                      "\" in the header at byte ", at, " is not a size");
      r.size = std::stoll(value);
    }
    i += len;
  }
  return r;
}

std::string field(const uint8_t* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), strnlen(reinterpret_cast<const char*>(p), n));
}

uint32_t big_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

std::string read_maybe_gzip(const std::string& path) {
  return path.ends_with(".gz") ? read_gzip(path) : read_whole(path);
}

uint32_t file_crc32(const std::string& path, int64_t& bytes) {
  File f = File::open_read(path);
  const uint64_t size = f.size();
  std::vector<unsigned char> buf(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  for (uint64_t at = 0; at < size;) {
    const auto n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - at));
    f.read_at(buf.data(), n, at);
    crc = crc32(crc, buf.data(), static_cast<uInt>(n));
    at += n;
  }
  bytes += static_cast<int64_t>(size);
  return static_cast<uint32_t>(crc);
}

}  // namespace

// ------------------------------------------------------------------ readers

std::vector<RawSample> read_tar_samples(const std::string& path, const std::string& json_field) {
  // A gzip-compressed shard (.tar.gz, .tgz) is inflated into memory whole;
  // a plain one is mapped.
  const bool gzipped = path.ends_with(".tar.gz") || path.ends_with(".tgz");
  std::optional<MappedFile> map;
  std::string inflated;
  if (gzipped) {
    inflated = read_gzip(path);
  } else {
    map.emplace(path);
  }
  const uint8_t* d = gzipped ? reinterpret_cast<const uint8_t*>(inflated.data()) : map->data();
  const size_t size = gzipped ? inflated.size() : map->size();
  struct Parts {
    std::string image, caption, problem, caption_problem;
    bool has_image = false, has_caption = false;
  };
  std::vector<std::string> order;  // keys in first-seen order
  std::map<std::string, Parts> parts;
  auto part = [&](const std::string& key) -> Parts& {
    auto it = parts.find(key);
    if (it == parts.end()) {
      order.push_back(key);
      it = parts.emplace(key, Parts{}).first;
    }
    return it->second;
  };
  std::string long_name;  // a GNU long-name entry names the next one
  PaxRecords pax;         // a pax extended header renames or resizes the next one
  size_t at = 0;
  while (true) {
    if (at + 512 > size) {
      VIADUCT_CHECK_T(FileError, at > 0, "'", path, "' is not a tar file (", size,
                      " bytes, shorter than one header)");
      if (at < size) log::warn("tar shard '", path, "': ", size - at,
                               " stray bytes after the last entry (truncated header?)");
      break;
    }
    const uint8_t* h = d + at;
    if (std::all_of(h, h + 512, [](uint8_t b) { return b == 0; })) break;  // end blocks
    bool ok_sum = false, ok_size = false;
    const int64_t sum = octal(h + 148, 8, ok_sum);
    int64_t computed = 0;
    for (size_t i = 0; i < 512; ++i) computed += (i >= 148 && i < 156) ? ' ' : h[i];
    VIADUCT_CHECK_T(FileError, ok_sum && sum == computed, "'", path,
                    "' is not a tar file (bad header checksum at byte ", at, ")");
    int64_t entry_size = size_field(h + 124, ok_size);
    VIADUCT_CHECK_T(FileError, ok_size, "tar shard '", path, "': bad size field at byte ", at);
    const char type = static_cast<char>(h[156]);
    const bool extension = type == 'L' || type == 'K' || type == 'x' || type == 'g';
    std::string name = field(h, 100);
    if (std::memcmp(h + 257, "ustar", 5) == 0) {
      const std::string prefix = field(h + 345, 155);
      if (!prefix.empty()) name = prefix + "/" + name;
    }
    if (!extension) {  // the names and sizes the headers before it gave this entry
      if (!long_name.empty()) name = long_name;
      if (!pax.path.empty()) name = pax.path;
      if (pax.size >= 0) entry_size = pax.size;
      long_name.clear();
      pax = PaxRecords{};
    }
    const size_t data_at = at + 512;
    const auto padded = static_cast<size_t>((entry_size + 511) / 512 * 512);
    const bool truncated = data_at + static_cast<size_t>(entry_size) > size;
    if (type == 'L') {  // GNU long name for the next entry
      VIADUCT_CHECK_T(FileError, !truncated, "tar shard '", path, "' is truncated at byte ", at);
      long_name = field(d + data_at, static_cast<size_t>(entry_size));
      at = data_at + padded;
      continue;
    }
    if (type == 'x') {  // pax extended header for the next entry
      VIADUCT_CHECK_T(FileError, !truncated, "tar shard '", path, "' is truncated at byte ", at);
      pax = parse_pax(d + data_at, static_cast<size_t>(entry_size), path, at);
      at = data_at + padded;
      continue;
    }
    if (type == '0' || type == '\0') {
      const std::string base = fs::path(name).filename().string();
      const auto dot = base.find('.');
      const std::string dir = fs::path(name).parent_path().string();
      const std::string key = (dir.empty() ? "" : dir + "/") + base.substr(0, dot);
      const std::string ext = dot == std::string::npos ? "" : lower(base.substr(dot + 1));
      Parts& p = part(key);
      if (truncated) {
        p.problem = str("the tar shard is truncated inside ", name, " (", entry_size,
                        " bytes declared, ", size - std::min(size, data_at), " left)");
        break;
      }
      const std::string body(reinterpret_cast<const char*>(d + data_at),
                             static_cast<size_t>(entry_size));
      if (ext == "jpg" || ext == "jpeg" || ext == "png" || ext == "webp") {
        if (!p.has_image) p.image = body;
        p.has_image = true;
      } else if (ext == "txt") {
        p.caption = body;
        p.has_caption = true;
      } else if (ext == "json") {
        try {
          const auto j = nlohmann::json::parse(body);
          if (j.is_object() && j.contains(json_field) && j[json_field].is_string()) {
            p.caption = j[json_field].get<std::string>();
            p.has_caption = true;
          } else {
            p.caption_problem = str(name, " has no string field \"", json_field, "\"");
          }
        } catch (const nlohmann::json::exception& e) {
          p.caption_problem = str(name, " is not JSON: ", e.what());
        }
      }
      at = data_at + padded;
      continue;
    }
    // Directories, links, GNU long link names, pax global headers (archive
    // comments such as git's commit id; a global path or size would make no
    // sense for many entries): no sample data.
    VIADUCT_CHECK_T(FileError, !truncated, "tar shard '", path, "' is truncated at byte ", at);
    at = data_at + padded;
  }
  std::vector<RawSample> out;
  for (const auto& key : order) {
    Parts& p = parts[key];
    RawSample s;
    s.file = path;
    s.key = key;
    s.image = std::move(p.image);
    s.caption = std::move(p.caption);
    if (!p.problem.empty()) {
      s.problem = p.problem;
    } else if (!p.has_image) {
      s.problem = "no image (KEY.jpg, .jpeg, .png or .webp)";
    } else if (!p.has_caption) {
      s.problem = p.caption_problem.empty()
                      ? str("no caption (KEY.txt, or KEY.json with \"", json_field, "\")")
                      : p.caption_problem;
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<RawSample> read_jsonl_samples(const std::string& path) {
  const std::string text = read_whole(path);
  const fs::path folder = fs::path(path).parent_path();
  std::vector<RawSample> out;
  size_t start = 0;
  int64_t line_no = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = trim(text.substr(start, end - start));
    start = end + 1;
    ++line_no;
    if (line.empty()) continue;
    RawSample s;
    s.file = path;
    s.key = str("line ", line_no);
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.is_object() || !j.contains("image") || !j["image"].is_string()) {
        s.problem = "no string field \"image\"";
      } else {
        const fs::path img = j["image"].get<std::string>();
        s.image_path = (img.is_absolute() ? img : folder / img).string();
        s.key = str("line ", line_no, " (", img.string(), ")");
        if (!j.contains("text") || !j["text"].is_string()) {
          s.problem = "no caption (string field \"text\")";
        } else {
          s.caption = j["text"].get<std::string>();
        }
      }
    } catch (const nlohmann::json::exception& e) {
      s.problem = str("not a JSON object: ", e.what());
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<RawSample> read_idx_samples(const std::string& images, const std::string& labels,
                                        const std::string& caption_template,
                                        const std::vector<std::string>& names) {
  const std::string im = read_maybe_gzip(images), lb = read_maybe_gzip(labels);
  const auto* ip = reinterpret_cast<const uint8_t*>(im.data());
  const auto* lp = reinterpret_cast<const uint8_t*>(lb.data());
  VIADUCT_CHECK_T(FileError, im.size() >= 16 && big_u32(ip) == 0x803, "'", images,
                  "' is not an IDX image file (magic 2051: uint8, 3 dimensions)");
  VIADUCT_CHECK_T(FileError, lb.size() >= 8 && big_u32(lp) == 0x801, "'", labels,
                  "' is not an IDX label file (magic 2049: uint8, 1 dimension)");
  const int64_t n = big_u32(ip + 4), h = big_u32(ip + 8), w = big_u32(ip + 12);
  const int64_t nl = big_u32(lp + 4);
  VIADUCT_CHECK_T(FileError, static_cast<int64_t>(im.size()) == 16 + n * h * w, "IDX image file '",
                  images, "' is ", im.size(), " bytes, but its header (", n, " images of ", h,
                  " x ", w, ") needs ", 16 + n * h * w, " (truncated?)");
  VIADUCT_CHECK_T(FileError, static_cast<int64_t>(lb.size()) == 8 + nl, "IDX label file '", labels,
                  "' is ", lb.size(), " bytes, but its header (", nl, " labels) needs ", 8 + nl);
  VIADUCT_CHECK_T(FileError, n == nl, "'", images, "' holds ", n, " images but '", labels,
                  "' ", nl, " labels");
  VIADUCT_CHECK_T(ConfigError, caption_template.find("{label}") != std::string::npos,
                  "--caption '", caption_template, "' has no {label}");
  std::vector<RawSample> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    RawSample& s = out[static_cast<size_t>(i)];
    s.file = images;
    s.key = str("image ", i);
    s.grey_width = w;
    s.grey_height = h;
    s.image.assign(im.data() + 16 + i * h * w, static_cast<size_t>(h * w));
    const uint8_t label = lp[8 + i];
    if (label >= names.size()) {
      s.problem = str("label ", int{label}, " has no name (--labels gives ", names.size(), ")");
      continue;
    }
    s.caption = caption_template;
    s.caption.replace(s.caption.find("{label}"), 7, names[label]);
  }
  return out;
}

// ------------------------------------------------------------------ driver

PrepareImagesStats prepare_images(const std::vector<ImageInput>& inputs,
                                  const std::string& output,
                                  const PrepareImagesOptions& o) {
  VIADUCT_CHECK_T(ConfigError, !inputs.empty(), "prepare-images: no input");
  VIADUCT_CHECK_T(ConfigError, o.image_size >= 1 && o.image_size <= 4096,
                  "--image-size must be in [1, 4096], got ", o.image_size);
  const auto t0 = std::chrono::steady_clock::now();
  const auto tokenizer = load_tokenizer(o.tokenizer);
  const int64_t end_token = tokenizer->document_marker().token;
  const int threads = o.threads > 0 ? o.threads
                                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (const auto& in : inputs) {
    for (const auto& p : {in.path, in.labels_path}) {
      if (p.empty()) continue;
      VIADUCT_CHECK_T(FileError, fs::exists(p), "prepare-images: input '", p, "' does not exist");
      VIADUCT_CHECK_T(FileError, fs::weakly_canonical(p) != fs::weakly_canonical(output),
                      "prepare-images: the output '", output, "' is one of the inputs");
    }
  }
  PrepareImagesStats stats;
  const int64_t S = o.image_size;
  ImageTextWriter writer(output, 3, S, tokenizer->vocab_size(), tokenizer->name());
  nlohmann::json sources = nlohmann::json::array();
  for (const auto& in : inputs) {
    std::vector<RawSample> samples;
    switch (in.kind) {
      case ImageInput::Kind::kTar: samples = read_tar_samples(in.path, o.json_field); break;
      case ImageInput::Kind::kJsonl: samples = read_jsonl_samples(in.path); break;
      case ImageInput::Kind::kIdx:
        samples = read_idx_samples(in.path, in.labels_path, o.caption_template, o.labels);
        break;
    }
    for (const auto& p : {in.path, in.labels_path}) {
      if (p.empty()) continue;
      int64_t bytes = 0;
      const uint32_t crc = file_crc32(p, bytes);
      stats.bytes_read += bytes;
      char hex[9];
      std::snprintf(hex, sizeof(hex), "%08x", crc);
      sources.push_back({{"path", p}, {"bytes", bytes}, {"crc32", hex}});
    }
    // Decode in chunks on worker threads; append in input order.
    for (size_t c0 = 0; c0 < samples.size(); c0 += kChunk) {
      const size_t c1 = std::min(samples.size(), c0 + kChunk);
      std::vector<std::vector<uint8_t>> pixels(c1 - c0);
      std::vector<std::vector<int64_t>> captions(c1 - c0);
      std::vector<std::thread> pool;
      const size_t nt = std::min<size_t>(static_cast<size_t>(threads), c1 - c0);
      for (size_t t = 0; t < nt; ++t) {
        pool.emplace_back([&, t] {
          auto state = tokenizer->new_state();
          for (size_t i = c0 + t; i < c1; i += nt) {
            RawSample& s = samples[i];
            if (!s.problem.empty()) continue;
            try {
              const std::string caption = trim(s.caption);
              if (caption.empty()) {
                s.problem = "empty caption";
                continue;
              }
              RgbImage rgb;
              if (s.grey_width > 0) {
                rgb.width = s.grey_width;
                rgb.height = s.grey_height;
                rgb.pixels.resize(s.image.size() * 3);
                for (size_t k = 0; k < s.image.size(); ++k) {
                  std::fill_n(rgb.pixels.begin() + static_cast<std::ptrdiff_t>(3 * k), 3,
                              static_cast<uint8_t>(s.image[k]));
                }
              } else {
                if (!s.image_path.empty()) s.image = read_whole(s.image_path);
                rgb = decode_image(reinterpret_cast<const uint8_t*>(s.image.data()),
                                   s.image.size());
              }
              pixels[i - c0] = fit_image(rgb, S, o.fit);
              auto& ids = captions[i - c0];
              tokenizer->encode_into(caption, false, ids, *state);
              ids.push_back(end_token);
            } catch (const Error& e) {
              s.problem = e.what();
            }
            std::string().swap(s.image);
          }
        });
      }
      for (auto& th : pool) th.join();
      for (size_t i = c0; i < c1; ++i) {
        RawSample& s = samples[i];
        if (!s.problem.empty()) {
          VIADUCT_CHECK_T(FileError, !o.strict, s.file, ": ", s.key, ": ", s.problem,
                          " (--strict: nothing was written)");
          log::warn(s.file, ": ", s.key, ": ", s.problem, "; skipped");
          stats.problems.push_back({s.file, s.key, s.problem});
          ++stats.skipped;
          continue;
        }
        stats.caption_tokens += static_cast<int64_t>(captions[i - c0].size());
        writer.append(pixels[i - c0].data(), captions[i - c0]);
      }
    }
  }
  VIADUCT_CHECK_T(FileError, writer.records() > 0, "prepare-images: no usable sample in the ",
                  inputs.size(), " input(s) (", stats.skipped,
                  " skipped); nothing was written");
  stats.records = writer.records();
  stats.bytes_written = writer.finish();
  nlohmann::json skipped = nlohmann::json::array();
  for (const auto& p : stats.problems) {
    skipped.push_back({{"file", p.file}, {"key", p.key}, {"reason", p.reason}});
  }
  const nlohmann::json manifest = {
      {"format", "viaduct image-text 1"},
      {"file", fs::path(output).filename().string()},
      {"records", stats.records},
      {"channels", 3},
      {"image_size", S},
      {"fit", o.fit == ImageFit::kCrop ? "crop" : "pad"},
      {"caption_tokens", stats.caption_tokens},
      {"tokenizer", tokenizer->name()},
      {"vocab_size", tokenizer->vocab_size()},
      {"bytes", stats.bytes_written},
      {"skipped", stats.skipped},
      {"skipped_samples", skipped},
      {"sources", sources}};
  stats.manifest_path = output + ".json";
  atomic_write_file(stats.manifest_path, manifest.dump(2) + "\n");
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace viaduct::data
