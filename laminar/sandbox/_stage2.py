"""The sandboxed interpreter's own program (`python -I -S -c <this source> CTL LIMITS [DROP]`).

Standard library only: inside the sandbox nothing of laminar is visible. The host passes this
file's text on the command line. It drops to DROP = [uid, gid] when given (bwrap started by
root, with CAP_SETUID/CAP_SETGID only), lowers its rlimits, says it is ready (`R` on the control
descriptor CTL), reads the untrusted program from stdin (`<length>\\n<utf-8 bytes>`), then runs it as
`__main__`. An exception prints its traceback (without this file's frame) to stderr and sends
its last line (`E <line>`) on CTL, then exits 1. stdout is line-buffered and stderr is the same
pipe, so prints and tracebacks arrive in the order they were written.
"""
import json
import linecache
import os
import resource
import sys
import traceback
import types


def _limits(spec):
    for name, soft, hard in spec:
        res = getattr(resource, name, None)
        if res is None:
            continue
        try:
            resource.setrlimit(res, (soft, hard))
        except (ValueError, OSError):  # never raise a limit we cannot; lower what we can
            resource.setrlimit(res, (min(soft, resource.getrlimit(res)[1]),) * 2)


def _main():
    ctl = int(sys.argv[1])
    if len(sys.argv) > 3:  # bwrap run by root: drop to the sandbox's uid (clears every capability)
        uid, gid = json.loads(sys.argv[3])
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _limits(json.loads(sys.argv[2]))
    os.write(ctl, b"R\n")
    head = b""
    while not head.endswith(b"\n"):  # "<length>\n" then the code: no need to wait for EOF
        b = os.read(0, 1)
        if not b:
            os._exit(0)  # the host went away before sending code
        head += b
    need = int(head)
    chunks = []
    while need > 0:
        b = os.read(0, min(need, 1 << 20))
        if not b:
            os._exit(0)
        chunks.append(b)
        need -= len(b)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    src = b"".join(chunks).decode("utf-8", "replace")
    linecache.cache["<sandbox>"] = (len(src), None, src.splitlines(True), "<sandbox>")
    sys.stdout.reconfigure(line_buffering=True)
    sys.argv = ["<sandbox>"]
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    compiled = False
    try:
        code = compile(src, "<sandbox>", "exec")
        compiled = True
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - report whatever the program raised
        tb = e.__traceback__.tb_next if compiled and e.__traceback__ is not None else None
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        try:
            traceback.print_exception(type(e), e, tb)
        except Exception:  # noqa: BLE001
            pass
        try:
            last = traceback.format_exception_only(type(e), e)[-1].strip()
        except Exception:  # noqa: BLE001
            last = type(e).__name__
        try:
            os.write(ctl, b"E " + last.encode("utf-8", "replace")[:1000].replace(b"\n", b" ") + b"\n")
        except OSError:
            pass
        sys.exit(1)


_main()
