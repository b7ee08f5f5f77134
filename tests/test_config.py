"""Config validation: schema defaults, cross-field checks, messages that name the key."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedagent.core.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


def test_default_config_is_valid():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg["rounds"] >= 2 and cfg["clients"]["total"] >= 2 and cfg["model"] == "smollm2"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"rounds": -1}, "rounds"),
        ({"clients.per_round": 5}, "clients.per_round"),
        ({"train.lr": "fast"}, "train.lr"),
        ({"train.bogus": 1}, "train.bogus"),
        ({"server.optimizer": "sgd"}, "server.optimizer"),
        ({"model": "/nonexistent/model"}, "model"),
        ({"partition.min_tasks_per_client": 99}, "partition.min_tasks_per_client"),
    ],
)
def test_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(REPO / "config" / "config.yaml", overrides)


def test_cli_exits_nonzero_with_one_message(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump({"rounds": 2, "eval": {"n": 0}}))
    proc = subprocess.run(
        [sys.executable, "-m", "fedagent.cli", "check-config", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "eval.n" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "overrides, message, job",
    [
        (
            {"train.backend": "verl", "train.ref_anchor": "round", "train.fedprox_mu": 0.01},
            "config key 'train.fedprox_mu': FedProx is implemented for train.backend=local only "
            "(the verl backend would ignore it)",
            "train-client-verl",
        ),
        (
            {"train.backend": "verl", "train.ref_anchor": "round", "rollout.mode": "concat"},
            "config key 'rollout.mode': 'concat' is implemented for train.backend=local only (verl trains windowed)",
            "train-client-verl",
        ),
        (
            {"train.algorithm": "ppo", "rollout.mode": "concat"},
            "config key 'rollout.mode': 'concat' with train.algorithm=ppo: PPO's GAE is per turn (windowed) only",
            "train-client-verl",
        ),
        (
            {"train.residual_dtype": "bfloat16"},
            "config key 'train.residual_dtype': 'bfloat16' trains on train.device=cuda only (the CPU path is fp32 and "
            "byte-deterministic; got 'cpu')",
            "train-client",
        ),
        (
            {
                "train.residual_dtype": "bfloat16",
                "train.device": "cuda",
                "train.backend": "verl",
                "train.ref_anchor": "round",
            },
            "config key 'train.residual_dtype': 'bfloat16' is implemented for train.backend=local only (verl keeps its "
            "own mixed precision)",
            "train-client-verl",
        ),
        (
            {"warm_start.enabled": True, "rollout.mode": "concat"},
            "config key 'warm_start.enabled': the expert warm start plays its demonstrations windowed (got "
            "rollout.mode='concat')",
            "warm-start",
        ),
        (
            {"train.backend": "verl", "train.ref_anchor": "round", "train.clip_ratio_c": None},
            "config key 'train.clip_ratio_c': null (no dual-clip) is implemented for train.backend=local only (verl's "
            "vanilla policy loss always caps at clip_ratio_c > 1; got 'verl')",
            "train-client-verl",
        ),
        (
            {"train.backend": "verl", "train.ref_anchor": "round", "train.activation_checkpointing": True},
            "config key 'train.activation_checkpointing': True is implemented for train.backend=local only (the verl "
            "backend would ignore it; got 'verl')",
            "train-client-verl",
        ),
        (
            {"train.compile_train": True, "train.activation_checkpointing": True, "train.device": "cuda"},
            "config key 'train.compile_train': True with train.activation_checkpointing: the compiled, CUDA-graphed "
            "training step with checkpointed layers fails on its first backward on the GPU (docs/results/scale-1p7b.md); "
            "set one of them to false",
            "train-client",
        ),
        (
            {"deterministic": True, "train.backend": "verl", "train.ref_anchor": "round"},
            "config key 'deterministic': True needs train.backend=local (verl's vLLM rollout has no deterministic "
            "mode; got 'verl')",
            "train-client-verl",
        ),
        (
            {"deterministic": True, "eval.backend": "vllm"},
            "config key 'deterministic': True needs eval.backend=local (vLLM has no deterministic mode; got 'vllm')",
            "eval-backend",
        ),
        (
            {"deterministic": True, "train.compile_train": True, "train.device": "cuda"},
            "config key 'deterministic': True with train.compile_train: the CUDA-graphed training step cannot hold "
            "the deterministic index_put_ of its backward (a host-side index check); set train.compile_train: false",
            "train-client",
        ),
    ],
)
def test_local_only_features_are_refused_with_their_own_message(overrides, message, job):
    """One row per config.REQUIREMENTS entry: the exact refusal, at plan time and in the job
    that carries the rule's keys."""
    import fedagent.train.local  # noqa: F401  (registers the train-client JobKeys)
    import fedagent.train.verl.backend  # noqa: F401  (registers the train-client-verl JobKeys)
    import fedagent.train.warm_start  # noqa: F401  (registers the warm-start JobKeys)
    import fedagent.evaluate.validation  # noqa: F401  (registers the eval-backend JobKeys)
    from fedagent.core.config import JOB_KEYS, REQUIREMENTS

    assert len(REQUIREMENTS) == 12
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "config" / "config.yaml", overrides)
    assert str(err.value) == message
    train = JOB_KEYS[job]
    good = train.from_config(load_config(REPO / "config" / "config.yaml"))
    bad = {**good, **{p: v for p, k in train.keys.items() for key, v in overrides.items() if k == key}}
    with pytest.raises(ConfigError) as err:
        train.check(bad)
    assert str(err.value) == message


