"""Generation and training throughput on one GPU, all columns measured in one run.

    python bench/gpu_throughput.py --model results/<run>/round_000/model [--vllm-pythonpath DIR]
    python bench/gpu_throughput.py --model DIR_WITH_CONFIG_AND_TOKENIZER --random-weights --skip-generation
    python bench/gpu_throughput.py --source random:smollm2-1.7b --prompt 512 --vllm-pythonpath DIR \
        --train-modes eager_ckpt compiled_ckpt --train-micro 16
    python bench/gpu_throughput.py --source random:smollm2-1.7b --skip-generation --train-seq 320 \
        --train-modes eager_ckpt eager_ckpt_lora eager_lora --train-micro 8 16 32     # LoRA's step against the full

``--source random:<architecture>`` (issue 29): the model is written first, as the base-model stage writes
it (fedagent.model.base_model_random: a named public architecture, e.g. SmolLM2-1.7B, seeded random
weights, SmolLM2's tokenizer; throughput and memory do not depend on the weights' values).

Generation (batch ``--batch`` 64, prompt ``--prompt`` 256 random token ids, exactly ``--new`` 64 new
tokens, temperature 1.0, bf16):
  hf_eager   transformers ``generate`` with its dynamic cache (the baseline)
  local      fedagent's GPU path: :class:`fedagent.model.static_sampler.StaticSampler` (static cache),
             one row per sampler mode in ``--local-modes``: ``compile`` (torch.compile'd decode
             step in CUDA graphs) and ``graph`` (the eager step recorded in one CUDA graph)
  vllm       ``vllm.LLM.generate`` on token-id prompts, in a subprocess whose PYTHONPATH starts
             with ``--vllm-pythonpath`` (vLLM lives in its own install)
Each column: one warm-up call, then the median of ``--reps`` timed calls; the ratios are
against vLLM and HF eager of the same run.

Training (batch 64 x 512 tokens, the local backend's update: fp32 master weights, bf16 autocast,
log-probs of the last 128 tokens, AdamW; ``--train-micro`` rows per forward/backward, the gradients of
the batch accumulated as ``train.micro_batch_size`` does), in the variants ``--train-modes`` names
(default: the earlier left-padded step, the GPU default, ``train.compile_train``; ``*_ckpt``: with
``train.activation_checkpointing``; see :func:`bench_train`):
tokens/s and MFU = the FLOPs the
step computes (decoder weights on every token, the LM head on the 128 trained tokens, causal
attention; see :func:`bench_train`) / time / peak, with peak = ``--peak-tflops`` (bf16 dense;
the H200 datasheet's 989 by default), over steps run back to back as the training loop runs
them, and again with a sync after every step. The naive 6·N·T figure is printed beside it. With
checkpointing the MFU counts the model's FLOPs only (the recomputed forward is not useful work; ``hfu``
counts it). Every generation column and training mode also reports the peak GPU memory torch's
allocator held and reserved in it (``peak_*_mib``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, PROMPT, NEW = 64, 256, 64


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (B, PROMPT), generator=g).tolist()


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> dict:
    """Peak GPU memory since the last :func:`_reset_peak` (MiB): what tensors held and what the allocator reserved."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20),
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
    }


def bench_hf(model, prompts, reps):
    import torch

    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)

    def call():
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
            )

    return _timed(call, reps)


def bench_local(model, tok, prompts, reps, mode="compile", profile=False, profile_dir=None):
    """One local sampler mode's full call, first call and prefill/decode split (see LOCAL_MODES)."""
    import torch

    base, prefill, fused, mea = parse_local_mode(mode)
    # Every mode traces its own graphs: Dynamo's cache is keyed on the sampler's code, not on the SDPA
    # backend flags, so without a reset a "_mea" mode after its cuDNN twin (or the reverse) replays
    # the twin's compiled step (seen on the H200 2026-12-04: a "_mea" row with the cuDNN row's time
    # and a 0.6 s first call).
    torch._dynamo.reset()
    # "_mea": SDPA without its cuDNN backend (the memory-efficient kernel takes the masked attention),
    # from the first trace on, so the compiled graphs bake that choice in.
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(not mea and cudnn)
    try:
        return _bench_local(model, tok, prompts, reps, mode, base, prefill, fused, profile, profile_dir)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


