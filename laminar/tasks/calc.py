"""The built-in agentic `calc` task: questions a tiny model cannot answer in its head.

The model writes a Python one-liner in a tool tag, the sandbox runs it (laminar/envs/calc.py),
the output comes back, and the model answers; the answer is scored by exact match. The whole
transcript is plain text (the built-in template: one token per character), kept short:

    Q:4821*9127\\n                          the prompt (every kind: `Q:` + question + newline)
    <py>print(4821*9127)</py>              model turn 1, ended by the stop string `</py>`
    \\n<out>44001267</out>\\nA:              the environment's observation
    44001267<eos>                          model turn 2: the answer

Question kinds (`task.calc.kinds`) and the program a demonstration writes for each:

    mul        Q:4821*9127                print(4821*9127)
    add        Q:4821+9127                print(4821+9127)
    range_sum  Q:sum 120:5430 %7==3       print(sum(i for i in range(120,5430)if i%7==3))
    count      Q:count c in abdhcgabe     print('abdhcgabe'.count('c'))
    primes     Q:primes<5000              print(sum(all(n%d for d in range(2,n))for n in range(2,5000)))

Every number (and the string) in a program is copied from its question. The work of `range_sum`
(range length) and `primes` (~N^2 / (2 ln N) inner iterations of the quadratic program) is
log-normal with `tail_sigma` around WORK_MEDIAN iterations, clipped to WORK_MAX, so program run
times have a heavy tail, the slow tools that asynchronous rollout hides. Measured in the bwrap
sandbox on a 2-core Xeon (busy), the 1684 range_sum/primes programs of the default 4096
questions: p50 ~50-65 ms, p99 0.4-0.75 s, 5 over 1 s, max 1.5 s; mul/add/count ~5 ms. The
WORK_MAX programs take ~0.8 s (range_sum) and ~1.3-1.7 s (primes) there, inside the sandbox's
default 5 s on a CPU twice as slow.
"""

from __future__ import annotations

import math

import numpy as np

from laminar.config import CalcTaskConfig
from laminar.types import PromptItem

FORMAT = "calc-v3"  # bump when questions, programs or observations change (the SFT cache key)
TOOL_OPEN, TOOL_CLOSE = "<py>", "</py>"
OBSERVATION_CHARS = 200  # longest tool output shown to the model (the tail is kept)
WORK_MEDIAN = 1e6  # inner-loop iterations of a median range_sum / primes program
WORK_MIN, WORK_MAX = 1e3, 3e7  # ~1 s of CPython on the machine it was tuned on
COUNT_ALPHABET = "abcdefgh"
COUNT_LEN = (20, 40)


def observation_text(output: str) -> str:
    """What the model sees after its program ran: the output (stripped, tail-truncated)."""
    text = output.strip()
    if len(text) > OBSERVATION_CHARS:
        text = "..." + text[-(OBSERVATION_CHARS - 3):]
    return f"\n<out>{text}</out>\nA:"


def parse_question(prompt: str) -> tuple[str, tuple]:
    """A prompt -> (kind, arguments), the inverse of the formats in the module docstring."""
    q = prompt.removeprefix("Q:").rstrip("\n")
    if q.startswith("sum "):
        span, cond = q[4:].split(" ")
        a, b = span.split(":")
        k, r = cond[1:].split("==")
        return "range_sum", (int(a), int(b), int(k), int(r))
    if q.startswith("count "):
        ch, s = q[6:].split(" in ")
        return "count", (ch, s)
    if q.startswith("primes<"):
        return "primes", (int(q[7:]),)
    if "*" in q:
        a, b = q.split("*")
        return "mul", (int(a), int(b))
    a, b = q.split("+")
    return "add", (int(a), int(b))


def program(prompt: str) -> str:
    """The demonstration's one-liner for a question (numbers copied from it)."""
    kind, args = parse_question(prompt)
    if kind == "mul":
        return f"print({args[0]}*{args[1]})"
    if kind == "add":
        return f"print({args[0]}+{args[1]})"
    if kind == "range_sum":
        a, b, k, r = args
        return f"print(sum(i for i in range({a},{b})if i%{k}=={r}))"
    if kind == "count":
        ch, s = args
        return f"print('{s}'.count('{ch}'))"
    (n,) = args
    return f"print(sum(all(n%d for d in range(2,n))for n in range(2,{n})))"


def demonstration(item: PromptItem) -> list[tuple[str, bool]]:
    """The text after the prompt of a solved episode, as (segment, trained?) pairs: the tool
    call, the observation the environment returns for it (context only) and the answer (EOS
    follows, added by SFT)."""
    return [(TOOL_OPEN + program(item.prompt) + TOOL_CLOSE, True),
            (observation_text(item.answer + "\n"), False),
            (item.answer, True)]


# ------------------------------------------------------------------------------ questions


def _range_sum(a: int, b: int, k: int, r: int) -> int:
    """sum(i for i in range(a, b) if i % k == r), in closed form."""
    first = a + (r - a) % k
    if first >= b:
        return 0
    n = (b - 1 - first) // k + 1
    return n * first + k * n * (n - 1) // 2


def _primes_below(limit: int) -> np.ndarray:
    """pi(n) for n in [0, limit]: the number of primes < n."""
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(limit ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = False
    return np.concatenate([[0], np.cumsum(sieve)])


def _primes_limit(work: float) -> int:
    """N whose quadratic prime count does about `work` inner iterations (sum of primes < N,
    ~N^2 / (2 ln N))."""
    n = math.sqrt(2 * work * 8)
    for _ in range(5):
        n = math.sqrt(2 * work * math.log(max(n, 3.0)))
    return max(3, int(round(n)))


def sample_work(cfg: CalcTaskConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    raw = WORK_MEDIAN * np.exp(cfg.tail_sigma * rng.standard_normal(n))
    return np.clip(raw, WORK_MIN, WORK_MAX)


def make_questions(cfg: CalcTaskConfig, n: int, seed: int) -> list[PromptItem]:
    """`n` questions, kinds drawn uniformly from `cfg.kinds`; deterministic given `seed`."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(np.array(cfg.kinds), size=n)
    work = sample_work(cfg, n, rng)
    pi = _primes_below(_primes_limit(WORK_MAX) + 2) if "primes" in cfg.kinds else None
    lo, hi = 10 ** (cfg.digits - 1), 10 ** cfg.digits
    items = []
    for i, kind in enumerate(kinds):
        if kind in ("mul", "add"):
            a, b = (int(x) for x in rng.integers(lo, hi, size=2))
            op = "*" if kind == "mul" else "+"
            q, ans = f"{a}{op}{b}", a * b if kind == "mul" else a + b
        elif kind == "range_sum":
            a = int(rng.integers(0, 1000))
            b = a + int(work[i])
            k = int(rng.integers(2, 10))
            r = int(rng.integers(0, k))
            q, ans = f"sum {a}:{b} %{k}=={r}", _range_sum(a, b, k, r)
        elif kind == "count":
            length = int(rng.integers(COUNT_LEN[0], COUNT_LEN[1] + 1))
            s = "".join(rng.choice(np.array(list(COUNT_ALPHABET)), size=length))
            ch = str(rng.choice(np.array(list(COUNT_ALPHABET))))
            q, ans = f"count {ch} in {s}", s.count(ch)
        else:  # primes
            limit = _primes_limit(float(work[i]))
            q, ans = f"primes<{limit}", int(pi[limit])
        items.append(PromptItem(index=i, prompt=f"Q:{q}\n", answer=str(ans)))
    return items
