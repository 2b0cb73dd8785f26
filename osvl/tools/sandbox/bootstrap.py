"""The code every local backend runs in the child before the model's code: rlimits, then the audit hook.

The hook (PEP 578) is defence in depth only: it refuses sockets, process creation, signals, rlimit
changes, interpreter introspection and file access outside the scratch directory and the import
roots, so careless code gets a readable refusal. It is a Python-level fence, and Python code can
reach around such fences; the namespaces backend's OS boundary is what actually holds.

The child reads the code on stdin; its arguments are the limits, whether to install the hook, the
import path, and (after ``--``) further readable roots. Everything lives in one function, with the
builtins it needs bound locally, so the model's globals cannot reach or redirect the hook.
"""

from __future__ import annotations

from osvl.tools.sandbox.config import SandboxLimits

VIOLATION_EXIT = 97  # the audit hook's exit status; nothing else in the child uses it

BOOTSTRAP = r"""
def _install():
    import posix, resource, sys
    cpu_s, memory, file_bytes, open_files, processes, hook_on = (int(v) for v in sys.argv[1:7])
    split = sys.argv.index("--")
    roots, extra_roots = sys.argv[7:split], sys.argv[split + 1:]
    for kind, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),
                        (resource.RLIMIT_NOFILE, (open_files, open_files)),
                        (resource.RLIMIT_NPROC, (processes, processes)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(kind, value)
    code = sys.stdin.read()
    sys.path[:] = list(roots)
    if not hook_on:
        return compile(code, "<python_interpreter>", "exec")
    getcwd, lstat, readlink, leave, write = posix.getcwd, posix.lstat, posix.readlink, posix._exit, posix.write
    join, decode, is_a = str.join, bytes.decode, isinstance
    str_, bytes_, int_, any_, tuple_, type_, repr_ = str, bytes, int, any, tuple, type, repr

    def resolve(path):
        # realpath from C functions only: nothing the model's code can monkeypatch
        if path[:1] != "/":
            path = getcwd() + "/" + path
        parts = [p for p in path.split("/") if p and p != "."]
        out, hops = [], 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if out:
                    out.pop()
                continue
            candidate = "/" + "/".join(out + [part])
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                out.append(part)
                continue
            if mode & 0o170000 == 0o120000:
                hops += 1
                if hops > 40:
                    stop("too many symbolic links in " + path)
                target = readlink(candidate)
                if target[:1] == "/":
                    out = []
                parts = [p for p in target.split("/") if p and p != "."] + parts
            else:
                out.append(part)
        return "/" + "/".join(out)

    root = resolve(getcwd())
    readable = tuple_(resolve(p) for p in roots + extra_roots) + (root,)
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_APPEND | posix.O_TRUNC
    refused = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "os.chdir",
        "os.chroot", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.cdata", "ctypes.addressof", "ctypes.call_function", "os.setuid", "os.setgid", "sqlite3.connect",
        "sys._current_frames", "sys.setprofile", "sys.settrace", "code.__new__", "function.__new__",
        "sys.addaudithook", "_posixshmem.shm_open", "mmap.__new__"})
    blocked_modules = frozenset({
        "ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi",
        "faulthandler", "readline", "_posixshmem", "sqlite3", "_sqlite3", "_socket", "socket", "mmap",
        "multiprocessing", "_multiprocessing", "pty", "termios", "fcntl"})
    mutating = frozenset({
        "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
        "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree", "shutil.copyfile", "shutil.copymode",
        "shutil.copystat", "shutil.copytree", "shutil.move"})
    listing = frozenset({"os.listdir", "os.scandir", "glob.glob", "os.walk"})
    function_internals = frozenset({"__code__", "__globals__", "__closure__"})

    def stop(reason):
        write(2, ("\nsandbox violation: " + reason + "\n").encode("utf-8", "replace"))
        leave(97)

    def text(path):
        # only immutable values: a PathLike could answer differently when the real call asks again
        if is_a(path, str_):
            return join("", [path])
        if is_a(path, bytes_):
            return decode(path, "utf-8", "surrogateescape")
        stop("file names must be str or bytes, got " + type_(path).__name__)

    def inside(path, roots):
        real = resolve(text(path))
        return any_(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event.startswith("socket.") or event in refused:
            stop(event + " is not allowed")
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise ImportError("importing " + args[0] + " is not allowed in the sandbox")
        if event == "object.__setattr__" and args[1] in function_internals:
            stop("replacing " + args[1] + " is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or is_a(path, int_):
                return  # an already open descriptor
            writes = (is_a(mode, str_) and any_(c in mode for c in "wax+")) or (
                is_a(flags, int_) and flags & write_flags)
            if writes and not inside(path, (root,)):
                stop("writing " + repr_(path) + " outside the working directory is not allowed")
            if not writes and not inside(path, readable):
                stop("reading " + repr_(path) + " is not allowed")
        elif event in mutating:
            for path in args[:2]:
                if is_a(path, (str_, bytes_)) and not inside(path, (root,)):
                    stop(event + " outside the working directory is not allowed")
        elif event in listing and args and is_a(args[0], (str_, bytes_)) and not inside(args[0], readable):
            stop("listing " + repr_(args[0]) + " is not allowed")

    compiled = compile(code, "<python_interpreter>", "exec")  # before the hook: compile raises events too
    sys.addaudithook(hook)
    return compiled

exec(_install(), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def bootstrap_args(
    limits: SandboxLimits, audit_hook: bool, import_roots: list[str], readable_roots: list[str]
) -> list[str]:
    """``-c BOOTSTRAP`` and its arguments, for the child's interpreter command line."""
    return [
        "-I",
        "-S",
        "-B",
        "-c",
        BOOTSTRAP,
        str(limits.cpu_s),
        str(limits.memory_bytes),
        str(limits.file_bytes),
        str(limits.open_files),
        str(limits.processes),
        "1" if audit_hook else "0",
        *import_roots,
        "--",
        *readable_roots,
    ]
