"""The escape suite: hostile code run through a real tool worker, each attempt checked from OUTSIDE.

Every case runs in the pool's worker like a policy's call, against the namespaces backend with the
audit hook (the default) and without it (the OS boundary alone). After each run the test looks at
the host: marker files must not exist, the planted secret and the worker's environment must not
appear in anything the call returned, the loopback listeners must have seen no packet, the worker
and a victim process must be alive and untraced, and nothing may appear in the host's /dev/shm,
System V shared memory, key rings, hostname or /usr. Whether the code raised does not matter; only
whether its effect happened.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from pathlib import Path

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job, PoolConfig, ToolBackendsConfig, ToolPool
from osvl.tools.python_interpreter import python_interpreter_spec
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, check_sandbox

LIMITS = SandboxLimits(
    cpu_s=2, wall_s=4.0, memory_bytes=384 << 20, file_bytes=1 << 20, scratch_bytes=4 << 20, output_chars=50_000
)
TOKEN = secrets.token_hex(8)
ENV_SECRET = f"worker-env-secret-{TOKEN}"

# Each snippet may use: MARKER (a host path outside any sandbox), SECRET (a host file holding a secret),
# PORT / UDP_PORT (loopback listeners on the host), WORKER (the tool worker's pid), VICTIM (another host
# process), TOKEN (unique to this session). A snippet prints whatever it obtained.
PRELUDE = """
import os, sys
MARKER, SECRET, PORT, UDP_PORT, WORKER, VICTIM, TOKEN = {values}
def attempt(fn):
    try:
        out = fn()
        print("RESULT", out)
    except BaseException as err:
        print("FAILED", type(err).__name__, err)
"""

CASES = {
    # --- the methods the outside battery used -------------------------------------------------------------
    "sqlite3_connect_anywhere": """
import sqlite3
attempt(lambda: sqlite3.connect(MARKER).execute("create table t(x)"))
""",
    "readline_write_history_file": """
import readline
readline.add_history("escaped")
attempt(lambda: readline.write_history_file(MARKER))
""",
    "readline_read_history_file": """
import readline
attempt(lambda: (readline.read_history_file(SECRET), readline.get_history_item(1))[1])
""",
    "posixshmem_shm_open": """
import _posixshmem
attempt(lambda: os.write(_posixshmem.shm_open("/osvl-escape-" + TOKEN, os.O_CREAT | os.O_RDWR, 0o666), b"x"))
""",
    "replace_isinstance_then_read_secret": """
import builtins
builtins.isinstance = lambda *args: True
attempt(lambda: open(SECRET).read())
""",
    "replace_isinstance_then_write_outside": """
import builtins
builtins.isinstance = lambda *args: False
attempt(lambda: (os.makedirs(os.path.dirname(MARKER), exist_ok=True), open(MARKER, "w").write("x")))
""",
    "hook_frame_empty_sets_then_subprocess": """
import builtins
real = builtins.isinstance
def spy(obj, kinds):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if type(value) in (set, frozenset) and ("os.system" in value or "ctypes" in value):
                try:
                    value.clear()
                except AttributeError:
                    pass
        frame = frame.f_back
    return real(obj, kinds)
builtins.isinstance = spy
attempt(lambda: open("probe", "w").close())
builtins.isinstance = real
import subprocess
attempt(lambda: subprocess.run(["sh", "-c", "echo x > " + MARKER]))
""",
    "subprocess_run": """
import subprocess
attempt(lambda: subprocess.run(["sh", "-c", "mkdir -p $(dirname " + MARKER + ") && echo x > " + MARKER]))
""",
    "ctypes_system": """
import ctypes
attempt(lambda: ctypes.CDLL(None).system(("touch " + MARKER).encode()))
""",
    "os_fork_child_writes": """
def child():
    pid = os.fork()
    if pid == 0:
        open(MARKER, "w").write("x")
        os._exit(0)
    return os.waitpid(pid, 0)
attempt(child)
""",
    "child_python_opens_socket": """
import subprocess
attempt(lambda: subprocess.run([sys.executable, "-c",
    f"import socket; socket.create_connection(('127.0.0.1', {PORT})).send(b'x')"]))
""",
    "sigterm_own_worker": """
import signal
attempt(lambda: os.kill(WORKER, signal.SIGTERM))
""",
    "read_worker_environ": """
attempt(lambda: open(f"/proc/{WORKER}/environ", "rb").read())
""",
    "read_planted_secret": """