LOCAL_BASES = ("compile", "graph", "compile_graph")
# every local mode: a sampler mode, then optionally "_prefill" (the prefill compiled too,
# StaticSampler(compile_prefill=True)), "_fused" (merged projections, StaticSampler(fused=True)) and
# "_mea" (no cuDNN attention), in that order
LOCAL_MODES = [
    b + p + f + a for b in LOCAL_BASES for p in ("", "_prefill") for f in ("", "_fused") for a in ("", "_mea")
]


def parse_local_mode(mode: str) -> tuple[str, bool, bool, bool]:
    """``mode`` as (sampler mode, compile_prefill, fused, memory-efficient attention)."""
    mea = mode.endswith("_mea")
    mode = mode.removesuffix("_mea")
    fused = mode.endswith("_fused")
    mode = mode.removesuffix("_fused")
    prefill = mode.endswith("_prefill")
    return mode.removesuffix("_prefill"), prefill, fused, mea


def _bench_local(model, tok, prompts, reps, mode, base, prefill, fused, profile, profile_dir):
    import torch

    from fedagent.model.static_sampler import StaticSampler

    # fused: merges the model's projections in place (kept for the modes after it: they run last)
    s = StaticSampler(
        model,
        tok,
        batch_size=B,
        max_prompt_tokens=PROMPT,
        max_new_tokens=NEW,
        mode=base,
        sync_every=NEW + 1,
        compile_prefill=prefill,
        fused=fused,
    )
    s.stops = torch.tensor([-1], device="cuda")  # exactly NEW tokens per row, like the others
    gen = torch.Generator().manual_seed(1)
    t0 = time.time()
    s(model, tok, prompts, NEW, 1.0, gen)
    _sync()
    first = time.time() - t0
    full = _timed(lambda: s(model, tok, prompts, NEW, 1.0, gen), reps)
    # The prefill alone: a call that samples one token (the prompt's forward + the first pick);
    # the rest of a full call is its NEW - 1 decode steps.
    prefill = _timed(lambda: s(model, tok, prompts, 1, 1.0, gen), reps)
    split = {"prefill_s": prefill, "decode_step_ms": (full - prefill) / max(NEW - 1, 1) * 1e3}
    if profile:
        split["kernel_ms_per_call"] = _profiled(
            lambda: s(model, tok, prompts, NEW, 1.0, gen), f"local_{mode}", profile_dir
        )
        split["prefill_kernel_ms"] = _profiled(
            lambda: s(model, tok, prompts, 1, 1.0, gen), f"local_{mode}_prefill", profile_dir
        )
    return full, first, split


def _profiled(fn, label, profile_dir):
    """GPU time by kernel category of one call of ``fn`` (torch.profiler; see :func:`_kernel_breakdown`)."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    _sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    trace = Path(tempfile.mkdtemp(prefix="fa-trace-")) / f"trace_{label}.json"
    prof.export_chrome_trace(str(trace))
    print(f"--- {label}: one call", flush=True)
    ms = _kernel_breakdown(trace, 1, Path(profile_dir) / f"kernels_{label}.csv" if profile_dir else None)
    trace.unlink()
    return ms


def _timed(fn, reps):
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


VLLM_CHILD = r"""
import json, statistics, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, reps, data = sys.argv[1], int(sys.argv[2]), json.load(open(sys.argv[3]))
    t0 = time.time()
    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.3, seed=0)
    start = time.time() - t0
    sp = SamplingParams(max_tokens=%d, min_tokens=%d, ignore_eos=True, temperature=1.0, detokenize=False)
    one = SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True, temperature=1.0, detokenize=False)
    as_prompts = lambda rows: [TokensPrompt(prompt_token_ids=p) for p in rows]
    main_set, fresh = as_prompts(data["main"]), [as_prompts(rows) for rows in data["fresh"]]
    def timed(prompts, params):
        t = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); return time.perf_counter() - t
    llm.generate(main_set, sp, use_tqdm=False)          # warm-up (its prompts' KV now in the prefix cache)
    # Fresh prompts every call (no prefix-cache hit: what the local path always computes), then the
    # same prompts again and again (every call's prefill a prefix-cache hit: not a rollout's work).
    full = [timed(fresh[i], sp) for i in range(reps)]
    pre = [timed(fresh[reps + i], one) for i in range(reps)]
    full_c = [timed(main_set, sp) for _ in range(reps)]
    pre_c = [timed(main_set, one) for _ in range(reps)]
    print("VLLM_RESULT " + json.dumps({"median_s": statistics.median(full), "engine_start_s": start,
                                       "prefill_s": statistics.median(pre),
                                       "cached_median_s": statistics.median(full_c),
                                       "cached_prefill_s": statistics.median(pre_c)}))
