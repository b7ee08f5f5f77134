"""Tampered client updates are refused by name, both by ``fedagent aggregate`` and by ``fedagent verify``.

Cases: a truncated safetensors file (manifest left as it was, and manifest re-signed to
match), a changed tensor byte, a missing manifest, an update of another architecture, a NaN
(the last two with honest manifests: only the content is wrong). Every case goes through the
CLI as Snakemake calls it; each must exit 1 with its reason named. Run alone it prints the
count: ``python tests/reliability/test_tamper.py``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedagent.server.aggregate import aggregate
from fedagent.core.atomic import write_manifest
from fedagent.cli import main as cli_main
from fedagent.model.hf_dir import SINGLE_FILE, TensorReader, read_header, save_model_dir, tensor_index, write_tensors
from fedagent.core.seeds import torch_generator

SHAPES = {
    "model.embed_tokens.weight": (40, 16),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.mlp.up_proj.weight": (32, 16),
    "model.norm.weight": (16,),
}
OTHER_ARCH = {
    "model.embed_tokens.weight": (40, 24),
    "model.layers.0.self_attn.q_proj.weight": (24, 24),
    "model.layers.0.mlp.up_proj.weight": (48, 24),
    "model.layers.1.mlp.up_proj.weight": (48, 24),
    "model.norm.weight": (24,),
}


def _state(shapes, purpose, index, base=None):
    g = torch_generator(13, purpose, index=index)
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        out[name] = base[name] + 1e-2 * x if base is not None else x
    return out


def _resign(d: Path) -> None:
    """Re-write the manifest to match the (tampered) files: only the content is then wrong."""
    (d / "manifest.json").unlink()
    write_manifest(d)


def _rewrite(d: Path, fn) -> None:
    path = d / SINGLE_FILE
    with TensorReader() as r:
        tensors = {n: r.read(i).clone() for n, i in read_header(path).items()}
    fn(tensors)
    write_tensors(path, tensors)


def _truncate(d: Path) -> None:
    path = d / SINGLE_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(d: Path) -> None:
    path = d / SINGLE_FILE
    info = tensor_index(d)["model.layers.0.mlp.up_proj.weight"]
    data = bytearray(path.read_bytes())
    data[info.start + 5] ^= 0x01
    path.write_bytes(bytes(data))


def _nan(d: Path) -> None:
    _rewrite(d, lambda t: t["model.layers.0.self_attn.q_proj.weight"].view(-1).__setitem__(3, float("nan")))
    _resign(d)


def _other_arch(d: Path) -> None:
    shutil.rmtree(d)
    save_model_dir(d, _state(OTHER_ARCH, "other_arch", 0), json_files={"metrics.json": {"num_samples": 4}})


def _truncate_resigned(d: Path) -> None:
    _truncate(d)
    _resign(d)


# case -> (tamper the client update, the reason aggregate names, the reason verify names)
CASES = {
    "truncated safetensors": (_truncate, r"size \d+ != manifest \d+", r"manifest: .*size \d+ != manifest"),
    "truncated safetensors, manifest re-signed": (
        _truncate_resigned,
        r"byte range .* disagrees with shape/file",
        r"structure: .*byte range .* disagrees",
    ),
    "changed tensor byte": (_flip_byte, r"sha256 differs from manifest", r"manifest: .*sha256 differs"),
    "missing manifest": (
        lambda d: (d / "manifest.json").unlink(),
        r"no manifest\.json",
        r"manifest: .*no manifest\.json",
    ),
    "other architecture": (
        _other_arch,
        r"tensor names disagree with prev",
        r"structure: .*tensor names disagree with prev",
    ),
    "NaN": (
        _nan,
        r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' contains NaN/Inf",
        r"client .*tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' contains NaN/Inf",
    ),
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``fedagent <args>`` as Snakemake runs it, in this process (a torch start-up per case is slow)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


def make_round(root: Path) -> tuple[Path, list[Path], Path]:
    """prev + 2 client updates + the honest aggregate (made before any tampering)."""
    prev = _state(SHAPES, "prev", 0)
    prev_dir = save_model_dir(root / "prev", prev)
    clients = [
        save_model_dir(
            root / "clients" / str(i),
            _state(SHAPES, "client", i, base=prev),
            json_files={"metrics.json": {"num_samples": 4 + i}},
        )
        for i in range(2)
    ]
    aggregate(prev_dir, clients, root / "aggregate", weighting="uniform")
    return prev_dir, clients, root / "aggregate"


def check_case(root: Path, case: str) -> tuple[str, str]:
    """Tamper client 1 by ``case``; return (aggregate's refusal, verify's refusal). Asserts both name it."""
    tamper, agg_reason, verify_reason = CASES[case]
    prev_dir, clients, agg_dir = make_round(root)
    tamper(clients[1])
    agg = _cli(
        "aggregate",
        "--prev",
        str(prev_dir),
        "--clients",
        *map(str, clients),
        "--out",
        str(root / "aggregate2"),
        "--quarantine",
        str(root / "_failed"),
    )
    assert agg.returncode == 1, (case, agg.stdout, agg.stderr)
    assert re.search(agg_reason, agg.stderr) and str(clients[1]) in agg.stderr, (case, agg.stderr)
    assert not (root / "aggregate2").exists()
    ver = _cli("verify", "--prev", str(prev_dir), "--clients", *map(str, clients), "--aggregate", str(agg_dir))
    assert ver.returncode == 1, (case, ver.stdout, ver.stderr)
    assert re.search(verify_reason, ver.stderr) and str(clients[1]) in ver.stderr, (case, ver.stderr)
    return agg.stderr.strip().splitlines()[-1], ver.stderr.strip().splitlines()[0]


def test_untampered_round_aggregates_and_verifies(tmp_path):
    prev_dir, clients, agg_dir = make_round(tmp_path)
    assert (
        _cli(
            "aggregate", "--prev", str(prev_dir), "--clients", *map(str, clients), "--out", str(tmp_path / "again")
        ).returncode
        == 0
    )
    ver = _cli("verify", "--prev", str(prev_dir), "--clients", *map(str, clients), "--aggregate", str(agg_dir))
    assert ver.returncode == 0, ver.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_tampered_update_is_refused_by_name(tmp_path, case):
    check_case(tmp_path, case)


def main() -> int:
    import tempfile

    refused = {"aggregate": 0, "verify": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            try:
                agg, ver = check_case(Path(tmp) / str(i), case)
            except AssertionError as exc:
                print(f"NOT REFUSED BY NAME: {case}: {exc}")
                continue
            refused["aggregate"] += 1
            refused["verify"] += 1
            print(f"{case}:\n  aggregate: {agg}\n  verify:    {ver}")
    print(
        f"tamper cases: {len(CASES)} refused by name at aggregate: {refused['aggregate']} "
        f"at verify: {refused['verify']}"
    )
    return 0 if refused["aggregate"] == refused["verify"] == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