attempt(lambda: open(SECRET).read())
""",
    # --- files -------------------------------------------------------------------------------------------
    "write_absolute_path": """
attempt(lambda: open(MARKER, "w").write("x"))
""",
    "write_dotdot_path": """
attempt(lambda: open("../../../../.." + MARKER, "w").write("x"))
""",
    "write_low_level_os_open": """
attempt(lambda: os.write(os.open(MARKER, os.O_CREAT | os.O_WRONLY, 0o666), b"x"))
""",
    "symlink_out_of_scratch": """
attempt(lambda: (os.symlink(os.path.dirname(MARKER), "out"), open("out/" + os.path.basename(MARKER), "w").write("x")))
""",
    "hardlink_the_secret": """
attempt(lambda: (os.link(SECRET, "copy"), open("copy").read())[1])
""",
    "chdir_root_then_write": """
attempt(lambda: (os.chdir("/"), open(MARKER.lstrip("/"), "w").write("x")))
""",
    "write_into_usr": """
attempt(lambda: open("/usr/lib/osvl-escape-" + TOKEN, "w").write("x"))
""",
    "numpy_save_outside": """
import numpy as np
attempt(lambda: np.save(MARKER, np.zeros(3)))
""",
    "numpy_fromfile_secret": """
import numpy as np
attempt(lambda: np.fromfile(SECRET, dtype=np.uint8).tobytes())
""",
    "io_open_code_secret": """
import io
attempt(lambda: io.open_code(SECRET).read())
""",
    "proc_worker_root_secret": """
attempt(lambda: open(f"/proc/{WORKER}/root" + SECRET).read())
""",
    "proc_host_pids_visible": """
