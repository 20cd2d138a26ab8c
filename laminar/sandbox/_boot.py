"""Start one `unshare` sandbox: `python -I -S _boot.py PLAN` (standard library only; PLAN is
marshal data in hex: importing json would cost ~7 ms of start-up).

Run by the host (laminar/sandbox/proc.py) with a clean environment, stdin = the code pipe,
stdout = stderr = the output pipe, and two more pipes: CTL (to the host, shared with the
sandbox: `R` ready, `E <line>` the program's exception, `F <why>` set-up failed) and REP
(this outer process and the sandbox's init only: `P <pid>` the init's host pid, `X <wait
status>` the program's end as its init saw it, `W <wait status>` the init's end).

The outer process (this one, in the host's namespaces):
  1. PR_SET_PDEATHSIG(SIGTERM): it ends with the host thread that started it;
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
        if not plan["userns"]:
            os.setgroups([])
            os.setresgid(plan["gid"], plan["gid"], plan["gid"])
            os.setresuid(plan["uid"], plan["uid"], plan["uid"])
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
    try:
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
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # only the sandbox holds the code and output pipes
        os.dup2(null, fd)
    os.write(rep, f"P {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    os.write(rep, f"W {status}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
