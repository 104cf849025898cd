#!/usr/bin/env python3
"""Checks the relative links and anchors of README.md, docs/ (with its
results/ and notes/), bench/ and reference/ Markdown files.

Every [text](target) outside code must name a file or folder that exists,
and a #anchor must match a heading of the target file (GitHub's slugs).
Usage: python3 scripts/check_doc_links.py [FILE ...]; exits 1 on a broken link.
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strip_code(text):
    # Fenced blocks, indented code after a blank line, then inline code.
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return text


def slug(heading):
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> text
    h = h.replace("`", "").strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    in_fence = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def check(path):
    bad = []
    text = strip_code(open(path, encoding="utf-8").read())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else os.path.normpath(
            os.path.join(os.path.dirname(path), file_part))
        if not os.path.exists(dest):
            bad.append(f"{os.path.relpath(path, ROOT)}: {target}: no such file")
            continue
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{os.path.relpath(path, ROOT)}: {target}: no heading #{anchor}")
    return bad


def main():
    files = sys.argv[1:] or [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True) +
        glob.glob(os.path.join(ROOT, "bench", "**", "*.md"), recursive=True) +
        glob.glob(os.path.join(ROOT, "reference", "*.md")))
    bad = [b for f in files for b in check(os.path.abspath(f))]
    for b in bad:
        print(b)
    print(f"{len(files)} files, {len(bad)} broken links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