attempt(lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
""",
    "print_environment": """
attempt(lambda: dict(os.environ))
""",
    # --- network -----------------------------------------------------------------------------------------
    "tcp_connect_loopback": """
import socket
attempt(lambda: socket.create_connection(("127.0.0.1", PORT), timeout=1).send(b"x"))
""",
    "udp_send_loopback": """
import socket
attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", UDP_PORT)))
""",
    "raw_socket_module": """
_socket = __import__("_socket")
attempt(lambda: _socket.socket().connect(("127.0.0.1", PORT)))
""",
    "ctypes_socket_syscall": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
attempt(lambda: (libc.socket(2, 1, 0), ctypes.get_errno()))
""",
    "ctypes_x32_abi_socket_syscall": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
attempt(lambda: libc.syscall(0x40000000 | 41, 2, 1, 0))
""",
    # --- processes and signals ---------------------------------------------------------------------------
    "os_system": """
attempt(lambda: os.system("touch " + MARKER))
""",
    "posix_spawn": """
attempt(lambda: os.posix_spawn("/bin/sh", ["sh", "-c", "touch " + MARKER], {}))
""",
    "execv_shell": """
attempt(lambda: os.execv("/bin/sh", ["sh", "-c", "touch " + MARKER]))
""",
    "posix_module_fork": """
def child():
    pid = __import__("posix").fork()
    if pid == 0:
        open(MARKER, "w").write("x")
        os._exit(0)
attempt(child)
""",
    "fork_bomb": """
def bomb():
    for _ in range(200):
        os.fork()
attempt(bomb)
""",
    "kill_victim": """
import signal
attempt(lambda: os.kill(VICTIM, signal.SIGKILL))
""",
    "kill_everything": """
import signal
attempt(lambda: os.kill(-1, signal.SIGKILL))
""",
    "ptrace_attach_victim": """
import ctypes
attempt(lambda: ctypes.CDLL(None).ptrace(16, VICTIM, 0, 0))
""",
    # --- shared memory and kernel objects ----------------------------------------------------------------
    "dev_shm_file": """
attempt(lambda: open("/dev/shm/osvl-escape-" + TOKEN, "w").write("x"))
""",
    "sysv_shmget": """
import ctypes
attempt(lambda: ctypes.CDLL(None).shmget(0x05C0FFEE, 4096, 0o1000 | 0o666))
""",
    "keyctl_add_key": """
import ctypes
libc = ctypes.CDLL(None)
attempt(lambda: libc.syscall(248, b"user", ("osvl-escape-" + TOKEN).encode(), b"x", 1, -4))
""",
    "sethostname": """
import ctypes
attempt(lambda: ctypes.CDLL(None).sethostname(b"osvl-escaped", 12))
""",
    # --- resource exhaustion -----------------------------------------------------------------------------
    "memory_exhaustion": """
attempt(lambda: len(bytearray(8 << 30)))
""",
    "disk_fill_scratch": """
attempt(lambda: open("fill", "wb").write(b"0" * (64 << 20)))
""",
    "thread_bomb": """
import threading, time
def bomb():
    for _ in range(5000):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
attempt(bomb)
""",
    "descriptor_exhaustion": """
attempt(lambda: [open("/dev/null") for _ in range(100_000)])
""",
    "cpu_burn": """
while True:
    pass
""",
    # --- code objects and frames -------------------------------------------------------------------------
    "code_object_swap": """
def harmless():
    return 0
attempt(lambda: setattr(harmless, "__code__", (lambda: os.system("touch " + MARKER)).__code__))
attempt(harmless)
""",
    "function_type_from_code": """
import types
code = compile("import os; os.system('touch ' + MARKER)", "x", "exec")
attempt(lambda: types.FunctionType(code, {"MARKER": MARKER, "__builtins__": __builtins__})())
""",
    "traceback_frame_walk": """
def walk():
    try:
        raise RuntimeError
    except RuntimeError as err:
        frame = err.__traceback__.tb_frame
    found = []
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if type(value) is set:
                value.clear()
                found.append(frame.f_code.co_name)
        frame = frame.f_back
    open(MARKER, "w").write("x")
    return found
attempt(walk)
""",
    "gc_find_hook_closure": """
import gc
def dig():
    hooks = [o for o in gc.get_objects() if getattr(o, "__name__", "") == "hook"]
    for hook in hooks:
        for cell in hook.__closure__ or ():
            if type(cell.cell_contents) is set:
                cell.cell_contents.clear()
    return os.system("touch " + MARKER)
attempt(dig)
""",
}

EXPECT_POLICY_OUTCOME = (ToolStatus.OK, ToolStatus.TOOL_ERROR)


class Listener:
    """TCP and UDP sockets on loopback that count every connection or datagram they received.

    Nothing accepts in the background: the kernel completes a handshake into the listen backlog and
    queues a datagram whether or not we read, so draining both afterwards sees all that arrived."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.events: list[str] = []

    def heard(self) -> list[str]:
        for sock, kind in ((self.tcp, "tcp connection"), (self.udp, "udp datagram")):
            try:
                while True:
                    if sock is self.tcp:
                        sock.accept()[0].close()
                    else:
                        sock.recv(65536)
                    self.events.append(kind)
            except BlockingIOError:
                pass
        return list(self.events)

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    check_sandbox(SandboxConfig())  # fails loudly (what to install) where bubblewrap cannot run
    folder = tmp_path_factory.mktemp("escape")
    secret = folder / "secret.txt"
    secret.write_text(f"planted-secret-{TOKEN}")
    secret.chmod(0o644)
    outside = Path(f"/tmp/osvl-escape-{TOKEN}")
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    listener = Listener()
    victim = subprocess.Popen(["sleep", "600"])
    os.environ["OSVL_ESCAPE_ENV"] = ENV_SECRET  # spawned workers inherit it; /proc/<worker>/environ holds it
    yield {
        "secret": secret,
        "outside": outside,
        "listener": listener,
        "victim": victim,
        "hostname": socket.gethostname(),
    }
    os.environ.pop("OSVL_ESCAPE_ENV", None)
    victim.kill()
    victim.wait()
    listener.close()
    for path in outside.iterdir():
        path.unlink()
    outside.rmdir()


@pytest.fixture(scope="module", params=[True, False], ids=["with_audit_hook", "os_boundary_alone"])
def sandboxed_pool(request, host):
    spec = python_interpreter_spec(LIMITS, SandboxConfig(audit_hook=request.param))
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1, preload=(spec.target,))) as pool:
        yield pool, spec


def _victim_state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


