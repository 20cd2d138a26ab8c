"""Start one `unshare` sandbox: `python -I -S _boot.py PLAN` (standard library only; PLAN is
marshal data in hex: importing json would cost ~7 ms of start-up).

Run by the host (laminar/sandbox/proc.py) with a clean environment, stdin = the code pipe,
stdout = stderr = the output pipe, and two more pipes: CTL (to the host, shared with the
sandbox: `R` ready, `E <line>` the program's exception, `F <why>` set-up failed) and REP
(this outer process and the sandbox's init only: `P <pid>` the init's host pid, `X <wait
status>` the program's end as its init saw it, `W <wait status>` the init's end).

The outer process (this one, in the host's namespaces):
  0. the plan's nice increment (sandbox.nice) and cores (the job's, where the host process is
     pinned to its own: laminar.cores.tool_cores), inherited by everything below;
  1. PR_SET_PDEATHSIG(SIGTERM): it ends with the host thread that started it (not for a
     zygote, which ends with its socket);
  2. unshare(mount, pid, net, ipc, uts, cgroup [+ user when not root]);
  3. forks the sandbox's init (pid 1 of the new pid namespace), reports its pid, waits for it
     and reports its wait status. SIGTERM makes it SIGKILL the init first, which kills every
     process of the pid namespace (the kernel does that when a namespace's init dies).

The init (pid 1), still privileged inside its namespaces, builds the root and drops privilege:
  - mount propagation private; a tmpfs as the new root holding read-only binds of the plan's
    paths (/usr, the Python prefix, ...) and symlinks (/bin -> usr/bin ...), a small /etc
    (passwd, group, hosts, the loader cache), a /dev tmpfs with null/zero/full/random/urandom
    bound from the host, a fresh /proc of the new pid namespace (its global knobs, /proc/sys,
    /proc/sysrq-trigger, /proc/irq... bound read-only over themselves), and /tmp, a tmpfs of
    `scratch_mb` owned by the sandbox user: the only writable place;
  - pivot_root into it and detach the old root (the host's files are then unreachable), root
    remounted read-only, hostname `sandbox`;
  - no supplementary groups, setresgid/setresuid to the plan's unprivileged uid (this clears
    every capability), PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG(SIGKILL) (it dies with the outer);
  - closes every descriptor but 0, 1, 2, CTL (moved to 3) and REP (4), and execs the plan's
    Python on the stage-2 program with a clean environment (`_stage2.py`: rlimits, then a fork:
    the program runs as pid 2, the stage-2 parent stays pid 1 and reports its end on REP).

With `zygote` in the plan (sandbox.zygote, laminar/sandbox/zygote.py) the init does not drop
privilege nor exec: it becomes the zygote (`zygote`), which keeps four capabilities, imports
stage 2 once and forks each program's init (`start_program`, `program_init`) into namespaces,
a /proc, a /tmp and a uid of its own, then runs stage 2's steps in that fork.
"""
import ctypes
import marshal
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

ST_TO_MS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
            (os.ST_RELATIME, MS_RELATIME))

PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "mtrr", "pressure", "acpi", "driver")

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203,
                  "ppc64": 203, "s390x": 217, "i686": 217, "i386": 217}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                       ctypes.c_ulong]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _b(s):
    return None if s is None else os.fsencode(s)


def mount(src, dst, fstype, flags, data=None):
    _check(libc.mount(_b(src), _b(dst), _b(fstype), flags, _b(data)),
           f"mount {src or fstype} on {dst}")


def prctl(op, arg):
    _check(libc.prctl(op, arg, 0, 0, 0), f"prctl({op})")


