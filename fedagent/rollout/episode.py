"""The episode loop: every session in lockstep, one batched ``sample`` call per turn.

Policy-agnostic apart from :func:`fedagent.model.policy.sample`; the environment is any object
with the env client's methods (``create``, ``reset``, ``step``, ``close``): the HTTP
:class:`fedagent.envs.client.EnvClient` in jobs, ``tests/fake_env.FakeEnv`` in tests. An env
that also has the batch forms (the client's ``create_many``/``reset_many``/``step_many``/
``close_many``: one ``/*_batch`` round trip each) gets one call per phase for all sessions
(per turn for steps); otherwise each session is handled on its own. The service
parses the raw answer itself, so the loop sends the model's text unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from fedagent.model.policy import sample
from fedagent.rollout.prompts import (
    HISTORY_LENGTH,
    concat_turn_prompt,
    encode_prompt,
    response_prefix,
    template_of,
    windowed_prompt,
)

ROLLOUT_MODES = ("windowed", "concat")


@dataclass
class Turn:
    """One agent turn: what the model saw and said, and what the env made of it."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    action: str  # the action the service projected from ``text``
    valid: bool  # the service's is_action_valid (format check)
    reward: float  # env reward of this step (unpenalized)
    # The observation this turn answered (the env's text, as the prompt shows it): GiGPO's anchor
    # state. Not in :meth:`Trajectory.summary` (samples.jsonl keeps its bytes).
    observation: str | None = None


@dataclass
class Trajectory:
    """One episode of one session."""

    task_id: str
    task_type: str
    seed: int
    turns: list[Turn] = field(default_factory=list)
    episode_return: float = 0.0  # sum of env rewards (unpenalized)
    won: bool = False
    score: float = 0.0  # the env's graded score after the last step
    n_turns: int = 0

    def summary(self, with_tokens: bool = False) -> dict[str, Any]:
        """A JSON-able view (``return`` key; token ids only when asked)."""
        turns = []
        for t in self.turns:
            d = asdict(t)
            d.pop("observation")
            d["prompt_tokens"], d["response_tokens"] = len(t.prompt_ids), len(t.response_ids)
            if not with_tokens:
                d.pop("prompt_ids")
                d.pop("response_ids")
            turns.append(d)
        return {
            "task_id": self.task_id,
            "task_type": self.task_type,
            "seed": self.seed,
            "return": self.episode_return,
            "won": self.won,
            "score": self.score,
            "n_turns": self.n_turns,
            "turns": turns,
        }


