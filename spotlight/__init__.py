"""Spotlight: Flow-GRPO post-training with seed exploration on spot GPUs."""

import os

# CUDA's caching allocator with expandable segments: on an H200, SD3.5-Medium's iteration reserved 1.31x the
# memory it allocated without them and 1.08x with them (bench/real_scale.py, docs/memory.md), which is what the
# memory plan's FRAGMENTATION assumes. Set before torch touches CUDA; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
