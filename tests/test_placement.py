"""Per-card placement on one machine (fedagent.core.placement) with an injected device list (FEDAGENT_GPUS):
the cards through the parent's CUDA_VISIBLE_DEVICES, concurrent jobs spread over cards, a card's memory never
over-committed by parallel claimers, a SIGKILLed claimer's claim reclaimed, the entry point's placement (cold and
through a warm server, per-card standbys), the errors before any job."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedagent.core import placement
from fedagent.core.placement import Card, Ledger, PlacementError


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """Four injected 10000-MiB cards (no reserve), a private ledger, no parent restriction."""
    monkeypatch.setenv(placement.GPUS_ENV, "0:10000,1:10000,2:10000,3:10000")
    monkeypatch.setenv(placement.RESERVE_ENV, "0")
    monkeypatch.setenv(placement.LEDGER_ENV, str(tmp_path / "ledger"))
    for key in ("CUDA_VISIBLE_DEVICES", placement.PLACED_ENV, placement.JOB_GPUS_ENV, placement.JOB_MEM_ENV):
        monkeypatch.delenv(key, raising=False)
    return tmp_path / "ledger"


def test_cards_through_the_parents_cuda_visible_devices():
    cards = placement.parse_gpus("0:100,1:200,2:300,3:400")
    assert [c.name for c in placement.visible(cards, None)] == ["0", "1", "2", "3"]
    seen = placement.visible(cards, "1,3")
    assert [(c.index, c.name) for c in seen] == [(1, "1"), (3, "3")]
    assert placement.visible(cards, "") == []
    assert placement.visible(cards, "2,-1,0") == [Card(2, 300, None, "2")]  # as CUDA: stops at an invalid entry
    uuids = [Card(0, 100, "GPU-aaaa-1"), Card(1, 200, "GPU-bbbb-2")]
    seen = placement.visible(uuids, "GPU-bbbb")  # a unique prefix, named as the parent wrote it
    assert [(c.index, c.name) for c in seen] == [(1, "GPU-bbbb")]
    with pytest.raises(PlacementError, match="FEDAGENT_GPUS"):
        placement.parse_gpus("0:100,1")


def test_choice_spreads_and_never_straddles(gpus):
    cards = placement.parse_gpus("0:1000,1:1000,2:1000")
    cards = [c for c in placement.visible(cards, None)]
    claims: list[dict] = []
    got = []
    for _ in range(3):
        (card,) = placement.choose(cards, claims, 1, 600)
        claims.append({"cards": [card.key], "mib": 600})
        got.append(card.index)
    assert got == [0, 1, 2]  # most unclaimed memory first, ties to the lowest index
    assert placement.choose(cards, claims, 1, 600) is None  # 3 x 400 free: the sum fits, no card does
    assert [c.index for c in placement.choose(cards, claims, 1, 400)] == [0]
    # two cards for one job: its MiB split over two distinct cards
    assert [c.index for c in placement.choose(cards, [], 2, 1800)] == [0, 1]
    assert placement.choose(cards, [], 2, 2400) is None
    assert placement.packs(cards, [600, 600, 600]) and not placement.packs(cards, [600, 600, 600, 600])


def _hold(ledger: str, mib: int, hold_s: float, out: str) -> None:
    """A parallel claimer: claim one card, record when it held it, release."""
    os.environ[placement.LEDGER_ENV] = ledger
    held = placement.claim(1, mib, what=f"claimer {os.getpid()}", wait_s=120)
    t0 = time.monotonic()
    time.sleep(hold_s)
    t1 = time.monotonic()
    held.release()
    Path(out).write_text(json.dumps({"card": held.cards[0].index, "mib": mib, "t0": t0, "t1": t1}))


def test_parallel_claimers_never_over_commit_a_card(gpus, tmp_path):
    """12 processes of 3000-7000 MiB on 4 cards of 10000 at once: at no moment do the claims held on a card
    add up to more than it has (seen failing with choose() ignoring the claimed memory)."""
    ctx = multiprocessing.get_context("fork")
    sizes = [7000, 3000, 6000, 4000, 5000, 5000, 7000, 3000, 6000, 4000, 5000, 5000]
    procs = [
        ctx.Process(target=_hold, args=(str(gpus), mib, 0.4, str(tmp_path / f"{i}.json")))
        for i, mib in enumerate(sizes)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    held = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(len(sizes))]
    assert len({h["card"] for h in held}) == 4  # spread over every card
    for h in held:  # at each claim's start, what its card held
        on_card = [o for o in held if o["card"] == h["card"] and o["t0"] <= h["t0"] < o["t1"]]
        assert sum(o["mib"] for o in on_card) <= 10000, on_card


def test_a_sigkilled_claimers_claim_is_reclaimed(gpus):
    """A job killed by SIGKILL never releases its claim: the next claimer removes it (its process is gone)
    and gets the card at once (seen failing with live_claims() not checking the claimer's process)."""
    code = (
        "import time; from fedagent.core import placement;"
        "h = placement.claim(1, 10000, what='victim', cards=placement.node_cards());"
        "print(h.cards[0].index, flush=True); time.sleep(600)"
    )
    env = {**os.environ, placement.GPUS_ENV: "0:10000"}
    victim = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert victim.stdout.readline().strip() == "0"
    cards = placement.parse_gpus("0:10000")
    cards = placement.visible(cards, None)
    with pytest.raises(PlacementError, match="no GPU had 10000 MiB unclaimed"):
        placement.claim(1, 10000, cards=cards, wait_s=0.5, log=lambda _line: None)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    t0 = time.monotonic()
    held = placement.claim(1, 10000, cards=cards, wait_s=30)
    assert held.cards[0].index == 0 and time.monotonic() - t0 < 5
    # a claim whose pid now names a process started at another time (pid reuse) is reclaimed too
    held.release()
    fake = gpus / "claim-reused.json"
    fake.write_text(json.dumps({"cards": ["index-0"], "mib": 10000, "pid": os.getpid(), "start": "1"}))
    with Ledger().locked():
        assert Ledger().live_claims() == [] and not fake.exists()


def test_errors_name_the_job_the_card_and_the_knobs(gpus):
    cards = placement.node_cards()
    why = placement.fit_problem(cards, "rule train_client", 1, 12000)
    assert "rule train_client declares gpu_mem_mb=12000" in why and "GPU 0 (10000 MiB" in why
    assert "micro_batch_size" in why and "env.pool_size" in why and "max_prompt_tokens" in why
    assert "asks 5 GPUs per job but this machine has 4" in placement.fit_problem(cards, "rule x", 5, 100)
    assert "no GPU is visible" in placement.fit_problem([], "rule x", 1, 100)
    with pytest.raises(PlacementError, match="gpu_mem_mb=12000"):
        placement.claim(1, 12000)  # at once, not after a wait


def _cli(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedagent.cli", *argv], env=env, capture_output=True, text=True, timeout=120
    )


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, **extra}