def bind(src, dst, readonly=True, extra=MS_NOSUID | MS_NODEV):
    mount(src, dst, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | extra | (MS_RDONLY if readonly else 0)
    have = os.statvfs(src).f_flag  # keep flags the kernel may have locked on the source
    for st, ms in ST_TO_MS:
        if have & st:
            flags |= ms
    mount(None, dst, None, flags)


def pivot_root(new_root):
    os.chdir(new_root)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(0, f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _write(path, text, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def build_root(plan):
    root = plan["stage"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    os.umask(0o022)
    for link, target in plan["symlinks"]:
        parent = os.path.dirname(root + link)
        os.makedirs(parent, 0o755, exist_ok=True)
        os.symlink(target, root + link)
    for src, dst in plan["ro_binds"]:
        inside = root + dst
        if os.path.isdir(src):
            os.makedirs(inside, 0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
            _write(inside, "")
        bind(src, inside)
    os.makedirs(root + "/etc", 0o755, exist_ok=True)
    for name, text in plan["etc"].items():
        _write(f"{root}/etc/{name}", text)
    dev = root + "/dev"
    os.makedirs(dev, 0o755, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + name):
            _write(f"{dev}/{name}", "", 0o666)
            bind("/dev/" + name, f"{dev}/{name}", readonly=False, extra=MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/proc", 0o555, exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READONLY:  # as bwrap: global knobs stay read-only whoever the uid maps to
        path = f"{root}/proc/{name}"
        if os.path.exists(path):
            bind(path, path, readonly=True, extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp", 0o755, exist_ok=True)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"mode=0700,uid={plan['uid']},gid={plan['gid']},size={plan['scratch_mb']}m")
    pivot_root(root)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def init(plan, ctl, rep):
    """pid 1 of the new pid namespace: build the root, drop privilege, exec stage 2 (which
    forks the program's process and stays as the init: `_stage2.py`)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        build_root(plan)
        host = b"sandbox"
        _check(libc.sethostname(host, len(host)), "sethostname")
        if not plan["userns"] and plan.get("zygote") is None:
            os.setgroups([])
            os.setresgid(plan["gid"], plan["gid"], plan["gid"])
            os.setresuid(plan["uid"], plan["uid"], plan["uid"])
        if plan.get("zygote") is not None:
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            zygote(plan, ctl, rep, plan["zygote"])  # never returns
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the uid change: set after it
        os.chdir("/tmp")
        ctl2, rep2 = os.dup(ctl), os.dup(rep)
        os.dup2(ctl2, 3)
        os.dup2(rep2, 4)
        os.set_inheritable(3, True)  # dup2(fd, fd) when dup() gave 3 or 4 keeps FD_CLOEXEC
        os.set_inheritable(4, True)
        os.closerange(5, 1 << 16)
        spec = {"ctl": 3, "rep": 4, "limits": plan["limits"], "drop": None}
        exe = plan["python"]
        os.execve(exe, [exe, "-I", "-S", "-c", plan["stage2"], marshal.dumps(spec).hex()],
                  plan["env"])
    except BaseException as e:  # noqa: BLE001 - report every failure to the host
        try:
            os.write(ctl, f"F sandbox set-up failed: {e}\n".encode()[:2000])
        finally:
            os._exit(127)


# ------------------------------------------------------------------ the zygote (sandbox.zygote)
# Modules a program is likely to import, imported once by the zygote so that no program pays
# for them. Each program is a fork: it starts with them as fresh as the zygote left them (the
# zygote never runs program code). Only modules built into the interpreter or pure Python, and
# math: every shared library the zygote maps makes each fork and exit dearer (~0.7 ms per call
# for json, decimal, statistics and the like on a 2-core VM).
PRELOAD = ("math", "re", "collections", "functools", "itertools", "operator", "string")
# What the zygote and a program's init (before its uid drop) use: signalling an init that runs
# under the program's uid, the uid and group changes, namespaces and mounts. Nothing else, in
# any set, bounding set included.
ZYGOTE_CAPS = (5, 6, 7, 21)  # CAP_KILL, CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN
PR_CAPBSET_DROP = 24
PER_PROGRAM = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS  # + a pid namespace


def zygote(plan, ctl, rep, sock_fd):
    """The init as the zygote (never returns). It keeps its privileges inside the namespaces
    (no program does), imports stage 2 and PRELOAD once, says R on CTL, then serves SOCK (a
    unix SEQPACKET socket to the host). A request is `marshal {uid, gid}` with five
    descriptors: code, output, ctl, rep, life. For each, the zygote forks the program's init
    as pid 1 of a new pid namespace (`program_init`) and acts as its outer process: it reports
    the init's end as `W <status>` on rep, and SIGKILLs the init (which ends the namespace and
    everything in it) when the host closes life. At the socket's end of file it lets the
    programs in flight end, then exits; its own pid namespace (every program) ends with it."""
    import fcntl
    import gc
    import select
    import socket
    import types

    os.environ.clear()
    os.environ.update(plan["env"])  # what every program inherits: nothing of the host
    stage2 = types.ModuleType("_stage2")
    exec(compile(plan["stage2"], "_stage2", "exec"), stage2.__dict__)
    for name in PRELOAD:
        __import__(name)
    stage2.prepare()
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    # CTL, REP, SOCK, this pid namespace as 3-6 and nothing else open, so that a request's
    # descriptors arrive above the program's 0-4
    pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in (ctl, rep, sock_fd, pid_ns)]
    for fd, to in zip(high, (3, 4, 5, 6)):
        os.dup2(fd, to, inheritable=False)
    os.closerange(7, 1 << 16)
    keep_capabilities(ZYGOTE_CAPS)
    sock = socket.socket(fileno=5)
    gc.freeze()  # the forks' garbage collector then leaves the zygote's objects (and pages) alone
    os.write(3, b"R\n")
    poller = select.poll()
    poller.register(5, select.POLLIN)
    by_pidfd, by_life = {}, {}  # fd -> [pid, pidfd, rep, life]
    serving = True
    while serving or by_pidfd:
        for fd, _ in poller.poll():
            if fd == 5:
                try:
                    msg, fds, _, _ = socket.recv_fds(sock, 4096, 5)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the host closed the zygote: let the runs in flight end
                    serving = False
                    poller.unregister(5)
                    sock.close()
                    continue
                entry = start_program(plan, stage2, marshal.loads(msg), fds)
                if entry is not None:
                    by_pidfd[entry[1]], by_life[entry[3]] = entry, entry
                    poller.register(entry[1], select.POLLIN)
                    poller.register(entry[3], select.POLLIN)
            elif fd in by_life:  # life readable: the host closed it (or wrote): kill
                entry = by_life.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                entry[3] = -1
                try:
                    os.kill(entry[0], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            elif fd in by_pidfd:  # the program's init ended
                pid, pidfd, rep_w, life_r = by_pidfd.pop(fd)
                poller.unregister(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    os.write(rep_w, f"W {status}\n".encode())
                except OSError:
                    pass
                for x in (pidfd, rep_w):
                    os.close(x)
                if life_r >= 0:
                    poller.unregister(life_r)
                    by_life.pop(life_r, None)
                    os.close(life_r)
    os._exit(0)


def start_program(plan, stage2, req, fds):
    """Fork one program's init in a new pid namespace; [pid, pidfd, rep, life] or None (the
    failure was reported on the request's rep)."""
    if len(fds) != 5:
        for fd in fds:
            os.close(fd)
        return None
    code_r, out_w, ctl_w, rep_w, life_r = fds
    try:
        _check(libc.unshare(CLONE_NEWPID), "unshare")  # for the next child only
        pid = os.fork()
        if pid == 0:
            program_init(plan, stage2, req, code_r, out_w, ctl_w, rep_w)
        _check(libc.setns(6, CLONE_NEWPID), "setns")  # children back in the zygote's own
        pidfd = os.pidfd_open(pid)
    except BaseException as e:  # noqa: BLE001 - report every failure to the host
        try:
            os.write(rep_w, f"F sandbox set-up failed: {e}\n".encode()[:2000])
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        return None
    for fd in (code_r, out_w, ctl_w):
        os.close(fd)
    return [pid, pidfd, rep_w, life_r]


def program_init(plan, stage2, req, code_r, out_w, ctl_w, rep_w):
    """pid 1 of the program's own pid namespace (never returns): its own mount, network, ipc
    and uts namespaces, a fresh /proc (pids only where the kernel has `subset=pid`, else with
    its global knobs read-only) and an empty /tmp, the program's uid, no capabilities, then
    stage 2 as in the one-shot path (rlimits, seccomp, the init's fork, the program)."""
    try:
        for fd, to in ((code_r, 0), (out_w, 1), (out_w, 2), (ctl_w, 3), (rep_w, 4)):
            if fd < 7:
                raise OSError(0, f"descriptor {fd} would be overwritten")
            os.dup2(fd, to)
        os.closerange(5, 1 << 16)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _check(libc.unshare(PER_PROGRAM), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        try:
            mount("proc", "/proc", "proc", proc_flags, "subset=pid")
        except OSError:  # before Linux 5.8: the whole /proc, its global knobs read-only
            mount("proc", "/proc", "proc", proc_flags)
            for name in PROC_READONLY:
                path = "/proc/" + name
                if os.path.exists(path):
                    bind(path, path, readonly=True, extra=proc_flags)
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
              f"mode=0700,uid={req['uid']},gid={req['gid']},size={plan['scratch_mb']}m")
        if not plan["userns"]:
            os.setgroups([])
            os.setresgid(req["gid"], req["gid"], req["gid"])
            os.setresuid(req["uid"], req["uid"], req["uid"])
        drop_capabilities()  # a user namespace's uid keeps them through setresuid: clear
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the uid change: set after it
        os.chdir("/tmp")
        stage2.confine({"limits": plan["limits"]})
    except BaseException as e:  # noqa: BLE001 - report every failure to the host
        try:
            os.write(3, f"F sandbox set-up failed: {e}\n".encode()[:2000])
        finally:
            os._exit(127)
    stage2.program(3, 4)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_CAP_HEADER = _CapHeader(0x20080522, 0)
_CAP_NONE = (_CapData * 2)()


def drop_capabilities():
    """Empty effective, permitted and inheritable sets (capset, version 3)."""
    _check(libc.capset(ctypes.byref(_CAP_HEADER), _CAP_NONE), "capset")


def keep_capabilities(caps):
    """Drop every capability but `caps` from the bounding set, then keep only `caps` as
    effective and permitted (none inheritable)."""
    for cap in range(64):
        if cap in caps:
            continue
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                break
            _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")
    mask = sum(1 << cap for cap in caps)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = mask
    _check(libc.capset(ctypes.byref(_CAP_HEADER), data), "capset")


def main():
    plan = marshal.loads(bytes.fromhex(sys.argv[1]))
    ctl, rep = plan["ctl"], plan["rep"]
    child = 0

    def on_term(signum, frame):
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if plan["nice"]:
        os.nice(plan["nice"])  # this process and all it starts: the sandbox, the zygote's forks
    if plan.get("cpus"):
        os.sched_setaffinity(0, plan["cpus"])  # the same: the job's cores, not the host's own
    try:
        if plan.get("pdeathsig", True):
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != plan["host_pid"]:
            os._exit(1)  # the host is already gone
        flags = (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
                 | CLONE_NEWCGROUP)
        if plan["userns"]:
            flags |= CLONE_NEWUSER
        uid, gid = os.geteuid(), os.getegid()
        _check(libc.unshare(flags), "unshare")
        if plan["userns"]:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{plan['uid']} {uid} 1\n")
            _write("/proc/self/gid_map", f"{plan['gid']} {gid} 1\n")
    except OSError as e:
        os.write(rep, f"F the kernel refused namespaces: {e}\n".encode())
        os._exit(2)
    pid = os.fork()
    if pid == 0:
        init(plan, ctl, rep)
    child = pid
    os.close(ctl)
    if plan.get("zygote") is not None:
        os.close(plan["zygote"])  # the zygote's death must close its socket at once
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # only the sandbox holds the code and output pipes
        os.dup2(null, fd)
    os.write(rep, f"P {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    os.write(rep, f"W {status}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
