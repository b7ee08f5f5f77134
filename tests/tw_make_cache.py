"""``tw-make`` with a per-test-session cache (tests only; tests/conftest.py points FEDAGENT_TW_MAKE here).

Each game costs ~5 s of ``tw-make`` and most workflow tests generate the same three tiny games
(the test config's data seed and knobs). The first call with a given argument list runs the real
``tw-make`` (the one next to this interpreter, as fedagent.envs.textworld.games picks it) and
keeps its output files under ``$FEDAGENT_TEST_TW_CACHE``; a later call with the same arguments
(and the same output file name) copies them. The cache lives in a temporary directory of the
session, so every session generates each game once for real. Tests that check ``tw-make`` itself
(same seed, same bytes) unset FEDAGENT_TW_MAKE.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

SUFFIXES = (".z8", ".json", ".ni")


def main(argv: list[str]) -> int:
    real = [str(Path(sys.executable).parent / "tw-make")]
    cache = os.environ.get("FEDAGENT_TEST_TW_CACHE")
    if not cache or "--output" not in argv:
        return subprocess.run(real + argv).returncode
    i = argv.index("--output")
    out = Path(argv[i + 1])
    key_args = argv[:i] + ["--output", out.name] + argv[i + 2 :]
    key = hashlib.sha256(json.dumps([version("textworld"), key_args]).encode()).hexdigest()[:32]
    entry = Path(cache) / key
    if entry.is_dir():
        for f in sorted(entry.iterdir()):
            shutil.copyfile(f, out.parent / f.name)
        return 0
    rc = subprocess.run(real + argv).returncode
    if rc == 0:
        Path(cache).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache))
        for suffix in SUFFIXES:
            if out.with_suffix(suffix).is_file():
                shutil.copyfile(out.with_suffix(suffix), staging / out.with_suffix(suffix).name)
        try:
            os.rename(staging, entry)  # atomic; another process may have stored it first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