def test_deterministic_needs_every_backend_key_local():
    """``deterministic``'s Requirements come from DETERMINISTIC_NEEDS: every backend key of the schema has
    its row (needs local), and each of its other values is refused with the key on, naming it."""
    from fedagent.core.config_rules import DETERMINISTIC_NEEDS
    from fedagent.core.schema import leaf_keys, subschema

    backends = [k for k in leaf_keys() if k.rsplit(".", 1)[-1] == "backend"]
    assert {"train.backend", "eval.backend"} <= set(backends)
    rows = {key: (need, violation) for key, need, _, violation in DETERMINISTIC_NEEDS}
    for key in backends:
        assert key in rows and rows[key][0] == "local", f"deterministic: no DETERMINISTIC_NEEDS row for {key}"
        for value in subschema(key)["enum"]:
            if value == "local":
                continue
            overrides = {**rows[key][1], "deterministic": True, key: value}
            with pytest.raises(ConfigError, match=rf"^config key 'deterministic': True needs {key}=local \("):
                load_config(REPO / "config" / "config.yaml", overrides)


@pytest.mark.parametrize("section", ["train", "eval"])
def test_sampler_widths_need_the_gpu_path_and_sit_below_the_widest(section):
    """train/eval.sampler_widths (issue 29's width buckets): each below max_prompt_tokens, GPU local path only."""
    cfg = REPO / "config" / "config.yaml"
    with pytest.raises(ConfigError, match=f"'{section}.sampler_widths'.*{section}.device cuda; got 'cpu'"):
        load_config(cfg, {f"{section}.sampler_widths": [64]})
    gpu = {f"{section}.device": "cuda", f"{section}.max_prompt_tokens": 512}
    with pytest.raises(
        ConfigError,
        match=rf"'{section}.sampler_widths'.*\[512\]: each width must be below "
        f"{section}.max_prompt_tokens=512",
    ):
        load_config(cfg, {**gpu, f"{section}.sampler_widths": [256, 512]})
    with pytest.raises(ConfigError, match=f"'{section}.sampler_widths'"):
        load_config(cfg, {**gpu, f"{section}.sampler_widths": [128, 128]})
    got = load_config(cfg, {**gpu, f"{section}.sampler_widths": [128, 256]})
    assert got[section]["sampler_widths"] == [128, 256]


@pytest.mark.parametrize("section", ["train", "eval"])
@pytest.mark.parametrize("switch", ["sampler_fused", "sampler_compile_prefill"])
def test_sampler_switches_need_the_gpu_path(section, switch):
    """train/eval.sampler_fused (merged projections) and sampler_compile_prefill (the compiled prefill)
    of the static-cache sampler: never silently unused on the CPU."""
    cfg = REPO / "config" / "config.yaml"
    with pytest.raises(ConfigError, match=f"'{section}.{switch}'.*{section}.device cuda; got 'cpu'"):
        load_config(cfg, {f"{section}.{switch}": True})
    assert load_config(cfg, {f"{section}.device": "cuda", f"{section}.{switch}": True})[section][switch]
    assert load_config(cfg, {})[section][switch] is False
    gpu = load_config(cfg, {f"{section}.device": "cuda", f"{section}.sampler": "compile_graph"})
    assert gpu[section]["sampler"] == "compile_graph"


@pytest.mark.parametrize("section, engine", [("train", "verl"), ("eval", "vllm")])
def test_sampler_keys_with_a_backend_that_runs_its_own_engine_are_refused(section, engine):
    """The static-cache sampler's keys would be silently unused by verl / vLLM: an error at plan time
    naming the key (seen passing silently before this rule)."""
    cfg = REPO / "config" / "config.yaml"
    base = {
        f"{section}.device": "cuda",
        f"{section}.backend": engine,
        **({"train.ref_anchor": "round"} if section == "train" else {}),
    }
    load_config(cfg, base)  # the defaults pass
    for key, value in (("sampler", "graph"), ("sampler_fused", True), ("sampler_compile_prefill", True)):
        with pytest.raises(ConfigError, match=f"config key '{section}.{key}'.*{section}.backend {engine} does not use"):
            load_config(cfg, {**base, f"{section}.{key}": value})
