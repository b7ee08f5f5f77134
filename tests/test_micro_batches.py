"""train.micro_batch_tokens: micro-batches cut by padded tokens as well as rows (fedagent.train.micro_batches) —
the cut itself, the same update as rows alone, the config's refusals, the job params and the memory estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedagent.core.config import ConfigError, load_config
from fedagent.core.seeds import python_rng
from fedagent.model import memory
from fedagent.model.policy import load_policy
from fedagent.train import grpo, micro_batches
from fedagent.train.actor import grpo_epoch
from fedagent.train.local import TrainParams
from fedagent.train.warm_start import WarmStartParams


def _rows(*lengths):
    """Samples whose prompt + response hold ``lengths`` tokens (responses of 2)."""
    return [grpo.Sample(list(range(3, 3 + n - 2)), [40, 41], 0.0, 0) for n in lengths]


def test_rows_only_is_the_plain_chunking():
    s = _rows(*[10] * 7)
    assert micro_batches.split(range(7), s, 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_token_budget_cuts_by_padded_width_in_order():
    # widths 10, 10, 30, 10, 10, 10; budget 40 tokens, at most 4 rows
    s = _rows(10, 10, 30, 10, 10, 10)
    cuts = micro_batches.split([5, 0, 1, 2, 3, 4], s, rows=4, tokens=40)
    # [5, 0, 1]: 3 × 10 = 30; adding row 2 (30 wide) would make 4 × 30 = 120 > 40; [2]: 30; [2, 3]: 2 × 30 = 60 > 40
    assert cuts == [[5, 0, 1], [2], [3, 4]]
    assert [i for c in cuts for i in c] == [5, 0, 1, 2, 3, 4]  # every index once, in order
    for c in cuts:
        assert len(c) * max(micro_batches.row_tokens(s[i]) for i in c) <= 40 and len(c) <= 4
    # the row cap still holds under a large budget
    assert micro_batches.split(range(6), s, rows=2, tokens=10_000) == [[0, 1], [2, 3], [4, 5]]


def test_a_row_longer_than_the_budget_is_a_micro_batch_of_its_own():
    s = _rows(10, 50, 10)
    assert micro_batches.split(range(3), s, rows=8, tokens=40) == [[0], [1], [2]]


def test_a_bad_cut_is_refused():
    with pytest.raises(ValueError, match="must be >= 1"):
        micro_batches.split(range(2), _rows(10, 10), rows=2, tokens=0)


def test_a_token_budget_gives_the_update_of_rows_alone(tiny_dir, monkeypatch):
    """Gradients accumulate to the same token-mean whatever the cut: one epoch with a budget that makes
    other micro-batches (counted) moves the weights as rows alone do."""
    samples = [
        grpo.Sample([5, 6, 7], [40, 41], 1.0, 0, advantage=1.0),
        grpo.Sample([5, 6], [50, 51, 52, 53, 54], 0.0, 0, advantage=-1.0),
        grpo.Sample([8, 9, 10, 11], [60], 0.0, 0, advantage=0.5),
        grpo.Sample([8, 9], [61, 62], 0.0, 0, advantage=-0.5),
    ]
    sizes = []
    real = grpo.response_logprobs

    def counted(model, batch, *args, **kwargs):
        if torch.is_grad_enabled():
            sizes[-1].append(len(batch))
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(grpo, "response_logprobs", counted)
    moved = []
    for tokens in (None, 10):
        sizes.append([])
        model, _ = load_policy(tiny_dir, threads=1)
        ref, _ = load_policy(tiny_dir, threads=1)
        with torch.no_grad():  # a reference that differs, so the KL term has a gradient too
            next(ref.parameters()).mul_(1.1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        p = TrainParams(mini_batch_size=4, micro_batch_size=4, micro_batch_tokens=tokens, kl_coef=0.5, grad_clip=1e9)
        grpo_epoch(model, ref, opt, samples, p, python_rng(0, "t"), 0)
        moved.append(torch.cat([q.detach().flatten() for q in model.parameters()]))
    assert sizes[0] == [4] and len(sizes[1]) > 1 and sum(sizes[1]) == 4  # the budget made other micro-batches
    base = torch.cat([q.detach().flatten() for q in load_policy(tiny_dir, threads=1)[0].parameters()])
    assert not torch.allclose(moved[0], base)
    assert torch.allclose(moved[0] - base, moved[1] - base, atol=1e-6, rtol=1e-4)


REPO = Path(__file__).resolve().parent.parent


def _config(**keys):
    """The default config with dotted ``keys`` (``__`` for ``.``), validated as a plan validates it."""
    return load_config(REPO / "config" / "config.yaml", {k.replace("__", "."): v for k, v in keys.items()})


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"train__micro_batch_tokens": 100}, "every row must fit"),
        ({"train__micro_batch_tokens": 4096, "train__compile_train": True, "train__device": "cuda"}, "static shapes"),
        ({"train__micro_batch_tokens": 4096, "train__algorithm": "ppo", "rollout__mode": "concat"}, "mean over micro"),
        ({"train__micro_batch_tokens": 4096, "train__backend": "verl", "train__ref_anchor": "round"}, "local only"),
    ],
)
def test_the_config_refuses_a_budget_it_cannot_keep(keys, words):
    with pytest.raises(ConfigError, match="train.micro_batch_tokens") as exc:
        _config(**keys)
    assert words in str(exc.value)


def test_the_job_params_carry_it_only_when_set():
    assert "micro_batch_tokens" not in TrainParams().recorded()
    assert TrainParams.from_dict({"micro_batch_tokens": 4096}).recorded()["micro_batch_tokens"] == 4096
    assert "micro_batch_tokens" not in WarmStartParams().recorded()
    assert WarmStartParams.from_dict({"micro_batch_tokens": 4096}).recorded()["micro_batch_tokens"] == 4096


def test_the_memory_estimate_counts_the_budget_not_the_longest_rows():
    cfg = _config(
        model="random:smollm2-1.7b",
        train__device="cuda",
        train__micro_batch_size=16,
        train__max_prompt_tokens=2048,
        train__max_new_tokens=48,
    )
    shape = memory.shape_of_source(cfg["model"])
    rows = memory.train_config_terms(cfg, shape)["activations"]
    cfg["train"]["micro_batch_tokens"] = 8192
    budget = memory.train_config_terms(cfg, shape)["activations"]
    # 16 rows × 2 096 tokens against 8 192 tokens: the per-token part shrinks 4.1×, the logits' rows stay
    assert budget < rows / 3
    cfg["train"]["micro_batch_tokens"] = 16 * 2096  # a budget that cuts nothing estimates what rows do
    assert memory.train_config_terms(cfg, shape)["activations"] == rows


@pytest.mark.workflow
def test_the_workflow_hands_the_budget_to_the_train_and_warm_start_jobs(tmp_path):
    """A plan's train-client and warm-start commands carry train.micro_batch_tokens when set, and a plan
    without it does not mention it (a run's cached jobs stay valid)."""
    from workflow_helpers import make_workdir, run_snakemake

    work = make_workdir(tmp_path / "w")
    warm = "warm_start={'enabled': True, 'demos': 1}"
    plain = run_snakemake(work, "-n", "-p", "--config", "rounds=1", "env={'train_games': 3}", warm)
    assert "fedagent train-client" in plain.stdout and "fedagent warm-start" in plain.stdout
    assert "micro_batch_tokens" not in plain.stdout
    budget = run_snakemake(
        work, "-n", "-p", "--config", "rounds=1", "env={'train_games': 3}", warm, "train={'micro_batch_tokens': 4096}"
    )
    lines = budget.stdout.splitlines()
    for command in ("fedagent train-client", "fedagent warm-start"):
        assert any(command in line and '"micro_batch_tokens":4096' in line for line in lines), command


def test_a_matrix_shares_round_0_across_budgets_unless_a_warm_start_reads_it():
    from fedagent.plan.matrix import start_key

    plain, budget = _config(), _config(train__micro_batch_tokens=4096)
    assert start_key(plain) == start_key(budget)  # round 0 is the base model and its eval: no micro-batch in it
    warm = {"warm_start__enabled": True, "warm_start__demos": 1, "env__train_games": 3}
    assert start_key(_config(**warm)) != start_key(_config(**warm, train__micro_batch_tokens=4096))
