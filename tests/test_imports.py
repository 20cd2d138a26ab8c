"""What a job's processes import: the prompt pool needs neither transformers nor torch and
imports neither (they cost it 4.1 s of CPU at every start of a job, in every test that starts
one; now 0.6 s); the modules of the rollout manager, the pools and the relays import neither.
(The manager's process still loads torch today: unpickling its rollout actors' handles imports
their class's module, laminar.rollout.actor.)"""

from __future__ import annotations

import pickle
import subprocess
import sys

from laminar.models.tokenizer import build_char_tokenizer, encode_prompt
from laminar.pools.prompts import PromptEncoder

HEAVY = "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"


def _run(code: str, stdin: bytes = b"") -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return out.stdout.decode().splitlines()


def test_the_prompt_encoder_gives_encode_prompts_ids_and_unpickles_without_transformers():
    tok = build_char_tokenizer()
    enc = PromptEncoder.of(tok)
    for text in ("ab=", "hello world\n", "", "  tabs\tand ~symbols~ 123", "x" * 300):
        assert enc(text) == encode_prompt(tok, text)
    tok.bos_token = None  # no BOS: the ids alone, as encode_prompt gives them
    assert PromptEncoder.of(tok)("ab") == encode_prompt(tok, "ab") == tok.encode("ab", add_special_tokens=False)
    # a fresh process unpickles it, as the prompt pool's does
    lines = _run(f"import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f('ab')); {HEAVY}",
                 pickle.dumps(enc))
    assert lines == [str(encode_prompt(build_char_tokenizer(), "ab")), "[]"]


def test_the_rollout_manager_and_the_pools_import_no_torch():
    lines = _run("import sys; import laminar.manager.actor, laminar.engine.knee, "
                 "laminar.pools.prompts, laminar.pools.partials, laminar.pools.experience, "
                 f"laminar.relay.relay; {HEAVY}")
    assert lines == ["[]"]
