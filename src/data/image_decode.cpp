// PNG through libpng's simplified API, JPEG through libjpeg(-turbo) with its
// errors and warnings turned into ImageError, WebP through libwebp; and the
// separable triangle-filter resize.
#include "data/image_decode.h"

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#ifdef VIADUCT_WITH_PNG
#include <png.h>
#endif
#ifdef VIADUCT_WITH_JPEG
#include <jpeglib.h>
#endif
#ifdef VIADUCT_WITH_WEBP
#include <webp/decode.h>
#endif

namespace viaduct::data {
namespace {

// Pixel counts past this are refused before any allocation (a header can
// claim anything).
constexpr int64_t kMaxPixels = int64_t{1} << 28;

void check_dims(int64_t w, int64_t h, const char* kind) {
  if (w <= 0 || h <= 0) throw ImageError(str(kind, " of zero size (", w, " x ", h, ")"));
  if (w * h > kMaxPixels) {
    throw ImageError(str(kind, " of ", w, " x ", h, " pixels is larger than viaduct takes (",
                         kMaxPixels, " pixels)"));
  }
}

// A format whose library this build was made without.
[[maybe_unused]] RgbImage not_built(const char* kind, const char* package) {
  throw ImageError(str(kind, " image, but this viaduct was built without ", package,
                       " (install it and build again)"));
}

#ifdef VIADUCT_WITH_PNG
RgbImage decode_png(const uint8_t* data, size_t size) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, data, size)) {
    throw ImageError(str("corrupt PNG: ", image.message));
  }
  image.format = PNG_FORMAT_RGB;
  RgbImage out;
  out.width = image.width;
  out.height = image.height;
  try {
    check_dims(out.width, out.height, "PNG");
  } catch (...) {
    png_image_free(&image);
    throw;
  }
  out.pixels.resize(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, out.pixels.data(), 0, nullptr)) {
    const std::string why = image.message;
    png_image_free(&image);
    throw ImageError(str("corrupt or truncated PNG: ", why));
  }
  // A PNG whose data ends early still decodes in part with a warning.
  if (image.warning_or_error != 0) {
    const std::string why = image.message;
    png_image_free(&image);
    throw ImageError(str("damaged PNG: ", why));
  }
  png_image_free(&image);
  return out;
}
#else
RgbImage decode_png(const uint8_t*, size_t) { return not_built("PNG", "libpng-dev"); }
#endif

#ifdef VIADUCT_WITH_JPEG
// libjpeg reports errors through a callback that must not return: jump
// back to the decode with the message.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool warned = false;
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings (a cut-short file: "Premature end of JPEG file") leave grey
// pixels behind: the image is corrupt.
void jpeg_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  if (level < 0 && !err->warned) {
    err->warned = true;
    (*cinfo->err->format_message)(cinfo, err->message);
  }
}

RgbImage decode_jpeg(const uint8_t* data, size_t size) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_message;
  err.message[0] = '\0';
  RgbImage out;
  // Nothing with a destructor may be created between setjmp and the jump.
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw ImageError(str("corrupt JPEG: ", err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const int64_t w = cinfo.output_width, h = cinfo.output_height;
  if (w <= 0 || h <= 0 || w * h > kMaxPixels || cinfo.output_components != 3) {
    jpeg_destroy_decompress(&cinfo);
    check_dims(w, h, "JPEG");
    throw ImageError(str("JPEG decodes to ", cinfo.output_components, " channels, not RGB"));
  }
  out.width = w;
  out.height = h;
  out.pixels.resize(static_cast<size_t>(w * h * 3));
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out.pixels.data() + static_cast<size_t>(cinfo.output_scanline) * w * 3;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (err.warned) throw ImageError(str("damaged JPEG: ", err.message));
  return out;
}
#else
RgbImage decode_jpeg(const uint8_t*, size_t) { return not_built("JPEG", "libjpeg-dev"); }
#endif

#ifdef VIADUCT_WITH_WEBP
RgbImage decode_webp(const uint8_t* data, size_t size) {
  int w = 0, h = 0;
  if (!WebPGetInfo(data, size, &w, &h)) throw ImageError("corrupt WebP header");
  check_dims(w, h, "WebP");
  RgbImage out;
  out.width = w;
  out.height = h;
  out.pixels.resize(static_cast<size_t>(w) * h * 3);
  if (!WebPDecodeRGBInto(data, size, out.pixels.data(), out.pixels.size(), w * 3)) {
    throw ImageError("corrupt or truncated WebP");
  }
  return out;
}
#else
RgbImage decode_webp(const uint8_t*, size_t) { return not_built("WebP", "libwebp-dev"); }
#endif

// Source taps and weights of each output position of a 1-D resample from n
// to m samples; `offset` shifts the output grid (a crop).
struct Taps {
  std::vector<int64_t> first;
  std::vector<std::vector<float>> weights;
};

Taps triangle_taps(int64_t n, int64_t m) {
  const double scale = static_cast<double>(m) / static_cast<double>(n);
  const double support = std::max(1.0, 1.0 / scale);
  Taps t;
  for (int64_t i = 0; i < m; ++i) {
    const double c = (static_cast<double>(i) + 0.5) / scale - 0.5;
    const auto lo = std::max<int64_t>(0, static_cast<int64_t>(std::floor(c - support)));
    const auto hi = std::min<int64_t>(n - 1, static_cast<int64_t>(std::ceil(c + support)));
    std::vector<float> w;
    double sum = 0;
    for (int64_t j = lo; j <= hi; ++j) {
      const double v = std::max(0.0, 1.0 - std::abs(static_cast<double>(j) - c) / support);
      w.push_back(static_cast<float>(v));
      sum += v;
    }
    if (sum <= 0) {  // cannot happen with support >= 1; keep the nearest
      w.assign(w.size(), 0.f);
      w[static_cast<size_t>(std::clamp<int64_t>(std::llround(c), lo, hi) - lo)] = 1.f;
      sum = 1;
    }
    for (auto& v : w) v = static_cast<float>(v / sum);
    t.first.push_back(lo);
    t.weights.push_back(std::move(w));
  }
  return t;
}

// [h, w, 3] uint8 -> [rh, rw, 3] float.
std::vector<float> resample(const RgbImage& im, int64_t rh, int64_t rw) {
  const int64_t w = im.width, h = im.height;
  const Taps tx = triangle_taps(w, rw), ty = triangle_taps(h, rh);
  std::vector<float> rows(static_cast<size_t>(h * rw * 3));  // [h, rw, 3]
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < rw; ++x) {
      const auto& wx = tx.weights[static_cast<size_t>(x)];
      for (int64_t c = 0; c < 3; ++c) {
        float acc = 0;
        for (size_t k = 0; k < wx.size(); ++k) {
          acc += wx[k] * im.pixels[static_cast<size_t>(
                             (y * w + tx.first[static_cast<size_t>(x)] + static_cast<int64_t>(k)) * 3 + c)];
        }
        rows[static_cast<size_t>((y * rw + x) * 3 + c)] = acc;
      }
    }
  }
  std::vector<float> out(static_cast<size_t>(rh * rw * 3));
  for (int64_t y = 0; y < rh; ++y) {
    const auto& wy = ty.weights[static_cast<size_t>(y)];
    const int64_t y0 = ty.first[static_cast<size_t>(y)];
    for (int64_t x = 0; x < rw * 3; ++x) {
      float acc = 0;
      for (size_t k = 0; k < wy.size(); ++k) {
        acc += wy[k] * rows[static_cast<size_t>((y0 + static_cast<int64_t>(k)) * rw * 3 + x)];
      }
      out[static_cast<size_t>(y * rw * 3 + x)] = acc;
    }
  }
  return out;
}

