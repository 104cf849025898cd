#!/usr/bin/env python3
"""Writes the image fixtures of tests/data/test_prepare_images.cpp with
independent encoders: Pillow (python3-pil) and ImageMagick for the images,
Python's tarfile and gzip for the shards and IDX files.

usage: make_image_fixtures.py OUTDIR

Reference pixels go beside each encoded image as raw RGB (or grey) bytes:
the pixels the encoder was given (PNG, lossless WebP) or meant to keep
(JPEG), never viaduct's decode.
"""
import gzip
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import zlib

from PIL import Image

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = random.Random(1234)


def save(name, data):
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)


def encoded(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


# Noise: exact formats must keep every pixel.
W, H = 37, 23
rgb = bytes(rng.randrange(256) for _ in range(W * H * 3))
im = Image.frombytes("RGB", (W, H), rgb)
save("rgb.raw", rgb)
save("rgb.png", encoded(im, "PNG"))
save("rgb.webp", encoded(im, "WEBP", lossless=True))
grey = bytes(rng.randrange(256) for _ in range(W * H))
save("grey.raw", grey)
save("grey.png", encoded(Image.frombytes("L", (W, H), grey), "PNG"))
# A palette PNG: its pixels are the palette's colours.
pal = Image.frombytes("RGB", (W, H), rgb).quantize(colors=16)
save("palette.raw", pal.convert("RGB").tobytes())
save("palette.png", encoded(pal, "PNG"))

# Smooth: what JPEG keeps within its tolerance.
SW, SH = 40, 32
smooth = bytearray()
for y in range(SH):
    for x in range(SW):
        smooth += bytes([(x * 255) // (SW - 1), (y * 255) // (SH - 1), ((x + y) * 255) // (SW + SH - 2)])
smooth = bytes(smooth)
sim = Image.frombytes("RGB", (SW, SH), smooth)
save("smooth.raw", smooth)
jpg = encoded(sim, "JPEG", quality=95)
save("smooth.jpg", jpg)

# ImageMagick, a second encoder: a gradient PNG and its own raw pixels.
subprocess.run(["convert", "-size", "19x11", "gradient:red-blue", "-depth", "8",
                os.path.join(out, "magick.png")], check=True)
subprocess.run(["convert", os.path.join(out, "magick.png"), "-depth", "8",
                "rgb:" + os.path.join(out, "magick.raw")], check=True)

png = encoded(im, "PNG")
webp = encoded(im, "WEBP", lossless=True)


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def shard(path, entries):
    with tarfile.open(os.path.join(out, path), "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in entries:
            add(tar, name, data)


good = [("s/000.jpg", jpg), ("s/000.txt", b"a smooth gradient\n"),
        ("s/001.png", png), ("s/001.json", json.dumps({"caption": "noise"}).encode()),
        ("s/002.webp", webp), ("s/002.txt", b"lossless noise")]
bad = [("s/003.png", png),                                   # no caption
       ("s/004.txt", b"no image here"),                       # no image
       ("s/005.jpg", b""), ("s/005.txt", b"zero size"),       # zero-size image
       ("s/006.png", png[: len(png) // 2]), ("s/006.txt", b"cut png"),
       ("s/007.jpg", b"this is not an image at all"), ("s/007.txt", b"text"),
       ("s/008.png", png), ("s/008.json", json.dumps({"text": "wrong field"}).encode()),
       ("s/009.jpg", jpg[: len(jpg) // 2]), ("s/009.txt", b"cut jpeg"),
       ("s/010.png", png), ("s/010.txt", b"   \n")]            # empty caption
shard("mixed.tar", good[:2] + bad + good[2:])
shard("good.tar", good)
with open(os.path.join(out, "good.tar"), "rb") as f:
    whole = f.read()
# Cut inside the second sample's image (after 000's two entries).
cut = 512 * 2 + ((len(jpg) + 511) // 512) * 512 + 512 + 512 + 512 + 200
save("truncated.tar", whole[:cut])
with open(os.path.join(out, "good.tar.gz"), "wb") as f:
    f.write(gzip.compress(whole))
save("good.tgz", gzip.compress(whole)[:-20])  # cut before the gzip trailer
save("mixed.tar.crc", b"%08x" % (zlib.crc32(open(os.path.join(out, "mixed.tar"), "rb").read()) & 0xFFFFFFFF))

# The same kind of samples under names a ustar header cannot hold: longer
# than 100 bytes (the last two differ only after byte 100) and not ASCII.
# The pax shard opens with a global header (an archive comment, as git
# archive writes); the GNU shard names entries by long-name entries.
LONG = "d/" + "x" * 120 + "/"
long_named = [(LONG + "000.jpg", jpg), (LONG + "000.txt", b"a smooth gradient"),
              ("s/\u00fcn\u00ef/001.png", png), ("s/\u00fcn\u00ef/001.txt", b"noise"),
              (LONG + "002.webp", webp), (LONG + "002.txt", b"lossless noise"),
              (LONG + "003.png", png)]                         # no caption
with tarfile.open(os.path.join(out, "pax.tar"), "w", format=tarfile.PAX_FORMAT,
                  pax_headers={"comment": "fixtures of test_prepare_images"}) as tar:
    for name, data in long_named:
        add(tar, name, data)
with tarfile.open(os.path.join(out, "gnu.tar"), "w", format=tarfile.GNU_FORMAT) as tar:
    for name, data in long_named:
        add(tar, name, data)


def raw_header(name, size_field, kind):
    """A ustar header block with the given 12-byte size field, checksummed."""
    h = bytearray(512)
    h[0:len(name)] = name.encode()
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def padded(data):
    return data + bytes(-len(data) % 512)


# Sizes a writer states outside the octal field: a pax `size` record over a
# ustar field of 0 (as for entries past 8 GiB), and GNU's base-256 field.
record = b"size=%d\n" % len(png)
record = b"%d " % (len(record) + 3) + record  # the length counts its own digits
assert int(record.split(b" ")[0]) == len(record)
base256 = bytes([0x80]) + len(png).to_bytes(11, "big")
save("sizes.tar",
     raw_header("././@PaxHeader", b"%011o\0" % len(record), b"x") + padded(record) +
     raw_header("z/000.png", b"00000000000\0", b"0") + padded(png) +
     raw_header("z/000.txt", b"%011o\0" % 5, b"0") + padded(b"noise") +
     raw_header("z/001.png", base256, b"0") + padded(png) +
     raw_header("z/001.txt", b"%011o\0" % 14, b"0") + padded(b"lossless noise") +
     bytes(1024))
bad_record = b"9 size=x\n"
save("badpax.tar",
     raw_header("././@PaxHeader", b"%011o\0" % len(bad_record), b"x") + padded(bad_record) +
     raw_header("z/000.png", b"%011o\0" % len(png), b"0") + padded(png) + bytes(1024))

lines = [json.dumps({"image": "rgb.png", "text": "noise from a list"}),
         json.dumps({"image": "missing.png", "text": "no such file"}),
         json.dumps({"image": "smooth.jpg"}),
         "this line is not json",
         "",
         json.dumps({"image": "grey.png", "text": "grey noise"})]
save("list.jsonl", ("\n".join(lines) + "\n").encode())

# IDX: 3 images of 5 x 4, labels 2, 0, 1; and a label file whose last
# label (7) has no name.
n, h, w = 3, 5, 4
pixels = bytes(rng.randrange(256) for _ in range(n * h * w))
idx_images = (0x803).to_bytes(4, "big") + n.to_bytes(4, "big") + h.to_bytes(4, "big") + \
    w.to_bytes(4, "big") + pixels
idx_labels = (0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + bytes([2, 0, 1])
save("idx-images", idx_images)
save("idx-labels", idx_labels)
save("idx-images.gz", gzip.compress(idx_images))
save("idx-labels.gz", gzip.compress(idx_labels))
save("idx-labels-bad", (0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + bytes([2, 0, 7]))
save("idx-pixels.raw", pixels)
