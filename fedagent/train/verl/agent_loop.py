"""The windowed agent loop for verl 0.9.1: one episode against the job's env service, one sample per turn.

verl instantiates :class:`WindowedAgentLoop` from the job's agent-loop YAML
(``actor_rollout_ref.rollout.agent.agent_loop_config_path``, written by
:func:`fedagent.train.verl.job_files.write_agent_loop_yaml`) once per rollout, i.e. per
(dataset row, session) with ``rollout.n`` sessions per row. ``run`` plays the row's task
seed: every turn builds the same windowed prompt as the local backend
(:func:`fedagent.rollout.prompts.windowed_prompt` in the prompt family the env's reset names
+ :func:`encode_prompt`, left-truncated to ``max_prompt_tokens``), asks verl's LLM server for the answer, and sends
the answer format's prefilled start + text to the env service (which parses it). Each request carries its
own sampling seed (:func:`fedagent.core.seeds.request_seed` of the row's job coordinates, session and turn),
so what a job samples does not depend on which engine serves it. It returns a **list** of
:class:`TurnOutput`, one per turn: verl's v1 (TransferQueue) worker stores each element as
its own training row under the row's ``uid``, so GRPO's mean/std runs over all per-turn
samples of the task's group (FACTS §5).

Rewards: each turn's reward is the episode's return minus ``invalid_penalty`` when that
turn's own action was invalid. verl's worker copies the *last* output's ``reward_score``
onto the earlier ones; :meth:`TurnOutput.as_dict` therefore writes ``rm_scores`` from the
turn's own ``turn_reward`` field, which that copy does not touch.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from fedagent.core.seeds import request_seed
from fedagent.model.policy import stop_token_ids_for_dir
from fedagent.rollout.prompts import HISTORY_LENGTH, encode_prompt, response_prefix, template_of, windowed_prompt


class TurnOutput(AgentLoopOutput):
    """One turn as a verl sample; ``rm_scores`` come from ``turn_reward``, not ``reward_score``."""

    turn_reward: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        out.pop("turn_reward", None)
        scores = out["response_mask"].new_zeros(out["response_mask"].shape, dtype=__import__("torch").float32)
        if scores.numel():
            scores[-1] = float(self.turn_reward)
        out["rm_scores"] = scores
        return out


def turn_reward(episode_return: float, valid: bool, invalid_penalty: float) -> float:
    """The training reward of one turn: the episode return, minus the penalty if this turn was invalid."""
    return float(episode_return) - (0.0 if valid else float(invalid_penalty))


def weight_versions(out) -> dict:
    """The policy versions a turn was generated with, as verl's v1 trainer reads them.

    verl's server manager tags every generation with the rollout weights' ``global_steps``
    (``min_global_steps``/``max_global_steps``); the v1 trainer turns those tags into ints for
    its staleness metrics and fails on a sample without them. Each turn is one generation.
    """
    extra = dict(getattr(out, "extra_fields", None) or {})
    step = extra.get("global_steps")
    return {
        "min_global_steps": extra.get("min_global_steps", step),
        "max_global_steps": extra.get("max_global_steps", step),
    }


# the row's extra_info keys a turn's sampling seed derives from (with the turn's session and index)
SEED_KEYS = ("base_seed", "round", "client", "epoch", "group")

JOB_FILE_KEYS = ("env_uds", "env_url", "env_token", "record_file", "model_dir")


def read_job_file(job_file: str, *entry_values) -> tuple:
    """The job's env address, record file and start model dir (its stop tokens' generation config) from
    its ``job_file`` (JSON with :data:`JOB_FILE_KEYS`),
    read per episode: verl reads the agent-loop YAML once per worker, so a file the YAML names is where
    a later job's values can reach live workers (``train.verl.warm_refit``; the run-scoped engines). The
    YAML entry must then carry none of them itself (one source, never a mix)."""
    if any(v is not None for v in entry_values):
        raise ValueError(
            f"agent-loop entry has job_file {job_file} and its own {JOB_FILE_KEYS} values: one or the other"
        )
    with open(job_file) as fh:
        job = json.load(fh)
    missing = [k for k in JOB_FILE_KEYS if k not in job]
    if missing:
        raise ValueError(f"{job_file}: missing {missing}")
    return tuple(job[k] for k in JOB_FILE_KEYS)


class WindowedAgentLoop(AgentLoopBase):
    """verl agent loop playing one windowed multi-turn episode (see the module docstring).

    Extra constructor arguments come from the agent-loop YAML entry; ``env`` (an object
    with the env client's ``create/reset/step/close``) replaces the connection in tests.
    """

    def __init__(
        self,
        *args,
        env_uds: str | None = None,
        env_url: str | None = None,
        env_token: str | None = None,
        max_turns: int = 3,
        max_prompt_tokens: int = 1024,
        invalid_penalty: float = 0.1,
        history_length: int = HISTORY_LENGTH,
        record_file: str | None = None,
        answer_format: str = "think_action",
        env=None,
        job_file: str | None = None,
        **kwargs,
    ):
        model_dir = None
        if job_file is not None:
            env_uds, env_url, env_token, record_file, model_dir = read_job_file(
                job_file, env_uds, env_url, env_token, record_file
            )
        kwargs.pop("name", None)  # the YAML entry's registry name
        kwargs.pop("tools", None)  # verl passes its tool list to every loop
        super().__init__(*args, **kwargs)
        self.max_turns = int(max_turns)
        self.max_prompt_tokens = min(int(max_prompt_tokens), int(self.rollout_config.prompt_length))
        self.response_length = int(self.rollout_config.response_length)
        self.invalid_penalty = float(invalid_penalty)
        self.history_length = int(history_length)
        self.record_file = record_file
        self.answer_format = str(answer_format)
        self.prefix = response_prefix(self.answer_format)
        # the job's own start model (from its job file: on live engines verl's config names the first job's,
        # which a later round may have deleted), else verl's
        self.stop_token_ids = stop_token_ids_for_dir(
            self.tokenizer, model_dir or self.config.actor_rollout_ref.model.get("path")
        )
        self._own_env = env is None  # verl builds one loop per episode: close what we open
        if env is None:
            from fedagent.envs.client import EnvClient

            env = EnvClient(uds=env_uds, base_url=env_url, token=env_token)
        self.env = env

    async def _env(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[TurnOutput]:
        info = dict(kwargs.get("extra_info") or {})
        seed = int(info["seed"])
        uid = str(kwargs.get("uid", uuid4().hex))
        session = int(kwargs.get("session_id", 0))
        missing = [k for k in SEED_KEYS if k not in info]
        if missing:
            raise ValueError(
                f"agent loop: the row's extra_info lacks {missing}: the per-request sampling seeds "
                "need the job's coordinates (fedagent.train.verl.job_files.task_rows)"
            )
        coords = {k: int(info[k]) for k in ("round", "client", "epoch", "group")}
        sid = f"{uid}-s{session}"
        params = dict(sampling_params)
        params["max_tokens"] = self.response_length
        # The local sampler's stop set (SmolLM2's converted eos is <|im_start|>; answers end at <|im_end|>).
        params["stop_token_ids"] = list(self.stop_token_ids)
        turns: list[dict] = []
        await self._env(self.env.create, sid)
        try:
            r = await self._env(self.env.reset, sid, seed)
            task_id, task_type = str(r["task_id"]), str(r["task_type"])
            task, obs = r.get("task", ""), r["observation"]
            template = template_of(r)  # the env names its prompt family (TextWorld/WebShop/ALFWorld)
            admissible = list(r.get("admissible_commands", []))
            history: list[tuple[str, str]] = []
            episode_return, won, score = 0.0, False, 0.0
            t_first = None
            for _ in range(self.max_turns):
                prompt_ids = encode_prompt(
                    self.tokenizer,
                    windowed_prompt(
                        task, obs, admissible, history, self.history_length, self.answer_format, template=template
                    ),
                    self.max_prompt_tokens,
                    self.answer_format,
                )
                # the job's own seed per request: vLLM's engine seed is engine-wide (a run-scoped set's first job's)
                sampling_seed = request_seed(int(info["base_seed"]), session=session, turn=len(turns), **coords)
                out = await self.server_manager.generate(
                    request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params={**params, "seed": sampling_seed}
                )
                if t_first is None:
                    t_first = time.time()  # wall clock, for the job's start-up timing only
                response_ids = list(out.token_ids)[: self.response_length]
                logprobs = list(out.log_probs)[: self.response_length] if out.log_probs else None
                text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
                step = await self._env(self.env.step, sid, self.prefix + text)
                reward = float(step["reward"])
                episode_return += reward
                won, score = bool(step.get("won", False)), float(step.get("score", 0.0))
                action = str(step.get("action", ""))
                turns.append(
                    {
                        "prompt_ids": prompt_ids,
                        "response_ids": response_ids,
                        "logprobs": logprobs,
                        "text": text,
                        "action": action,
                        "valid": bool(step["is_action_valid"]),
                        "reward": reward,
                        "versions": weight_versions(out),
                        "sampling_seed": sampling_seed,
                    }
                )
                history.append((obs, action))
                obs = step["observation"]
                admissible = list(step.get("admissible_commands", admissible))
                if step["done"]:
                    break
        finally:
            try:
                await self._env(self.env.close, sid)
            finally:
                if self._own_env:
                    self.env.shutdown()
        outputs = []
        for k, t in enumerate(turns):
            if not t["response_ids"]:
                continue  # nothing to train on
            rew = turn_reward(episode_return, t["valid"], self.invalid_penalty)
            outputs.append(
                TurnOutput(
                    prompt_ids=t["prompt_ids"],
                    response_ids=t["response_ids"],
                    response_mask=[1] * len(t["response_ids"]),
                    response_logprobs=t["logprobs"],
                    reward_score=rew,
                    turn_reward=rew,
                    num_turns=2,
                    metrics=AgentLoopMetrics(),
                    extra_fields={
                        "reward_extra_info": {},
                        "task_id": task_id,
                        "task_type": task_type,
                        "turn": k,
                        "valid": t["valid"],
                        "episode_return": episode_return,
                        "won": won,
                        "seed": seed,
                        **t["versions"],
                    },
                )
            )
        self._record(
            {
                "epoch": int(info.get("epoch", 0)),
                "group": int(info.get("group", 0)),
                "session": session,
                "task_id": task_id,
                "task_type": task_type,
                "seed": seed,
                "return": episode_return,
                "won": won,
                "score": score,
                "n_turns": len(turns),
                "t_first_generation": t_first,
                "turns": [
                    {
                        "action": t["action"],
                        "valid": t["valid"],
                        "reward": t["reward"],
                        "text": t["text"],
                        "sampling_seed": t["sampling_seed"],
                        "prompt_tokens": len(t["prompt_ids"]),
                        "response_tokens": len(t["response_ids"]),
                    }
                    for t in turns
                ],
            }
        )
        return outputs

    def _record(self, rec: dict) -> None:
        """Append the episode's summary as one line (O_APPEND: lines of concurrent loops do not mix)."""
        if not self.record_file:
            return
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        fd = os.open(self.record_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