def run_episodes(
    model,
    tokenizer,
    env,
    seeds: Sequence[int],
    *,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    generator,
    session_prefix: str,
    max_prompt_tokens: int,
    history_length: int = HISTORY_LENGTH,
    answer_format: str = "think_action",
    sampler=None,
    rollout_mode: str = "windowed",
    expert: bool = False,
    on_done: Callable[[int], None] | None = None,
    clock=None,
) -> list[Trajectory]:
    """Play one episode per seed, all sessions in lockstep; returns trajectories in seed order.

    Session ids are ``f"{session_prefix}-{i}"``. Every session is created, reset with its
    seed and stepped until done or ``max_turns``; every created session is closed in
    ``finally`` (a leaked session would shrink the service's pool for good).
    ``answer_format`` picks the prompt's instruction and the prefilled answer start (the env
    service must parse the same format). ``sampler`` replaces :func:`fedagent.model.policy.sample`
    (same signature), e.g. the GPU path's :class:`fedagent.gpu_sampler.StaticSampler`.

    ``rollout_mode``: ``windowed`` — each turn's prompt is a fresh one-message chat with the
    last ``history_length`` steps, left-truncated to ``max_prompt_tokens``; the turn stores
    exactly the ids it was generated from. ``concat`` — one growing chat per session
    (:class:`fedagent.rollout.concat.ConcatChat`): each turn is generated from the previous
    context + its response + the recovered glue, and stores that whole context; an episode
    whose context passes ``max_prompt_tokens`` ends there (never truncated mid-episode).

    ``expert``: no model samples; each turn's answer is the env's expert's (``env.expert_many``:
    a service started with ``expert=True``), written in the same format after the same prompt
    (:func:`fedagent.rollout.expert.expert_generation`) — the warm start's demonstrations.
    ``model`` may then be None. Windowed mode only.

    ``on_done(n)``: told after each turn how many more episodes ended (and the rest when the batch
    ends): a job's progress line (:mod:`fedagent.core.progress`); it is never read back.

    ``clock`` (a :class:`fedagent.core.timing.PhaseClock`): the loop's time split into its phases
    ``rollout_env`` (the env service's create, reset, step and close), ``rollout_prompt`` (building and
    tokenizing the prompts) and ``rollout_sample`` (the sampler's calls, which end on the host: tokens
    copied back), so a job's timings say whether its rollout waits on the GPU or on the host. Wall
    clock, informational: nothing the loop returns depends on it.
    """
    if rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode must be one of {ROLLOUT_MODES}, got {rollout_mode!r}")
    concat = rollout_mode == "concat"
    if expert and concat:
        raise ValueError("expert demonstrations are played in windowed mode")
    if expert:
        from fedagent.rollout.expert import expert_generation
    if concat:
        from fedagent.rollout.concat import ConcatChat
    sample_fn = sample if sampler is None else sampler
    timed = clock.phase if clock is not None else _untimed
    prefix = response_prefix(answer_format)
    sids = session_ids(session_prefix, len(seeds))
    trajs: list[Trajectory] = []
    created: list[str] = []
    completed = False
    try:
        with timed("rollout_env"):
            many = getattr(env, "create_many", None)
            if many is not None:
                created = list(sids)  # a failed batch may have created some: close all
                many(sids)
            else:
                for sid in sids:
                    env.create(sid)
                    created.append(sid)
            resets = _reset_all(env, sids, seeds)
        state = []  # per session: task, observation, admissible, history
        for sid, seed, r in zip(sids, seeds, resets):
            trajs.append(Trajectory(task_id=str(r["task_id"]), task_type=str(r["task_type"]), seed=int(seed)))
            state.append(
                {
                    "task": r.get("task", ""),
                    "obs": r["observation"],
                    "admissible": list(r.get("admissible_commands", [])),
                    "history": [],
                    "template": template_of(r),
                }
            )  # the env names its prompt family
            if concat:
                st = state[-1]
                st["chat"] = ConcatChat.start(
                    tokenizer,
                    windowed_prompt(
                        st["task"],
                        st["obs"],
                        st["admissible"],
                        [],
                        history_length,
                        answer_format,
                        template=st["template"],
                    ),
                    answer_format,
                    max_prompt_tokens,
                )
        done = [False] * len(sids)
        reported = 0
        for _turn in range(max_turns):
            if concat:  # a context past the budget ends its episode (a cut would change the past)
                for i in range(len(sids)):
                    if not done[i] and len(state[i]["chat"].ids) > max_prompt_tokens:
                        done[i] = True
            active = [i for i in range(len(sids)) if not done[i]]
            if not active:
                break
            with timed("rollout_prompt"):
                if concat:
                    prompts = [list(state[i]["chat"].ids) for i in active]
                else:
                    prompts = [
                        encode_prompt(
                            tokenizer,
                            windowed_prompt(
                                state[i]["task"],
                                state[i]["obs"],
                                state[i]["admissible"],
                                state[i]["history"],
                                history_length,
                                answer_format,
                                template=state[i]["template"],
                            ),
                            max_prompt_tokens,
                            answer_format,
                        )
                        for i in active
                    ]
            if expert:
                with timed("rollout_env"):
                    actions = env.expert_many([sids[i] for i in active])
                gens = [expert_generation(tokenizer, p, a, answer_format) for p, a in zip(prompts, actions)]
            else:
                with timed("rollout_sample"):
                    gens = sample_fn(model, tokenizer, prompts, max_new_tokens, temperature, generator)
            # the answer includes its prefilled start
            with timed("rollout_env"):
                results = _step_all(env, [sids[i] for i in active], [prefix + g.text for g in gens])
            for i, g, r in zip(active, gens, results):
                tr, st = trajs[i], state[i]
                tr.turns.append(
                    Turn(
                        prompt_ids=g.prompt_ids,
                        response_ids=g.response_ids,
                        text=g.text,
                        action=str(r.get("action", "")),
                        valid=bool(r["is_action_valid"]),
                        reward=float(r["reward"]),
                        observation=str(st["obs"]),
                    )
                )
                tr.episode_return += float(r["reward"])
                tr.won = bool(r.get("won", False))
                tr.score = float(r.get("score", 0.0))
                tr.n_turns += 1
                # History holds the observation the action answered and the projected action.
                st["history"].append((st["obs"], str(r.get("action", ""))))
                st["obs"] = r["observation"]
                st["admissible"] = list(r.get("admissible_commands", st["admissible"]))
                if r["done"]:
                    done[i] = True
                elif concat:
                    st["chat"].extend(
                        tokenizer,
                        prefix=prefix,
                        text=g.text,
                        response_ids=g.response_ids,
                        finished=g.finished,
                        next_user=concat_turn_prompt(
                            st["obs"], st["admissible"], tr.n_turns + 1, answer_format, template=st["template"]
                        ),
                        answer_format=answer_format,
                    )
            if on_done is not None and sum(done) > reported:
                on_done(sum(done) - reported)
                reported = sum(done)
        if on_done is not None and len(sids) > reported:  # the episodes max_turns ended
            on_done(len(sids) - reported)
        completed = True
    finally:
        with timed("rollout_env"):
            errors = _close_all(env, created)
        # A failing close must not mask the exception that is already propagating.
        if errors and completed:
            raise errors[0]
    return trajs