if __name__ == "__main__":
    main()
"""


def bench_vllm(model_dir, prompts, reps, pythonpath, workdir, fresh=()):
    """vLLM's column: ``fresh`` (2 × reps prompt sets, none sharing a prefix with another) for the
    timed calls; ``prompts`` for the warm-up and for the prefix-cached figure (see VLLM_CHILD)."""
    script = Path(workdir) / "vllm_child.py"
    script.write_text(VLLM_CHILD % (NEW, NEW))  # NEW: --new, set in main()
    pfile = Path(workdir) / "prompts.json"
    pfile.write_text(json.dumps({"main": prompts, "fresh": list(fresh)}))
    env = dict(
        os.environ, PYTHONPATH=f"{pythonpath}:{os.environ.get('PYTHONPATH', '')}", VLLM_USE_FLASHINFER_SAMPLER="0"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(reps), str(pfile)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT ") :])
    raise RuntimeError(f"vLLM child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _kernel_breakdown(trace_path, steps, out_csv=None):
    """Per-kernel GPU time from a Chrome trace of ``steps`` steps: categories (GEMM, attention,
    Triton (inductor's fused kernels), other) and every kernel name × grid, per step."""
    import collections
    import csv

    ev = json.loads(Path(trace_path).read_text())["traceEvents"]
    by = collections.defaultdict(lambda: [0, 0.0])
    cats = collections.defaultdict(float)
    for e in ev:
        if e.get("cat") != "kernel":
            continue
        name, dur = e["name"], float(e.get("dur", 0.0)) / steps
        grid = tuple(e.get("args", {}).get("grid", ()))
        low = name.lower()
        if any(k in low for k in ("fmha", "flash", "cudnn", "attention", "sdpa")):
            cat = "attention"
        elif any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "splitk")):
            cat = "gemm"
        elif name.startswith("triton"):
            cat = "triton"
        else:
            cat = "other"
        cats[cat] += dur
        b = by[(cat, name, grid)]
        b[0] += 1
        b[1] += dur
    total = sum(cats.values())
    print(
        f"--- GPU time per step by category (ms): total {total / 1e3:.2f}, "
        + ", ".join(f"{c} {t / 1e3:.2f} ({t / total:.0%})" for c, t in sorted(cats.items(), key=lambda x: -x[1])),
        flush=True,
    )
    rows = sorted(by.items(), key=lambda x: -x[1][1])
    for (cat, name, grid), (n, t) in rows[:40]:
        print(f"  {t / 1e3:7.3f} ms {n / steps:6.0f}x {cat:9s} {str(grid):16s} {name[:110]}", flush=True)
    if out_csv:
        with open(out_csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["category", "kernel", "grid", "calls_per_step", "us_per_step"])
            for (cat, name, grid), (n, t) in rows:
                w.writerow([cat, name, "x".join(map(str, grid)), n / steps, round(t, 2)])
    return {c: t / 1e3 for c, t in cats.items()}


def _graph_breaks(model, samples):
    """Dynamo's graphs and graph breaks (up to 3 reasons) in the compiled training forward on
    ``samples``, traced with ``torch._dynamo.explain`` (eager backend) under the step's autocast;
    the caches are reset afterwards so the timed compile starts clean."""
    import torch

    from fedagent.train import grpo
    from fedagent.train.actor import autocast

    shape = grpo.static_pad_shape(
        len(samples), max(len(s.prompt_ids) + len(s.response_ids) for s in samples), rows_to=len(samples)
    )
    dev = next(model.parameters()).device
    ids, pos, rows, cols, targets = grpo._right_padded(samples, shape, dev)
    with autocast(model):
        ex = torch._dynamo.explain(grpo.forward_logprobs)(model, ids, None, pos, rows, cols, targets, 1.0, True)
    torch._dynamo.reset()
    reasons = [f"{b.reason} @ {b.user_stack[-1] if b.user_stack else '?'}" for b in ex.break_reasons[:3]]
    print(
        f"dynamo: {ex.graph_count} graph(s), {ex.graph_break_count} break(s)" + "".join(f"\n  {r}" for r in reasons),
        flush=True,
    )
    return ex.graph_count, reasons


