"""What a client update holds, and how the server step reads it: one :class:`UpdateFormat` per kind.

- :data:`FULL_MODEL`: the whole model's float tensors (today's fp32 safetensors, an HF dir), each
  tensor aggregated as client − prev and stepped by the server optimizer;
- :data:`CRITIC`: a PPO critic, a full model of its own in ``critic/`` (fedagent.model.critic_dir)
  beside the actor's, aggregated with the same weights and stepped with its own server state;
- :class:`AdapterFormat`: low-rank adapters (LoRA A/B factors, PEFT's ``adapter_config.json`` +
  ``adapter_model.safetensors``): the interface only, a later feature. An adapter update is
  recognised by its files and refused by name, never read as a full model.

``fedagent aggregate``'s structure check (:func:`format_of`, then the format's
:meth:`~UpdateFormat.check_structure`), ``fedagent merge`` and ``fedagent verify`` (the nested
:data:`CRITIC` part) go through these objects instead of assuming a full model.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Sequence

from fedagent.model.critic_dir import CRITIC_DIR, critic_of, critic_pairs, has_critic
from fedagent.model.hf_dir import FLOAT_CODES, TensorInfo, tensor_index


class StructureError(RuntimeError):
    """Updates and prev disagree, or an update is of a format the server step cannot read."""


class UpdateFormat:
    """Base: ``name``; ``subdir`` (where the part sits in an update, ``""`` at its top);
    :meth:`present` (does this dir hold it) and :meth:`check_structure` (the tensors to aggregate)."""

    name: ClassVar[str] = ""
    subdir: ClassVar[str] = ""

    def present(self, d: Path) -> bool:
        raise NotImplementedError

    def check_structure(
        self, prev_dir: Path, client_dirs: Sequence[Path]
    ) -> tuple[dict[str, TensorInfo], list[dict[str, TensorInfo]]]:
        """Tensor index of prev and of each client (every name, shape and dtype agreeing)."""
        raise NotImplementedError


class FullModel(UpdateFormat):
    """Every float tensor of the model, as ``fedagent.model.hf_dir.tensor_index`` reads it."""

    name = "full"

    def present(self, d: Path) -> bool:
        return any(Path(d).glob("*.safetensors")) or (Path(d) / "model.safetensors.index.json").is_file()

    def check_structure(self, prev_dir, client_dirs):
        """Refuses any name/shape/dtype disagreement, naming the client dir and tensor."""
        prev = tensor_index(prev_dir)
        for name, info in prev.items():
            if info.dtype not in FLOAT_CODES:
                raise StructureError(f"prev {prev_dir}: tensor {name!r} has non-float dtype {info.dtype}")
        clients = []
        for d in client_dirs:
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


class CriticFormat(FullModel):
    """A PPO critic: a full model in ``critic/`` of prev, each update, the aggregate and the merged model."""

    name = "critic"
    subdir = CRITIC_DIR

    def present(self, d: Path) -> bool:
        return has_critic(d)

    def of(self, d: Path) -> Path:
        """``d/critic``."""
        return critic_of(d)

    def pairs(self, prev_dir: Path, client_dirs: Sequence[Path]) -> tuple[Path, list[Path]] | None:
        """``(prev/critic, [client/critic...])`` when prev has a critic, None when nobody has one
        (a layout error when only some have one: fedagent.model.critic_dir.critic_pairs)."""
        return critic_pairs(prev_dir, client_dirs)


class AdapterFormat(UpdateFormat):
    """Low-rank adapters: per adapted weight W, factors A (r × in) and B (out × r), W' = W + (α/r)·B·A.

    The interface a later implementation fills: :meth:`factors` (the A/B pairs by target weight,
    from ``adapter_model.safetensors``) and :meth:`check_structure` (prev's adapter against each
    update's: same targets, ranks and shapes). Averaging A and B separately is not averaging the
    products B·A, so its aggregator and its merge into the global model are that feature's choice;
    until then an adapter update is refused here, by name.
    """

    name = "adapter"
    CONFIG = "adapter_config.json"

    def present(self, d: Path) -> bool:
        return (Path(d) / self.CONFIG).is_file()

    def factors(self, d: Path) -> dict[str, tuple[TensorInfo, TensorInfo]]:
        """target weight name → (A, B) of the adapter in ``d``."""
        raise NotImplementedError("adapter updates: interface only")

    def check_structure(self, prev_dir, client_dirs):
        d = next(d for d in client_dirs if self.present(d))
        raise StructureError(
            f"client {d}: an adapter update ({self.CONFIG}); the server step reads full-model updates only"
        )


FULL_MODEL, CRITIC, ADAPTER = FullModel(), CriticFormat(), AdapterFormat()


def format_of(client_dirs: Sequence[Path]) -> UpdateFormat:
    """The format of a round's updates, from their files: an adapter's config, else a full model."""
    return ADAPTER if any(ADAPTER.present(d) for d in client_dirs) else FULL_MODEL
