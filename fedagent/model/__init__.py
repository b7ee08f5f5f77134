"""Model directories: the base model, HF safetensors dirs, the critic, policy loading and the GPU sampler."""
