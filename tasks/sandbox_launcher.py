"""The sandbox's launcher (tasks/sandbox.py): trusted code that sets the sandbox up, forks, and supervises.

Not imported: run_sandboxed reads this file and runs its text with `python -I -S -c TEXT STATUS_FD CONFIG CMD...`,
so the sandboxed process needs no read access to the checkout. The parent's config (JSON) says which layers to
apply; the child applies the per-process ones and execs CMD, the launcher stays behind as its supervisor.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

status_fd, cfg, cmd = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
os.set_inheritable(status_fd, False)  # a successful exec closes it: the parent then reads nothing
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype, L, U = ctypes.c_long, ctypes.c_long, ctypes.c_ulong


def ok(ret, what):
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret


def fail(e):
    os.write(status_fd, f"{type(e).__name__}: {e}".encode())
    os._exit(126)


def descendants(root):  # pids whose parent chain leads to `root`, from /proc
    parent = {}
    for d in os.listdir("/proc"):
        try:
            parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            pass
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        todo += kids
    return found


def kill_all(child):  # the child, everything that descends from the supervisor, and the cgroup's members
    for _ in range(100):  # repeat: a process may fork while we scan
        victims = {child} | descendants(os.getpid())
        if cfg["cgroup"]:
            try:
                victims |= {int(p) for p in open(os.path.join(cfg["cgroup"], "cgroup.procs")).read().split()}
            except OSError:
                pass
        victims.discard(os.getpid())
        alive = False
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                alive = True
            except OSError:
                pass
        while True:  # reap what we can (we are their parent or subreaper)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not alive:
            return


try:  # --- supervisor: cgroup, namespaces, then fork
    if cfg["cgroup"]:
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    uid, gid = os.geteuid(), os.getegid()
    if cfg["clone"]:
        ok(libc.unshare(ctypes.c_int(cfg["clone"])), "unshare")
        if cfg["clone"] & 0x10000000:  # a user namespace: map our own ids, so files look the same
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    if not cfg["clone"] & 0x20000000:
        ok(libc.prctl(ctypes.c_int(36), U(1), U(0), U(0), U(0)), "PR_SET_CHILD_SUBREAPER")
    supervisor = os.getpid()
    child = os.fork()
except BaseException as e:
    fail(e)

if child:  # --- the supervisor: forwards SIGUSR1 (stack dump), kills everything on SIGTERM and when the child ends
    for fd in cfg["pass_fds"]:
        os.close(fd)
    os.close(status_fd)
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(child, signal.SIGUSR1))
    signal.signal(signal.SIGTERM, lambda *_: (kill_all(child), os._exit(137)))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(126)
        if pid == child:
            break
    kill_all(child)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))

try:  # --- the child: per-process layers, then exec
    ok(libc.prctl(ctypes.c_int(1), U(signal.SIGKILL), U(0), U(0), U(0)), "PR_SET_PDEATHSIG")  # dies with its supervisor
    if os.getppid() != supervisor and not cfg["clone"] & 0x20000000:
        os._exit(137)
    ok(libc.prctl(ctypes.c_int(38), U(1), U(0), U(0), U(0)), "PR_SET_NO_NEW_PRIVS")  # no exec regains privileges
    abi = cfg["landlock_abi"]
    if abi:  # landlock_create_ruleset = 444, landlock_add_rule = 445, landlock_restrict_self = 446 (all arches)
        fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every fs right this ABI knows
        size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct grew: fs rights, then net rights, then scopes
        attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
        ruleset = ok(libc.syscall(L(444), attr, L(len(attr)), L(0)), "landlock_create_ruleset")
        for path, access in cfg["rules"]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            if not os.path.isdir(path):
                access &= 1 | 2 | 4 | 1 << 14 | 1 << 15  # the rights a single file can carry
            ok(libc.syscall(L(445), L(ruleset), L(1), struct.pack("=Qi", access & fs, fd), L(0)), f"add_rule {path}")
            os.close(fd)
        ok(libc.syscall(L(446), L(ruleset), L(0)), "landlock_restrict_self")
    if cfg["seccomp"]:  # [arch, socket nr]: socket() and io_uring_setup -> EACCES; so are x32 and foreign-ABI calls
        arch, nr_socket = cfg["seccomp"]
        deny, allow = 0x00050000 | 13, 0x7FFF0000
        prog = [
            (0x20, 0, 0, 4),
            (0x15, 1, 0, arch),
            (0x06, 0, 0, deny),
            (0x20, 0, 0, 0),
            (0x35, 3, 0, 0x40000000),
            (0x15, 2, 0, 425),
            (0x15, 1, 0, nr_socket),
            (0x06, 0, 0, allow),
            (0x06, 0, 0, deny),
        ]
        filt = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
        fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(filt))
        ok(libc.prctl(ctypes.c_int(22), U(2), ctypes.c_char_p(fprog), U(0), U(0)), "seccomp")
    if cfg["drop_caps"]:  # no privilege left: permitted = effective = {} (and no_new_privs keeps it so)
        for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
            libc.prctl(ctypes.c_int(24), U(cap), U(0), U(0), U(0))  # PR_CAPBSET_DROP; needs CAP_SETPCAP: best effort
        ok(libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)), "capset")
    for name, (soft, hard) in cfg["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):
            if sys.platform.startswith("linux"):
                raise
    os.execvp(cmd[0], cmd)
except BaseException as e:
    fail(e)
