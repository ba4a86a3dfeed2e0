"""A tiny random Idefics3 (SmolVLM) checkpoint directory in the published layout.

`write_tiny_idefics3(path)` writes what SmolVLM's repository ships, at toy size: `config.json`
(`idefics3` with a llama `text_config` and a SigLIP `vision_config`), `model.safetensors` with
transformers' names (`model.text_model.*`, `model.vision_model.*`, `model.connector.*`, `lm_head`),
`preprocessor_config.json` and `processor_config.json` for the image processor, a word-level tokenizer
whose last ids are the processor's special tokens (`<image>`, `<fake_token_around_image>`,
`<global-img>`, `<row_r_col_c>`, `<end_of_utterance>`), and the chat template in `chat_template.json`
only, as SmolVLM ships it: a template that reads message content as typed parts. Weights are drawn by
transformers' own `Idefics3ForConditionalGeneration` (so the names are the ones it saves and loads).

Written under a temporary name next to `path` and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .tiny_checkpoint import write_word_tokenizer

TINY_TEXT: dict = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None,
                       pad_token_id=0)
# 32 x 32 tiles of 8 x 8 patches, folded 2 x 2: 4 image tokens per tile
TINY_VISION: dict = dict(model_type="idefics3_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, image_size=32, patch_size=8, hidden_act="gelu_pytorch_tanh")
SCALE_FACTOR = 2

_SPECIALS = (["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
             + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])

# SmolVLM's form: "User:<image>text<end_of_utterance>\nAssistant:", content read as typed parts
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_tiny_idefics3(path, *, seed: int = 0, longest_edge: int = 64, do_image_splitting: bool = True) -> Path:
    """Write the checkpoint at `path` (which must not exist, or be an empty directory) and return it.
    `longest_edge`: the image processor's resize target (a multiple of the 32-pixel tile gives that many
    tiles per side at most, plus the global view)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    vocab = TINY_TEXT["vocab_size"]
    ids = dict(zip(_SPECIALS, range(vocab - len(_SPECIALS), vocab)))
    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3", "dtype": "float32",
              "image_token_id": ids["<image>"], "scale_factor": SCALE_FACTOR, "tie_word_embeddings": False,
              "text_config": TINY_TEXT, "vision_config": TINY_VISION}
    tile = TINY_VISION["image_size"]
    image_processor = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
                       "size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": tile},
                       "do_image_splitting": do_image_splitting, "resample": 1, "do_rescale": True,
                       "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "do_pad": True}
    seq_len = (tile // TINY_VISION["patch_size"]) ** 2 // SCALE_FACTOR ** 2
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(Idefics3Config(**{k: v for k, v in config.items()
                                                                   if k not in ("architectures", "dtype")}))
        _redraw(model, seed)
        model.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2) + "\n")
        (tmp / "processor_config.json").write_text(json.dumps(
            {"image_seq_len": seq_len, "processor_class": "Idefics3Processor"}, indent=2) + "\n")
        (tmp / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
        write_word_tokenizer(tmp, vocab, specials={i: token for token, i in ids.items()}, template=None)
        if path.exists():
            path.rmdir()
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _redraw(model, seed: int) -> None:
    """Weights at a scale where mistakes show (transformers' 0.02 init leaves the image's effect on the
    logits near rounding): matrices at unit gain, norm scales around one, biases and embeddings around
    zero at 0.2 and 1."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.named_parameters():
            r = torch.randn(t.shape, generator=gen)
            if "embed_tokens" in name or "position_embedding" in name:
                t.copy_(r)
            elif t.dim() > 1:
                t.copy_(r * t[0].numel() ** -0.5)
            else:
                t.copy_(r * 0.2 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
