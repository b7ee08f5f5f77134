"""The cross rules of token-budget micro-batches (``train.micro_batch_tokens``, :mod:`fedagent.train.micro_batches`):
where the budget's cut keeps the update's meaning, and that every row the config allows fits it. Imported by
:mod:`fedagent.core.config_rules` (which registers every rule), as :mod:`fedagent.core.lora_rules`.
"""

from __future__ import annotations

from fedagent.core.rules import PLAN_ONLY_RULES, Requirement, cross_rule


def _set(tokens) -> bool:
    return tokens is not None


MICRO_BATCH_TOKEN_REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        "train.micro_batch_tokens",
        "train.micro_batch_tokens",
        _set,
        "train.backend",
        "local",
        "{value!r} is implemented for train.backend=local only (the verl backend sizes its micro-batches "
        "from its memory plan, fedagent.model.verl_memory; got {got!r})",
        {"train.micro_batch_tokens": 4096, "train.backend": "verl", "train.ref_anchor": "round"},
    ),
    Requirement(
        "train.micro_batch_tokens",
        "train.micro_batch_tokens",
        _set,
        "train.compile_train",
        False,
        "{value!r} with train.compile_train: the compiled step pads every micro-batch to micro_batch_size rows "
        "(static shapes), so a token budget would cut nothing it costs; set one of them off",
        {"train.micro_batch_tokens": 4096, "train.compile_train": True, "train.device": "cuda"},
    ),
)

# No job carries both train.micro_batch_tokens and train.backend (the local job has no backend key, the verl job
# no token budget): the backend rule is a plan-time rule; the others are also checked by the train job.
PLAN_ONLY_RULES.add("train.micro_batch_tokens")

for _req in MICRO_BATCH_TOKEN_REQUIREMENTS:
    cross_rule(_req.key, dict.fromkeys((_req.key, _req.when_key, _req.need_key)), _req.violation)(_req.check)


@cross_rule(
    "train.micro_batch_tokens",
    ["train.micro_batch_tokens", "train.algorithm"],
    violation={"train.micro_batch_tokens": 4096, "train.algorithm": "ppo", "rollout.mode": "concat"},
)
def _not_with_ppo(get):
    # PPO's critic loss is the reference's legacy_exact: each micro-batch's token mean ÷ their number
    # (fedagent.train.ppo), a value that depends on where the micro-batches are cut.
    if _set(get("train.micro_batch_tokens")) and get("train.algorithm") == "ppo":
        return (
            f"{get('train.micro_batch_tokens')!r} with train.algorithm='ppo': the critic's loss is a mean over "
            "micro-batches, so a token budget's cut would change it; leave micro_batch_tokens null for PPO"
        )
    return None


@cross_rule(
    "train.micro_batch_tokens",
    ["train.micro_batch_tokens", "train.max_prompt_tokens", "train.max_new_tokens"],
    violation={"train.micro_batch_tokens": 100, "train.max_prompt_tokens": 512, "train.max_new_tokens": 40},
)
def _every_row_fits(get):
    longest = get("train.max_prompt_tokens") + get("train.max_new_tokens")
    if _set(get("train.micro_batch_tokens")) and get("train.micro_batch_tokens") < longest:
        return (
            f"{get('train.micro_batch_tokens')} is less than one row of train.max_prompt_tokens + "
            f"train.max_new_tokens = {longest} tokens: every row must fit one micro-batch"
        )
    return None