uint8_t to_byte(float v) {
  return static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L));
}

}  // namespace

ImageKind sniff_image(const uint8_t* d, size_t n) {
  static const uint8_t kPngSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (n >= 8 && std::memcmp(d, kPngSig, 8) == 0) return ImageKind::kPng;
  if (n >= 3 && d[0] == 0xff && d[1] == 0xd8 && d[2] == 0xff) return ImageKind::kJpeg;
  if (n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0) {
    return ImageKind::kWebp;
  }
  return ImageKind::kUnknown;
}

const char* image_kind_name(ImageKind kind) {
  switch (kind) {
    case ImageKind::kPng: return "PNG";
    case ImageKind::kJpeg: return "JPEG";
    case ImageKind::kWebp: return "WebP";
    default: return "unknown";
  }
}

RgbImage decode_image(const uint8_t* data, size_t size) {
  if (size == 0) throw ImageError("empty file (zero bytes)");
  switch (sniff_image(data, size)) {
    case ImageKind::kPng: return decode_png(data, size);
    case ImageKind::kJpeg: return decode_jpeg(data, size);
    case ImageKind::kWebp: return decode_webp(data, size);
    default: throw ImageError("not an image (no PNG, JPEG or WebP signature)");
  }
}

std::vector<uint8_t> fit_image(const RgbImage& im, int64_t S, ImageFit fit) {
  VIADUCT_CHECK(S >= 1 && im.width >= 1 && im.height >= 1 &&
                    static_cast<int64_t>(im.pixels.size()) == im.width * im.height * 3,
                "fit_image: bad image ", im.width, " x ", im.height, " to ", S);
  const double w = static_cast<double>(im.width), h = static_cast<double>(im.height);
  const double scale = static_cast<double>(S) /
                       (fit == ImageFit::kCrop ? std::min(w, h) : std::max(w, h));
  // The scaled size: the fitted side exactly S, the other rounded (>= 1).
  auto side = [&](int64_t n) {
    return std::max<int64_t>(1, std::llround(static_cast<double>(n) * scale));
  };
  int64_t rw = side(im.width), rh = side(im.height);
  if (fit == ImageFit::kCrop) {
    rw = std::max(rw, S);
    rh = std::max(rh, S);
  } else {
    rw = std::min(rw, S);
    rh = std::min(rh, S);
  }
  const auto scaled = resample(im, rh, rw);  // [rh, rw, 3]
  std::vector<uint8_t> out(static_cast<size_t>(3 * S * S), 0);  // [3, S, S]
  for (int64_t y = 0; y < S; ++y) {
    for (int64_t x = 0; x < S; ++x) {
      // crop: the middle S x S of the scaled image; pad: the scaled image in
      // the middle of the square.
      const int64_t sy = fit == ImageFit::kCrop ? y + (rh - S) / 2 : y - (S - rh) / 2;
      const int64_t sx = fit == ImageFit::kCrop ? x + (rw - S) / 2 : x - (S - rw) / 2;
      if (sy < 0 || sy >= rh || sx < 0 || sx >= rw) continue;
      for (int64_t c = 0; c < 3; ++c) {
        out[static_cast<size_t>((c * S + y) * S + x)] =
            to_byte(scaled[static_cast<size_t>((sy * rw + sx) * 3 + c)]);
      }
    }
  }
  return out;
}

}  // namespace viaduct::data
