"""Run untrusted Python safely and fast (docs/sandbox.md).

    from laminar.sandbox import Sandbox, RunResult, SandboxError, resolve_backend, shared_sandbox
    sb = Sandbox(cfg.sandbox)           # starts cfg.warm sandboxes in the background
    r = sb.run("print(2**100)")         # RunResult: stdout, status, exit_code, error, wall_s,
                                        #   truncated
    r = await sb.arun(code, timeout_s=2.0)
    r.observation()                     # what a model sees: output, then the error on failure
    sb.close()                          # kills the warm ones; idempotent; also at exit

Backends (`sandbox.backend`): `bwrap` (bubblewrap), `unshare` (laminar's own namespaces:
laminar/sandbox/_boot.py), `unsafe` (rlimits only; needs `sandbox.allow_unsafe`), `auto`
(bwrap if installed and working, else unshare, else SandboxError or, when allowed, unsafe).
Every run is a fresh process that runs one program and is thrown away.
"""

from laminar.sandbox.pool import Sandbox, probe, resolve_backend, shared_sandbox
from laminar.sandbox.result import RunResult, SandboxError

__all__ = ["RunResult", "Sandbox", "SandboxError", "probe", "resolve_backend", "shared_sandbox"]