def bench_train(
    model_dir,
    reps,
    peak_tflops,
    mode,
    seq=512,
    resp=128,
    profile=False,
    profile_dir=None,
    micro=None,
    lora_rank=16,
    device="cuda",
):
    """One GRPO-shaped training step at B × seq, timed; ``mode`` picks what the local backend does.

    The step is the backend's own optimizer step (:func:`fedagent.train.actor.update_step`: bf16
    autocast over fp32 masters, the clipped-ratio loss, gradient clipping, fused AdamW that skips
    a non-finite step on the device). Timed two ways: ``step_s``/``mfu``: ``max(reps, 10)`` steps
    back to back with one sync at the end, as ``grpo_epoch`` runs them (no host sync per step);
    ``*_synced``: the median of ``reps`` steps each followed by a sync (the host's work before a
    step's first kernel is then exposed). eager_leftpad: the older step kept as a baseline
    (left-padded rows with an attention mask, no clipping, torch's default foreach AdamW);
    eager: what ``train.device: cuda`` runs by default (right-padded rows, no mask, the batch in
    one non-blocking copy, fused AdamW); compiled: ``train.compile_train: true`` (the decoder
    through torch.compile with static shapes and CUDA graphs, :func:`compile_for_training`);
    ``*_bf16res``: the same with ``train.residual_dtype: bfloat16`` (:func:`grpo.set_residual_dtype`);
    compiled_tunepw: compiled with inductor's autotuning of its pointwise and reduction kernels;
    ``*_ckpt``: with ``train.activation_checkpointing`` (:func:`checkpoint_activations`); ``*_lora``: a LoRA
    client's step (``train.lora``, rank ``lora_rank``, α = 2r, every projection: the frozen base's linear
    weights in bf16 and fresh adapters, as :class:`fedagent.train.lora_client.LoraClient` makes them, AdamW
    over the adapters only; its FLOPs count no weight gradient of the base). ``micro``:
    rows per forward/backward (the B rows' gradients accumulated; None: all B at once).
    Compiled modes first report Dynamo's graphs and graph breaks (:func:`_graph_breaks`).
    """
    import tempfile
    import time

    import torch

    from fedagent.model.policy import load_policy
    from fedagent.train import grpo
    from fedagent.train.local import TrainParams
    from fedagent.train.actor import (
        autocast,
        checkpoint_activations,
        compile_for_training,
        deferred_steps,
        logprobs_nograd,
        token_slices,
        update_step,
    )

    micro = int(micro or B)
    _reset_peak()
    model, _ = load_policy(model_dir, 1, verify=False, device=device)
    lora = mode.endswith("_lora")
    base_mode = mode[: -len("_lora")] if lora else mode
    if lora:  # before checkpointing, as the train job adds them (fedagent.train.local)
        from fedagent.model.lora import LoraSettings
        from fedagent.train.lora_client import LoraClient

        client = LoraClient(LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank), 0, 1, 0, device)
        client.freeze_base(model)
        client.add_adapters(model)
    n_params = sum(p.numel() for p in model.parameters() if not lora or not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if base_mode.endswith("_ckpt"):
        checkpoint_activations(model)
        base_mode = base_mode[: -len("_ckpt")]
    model.train()
    cfg = model.config
    emb = model.get_input_embeddings().weight.numel()
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(100, cfg.vocab_size - 100, (B, seq), generator=g).tolist()
    samples = [
        grpo.Sample(prompt_ids=r[: seq - resp], response_ids=r[seq - resp :], reward=0.0, group=0, advantage=1.0)
        for r in rows
    ]
    opt = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],  # LoRA: the adapters only
        lr=1e-7,
        **({"fused": True} if mode != "eager_leftpad" else {}),
    )
    if base_mode == "compiled":
        compile_for_training(model)
    elif mode == "compiled_tunepw":  # + inductor's autotuning of its pointwise/reduction kernels
        from fedagent.train.actor import COMPILE_TRAIN_OPTIONS

        compile_for_training(model, {**COMPILE_TRAIN_OPTIONS, "max_autotune_pointwise": True})
    elif mode in ("compiled_bf16res", "eager_bf16res"):  # + train.residual_dtype: bfloat16
        grpo.set_residual_dtype(model, "bfloat16")
        if mode == "compiled_bf16res":
            compile_for_training(model)
    adv = torch.ones(B * resp, device=next(model.parameters()).device)
    p = TrainParams(mini_batch_size=B, micro_batch_size=micro, kl_coef=0.0, temperature=1.0)
    params = [q for q in model.parameters() if q.requires_grad]
    breaks = _graph_breaks(model, samples[:4]) if mode.startswith("compiled") else None
    with autocast(model):
        old = logprobs_nograd(model, samples, micro, 1.0)
    slices, mb, deferred = token_slices(samples), list(range(B)), deferred_steps(opt)

    def step():
        if mode == "eager_leftpad":  # the step before right padding and update_step (kept as the baseline)
            opt.zero_grad(set_to_none=True)
            with autocast(model):
                logp, _ = grpo.response_logprobs(model, samples, temperature=1.0)
            terms, _ = grpo.grpo_token_terms(logp, logp.detach(), None, adv, clip=0.2, kl_coef=0.0)
            loss = terms.sum() / terms.numel()
            loss.backward()
            opt.step()
            return
        # The backend's own optimizer step (what grpo_epoch runs per mini-batch).
        update_step(model, opt, samples, mb, old, None, adv, slices, p, params, deferred=deferred)

    t0 = time.time()
    step()
    _sync()
    first = time.time() - t0
    t = _timed(step, reps)
    # Back to back, one sync at the end: how grpo_epoch runs its steps (no host sync per step with
    # the fused optimizer), so the host builds step k+1 while the GPU still runs step k.
    n_back = max(reps, 10)
    step()
    _sync()
    t1 = time.perf_counter()
    for _ in range(n_back):
        step()
    _sync()
    t_back = (time.perf_counter() - t1) / n_back
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            _sync()
        trace = Path(tempfile.mkdtemp(prefix="fa-trace-")) / f"trace_{mode}.json"  # tens of MB: not kept
        prof.export_chrome_trace(str(trace))
        kernel_ms = _kernel_breakdown(trace, 2, Path(profile_dir) / f"kernels_{mode}.csv" if profile_dir else None)
        trace.unlink()
        table = prof.key_averages()
        print(f"--- training mode {mode}: top CUDA kernels over 2 steps", flush=True)
        print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)
        # Where the host's time goes while the GPU waits (launches, syncs, Python-side index building).
        print(f"--- training mode {mode}: top host operators over 2 steps", flush=True)
        print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70), flush=True)
    tokens = B * seq
    # FLOPs actually computed (forward + backward = 3 × forward, 2 per multiply-add):
    # - the decoder's weight matrices on every token: 6 · (N − embedding) · T;
    # - the (tied) LM head only on the trained response tokens: 6 · V · d · (B · resp);
    # - causal attention, QK^T and AV over half the square: 6 · L · d · seq per token.
    # The embedding lookup is a gather (no FLOPs). Counting the LM head on every token, as a
    # plain 6·N·T does, would credit this step with FLOPs it never runs.
    # A LoRA step computes no weight gradient of the frozen base (4 instead of 6 per weight and token; the
    # adapters' own products, r/d of a projection's, are left out).
    w = 4 if lora else 6
    flops = (
        w * (n_params - emb) * tokens + w * emb * B * resp + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens
    )
    # Checkpointing recomputes each layer's forward in the backward pass: hardware FLOPs, not model FLOPs.
    recompute = (
        2 * (n_params - emb) * tokens + 2 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens
        if "_ckpt" in mode
        else 0
    )
    peak = _peak()
    model = opt = None  # free them before the next mode (the closure above reads both)
    return {
        "mode": mode,
        "step_s": t_back,
        **({"kernel_ms_per_step": kernel_ms} if profile else {}),
        "micro_batch_rows": micro,
        "seq": seq,
        **peak,
        "hfu": (flops + recompute) / t_back / (peak_tflops * 1e12),
        **({"graphs": breaks[0], "graph_breaks": breaks[1]} if breaks else {}),
        "first_step_s": first,
        "tokens_per_s": tokens / t_back,
        "tflops": flops / t_back / 1e12,
        "mfu": flops / t_back / (peak_tflops * 1e12),
        "back_to_back_steps": n_back,
        "step_s_synced": t,
        "tokens_per_s_synced": tokens / t,
        "mfu_synced": flops / t / (peak_tflops * 1e12),
        "params": n_params,
        "trained_params": trained,
        **({"lora_rank": lora_rank} if lora else {}),
        "flops_per_step": flops,
        "naive_6NT_mfu": 6 * n_params * tokens / t_back / (peak_tflops * 1e12),
    }


