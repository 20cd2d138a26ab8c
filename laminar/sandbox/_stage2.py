"""The sandboxed interpreter's own program: `python -I -S -c <this source> SPEC_JSON`.

Standard library only: inside the sandbox nothing of laminar is visible. The host passes this
file's text on the command line. SPEC = {"ctl": fd, "rep": fd | null, "limits": [[name, soft,
hard]...], "drop": [uid, gid] | null}.

1. `drop` (bwrap started by root, which keeps only CAP_SETUID/CAP_SETGID for this): no
   supplementary groups, setresgid/setresuid to the sandbox uid; that clears every capability.
2. The rlimits (lowering is always allowed).
3. With `rep`: fork. The parent stays as a small init: it ignores what it can, makes itself
   non-dumpable (the program, same uid, cannot ptrace it), reaps children until the program's
   process ends, writes `X <wait status>` on `rep` (a pipe only it holds) and exits, which ends
   the namespace. The program so never runs as a pid namespace's init, where the kernel drops
   default-action signals such as SIGXCPU (the CPU limit).
4. The program's process says `R` on `ctl` (the host waits for it), reads `<length>\\n<utf-8>`
   from stdin and runs it as `__main__` with stdout line-buffered; stderr is the same pipe, so
   output keeps its order. An exception prints its traceback (without this file's frame) and
   sends its last line as `E <line>` on `ctl`, then exits 1.
"""
import json
import linecache
import os
import resource
import signal
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


def _init(child, rep):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGALRM, signal.SIGXCPU):
        signal.signal(s, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    except Exception:  # noqa: BLE001
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            break
    try:
        os.write(rep, b"X %d\n" % status)
    finally:
        os._exit(0)


def _main():
    spec = json.loads(sys.argv[1])
    ctl = spec["ctl"]
    if spec.get("drop"):
        uid, gid = spec["drop"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _limits(spec["limits"])
    rep = spec.get("rep")
    if rep is not None:
        child = os.fork()
        if child:
            _init(child, rep)
        os.close(rep)
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
