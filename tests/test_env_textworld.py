"""TextWorld games (deterministic, disjoint pools, verified manifest) and the TextWorld env."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from env_fixtures import tw_games_dir
from fedagent.core.atomic import ManifestError
from fedagent.envs.textworld.env import clean_observation
from fedagent.envs.textworld.games import (
    VAL_INDEX_OFFSET,
    TextWorldTaskSource,
    fix_serial,
    game_seed,
    generate_games,
    id_list_sha256,
)

pytestmark = pytest.mark.slow


def walkthrough(games_dir, task_id):
    return json.loads((games_dir / "games" / f"{task_id}.json").read_text())["metadata"]["walkthrough"]


def test_games_json_layout():
    d = tw_games_dir()
    g = json.loads((d / "games.json").read_text())
    assert g["train"] == ["tw-train-0000", "tw-train-0001"] and g["val"] == ["tw-val-0000"]
    assert g["sha256"] == id_list_sha256(g["train"], g["val"])
    assert set(g["files"]) == set(g["train"]) | set(g["val"])
    assert g["seeds"]["tw-train-0001"] == game_seed(7, 1) or "tw-train-0001" in g["regenerated"]
    assert g["seeds"]["tw-val-0000"] == game_seed(7, VAL_INDEX_OFFSET) or "tw-val-0000" in g["regenerated"]
    assert len(set(g["game_sha256"].values())) == 3  # three distinct games
    assert g["knobs"]["base_seed"] == 7
    assert not list(d.rglob("*.ni"))


def test_same_seed_same_bytes_other_seed_differs(tmp_path, monkeypatch):
    """Same seed → byte-identical games.json and game files; another seed → other games."""
    d = tw_games_dir()
    monkeypatch.delenv("FEDAGENT_TW_MAKE", raising=False)  # the real tw-make here, not the session's cache
    again = tmp_path / "again"
    generate_games(again, base_seed=7, n_train=2, n_val=1, jobs=2, quarantine_root=tmp_path / "_f")
    assert (again / "games.json").read_bytes() == (d / "games.json").read_bytes()
    assert (again / "manifest.json").read_bytes() == (d / "manifest.json").read_bytes()
    other = tmp_path / "other"
    generate_games(other, base_seed=8, n_train=1, n_val=0, jobs=1, quarantine_root=tmp_path / "_f")
    g7 = json.loads((d / "games.json").read_text())
    g8 = json.loads((other / "games.json").read_text())
    assert g8["game_sha256"]["tw-train-0000"] != g7["game_sha256"]["tw-train-0000"]
    assert g8["seeds"] != g7["seeds"]


def test_serial_number_is_fixed(tmp_path):
    d = tw_games_dir()
    data = (d / "games" / "tw-train-0000.z8").read_bytes()
    assert data[0x12:0x18] == b"000000"  # not the compile date
    z = tmp_path / "x.z8"
    z.write_bytes(data[:0x12] + b"261129" + data[0x18:])
    fix_serial(z)
    assert z.read_bytes() == data


def test_task_source_verifies_manifest(tmp_path):
    d = tw_games_dir()
    src = TextWorldTaskSource(d)
    assert src.task_ids("val") == ["tw-val-0000"] and src.task_type("tw-val-0000") == "textworld"
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    p = broken / "games" / "tw-train-0000.z8"
    data = bytearray(p.read_bytes())
    data[1000] ^= 0xFF  # same size, other content
    p.write_bytes(bytes(data))
    with pytest.raises(ManifestError):
        TextWorldTaskSource(broken)
    # A service of other tasks hashes only its own games' files: it does not read this one.
    served = [t for t in TextWorldTaskSource(d).task_ids("train") + ["tw-val-0000"] if t != "tw-train-0000"]
    assert served, "the fixture needs a second game"
    TextWorldTaskSource(broken, served=served)
    with pytest.raises(ManifestError, match="tw-train-0000.z8"):
        TextWorldTaskSource(broken, served=["tw-train-0000"])
    (broken / "games.json").write_text((broken / "games.json").read_text().replace('"', "'", 1)[:-1] + " ")
    with pytest.raises(ManifestError, match="games.json"):  # not a game's file: always hashed
        TextWorldTaskSource(broken, served=served)
    (broken / "manifest.json").unlink()
    with pytest.raises(ManifestError):
        TextWorldTaskSource(broken)


def test_env_wins_by_walkthrough_with_sparse_reward():
    d = tw_games_dir()
    env = TextWorldTaskSource(d).make_env(max_turns=20)
    for tid in ["tw-train-0000", "tw-val-0000", "tw-train-0000"]:  # third: cached game
        r = env.reset(tid)
        assert r.task_id == tid and r.task_type == "textworld" and r.admissible_commands
        assert "$$" not in r.observation and r.observation.startswith(r.task)
        assert not r.observation.rstrip().endswith(">")
        steps = [env.step(a.lower()) for a in walkthrough(d, tid)]
        assert [s.reward for s in steps] == [0.0] * (len(steps) - 1) + [10.0]
        assert steps[-1].won and steps[-1].done and steps[-1].score == 1.0
        after = env.step("look")
        assert after.done and after.reward == 0.0
    env.close()


def test_env_turn_budget():
    env = TextWorldTaskSource(tw_games_dir()).make_env(max_turns=3)
    env.reset("tw-train-0001")
    out = [env.step("look") for _ in range(3)]
    assert [o.done for o in out] == [False, False, True] and not out[-1].won
    env.close()


def test_distinct_instances_step_concurrently_and_identically():
    """Threads each playing their own instance get the same results as one thread alone."""
    d = tw_games_dir()
    src = TextWorldTaskSource(d)

    def play(tid):
        env = src.make_env(max_turns=20)
        r = env.reset(tid)
        trace = [r.observation] + [env.step(a).observation for a in ["look", "inventory"] + walkthrough(d, tid)]
        env.close()
        return trace

    tids = ["tw-train-0000", "tw-train-0001", "tw-val-0000"] * 2
    serial = [play(t) for t in tids]
    results = [None] * len(tids)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, play(tids[i]))) for i in range(len(tids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


def test_clean_observation():
    raw = "\n\n  $$$$ banner $$\n\nDo the thing!\n\n-= Room =-\nA room.\n\n>    -= Room =-0/1"
    assert clean_observation(raw, "Do the thing!") == "Do the thing!\n\n-= Room =-\nA room."
    end = "You win.\n\n\n     *** The End ***\n\nYou scored 1 out of a possible 1.\n\nWould you like to RESTART?\n>  "
    assert clean_observation(end) == "You win.\n\n*** The End ***"


def test_any_text_reaches_the_engine_without_ending_it():
    """The reference projection sends tagless answers' tails to the env: 300 random strings (C0
    controls, backslash commands, CJK...) and the three found to end or hang dumb-frotz (NUL,
    DLE, a leading backslash) all get the parser's answer (seen: the interpreter died on NUL,
    hung on DLE, read '\\...' as its own command, before engine_text)."""
    import random

    from env_fixtures import tw_games_dir
    from fedagent.envs.textworld.env import engine_text
    from fedagent.envs.textworld.games import TextWorldTaskSource

    assert engine_text("\\q a\x00b\x10") == " q a b "
    src = TextWorldTaskSource(tw_games_dir())
    tid = src.task_ids("val")[0]
    env = src.make_env(1000)
    env.reset(tid)
    rng = random.Random(31)
    texts = ["\x00", "\x10", "\\q", "\\x"] + [
        "".join(chr(rng.choice([rng.randint(0, 127), rng.randint(128, 0x2FFF)])) for _ in range(rng.randint(1, 30)))
        for _ in range(300)
    ]
    for t in texts:
        r = env.step(t)
        assert isinstance(r.observation, str)
        if r.done:
            env.reset(tid)
