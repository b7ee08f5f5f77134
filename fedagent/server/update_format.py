"""What a client update holds, and how the server step reads it: one :class:`UpdateFormat` per kind.

- :data:`FULL_MODEL`: the whole model's float tensors (fp32 safetensors, an HF dir), each tensor's
  client delta c_i − prev;
- :data:`CRITIC`: a PPO critic, a full model of its own in ``critic/`` (fedagent.model.critic_dir)
  beside the actor's, aggregated with the same weights and stepped with its own server state;
- :data:`LORA`: LoRA adapters (``train.lora``; the files and their reading are
  :mod:`fedagent.model.lora`'s): each adapted weight's client delta is ΔW_i = (α/r)·B_i·A_i, computed
  from the factors in float64, and every other tensor's is 0 (frozen). So the aggregate is the
  weighted mean of the products — never the product of averaged factors, since mean(B)·mean(A) ≠
  mean(B·A) — dense, of the global model's shape, and the server optimizer steps the dense global
  model exactly as with full updates: every server rule keeps its meaning.

A format answers the questions the server step asks of a round's updates: their structure against
prev (:meth:`~UpdateFormat.check_structure`), each client's fp32 delta over a chunk of one tensor
(:meth:`~UpdateFormat.chunk_deltas`: ``fedagent aggregate`` streams these into the aggregator), which
input holds a NaN/Inf (:meth:`~UpdateFormat.nonfinite`), and each client's float64 delta of a whole
tensor (:meth:`~UpdateFormat.exact_deltas`: ``fedagent verify``'s recomputation). ``fedagent merge``
reads only prev and the dense aggregate, whatever the format. :func:`format_of` picks a round's format
from its updates' files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator, Sequence

import torch

from fedagent.model import lora
from fedagent.model import update_layout as layout
from fedagent.model.critic_dir import critic_of, critic_pairs, has_critic
from fedagent.model.hf_dir import FLOAT_CODES, INDEX_FILE, TensorInfo, TensorReader, tensor_index

METRICS = layout.METRICS_JSON


class StructureError(RuntimeError):
    """Updates and prev disagree, or an update is of a format the server step cannot read."""


class NonFiniteInput(ValueError):
    """A client's input holds NaN/Inf (the message names the client and the tensor)."""


class UpdateFormat:
    """Base: ``name``; ``subdir`` (where the part sits in an update, ``""`` at its top); :meth:`present`
    (does this dir hold it), :meth:`check_structure` and the deltas (see the module docstring)."""

    name: ClassVar[str] = ""
    subdir: ClassVar[str] = ""

    def present(self, d: Path) -> bool:
        raise NotImplementedError

    def check_structure(self, prev_dir: Path, client_dirs: Sequence[Path]) -> tuple[dict[str, TensorInfo], list]:
        """Tensor index of prev and what each client's deltas are read from (every name, shape and dtype
        agreeing with prev)."""
        raise NotImplementedError

    def chunk_deltas(
        self, reader: TensorReader, scratch, name: str, prev: TensorInfo, p: torch.Tensor, clients, begin: int, end: int
    ) -> Iterator[torch.Tensor]:
        """Each client's fp32 delta of tensor ``name`` over flat elements ``[begin, end)``, in client order
        (``p``: prev's fp32 values there; ``scratch``: the aggregate's reused buffers, fedagent.server.aggregate.
        ChunkScratch; each yielded tensor is a reused buffer, valid until the next one is drawn)."""
        raise NotImplementedError

    def nonfinite(
        self, reader: TensorReader, name: str, clients, client_dirs: Sequence[Path], begin: int, end: int
    ) -> str | None:
        """Which client's input to tensor ``name``'s chunk holds NaN/Inf (the message), else None."""
        raise NotImplementedError

    def exact_deltas(
        self, reader: TensorReader, name: str, p: torch.Tensor, clients, client_dirs: Sequence[Path]
    ) -> Iterator[torch.Tensor]:
        """Each client's float64 delta of the whole tensor ``name`` (``p``: prev's, float64);
        :class:`NonFiniteInput` on a NaN/Inf input."""
        raise NotImplementedError


def _check_prev(prev_dir: Path) -> dict[str, TensorInfo]:
    prev = tensor_index(prev_dir)
    for name, info in prev.items():
        if info.dtype not in FLOAT_CODES:
            raise StructureError(f"prev {prev_dir}: tensor {name!r} has non-float dtype {info.dtype}")
    return prev


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