def test_the_entry_point_places_a_job_before_it_runs(gpus, tmp_path, monkeypatch):
    """`fedagent <cmd>` with FEDAGENT_JOB_GPUS set: the job runs with CUDA_VISIBLE_DEVICES set to a card of
    the parent's list ("1,3": never 0 or 2), and its claim is gone once it exits; unset: nothing changes."""
    env = _env(CUDA_VISIBLE_DEVICES="1,3")
    env.update({placement.JOB_GPUS_ENV: "1", placement.JOB_MEM_ENV: "6000"})
    # a "job" that holds its card while two more ask: check-config of a config that does not exist
    # fails fast, so the job here is a python -c through the CLI's own hook
    code = (
        "import os, sys, time; from fedagent.core import placement;"
        "placement.place_job(['train-client']);"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(float(sys.argv[1]))"
    )
    holders = [
        subprocess.Popen([sys.executable, "-c", code, "3"], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    seen = sorted(h.stdout.readline().strip() for h in holders)
    assert seen == ["1", "3"]  # spread over the parent's two cards, named as it names them
    third = subprocess.run(
        [sys.executable, "-c", code, "0"], env={**env, placement.WAIT_ENV: "30"}, capture_output=True, text=True
    )
    assert third.returncode == 0 and third.stdout.strip() in ("1", "3")
    assert "waiting for 1 GPU(s) with 6000 MiB free each" in third.stderr  # both cards were full
    for h in holders:
        h.wait()
    assert not list(gpus.glob("claim-*.json"))  # released at exit
    # the real entry point: a placed command sees its card; an unplaced one its parent's environment
    out = _cli(env, "check-config", "--help")
    assert out.returncode == 0 and not list(gpus.glob("claim-*.json"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    from fedagent import cli

    monkeypatch.setenv(placement.JOB_GPUS_ENV, "1")
    monkeypatch.setenv(placement.JOB_MEM_ENV, "20000")
    assert cli.main(["check-config", "--help"]) == 2  # larger than any card: one line, no job
    monkeypatch.setenv(placement.JOB_GPUS_ENV, "0")
    monkeypatch.setattr(placement, "claim", lambda *a, **k: pytest.fail("placed with FEDAGENT_JOB_GPUS=0"))
    placement.place_job(["eval"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_recorded_only_when_placed(monkeypatch):
    monkeypatch.delenv(placement.PLACED_ENV, raising=False)
    assert placement.recorded() == {}
    monkeypatch.setenv(placement.PLACED_ENV, json.dumps({"cards": ["3"], "mib": 6000}))
    assert placement.recorded() == {"gpu_placed": {"cards": ["3"], "mib": 6000}}


def test_warm_jobs_are_placed_and_run_in_a_standby_of_their_card(gpus, tmp_path):
    """Through a real warm server with `--standby 1` on a node whose parent sees cards "1,3": one standby
    per card, started with that card's CUDA_VISIBLE_DEVICES; a job the client placed on card 3 (card 1 held
    by another claim) runs in card 3's standby, then one placed on card 1 in card 1's (seen failing with
    one set of standbys under the server's environment: the placed jobs forked plainly)."""
    from test_warm import FEDAGENT, SOCKET_ENV, _env, _wait_for, warm_server
    from test_warm_standby import _ping

    from fedagent.warm.standby import TOUCH_DIR_ENV

    marks = tmp_path / "marks"
    marks.mkdir()
    env = _env(CUDA_VISIBLE_DEVICES="1,3", **{TOUCH_DIR_ENV: str(marks)})
    with warm_server("", "--standby-kind", "touch", "--standby", "1", env=env) as (sock, log, _pid):

        def ready():
            got = {s.get("card"): s["pid"] for s in _ping(sock)["standbys"] if s["state"] == "ready"}
            return got if set(got) == {"1", "3"} else None

        standbys = _wait_for(ready, 60, "a ready standby per card")
        for card, pid in standbys.items():
            assert json.loads((marks / f"standby-{pid}.json").read_text())["card"] == card
        job_env = {**env, SOCKET_ENV: sock, placement.JOB_GPUS_ENV: "1", placement.JOB_MEM_ENV: "6000"}
        for busy, free in (("1", "3"), ("3", "1")):
            other = placement.visible(placement.parse_gpus("1:10000,3:10000"), busy)
            held = placement.claim(1, 6000, what="the other job", cards=other)  # this process holds `busy`
            res = subprocess.run([*FEDAGENT, "eval", "--help"], env=job_env, capture_output=True, text=True)
            held.release()
            assert res.returncode == 0, res.stderr
            pid = standbys[free]
            assert f"standby pid {pid} (process group {pid}, ready " in log.read_text(), log.read_text()
        assert "no standby" not in log.read_text()
        assert not list(gpus.glob("claim-*.json"))


@pytest.mark.workflow
@pytest.mark.slow
def test_a_rounds_two_train_jobs_record_different_cards(gpus, tmp_path, monkeypatch):
    """The tiny workflow, one round, its two train_client jobs asking one GPU of 6000 MiB each on two injected
    cards of 10000 (the Snakefile registers gpu=2 and gpu_mem_mb=20000 from them): both jobs run at once
    and each records its own card in metrics.json (seen failing with node_cards() returning one card per
    index 0 only: both jobs on card 0, the second waiting)."""
    import yaml
    from workflow_helpers import RUN, make_workdir, run_snakemake

    work = make_workdir(tmp_path / "w")
    cfg_path = work / "config/config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["rounds"] = 1
    cfg["train"]["threads"] = 1  # one core each: the round's two clients at once
    cfg_path.write_text(yaml.safe_dump(cfg))
    rules = work / "rules/train.smk"
    text = rules.read_text()
    if "FEDAGENT_JOB_GPUS" not in text:  # the rules' own prefix for GPU-capable jobs, where they lack it
        prefix = "FEDAGENT_JOB_GPUS={resources.gpu} FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb} "
        text = text.replace('"fedagent train-client ', f'"{prefix}fedagent train-client ', 1)
        assert prefix in text
        rules.write_text(text)
    monkeypatch.setenv(placement.GPUS_ENV, "0:10000,1:10000")
    run_snakemake(
        work,
        "--cores",
        "3",  # round 0's eval (1 thread) goes first (ROUND_RECORD_PRIORITY): both train jobs beside it
        "--set-resources",
        "train_client:gpu=1",
        "train_client:gpu_mem_mb=6000",
    )
    cards = []
    for client in ("0", "1"):
        metrics = json.loads((work / RUN / "round_001/clients" / client / "metrics.json").read_text())
        cards.append(metrics["gpu_placed"]["cards"])
        assert metrics["gpu_placed"]["mib"] == 6000
    assert sorted(cards) == [["0"], ["1"]]
    evals = json.loads((work / RUN / "round_001/eval_timings.json").read_text())
    assert "gpu_placed" not in evals  # not placed: as it was
    assert not list(gpus.glob("claim-*.json"))


_SHARE_SNAKEFILE = """
include: {gpus_smk!r}

rule all:
    input: "a.json", "b.json"

rule job:
    output: "{{name}}.json"
    resources: gpu=1, gpu_mem_mb=37266
    params: other=lambda w: "b" if w.name == "a" else "a"
    shell:
        "touch running_{{wildcards.name}}; saw=false; "
        "for i in $(seq 50); do [ -e running_{{params.other}} ] && {{{{ saw=true; break; }}}}; sleep 0.1; done; "
        "sleep 0.3; rm running_{{wildcards.name}}; echo \\"{{{{\\\\\\"saw_other\\\\\\": $saw}}}}\\" > {{output}}"
"""


@pytest.mark.parametrize(("card_mib", "together"), [(81559, True), (60000, False)])
def test_gpu_jobs_share_a_card_when_their_memory_fits(tmp_path, monkeypatch, card_mib, together):
    """Snakemake's local scheduler, with the totals workflow/gpus.smk registers from one 80 GB card, runs
    two 1-GPU jobs of 37266 MiB each at once (they fit its 75788 usable MiB), and one at a time on a card
    whose usable memory holds only one. A ``gpu`` total of one per card would run them one at a time."""
    monkeypatch.setenv(placement.GPUS_ENV, f"0:{card_mib}")
    for key in ("CUDA_VISIBLE_DEVICES", placement.RESERVE_ENV):
        monkeypatch.delenv(key, raising=False)
    gpus_smk = str(Path(__file__).resolve().parents[1] / "workflow" / "gpus.smk")
    (tmp_path / "Snakefile").write_text(_SHARE_SNAKEFILE.format(gpus_smk=gpus_smk))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "4", "--quiet", "all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saw = [json.loads((tmp_path / f"{n}.json").read_text())["saw_other"] for n in "ab"]
    assert saw == [together, together], proc.stderr[-3000:]
