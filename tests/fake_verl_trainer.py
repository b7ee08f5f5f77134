"""A stand-in for ``python -m verl.trainer.main_ppo`` (set ``FEDAGENT_VERL_TRAINER=fake_verl_trainer``).

Does what a verl job does to the machine, without a GPU: takes the same Hydra overrides,
binds what verl/Ray/vLLM bind (a Unix socket in Ray's temp dir, a TCP port picked by the OS,
the weight-transfer IPC socket named from the salted Ray job id via our Ray hook), leaves a
child process running (as Ray/vLLM do), plays each dataset row's episodes against the job's
env service through the agent-loop YAML, and saves a world-size-1 FSDP-layout checkpoint of
the start model with a fixed perturbation. It records what it saw in ``$FAKE_VERL_RECORD``
and holds everything open for ``$FAKE_VERL_HOLD_S`` seconds so that two jobs overlap
(``$FAKE_VERL_HOLD_ONLY_LATER=1``: only the trainers that start after a first one has recorded).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


# per-step metric values at step 1 (step k logs k times these)
FAKE_STEP_VALUES = {
    "actor/pg_loss": -0.01,
    "actor/kl_loss": 0.003,
    "actor/entropy": 1.25,
    "actor/pg_clipfrac": 0.02,
    "actor/grad_norm": 0.5,
    "critic/rewards/mean": 0.25,
}
FAKE_CRITIC_VALUES = {"critic/vf_loss": 0.125}  # PPO jobs only


def parse(argv: list[str]) -> dict[str, str]:
    out = {}
    for a in argv:
        key, _, value = a.partition("=")
        out[key.lstrip("+")] = value
    return out


def ray_env_str(value: str) -> str:
    """An env var's override value as Hydra hands it to ``ray.init``: quoted, the string inside; an
    unquoted number, bool or null is not a str, and Ray refuses the runtime env (as on the H200)."""
    import re

    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|true|false|null", value, re.IGNORECASE):
        raise TypeError(f"runtime_env['env_vars'] must be of type Dict[str, str], but the value {value} is not a str")
    return value


def play_episodes(entry: dict, rows_file, n: int, tag: str) -> None:
    """One scripted episode per row and rollout through the agent-loop entry's env address (or its job file,
    read as our agent loop reads it), appended to its record file as our agent loop records them."""
    import pandas as pd

    from fedagent.core.seeds import request_seed
    from fedagent.envs.client import EnvClient

    if entry.get("job_file"):
        from fedagent.train.verl.agent_loop import JOB_FILE_KEYS, read_job_file

        entry = {**entry, **dict(zip(JOB_FILE_KEYS, read_job_file(entry["job_file"])))}
    env = (
        EnvClient(uds=entry["env_uds"])
        if entry["env_uds"]
        else EnvClient(base_url=entry["env_url"], token=entry["env_token"])
    )
    rows = pd.read_parquet(rows_file)
    with open(entry["record_file"], "a") as rec:
        for k, info in enumerate(rows["extra_info"]):
            for s in range(n):
                sid = f"{tag}-{k}-{s}"
                env.create(sid)
                r = env.reset(sid, int(info["seed"]))
                st = env.step(sid, "<think>x</think><action>look</action>")
                env.close(sid)
                rec.write(
                    json.dumps(
                        {
                            "epoch": int(info["epoch"]),
                            "group": int(info["group"]),
                            "session": s,
                            "seed": int(info["seed"]),
                            "task_id": r["task_id"],
                            "task_type": r["task_type"],
                            "return": float(st["reward"]),
                            "won": bool(st.get("won")),
                            "score": 0.0,
                            "n_turns": 1,
                            "t_first_generation": time.time(),
                            "turns": [
                                {
                                    "action": st["action"],
                                    "valid": st["is_action_valid"],
                                    "reward": st["reward"],
                                    "text": "x",
                                    # as our agent loop seeds its requests (the job checks it)
                                    # ($FAKE_VERL_ENGINE_SEED: one engine-wide seed instead)
                                    "sampling_seed": int(os.environ["FAKE_VERL_ENGINE_SEED"])
                                    if os.environ.get("FAKE_VERL_ENGINE_SEED")
                                    else request_seed(
                                        int(info["base_seed"]),
                                        round=int(info["round"]),
                                        client=int(info["client"]),
                                        epoch=int(info["epoch"]),
                                        group=int(info["group"]),
                                        session=s,
                                        turn=0,
                                    ),
                                    "prompt_tokens": 10,
                                    "response_tokens": 3,
                                }
                            ],
                        }
                    )
                    + "\n"
                )


def save_checkpoint(model_dir: Path, ckpt_dir: Path, steps: int, critic_dir: Path | None) -> None:
    """One save at the end: FSDP layout, world size 1, fp32, start model + 1/1024 (the critic: + 1/512)."""
    import torch
    from safetensors.torch import load_file

    actor = Path(ckpt_dir) / f"global_step_{steps}" / "actor"
    actor.mkdir(parents=True)
    sd = {k: v + 2.0**-10 for k, v in load_file(Path(model_dir) / "model.safetensors").items()}
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    torch.save(sd, actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 1}))
    if critic_dir is not None:  # the critic's save beside the actor's
        critic = actor.parent / "critic"
        critic.mkdir()
        csd = {k: v + 2.0**-9 for k, v in load_file(Path(critic_dir) / "model.safetensors").items()}
        torch.save(csd, critic / "model_world_size_1_rank_0.pt")
        (critic / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 1}))


def print_steps(steps: int, ppo: bool) -> list[dict]:
    """verl's console logger, one line per step, with known values (FAKE_STEP_VALUES) that the job's
    metrics.json must carry; the same records as verl's Tracking gets them."""
    recorded = []
    for step in range(1, steps + 1):
        vals = {k: v * step for k, v in {**FAKE_STEP_VALUES, **(FAKE_CRITIC_VALUES if ppo else {})}.items()}
        values = " - ".join(f"{k}:{v}" for k, v in vals.items())
        print(
            f"step:{step} - timing_s/gen:2.5 - timing_s/old_log_prob:0.25 - timing_s/ref:0.5 - timing_s/update_actor:1.0"
            f" - perf/throughput:1234.5 - {values}",
            flush=True,
        )
        recorded.append(
            {
                "step": step,
                "timing_s/gen": 2.5,
                "timing_s/old_log_prob": 0.25,
                "timing_s/ref": 0.5,
                "timing_s/update_actor": 1.0,
                "perf/throughput": 1234.5,
                **vals,
            }
        )
    return recorded


