"""An agent written against the OpenAI client, trained by laminar (examples/agent.yaml).

It answers a `reverse` prompt (`abc=` -> `cba`); when the answer is wrong it says so and asks
once more. Reward: 1 for a right first answer, 0.5 for a right second one, else 0. Nothing here
knows about tokens: laminar serves the client's requests from the policy being trained and keeps
the token ids it generated (docs/openai-endpoint.md).
"""

import openai

from laminar.types import PromptItem


async def run(client: openai.AsyncOpenAI, sample: PromptItem) -> float:
    messages = [{"role": "user", "content": sample.prompt}]
    for attempt in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # the episode's token budget is spent
            return 0.0
        answer = choice.message.content.strip()
        if answer == sample.answer:
            return 1.0 if attempt == 0 else 0.5
        messages += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": f"\nwrong, again: {sample.prompt}"}]
    return 0.0
