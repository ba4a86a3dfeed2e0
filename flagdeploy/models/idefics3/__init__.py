"""Idefics3 (HF `idefics3`; SmolVLM): a llama-family text model fed by a SigLIP image encoder.

Modules: config (Idefics3Config, from_hf_config), vision (the encoder and its connector), model
(Idefics3ForCausalLM: the llama model with the encoder). processor (images to tiles and the prompt's
`<image>` expansion, at serve time) imports transformers and is loaded only when such a model is served
(flagdeploy.models.media_processor). The reference this is checked against is transformers'
`Idefics3ForConditionalGeneration` (tests/test_idefics3.py).
"""

from .config import Idefics3Config, SiglipConfig, from_hf_config
from .model import Idefics3ForCausalLM, load_hf_weights

__all__ = ["Idefics3Config", "Idefics3ForCausalLM", "SiglipConfig", "from_hf_config", "load_hf_weights"]
