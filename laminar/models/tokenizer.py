"""A character-level tokenizer as a `transformers.PreTrainedTokenizerFast`.

One token per character of `string.printable`, plus <pad>/<bos>/<eos>/<unk>. It saves and loads
the Hugging Face way (`save_pretrained` / `AutoTokenizer.from_pretrained`), and encode → decode
is an exact round trip for printable text.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt: BOS (when the tokenizer has one) followed by the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else list(ids)


def decode_response(tokenizer, ids: list[int]) -> str:
    """Response text without EOS/PAD."""
    return tokenizer.decode(ids, skip_special_tokens=True)
