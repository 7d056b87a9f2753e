"""The sandbox's system-call allow-list, compiled to a seccomp BPF program by libseccomp.

Everything not listed fails with EPERM; `clone3` fails with ENOSYS (its flags live in memory a
filter cannot read, and glibc falls back to `clone` on ENOSYS); `clone` is allowed only without
namespace flags. So these are refused, whatever the arguments: unshare, setns, clone with
CLONE_NEW*, bpf, perf_event_open, io_uring_setup/enter/register, ptrace, process_vm_readv/writev,
mount, umount2, pivot_root, chroot, the new mount API (open_tree, move_mount, fsopen, fsmount,
fsconfig, fspick, mount_setattr), keyctl/add_key/request_key, userfaultfd, kexec, modules,
reboot, swapon/off, acct, quotactl, syslog, name_to_handle_at/open_by_handle_at, personality,
and setuid-family calls that would only matter to root.

The program is built here, in the parent (which has `pyseccomp`, a ctypes binding of the system's
libseccomp), and handed as bytes to the sandbox's init, which installs it with
prctl(PR_SET_SECCOMP) right before exec: the init stays standard-library only and the code's
interpreter need not have pyseccomp.
"""
from __future__ import annotations

import errno
import os

# Names unknown to libseccomp or to this architecture are skipped (e.g. the *_time64 calls exist
# on 32-bit only, arch_prctl on x86 only).
ALLOWED_SYSCALLS = tuple("""
accept accept4 access alarm arch_prctl bind brk
clock_getres clock_getres_time64 clock_gettime clock_gettime64 clock_nanosleep clock_nanosleep_time64
close close_range connect copy_file_range creat dup dup2 dup3
epoll_create epoll_create1 epoll_ctl epoll_pwait epoll_pwait2 epoll_wait eventfd eventfd2
execve execveat exit exit_group faccessat faccessat2 fadvise64 fallocate
fchdir fchmod fchmodat fchmodat2 fchown fchownat fcntl fdatasync fgetxattr flistxattr flock fork
fremovexattr fsetxattr fstat fstatfs fsync ftruncate futex futex_requeue futex_wait futex_waitv futex_wake
futimesat get_mempolicy get_robust_list getcpu getcwd getdents getdents64 getegid geteuid getgid
getgroups getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid
getresuid getrlimit getrusage getsid getsockname getsockopt gettid gettimeofday getuid getxattr
inotify_add_watch inotify_init inotify_init1 inotify_rm_watch ioctl ioprio_get kill
lchown lgetxattr link linkat listen listxattr llistxattr lremovexattr lseek lsetxattr lstat
madvise mbind membarrier memfd_create mincore mkdir mkdirat mmap mprotect mremap msync munmap
nanosleep newfstatat open openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2 poll ppoll prctl
pread64 preadv preadv2 prlimit64 pselect6 pwrite64 pwritev pwritev2
read readahead readlink readlinkat readv recvfrom recvmmsg recvmsg remap_file_pages
rename renameat renameat2 restart_syscall rmdir rseq
rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait
rt_tgsigqueueinfo sched_get_priority_max sched_get_priority_min sched_getaffinity sched_getattr
sched_getparam sched_getscheduler sched_rr_get_interval sched_setaffinity sched_yield select
semctl semget semop semtimedop sendfile sendmmsg sendmsg sendto set_mempolicy set_robust_list
set_tid_address setitimer setpgid setpriority setrlimit setsid setsockopt shutdown sigaltstack
socket socketpair splice stat statfs statx symlink symlinkat sync sync_file_range syncfs sysinfo
tee tgkill time timer_create timer_delete timer_getoverrun timer_gettime timer_settime
timerfd_create timerfd_gettime timerfd_settime times tkill truncate umask uname unlink unlinkat
utime utimensat utimes vfork wait4 waitid write writev
""".split())

# clone(2) flags that create namespaces (CLONE_NEWTIME shares its bit with the exit signal in
# clone's first argument and is only reachable through clone3/unshare, both refused).
CLONE_NEW_MASK = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
                  | 0x40000000)


def build_program() -> bytes:
    """The compiled filter (struct sock_filter[]). Raises ImportError/OSError without libseccomp."""
    import pyseccomp as sc  # noqa: PLC0415 — optional at import time; the caller reports its absence

    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    arch = sc.system_arch()
    for name in ALLOWED_SYSCALLS:
        if sc.resolve_syscall(arch, name) < 0:
            continue  # not a system call on this architecture
        f.add_rule(sc.ALLOW, name)
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEW_MASK, 0))
    if sc.resolve_syscall(arch, "clone3") >= 0:
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    fd = os.memfd_create("laminar-seccomp")
    try:
        with os.fdopen(os.dup(fd), "rb") as r:
            f.export_bpf(r)
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(fd, "rb", closefd=False) as r:
            prog = r.read()
    finally:
        os.close(fd)
    if not prog or len(prog) % 8:
        raise OSError(errno.EINVAL, f"libseccomp exported a malformed program ({len(prog)} bytes)")
    return prog
