"""Build the policy model: a Qwen2 causal LM from a size preset, or any local HF directory.

`load_policy(cfg)` returns (model, tokenizer). `save_pretrained(model, tokenizer, dir)` writes a
plain Hugging Face directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)
from transformers.utils import logging as hf_logging

from laminar.config import ConfigError, ModelConfig
from laminar.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer

hf_logging.disable_progress_bar()  # no per-file bars when saving and loading small models

# hidden, layers, attention heads, KV heads; intermediate = 4 * hidden, vocab 128, tied embeddings
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (128, 2, 4, 2),
    "small": (256, 4, 4, 2),
}
VOCAB_SIZE = 128  # >= 104 char-tokenizer ids, padded to a multiple of 64


def build_preset(preset: str, seed: int = 0, attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    if preset not in PRESETS:
        raise ConfigError(f"model.preset='{preset}' is unknown; choose one of {sorted(PRESETS)}")
    return build_shaped(PRESETS[preset], seed, attn_implementation)


def build_shaped(shape: tuple[int, int, int, int], seed: int = 0,
                 attn_implementation: str = "sdpa") -> Qwen2ForCausalLM:
    """A preset-like model of another shape: (hidden, layers, attention heads, KV heads)."""
    hidden, layers, heads, kv_heads = shape
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def check_model_dir(path: str | Path, key: str = "model.path") -> None:
    """A ConfigError naming `key` unless `path` is a local Hugging Face model directory."""
    if not Path(path).is_dir():
        raise ConfigError(f"{key}='{path}' does not exist; point it at a local Hugging Face model "
                          "directory (config.json, weights and tokenizer files) or unset it to "
                          "start from model.preset")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{key}='{path}' is not a Hugging Face model directory (no config.json "
                          "inside); point it at a folder written by save_pretrained, such as a "
                          "laminar checkpoint's model/ folder")


def load_pretrained(path: str | Path, attn_implementation: str = "sdpa"
                    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = Path(path)
    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The directory's own tokenizer. A generic fast tokenizer (like laminar's char tokenizer)
    is loaded as `PreTrainedTokenizerFast`: AutoTokenizer would force Qwen2's own class onto a
    qwen2 model directory and mangle it."""
    path = Path(path)
    tok_cfg = path / "tokenizer_config.json"
    declared = json.loads(tok_cfg.read_text()).get("tokenizer_class") if tok_cfg.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_policy(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting model and its tokenizer, as `cfg` describes."""
    if cfg.path:
        return load_pretrained(cfg.path, cfg.attn_implementation)
    return build_preset(cfg.preset, cfg.seed, cfg.attn_implementation), build_char_tokenizer()


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
