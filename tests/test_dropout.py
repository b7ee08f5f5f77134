"""fedagent drop-client and aggregate's survivors rule (clients.min_per_round), without Snakemake."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fedagent.server.aggregate import AggregateError, aggregate
from fedagent.core.atomic import verify_manifest
from fedagent.cli import main as cli_main
from test_aggregate import make_round


def _drop(tmp_path, out, attempt, drop_at):
    log = tmp_path / "train.log"
    log.write_text("loading\nRuntimeError: CUDA out of memory\n")
    return cli_main(
        [
            "drop-client",
            "--out",
            str(out),
            "--round",
            "3",
            "--client",
            "1",
            "--exit-code",
            "1",
            "--attempt",
            str(attempt),
            "--drop-at-attempt",
            str(drop_at),
            "--log",
            str(log),
        ]
    )


def test_drop_client_strict_or_attempts_left_fails_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "clients" / "1"
    assert _drop(tmp_path, out, 1, 0) == 1 and "not dropped: strict" in capsys.readouterr().err
    assert _drop(tmp_path, out, 1, 2) == 1 and "Snakemake retries it" in capsys.readouterr().err
    assert not out.exists()


def test_drop_client_last_attempt_writes_a_checked_record(tmp_path):
    out = tmp_path / "clients" / "1"
    assert _drop(tmp_path, out, 2, 2) == 0
    assert sorted(verify_manifest(out)["files"]) == ["dropped.json", "provenance.json"]
    rec = json.loads((out / "dropped.json").read_text())
    assert rec["reason"] == "train_client exited 1 after 2 attempt(s): RuntimeError: CUDA out of memory"
    assert rec["round"] == 3 and rec["client"] == 1


def test_aggregate_strict_refuses_a_drop_record_by_name(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    _drop(tmp_path, tmp_path / "client2", 1, 1)
    with pytest.raises(AggregateError, match=r"only 2 of 3 clients finished \(strict.*client2: train_client exited 1"):
        aggregate(prev_dir, [*dirs, tmp_path / "client2"], tmp_path / "agg")
    with pytest.raises(AggregateError, match="only 2 of 3 clients finished"):
        aggregate(prev_dir, [*dirs, tmp_path / "client2"], tmp_path / "agg", min_clients=3)
    assert not (tmp_path / "agg").exists()


def test_aggregate_min_clients_averages_the_survivors(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    _drop(tmp_path, tmp_path / "client2", 1, 1)
    s = aggregate(prev_dir, [dirs[0], tmp_path / "client2", dirs[1]], tmp_path / "agg", min_clients=1)
    assert [c["dir"] for c in s["clients"]] == [str(dirs[0]), str(dirs[1])]
    assert s["dropped"][0]["dir"] == str(tmp_path / "client2")
    aggregate(prev_dir, dirs, tmp_path / "agg_ref")
    a, b = load_file(tmp_path / "agg" / "delta.safetensors"), load_file(tmp_path / "agg_ref" / "delta.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)  # the drop record changes nothing but the listing
    prov = json.loads((tmp_path / "agg" / "provenance.json").read_text())
    assert prov["dropped"] == s["dropped"] and prov["job"] == "aggregate"


def test_min_per_round_above_per_round_is_a_config_error():
    from fedagent.core.config import ConfigError, check_cross_fields, validate_schema

    cfg = validate_schema({"model": "tiny", "clients": {"total": 4, "per_round": 2, "min_per_round": 3}})
    with pytest.raises(ConfigError, match="clients.min_per_round"):
        check_cross_fields(cfg)
    assert validate_schema({"model": "tiny"})["clients"]["min_per_round"] is None  # strict by default
