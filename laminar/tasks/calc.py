"""The built-in agentic `calc` task: questions a tiny model cannot answer in its head.

The model writes a Python one-liner in a tool tag, the sandbox runs it (`CalcEnv`, below),
the output comes back, and the model answers; the answer is scored by exact match. The whole
transcript is plain text (the built-in template: one token per character), kept short:

    Q:4821*9127\\n                          the prompt (every kind: `Q:` + question + newline)
    <py>print(4821*9127)</py>              model turn 1, ended by the stop string `</py>`
    \\n<out>44001267</out>\\nA:              the environment's observation
    44001267<eos>                          model turn 2: the answer

Question kinds (`task.calc.kinds`) and the program a demonstration writes for each:

    mul        Q:4821*9127                print(4821*9127)
    add        Q:4821+9127                print(4821+9127)
    range_sum  Q:sum%7 120:5430           print(sum(i%7 for i in range(120,5430)))
    count      Q:count c in abdhcgabe     print('abdhcgabe'.count('c'))
    primes     Q:primes<5000              print(sum(all(n%d for d in range(2,n))for n in range(2,5000)))

Every number (and the string) in a program is copied from its question. The work of `range_sum`
(range length) and `primes` (~N^2 / (2 ln N) inner iterations of the quadratic program) is
log-normal with `tail_sigma` around WORK_MEDIAN iterations, clipped to WORK_MAX, so program run
times have a heavy tail, the slow tools that asynchronous rollout hides: median programs take
milliseconds, the slowest around a second (WORK_MAX programs: ~0.8 s range_sum, ~1.3-1.7 s
primes on a busy 2-core Xeon), inside the sandbox's default 5 s. What a run saw is in its step
rows (`env_latency_s`); docs/agentic.md quotes `laminar bench modes --task calc`.
"""

from __future__ import annotations

import math

import numpy as np

from laminar.config import CalcTaskConfig, SandboxConfig
from laminar.envs.base import Env, StepResult
from laminar.sandbox import shared_sandbox
from laminar.types import PromptItem

FORMAT = "calc-v4"  # bump when questions, programs or observations change (the SFT cache key)
TOOL_OPEN, TOOL_CLOSE = "<py>", "</py>"
OBSERVATION_CHARS = 200  # longest tool output shown to the model (the tail is kept)
WORK_MEDIAN = 2e5  # inner-loop iterations of a median range_sum / primes program
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
    if q.startswith("sum%"):
        k, span = q[4:].split(" ")
        a, b = span.split(":")
        return "range_sum", (int(a), int(b), int(k))
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
        a, b, k = args
        return f"print(sum(i%{k} for i in range({a},{b})))"
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


def _range_sum(a: int, b: int, k: int) -> int:
    """sum(i % k for i in range(a, b)), in closed form (a sum over the range: its answer stays
    short, about (b - a) * k / 2, so a tiny model can copy it back from the tool's output)."""
    def upto(n: int) -> int:  # sum of i % k for i in range(n)
        return (n // k) * (k * (k - 1) // 2) + (n % k) * (n % k - 1) // 2
    return upto(b) - upto(a)


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
            q, ans = f"sum%{k} {a}:{b}", _range_sum(a, b, k)
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


# --- the environment -----------------------------------------------------------------------

class CalcEnv(Env):
    """The environment of the calc task.

    A turn holding a complete `<py>...</py>` tool call runs its code in the sandbox and shows the
    output (`\\n<out>...</out>\\nA:`; an error, timeout or cut output shows the sandbox's message,
    tail-truncated to 200 characters); any other turn is the final answer, scored by exact match.
    A turn that opens `<py>` and never closes it (the token budget ran out) ends the episode with
    reward 0. The state is plain data (the sandbox settings and the answer), so an episode pickles
    and moves between rollouts; the sandbox itself is the process's shared pool.
    """

    stop = (TOOL_CLOSE,)

    def __init__(self, sandbox: SandboxConfig | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else SandboxConfig()
        self.answer = ""

    async def reset(self, sample: PromptItem) -> str:
        self.answer = sample.answer
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        start = text.find(TOOL_OPEN)
        if start >= 0:
            end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
            if end < 0:  # an unclosed tool call: the turn ran out of budget
                return StepResult("", 0.0, True, {"exact_match": False})
            code = text[start + len(TOOL_OPEN):end]
            r = await shared_sandbox(self.sandbox).arun(code)
            return StepResult(observation_text(r.observation()), 0.0, False,
                              {"tool_s": r.wall_s, "tool_status": r.status})
        exact = text.strip() == self.answer
        return StepResult("", 1.0 if exact else 0.0, True, {"exact_match": exact})
