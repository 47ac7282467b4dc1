"""Spotlight: Flow-GRPO post-training with seed exploration on spot GPUs."""

import logging
import os

# CUDA's caching allocator with expandable segments: on an H200, SD3.5-Medium's iteration reserved 1.31x the
# memory it allocated without them and 1.08x with them (bench/real_scale.py, docs/memory.md), which is what the
# memory plan's FRAGMENTATION assumes. Set before torch touches CUDA; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


class _TorchvisionFallbackNotice(logging.Filter):
    """diffusers' pipelines import CLIP's and SigLIP's torchvision image processors; without torchvision (not a
    dependency) transformers falls back to their PIL twins and warns once per process, on every command and in
    every worker's log. Spotlight's rewards load the PIL processors themselves, so the notice says nothing here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallbackNotice())