def random_weight_model(source: str, out: Path, seed: int = 0) -> Path:
    """An fp32 HF dir at ``out`` with seeded random weights, written as the base-model stage writes a
    ``random:`` source (fedagent.model.base_model_random: streamed, one piece in memory at a time):
    ``source`` is ``random:<architecture name>`` (``--source``) or ``random:<dir>`` (``--random-weights``:
    that dir's config.json and tokenizer)."""
    from fedagent.model.base_model_random import build_random_model

    build_random_model(source, out, seed)
    return out


def _save(args, out) -> None:
    """Write what is measured so far to ``--json`` (after every column and training mode: a run cut
    short by its device call's time limit keeps what it measured; seen on the H200 2026-12-03, when
    a call ran out in the last training mode and the vLLM column was lost with the final JSON)."""
    if args.json:
        tmp = args.json.with_name(args.json.name + ".part")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)


def generation(args, out) -> None:
    """The three generation columns (HF eager, the local GPU path, vLLM) into ``out``."""
    import tempfile

    import torch

    from fedagent.model.policy import load_policy

    _reset_peak()
    model, tok = load_policy(args.model, 1, verify=False, device="cuda")
    model = model.to(torch.bfloat16)
    prompts = _prompts(model.config.vocab_size)
    gen_tokens = B * NEW
    with tempfile.TemporaryDirectory() as tmp:
        if args.vllm_pythonpath:
            # First: the column the others are judged against (a local mode that fails or runs the
            # call out of time leaves it measured). vLLM loads the fp32 safetensors in bf16 itself.
            # vLLM caches prompt prefixes across calls (on by default): timed on the same prompts
            # call after call, its prefill is a cache hit (seen on the H200 2026-12-04: a 42 ms
            # "prefill" of 32768 tokens at 1.7B, 2.5 PFLOP/s). The column is timed on fresh prompts
            # every call, as the local path (no prefix cache) is; the cached figure is kept beside it.
            fresh = [_prompts(model.config.vocab_size, seed=1000 + i) for i in range(2 * args.reps)]
            v = bench_vllm(args.model, prompts, args.reps, args.vllm_pythonpath, tmp, fresh)
            out["vllm_tok_s"] = gen_tokens / v["median_s"]
            out["vllm_engine_start_s"] = v["engine_start_s"]
            out["vllm_split"] = {
                "prefill_s": v["prefill_s"],
                "decode_step_ms": (v["median_s"] - v["prefill_s"]) / max(NEW - 1, 1) * 1e3,
            }
            out["vllm_prefix_cached_tok_s"] = gen_tokens / v["cached_median_s"]
            out["vllm_prefix_cached_split"] = {
                "prefill_s": v["cached_prefill_s"],
                "decode_step_ms": (v["cached_median_s"] - v["cached_prefill_s"]) / max(NEW - 1, 1) * 1e3,
            }
            _save(args, out)
            print(
                "VLLM "
                + json.dumps(
                    {
                        k: out[k]
                        for k in (
                            "vllm_tok_s",
                            "vllm_engine_start_s",
                            "vllm_split",
                            "vllm_prefix_cached_tok_s",
                            "vllm_prefix_cached_split",
                        )
                    }
                ),
                flush=True,
            )
    t_hf = bench_hf(model, prompts, args.reps)
    out["hf_eager_tok_s"] = gen_tokens / t_hf
    out["hf_eager_peak"] = _peak()
    # fused modes last: fusing changes the model in place for every later mode
    for mode in sorted(args.local_modes, key=lambda m: parse_local_mode(m)[2]):
        torch.cuda.empty_cache()
        _reset_peak()
        try:
            t_local, first, split = bench_local(model, tok, prompts, args.reps, mode, args.profile, args.profile_dir)
        except Exception as e:  # a mode that fails is a row, not the end of the run
            out[f"local_{mode}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"LOCAL {mode}: {out[f'local_{mode}_error']}", flush=True)
            _save(args, out)
            continue
        out[f"local_{mode}_split"] = split
        out[f"local_{mode}_peak"] = _peak()  # the bf16 weights + its static KV cache and graphs
        # "local_tok_s" is the first listed mode's row; every mode has its own key.
        out[f"local_{mode}_tok_s"] = gen_tokens / t_local
        out[f"local_{mode}_first_call_s"] = first
        if "vllm_tok_s" in out:
            out[f"local_{mode}_over_vllm"] = out[f"local_{mode}_tok_s"] / out["vllm_tok_s"]
        print(
            f"LOCAL {mode}: "
            + json.dumps({k[len(f"local_{mode}_") :]: v for k, v in out.items() if k.startswith(f"local_{mode}_")}),
            flush=True,
        )
        _save(args, out)
    ok = [m for m in args.local_modes if f"local_{m}_tok_s" in out]
    if ok:
        out["local_mode"] = ok[0]
        out["local_tok_s"] = out[f"local_{ok[0]}_tok_s"]
        if "vllm_tok_s" in out:
            out["local_over_vllm"] = out["local_tok_s"] / out["vllm_tok_s"]
    print(json.dumps(out), flush=True)
    del model
    torch.cuda.empty_cache()
    if "local_tok_s" in out:
        out["local_over_hf_eager"] = out["local_tok_s"] / out["hf_eager_tok_s"]
    _save(args, out)


def main(argv=None) -> int:
    global B, PROMPT, NEW  # --batch / --prompt / --new set the module's shapes
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model dir (fp32 safetensors)")
    ap.add_argument(
        "--source",
        default=None,
        metavar="random:NAME",
        help="instead of --model: write a random-weight model of this named architecture first "
        "(e.g. random:smollm2-1.7b, random:qwen2.5-1.5b; fedagent/core/architectures.py)",
    )
    ap.add_argument("--batch", type=int, default=B, help="generation rows and training rows (B)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="generation prompt tokens")
    ap.add_argument("--new", type=int, default=NEW, help="generated tokens per row")
    ap.add_argument("--train-seq", type=int, default=512, help="training tokens per row")
    ap.add_argument(
        "--train-micro",
        type=int,
        nargs="+",
        default=None,
        help="training rows per forward/backward (gradients accumulated over the batch; default: all); several: each train mode at each (an OOM is reported as that row's error)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vllm-pythonpath", default=None, help="site dir holding vLLM (column skipped if unset)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--train-modes",
        nargs="*",
        default=["eager_leftpad", "eager", "compiled"],
        choices=[
            "eager_leftpad",
            "eager",
            "eager_bf16res",
            "compiled",
            "compiled_bf16res",
            "compiled_tunepw",
            "eager_ckpt",
            "compiled_ckpt",
            "eager_lora",
            "eager_ckpt_lora",
        ],
        help="training step variants to time (see bench_train; none given: generation only)",
    )
    ap.add_argument(
        "--lora-rank", type=int, default=16, help="the adapters' rank in the *_lora training modes (α = 2r)"
    )
    ap.add_argument("--skip-generation", action="store_true", help="time the training step only")
    ap.add_argument(
        "--local-modes",
        nargs="+",
        default=["compile", "graph"],
        choices=LOCAL_MODES,
        metavar="MODE",
        help="StaticSampler modes to time: compile, graph or compile_graph, then optionally _prefill "
        "(the prefill compiled too), _fused (merged projections), _mea (no cuDNN attention); "
        "the first that runs is reported as local_tok_s",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after timing each training mode and local sampler mode, print its top CUDA kernels "
        "(torch.profiler; a sampler mode: one full call and one prefill-only call)",
    )
    ap.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="with --profile: write each mode's per-kernel table (CSV: kernel, grid, calls and µs per step) here",
    )
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="--model holds only config.json and the tokenizer files: time a model of that "
        "config with seeded random weights (the same shapes and kernels; throughput does not "
        "depend on the values), e.g. on a bare GPU node without the converted base model",
    )
    args = ap.parse_args(argv)
    B, PROMPT, NEW = args.batch, args.prompt, args.new
    if (args.model is None) == (args.source is None):
        ap.error("give exactly one of --model and --source")

    import tempfile

    import torch

    if args.source is not None:
        keep = tempfile.TemporaryDirectory(prefix="fa-random-model-")
        t0 = time.time()
        args.model = random_weight_model(args.source, Path(keep.name) / "model")
        print(f"wrote {args.source} to {args.model} in {time.time() - t0:.1f} s", flush=True)
    elif args.random_weights:
        keep = tempfile.TemporaryDirectory(prefix="fa-random-model-")
        args.model = random_weight_model(f"random:{args.model}", Path(keep.name) / "model")

    assert torch.cuda.is_available(), "this bench needs a GPU"
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "batch": B,
        "prompt": PROMPT,
        "new_tokens": NEW,
        **({"source": args.source, "weights": "random"} if args.source else {}),
    }
    if not args.skip_generation:
        generation(args, out)
    out["train"] = {}
    micros = args.train_micro or [None]
    for m in args.train_modes:
        for micro in micros:
            key = m if len(micros) == 1 else f"{m}_micro{micro}"
            try:
                out["train"][key] = bench_train(
                    args.model,
                    args.reps,
                    args.peak_tflops,
                    m,
                    seq=args.train_seq,
                    profile=args.profile,
                    profile_dir=args.profile_dir,
                    micro=micro,
                    lora_rank=args.lora_rank,
                )
            except torch.OutOfMemoryError as e:  # a variant that does not fit is a row, not the end of the run
                out["train"][key] = {"mode": m, "micro_batch_rows": micro, "error": f"OOM: {str(e)[:200]}"}
            except Exception as e:  # so is one that fails (seen: compiled at micro 32 of 64, 2026-12-04)
                out["train"][key] = {
                    "mode": m,
                    "micro_batch_rows": micro,
                    "error": f"{type(e).__name__}: {str(e)[:300]}",
                }
            print(f"TRAIN {key}: " + json.dumps(out["train"][key]), flush=True)
            _save(args, out)
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    if not args.skip_generation:
        print(f"\ngeneration B{B} prompt {PROMPT} new {NEW} on {out['device']}")
        print(f"  hf_eager {out['hf_eager_tok_s']:10.0f} tok/s")
        for mode in args.local_modes:
            if f"local_{mode}_error" in out:
                print(f"  local {mode}: {out[f'local_{mode}_error']}")
                continue
            tps = out[f"local_{mode}_tok_s"]
            print(
                f"  local {mode:7s} {tps:8.0f} tok/s  ({tps / out['hf_eager_tok_s']:.2f}x hf_eager"
                + (f", {tps / out['vllm_tok_s']:.2f}x vllm" if "vllm_tok_s" in out else "")
                + f"; first call {out[f'local_{mode}_first_call_s']:.1f} s)"
            )
        if "vllm_tok_s" in out:
            print(
                f"  vllm     {out['vllm_tok_s']:10.0f} tok/s  (fresh prompts every call; engine start "
                f"{out['vllm_engine_start_s']:.0f} s)"
            )
            print(
                f"  vllm     {out['vllm_prefix_cached_tok_s']:10.0f} tok/s  (the same prompts every call: "
                f"prefill from its prefix cache)"
            )
        for key in [f"local_{m}_split" for m in args.local_modes if f"local_{m}_split" in out] + (
            ["vllm_split", "vllm_prefix_cached_split"] if "vllm_split" in out else []
        ):
            sp = out[key]
            print(
                f"  {key[:-6]:14s} prefill {sp['prefill_s'] * 1e3:7.1f} ms, decode {sp['decode_step_ms']:6.2f} ms/step"
            )
    for tr in out["train"].values():
        if "error" in tr:
            print(f"training {tr['mode']} micro {tr['micro_batch_rows']}: {tr['error']}")
            continue
        print(
            f"training B{B}x{tr['seq']} (micro {tr['micro_batch_rows']}) {tr['mode']:13s}: {tr['tokens_per_s']:.0f} tok/s, "
            f"{tr['tflops']:.1f} TFLOP/s, "
            f"MFU {tr['mfu']:.3f} of {args.peak_tflops:.0f} over {tr['back_to_back_steps']} steps back to back "
            f"(synced after every step: {tr['tokens_per_s_synced']:.0f} tok/s, MFU {tr['mfu_synced']:.3f}; "
            f"first step {tr['first_step_s']:.1f} s; naive 6NT {tr['naive_6NT_mfu']:.3f}; HFU {tr['hfu']:.3f}); "
            f"peak GPU memory {tr['peak_reserved_mib']} MiB reserved, {tr['peak_allocated_mib']} allocated"
        )
    if not args.skip_generation:
        for key in ["hf_eager_peak"] + [f"local_{m}_peak" for m in args.local_modes if f"local_{m}_peak" in out]:
            print(f"  generation {key[:-5]}: peak GPU memory {out[key]['peak_reserved_mib']} MiB reserved")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
