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

Both methods also take chat messages (`[{"role": ..., "content": ...}]`, content a string) in
place of the text: the chat template renders them with their own roles (a prompt with a system
message, a user's follow-up); the built-in template appends their contents as text.
"""

from __future__ import annotations

from typing import Any, Union

from laminar.models.tokenizer import encode_prompt

# A stand-in conversation for measuring what the chat template puts around an observation.
_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe"}]

Observation = Union[str, list[dict[str, Any]]]  # text, or chat messages


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

    def prompt_ids(self, observation: Observation) -> list[int]:
        if not self.chat:
            return encode_prompt(self.tokenizer, _text(observation))
        return _ids(self.tokenizer, _messages(observation, "user"), True)

    def observation_ids(self, observation: Observation, ended_with_eos: bool) -> list[int]:
        """The ids that follow a model turn: its end token when the turn lacked one (chat
        template only), the observation, and the next generation prompt."""
        if not self.chat:
            return list(self.tokenizer.encode(_text(observation), add_special_tokens=False))
        base = _ids(self.tokenizer, _PROBE, False)
        full = _ids(self.tokenizer, [*_PROBE, *_messages(observation, self.role)], True)
        cut = _after_last(base, self.eos)
        if full[:cut] != base[:cut]:
            raise ValueError("the chat template renders a conversation differently once an "
                             "observation follows; laminar cannot append observations token-"
                             "exactly with it")
        head = [] if ended_with_eos or self.eos is None else [self.eos]
        return head + full[cut:]


def _messages(observation: Observation, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": observation}] if isinstance(observation, str) else observation


def _text(observation: Observation) -> str:
    return observation if isinstance(observation, str) else "".join(m["content"] for m in observation)


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
