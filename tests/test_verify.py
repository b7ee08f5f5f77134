"""`fedagent verify` through the CLI: passes on a good round, fails (non-zero) on tampering."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from fedagent.server.aggregate import aggregate
from fedagent.core.atomic import write_manifest
from fedagent.cli import main as cli_main
from fedagent.model.hf_dir import TensorReader, read_header, save_model_dir, tensor_index, write_tensors
from fedagent.server.merge import merge
from fedagent.server.optimizers import OPTIMIZERS, FedAvg, make_optimizer
from fedagent.server.optimizers import hparam_flags
from fedagent.server.verify import WEIGHT, recompute
from test_aggregate import make_round, random_model

FLAGS = hparam_flags()  # hyper-parameter → its `fedagent verify` flag


def run_verify(prev_dir, dirs, agg, model=None, weighting="samples"):
    cmd = [
        sys.executable,
        "-m",
        "fedagent.cli",
        "verify",
        "--prev",
        str(prev_dir),
        "--clients",
        *map(str, dirs),
        "--weighting",
        weighting,
        "--aggregate",
        str(agg),
    ]
    if model is not None:
        cmd += ["--model", str(model), "--server-opt", "fedavg"]
    return subprocess.run(cmd, capture_output=True, text=True)


def good_round(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 3)
    aggregate(prev_dir, dirs, tmp_path / "agg", weighting="samples")
    merge(prev_dir, tmp_path / "agg", tmp_path / "model", FedAvg(), round_=1)
    return prev_dir, dirs


def rewrite_delta(agg, fn):
    """Change delta.safetensors and re-sign the manifest, so only the values are wrong."""
    path = agg / "delta.safetensors"
    with TensorReader() as r:
        tensors = {n: r.read(i).clone() for n, i in read_header(path).items()}
    fn(tensors)
    write_tensors(path, tensors)
    write_manifest(agg)


def test_verify_passes_on_good_round(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    res = run_verify(prev_dir, dirs, tmp_path / "agg", tmp_path / "model")
    assert res.returncode == 0, res.stderr
    assert "verify: OK" in res.stdout


def test_verify_fails_on_tampered_tensor(tmp_path):
    prev_dir, dirs = good_round(tmp_path)

    def tamper(t):
        t["layer.0.attn.weight"][2, 3] += 1e-4  # far below a bf16 ulp of the weights, far above fp32 rounding

    rewrite_delta(tmp_path / "agg", tamper)
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0
    assert "'layer.0.attn.weight': 1 element(s) outside tolerance" in res.stderr


def test_verify_fails_on_tampered_bytes_manifest(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    with open(tmp_path / "model" / "model.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    res = run_verify(prev_dir, dirs, tmp_path / "agg", tmp_path / "model")
    assert res.returncode != 0 and "manifest" in res.stderr and "sha256" in res.stderr


def test_verify_fails_on_wrong_weighting(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    res = run_verify(prev_dir, dirs, tmp_path / "agg", weighting="uniform")
    assert res.returncode != 0 and "weighting" in res.stderr


def test_verify_fails_on_missing_file(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    (dirs[1] / "metrics.json").unlink()
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "missing" in res.stderr and "metrics.json" in res.stderr
    shutil.rmtree(tmp_path / "agg")
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "no manifest.json" in res.stderr and "metrics.json" in res.stderr


def test_verify_fails_on_shape_mismatch(tmp_path):
    prev_dir, dirs = good_round(tmp_path)

    def reshape(t):
        t["layer.0.mlp.weight"] = t["layer.0.mlp.weight"][:-1].contiguous()

    rewrite_delta(tmp_path / "agg", reshape)
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "'layer.0.mlp.weight'" in res.stderr and "expected F32[24, 16]" in res.stderr


def test_verify_fails_on_bf16_truncated_aggregate(tmp_path):
    """The reference system's bug: an fp32 mean stored through bf16. Must not pass."""
    prev_dir, dirs = good_round(tmp_path)
    rewrite_delta(tmp_path / "agg", lambda t: t.update({k: v.to(torch.bfloat16).float() for k, v in t.items()}))
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "outside tolerance" in res.stderr


# ---- the server step for every optimizer ---------------------------------------------------

HPARAMS = {  # not merge's defaults, so a flag that does not reach the recomputation shows
    "fedavg": dict(lr=0.8),
    "fedavgm": dict(lr=0.5, momentum=0.8),
    "fedadam": dict(lr=0.05, beta1=0.85, beta2=0.995, tau=1e-3),
    "fedyogi": dict(lr=0.02, beta1=0.9, beta2=0.99, tau=3e-3),
}
WRONG = {"fedavg": ("lr", 0.7), "fedavgm": ("momentum", 0.9), "fedadam": ("beta2", 0.99), "fedyogi": ("tau", 1e-3)}


