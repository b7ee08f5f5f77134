"""Security defaults (issue 13): loopback/Unix-socket services, no unpickling, paths inside results_dir."""

from __future__ import annotations

import argparse
import ast
import socket
from pathlib import Path

import pytest

from fedagent.core.config import ConfigError, validate_schema

PACKAGE = Path(__file__).resolve().parent.parent / "fedagent"


# ---- services bind a Unix socket or loopback only -----------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.org", ""])
def test_env_service_refuses_a_non_loopback_host(host, capsys):
    from fedagent.cli import main

    rc = main(["serve-env", "--games", "/nonexistent", "--split", "train", "--all", "--port", "0", "--host", host])
    assert rc == 2 and "not a loopback address" in capsys.readouterr().err
    from fedagent.envs.serve import bind_socket

    with pytest.raises(ValueError, match="not a loopback address"):
        bind_socket(argparse.Namespace(uds=None, host=host, port=0))


def test_env_service_tcp_binds_loopback_and_uds_binds_a_socket_file(tmp_path):
    from fedagent.envs.serve import bind_socket

    sock, where = bind_socket(argparse.Namespace(uds=None, host="127.0.0.1", port=0))
    try:
        assert sock.getsockname()[0] == "127.0.0.1" and where["host"] == "127.0.0.1"
    finally:
        sock.close()
    sock, where = bind_socket(argparse.Namespace(uds=tmp_path / "s.sock", host="127.0.0.1", port=None))
    try:
        assert sock.family == socket.AF_UNIX and where == {"uds": str(tmp_path / "s.sock")}
    finally:
        sock.close()


def test_job_services_default_to_a_unix_socket():
    import inspect

    from fedagent.envs import lifecycle

    assert inspect.signature(lifecycle.env_service).parameters["tcp"].default is False
    src = inspect.getsource(lifecycle)
    assert '"--host", "127.0.0.1"' in src  # the TCP option is loopback too


# ---- no unpickling of untrusted files ------------------------------------------------------


def _unsafe_loads(tree: ast.AST) -> list[str]:
    """Calls that can unpickle (or otherwise execute) a file's content."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, base = node.func.attr, node.func.value
        owner = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        kw = {k.arg: k.value for k in node.keywords}

        def true(name):
            return isinstance(kw.get(name), ast.Constant) and kw[name].value is True

        where = f"line {node.lineno}: {owner}.{attr}"
        if owner in ("pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve") and attr in (
            "load",
            "loads",
            "open",
            "Unpickler",
        ):
            bad.append(where)
        elif owner == "torch" and attr == "load" and not true("weights_only"):
            bad.append(where + " without weights_only=True")
        elif (
            owner in ("np", "numpy")
            and attr == "load"
            and "allow_pickle" in kw
            and not (isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False)
        ):
            bad.append(where + " with allow_pickle")
        elif (
            owner == "yaml"
            and attr in ("load", "unsafe_load", "full_load", "load_all")
            and not (
                attr in ("load", "load_all")
                and isinstance(kw.get("Loader"), ast.Attribute)
                and kw["Loader"].attr in ("SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader")
            )
        ):
            bad.append(where + " (use yaml.safe_load)")
        elif owner in ("pd", "pandas") and attr == "read_pickle":
            bad.append(where)
        elif (
            owner.startswith("AutoModel")
            and attr == "from_pretrained"
            and not (true("use_safetensors") or "gguf_file" in kw)
        ):
            bad.append(where + " without use_safetensors=True")
    return bad


def test_the_unsafe_load_scan_finds_what_it_should():
    code = (
        "torch.load(p)\npickle.loads(b)\nnp.load(p, allow_pickle=True)\nyaml.load(t)\n"
        "AutoModelForCausalLM.from_pretrained(d)\ntorch.load(p, weights_only=True)\n"
        "AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)\nyaml.safe_load(t)\n"
        "yaml.load(t, Loader=yaml.BaseLoader)\nyaml.load(t, Loader=yaml.SafeLoader)\n"
    )
    assert len(_unsafe_loads(ast.parse(code))) == 5


def test_no_module_unpickles_or_loads_weights_unsafely():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += [f"{path.relative_to(PACKAGE.parent)}: {b}" for b in _unsafe_loads(ast.parse(path.read_text()))]
    assert found == []


def test_a_pickled_checkpoint_in_a_model_dir_is_refused_not_loaded(tmp_path):
    """load_policy reads safetensors only: a model dir whose weights are a pickle is refused."""
    import torch

    from fedagent.core.atomic import write_manifest
    from fedagent.model.base_model_tiny import build_model, build_tokenizer
    from fedagent.model.policy import load_policy

    tok = build_tokenizer()
    model = build_model(len(tok), seed=1)
    model.config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a loadable pickle
    write_manifest(tmp_path)
    with pytest.raises((OSError, ValueError, EnvironmentError), match="safetensors"):
        load_policy(tmp_path, threads=1)


# ---- run/output paths cannot escape results_dir --------------------------------------------


@pytest.mark.parametrize("run", ["../escape", "a/../../b", "/etc", "a/b", "..", ".hidden", "x\ny", ""])
def test_run_name_cannot_escape_results_dir(run):
    with pytest.raises(ConfigError, match="config key 'run'"):
        validate_schema({"run": run})


def test_plain_run_names_are_fine():
    assert validate_schema({"run": "exp-1.a_b"})["run"] == "exp-1.a_b"
