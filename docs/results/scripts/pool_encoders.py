"""The pools' value encoders against `dataclasses.asdict` (what they replaced in 3118fbf).

    python docs/results/scripts/pool_encoders.py

Times encoding one prompt group, one generation request and one trajectory of the default
reverse workload's sizes (a 24-token prompt, 48 response tokens with log-probs and versions),
checks that both produce the same JSON, and prints microseconds per value.
"""
import dataclasses
import json
import timeit

from laminar.pools.store import encode_group, encode_request, encode_trajectory
from laminar.types import GenerationRequest, PromptGroup, PromptItem, SamplingParams, Trajectory

prompt = list(range(24))
out = list(range(100, 148))
lps = [-0.5 - i / 100 for i in range(48)]
group = PromptGroup("e0-17", PromptItem(17, "reverse: a b c d", "d c b a"), prompt, 8)
req = GenerationRequest("e0-17/3", prompt, SamplingParams(max_new_tokens=80, stop_token_ids=(2,)),
                        out, lps, [5] * 48, 5, None)
traj = Trajectory("e0-17/3", "e0-17", prompt, out, lps, 5, 1.0, True, "stop", [5] * 48)


def asdict_request(r):
    d = dataclasses.asdict(r)
    d["params"]["stop_token_ids"] = list(d["params"]["stop_token_ids"])
    d["params"]["stop_sequences"] = [list(s) for s in d["params"]["stop_sequences"]]
    return d


print(f"{'value':<12}{'asdict µs':>12}{'encoder µs':>12}{'ratio':>8}")
for name, value, old, new in [("group", group, dataclasses.asdict, encode_group),
                              ("request", req, asdict_request, encode_request),
                              ("trajectory", traj, dataclasses.asdict, encode_trajectory)]:
    assert json.dumps(old(value)) == json.dumps(new(value)), name
    n = 20000
    t_old = min(timeit.repeat(lambda: old(value), number=n, repeat=5)) / n * 1e6
    t_new = min(timeit.repeat(lambda: new(value), number=n, repeat=5)) / n * 1e6
    print(f"{name:<12}{t_old:>12.1f}{t_new:>12.1f}{t_old / t_new:>7.1f}x")
