"""Tiny random-weight CLIP folders for tests: built locally, loaded by ``from_pretrained``, never downloaded.

Why: the learned rewards (PickScore, CLIP score, the LAION aesthetic head) load real transformers
folders; tests exercise that same loading path on a model of a few hundred kB. The tokenizer is a
genuine byte-level BPE CLIP tokenizer (a ``vocab.json`` and a ``merges.txt`` with ``#version: 0.2``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from spotlight.clip_rewards import AestheticHead

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# A few merges so prompts tokenize into real BPE units, not only characters.
_MERGES = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("i", "n"), ("o", "n</w>"), ("c", "a"), ("ca", "t</w>")]


def _write_tokenizer_files(out: Path) -> tuple[Path, Path]:
    """CLIP's vocabulary layout: the 256 byte symbols, the same with ``</w>``, the merges, then BOS/EOS last."""
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, *(s + "</w>" for s in symbols), *(a + b for a, b in _MERGES), BOS, EOS]
    vocab, merges = out / "vocab.json", out / "merges.txt"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _MERGES))
    return vocab, merges


def build_tiny_clip(out_dir: str | Path, image_size: int = 32, seed: int = 0) -> Path:
    """A random CLIPModel (2 layers per tower, projection 16) + tokenizer + CLIP image processor in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = _write_tokenizer_files(out)
    tokenizer = CLIPTokenizer(str(vocab), str(merges), model_max_length=77)
    tower = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(**tower, vocab_size=len(tokenizer), max_position_embeddings=77,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(**tower, image_size=image_size, patch_size=8),
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    model.save_pretrained(out)
    # Saved apart, as in the public CLIP folders: preprocessor_config.json + the tokenizer's files.
    tokenizer.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}).save_pretrained(out)
    return out


def build_tiny_aesthetic_head(path: str | Path, dim: int, seed: int = 0) -> Path:
    """A random head in the LAION aesthetic predictor v2 layout (``layers.N.weight/bias``); .pth or .safetensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = AestheticHead(dim).state_dict()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path
