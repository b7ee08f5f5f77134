"""The GPU node's wheelhouse check (scripts/gpu/check-wheelhouse.py) and the recipe's pins (issue 27)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "scripts" / "gpu" / "check-wheelhouse.py"


def _wheel(house: Path, name: str, lib: bytes | None = None) -> None:
    with zipfile.ZipFile(house / name, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
        if lib is not None:
            zf.writestr("pkg/libx.so", lib)


def _check(house: Path, pins: list[str]) -> subprocess.CompletedProcess:
    (house.parent / "pins.txt").write_text("# comment\n" + "\n".join(pins) + "\n")
    return subprocess.run(
        [sys.executable, str(CHECK), str(house), str(house.parent / "pins.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_wheelhouse_for_the_node_passes_and_is_listed(tmp_path):
    house = tmp_path / "wheelhouse"
    house.mkdir()
    _wheel(house, "bm25s-0.3.16-py3-none-any.whl")
    _wheel(
        house,
        "rapidfuzz-3.14.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        b"\x7fELF....GLIBC_2.17\x00GLIBCXX_3.4.22\x00",
    )
    _wheel(house, "wcwidth-0.9.4-cp310-abi3-manylinux2014_x86_64.whl")
    _wheel(house, "fast_downward_textworld-20.6.4-py3-none-any.whl", b"\x7fELF..GLIBC_2.32\x00GLIBCXX_3.4.29\x00")
    proc = _check(house, ["bm25s==0.3.16", "RapidFuzz==3.14.6", "wcwidth==0.9.4", "fast-downward-textworld==20.6.4"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("4 wheels, ")
    assert "needs GLIBC_2.32 GLIBCXX_3.4.29" in proc.stdout


def test_wheels_the_node_cannot_use_and_missing_pins_are_each_named(tmp_path):
    house = tmp_path / "wheelhouse"
    house.mkdir()
    _wheel(house, "blis-1.3.4-cp311-cp311-manylinux2014_x86_64.whl")  # another CPython
    _wheel(house, "greenlet-3.5.6-cp312-cp312-macosx_11_0_arm64.whl")  # another platform
    _wheel(house, "new-1.0-cp312-cp312-manylinux_2_40_x86_64.whl")  # glibc newer than the node's
    _wheel(house, "built-1.0-py3-none-any.whl", b"\x7fELF..GLIBC_2.41\x00GLIBCXX_3.4.34\x00")  # built too new
    proc = _check(house, ["blis==1.3.4", "bm25s==0.3.16"])
    assert proc.returncode == 1
    problems = proc.stderr.splitlines()
    for expected in (
        "blis-1.3.4-cp311",
        "greenlet-3.5.6-cp312-cp312-macosx",
        "new-1.0-cp312-cp312-manylinux_2_40",
        "pkg/libx.so needs GLIBC_2.41",
        "pkg/libx.so needs GLIBCXX_3.4.34",
        "bm25s==0.3.16: no wheel",
    ):
        assert any(expected in p for p in problems), (expected, problems)


def test_the_recipe_pins_every_environment():
    pins = {
        line.split("==")[0].lower()
        for line in (REPO / "scripts/gpu/device-wheels.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert {"textworld", "jericho", "bm25s", "rapidfuzz", "alfworld", "fast-downward-textworld"} <= pins


def _snakemake_record(games: str) -> str:
    """Where Snakemake's file persistence keeps the record of output ``games`` (its own code)."""
    from snakemake.persistence.file import FilePersistence

    class _Stub:
        def _fetch_max_len(self, subject):
            return 255

    return FilePersistence._record_path(_Stub(), ".snakemake/metadata", games)


