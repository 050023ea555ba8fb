"""PrismLLM training core: typed configs, model, data, optimizer, pure train step, checkpoints."""
from framework import platforms as _platforms

_platforms.cpu_unless_accelerator()
