"""The HTTP environment service: a pool of env instances behind five idempotent endpoints.

Protocol (the reference's env-service protocol):

- ``GET /health``: ok, pool free/total, sessions, split, client id, task count/sha256, mode.
- ``POST /create {session_id}``: borrow an env; blocks (async) while the pool is empty.
  Idempotent: the session slot is reserved *before* the blocking borrow, so a retried or
  concurrent create of the same id waits for that one borrow instead of taking a second env
  (the reference system drained its pool this way).
- ``POST /reset {session_id, seed}``: seed → task is pure (index: ``tasks[seed % n]``;
  draw: ``tasks[Random(seed).randrange(n)]``, a local RNG); zeroes the step counter. The answer
  names the source's ``prompt_template`` (the rollout renders that env's prompt family).
- ``POST /step {session_id, text, step_id}``: ``text`` is the model's answer, parsed here with
  :func:`fedagent.rollout.parsing.parse_action`; an invalid answer steps the env with its
  projected action (``projection="reference"``, the reference's) or is a no-op turn (``noop``). step_id
  must be the next expected id; the previous id (same text) replays the cached response;
  anything else is 409.
- ``POST /step_batch {items: [{session_id, text, step_id}, ...]}``: up to
  ``MAX_BATCH_ITEMS`` steps in one round trip (the rollout loop steps every session each
  turn), run concurrently; ``results`` in item order, each the ``/step`` response or
  ``{error: {status, detail}}`` with the status ``/step`` would have answered (404, 409, 422;
  500 if the env raised). One bad item never fails the others.
- ``POST /close {session_id}``: idempotent; returns the env to the pool.
- ``POST /expert_batch {items: [{session_id}, ...]}`` (a service started with ``expert=True`` only,
  else 404): each session's expert action from its current state (the env's ``expert_action``:
  TextWorld's walkthrough, ALFWorld's planner, WebShop's oracle), ``null`` once the episode is over.
  What the warm start's demonstrations are played with (:mod:`fedagent.train.warm_start`).
- ``POST /create_batch``, ``/reset_batch``, ``/close_batch`` ``{items: [...]}``: the same
  per item (items are the single endpoint's bodies), run concurrently, results in item
  order with per-item errors like ``/step_batch``. A ``/create_batch`` of more new sessions
  than the pool holds is a 409 before anything is borrowed (it could only wait forever).
  The rollout loop opens, resets and closes all its sessions at once; one request per
  session for these cost the service a quarter of its throughput at 64 sessions
  (bench/env_service.py).

Bad input is always a 4xx (413 body too large, 422 malformed/wrong types/too long, 404
unknown session, 409 protocol order, 401 bad token), never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from fedagent.envs.base import StepResult, TaskSource
from fedagent.envs.guard import GuardMiddleware
from fedagent.envs.sessions import EnvPool, Session, ThreadCalls  # noqa: F401 - re-exported
from fedagent.envs.protocol import (  # noqa: F401 - MAX_TEXT_CHARS re-exported
    BATCH_PATHS,
    MAX_BATCH_BODY_BYTES,
    MAX_BODY_BYTES,
    MAX_TEXT_CHARS,
    BatchRequest,
    HealthResponse,
    ResetBatchResponse,
    ResetRequest,
    ResetResponse,
    SessionBatchResponse,
    SessionRequest,
    SessionResponse,
    StepBatchResponse,
    StepRequest,
    StepResponse,
    ExpertBatchResponse,
    ExpertResponse,
)
from fedagent.rollout.parsing import fallback_chars, parse_action
from fedagent.rollout.prompts import prompt_templates


def task_for_seed(tasks: Sequence[str], seed: int, mode: str) -> str:
    """The pure seed → task map: index mode ``tasks[seed % n]``, draw mode a local-RNG draw."""
    if mode == "index":
        return tasks[seed % len(tasks)]
    if mode == "draw":
        return tasks[random.Random(seed).randrange(len(tasks))]
    raise ValueError(f"unknown mode {mode!r} (index or draw)")


def _item_error(status: int, detail: str) -> dict:
    return {"error": {"status": status, "detail": detail}}


def _brief(exc: ValidationError) -> str:
    """A one-line summary of a pydantic error (location: message, first three)."""
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ())) or 'item'}: {e.get('msg', '')}" for e in exc.errors()[:3]]
    return "; ".join(parts)


# ---------------------------------------------------------------- app
def build_app(
    task_source: TaskSource,
    split: str,
    task_ids: Sequence[str],
    *,
    mode: Literal["draw", "index"] = "draw",
    pool_size: int = 4,
    max_turns: int = 50,
    client_id: str | None = None,
    token: str | None = None,
    create_timeout: float | None = None,
    max_body: int = MAX_BODY_BYTES,
    max_batch_body: int = MAX_BATCH_BODY_BYTES,
    env_threads: bool = True,
    env_procs: int = 0,
    answer_format: str = "think_action",
    projection: str = "reference",
    expert: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``task_ids`` (in this order) of ``task_source`` from a pool.

    ``answer_format`` (``think_action`` | ``action``) is what :func:`parse_action` requires of an
    answer for it to be valid; ``projection`` what an invalid one does (fedagent.rollout.parsing).
    ``expert``: envs made with their expert (``make_env(..., policy_commands=True)``) and the
    ``/expert_batch`` endpoint.
    """
    tasks = list(task_ids)
    if not tasks:
        raise ValueError("a service needs at least one task")
    if mode not in ("draw", "index"):
        raise ValueError(f"unknown mode {mode!r} (index or draw)")
    if pool_size < 1 or max_turns < 1:
        raise ValueError("pool_size and max_turns must be >= 1")
    if answer_format not in ("think_action", "action"):
        raise ValueError(f"unknown answer_format {answer_format!r} (think_action or action)")
    require_think = answer_format == "think_action"
    prompt_template = getattr(task_source, "prompt_template", None)
    if prompt_template not in prompt_templates():
        raise ValueError(
            f"task source {type(task_source).__name__} names no known prompt_template "
            f"(one of {prompt_templates()}), got {prompt_template!r}"
        )
    tail = fallback_chars(prompt_template, projection)  # also refuses an unknown projection
    execute_invalid = projection == "reference"
    task_types = {t: task_source.task_type(t) for t in tasks}  # also fails early on unknown ids
    env_info = dict(getattr(task_source, "info", None) or {})
    tasks_sha = hashlib.sha256("\n".join(tasks).encode()).hexdigest()
    type_counts: dict[str, int] = {}
    for t in task_types.values():
        type_counts[t] = type_counts.get(t, 0) + 1

    workers = []
    if env_procs > 0:
        # Envs live in worker processes (GIL-bound envs step in parallel; ALFWorld's PDDL lock is
        # per process); see envs/pool.py. An expert service's workers build their envs with it.
        from fedagent.envs.pool import process_envs

        env_list, workers = process_envs(task_source, max_turns, pool_size, env_procs, expert=expert)
        env_threads = True  # proxies block on a pipe: keep them off the loop
    elif expert:
        env_list = [task_source.make_env(max_turns, policy_commands=True) for _ in range(pool_size)]
    else:
        env_list = [task_source.make_env(max_turns) for _ in range(pool_size)]
    pool_ = EnvPool(env_list)
    # One thread per env: env calls block (TextWorld/jericho) and sessions run in parallel.
    executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="env") if env_threads else None
    thread_calls = ThreadCalls(executor) if executor is not None else None
    all_envs = list(pool_._free)
    sessions: dict[str, Session] = {}
    counters = {"creates": 0, "borrows": 0, "closes": 0, "resets": 0, "steps": 0, "replays": 0, "batches": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for env in all_envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        for worker in workers:
            worker.shutdown()

    app = FastAPI(title="fedagent env service", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(
        GuardMiddleware, max_body=max_body, token=token, path_caps={p: max_batch_body for p in BATCH_PATHS}
    )

    async def in_thread(fn, *args):
        if executor is None:
            return fn(*args)  # inline: no thread hand-offs (see env_threads)
        return await thread_calls.run(asyncio.get_running_loop(), fn, *args)

    def pool() -> EnvPool:
        return pool_

    # ------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        return JSONResponse({"detail": "invalid request", "errors": errors[:10]}, status_code=422)

    async def run_to_completion(coro):
        # Shielded: a client that disconnects (or a cancelled request) never leaves a session
        # half-stepped; the work finishes and its response is cached for a replay.
        return await asyncio.shield(asyncio.ensure_future(coro))

    async def get_session(session_id: str) -> Session:
        s = sessions.get(session_id)
        if s is None:
            raise HTTPException(404, f"unknown session {session_id!r} (create it first)")
        try:
            await asyncio.shield(s.ready)  # a create of this id may still be borrowing
        except Exception as exc:  # that create failed: the session never existed
            raise HTTPException(404, f"session {session_id!r} failed to create: {exc}") from exc
        if s.closed:
            raise HTTPException(404, f"session {session_id!r} was closed")
        return s

    # ------------------------------------------------------------ endpoints
    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        """Liveness and pool accounting."""
        return HealthResponse(
            ok=True,
            pool_free=pool().free,
            pool_total=pool().total,
            sessions=len(sessions),
            split=split,
            client_id=client_id,
            mode=mode,
            num_tasks=len(tasks),
            tasks_sha256=tasks_sha,
            task_types=type_counts,
            max_turns=max_turns,
            counters=dict(counters),
            env_info=env_info,
        )

    @app.post("/create", response_model=SessionResponse)
    async def create(req: SessionRequest) -> SessionResponse:
        """Borrow an env for the session (idempotent; waits while the pool is empty)."""
        return await _create(req)

    async def _create(req: SessionRequest) -> SessionResponse:
        """Borrow an env for the session (idempotent; waits while the pool is empty)."""
        counters["creates"] += 1
        s = sessions.get(req.session_id)
        if s is not None:
            try:
                await asyncio.shield(s.ready)  # the first create's borrow, never a second one
            except Exception as exc:  # the first borrow failed (timeout): report it the same way
                raise HTTPException(503, f"create of {req.session_id!r} failed: {exc!r}") from exc
            if s.closed:
                raise HTTPException(409, f"session {req.session_id!r} was closed while being created")
            return SessionResponse(ok=True, session_id=req.session_id, created=False)
        s = Session(req.session_id, ready=asyncio.get_running_loop().create_future())
        sessions[req.session_id] = s  # reserve the slot *before* the blocking borrow
        try:
            env = await pool().borrow(create_timeout)
        except BaseException as exc:
            if sessions.get(req.session_id) is s:
                del sessions[req.session_id]
            s.ready.set_exception(
                RuntimeError("pool borrow timed out" if isinstance(exc, asyncio.TimeoutError) else "create aborted")
            )
            s.ready.exception()  # mark retrieved: waiters may not exist
            if isinstance(exc, asyncio.TimeoutError):
                raise HTTPException(503, f"no env free within {create_timeout} s") from exc
            raise
        counters["borrows"] += 1
        if s.closed:  # closed while we waited: give the env straight back
            pool().release(env)
            s.ready.set_result(None)
            raise HTTPException(409, f"session {req.session_id!r} was closed while being created")
        s.env = env
        s.ready.set_result(None)
        return SessionResponse(ok=True, session_id=req.session_id, created=True)

    async def _reset(req: ResetRequest) -> ResetResponse:
        """Start an episode of the seed's task; zeroes the step counter."""
        s = await get_session(req.session_id)
        async with s.lock:
            if s.closed:
                raise HTTPException(404, f"session {req.session_id!r} was closed")
            task_id = task_for_seed(tasks, req.seed, mode)
            r = await in_thread(s.env.reset, task_id)
            counters["resets"] += 1
            s.task_id, s.task_type = r.task_id, r.task_type
            s.next_step_id, s.turns, s.done, s.replay = 0, 0, False, None
            s.last_obs, s.last_admissible, s.last_score, s.last_won = (
                r.observation,
                list(r.admissible_commands),
                0.0,
                False,
            )
            return ResetResponse(
                observation=r.observation,
                task=r.task,
                admissible_commands=list(r.admissible_commands),
                task_id=r.task_id,
                task_type=r.task_type,
                prompt_template=prompt_template,
            )

    @app.post("/reset", response_model=ResetResponse)
    async def reset(req: ResetRequest) -> ResetResponse:
        """Start an episode of the seed's task; zeroes the step counter."""
        return await run_to_completion(_reset(req))

    async def _step(req: StepRequest) -> dict:
        """One turn: parse the answer, step the env (or no-op), enforce the turn budget."""
        s = await get_session(req.session_id)
        async with s.lock:
            if s.closed:
                raise HTTPException(404, f"session {req.session_id!r} was closed")
            if s.task_id is None:
                raise HTTPException(409, "step before reset")
            if s.replay is not None and req.step_id == s.replay[0]:
                if req.text != s.replay[1]:
                    raise HTTPException(409, f"step_id {req.step_id} re-sent with a different text")
                counters["replays"] += 1
                return s.replay[2]
            if req.step_id != s.next_step_id:
                raise HTTPException(409, f"step_id {req.step_id} out of order (expected {s.next_step_id})")
            parsed = parse_action(req.text, tail, require_think=require_think)
            if s.done:
                # Past the end: nothing changes, nothing is earned.
                r = StepResult(s.last_obs, 0.0, True, s.last_won, s.last_admissible, s.last_score)
            elif parsed.valid or execute_invalid:  # reference: a format error still acts
                r = await in_thread(s.env.step, parsed.action)
            else:
                # projection noop, invalid format: a no-op turn that still costs budget.
                r = StepResult(s.last_obs, 0.0, False, False, s.last_admissible, s.last_score)
            counters["steps"] += 1
            s.turns += 1
            done = bool(r.done) or s.turns >= max_turns
            s.done, s.last_obs, s.last_admissible = done, r.observation, list(r.admissible_commands)
            s.last_score, s.last_won = float(r.score), bool(r.won)
            resp = StepResponse(
                observation=r.observation,
                reward=float(r.reward),
                done=done,
                won=bool(r.won),
                is_action_valid=parsed.valid,
                action=parsed.action,
                admissible_commands=list(r.admissible_commands),
                task_id=s.task_id,
                task_type=s.task_type,
                score=float(r.score),
                step_id=req.step_id,
                turns=s.turns,
            ).model_dump()
            s.replay = (req.step_id, req.text, resp)
            s.next_step_id += 1
            return resp

    @app.post("/step", response_model=StepResponse)
    async def step(req: StepRequest) -> dict:
        """One turn: parse the answer, step the env (or no-op), enforce the turn budget."""
        return await run_to_completion(_step(req))

    async def _batch_item(what: str, model: type[BaseModel], handler, item: dict[str, Any]) -> dict:
        """One batch item: exactly the single endpoint, with its error status as a value."""
        try:
            req = model.model_validate(item)
        except ValidationError as exc:
            return _item_error(422, "invalid item: " + _brief(exc))
        try:
            out = await handler(req)
        except HTTPException as exc:
            return _item_error(exc.status_code, str(exc.detail))
        except Exception as exc:  # noqa: BLE001 - an env that raised fails only its own item
            return _item_error(500, f"{what} of {req.session_id!r} failed: {type(exc).__name__}: {exc}")
        return out.model_dump() if isinstance(out, BaseModel) else out

    async def _run_batch(what: str, model: type[BaseModel], handler, items: list[dict[str, Any]]) -> dict:
        counters["batches"] += 1
        # Items start in order, so repeated items of one session take its lock in order. One
        # shield for the whole batch (cheaper than one per item): every item completes.
        batch = asyncio.gather(*(_batch_item(what, model, handler, item) for item in items))
        # Every item is already a dumped response model: a JSONResponse skips FastAPI's second
        # validation of the whole list against the response_model union (measured with a
        # no-op env: 15.5 -> 14.2 ms per /step_batch of 64 items, client included).
        return JSONResponse({"results": list(await run_to_completion(batch))})

    @app.post("/create_batch", response_model=SessionBatchResponse)
    async def create_batch(req: BatchRequest) -> dict:
        """Many /creates in one round trip (each waits for its borrow); results in item order.

        A batch that would hold more new sessions than the pool has envs can never finish
        (its items keep their envs until closed), so it is refused whole, before any borrow.
        """
        # Only well-formed ids can borrow; a malformed one (even unhashable) is its item's own 422.
        new = {sid for item in req.items if isinstance(sid := item.get("session_id"), str)} - sessions.keys()
        if len(new) > pool().total:
            raise HTTPException(
                409,
                f"create_batch of {len(new)} new sessions cannot be served by a pool "
                f"of {pool().total} envs; send at most {pool().total} at once",
            )
        return await _run_batch("create", SessionRequest, _create, req.items)

    @app.post("/reset_batch", response_model=ResetBatchResponse)
    async def reset_batch(req: BatchRequest) -> dict:
        """Many /resets in one round trip, run concurrently; results in item order."""
        return await _run_batch("reset", ResetRequest, _reset, req.items)

    @app.post("/step_batch", response_model=StepBatchResponse)
    async def step_batch(req: BatchRequest) -> dict:
        """Many /steps in one round trip, stepped concurrently; results in item order."""
        return await _run_batch("step", StepRequest, _step, req.items)

    @app.post("/close_batch", response_model=SessionBatchResponse)
    async def close_batch(req: BatchRequest) -> dict:
        """Many /closes in one round trip (idempotent each); results in item order."""
        return await _run_batch("close", SessionRequest, _close, req.items)

    async def _expert(req: SessionRequest) -> ExpertResponse:
        """The expert's next action in the session's current state (None once it is done)."""
        s = await get_session(req.session_id)
        async with s.lock:
            if s.task_id is None:
                raise HTTPException(409, "expert before reset")
            action = None if s.done else await in_thread(s.env.expert_action)
            return ExpertResponse(session_id=req.session_id, action=action)

    @app.post("/expert_batch", response_model=ExpertBatchResponse)
    async def expert_batch(req: BatchRequest) -> dict:
        """Many sessions' expert actions in one round trip; results in item order."""
        if not expert:
            raise HTTPException(404, "this service has no expert (started without expert=True)")
        return await _run_batch("expert", SessionRequest, _expert, req.items)

    async def _close(req: SessionRequest) -> SessionResponse:
        """End the session and return its env (idempotent: an unknown id is fine)."""
        counters["closes"] += 1
        s = sessions.pop(req.session_id, None)
        if s is None:
            return SessionResponse(ok=True, session_id=req.session_id, existed=False)
        s.closed = True
        if not s.ready.done():
            # Still waiting for an env: the pending create hands it back when it arrives.
            return SessionResponse(ok=True, session_id=req.session_id, existed=True)
        if s.ready.exception() is None and s.env is not None:
            async with s.lock:  # let an in-flight reset/step finish with the env
                env, s.env = s.env, None
            if env is not None:
                pool().release(env)
        return SessionResponse(ok=True, session_id=req.session_id, existed=True)

    @app.post("/close", response_model=SessionResponse)
    async def close(req: SessionRequest) -> SessionResponse:
        """End the session and return its env (idempotent: an unknown id is fine)."""
        return await run_to_completion(_close(req))

    app.state.sessions = sessions
    app.state.counters = counters
    app.state.pool = pool
    return app
