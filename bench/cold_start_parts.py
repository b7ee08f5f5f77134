"""Where a GPU train job's cold start goes, part by part, and what a process prepared beforehand saves.

    python bench/cold_start_parts.py --model results/<run>/round_000/model [--json out.json]

Each variant runs in a fresh interpreter that first imports what the warm server preloads
(``train,eval``; not timed: a warm-server job has them already) and then does what a ``train-client`` job on ``device: cuda`` does before its first
sampled token, each part timed with a device sync: CUDA's start, the policy's load onto the GPU,
the reference and the bf16 rollout copies, the static-cache sampler (``mode: graph``) and its
warm-up, the first real sampler call (64 prompts) to its first token; then two optimizer steps of
the preset's micro-batch (``update_step``: the first pays the backward's kernels). What runs
*before* the job's clock, per variant (``--variants``):

  none   nothing: a plain forked job
  cuda   the CUDA context, a device allocation and the cuBLAS handle (a bf16 and an fp32 matmul):
         what a warm server's standby process (``warm-server --standby``) does before a job exists
  arch   ``cuda`` + :func:`fedagent.warm.gpu_warmup.warm_up` (a standby's ``--standby-config``
         warm-up): the job's calls on a 1-layer model of its own architecture (random weights)
  full   the whole job sequence once on the real model, then timed again in the same process
         (the floor: only what a job must redo with everything loaded)

The ratios are against ``none`` of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("none", "cuda", "arch", "full")
POOL, WIDTH, NEW, MICRO = 64, 512, 16, 32


def _job(model, tok, parts: dict, rng_seed: int = 0):
    """The job's sequence after its policy is loaded: copies, sampler, warm-up, first call, 2 steps."""
    import copy

    import torch

    from fedagent.model.static_sampler import StaticSampler
    from fedagent.train import grpo
    from fedagent.train.local import TrainParams
    from fedagent.train.actor import autocast, logprobs_nograd, token_slices, deferred_steps, update_step

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        sync()
        parts[name] = round(time.perf_counter() - t, 4)
        return out

    def copies():
        ref = copy.deepcopy(model)
        ref.requires_grad_(False)
        roll = copy.deepcopy(model).to(torch.bfloat16)
        roll.requires_grad_(False)
        return ref, roll

    ref, roll = timed("copies", copies)
    sampler = timed(
        "sampler_init",
        lambda: StaticSampler(
            roll,
            tok,
            batch_size=POOL,
            max_prompt_tokens=WIDTH,
            max_new_tokens=NEW,
            mode="graph" if device.type == "cuda" else "eager",
        ),
    )
    timed("sampler_warmup", lambda: sampler.warmup(1.0))
    g = torch.Generator().manual_seed(rng_seed)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(100, vocab - 100, (int(n),), generator=g).tolist()
        for n in torch.randint(250, 400, (POOL,), generator=g)
    ]
    t = time.time()
    sampler.first_token_time = None
    gens = timed("first_call", lambda: sampler(roll, tok, prompts, NEW, 1.0, torch.Generator().manual_seed(1)))
    parts["first_call_to_first_token"] = round(sampler.first_token_time - t, 4)
    samples = [
        grpo.Sample(prompt_ids=gn.prompt_ids, response_ids=gn.response_ids or [1], reward=float(i % 2), group=i // 8)
        for i, gn in enumerate(gens[:MICRO])
    ]
    for s, a in zip(samples, grpo.group_advantages([s.reward for s in samples], [s.group for s in samples])):
        s.advantage = a
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=device.type == "cuda")
    p = TrainParams(mini_batch_size=MICRO, micro_batch_size=MICRO, kl_coef=0.01, temperature=1.0)
    params = [q for q in model.parameters() if q.requires_grad]
    with autocast(model):
        old = timed("behaviour_logprobs", lambda: logprobs_nograd(model, samples, MICRO, 1.0))
    adv = grpo.token_advantages(samples).to(device)
    slices = token_slices(samples)
    for k in (1, 2):
        timed(
            f"train_step_{k}",
            lambda: update_step(
                model,
                opt,
                samples,
                list(range(len(samples))),
                old,
                old,
                adv,
                slices,
                p,
                params,
                deferred=deferred_steps(opt),
            ),
        )


def child(model_dir: Path, variant: str) -> dict:
    import torch

    from fedagent.model.policy import load_policy

    from fedagent.warm.preload import parse_groups, preload

    preload(parse_groups("train,eval"))  # what a warm server has imported before forking a job
    parts: dict = {"variant": variant}
    t0 = time.perf_counter()
    if variant in ("cuda", "arch", "full"):
        from fedagent.warm import standby

        standby.prepare("cuda")  # what a --standby process does before its job
    if variant == "arch":
        from fedagent.warm.gpu_warmup import Shapes, warm_up

        parts["warmup_parts"] = {
            k: round(v, 3)
            for k, v in warm_up(
                Shapes(
                    model_dir,
                    {"pool": POOL, "width": WIDTH, "new_tokens": NEW, "micro": MICRO, "sampler": "graph"},
                    {"batch": POOL, "width": WIDTH, "new_tokens": NEW, "sampler": "graph"},
                )
            ).items()
        }
    if variant == "full":
        m, tok = load_policy(model_dir, 4, verify=False, device="cuda")
        _job(m, tok, {})
        del m
        torch.cuda.empty_cache()
    parts["before_job_s"] = round(time.perf_counter() - t0, 3)
    t_job = time.perf_counter()
    t = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    parts["cuda_start"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    model, tok = load_policy(model_dir, 4, verify=False, device="cuda")
    torch.cuda.synchronize()
    parts["load_policy"] = round(time.perf_counter() - t, 4)
    _job(model, tok, parts)
    parts["to_first_token"] = round(
        sum(parts[k] for k in ("cuda_start", "load_policy", "copies", "sampler_init", "sampler_warmup"))
        + parts["first_call_to_first_token"],
        3,
    )
    parts["job_s"] = round(time.perf_counter() - t_job, 3)
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes per variant")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("PARTS " + json.dumps(child(args.model, args.child)), flush=True)
        return 0
    rows = []
    for _ in range(args.repeat):
        for v in args.variants:
            proc = subprocess.run(
                [sys.executable, __file__, "--model", str(args.model), "--child", v],
                capture_output=True,
                text=True,
                env=dict(os.environ),
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PARTS ")), None)
            if line is None:
                raise RuntimeError(
                    f"variant {v} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
                )
            rows.append(json.loads(line[6:]))
            print(json.dumps(rows[-1]), flush=True)
    base = [r for r in rows if r["variant"] == "none"]
    if base:
        ref = sum(r["to_first_token"] for r in base) / len(base)
        for r in rows:
            print(
                f"{r['variant']:5s} to first token {r['to_first_token']:.2f} s ({r['to_first_token'] / ref:.2f}x none)"
                f"  cuda {r['cuda_start']:.2f}  load {r['load_policy']:.2f}  copies {r['copies']:.2f}"
                f"  sampler {r['sampler_init']:.2f}+{r['sampler_warmup']:.2f}  first call {r['first_call_to_first_token']:.2f}"
                f"  steps {r['train_step_1']:.2f}/{r['train_step_2']:.2f}  (before the job {r['before_job_s']:.1f} s)"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
