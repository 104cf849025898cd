#!/usr/bin/env python3
"""Checks that docs/ARCHITECTURE.md's rules hold in src/.

1. Layers: every `#include "<folder>/..."` of a file in src/<folder> names a
   folder that the table's "links" column allows, directly or through the
   folders those link (the closure), and so does every viaduct_* library in
   the folder's CMakeLists.txt DEPS.
   Model code reaches kernels/ only through ops/.
2. Family names: outside src/model/ no code compares a string with a family
   name ("llama", "gpt2", "kimi_k3", "exact16"); the families answer through
   the registry.
3. Typed config: below apps/ and train/ no code includes config/config.h
   (the raw key store) or reads a key by name (`.get_int("section.key")`
   and the like); a family's parse of its own [model] keys
   (ModelSection::keys) is the one read by name, and only of model.* keys.
4. Notes: a Note is defined once, on a comment line of its own
   (`// Note [Title]`), and every other mention reads `See Note [Title]`
   (or `See Notes [A], [B]`) and names a defined Note.
5. Folder removal: no C++ file under src/, apps/, tests/ or bench/ calls
   std::filesystem::remove_all; it goes through core/file_io.h's remove_tree
   (built against the PyTorch wheel's LibTorch, remove_all of a non-empty
   folder dies of SIGSEGV).

6. Test helpers' names: the files of one tests/<folder> are one gtest
   binary compiled as one unity translation unit (the CUDA build adds the
   CUDA tests, which the CPU build never compiles together), so no two of
   them define a type (struct, class, enum) of the same name at file
   scope.

Usage: check_architecture.py [REPO_ROOT]; prints each violation and exits 1
when there is one.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
SRC = ROOT / "src"
FAMILIES = ("llama", "gpt2", "kimi_k3", "exact16")
problems = []


def table_rows():
    """(folder keys, linked folder keys) per row of the layers table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    text = text.split("## Layers, bottom up", 1)[-1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        folders = [f.strip("/") for f in re.findall(r"`([a-z_/]+)`", cells[0])]
        links = cells[-1]
        rows.append((folders, links))
    return rows


def allowed_map(rows):
    """folder -> the set of folders it may include (its own included)."""
    seen = []
    direct = {}
    for folders, links in rows:
        words = [w.strip() for w in re.sub(r"\(.*?\)", "", links).split(",")]
        deps = set()
        for w in words:
            if w in ("all above", "all"):
                deps |= set(seen)
            elif w == "runtime":
                deps.add("pipeline/runtime")
            elif w == "plan":
                deps |= {"pipeline/split", "pipeline/schedule"}
            elif w and w != "LibTorch" and not w.startswith("CUDA"):
                deps.add(w.rstrip("/"))
        for f in folders:  # the folders of one row use each other
            direct[f] = deps | (set(folders) - {f})
        seen += folders
    closure = {f: {f} | d for f, d in direct.items()}
    changed = True
    while changed:  # the transitive closure, to a fixed point
        changed = False
        for f in closure:
            more = set().union(*(closure.get(d, {d}) for d in closure[f]))
            if not more <= closure[f]:
                closure[f] |= more
                changed = True
    return closure


def folder_of(rel, known):
    """The table's folder key of a path relative to src/ (longest match)."""
    best = None
    for k in known:
        if rel == k or rel.startswith(k + "/"):
            if best is None or len(k) > len(best):
                best = k
    return best


def check_layers():
    rows = table_rows()
    allowed = allowed_map(rows)
    known = list(allowed)
    if not known:
        problems.append("docs/ARCHITECTURE.md: no layers table found")
        return
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh", ".inc"):
            continue
        rel = path.relative_to(SRC).as_posix()
        me = folder_of(rel, known)
        if me is None:
            continue  # tools/ and other folders outside the table
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            target = folder_of(m.group(1), known)
            if target is not None and target not in allowed[me]:
                problems.append(f"src/{rel}:{n}: {me}/ includes {m.group(1)}, but the table lets "
                                f"{me}/ link only {sorted(allowed[me] - {me}) or 'nothing of ours'}")
    libs = {f"viaduct_{k.split('/')[-1]}": k for k in known}
    libs["viaduct_pipeline_plan"] = "pipeline/schedule"
    libs["viaduct_pipeline"] = "pipeline/runtime"
    for cm in sorted(SRC.rglob("CMakeLists.txt")):
        text = cm.read_text()
        for m in re.finditer(r"viaduct_library\((\w+)(.*?)\)\s*$", text, re.S | re.M):
            body = m.group(2)
            deps = re.search(r"DEPS(.*)", body, re.S)
            if not deps:
                continue
            lib = m.group(1)
            me = libs.get(lib) or folder_of(cm.parent.relative_to(SRC).as_posix(), known)
            if me is None:
                continue
            for dep in re.findall(r"viaduct_\w+", deps.group(1)):
                target = libs.get(dep.replace("_pure", ""))
                if target is not None and target not in allowed[me]:
                    problems.append(f"{cm.relative_to(ROOT)}: {lib} links {dep}, but the table "
                                    f"lets {me}/ link only {sorted(allowed[me] - {me})}")


def check_model_calls_ops_only():
    """Model code calls ops::, never kernels:: (the table's model/ row)."""
    for path in sorted((SRC / "model").rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.match(r'\s*#\s*include\s+"kernels/', line) or "kernels::" in line.split("//")[0]:
                problems.append(f"{path.relative_to(ROOT)}:{n}: model/ reaches kernels/ past ops/: "
                                f"{line.strip()}")
    cm = (SRC / "model" / "CMakeLists.txt").read_text()
    if "viaduct_kernels" in cm:
        problems.append("src/model/CMakeLists.txt: viaduct_model links viaduct_kernels; model/ "
                        "reaches kernels only through ops/")


def check_family_names():
    names = "|".join(FAMILIES)
    compare = re.compile(rf'(==|!=)\s*"({names})"|"({names})"\s*(==|!=)|'
                         rf'\.compare\(\s*"({names})"')
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("model/"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("//")[0]
            if compare.search(code):
                problems.append(f"src/{rel}:{n}: compares a family name outside model/: "
                                f"{line.strip()}")


def check_typed_config():
    read = re.compile(r'\.get_(int|float|bool|string|string_list|float_list)(_opt)?\(\s*"([^"]*)"')
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        rel = path.relative_to(SRC).as_posix()
        if rel.split("/")[0] in ("config", "train", "apps", "tools"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("//")[0]
            if re.match(r'\s*#\s*include\s+"config/config.h"', code):
                problems.append(f"src/{rel}:{n}: includes the raw config below train/; take the "
                                f"JobConfig section instead (config/job_config.h)")
            for m in read.finditer(code):
                if not m.group(3).startswith("model."):
                    problems.append(f"src/{rel}:{n}: reads config key {m.group(3)!r} by name "
                                    f"below train/; take its JobConfig section")


def check_notes():
    defs = {}
    mentions = []
    files = [p for p in ROOT.glob("src/**/*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")]
    files += [p for p in ROOT.glob("tests/**/*") if p.suffix in (".h", ".cpp")]
    for path in sorted(files):
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            d = re.match(r"\s*//\s*Note \[([^\]]+)\]\s*$", line)
            if d:
                if not rel.startswith("src/"):
                    problems.append(f"{rel}:{n}: Note [{d.group(1)}] is defined outside src/")
                elif d.group(1) in defs:
                    problems.append(f"{rel}:{n}: Note [{d.group(1)}] is defined twice "
                                    f"(also {defs[d.group(1)]})")
                defs.setdefault(d.group(1), f"{rel}:{n}")
                continue
            for m in re.finditer(r"(\S+\s+)?Notes? \[", line):
                before = (m.group(1) or "").strip().strip("(").lower()
                if before != "see":
                    problems.append(f"{rel}:{n}: a mention of a Note that does not read "
                                    f"'See Note [...]': {line.strip()}")
            for m in re.finditer(r"[Ss]ee Notes? ((?:\[[^\]]+\](?:,?\s*(?:and\s+)?)?)+)", line):
                for title in re.findall(r"\[([^\]]+)\]", m.group(1)):
                    mentions.append((title, rel, n))
    for title, rel, n in mentions:
        if title not in defs:
            problems.append(f"{rel}:{n}: See Note [{title}] names no defined Note")


def check_remove_all():
    for top in ("src", "apps", "tests", "bench"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"\bremove_all\s*\(", line.split("//")[0]):
                    problems.append(f"{path.relative_to(ROOT)}:{n}: std::filesystem::remove_all; "
                                    f"use remove_tree (core/file_io.h): {line.strip()}")


def check_test_type_names():
    # A type defined at column 0 (file scope, or an anonymous namespace's,
    # which the files of a unity translation unit share).
    type_def = re.compile(r"^(?:struct|class|enum(?: class)?)\s+([A-Za-z_]\w*)\b(?!\s*;)")
    defined = {}  # (folder, name) -> first "file:line"
    for path in sorted((ROOT / "tests").rglob("*.cpp")):
        rel = path.relative_to(ROOT)
        folder = rel.parts[1]
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = type_def.match(line)
            if not m:
                continue
            key = (folder, m.group(1))
            first = defined.setdefault(key, f"{rel}:{n}")
            if not first.startswith(f"{rel}:"):
                problems.append(f"{rel}:{n}: type {m.group(1)} is also defined at {first}; "
                                f"tests/{folder} is one unity translation unit")


check_layers()
check_model_calls_ops_only()
check_test_type_names()
check_remove_all()
check_family_names()
check_typed_config()
check_notes()
for p in problems:
    print(p)
if problems:
    print(f"{len(problems)} architecture rule(s) broken (docs/ARCHITECTURE.md)")
    sys.exit(1)
print("architecture rules hold: layers, family names, typed config, Notes, folder removal, "
      "test type names")
