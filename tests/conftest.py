"""Session-wide test settings: TextWorld games made once per session (tests/tw_make_cache.py), and one
shared 1-round reference run of the test config."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_CACHE: list[str] = []

# scripts/test.sh runs the suite on two workers, one whole file at a time each (`--dist loadfile`), handing
# the files out in collection order (`--no-loadscope-reorder`). These files take longest: collected first,
# longest first, the two workers end together instead of one finishing a long file picked up last
# (xdist's own order, most tests first, left most of them to the end). Seconds of the file's tests (setup,
# call and teardown: pytest's --junitxml times) in one `scripts/test.sh` run on the 2-core machine, both
# workers busy, rounded: their order is what counts. Every other file takes less than ~20 s and keeps its
# place after these; a new long file belongs here. Replayed over the measured per-test times with
# xdist's rule (a worker gets its next file once two tests of its current one are left), this order
# ends the two workers within a few seconds of each other, less than a run's noise.
LONGEST_FILES = {
    "tests/test_verl_isolation.py": 247,
    "tests/test_verl_engines.py": 183,
    "tests/test_workflow.py": 182,
    "tests/test_experiments.py": 131,
    "tests/test_slurm.py": 115,
    "tests/test_workflow_lora.py": 106,
    "tests/test_labels.py": 102,
    "tests/test_verl_refit.py": 98,
    "tests/test_matrix.py": 91,
    "tests/reliability/test_kill_short.py": 75,
    "tests/test_alfworld_games.py": 66,
    "tests/test_warm_start.py": 65,
    "tests/test_warm_standby.py": 60,
    "tests/test_warm.py": 53,
    "tests/test_plan_checks.py": 50,
    "tests/test_verl_ref_model.py": 47,
    "tests/test_ppo.py": 37,
    "tests/test_gpu_verl_reset_memory.py": 37,
    "tests/test_workflow_gigpo.py": 32,
    "tests/test_placement.py": 31,
    "tests/test_verl_convert.py": 29,
    "tests/test_byzantine.py": 28,
    "tests/test_workflow_ppo.py": 28,
    "tests/reliability/test_dropout_workflow.py": 27,
    "tests/test_server_plugin.py": 26,
    "tests/test_scale.py": 24,
    "tests/test_bench_rollout_host.py": 20,
}


def pytest_configure(config):
    # Every fedagent games job of the session (in-process or under Snakemake, which inherits this
    # environment) runs tw-make through the cache: each distinct game is generated once for real.
    if "FEDAGENT_TW_MAKE" not in os.environ:
        _CACHE.append(tempfile.mkdtemp(prefix="fa-tw-make-cache-"))
        os.environ["FEDAGENT_TEST_TW_CACHE"] = _CACHE[0]
        os.environ["FEDAGENT_TW_MAKE"] = shlex.join([sys.executable, str(Path(__file__).parent / "tw_make_cache.py")])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # a stable sort: each file's tests keep their order (and stay together)
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::", 1)[0], 0))


def pytest_unconfigure(config):
    for d in _CACHE:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _accelerator_env_restored():
    """Every test leaves the no-accelerator variables as it found them. fedagent.envs.serve.hide_accelerators
    writes them into its process for good (right for an env service's own process); a test calling it
    in-process left CUDA_VISIBLE_DEVICES='' in its worker (monkeypatch.delenv of an absent key records
    nothing to undo), and a later test's Snakemake run there saw no card."""
    from fedagent.envs.serve import NO_ACCELERATOR_ENV

    before = {k: os.environ.get(k) for k in NO_ACCELERATOR_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def gguf_reads(monkeypatch) -> list:
    """The paths of every real ``gguf.GGUFReader`` made while the test runs (the reads of a GGUF file that
    ``fedagent.model.smollm2_gguf.gguf_read_once`` is there to share)."""
    import gguf

    reads: list = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            reads.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    return reads


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(seed)``: a tiny model dir (fake_env.build_tiny_model) made once per seed and session.
    Shared: tests read it and write elsewhere."""
    from fake_env import build_tiny_model

    made: dict[int, Path] = {}

    def get(seed: int) -> Path:
        if seed not in made:
            made[seed] = build_tiny_model(tmp_path_factory.mktemp(f"tiny{seed}") / "m", seed=seed)
        return made[seed]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tiny_model) -> Path:
    """The tiny model of seed 4 the local training tests start from (with fake_env.TINY_TRAIN)."""
    return tiny_model(4)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, worker_id) -> Path:
    """One uninterrupted run of the test config with ``rounds: 1`` (a finished work dir), made once
    per session: the reliability tests start from copies of it, test_slurm compares with it. Under
    xdist the workers share it (in the session's temp root, made by the first to ask, under a file
    lock; the others find it finished): its files are only read and copied."""
    from filelock import FileLock

    sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
    from kill_driver import build_reference
    from workflow_helpers import RUN

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the session's, above each worker's own
    base = root / "reliability-shared"
    base.mkdir(exist_ok=True)
    ref = base / "reference"
    with FileLock(str(root / "reliability-shared.lock")):
        # finished: used as it is (no Snakemake run in it while another worker copies it)
        if not (ref / RUN / "round_001" / "summary.csv").is_file():
            build_reference(base)
    return ref
