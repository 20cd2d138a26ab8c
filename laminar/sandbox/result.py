"""What one sandboxed run gives back (`RunResult`) and the one error the sandbox raises."""

from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("ok", "error", "timeout", "output_limit", "killed")


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (isolation unavailable, unsafe not allowed, a sandbox that
    failed to start, a closed Sandbox). Never raised for anything the untrusted code does."""


class SandboxSlow(SandboxError):
    """A sandbox that did not become ready in time: the machine was busy, not the isolation
    missing. Nobody caches it as an answer about this machine (pool.probe asks again later)."""


@dataclass
class RunResult:
    """One run of untrusted code.

    stdout: the program's stdout and stderr interleaved in the order written (both are one
        pipe; stdout is line-buffered), decoded as UTF-8 with replacement, cut to
        `max_output_bytes` bytes.
    status: "ok" (exit 0), "error" (an exception or a nonzero exit), "timeout" (wall clock),
        "output_limit" (printed over 16x `max_output_bytes`; stopped), "killed" (a signal: the
        CPU limit's SIGXCPU, SIGKILL, SIGSEGV...).
    exit_code: the exit code; minus the signal number when killed by one; None when the
        sandbox stopped it (timeout, output_limit).
    error: a short reason when status is not "ok": the last line of the traceback
        ("ZeroDivisionError: division by zero", "MemoryError"), "exit code 3",
        "timeout after 2 s", "output over 65536 bytes", "killed by signal 9 (SIGKILL)".
    wall_s: seconds from handing the code over to the end of the run.
    truncated: the output was longer than `max_output_bytes` and was cut.
    """

    stdout: str
    status: str
    exit_code: int | None
    error: str | None
    wall_s: float
    truncated: bool

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def observation(self) -> str:
        """What a model sees: the output; then, when cut, a line saying so; then, on failure, a
        final line with the error unless the output already ends with it (a traceback does)."""
        out = self.stdout
        lines = []
        if self.truncated:
            lines.append("[output truncated]")
        if self.status != "ok" and self.error and (
                self.truncated or not out.rstrip().endswith(self.error)):
            lines.append(self.error)
        if not lines:
            return out
        if out and not out.endswith("\n"):
            out += "\n"
        return out + "\n".join(lines)