def server_flags(name, hp, prev_state=None):
    """verify's --server-opt/--prev-server-state and hyper-parameter flags."""
    out = ["--server-opt", name, "--prev-server-state", str(prev_state or "none")]
    for k, v in hp.items():
        out += [FLAGS[k], repr(v)]
    return out


def verify_cli(rnd, model=None, flags=None, *, in_process=None):
    """Run ``fedagent verify`` on one round of ``two_rounds`` (a subprocess, or main() with capsys)."""
    args = [
        "verify",
        "--prev",
        str(rnd["prev"]),
        "--clients",
        *map(str, rnd["clients"]),
        "--weighting",
        "samples",
        "--aggregate",
        str(rnd["agg"]),
        "--model",
        str(model or rnd["model"]),
        *flags,
    ]
    if in_process is None:
        return subprocess.run([sys.executable, "-m", "fedagent.cli", *args], capture_output=True, text=True)
    code = cli_main(args)
    out = in_process.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def fp32_clients(tmp, base_dir, m=3):
    """Round-2 clients: the round-1 global model plus noise, stored fp32 like it."""
    with TensorReader() as r:
        base = {n: r.read(i).clone() for n, i in tensor_index(base_dir).items()}
    return [
        save_model_dir(
            tmp / f"r2client{i}",
            {k: v.float() for k, v in random_model("r2", i, base=base).items()},
            json_files={"metrics.json": {"num_samples": 5 + i, "num_tokens": 100}},
        )
        for i in range(m)
    ]


@pytest.fixture(scope="module", params=sorted(HPARAMS))
def two_rounds(request, tmp_path_factory):
    """An honest run of two rounds with one optimizer: round 1 from fresh state, round 2 from round 1's."""
    name, tmp = request.param, tmp_path_factory.mktemp(request.param)
    _, prev_dir, _, dirs = make_round(tmp, 3)
    aggregate(prev_dir, dirs, tmp / "agg1", weighting="samples")
    merge(prev_dir, tmp / "agg1", tmp / "r1", make_optimizer(name, **HPARAMS[name]), round_=1)
    dirs2 = fp32_clients(tmp, tmp / "r1")
    aggregate(tmp / "r1", dirs2, tmp / "agg2", weighting="samples")
    merge(
        tmp / "r1", tmp / "agg2", tmp / "r2", make_optimizer(name, **HPARAMS[name]), round_=2, prev_state_dir=tmp / "r1"
    )
    return {
        "name": name,
        "hp": HPARAMS[name],
        1: {"prev": prev_dir, "clients": dirs, "agg": tmp / "agg1", "model": tmp / "r1", "state": None},
        2: {"prev": tmp / "r1", "clients": dirs2, "agg": tmp / "agg2", "model": tmp / "r2", "state": tmp / "r1"},
    }


def flags_of(run, rnd, **change):
    return server_flags(run["name"], {**run["hp"], **change}, rnd["state"])


def tampered_copy(run, tmp_path, file, fn):
    """A copy of round 2's model dir with ``fn`` applied to one safetensors file, manifest re-signed."""
    out = tmp_path / "r2x"
    shutil.copytree(run[2]["model"], out)
    with TensorReader() as r:
        tensors = {n: r.read(i).clone() for n, i in read_header(out / file).items()}
    fn(tensors)
    write_tensors(out / file, tensors)
    write_manifest(out)
    return out


def bump(t, name, rel=1e-4):
    """Scale the largest-magnitude element of ``t[name]`` by 1 + rel (no cancellation there)."""
    x = t[name].reshape(-1)
    x[int(x.abs().argmax())] *= 1 + rel


def test_verify_server_step_two_honest_rounds(two_rounds, capsys):
    # In-process main() (exit code = run()'s return): the subprocess path is covered above.
    for i in (1, 2):
        rnd = two_rounds[i]
        res = verify_cli(rnd, flags=flags_of(two_rounds, rnd), in_process=capsys)
        assert res.returncode == 0, res.stderr
        assert "verify: OK" in res.stdout and two_rounds["name"] in res.stdout
        assert ("fresh state" if i == 1 else "state from") in res.stdout


