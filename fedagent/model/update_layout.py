"""The names a client update goes by — its formats, files and metrics records — in one place.

The trainer's epilogue (:func:`fedagent.train.epilogue.write_model_update`) writes an update by these
names and the server step (:mod:`fedagent.server.update_format`: aggregate, verify) reads it by them; the
two are sibling packages that cannot import each other, so both import this module.

An update dir holds its policy part in one format (a round's updates share it):

- :data:`FULL`: the whole model's fp32 HF dir at the top (:mod:`fedagent.model.hf_dir`'s files);
- :data:`LORA`: only LoRA adapters' factors at the top, PEFT's layout (:mod:`fedagent.model.lora`):
  :data:`ADAPTER_CONFIG` and :data:`ADAPTER_WEIGHTS`;

and, from a PPO job, the trained critic's HF dir in :data:`CRITIC_DIR` (format :data:`CRITIC`;
:mod:`fedagent.model.critic_dir`). Beside them: :data:`METRICS_JSON` (which names a format other than
full under :data:`FORMAT_RECORD`, as aggregate.json does; a LoRA writer's record under :data:`LORA`; the
critic's file digests under :data:`CRITIC_RECORD`; the bytes of the update's files, what a client sends,
under :data:`UPLOAD_BYTES`) and :data:`SAMPLES_JSONL`. Names only: no imports.
"""

# The formats (fedagent.server.update_format has one class per name).
FULL = "full"
LORA = "lora"
CRITIC = "critic"

# Files and folders of an update dir.
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's LoraConfig.save_pretrained
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the factors A and B of every adapted module
CRITIC_DIR = "critic"
METRICS_JSON = "metrics.json"
SAMPLES_JSONL = "samples.jsonl"

# Keys of its metrics.json.
FORMAT_RECORD = "update_format"  # absent: full
# {path relative to critic/: sha256} of the update's own critic (fedagent verify compares it).
CRITIC_RECORD = "critic_sha256"
UPLOAD_BYTES = "upload_bytes"
