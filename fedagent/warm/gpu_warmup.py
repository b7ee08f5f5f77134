"""A standby's warm-up for GPU jobs: the CUDA kernels a run's train and eval jobs launch, loaded
and chosen before any such job exists.

CUDA loads kernels lazily and cuBLAS picks (and loads) its GEMM kernels per shape at first use,
so a GPU job's first sampler call and first optimizer step pay for that on top of CUDA's own
start (measured with ``bench/cold_start_parts.py``, docs/results/cold-start.md: to the first sampled token 8.9–12 s
in a fresh process with CUDA started beforehand and 1.4–1.6 s after this warm-up). A standby
process of the warm server (:mod:`fedagent.warm.standby`) runs :func:`warm_up` once, before it
is handed a job: a model of the run's own architecture with **one** decoder layer and random
weights (each layer's GEMMs have the job's shapes; attention, norms, rotary embedding and the LM
head are the same kernels) goes through the job's own calls at the run's shapes — the train
job's static-cache sampler, behaviour log-probs and two fused-AdamW optimizer steps
(:func:`fedagent.train.actor.update_step`), and the eval job's bf16 sampler. A sampler in mode
``compile`` is not warmed: its Dynamo/inductor work is per process and would not carry over.

Nothing of it reaches a job but CUDA's state (its context, loaded kernels, cuBLAS handles and
heuristics): the warm-up's model is freed, the allocator's cache emptied, and the torch CPU and
CUDA RNG states are restored (:func:`torch.random.fork_rng`), so a job starts from the RNG state
a freshly forked process has.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping


@dataclass(frozen=True)
class Shapes:
    """What to warm: the run's model dir (its ``config.json``: the architecture) and the GPU jobs'
    shapes. ``train``/``eval``: None when that job does not run on CUDA."""

    model_dir: Path
    train: Mapping | None  # pool, width, new_tokens, micro, sampler
    eval: Mapping | None  # batch, width, new_tokens, sampler
    # The run's ``model`` (``smollm2``, ``random:<architecture>`` or an HF dir): its architecture is
    # known before round 0's model is built (None: wait for ``model_dir``).
    source: str | None = None

    def absolute(self) -> "Shapes":
        """The same with its paths absolute (a standby's job may run in another directory)."""
        from fedagent.core.architectures import ARCHITECTURES, RANDOM_PREFIX, is_random_source, random_target

        source = self.source
        if source is not None and is_random_source(source):
            target = random_target(source)  # a named architecture stays a name; a dir becomes absolute
            source = source if target in ARCHITECTURES else RANDOM_PREFIX + os.path.abspath(target)
        elif source is not None and source != "smollm2":
            source = os.path.abspath(source)
        return Shapes(Path(os.path.abspath(self.model_dir)), self.train, self.eval, source)

    def describe(self) -> dict:
        """JSON-able (``warm-server --ping``)."""
        return {
            "model_dir": str(self.model_dir),
            "train": dict(self.train) if self.train else None,
            "eval": dict(self.eval) if self.eval else None,
            "source": self.source,
        }


def shapes_from_config(config: Mapping) -> Shapes:
    """The :class:`Shapes` of a checked run config (``fedagent.report.config_show.effective_config``)."""
    tr, ev, pool = config["train"], config["eval"], int(config["env"]["pool_size"])
    train = None
    if tr.get("device") == "cuda" and tr.get("backend", "local") == "local":
        train = {
            "pool": pool,
            "width": int(tr["max_prompt_tokens"]),
            "new_tokens": int(tr["max_new_tokens"]),
            "micro": int(tr["micro_batch_size"]),
            "sampler": str(tr["sampler"]),
        }
    evs = None
    if ev.get("device") == "cuda" and ev.get("backend", "local") == "local":
        evs = {
            "batch": min(int(ev["batch"]), pool),
            "width": int(ev["max_prompt_tokens"]),
            "new_tokens": int(ev["max_new_tokens"]),
            "sampler": str(ev["sampler"]),
        }
    model_dir = Path(config["results_dir"]) / config["run"] / "round_000" / "model"
    source = config.get("model")
    return Shapes(
        model_dir=model_dir, train=train, eval=evs, source=str(source) if source not in (None, "tiny") else None
    )


@contextlib.contextmanager
def architecture_dir(shapes: Shapes, give_up) -> Iterator[Path | None]:
    """A directory with the run's ``config.json`` and tokenizer, as soon as there is one: round
    0's model if it exists; else, for ``source`` ``smollm2``, both written from the GGUF's
    metadata into a temporary directory (:func:`fedagent.model.base_model.smollm2_architecture`;
    a few seconds, where building the base model takes about a minute) or an HF dir ``source``
    itself; for ``random:<architecture>`` its config.json and tokenizer without the weights
    (:func:`fedagent.model.base_model_random.write_architecture`); else (``tiny``) round 0's model once
    it exists. None: ``give_up()`` came true first."""
    from fedagent.core.architectures import is_random_source
    from fedagent.core.atomic import MANIFEST

    if (shapes.model_dir / MANIFEST).is_file():
        yield shapes.model_dir
    elif shapes.source is not None and is_random_source(shapes.source):
        from fedagent.model.base_model_random import write_architecture

        with tempfile.TemporaryDirectory(prefix="fa-arch-") as tmp:
            write_architecture(shapes.source, Path(tmp))
            yield Path(tmp)
    elif shapes.source == "smollm2":
        from fedagent.model.base_model import smollm2_architecture

        with tempfile.TemporaryDirectory(prefix="fa-arch-") as tmp:
            smollm2_architecture(Path(tmp))
            yield Path(tmp)
    elif shapes.source is not None and (Path(shapes.source) / "config.json").is_file():
        yield Path(shapes.source)
    else:
        yield shapes.model_dir if wait_for_model(shapes, give_up) else None


def wait_for_model(shapes: Shapes, give_up, poll_s: float = 0.5) -> bool:
    """Wait until ``shapes.model_dir`` holds a model (its manifest: an atomic dir is complete);
    False as soon as ``give_up()`` is true (the standby's server is gone)."""
    from fedagent.core.atomic import MANIFEST

    while not (shapes.model_dir / MANIFEST).is_file():
        if give_up():
            return False
        time.sleep(poll_s)
    return True


def warm_up(shapes: Shapes, device: str = "cuda", arch_dir: Path | None = None) -> dict[str, float]:
    """Run the warm-up; returns seconds per part. ``arch_dir`` (default ``shapes.model_dir``) must
    hold ``config.json`` and the tokenizer (:func:`architecture_dir`). ``device`` "cpu" (tests:
    samplers in mode ``eager``) runs the same calls on the CPU."""
    import torch

    parts: dict[str, float] = {}
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    with torch.random.fork_rng(
        devices=[device.index] if device.type == "cuda" else [],
        device_type=device.type if device.type == "cuda" else "cuda",
    ):
        t = time.perf_counter()
        model, tok = _one_layer_model(shapes.model_dir if arch_dir is None else arch_dir, device)
        parts["model"] = time.perf_counter() - t
        if shapes.train is not None:
            t = time.perf_counter()
            _train_job(model, tok, shapes.train)
            parts["train"] = time.perf_counter() - t
        if shapes.eval is not None and shapes.eval["sampler"] != "compile":
            t = time.perf_counter()
            _eval_job(model, tok, shapes.eval)
            parts["eval"] = time.perf_counter() - t
        del model
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return parts


def _one_layer_model(model_dir: Path, device):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedagent.model.policy import load_tokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cfg.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    model.eval()
    return model, load_tokenizer(model_dir)


def _prompts(vocab: int, n: int, width: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, width // 2), width + 1, (n,), generator=g)
    return [torch.randint(100, max(101, vocab - 100), (int(k),), generator=g).tolist() for k in lengths]


def _train_job(model, tok, s: Mapping) -> None:
    """The train job's GPU calls: bf16 rollout copy + sampler, behaviour log-probs, 2 update steps."""
    import torch

    from fedagent.train import grpo
    from fedagent.train.local import TrainParams
    from fedagent.train.actor import autocast, logprobs_nograd, token_slices, deferred_steps, update_step

    gens = _bf16_sampler_call(model, tok, s["pool"], s, temperature=1.0, seed=1)
    samples = [
        grpo.Sample(
            prompt_ids=g.prompt_ids,
            response_ids=g.response_ids or [int(tok.pad_token_id)],
            reward=float(i % 2),
            group=i // 2,
        )
        for i, g in enumerate(gens[: s["micro"]])
    ]
    for smp, a in zip(samples, grpo.group_advantages([x.reward for x in samples], [x.group for x in samples])):
        smp.advantage = a
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    p = TrainParams(mini_batch_size=len(samples), micro_batch_size=s["micro"], kl_coef=0.01, temperature=1.0)
    with autocast(model):
        old = logprobs_nograd(model, samples, s["micro"], 1.0)
    adv = grpo.token_advantages(samples).to(old.device)
    params = [q for q in model.parameters() if q.requires_grad]
    for _ in range(2):
        update_step(
            model,
            opt,
            samples,
            list(range(len(samples))),
            old,
            old,
            adv,
            token_slices(samples),
            p,
            params,
            deferred=deferred_steps(opt),
        )


def _eval_job(model, tok, s: Mapping) -> None:
    """The eval job's GPU calls: a bf16 model and its sampler."""
    _bf16_sampler_call(model, tok, s["batch"], s, temperature=0.5, seed=2)


def _bf16_sampler_call(model, tok, batch: int, s: Mapping, *, temperature: float, seed: int):
    """A bf16 copy of ``model``, its static-cache sampler at the job's shape (warmed as the job
    warms it), one call of ``batch`` prompts; the generations (the copy and sampler are freed)."""
    import copy

    import torch

    from fedagent.model.static_sampler import StaticSampler

    m = copy.deepcopy(model).to(torch.bfloat16)
    m.requires_grad_(False)
    sampler = StaticSampler(
        m, tok, batch_size=batch, max_prompt_tokens=s["width"], max_new_tokens=s["new_tokens"], mode=s["sampler"]
    )
    if s["sampler"] != "eager":
        sampler.warmup(temperature)
    return sampler(
        m,
        tok,
        _prompts(model.config.vocab_size, batch, s["width"]),
        s["new_tokens"],
        temperature,
        torch.Generator().manual_seed(seed),
    )