class FullModel(UpdateFormat):
    """Every float tensor of the model, as ``fedagent.model.hf_dir.tensor_index`` reads it."""

    name = layout.FULL

    def present(self, d: Path) -> bool:
        return any(Path(d).glob("*.safetensors")) or (Path(d) / INDEX_FILE).is_file()

    def check_structure(self, prev_dir, client_dirs):
        """Refuses any name/shape/dtype disagreement, naming the client dir and tensor."""
        prev = _check_prev(prev_dir)
        clients = []
        for d in client_dirs:
            if lora.is_adapter(d):
                raise StructureError(f"client {d}: a LoRA update ({layout.ADAPTER_CONFIG}) among full-model updates")
            idx = tensor_index(d)
            missing, extra = sorted(set(prev) - set(idx)), sorted(set(idx) - set(prev))
            if missing or extra:
                raise StructureError(
                    f"client {d}: tensor names disagree with prev {prev_dir}: "
                    f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                    f"extra {extra[:5]}{'...' if len(extra) > 5 else ''}"
                )
            for name, info in idx.items():
                p = prev[name]
                if info.shape != p.shape:
                    raise StructureError(
                        f"client {d}: tensor {name!r} shape {list(info.shape)} != prev {list(p.shape)}"
                    )
                if info.dtype != p.dtype:
                    raise StructureError(f"client {d}: tensor {name!r} dtype {info.dtype} != prev {p.dtype}")
            clients.append(idx)
        return prev, clients

    def chunk_deltas(self, reader, scratch, name, prev, p, clients, begin, end):
        for c in clients:
            # c − p first: close values subtract exactly, so the delta keeps its precision
            yield scratch.read_f32(reader, c[name], begin, end, 1).sub_(p)

    def nonfinite(self, reader, name, clients, client_dirs, begin, end):
        for c, d in zip(clients, client_dirs):
            if not _finite(reader.read_range(c[name], begin, end)):
                return f"client {d}: tensor {name!r} contains NaN/Inf"
        return None

    def exact_deltas(self, reader, name, p, clients, client_dirs):
        for c, d in zip(clients, client_dirs):
            ct = reader.read(c[name]).to(torch.float64)
            if not _finite(ct):
                raise NonFiniteInput(f"client {d}: tensor {name!r} contains NaN/Inf")
            yield ct - p


class CriticFormat(FullModel):
    """A PPO critic: a full model in ``critic/`` of prev, each update, the aggregate and the merged model."""

    name = layout.CRITIC
    subdir = layout.CRITIC_DIR

    def present(self, d: Path) -> bool:
        return has_critic(d)

    def of(self, d: Path) -> Path:
        """``d/critic``."""
        return critic_of(d)

    def pairs(self, prev_dir: Path, client_dirs: Sequence[Path]) -> tuple[Path, list[Path]] | None:
        """``(prev/critic, [client/critic...])`` when prev has a critic, None when nobody has one
        (a layout error when only some have one: fedagent.model.critic_dir.critic_pairs)."""
        return critic_pairs(prev_dir, client_dirs)


@dataclass
class AdapterClient:
    """One LoRA update as the aggregate streams it: its factors' index and its A matrices read so far
    (float64, r × in: small; only the current tensor's are kept)."""

    index: lora.AdapterIndex
    a_cache: dict = field(default_factory=dict)

    def a64(self, reader: TensorReader, name: str) -> torch.Tensor:
        """A of the adapted weight ``name``, float64."""
        if name not in self.a_cache:
            self.a_cache.clear()
            a_info = self.index.factors[name][0]
            self.a_cache[name] = reader.read(a_info).to(torch.float64)
        return self.a_cache[name]