@contextlib.contextmanager
def _untimed(name: str):
    """No clock: :func:`run_episodes`' phases untimed."""
    yield


def _reset_all(env, sids: list[str], seeds: Sequence[int]) -> list[dict]:
    """One reset answer per session, in order: a single ``reset_many`` call when the env has it."""
    reset_many = getattr(env, "reset_many", None)
    if reset_many is not None:
        return reset_many([(sid, int(seed)) for sid, seed in zip(sids, seeds)])
    return [env.reset(sid, int(seed)) for sid, seed in zip(sids, seeds)]


def _close_all(env, sids: list[str]) -> list[Exception]:
    """Close every session; returns the errors instead of stopping at the first.

    A failed ``close_many`` (after its own retries) falls back to one ``close`` per session,
    so a single bad item or a broken batch route never leaks the others' envs.
    """
    if not sids:
        return []
    close_many = getattr(env, "close_many", None)
    if close_many is not None:
        try:
            close_many(sids)
            return []
        except Exception:  # noqa: BLE001 - retried one by one below
            pass
    errors = []
    for sid in sids:
        try:
            env.close(sid)
        except Exception as exc:  # close every session even if one close fails
            errors.append(exc)
    return errors


def _step_all(env, sids: list[str], texts: list[str]) -> list[dict]:
    """One env answer per session, in order: a single ``step_many`` call when the env has it."""
    step_many = getattr(env, "step_many", None)
    if step_many is not None:
        return step_many(list(zip(sids, texts)))
    return [env.step(sid, text) for sid, text in zip(sids, texts)]


def run_episodes_batched(
    model, tokenizer, env, seeds: Sequence[int], *, batch_size: int, session_prefix: str, **kwargs
) -> list[Trajectory]:
    """:func:`run_episodes` over consecutive chunks of at most ``batch_size`` seeds.

    The service's ``/create`` blocks while its pool is empty, so a lockstep batch must never
    exceed the pool; chunking keeps the order of seeds and of generator draws fixed.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    out: list[Trajectory] = []
    for k in range(0, len(seeds), batch_size):
        out.extend(
            run_episodes(
                model,
                tokenizer,
                env,
                list(seeds[k : k + batch_size]),
                session_prefix=batch_prefix(session_prefix, k // batch_size),
                **kwargs,
            )
        )
    return out


def batch_prefix(session_prefix: str, batch: int) -> str:
    """The session prefix of batch ``batch`` of :func:`run_episodes_batched`."""
    return f"{session_prefix}-b{batch}"


def first_batch(seeds: Sequence[int], batch_size: int, session_prefix: str) -> tuple[list[str], list[int]]:
    """The session ids and seeds that :func:`run_episodes_batched` creates and resets first."""
    head = [int(s) for s in seeds[:batch_size]]
    return session_ids(batch_prefix(session_prefix, 0), len(head)), head


def session_ids(session_prefix: str, n: int) -> list[str]:
    """The session ids :func:`run_episodes` gives ``n`` seeds."""
    return [f"{session_prefix}-{i}" for i in range(n)]