def main() -> int:
    import yaml

    from fedagent.train.verl import ray_hook

    print("2026-12-01 00:00:00,000\tINFO worker.py:2038 -- Started a local Ray instance.", flush=True)
    ov = parse(sys.argv[1:])
    tag = os.environ[ray_hook.TAG_ENV]
    once = os.environ.get("FAKE_VERL_PORTFAIL_ONCE")
    if once and not Path(once).exists():  # the first launch loses a port race
        Path(once).write_text("x")
        print("OSError: [Errno 98] Address already in use", flush=True)
        return 1
    assert ov["ray_kwargs.ray_init.runtime_env.env_vars." + ray_hook.TAG_ENV] == tag
    ray_tmp = Path(ov["ray_kwargs.ray_init._temp_dir"])
    # Ray: session dir + a Unix socket inside the job's temp dir.
    sess = ray_tmp / f"session_fake_{os.getpid()}" / "sockets"
    sess.mkdir(parents=True)
    raylet = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raylet.bind(str(sess / "raylet"))
    raylet.listen()
    # verl/vLLM: a port from the OS (verl's get_free_port binds port 0).
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    # The weight-transfer socket, named as verl 0.9.1 names it, from the job id our Ray hook
    # gives a verl caller (the unsalted id of a fresh cluster's first driver is 01000000).
    # Ray's worker setup hook, as Ray would run it in the trainer's worker, with the env vars the
    # launch gives Ray's runtime_env (a PPO job's arms its critic loss: the armed line comes from
    # the real verl trainer module, imported here as verl's TaskRunner imports it).
    prefix = "ray_kwargs.ray_init.runtime_env.env_vars."
    for key, value in ov.items():
        if key.startswith(prefix) and key[len(prefix) :] != ray_hook.TAG_ENV:
            os.environ[key[len(prefix) :]] = ray_env_str(value)
    if os.environ.get("FAKE_VERL_NO_CRITIC_ATTN"):  # a hook that never arms the critic's loader
        from fedagent.train.verl import critic_attn

        critic_attn.arm = lambda: None
    ray_hook.setup()  # fails closed on a Ray without get_job_id
    ppo = "critic.model.path" in ov
    if ppo and not os.environ.get("FAKE_VERL_SKIP_TRAINER_IMPORT"):
        import verl.trainer.ppo.v1.trainer_base  # noqa: F401 - the hook's patch runs on this import
    salted = ray_hook.salted_get_job_id(lambda self: "01000000", tag)
    job_id = eval(
        "get_job_id(None)", {"__name__": "verl.workers.rollout.vllm_rollout.vllm_rollout", "get_job_id": salted}
    )
    ipc_path = f"/tmp/rl-colocate-zmq-{job_id}-replica-0-rank-0.sock"
    ipc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ipc.bind(ipc_path)  # EADDRINUSE if two jobs shared the name
    ipc.listen()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # verl 0.9.1's start-up lines, in its order (the backend times its phases by them).
    for line in (
        "INFO:2026-12-01 00:00:01,000:train and validate dataloader initialized, train dataset size: 1",
        "INFO:2026-12-01 00:00:02,000:actor and ref model engine initialized",
        "LLMServerManager: ['127.0.0.1:1']",
        "INFO:2026-12-01 00:00:03,000:all initialize finished, ready to fit",
    ):
        print(line, flush=True)
    # train.verl.warm_refit (fedagent.train.verl.refit): a first fit's step lines (values × 100, not the
    # job's), the refit line, the workers' reset line (FAKE_VERL_NO_RESET: left out), then the second
    # fit below — whose episodes and steps are the job's.
    from fedagent.train.verl import refit

    if os.environ.get(refit.REFIT_ENV):
        values = " - ".join(f"{k}:{v * 100}" for k, v in FAKE_STEP_VALUES.items())
        print(f"step:1 - timing_s/gen:2.5 - {values}", flush=True)
        t_cold = time.time()
        print(f"{refit.FIRST_FIT_TOKEN_PREFIX}{t_cold:.3f}", flush=True)  # the first fit's first token
        time.sleep(0.05)
        print(refit.refit_line(time.time()), flush=True)
        if not os.environ.get("FAKE_VERL_NO_RESET"):
            reset_from = os.environ.get("FAKE_VERL_RESET_FROM") or ov["actor_rollout_ref.model.path"]
            print(f"(WorkerDict pid=1) {refit.RESET_LINE}{reset_from}", flush=True)
            from fedagent.train.verl.ref_model import REF_MODEL_ENV

            ref_from = (
                os.environ.get("FAKE_VERL_REF_RESET_FROM")
                or os.environ.get(REF_MODEL_ENV)
                or ov["actor_rollout_ref.model.path"]
            )
            print(f"(WorkerDict pid=1) {refit.REF_RESET_LINE}{ref_from}", flush=True)
        time.sleep(0.05)
    # Episodes through the agent-loop YAML's env address.
    entry = yaml.safe_load(Path(ov["actor_rollout_ref.rollout.agent.agent_loop_config_path"]).read_text())[0]
    play_episodes(entry, ov["data.train_files"], int(ov["actor_rollout_ref.rollout.n"]), tag)
    record = {
        "tag": tag,
        "pid": os.getpid(),
        "t": time.time(),
        "child": child.pid,
        "tcp_port": tcp.getsockname()[1],
        "ray_tmp": str(ray_tmp),
        "raylet": str(sess / "raylet"),
        "ipc": ipc_path,
        "tmpdir": os.environ["TMPDIR"],
        "ray_address": os.environ.get("RAY_ADDRESS"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "workdir": str(Path(ov["trainer.default_local_dir"]).parent),
        "argv": sys.argv[1:],
    }
    out = Path(os.environ["FAKE_VERL_RECORD"]) / f"{tag}.json"
    # whole or absent: tests poll this directory while the job runs (an empty file was read once)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(out)
    hold = float(os.environ.get("FAKE_VERL_HOLD_S", "1"))
    if os.environ.get("FAKE_VERL_HOLD_ONLY_LATER") == "1" and len(list(out.parent.glob("*.json"))) < 2:
        hold = 0.0  # the first trainer of the test does not hold; the ones after it do
    time.sleep(hold)
    steps = int(ov["trainer.total_training_steps"])
    save_checkpoint(
        Path(ov["actor_rollout_ref.model.path"]),
        Path(ov["trainer.default_local_dir"]),
        steps,
        Path(ov["critic.model.path"]) if ppo else None,
    )
    recorded = print_steps(steps, ppo)
    if os.environ.get(refit.REFIT_ENV):  # the refit runner's recorded steps
        (Path(ov["trainer.default_local_dir"]).parent / refit.STEPS_FILE).write_text(json.dumps(recorded))
    if os.environ.get("FAKE_VERL_FAIL"):
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
