"""The job epilogue (fedagent.train.epilogue): the one writer of both training backends' update dirs.

The backends' own tests (test_grpo, test_ppo, test_verl_isolation, ...) check their updates end to end;
these check the epilogue's contract with fake model writers: what the dir holds and in which bytes, the
critic's record, and that nothing is written before the job's input checks pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedagent.core.atomic import MANIFEST, ManifestError, verify_manifest
from fedagent.core.timing import PhaseClock
from fedagent.model.critic_dir import CRITIC_RECORD, critic_digests
from fedagent.train.epilogue import ModelUpdate, write_client_update, write_model_update


def _hf_dir(tag: str):
    """A writer of a stand-in HF dir (its bytes name ``tag``)."""

    def write(d: Path):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"tag": tag}))
        (d / "model.safetensors").write_bytes(tag.encode())

    return write


def test_the_update_dir_holds_the_model_the_records_and_the_manifest(tmp_path):
    samples = [{"epoch": 0, "b": 1, "a": 2}, {"epoch": 1, "a": 3}]
    seen = {}

    def metrics(policy):
        seen["policy"] = policy
        # insertion order unlike the sorted bytes: the files must not depend on it
        return {"z": 1, "a": {"y": 2, "b": 3}}

    def write_policy(d):
        _hf_dir("policy")(d)
        return {"world_size": 2}

    out = tmp_path / "round_001" / "clients" / "0"
    m = write_client_update(
        out,
        ModelUpdate(write_policy=write_policy, write_critic=_hf_dir("critic")),
        metrics=metrics,
        samples=samples,
        clock=PhaseClock(start=0.0),
        provenance={"job": "train_client", "params": {"lr": 1.0}, "backend": "local"},
    )
    assert seen["policy"] == {"world_size": 2}
    files = set(verify_manifest(out)["files"])
    assert files == {
        "config.json",
        "model.safetensors",
        "critic/config.json",
        "critic/model.safetensors",
        "metrics.json",
        "samples.jsonl",
        "provenance.json",
    }
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == m and m[CRITIC_RECORD] == critic_digests(out) and "saved" in m["timings"]["marks"]
    assert (out / "metrics.json").read_text() == json.dumps(m, indent=1, sort_keys=True) + "\n"
    assert (out / "samples.jsonl").read_text().splitlines() == [json.dumps(s, sort_keys=True) for s in samples]
    assert json.loads((out / "provenance.json").read_text())["params"] == {"lr": 1.0}
    assert not list(out.parent.glob(".partial-*"))


def test_without_a_critic_or_provenance_the_update_has_neither(tmp_path):
    out = tmp_path / "u"
    m = write_client_update(
        out, ModelUpdate(write_policy=_hf_dir("p")), metrics=lambda _: {}, samples=[], clock=PhaseClock(start=0.0)
    )
    assert CRITIC_RECORD not in m
    assert set(verify_manifest(out)["files"]) == {"config.json", "model.safetensors", "metrics.json", "samples.jsonl"}
    written = write_model_update(tmp_path / "v", ModelUpdate(write_policy=_hf_dir("p")))
    # what the client sends: every file of the model update
    assert written.record == {"upload_bytes": sum(f.stat().st_size for f in (tmp_path / "v").iterdir())}


def test_an_update_is_the_full_model_or_the_adapter_never_both(tmp_path):
    """A LoRA update (write_adapter) is laid out by the same function: its files at the top, the format and
    the writer's record in the metrics; a writer of each, or neither, is refused."""
    from fedagent.model.lora import ADAPTER_CONFIG

    def adapter(d):
        d.mkdir(parents=True, exist_ok=True)
        (d / ADAPTER_CONFIG).write_text("{}")
        return {"rank": 2}

    w = write_model_update(tmp_path / "a", ModelUpdate(write_adapter=adapter))
    assert w.record == {"update_format": "lora", "lora": {"rank": 2}, "upload_bytes": 2} and w.policy == {}
    for bad in (ModelUpdate(), ModelUpdate(write_policy=_hf_dir("p"), write_adapter=adapter)):
        with pytest.raises(ValueError, match="exactly one writer"):
            write_model_update(tmp_path / "b", bad)


def test_the_server_reads_the_format_the_epilogue_writes(tmp_path):
    """Both sides name an update's format by fedagent.model.update_layout: the format a LoRA update's
    metrics record is the one the server step finds in its files (a full update records none)."""
    from fedagent.model import update_layout as layout
    from fedagent.server.update_format import FULL_MODEL, format_of

    def adapter(d):
        d.mkdir(parents=True, exist_ok=True)
        (d / layout.ADAPTER_CONFIG).write_text("{}")
        return {}

    w = write_model_update(tmp_path / "a", ModelUpdate(write_adapter=adapter))
    assert format_of([tmp_path / "a"]).name == w.record[layout.FORMAT_RECORD] == layout.LORA
    full = write_model_update(tmp_path / "f", ModelUpdate(write_policy=_hf_dir("p")))
    assert layout.FORMAT_RECORD not in full.record
    assert format_of([tmp_path / "f"]) is FULL_MODEL and FULL_MODEL.name == layout.FULL


class _FailedCheck:
    def wait(self):
        raise ManifestError("start model: sha256 differs from manifest")


def test_nothing_is_written_before_the_inputs_verified(tmp_path):
    """A failed input check (verl: the start model's sha256, checked while the job ran) leaves no update
    and never reaches the model writer: nothing derived from an unverified input is written."""
    written = []
    out = tmp_path / "clients" / "0"
    with pytest.raises(ManifestError):
        write_client_update(
            out,
            ModelUpdate(write_policy=lambda d: written.append(d)),
            metrics=lambda _: {},
            samples=[],
            clock=PhaseClock(start=0.0),
            quarantine=tmp_path / "_failed",
            inputs=_FailedCheck(),
        )
    assert not written and not out.exists()
    # the staging dir went to quarantine, as any failed attempt's does
    (failed,) = (tmp_path / "_failed").iterdir()
    assert failed.name == "clients__0.attempt1" and not (failed / MANIFEST).exists()
