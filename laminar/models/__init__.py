"""Models and tokenizers: presets built from config, or local Hugging Face directories."""

from laminar.models.builder import (PRESETS, build_preset, load_policy, load_pretrained,
                                    num_parameters, save_pretrained)
from laminar.models.tokenizer import (BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, decode_response,
                                      encode_prompt)

__all__ = ["PRESETS", "build_preset", "load_policy", "load_pretrained", "num_parameters",
           "save_pretrained", "build_char_tokenizer", "decode_response", "encode_prompt", "BOS_ID",
           "EOS_ID", "PAD_ID"]