def test_verify_server_step_fails_on_tampered_weight(two_rounds, tmp_path, capsys):
    model = tampered_copy(two_rounds, tmp_path, "model.safetensors", lambda t: bump(t, "layer.0.attn.weight"))
    res = verify_cli(two_rounds[2], model, flags_of(two_rounds, two_rounds[2]), in_process=capsys)
    assert res.returncode != 0
    assert "merged model: tensor 'layer.0.attn.weight': 1 element(s) outside tolerance" in res.stderr, res.stderr


@pytest.mark.parametrize("slot", ["m", "v"])
def test_verify_server_step_fails_on_tampered_state(two_rounds, tmp_path, slot, capsys):
    if slot not in OPTIMIZERS[two_rounds["name"]].slots:
        pytest.skip(f"{two_rounds['name']} has no state {slot!r}")
    name = f"{slot}/layer.0.mlp.weight"
    model = tampered_copy(two_rounds, tmp_path, "server_state.safetensors", lambda t: bump(t, name))
    res = verify_cli(two_rounds[2], model, flags_of(two_rounds, two_rounds[2]), in_process=capsys)
    assert res.returncode != 0
    assert f"server state: tensor {name!r}: 1 element(s) outside tolerance" in res.stderr, res.stderr


def test_verify_server_step_fails_on_wrong_hparam_flag(two_rounds, capsys):
    key, value = WRONG[two_rounds["name"]]
    res = verify_cli(two_rounds[2], flags=flags_of(two_rounds, two_rounds[2], **{key: value}), in_process=capsys)
    assert res.returncode != 0
    assert f"server.json: hparams {key}={two_rounds['hp'][key]!r} != {FLAGS[key]} {value!r}" in res.stderr, res.stderr


def test_verify_server_step_recomputes_from_flags_not_server_json(two_rounds, tmp_path, capsys):
    """A run with other hyper-parameters whose server.json files were edited to match the flags: values fail."""
    key, value = WRONG[two_rounds["name"]]
    for r in (1, 2):  # round 1's too: it is round 2's previous state (and FedAvgM's β acts from round 2)
        shutil.copytree(two_rounds[r]["model"], tmp_path / f"r{r}")
        meta = json.loads((tmp_path / f"r{r}" / "server.json").read_text())
        meta["hparams"][key] = value
        (tmp_path / f"r{r}" / "server.json").write_text(json.dumps(meta))
        write_manifest(tmp_path / f"r{r}")
    flags = server_flags(two_rounds["name"], {**two_rounds["hp"], key: value}, tmp_path / "r1")
    res = verify_cli(two_rounds[2], tmp_path / "r2", flags, in_process=capsys)
    assert res.returncode != 0 and "server.json" not in res.stderr
    assert "merged model: tensor 'layer.0.attn.weight'" in res.stderr, res.stderr


def test_verify_server_step_checks_round_step_and_optimizer(two_rounds, capsys):
    run, rnd = two_rounds, two_rounds[2]
    res = verify_cli(rnd, flags=server_flags(run["name"], run["hp"], None), in_process=capsys)
    assert res.returncode != 0 and "server.json: step 2 != previous step 0 + 1" in res.stderr, res.stderr
    res = verify_cli(rnd, flags=server_flags(run["name"], run["hp"], rnd["model"]), in_process=capsys)
    assert res.returncode != 0 and "server.json: round 2 != previous round 2 + 1" in res.stderr, res.stderr
    other = "fedavgm" if run["name"] != "fedavgm" else "fedadam"
    res = verify_cli(rnd, flags=server_flags(other, {"lr": 0.1}, rnd["state"]), in_process=capsys)
    assert res.returncode != 0 and f"optimizer {run['name']!r} != --server-opt {other}" in res.stderr, res.stderr


def test_verify_server_state_structure(two_rounds, tmp_path, capsys):
    run = two_rounds
    slots = OPTIMIZERS[run["name"]].slots
    if not slots:
        pytest.skip("fedavg has no state tensors")
    name = f"{slots[-1]}/scalar"
    model = tampered_copy(run, tmp_path, "server_state.safetensors", lambda t: t.pop(name))
    res = verify_cli(run[2], model, flags_of(run, run[2]), in_process=capsys)
    assert res.returncode != 0 and f"server state ({run['name']}) tensors differ" in res.stderr
    assert f"missing [{name!r}]" in res.stderr, res.stderr
    state = tmp_path / "r1x"
    shutil.copytree(run[1]["model"], state)
    with TensorReader() as r:
        tensors = {n: r.read(i).clone() for n, i in read_header(state / "server_state.safetensors").items()}
    bad = f"{slots[0]}/layer.0.mlp.weight"
    tensors[bad] = tensors[bad][:-1].contiguous()
    write_tensors(state / "server_state.safetensors", tensors)
    write_manifest(state)
    res = verify_cli(run[2], flags=server_flags(run["name"], run["hp"], state), in_process=capsys)
    assert res.returncode != 0 and f"previous server state ({run['name']}) tensor {bad!r}" in res.stderr, res.stderr


