"""How turns become tokens, without ever re-tokenizing what the model generated.

    turns = TurnTemplate(tokenizer)
    prompt_ids = turns.prompt_ids("What is 2+2?")          # the first observation, templated
    obs_ids = turns.observation_ids("<out>4</out>", ended_with_eos=False)   # appended after a turn

A trajectory's tokens are the prompt, then alternately the ids the engine generated (kept as
they are) and observation ids built here. Two templates:

- **the tokenizer's chat template** (`tokenizer.chat_template` set, as in any instruct model's
  directory): the prompt is a user message with the generation prompt; an observation is a
  `tool` message (a `user` one where the template has no tool role) followed by the next
  generation prompt. Its ids are the template's rendering of a conversation with the
  observation minus the rendering without it, cut right after the previous assistant turn's
  end token: exactly the tokens the template would put between the model's turn and its next
  one. A turn ended by a stop string (no end token) gets the end token first, masked like the
  observation.
- **the built-in template** (no chat template, e.g. laminar's character tokenizer): plain text.
  The prompt is BOS + the first observation; an observation is its own text, appended as is
  (the environment writes its own framing, such as `\\n<out>4</out>\\n`).
"""

from __future__ import annotations

from typing import Any

from laminar.models.tokenizer import encode_prompt

# A stand-in conversation for measuring what the chat template puts around an observation.
_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"}]


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if hasattr(out, "keys"):  # a BatchEncoding (return_dict default of newer transformers)
        out = out["input_ids"]
    return list(out)


class TurnTemplate:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.eos = tokenizer.eos_token_id
        self.role = "tool"
        if self.chat:
            try:
                _ids(tokenizer, [*_PROBE, {"role": "tool", "content": "x"}], True)
            except Exception:  # templates without a tool role raise on one
                self.role = "user"

    @property
    def name(self) -> str:
        return "chat" if self.chat else "built-in"

    def prompt_ids(self, observation: str) -> list[int]:
        if not self.chat:
            return encode_prompt(self.tokenizer, observation)
        return _ids(self.tokenizer, [{"role": "user", "content": observation}], True)

    def observation_ids(self, observation: str, ended_with_eos: bool) -> list[int]:
        """The ids that follow a model turn: its end token when the turn lacked one (chat
        template only), the observation, and the next generation prompt."""
        if not self.chat:
            return list(self.tokenizer.encode(observation, add_special_tokens=False))
        base = _ids(self.tokenizer, _PROBE, False)
        full = _ids(self.tokenizer, [*_PROBE, {"role": self.role, "content": observation}], True)
        cut = _after_last(base, self.eos)
        if full[:cut] != base[:cut]:
            raise ValueError("the chat template renders a conversation differently once an "
                             "observation follows; laminar cannot append observations token-"
                             "exactly with it")
        head = [] if ended_with_eos or self.eos is None else [self.eos]
        return head + full[cut:]


def _after_last(ids: list[int], token: int | None) -> int:
    """Index just past the last `token` in `ids` (len(ids) when absent)."""
    if token is not None:
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == token:
                return i + 1
    return len(ids)


def stop_sequences(tokenizer: Any, stops: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """An environment's stop strings as token-id sequences for the engine. With a tokenizer
    that merges characters, the model may spell a stop string with other tokens; such a turn
    then ends at EOS or the budget and `step` still sees its text."""
    return tuple(tuple(tokenizer.encode(s, add_special_tokens=False)) for s in stops if s)
