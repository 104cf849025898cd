// Image decoding through Debian's libraries (libpng, libjpeg-turbo,
// libwebp) and the resize to the vision tower's square. Only `viaduct
// prepare-images` links this; the trainer reads decoded images from
// image-text files (image_text_file.h) and needs none of these libraries.
// A build without one of them refuses that format (an ImageError naming
// the package to install).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"

namespace viaduct::data {

// An image that is not one, or is cut short or corrupt. prepare-images
// reports it with its file and key and skips it (or stops, with --strict).
class ImageError : public Error {
 public:
  using Error::Error;
};

enum class ImageKind { kUnknown, kPng, kJpeg, kWebp };

// By the leading bytes (the signature), never by the file name.
ImageKind sniff_image(const uint8_t* data, size_t size);
const char* image_kind_name(ImageKind kind);

// Decoded pixels: [height, width, 3] RGB, row-major. Grey images are
// spread over the three channels; an alpha channel is dropped (PNG: the
// colour composited over black, as libpng's simplified API does it).
struct RgbImage {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> pixels;
};

// Throws ImageError saying what is wrong: not a PNG, JPEG or WebP, zero
// size, truncated, corrupt (a JPEG decoder warning counts as corrupt).
RgbImage decode_image(const uint8_t* data, size_t size);

// How a non-square image becomes a square: scale its shorter side to the
// square and cut the middle (kCrop), or scale its longer side and put it in
// the middle of a black square (kPad).
enum class ImageFit { kCrop, kPad };

// The image scaled to size x size with a triangle (bilinear) filter whose
// support widens with the down-scale factor, so a reduction averages every
// source pixel; an image already of that size is copied exactly.
// Returns [3, size, size] uint8, channel-major (what the tower reads).
std::vector<uint8_t> fit_image(const RgbImage& image, int64_t size, ImageFit fit);

}  // namespace viaduct::data
