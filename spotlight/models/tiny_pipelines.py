"""Tiny random-weight diffusers pipelines (SD3.5-style, FLUX.1, Qwen-Image), built offline.

Tests, benches and CPU users exercise the real-model path with these: every part comes from the
real diffusers/transformers classes at toy size (as diffusers' own ``get_dummy_components``), the
tokenizers are built here (no hub id, nothing downloaded), and ``save_pretrained`` writes a folder
that ``<Pipeline>.from_pretrained(folder)`` loads exactly as it loads real weights.

Functions (no CLI):

- ``build_tiny_pipeline(kind, out_dir, seed=0, resolution=32, guidance_embeds=True, heads=None) -> Path``:
  ``kind`` is ``sd3`` | ``flux`` | ``qwen-image``; ``guidance_embeds`` only matters for FLUX
  (True: FLUX.1-dev's distilled guidance embedding; False: FLUX.1-schnell-like, true CFG);
  ``heads`` sets the FLUX / Qwen-Image transformer's attention heads (default 2 / 3): Ulysses
  sequence parallelism needs a head count its degree divides.

The tiny CLIP of the reward tests is :mod:`spotlight.models.tiny_clip`.

Facts learned building them (transformers 5.17, tokenizers 0.23, diffusers 0.39):

- transformers 5 merged slow and fast tokenizers: ``T5TokenizerFast`` is ``T5Tokenizer`` (a Unigram
  built from ``vocab=[(piece, score), ...]``), ``CLIPTokenizer`` takes a ``vocab.json`` +
  ``merges.txt``. ``Qwen2Tokenizer`` rebuilds its BPE from vocab/merges on load and drops
  ``ignore_merges``, so the Qwen tokenizer is saved as a generic ``PreTrainedTokenizerFast``
  (``tokenizer.json`` round-trips whole).
- QwenImagePipeline drops the first ``prompt_template_encode_start_idx`` = 34 tokens of its chat
  template (the real Qwen tokenizer's length of the system prefix); this tokenizer has the
  template's words as whole tokens so that prefix is also exactly 34 tokens here, else the
  prompt's own tokens would be dropped.
- ``CLIPImageProcessor`` needs torchvision in transformers 5; ``CLIPImageProcessorPil`` does not.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

import torch

Kind = Literal["sd3", "flux", "qwen-image"]

#: the words of QwenImagePipeline's prompt template (whole tokens, see the module docstring)
_QWEN_TEMPLATE_WORDS = ("system user assistant Describe the image by detailing color shape size texture quantity "
                        "text spatial relationships of objects and background").split()
_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
_CHARS = [chr(c) for c in range(33, 127)]  # printable ASCII but space


def _clip_tokenizer(max_length: int = 77):
    """A CLIP BPE tokenizer over single characters (no merges): any ASCII prompt tokenizes."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in _CHARS:
        vocab.setdefault(ch.lower(), len(vocab))
        vocab.setdefault(f"{ch.lower()}</w>", len(vocab))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "vocab.json").write_text(json.dumps(vocab))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(str(Path(d) / "vocab.json"), str(Path(d) / "merges.txt"), model_max_length=max_length)


def _t5_tokenizer():
    """A T5 Unigram tokenizer: whole words of a small list, else single characters."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    words = "a an the of and in on photo painting cat dog red blue green tree house sky".split()
    pieces += [(f"▁{w}", -2.0) for w in words]
    pieces += [(ch, -5.0) for ch in _CHARS] + [(f"▁{ch}", -5.0) for ch in _CHARS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def _qwen_tokenizer():
    """Qwen2's byte-level BPE with its pre-tokenizer regex and chat special tokens; the template's
    words are whole tokens (``ignore_merges``), anything else falls back to bytes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {tok: i for i, tok in enumerate(_QWEN_SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    for w in _QWEN_TEMPLATE_WORDS:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault(f"Ġ{w}", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in _QWEN_SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=32768)


def _clip_text_config(tokenizer, hidden: int, projection: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, projection_dim=projection, max_position_embeddings=77,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, hidden_act="gelu")


def _t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=37, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))


def _vae_kl(latent_channels: int):
    """A 2x-downsampling AutoencoderKL with SD3's scaling and shift factors."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)


def _sd3(resolution: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip = _clip_tokenizer()
    t5 = _t5_tokenizer()
    latent = resolution // 2
    transformer = SD3Transformer2DModel(  # SD3.5-style: qk RMS norm and a dual-attention layer
        sample_size=latent, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=latent, dual_attention_layers=(0,), qk_norm="rms_norm")
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae_kl(4),
        text_encoder=CLIPTextModelWithProjection(_clip_text_config(clip, 16, 32)),
        tokenizer=clip,
        text_encoder_2=CLIPTextModelWithProjection(_clip_text_config(clip, 16, 32)),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(t5, 32),
        tokenizer_3=t5,
    )


def _flux(guidance_embeds: bool, heads: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip = _clip_tokenizer()
    t5 = _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    return FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=_vae_kl(4),
        text_encoder=CLIPTextModel(_clip_text_config(clip, 32, 32)), tokenizer=clip,
        text_encoder_2=_t5_encoder(t5, 32), tokenizer_2=t5, image_encoder=None, feature_extractor=None)


def _qwen_image(heads: int):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL}
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=heads,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    vae = AutoencoderKLQwenImage(  # non-trivial latents_mean/std so decode's un-normalisation is exercised
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[0.5, 1.5, 2.0, 0.8])
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                     "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, time_shift_type="exponential")
    return QwenImagePipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                             text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(), tokenizer=tok)


def build_tiny_pipeline(kind: Kind, out_dir: str | Path, seed: int = 0, resolution: int = 32,
                        guidance_embeds: bool = True, heads: int | None = None) -> Path:
    """Build a random-weight pipeline of ``kind`` (weights follow ``seed``) and save it to ``out_dir``.

    ``resolution`` sizes SD3's positional-embedding grid (the largest image it can sample); FLUX and
    Qwen-Image (RoPE) sample any multiple of 4 / 8 pixels."""
    builders = {"sd3": lambda: _sd3(resolution), "flux": lambda: _flux(guidance_embeds, heads or 2),
                "qwen-image": lambda: _qwen_image(heads or 3)}
    if kind not in builders:
        raise ValueError(f"unknown pipeline kind {kind!r}; kinds: {', '.join(builders)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = builders[kind]()
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out