# ---- the bounds themselves, in process -------------------------------------------------------


def fp32_step(name, hp, p, d, state):
    """The real fp32 server step; returns (old state as float64, stored outputs as float64)."""
    opt = make_optimizer(name, **hp)
    st = {s: state[s].clone() for s in opt.slots} if state else opt.init_state(p)
    old = {s: t.double() for s, t in st.items()}
    w = opt.step(p.clone(), d.clone(), st)
    return opt, old, {WEIGHT: w.double(), **{s: t.double() for s, t in st.items()}}


def ratios(opt, p, d, old, got):
    return {
        k: float(((got[k] - want).abs() / tol).max())
        for k, (want, tol) in recompute(opt, p.double(), d.double(), old, got).items()
    }


@pytest.mark.parametrize("name", sorted(HPARAMS))
def test_recompute_bounds_sound_and_tight_on_random_steps(name):
    """Honest fp32 steps stay inside the bound (many seeds, magnitudes over 14 decades, zeros)."""
    worst = 0.0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)

        def mag(g=g):
            return 10.0 ** torch.empty(3000, dtype=torch.float64).uniform_(-12, 2, generator=g)

        p, d, m0 = ((torch.randn(3000, generator=g, dtype=torch.float64) * mag()).float() for _ in range(3))
        d[::17] = 0
        v0 = (torch.rand(3000, generator=g, dtype=torch.float64) * mag() ** 2).float()
        for state in (None, {"m": m0, "v": v0}):
            opt, old, got = fp32_step(name, HPARAMS[name], p, d, state)
            worst = max(worst, *ratios(opt, p, d, old, got).values())
    assert worst <= 1.0
    # Tight: on ordinary values the tolerance is a few u of the value, so a 1e-4 relative
    # change is caught nearly everywhere (not where p + q happens to cancel).
    g = torch.Generator().manual_seed(0)
    p, d = torch.randn(3000, generator=g), 1e-2 * torch.randn(3000, generator=g)
    opt, old, got = fp32_step(name, HPARAMS[name], p, d, None)
    for key, (want, tol) in recompute(opt, p.double(), d.double(), old, got).items():
        rel = tol / want.abs()
        assert float(rel.median()) < 5e-7 and float((rel < 1e-4).float().mean()) > 0.99, key


def test_recompute_yogi_covers_both_sign_branches():
    """v₀ equal to (or a few ulps from) fl(d²): fp32's sign(v₀ − fl(d²)) is not the exact sign."""
    g = torch.Generator().manual_seed(3)
    d = 1e-2 * torch.randn(4000, generator=g)
    d2 = d * d  # fp32, rounded
    steps = torch.randint(-2, 3, (4000,), generator=g)
    v0 = d2.clone()
    for k in (1, 2):  # up to two ulps either way
        v0 = torch.where(steps >= k, torch.nextafter(v0, torch.tensor(1.0)), v0)
        v0 = torch.where(steps <= -k, torch.nextafter(v0, torch.tensor(0.0)), v0)
    m0, p = 1e-3 * torch.randn(4000, generator=g), 1e-2 * torch.randn(4000, generator=g)
    opt, old, got = fp32_step("fedyogi", HPARAMS["fedyogi"], p, d, {"m": m0, "v": v0})
    flipped = torch.sign(v0 - d2) != torch.sign(v0.double() - d.double() ** 2)
    assert int(flipped.sum()) > 100  # the case really occurs here
    assert max(ratios(opt, p, d, old, got).values()) <= 1.0
    # The branch is chosen once, for v and w together: v moved to another honest branch
    # alone passes on its own but not with w; and v between branches fails.
    c = 1 - HPARAMS["fedyogi"]["beta2"]
    i = int(flipped.nonzero()[0])
    vi, cd = float(v0[i]), c * float(d[i]) ** 2
    branches = torch.tensor([vi + cd, vi, vi - cd], dtype=torch.float64)
    moved = {k: t.clone() for k, t in got.items()}
    moved["v"][i] = branches[int((branches - got["v"][i]).abs().argmax())]
    r = ratios(opt, p, d, old, moved)
    assert r["v"] <= 1.0 and r["weight"] > 1.0, r
    got["v"][i] += cd / 2
    assert ratios(opt, p, d, old, got)["v"] > 1.0
