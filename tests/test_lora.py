"""LoRA clients (train.lora): the adapter update's files, the client's training, and the server step's exact
aggregation of the products ΔW_i = (α/r)·B_i·A_i (never of the factors), merge and verify."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fake_env import TINY_TRAIN, FakeEnv
from fedagent.core.atomic import write_manifest
from fedagent.core.seeds import torch_generator
from fedagent.model import lora
from fedagent.model.hf_dir import save_model_dir
from fedagent.server.aggregate import AggregateError, aggregate, check_structure, client_weights, stream_delta
from fedagent.server.merge import merge
from fedagent.server.optimizers import FedAvg
from fedagent.server.update_format import LORA, format_of
from fedagent.server.verify import verify_round

U32 = 2.0**-24
# A model with adapted projections (2-D, Llama names) and tensors LoRA never touches.
PREV = {
    "model.embed_tokens.weight": (37, 16),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.self_attn.v_proj.weight": (8, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 24),
    "model.layers.0.input_layernorm.weight": (16,),
}
ADAPTED = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"]


def _prev(tmp_path: Path) -> tuple[dict, Path]:
    g = torch_generator(5, "lora_test_prev")
    prev = {n: torch.randn(s, generator=g) * 0.05 for n, s in PREV.items()}
    return prev, save_model_dir(tmp_path / "prev", prev)


def write_update(d: Path, prev_dir: Path, factors: dict, rank: int, alpha: float, samples: int = 10, **cfg) -> Path:
    """A LoRA client update as train-client writes it: PEFT's two files, metrics.json, manifest."""
    d.mkdir(parents=True)
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[lora.factor_key(module, "A")] = a.float().contiguous()
        tensors[lora.factor_key(module, "B")] = b.float().contiguous()
    save_file(tensors, str(d / lora.ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "target_modules": [], **cfg}
    (d / lora.ADAPTER_CONFIG).write_text(json.dumps(config))
    metrics = {"num_samples": samples, "lora": {lora.START_MODEL_RECORD: lora.manifest_digest(prev_dir)}}
    (d / "metrics.json").write_text(json.dumps(metrics))
    write_manifest(d)
    return d


def random_factors(prev: dict, rank: int, index: int, modules=ADAPTED) -> dict:
    """Factors of the size a trained adapter has (B well away from its zero init): each client its own A."""
    g = torch_generator(5, "lora_test_factors", index=index)
    out = {}
    for m in modules:
        out_f, in_f = prev[m + ".weight"].shape
        out[m] = (torch.randn(rank, in_f, generator=g) * 0.3, torch.randn(out_f, rank, generator=g) * 0.05)
    return out


def lora_round(tmp_path: Path, ranks=(4, 2, 4), alphas=(8.0, 2.0, 8.0)):
    prev, prev_dir = _prev(tmp_path)
    dirs, facs = [], []
    for i, (r, a) in enumerate(zip(ranks, alphas)):
        f = random_factors(prev, r, i, ADAPTED if i != 1 else ADAPTED[:2])  # client 1 adapts fewer modules
        facs.append((a / r, f))
        dirs.append(write_update(tmp_path / f"c{i}", prev_dir, f, r, a, samples=10 * (i + 1)))
    return prev, prev_dir, facs, dirs


def float64_delta(prev: dict, facs, weights, mean_of_factors: bool = False) -> dict:
    """Σ_i w_i (α_i/r_i)·B_i·A_i per adapted weight (0 elsewhere), in float64; or the broken rule,
    the scaled product of the weighted mean factors (only meaningful for equal ranks and scales)."""
    out = {}
    for n, w in prev.items():
        module = n[: -len(".weight")]
        acc = torch.zeros(w.shape, dtype=torch.float64)
        if mean_of_factors:
            pairs = [(wt, s, f[module]) for (s, f), wt in zip(facs, weights) if module in f]
            if pairs:
                a = sum(wt * f[0].double() for wt, _, f in pairs)
                b = sum(wt * f[1].double() for wt, _, f in pairs)
                acc += pairs[0][1] * (b @ a)
        else:
            for (s, f), wt in zip(facs, weights):
                if module in f:
                    a, b = f[module]
                    acc += wt * s * (b.double() @ a.double())
        out[n] = acc
    return out


# ---- the update's files


def test_an_update_written_by_the_trainer_loads_in_peft_and_reads_on_the_server(tiny_model, tmp_path):
    """write_adapter's files are PEFT's: PeftModel.from_pretrained(base, update) gives W + (α/r)·B·A; the
    server's read (no peft) pairs every factor with the weight it adapts."""
    from peft import PeftModel

    from fedagent.model.policy import load_policy

    tiny = tiny_model(2)
    model, _ = load_policy(tiny, threads=1)
    settings = lora.LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj"))
    lora.add_adapters(model, settings, torch_generator(1, "t"))
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            layer.lora_B["default"].weight.normal_(generator=torch_generator(2, "b"))  # a trained B
    rec = lora.write_adapter(model, settings, tmp_path / "u")
    assert rec["adapted_weights"] == 4 and rec["rank"] == 4  # 2 layers × 2 projections
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]

    idx = lora.read_adapter(tmp_path / "u")
    assert idx.rank == 4 and idx.scale == 2.0
    assert sorted(idx.factors) == sorted(
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")
    )
    base, _ = load_policy(tiny, threads=1)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "u")).merge_and_unload()
    factors = load_file(tmp_path / "u" / lora.ADAPTER_WEIGHTS)
    plain = load_file(tiny / "model.safetensors")
    for name, (a, b) in idx.factors.items():
        want = plain[name].double() + 2.0 * factors[b.name].double() @ factors[a.name].double()
        got = peft_model.get_parameter(name).double()
        assert torch.allclose(got, want, rtol=0, atol=1e-6), name


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_rslora": True}, "use_rslora"),
        ({"use_dora": True}, "use_dora"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"bias": "all"}, "bias"),
        ({"r": 0}, "r=0"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_an_adapter_that_is_not_plain_lora_is_refused_by_name(tmp_path, change, message):
    prev, prev_dir = _prev(tmp_path)
    d = write_update(tmp_path / "c", prev_dir, random_factors(prev, 4, 0), 4, 8.0, **change)
    with pytest.raises(lora.AdapterError, match=message):
        lora.read_adapter(d)
    with pytest.raises(AggregateError, match=rf"client {d}: .*{message}"):
        check_structure(prev_dir, [d])


def test_fresh_adapters_change_nothing_and_come_from_their_seed_only(tiny_model, tmp_path):
    """B = 0: the adapted model's logits are the base model's, bit for bit; A is the seed's draw whatever the
    global RNG's state; adapters_off gives the base model back after training moved B."""
    from fedagent.model.policy import load_policy

    tiny = tiny_model(2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base, _ = load_policy(tiny, threads=1)
    want = base(input_ids=ids).logits
    states = []
    for global_seed in (0, 123):
        torch.manual_seed(global_seed)  # the global RNG's state must not matter
        model, _ = load_policy(tiny, threads=1)
        n = lora.add_adapters(model, lora.LoraSettings(rank=2), torch_generator(9, "lora_init", round=1))
        assert n == lora.lora_param_count(model) > 0
        assert [q for q in model.parameters() if q.requires_grad] and all(
            ("lora_" in name) == q.requires_grad for name, q in model.named_parameters()
        )
        assert torch.equal(model(input_ids=ids).logits, want)
        states.append(lora.adapter_state(model))
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            layer.lora_B["default"].weight.fill_(0.01)
    assert not torch.equal(model(input_ids=ids).logits, want)
    with lora.adapters_off(model) as off:
        assert torch.equal(off(input_ids=ids).logits, want)
    assert not torch.equal(model(input_ids=ids).logits, want)  # back on after the block


def test_merge_into_gives_the_rollout_copy_the_trained_weights(tiny_model, tmp_path):
    import copy

    from fedagent.model.policy import load_policy

    tiny = tiny_model(2)
    model, _ = load_policy(tiny, threads=1)
    copy_ = copy.deepcopy(model)
    lora.add_adapters(model, lora.LoraSettings(rank=2, alpha=4.0), torch_generator(9, "t"))
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            layer.lora_B["default"].weight.normal_(generator=torch_generator(3, "b"))
    lora.merge_into(copy_, model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.allclose(copy_(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_fedprox_on_lora_is_the_gradient_of_the_weights_distance(tiny_model, tmp_path):
    """μ/2·‖s·B·A‖² summed over the adapted weights: LoraAnchor's gradients are autograd's."""
    from fedagent.model.policy import load_policy
    from fedagent.train import fedprox

    model, _ = load_policy(tiny_model(2), threads=1)
    lora.add_adapters(model, lora.LoraSettings(rank=3, alpha=6.0), torch_generator(9, "t"))
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            layer.lora_B["default"].weight.normal_(generator=torch_generator(4, "b"))
    mu = 0.3
    loss = sum(
        0.5 * mu * ((layer.scaling["default"] * b @ a) ** 2).sum()
        for _, layer in lora.lora_layers(model)
        for a, b in [lora.factors(layer)]
    )
    loss.backward()
    want = {n: q.grad.clone() for n, q in model.named_parameters() if q.requires_grad}
    model.zero_grad(set_to_none=True)
    fedprox.add_proximal_grad(model, fedprox.LoraAnchor(model), mu)
    for n, q in model.named_parameters():
        if q.requires_grad:
            assert float((q.grad - want[n]).abs().max()) <= 1e-5 * float(want[n].abs().max()), n


# ---- the client's job


PARAMS = {**TINY_TRAIN, "lora": True, "lora_rank": 4, "lora_alpha": 8.0, "lora_lr": 1e-2}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_lora_client_sends_only_its_factors_byte_identically(tiny_dir, tmp_path):
    """The update is the adapter's two files (+ the job's records), the same bytes on a re-run; the base
    weights never moved; the KL term is live from the second epoch (the reference is the base, adapters
    off); the metrics say what was sent and what a full update would weigh."""
    from fedagent.train.local import TrainParams, train_client

    tiny = tiny_dir
    p = TrainParams.from_dict(PARAMS)
    outs = []
    for k in range(2):
        env = FakeEnv(mode="draw", win_if=lambda text: len(text) % 2 == 0)
        m = train_client(tiny, tiny, env, round=1, client=0, params=p, threads=1, out_dir=tmp_path / f"u{k}")
        outs.append((tmp_path / f"u{k}", m))
    (a, m), (b, _) = outs
    assert sorted(f.name for f in a.iterdir()) == sorted(
        [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, "manifest.json", "metrics.json", "provenance.json", "samples.jsonl"]
    )
    for f in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG, "provenance.json"):
        assert _sha(a / f) == _sha(b / f), f
    assert m["update_format"] == "lora" and m["params"]["lora_rank"] == 4 and m["params"]["lora_lr"] == 1e-2
    assert m["lora"][lora.START_MODEL_RECORD] == lora.manifest_digest(tiny)
    assert m["upload_bytes"] == sum(f.stat().st_size for f in (a / lora.ADAPTER_CONFIG, a / lora.ADAPTER_WEIGHTS))
    assert m["lora"]["full_model_bytes"] > 5 * m["upload_bytes"]
    assert max(s["grad_norm"] for s in m["steps"]) > 0 and max(s["kl"] for s in m["steps"] if s["epoch"] == 1) > 0
    factors = load_file(a / lora.ADAPTER_WEIGHTS)
    assert any(float(t.abs().max()) > 0 for k, t in factors.items() if k.endswith("lora_B.weight"))  # B moved
    # a full fine-tune with the same knobs still writes the model (LoRA's keys absent from its params)
    full = TrainParams.from_dict({k: v for k, v in PARAMS.items() if not k.startswith("lora")})
    mf = train_client(
        tiny, tiny, FakeEnv(mode="draw"), round=1, client=0, params=full, threads=1, out_dir=tmp_path / "f"
    )
    assert (tmp_path / "f" / "model.safetensors").is_file() and "update_format" not in mf
    assert not any(k.startswith("lora") for k in mf["params"]) and mf["upload_bytes"] > m["lora"]["full_model_bytes"]


def test_an_unknown_target_module_fails_the_job_naming_the_key(tiny_dir, tmp_path):
    from fedagent.model.policy import load_policy

    model, _ = load_policy(tiny_dir, threads=1)
    with pytest.raises(ValueError, match=r"train.lora.target_modules \['c_attn'\]"):
        lora.add_adapters(model, lora.LoraSettings(target_modules=("c_attn",)), torch_generator(1, "t"))


# ---- the server step


def test_the_aggregate_is_the_weighted_mean_of_the_products_not_of_the_factors(tmp_path):
    prev, prev_dir, facs, dirs = lora_round(tmp_path)
    assert format_of(dirs) is LORA
    s = aggregate(prev_dir, dirs, tmp_path / "agg", weighting="samples")
    assert s["update_format"] == "lora" and s["num_tensors"] == len(PREV)
    weights = client_weights(dirs, "samples")
    delta = load_file(tmp_path / "agg" / "delta.safetensors")
    exact = float64_delta(prev, facs, weights)
    magnitude = float64_delta(
        prev, [(s_, {m: (a.abs(), b.abs()) for m, (a, b) in f.items()}) for s_, f in facs], weights
    )
    for n, x in exact.items():
        assert delta[n].dtype == torch.float32 and delta[n].shape == prev[n].shape
        # fp32 rounding of the terms, as WeightedMean's bound (|B|·|A| bounds |B·A| elementwise)
        assert ((delta[n].double() - x).abs() <= 8 * U32 * (magnitude[n] + x.abs())).all(), n
    assert not delta["model.embed_tokens.weight"].any()  # frozen tensors: ΔW = 0
    # the broken rule is far from it (equal ranks and α: clients 0 and 2 alone)
    two = [facs[0], facs[2]]
    right, wrong = float64_delta(prev, two, [0.5, 0.5]), float64_delta(prev, two, [0.5, 0.5], mean_of_factors=True)
    n = "model.layers.0.mlp.down_proj.weight"
    assert float((right[n] - wrong[n]).abs().max()) > 0.1 * float(right[n].abs().max())
    # streamed by rows of B: any chunk size writes the same bytes
    p, c = check_structure(prev_dir, dirs)
    stream_delta(tmp_path / "a.safetensors", p, c, weights, dirs, fmt=LORA)
    stream_delta(tmp_path / "b.safetensors", p, *check_structure(prev_dir, dirs)[1:], weights, dirs, chunk=7, fmt=LORA)
    assert _sha(tmp_path / "a.safetensors") == _sha(tmp_path / "b.safetensors")


def test_merge_then_verify_passes_and_a_changed_factor_or_delta_fails_naming_it(tmp_path):
    prev, prev_dir, facs, dirs = lora_round(tmp_path)
    aggregate(prev_dir, dirs, tmp_path / "agg", weighting="samples")
    merge(prev_dir, tmp_path / "agg", tmp_path / "model", FedAvg(), round_=1)
    ok = verify_round(prev_dir, dirs, "samples", tmp_path / "agg", model_dir=tmp_path / "model")
    assert ok == []
    # the merged global model is prev + the mean of the products (FedAvg, lr 1), ≤ 1e-6 relative
    merged = load_file(tmp_path / "model" / "model.safetensors")
    exact = float64_delta(prev, facs, client_weights(dirs, "samples"))
    for n, w in prev.items():
        want = w.double() + exact[n]
        assert float((merged[n].double() - want).abs().max()) <= 1e-6 * float(want.abs().max()), n
    # a client's B changed after the round (re-signed): the recomputation names the tensor
    bad = tmp_path / "tampered" / dirs[0].name  # aggregate.json's clients are matched by folder name
    shutil.copytree(dirs[0], bad)
    t = load_file(bad / lora.ADAPTER_WEIGHTS)
    key = lora.factor_key(ADAPTED[2], "B")
    t[key] = t[key] * 1.001
    save_file(t, str(bad / lora.ADAPTER_WEIGHTS))
    write_manifest(bad)
    fails = verify_round(prev_dir, [bad, *dirs[1:]], "samples", tmp_path / "agg")
    assert any("aggregate: tensor 'model.layers.0.mlp.down_proj.weight'" in f for f in fails), fails


@pytest.mark.parametrize("case", ["mixed", "other_start", "unknown_weight", "shape"])
def test_a_lora_round_refuses_updates_it_cannot_apply(tmp_path, case):
    prev, prev_dir, _, dirs = lora_round(tmp_path)
    if case == "mixed":  # a full-model update among LoRA updates
        full = save_model_dir(tmp_path / "full", prev, json_files={"metrics.json": {"num_samples": 1}})
        dirs, msg = [dirs[0], full], rf"client {full}: a full-model update among LoRA updates"
    elif case == "other_start":  # factors trained on another global model
        m = json.loads((dirs[1] / "metrics.json").read_text())
        m["lora"][lora.START_MODEL_RECORD] = "0" * 64
        (dirs[1] / "metrics.json").write_text(json.dumps(m))
        write_manifest(dirs[1])
        msg = rf"client {dirs[1]}: its adapters were trained on the model whose manifest has sha256 0000"
    elif case == "unknown_weight":
        f = random_factors(prev, 2, 7)
        f["model.layers.9.mlp.up_proj"] = (torch.zeros(2, 16), torch.zeros(16, 2))
        dirs = [write_update(tmp_path / "u", prev_dir, f, 2, 4.0)]
        msg = r"adapts 'model.layers.9.mlp.up_proj.weight', which prev"
    else:
        f = random_factors(prev, 2, 7)
        f[ADAPTED[0]] = (torch.zeros(2, 15), torch.zeros(16, 2))
        dirs = [write_update(tmp_path / "u", prev_dir, f, 2, 4.0)]
        msg = r"factors of 'model.layers.0.self_attn.q_proj.weight' \(B \[16, 2\], A \[2, 15\]\) do not make"
    with pytest.raises(AggregateError, match=msg):
        aggregate(prev_dir, dirs, tmp_path / "agg", check_manifests=False)
    assert not (tmp_path / "agg").exists()


def test_verify_cli_checks_the_recorded_format(tmp_path):
    prev, prev_dir, _, dirs = lora_round(tmp_path)
    aggregate(prev_dir, dirs, tmp_path / "agg", weighting="samples")
    summary = json.loads((tmp_path / "agg" / "aggregate.json").read_text())
    del summary["update_format"]  # as if the aggregate had read the updates as full models
    (tmp_path / "agg" / "aggregate.json").write_text(json.dumps(summary))
    write_manifest(tmp_path / "agg")
    proc = subprocess.run(
        [sys.executable, "-m", "fedagent.cli", "verify", "--prev", str(prev_dir), "--clients", *map(str, dirs)]
        + ["--weighting", "samples", "--aggregate", str(tmp_path / "agg")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "update_format 'full' != the clients' 'lora'" in proc.stderr, proc.stderr


# ---- config, memory and disk


def test_the_schema_offers_the_projections_the_trainer_knows():
    from fedagent.core.config import subschema

    sub = subschema("train.lora.target_modules")
    assert tuple(sub["items"]["enum"]) == lora.PROJECTIONS and tuple(sub["default"]) == lora.PROJECTIONS


def test_memory_and_disk_estimates_count_adapters_not_the_model():
    from fedagent.core.config import load_config
    from fedagent.model import memory
    from fedagent.report import disk_need

    repo = Path(__file__).resolve().parent.parent
    full = load_config(repo / "config/experiments/gpu-scale-webshop.yaml", {"train.gpu_mem_gb": None})
    lo = load_config(
        repo / "config/experiments/gpu-scale-webshop.yaml",
        {"train.gpu_mem_gb": None, "train.lora": {"enabled": True, "rank": 16}},
    )
    shape = memory.shape_of_source(full["model"])
    n = memory.lora_param_count(shape, 16, lora.PROJECTIONS)
    assert n == 24 * 16 * (2048 * 8 + 3 * (2048 + 8192))  # SmolLM2-1.7B: q/k/v/o 2048², gate/up/down 2048×8192
    t_full, t_lora = memory.train_config_terms(full, shape), memory.train_config_terms(lo, shape)
    assert t_lora["adapters_and_adamw"] == 16 * n and t_lora["frozen_base"] == memory.reference_bytes(shape)
    assert t_lora["reference"] == 0 and sum(t_lora.values()) < sum(t_full.values()) - 20 * memory.GIB
    assert memory.job_gpu_mib(lo, "train") < memory.job_gpu_mib(full, "train")
    one, _, update = disk_need.dir_bytes(lo)
    assert update == 4 * n and one / update > 50
    assert memory.job_host_mib(lo, "train") < memory.job_host_mib(full, "train")


def test_a_bf16_global_model_stays_bf16_and_verifies_with_its_dtype(tmp_path):
    """model_dtype bfloat16: the delta and the merged weights are stored bf16 (half the disk), the step is
    fp32; verify with --dtype bfloat16 passes, and without it names the dtype it expected."""
    prev, prev_dir = _prev(tmp_path)
    prev = {n: t.to(torch.bfloat16) for n, t in prev.items()}
    shutil.rmtree(prev_dir)
    prev_dir = save_model_dir(tmp_path / "prev", prev)
    facs, dirs = [], []
    for i in range(2):
        f = random_factors(prev, 4, i)
        facs.append((2.0, f))
        dirs.append(write_update(tmp_path / f"c{i}", prev_dir, f, 4, 8.0))
    s = aggregate(prev_dir, dirs, tmp_path / "agg", store="bfloat16")
    assert s["dtype"] == "BF16"
    meta = merge(prev_dir, tmp_path / "agg", tmp_path / "model", FedAvg(), round_=1, store="bfloat16")
    assert meta["dtype"] == "bfloat16"
    merged = load_file(tmp_path / "model" / "model.safetensors")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert {t.dtype for t in load_file(tmp_path / "agg" / "delta.safetensors").values()} == {torch.bfloat16}
    exact = float64_delta(prev, facs, [0.5, 0.5])
    for n, w in prev.items():
        want = w.double() + exact[n]
        # fp32 step, then one bf16 rounding of the delta and one of the weight
        assert float((merged[n].double() - want).abs().max()) <= 2**-7 * float(want.abs().max()), n
    assert (
        verify_round(prev_dir, dirs, "uniform", tmp_path / "agg", model_dir=tmp_path / "model", store="bfloat16") == []
    )
    fails = verify_round(prev_dir, dirs, "uniform", tmp_path / "agg", model_dir=tmp_path / "model")
    assert any("is BF16[16, 16], expected F32[16, 16]" in f for f in fails), fails


def test_the_7b_preset_fits_one_gpu_per_client_and_a_one_gpu_nodes_disk():
    """config/experiments/gpu-lora-7b.yaml: Qwen2.5-7B's shape with LoRA clients; each train job fits an
    H100 (80 GB, one client per card), the two fit one H200 at once, and the run writes ≈ 46 GB (its bf16
    global model), within a 64 GiB node's disk; the fp32 global model would not be."""
    from fedagent.core.config import load_config
    from fedagent.model import memory
    from fedagent.report import disk_need

    repo = Path(__file__).resolve().parent.parent
    cfg = load_config(repo / "config/experiments/gpu-lora-7b.yaml")
    assert (
        cfg["model"] == "random:qwen2.5-7b" and cfg["train"]["lora"]["enabled"] and cfg["train"]["lora"]["rank"] <= 32
    )
    train, ev = memory.job_gpu_mib(cfg, "train"), memory.job_gpu_mib(cfg, "eval")
    assert max(train, ev) <= 79000 and 2 * train <= 138000, (train, ev)
    need = disk_need.run_need(cfg, "results/x", [1], exists=lambda p: False).total
    assert need < 50e9
    fp32 = disk_need.run_need({**cfg, "model_dtype": "float32"}, "results/x", [1], exists=lambda p: False).total
    assert fp32 > 64 * 2**30


def test_the_adapters_dropout_is_seeded_and_only_in_the_update(tiny_model, tmp_path):
    """train.lora.dropout: masks from the job's seeded generator (the same seed, the same masks; the global
    RNG plays no part), only where autograd records (the update's forward); the behaviour, reference and
    rollout passes (no grad) see no dropout."""
    from fedagent.model.policy import load_policy

    tiny = tiny_model(2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    outs = []
    for global_seed in (0, 99):
        torch.manual_seed(global_seed)  # the global RNG's state must not matter
        model, _ = load_policy(tiny, threads=1)
        settings = lora.LoraSettings(rank=2, dropout=0.5)
        lora.add_adapters(model, settings, torch_generator(9, "init"), torch_generator(9, "lora_dropout"))
        with torch.no_grad():
            for _, layer in lora.lora_layers(model):
                layer.lora_B["default"].weight.fill_(0.05)
                assert isinstance(layer.lora_dropout["default"], lora.SeededDropout)
            plain = model(input_ids=ids).logits
            assert torch.equal(plain, model(input_ids=ids).logits)  # no grad: no dropout
        outs.append((plain, model(input_ids=ids).logits.detach()))  # autograd on: masked
    (plain_a, drop_a), (plain_b, drop_b) = outs
    assert not torch.equal(plain_a, drop_a)
    assert torch.equal(plain_a, plain_b) and torch.equal(drop_a, drop_b)