def test_pack_games_carries_the_record_snakemake_reads(tmp_path):
    """pack-games.sh names the record as Snakemake does (URL-safe base64, cut into NAME_MAX-1 pieces):
    with a run name long enough for two pieces, `base64 -w0` of the path (the TextWorld-era
    script) found no record. The tarball holds the catalogue and the record, and nothing else."""
    import tarfile

    for run in ("gpu-alfworld", "a" * 200):
        repo = tmp_path / run[:20]
        games = f"results/{run}/plan/games"
        (repo / games / "alfworld" / "train").mkdir(parents=True)
        (repo / games / "games.json").write_text("{}\n")
        (repo / games / "manifest.json").write_text("{}\n")
        record = _snakemake_record(games)
        (repo / record).parent.mkdir(parents=True)
        (repo / record).write_text('{"rule": "games"}\n')
        (repo / "cfg.yaml").write_text(f"run: {run}\nenv: {{kind: alfworld}}\n")
        proc = subprocess.run(
            ["bash", str(REPO / "scripts/gpu/pack-games.sh"), "cfg.yaml", "out"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        with tarfile.open(repo / "out" / "games.tgz") as tf:
            names = {m.name for m in tf.getmembers() if m.isfile()}
        assert names == {f"{games}/games.json", f"{games}/manifest.json", record}, names


def _node_run(tmp_path, *args, extra_env=None, session=False):
    """scripts/gpu/node-run.sh in a scratch checkout, with a `snakemake` that prints its arguments.
    ``session``: the call in its own process group, every process left in it killed when it returns (what a
    device call's end does)."""
    import os
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True, exist_ok=True)
    for name in ("node-run.sh", "node-env.sh", "warm.sh"):
        shutil.copy(REPO / "scripts" / "gpu" / name, repo / "scripts" / "gpu" / name)
    (repo / "config" / "matrices").mkdir(parents=True, exist_ok=True)
    (repo / "config" / "base.yaml").write_text("run: base\nenv: {kind: textworld}\n")
    (repo / "config" / "matrices" / "m.yaml").write_text("base: config/base.yaml\narms: {a: {}}\n")
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "snakemake").write_text(
        '#!/bin/sh\necho "cublas:${CUBLAS_WORKSPACE_CONFIG:-}"\nfor a in "$@"; do echo "arg:$a"; done\n'
        'exec sleep "${FAKE_SNAKEMAKE_S:-0}"\n'
    )
    (fake / "snakemake").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SKIP_ENV_CHECK": "1",
        "GPU_SAMPLE": "0",
        "FA_GPU": str(tmp_path / "fa"),
    }
    env.pop("OUT", None)
    env.pop("WARM", None)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    env.pop("DEADLINE", None)
    env.update(extra_env or {})
    cmd = ["bash", "scripts/gpu/node-run.sh", "config/matrices/m.yaml", "60", *args]
    if not session:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    else:
        import signal

        popen = subprocess.Popen(
            cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        stdout, stderr = popen.communicate(timeout=60)
        try:
            os.killpg(popen.pid, signal.SIGKILL)  # the call's session: what the call left running
        except ProcessLookupError:
            pass
        proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    return proc, [line[4:] for line in proc.stdout.splitlines() if line.startswith("arg:")]


def test_node_run_keeps_the_matrix_when_the_caller_adds_config(tmp_path):
    """Snakemake keeps only the last --config: node-run.sh's own `--config matrix=NAME` followed by a
    caller's `--config rounds=2` ran the workflow's default on the node (208 s of device time). The
    caller's --config now carries matrix=NAME; a second --config is refused before Snakemake starts."""
    proc, args = _node_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert args[args.index("--config") + 1] == "matrix=m"

    proc, args = _node_run(tmp_path, "--keep-going", "--config", "rounds=2")
    assert proc.returncode == 0, proc.stderr
    assert args.count("--config") == 1
    i = args.index("--config")
    assert set(args[i + 1 : i + 3]) == {"matrix=m", "rounds=2"}, args

    proc, args = _node_run(tmp_path, "--config", "rounds=2", "--config", "eval.n=8")
    assert proc.returncode == 2 and args == []
    assert "--config given 2 times" in proc.stderr


def test_node_run_unlocks_a_stale_lock(tmp_path):
    """A Snakemake killed at the end of a device call (SIGKILL after the timeout's SIGINT) left its lock
    and the next call stopped at once: "Directory cannot be locked" (node, 2026-12-03). With a lock and
    no Snakemake of the checkout running, node-run.sh unlocks (same target) before it runs."""
    repo = tmp_path / "repo"
    (repo / ".snakemake" / "locks").mkdir(parents=True)
    (repo / ".snakemake" / "locks" / "0.input.lock").write_text("x\n")
    proc, args = _node_run(tmp_path, "--config", "rounds=2")
    assert proc.returncode == 0, proc.stderr
    assert "stale Snakemake lock" in proc.stdout
    assert args.index("--unlock") < args.index("--cores"), args  # the unlock ran first
    assert args.count("matrix=m") == 2  # both with the matrix

    # no lock: no unlock
    proc, args = _node_run(tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert "--unlock" not in args


def test_node_run_exports_the_cublas_setting_for_a_deterministic_run(tmp_path):
    """deterministic: the warm server's standbys must start CUDA with CUBLAS_WORKSPACE_CONFIG, or they
    cannot take the run's jobs (fedagent/model/determinism.py): node-run.sh exports it before them."""
    proc, _ = _node_run(tmp_path / "a")
    assert "cublas:\n" in proc.stdout + "\n" and "cublas::4096:8" not in proc.stdout
    proc, _ = _node_run(tmp_path / "b", "--config", "deterministic=true")
    assert proc.returncode == 0, proc.stderr
    assert "cublas::4096:8" in proc.stdout


def test_node_run_cuts_its_limit_to_the_calls_deadline(tmp_path):
    """A device call that installed first and gave node-run.sh 515 of its 600 s was cut off while packing
    (node, 2026-12-06). With DEADLINE (the call's end), Snakemake's limit leaves its stop and the packing
    inside the call: here 60 s asked, 2 s left, and a Snakemake that would run 30 s is stopped at 2 s.
    Seen failing with the DEADLINE block removed (the fake ran its 30 s; the test's 60 s stayed)."""
    import time

    t0 = time.monotonic()
    deadline = str(int(time.time()) + 4)
    proc, args = _node_run(
        tmp_path / "a", extra_env={"DEADLINE": deadline, "STOP_S": "1", "PACK_S": "1", "FAKE_SNAKEMAKE_S": "30"}
    )
    assert "--cores" in args, proc.stderr
    assert "limit 60 s cut to" in proc.stdout, proc.stdout
    assert proc.returncode == 124 and time.monotonic() - t0 < 15, (proc.returncode, proc.stdout)

    proc, args = _node_run(tmp_path / "b", extra_env={"DEADLINE": str(int(time.time()) + 10)})
    assert proc.returncode == 1 and args == []  # 30 s stop + 30 s packing do not fit: nothing started
    assert "no time left before DEADLINE" in proc.stderr


PIECES = REPO / "scripts" / "gpu" / "check-pieces.sh"


def _pieces(tmp_path: Path, sizes: dict[str, int], checkout_bytes: int, piece_mb: int) -> subprocess.CompletedProcess:
    """check-pieces.sh on sparse pieces of the given sizes, beside a checkout of ``checkout_bytes``."""
    bundle = tmp_path / "pack" / "vllm"
    bundle.mkdir(parents=True)
    for name, size in sizes.items():
        with open(bundle / name, "wb") as f:
            f.truncate(size)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    with open(checkout / "docs.bin", "wb") as f:  # untracked, not ignored: a device call carries it
        f.truncate(checkout_bytes)
    return subprocess.run(
        ["bash", str(PIECES), str(piece_mb), str(bundle)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "CHECKOUT": str(checkout)},
    )


def test_pieces_that_fit_a_device_call_beside_the_checkout_pass(tmp_path):
    proc = _pieces(tmp_path, {"part-00": 48_000_000, "part-01": 7_987_200}, 8_000_000, 48)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("2 pieces, 56 MB; the checkout 8.0 MB")


def test_a_piece_that_beside_the_checkout_passes_64_mib_is_named(tmp_path):
    """make-wheelhouse.sh's 60 MiB pieces under PIECE_MB 64 beside an 8 MB checkout: each device call of
    one was refused on the node; the check names them before any call."""
    proc = _pieces(tmp_path, {"part-00": 62_914_560, "part-01": 40_000_000}, 8_000_000, 64)
    assert proc.returncode == 1
    assert "do not fit a device call's 64 MiB" in proc.stdout and "part-00" in proc.stdout
    assert "part-01" not in proc.stdout.split("PIECE_MB):")[1]
    over = _pieces(tmp_path / "b", {"part-00": 50_000_000}, 1_000, 48)
    assert over.returncode == 1 and "pieces over PIECE_MB:" in over.stdout


def test_node_run_detached_snakemake_outlives_the_device_call(tmp_path):
    """DETACH=1: a device call's end kills every process the call left in its session, and each stop of the
    default mode killed the jobs in flight (two ALFWorld train jobs, ≈ 2 min each, at both of a run's call
    boundaries). Snakemake runs in its own session instead: the first call returns 75 at its DEADLINE with
    Snakemake still running, and the next call waits on that same Snakemake (started once) and returns its rc."""
    import time

    state, out1, out2 = tmp_path / "state", tmp_path / "out1", tmp_path / "out2"
    out1.mkdir()
    out2.mkdir()
    common = {"DETACH": "1", "NODE_RUN_STATE": str(state), "FAKE_SNAKEMAKE_S": "6", "PACK_S": "0"}
    first, _ = _node_run(
        tmp_path, extra_env={**common, "OUT": str(out1), "DEADLINE": str(int(time.time()) + 2)}, session=True
    )
    assert first.returncode == 75, (first.stdout, first.stderr)
    assert "still runs" in first.stdout
    second, _ = _node_run(
        tmp_path, extra_env={**common, "OUT": str(out2), "DEADLINE": str(int(time.time()) + 40)}, session=True
    )
    assert second.returncode == 0, (second.stdout, second.stderr)
    assert "waiting on it" in second.stdout and "rc=0" in second.stdout
    log = (out2 / "node-run.log").read_text()
    assert log.count("snakemake started") == 1, log
    assert [line[4:] for line in log.splitlines() if line.startswith("arg:")].count("--cores") == 1, log


def test_node_run_detached_needs_out(tmp_path):
    proc, _ = _node_run(tmp_path, extra_env={"DETACH": "1", "NODE_RUN_STATE": str(tmp_path / "state")})
    assert proc.returncode == 2 and "DETACH=1 needs OUT" in proc.stderr
