"""The seccomp filter of the namespaces backend, compiled once per process to the BPF bubblewrap loads.

Everything is allowed except what a numerics snippet never needs and an escape always does: socket
creation, process creation (``fork``/``vfork``, ``clone`` without ``CLONE_THREAD``; ``clone3`` answers
ENOSYS so libc falls back to the checkable ``clone``), tracing and other processes' memory, mounts and
namespaces, BPF, keyrings, perf, io_uring, kernel modules, handle-based opens, System V and POSIX IPC,
and the clock and host identity. Refused calls fail with EPERM, so the model reads a Python
``PermissionError``; calls from a foreign ABI (x32, i386) kill the process (libseccomp's bad-arch action).
"""

from __future__ import annotations

import errno
import functools
import tempfile

from osvl.tools.sandbox.config import SandboxUnavailable

CLONE_THREAD = 0x00010000

DENIED_SYSCALLS = (
    # network
    "socket",
    "socketpair",
    # processes
    "fork",
    "vfork",
    # other processes and the kernel's view of them
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    # file systems and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    # kernel attack surface
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "lookup_dcookie",
    "syslog",
    "iopl",
    "ioperm",
    "personality",
    "quotactl",
    "acct",
    # the host
    "reboot",
    "swapon",
    "swapoff",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    # shared memory and message queues (private to the IPC namespace anyway)
    "shmget",
    "shmat",
    "msgget",
    "semget",
    "mq_open",
)


@functools.cache
def seccomp_program() -> bytes:
    """The filter as BPF bytes for ``bwrap --seccomp FD``; ``SandboxUnavailable`` without libseccomp."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as err:  # pyseccomp loads libseccomp.so.2 when imported
        raise SandboxUnavailable(
            f"the seccomp filter needs pyseccomp and libseccomp ({err}); "
            "pip install pyseccomp and apt-get install libseccomp2"
        ) from None
    deny = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            program.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a system call on this architecture (or unknown to this libseccomp)
    program.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as sink:  # libseccomp writes to a file descriptor
        program.export_bpf(sink)
        sink.seek(0)
        return sink.read()
