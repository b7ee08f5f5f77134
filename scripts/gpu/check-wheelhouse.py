#!/usr/bin/env python3
"""Check a wheelhouse for the GPU node (CPython 3.12, x86-64 Linux, glibc 2.39) and list it.

    check-wheelhouse.py WHEELHOUSE PINS_FILE [EXTRA_PIN...]

Fails (exit 1, one line per problem) when a wheel's tags cannot install under CPython 3.12 on
x86-64 Linux, when a native library inside a wheel asks for a newer glibc or libstdc++ than the
node has, or when a pin of PINS_FILE (``name==version`` lines; ``#`` comments) has no wheel.
Prints one line per wheel (name, version, tags, MB, native libraries with the newest glibc /
GLIBCXX symbol version they need), then the total. Stdlib only.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

NODE_GLIBC = (2, 39)  # Ubuntu 24.04 (the node's Python 3.12.3)
NODE_GLIBCXX = (3, 4, 33)  # its libstdc++ (GCC 14)
PY_OK = re.compile(r"^(cp312|py3|py2\.py3|cp3(?:[0-9]|1[0-2])|py3[0-9]*)$")
PLAT = re.compile(
    r"^(any|linux_x86_64|manylinux1_x86_64|manylinux2010_x86_64|manylinux2014_x86_64|"
    r"manylinux_(\d+)_(\d+)_x86_64)$"
)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(path: Path) -> tuple[str, str, list[str], list[str], list[str]]:
    parts = path.name[:-4].split("-")
    name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    return name, version, py.split("."), abi.split("."), plat.split(".")


def tag_problem(py: list[str], abi: list[str], plat: list[str]) -> str | None:
    if not any(PY_OK.match(p) or p == "py2.py3" for p in py):
        return f"python tag {'.'.join(py)} is not for CPython 3.12"
    if not any(a in ("none", "cp312", "abi3") for a in abi):
        return f"abi tag {'.'.join(abi)} is not cp312/abi3/none"
    if "abi3" not in abi and "none" not in abi and "cp312" not in py:
        return f"cp312 ABI without a cp312 python tag ({'.'.join(py)})"
    ok = []
    for p in plat:
        m = PLAT.match(p)
        if m and m.group(2) and (int(m.group(2)), int(m.group(3))) > NODE_GLIBC:
            continue
        ok.append(bool(m))
    if not any(ok):
        return f"platform tag {'.'.join(plat)} is not x86-64 Linux with glibc <= {NODE_GLIBC[0]}.{NODE_GLIBC[1]}"
    return None


def native_needs(path: Path) -> list[tuple[str, tuple, tuple]]:
    """(member, newest GLIBC_x.y, newest GLIBCXX_x.y.z) of each ELF shared library in the wheel."""
    out = []
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if not re.search(r"\.so(\.\d+)*$", info.filename):
                continue
            data = zf.read(info)
            if not data.startswith(b"\x7fELF"):
                continue
            glibc = [tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)\x00", data)]
            glibcxx = [tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBCXX_(\d+\.\d+(?:\.\d+)?)\x00", data)]
            out.append((info.filename, max(glibc, default=()), max(glibcxx, default=())))
    return out


def main(argv: list[str]) -> int:
    house, pins_file, extra = Path(argv[1]), Path(argv[2]), argv[3:]
    pins = [ln.strip() for ln in pins_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")] + extra
    wheels = sorted(house.glob("*.whl"), key=lambda p: p.name.lower())
    problems, have, total = [], set(), 0
    for w in wheels:
        name, version, py, abi, plat = parse(w)
        have.add((norm(name), version))
        why = tag_problem(py, abi, plat)
        if why:
            problems.append(f"{w.name}: {why}")
        libs = native_needs(w)
        for member, glibc, glibcxx in libs:
            if glibc and glibc > NODE_GLIBC:
                problems.append(f"{w.name}: {member} needs GLIBC_{'.'.join(map(str, glibc))} (node: {NODE_GLIBC})")
            if glibcxx and glibcxx > NODE_GLIBCXX:
                problems.append(
                    f"{w.name}: {member} needs GLIBCXX_{'.'.join(map(str, glibcxx))} (node: {NODE_GLIBCXX})"
                )
        size = w.stat().st_size
        total += size
        native = ""
        if libs:
            g = max((lib[1] for lib in libs), default=())
            gx = max((lib[2] for lib in libs), default=())
            native = (
                f"  [{len(libs)} native lib(s); needs GLIBC_{'.'.join(map(str, g)) or '-'}"
                f" GLIBCXX_{'.'.join(map(str, gx)) or '-'}]"
            )
        print(
            f"{name:36s} {version:14s} {'.'.join(py)}-{'.'.join(abi)}-{'.'.join(plat):40s} {size / 1e6:7.2f} MB{native}"
        )
    for pin in pins:
        name, _, version = pin.partition("==")
        if (norm(name), version) not in have:
            problems.append(f"{pin}: no wheel in {house}")
    for p in problems:
        print(f"check-wheelhouse: {p}", file=sys.stderr)
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
