"""The attention implementation of a verl PPO job's critic: the one its model config asks for.

verl 0.9.1's FSDP engine loads the critic (``model_type == "value_model"``) through
``verl.utils.model.load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code)``
(imported inside ``FSDPEngine._build_module``, so replacing the module attribute is enough), which
passes ``attn_implementation="flash_attention_2"`` to ``from_pretrained`` regardless of the config —
overriding ``+critic.model.override_config.attn_implementation`` (``overrides.ppo_overrides``). Without
flash-attn the critic does not load (seen on the GPU: "FlashAttention2 has been toggled
on", then verl's "is not a value head model, please install trl").

:func:`load_valuehead_model` is verl's first (token-classification) load with the attention taken from
``model_config._attn_implementation`` (verl set it from ``override_config``; ``"sdpa"`` when it is
``None``; ``"flash_attention_2"`` kept when asked for). :func:`arm` installs it in this process, now
or when ``verl.utils.model`` is imported (:mod:`fedagent.train.verl.post_import`), and prints
:func:`armed_line`. :mod:`fedagent.train.verl.ray_hook` arms it in a PPO job's Ray workers (those
that carry ``critic_loss.CRITIC_LOSS_ENV``).
"""

from __future__ import annotations

TARGET_MODULE = "verl.utils.model"
TARGET_FUNCTION = "load_valuehead_model"
DEFAULT_ATTN = "sdpa"
_MARK = "_fedagent_critic_attn"


def armed_line(impl: str = "config") -> str:
    """The line :func:`arm` prints (``impl``: what the loader will use; ``config`` = per the model config)."""
    return f"fedagent: critic attention {impl} armed in {TARGET_MODULE}.{TARGET_FUNCTION}"


def attn_implementation(model_config) -> str:
    """The model config's ``_attn_implementation``, or :data:`DEFAULT_ATTN` when it has none."""
    impl = getattr(model_config, "_attn_implementation", None)
    return impl if impl else DEFAULT_ATTN


def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl 0.9.1's ``load_valuehead_model`` call with ``attn_implementation`` from ``model_config``.

    The token-classification load verl tries first (its engine set ``num_labels=1`` in the config).
    A fedagent critic dir is always such a model (:mod:`fedagent.model.critic_dir`), so verl's second
    route (trl's value-head wrapper over a causal LM) is not taken: a failed load is an error naming
    the dir, never a silent switch to another model class."""
    from transformers import AutoModelForTokenClassification

    try:
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=attn_implementation(model_config),
            trust_remote_code=trust_remote_code,
            use_safetensors=True,  # a fedagent critic dir is safetensors (never a pickle)
        )
    except Exception as e:
        raise RuntimeError(
            f"{local_path}: the critic did not load as a token-classification model "
            f"(attention {attn_implementation(model_config)}): {e}"
        ) from e


setattr(load_valuehead_model, _MARK, True)


def _patch(module) -> None:
    current = getattr(module, TARGET_FUNCTION, None)
    if not callable(current):
        raise RuntimeError(f"{TARGET_MODULE} has no {TARGET_FUNCTION}: cannot arm the critic's attention")
    if not getattr(current, _MARK, False):
        load_valuehead_model.__wrapped__ = current
        setattr(module, TARGET_FUNCTION, load_valuehead_model)
    print(armed_line(), flush=True)


def arm() -> None:
    """Make ``verl.utils.model.load_valuehead_model`` ours in this process (now or on import)."""
    from fedagent.train.verl.post_import import patch_on_import

    patch_on_import(TARGET_MODULE, _patch, "arm the critic's attention implementation")