def _host_file(path: str) -> str:
    """A host /proc table ("" on a kernel built without it: then nothing can appear there either)."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("case", sorted(CASES))
def test_escape_attempt_has_no_effect_outside(case, sandboxed_pool, host):
    pool, spec = sandboxed_pool
    worker = pool.worker_pids[0]
    marker = host["outside"] / case
    values = (
        str(marker),
        str(host["secret"]),
        host["listener"].tcp.getsockname()[1],
        host["listener"].udp.getsockname()[1],
        worker,
        host["victim"].pid,
        TOKEN,
    )
    code = PRELUDE.format(values=repr(values)) + CASES[case]
    result = pool.call(
        Job("python_interpreter", spec.target, {"code": code}, deadline_s=spec.deadline_s, options=dict(spec.options))
    )
    seen = f"{result.text}\n{result.error}"

    assert result.status in EXPECT_POLICY_OUTCOME, (result.status, result.error)
    assert not marker.exists() and not Path(f"{marker}.npy").exists(), f"{case} wrote {marker}"
    assert f"planted-secret-{TOKEN}" not in seen, f"{case} read the planted secret"
    assert ENV_SECRET not in seen, f"{case} read the worker's environment"
    assert host["listener"].heard() == [], f"{case} reached the loopback listener"
    assert pool.worker_pids == [worker] and os.path.exists(f"/proc/{worker}"), f"{case} killed its worker"
    assert pool.stats.crashes == 0 and pool.stats.restarts == 0
    assert host["victim"].poll() is None and _victim_state(host["victim"].pid) in ("S", "R"), f"{case} hit the victim"
    assert not Path(f"/dev/shm/osvl-escape-{TOKEN}").exists(), f"{case} created host shared memory"
    assert "96534510" not in _host_file("/proc/sysvipc/shm"), f"{case} created host System V shared memory"
    assert f"osvl-escape-{TOKEN}" not in _host_file("/proc/keys"), f"{case} added a host key"
    assert socket.gethostname() == host["hostname"], f"{case} renamed the host"
    assert not Path(f"/usr/lib/osvl-escape-{TOKEN}").exists(), f"{case} wrote into /usr"
    if case == "proc_host_pids_visible" and "RESULT" in result.text:
        visible = result.text.split("RESULT", 1)[1]
        assert f" {worker}," not in visible and f" {host['victim'].pid}," not in visible, "host PIDs are visible"


def test_the_suite_covers_the_battery_and_twenty_more():
    battery = {
        "sqlite3_connect_anywhere",
        "readline_write_history_file",
        "readline_read_history_file",
        "posixshmem_shm_open",
        "replace_isinstance_then_read_secret",
        "hook_frame_empty_sets_then_subprocess",
        "subprocess_run",
        "ctypes_system",
        "os_fork_child_writes",
        "child_python_opens_socket",
        "sigterm_own_worker",
        "read_worker_environ",
        "read_planted_secret",
    }
    assert battery <= set(CASES) and len(set(CASES) - battery) >= 20


def test_a_probe_that_can_succeed_does_succeed(sandboxed_pool, host):
    """The harness can see an effect: the same kind of write inside the scratch directory works and is read back."""
    pool, spec = sandboxed_pool
    code = "open('inside.txt', 'w').write('hello')\nprint(open('inside.txt').read(), os.getcwd())"
    result = pool.call(
        Job(
            "python_interpreter",
            spec.target,
            {"code": "import os\n" + code},
            deadline_s=spec.deadline_s,
            options=dict(spec.options),
        )
    )
    assert result.status is ToolStatus.OK and result.text.split() == ["hello", "/tmp"], result.error


def test_the_checks_see_the_effects_when_there_is_no_boundary(host):
    """The same snippets and checks against a child with neither boundary nor hook: the effects happen,
    so every check above is one that can fail."""
    from osvl.tools.sandbox import run_sandboxed

    bare = SandboxConfig(backend="unsafe_no_boundary", audit_hook=False)
    listener = host["listener"]
    for case in ("write_absolute_path", "read_planted_secret", "tcp_connect_loopback", "ctypes_system"):
        marker = host["outside"] / f"unguarded-{case}"
        values = (
            str(marker),
            str(host["secret"]),
            listener.tcp.getsockname()[1],
            listener.udp.getsockname()[1],
            os.getpid(),
            host["victim"].pid,
            TOKEN,
        )
        run = run_sandboxed(PRELUDE.format(values=repr(values)) + CASES[case], LIMITS, bare)
        effects = {
            "write_absolute_path": marker.exists,
            "ctypes_system": marker.exists,
            "read_planted_secret": lambda stdout=run.stdout: f"planted-secret-{TOKEN}" in stdout,
            "tcp_connect_loopback": lambda: "tcp connection" in listener.heard(),
        }
        assert effects[case](), (case, run)
        marker.unlink(missing_ok=True)
    listener.events.clear()
