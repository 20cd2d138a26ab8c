"""The sandboxed interpreter's own program: `python -I -S -c <this source> SPEC`.

Standard library only: inside the sandbox nothing of laminar is visible. The host passes this
file's text on the command line. SPEC (marshal data in hex) = {"ctl": fd, "rep": fd | None,
"limits": [(name, soft, hard)...], "drop": [uid, gid] | None}.

1. `drop` (bwrap started by root, which keeps only CAP_SETUID/CAP_SETGID for this): no
   supplementary groups, setresgid/setresuid to the sandbox uid; that clears every capability.
2. The rlimits (lowering is always allowed), then a seccomp filter (`_DENY`: no new
   namespaces, mounts, bpf, perf, io_uring, userfaultfd, keyctl, ptrace...).
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
import linecache
import marshal
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


# Syscalls refused to the program (seccomp, errno EPERM): namespaces (the kernel surface an
# unprivileged user namespace opens), mounts, and interfaces no calculation needs that have had
# many kernel bugs. clone with any CLONE_NEW* flag is refused; clone3 answers ENOSYS so that the
# C library falls back to clone (whose flags a filter can see). Other architectures: no filter.
_DENY = {
    "x86_64": (0xC000003E, 56, 435, {
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
        "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "keyctl": 250, "add_key": 248,
        "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "ptrace": 101, "process_vm_writev": 311, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 246, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "name_to_handle_at": 303, "open_by_handle_at": 304,
        "personality": 135, "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169}),
    "aarch64": (0xC00000B7, 220, 435, {
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "keyctl": 219, "add_key": 217,
        "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "ptrace": 117, "process_vm_writev": 271, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 104, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "name_to_handle_at": 264, "open_by_handle_at": 265,
        "personality": 92, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142}),
}
_CLONE_NEW = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME


def _filter():
    """The seccomp program as (ctypes library, sock_fprog, its buffer), or None where this
    architecture has no filter here. Built once per interpreter: the zygote builds it before it
    forks, so that no program's process pays for it (nor copies the pages it would touch)."""
    global _FILTER
    if _FILTER is not False:
        return _FILTER
    import ctypes
    import struct

    spec = _DENY.get(os.uname().machine)
    if spec is None:
        _FILTER = None
        return None
    arch, clone, clone3, deny = spec
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # x32 syscalls
    for nr in sorted(deny.values()):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys),
             (jeq, 0, 3, clone), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NEW), (ret, 0, 0, eperm),
             (ret, 0, 0, allow)]
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.addressof(buf))
    _FILTER = (_libc(), ctypes.byref(fprog), fprog, buf)
    return _FILTER


_FILTER = False  # not built yet


def _seccomp():
    """Install the filter; False where this architecture has none here."""
    import ctypes

    f = _filter()
    if f is None:
        return False
    libc, ref = f[0], f[1]
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (bwrap and _boot set it too)
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(22, 2, ref, 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.prctl  # noqa: B018 - resolve the symbol now (in the zygote: before any fork)
    return _LIBC


_LIBC = None


def prepare():
    """Everything a program's process would otherwise build for itself (the zygote calls it
    before it forks)."""
    _filter()
    _libc()


def _dumpable(flag):
    if _libc().prctl(4, flag, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError("prctl(PR_SET_DUMPABLE) failed")


def _init(child, rep):
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGALRM, signal.SIGXCPU):
        signal.signal(s, signal.SIG_IGN)
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


def _main(spec):
    """The whole one-shot stage 2: drop, limits, seccomp, the init's fork, the program."""
    if spec.get("drop"):
        uid, gid = spec["drop"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    confine(spec)
    program(spec["ctl"], spec.get("rep"))


def confine(spec):
    """The nice level and the cores, the rlimits, then the seccomp filter (in this order:
    setpriority and setrlimit stay allowed, but nothing is left to do after the filter)."""
    if spec.get("nice"):
        os.nice(spec["nice"])
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    _limits(spec["limits"])
    if spec.get("seccomp", True):
        _seccomp()


def program(ctl, rep):
    """With `rep`: fork, the parent staying as the init. Then say R, read the code, run it,
    end (never returns)."""
    if rep is not None:
        _dumpable(0)  # before the fork: the init is never ptrace-able nor its /proc/1/fd open
        child = os.fork()
        if child:
            _init(child, rep)
        os.close(rep)
        _dumpable(1)  # the program's own process is an ordinary one
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
    except SystemExit as e:
        _finish(_exit_status(e))
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
            line = last.encode("utf-8", "replace")[:1000].replace(b"\n", b" ")
            os.write(ctl, b"E " + line + b"\n")
        except OSError:
            pass
        _finish(1)
    _finish(0)


def _exit_status(e):
    """What the interpreter would exit with for this SystemExit (printing a non-int code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        sys.stdout.flush()
        print(e.code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _finish(status):
    """End like the interpreter's own exit (join non-daemon threads, atexit, flush) but skip
    tearing down every module: that touches every page the fork shares with the init (copy on
    write), which made exiting cost ~10 ms."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
    except BaseException:  # noqa: BLE001
        pass
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(status)



if __name__ == "__main__":  # the one-shot path: `python -I -S -c <this> SPEC`
    _main(marshal.loads(bytes.fromhex(sys.argv[1])))