def delta_rows(b_rows: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    """ΔW's rows ``(α/r)·B[rows]·A`` in float64 (``b_rows``: those rows of B; ``a``: A, both float64)."""
    return (b_rows @ a).mul_(scale)


class LoraFormat(UpdateFormat):
    """LoRA adapters (:mod:`fedagent.model.lora`): the client delta of an adapted weight W (out × in) is
    ΔW_i = (α_i/r_i)·B_i·A_i, of every other tensor 0. Products in float64 (one fp32 rounding when
    handed to the aggregator, as a full update's c − p), streamed by rows: a chunk of W's flat elements
    needs only the rows of B it spans and A."""

    name = layout.LORA

    def present(self, d: Path) -> bool:
        return lora.is_adapter(d)

    def check_structure(self, prev_dir, client_dirs):
        """Every update a LoRA adapter of plain LoRA (:func:`fedagent.model.lora.read_adapter`) whose adapted
        weights are 2-D float tensors of prev with B's rows and A's columns, trained on prev itself (its
        metrics.json's ``start_model_manifest_sha256`` is prev's manifest's); each refusal names the client."""
        prev = _check_prev(prev_dir)
        want = lora.manifest_digest(prev_dir) if (Path(prev_dir) / "manifest.json").is_file() else None
        clients = []
        for d in client_dirs:
            if not lora.is_adapter(d):
                raise StructureError(
                    f"client {d}: a full-model update among LoRA updates ({layout.ADAPTER_CONFIG}): a round's updates "
                    "share one format"
                )
            try:
                idx = lora.read_adapter(d)
            except lora.AdapterError as exc:
                raise StructureError(f"client {d}: {exc}") from None
            for name, (a, b) in idx.factors.items():
                w = prev.get(name)
                if w is None:
                    raise StructureError(f"client {d}: adapts {name!r}, which prev {prev_dir} does not have")
                if len(w.shape) != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape):
                    raise StructureError(
                        f"client {d}: factors of {name!r} (B {list(b.shape)}, A {list(a.shape)}) do not make "
                        f"prev's shape {list(w.shape)}"
                    )
            if want is not None:
                got = self.start_model(d)
                if got != want:
                    raise StructureError(
                        f"client {d}: its adapters were trained on the model whose manifest has sha256 {got}, "
                        f"not on prev {prev_dir} ({want}): factors apply only to the model they were trained on"
                    )
            clients.append(AdapterClient(idx))
        return prev, clients

    @staticmethod
    def start_model(d: Path) -> str | None:
        """The start model's manifest digest an update's metrics.json records (None: none recorded)."""
        try:
            rec = json.loads((Path(d) / METRICS).read_text()).get(layout.LORA) or {}
        except (OSError, ValueError, AttributeError) as exc:
            raise StructureError(f"client {d}: cannot read {METRICS} ({exc})") from None
        return rec.get(lora.START_MODEL_RECORD) if isinstance(rec, dict) else None

    def chunk_deltas(self, reader, scratch, name, prev, p, clients, begin, end):
        out = scratch.f32[1][: end - begin]
        for c in clients:
            pair = c.index.factors.get(name)
            if pair is None:  # not adapted: frozen, ΔW = 0
                yield out.zero_()
                continue
            cols, r = prev.shape[1], c.index.rank
            r0, r1 = begin // cols, -(-end // cols)
            b_rows = reader.read_range(pair[1], r0 * r, r1 * r).to(torch.float64).view(r1 - r0, r)
            rows = delta_rows(b_rows, c.a64(reader, name), c.index.scale).view(-1)
            yield out.copy_(rows[begin - r0 * cols : end - r0 * cols])

    def nonfinite(self, reader, name, clients, client_dirs, begin, end):
        for c, d in zip(clients, client_dirs):
            for info in c.index.factors.get(name, ()):
                if not _finite(reader.read(info)):
                    return f"client {d}: LoRA factor {info.name!r} of tensor {name!r} contains NaN/Inf"
        return None

    def exact_deltas(self, reader, name, p, clients, client_dirs):
        for c, d in zip(clients, client_dirs):
            pair = c.index.factors.get(name)
            if pair is None:
                yield torch.zeros_like(p)
                continue
            a, b = (reader.read(info).to(torch.float64) for info in pair)
            if not (_finite(a) and _finite(b)):
                raise NonFiniteInput(f"client {d}: LoRA factors of tensor {name!r} contain NaN/Inf")
            yield delta_rows(b, a, c.index.scale)


FULL_MODEL, CRITIC, LORA = FullModel(), CriticFormat(), LoraFormat()
FORMATS = {f.name: f for f in (FULL_MODEL, LORA)}


def format_of(client_dirs: Sequence[Path]) -> UpdateFormat:
    """The format of a round's updates, from their files: LoRA when any holds an adapter config (its
    structure check then refuses a full update among them), else a full model."""
    return LORA if any(LORA.present(d) for d in client_dirs) else FULL_MODEL
