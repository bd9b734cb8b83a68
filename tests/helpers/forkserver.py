"""A fork server for the integration tests' launches: one process per pytest worker imports
torch, vLLM and torchtitan_rl once, and every rank (and plain process) the tests launch is
forked from it instead of importing them again.

A rank spends 13 CPU-s importing before its first line of work, and a 2-rank one-step RL
world 29 CPU-s in all (measured, tests/README.md): imports were most of a short world.

    server: python -m helpers.forkserver --serve SOCKET
    client: tests/helpers/forked [-u] (-m MODULE | -c CODE | SCRIPT) ARGS...

The client takes the place of `python` under `torchrun --no-python` (helpers/launch.py), so
torchrun, its rendezvous and each rank's environment are real; only the interpreter start
differs. The client sends its argv, environment, working directory and stdin, stdout and
stderr to the server, which forks a child that takes them and runs the module or script as
`python` would (`__main__`, sys.argv, sys.path from PYTHONPATH, SystemExit, exit hooks). The
client forwards the signals a launcher sends (torchrun's SIGTERM, a test's SIGINT) to the
child, and exits as the child did (its code, or killed by its signal). The child dies when its
client does (SIGKILL included: it watches the connection).

A multiprocessing child that a forked process spawns (a disaggregated rank's engine) is
forked the same way: the child sets multiprocessing's executable to the client, which passes
the pipes its parent handed it on to the server's child, at the same numbers.

What the server imported was imported with its environment. A launch whose environment
differs in a variable read at import time (VLLM_*, TORCH*, OMP_*, PYTHON*, ...), whose
PYTHONPATH adds a directory shadowing a module already imported, or which passes `python`
options other than -u and -B, is not forked: the client runs `python` itself.
"""

import array
import json
import os
import signal
import socket
import sys

SOCKET = "TTRL_FORKSERVER"  # the server's socket, in the launch's environment
PYTHON = "TTRL_FORKSERVER_PYTHON"  # the interpreter for a launch that is not forked
# What the server imports before it forks: what a rank imports before its first step, but
# `datasets` (through torchtitan.trainer), whose import starts a thread (pyarrow's).
PRELOAD = (
    "torchtitan_rl.train",
    "torchtitan_rl.sft",
    "torchtitan_rl.generator.vllm_model",
    "torchtitan_rl.generator.engine_build",
    "torchtitan_rl.loop",
    "torchtitan_rl.placements.colocated",
    "torchtitan_rl.weight_sync.broadcast",
    "torchtitan_rl.weight_sync.local",
    "torchtitan.components.dataloader",
    "torchtitan.components.metrics",
    "torch.utils.tensorboard",
    "torch._inductor.compile_fx",
    "torch.export",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.compilation.backends",
    "vllm.renderers.hf",
    "matplotlib.pyplot",
    "PIL.PngImagePlugin",
)
# Read when imported (by torch, vLLM, OpenMP, transformers, the interpreter): a launch that
# sets them otherwise than the server is not forked.
IMPORT_TIME = (
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TRITON_",
    "CUDA_",
    "LD_",
    "PYTHON",
)
# Set by torchrun for each rank, or by the fork server itself, and read at run time.
RUN_TIME = (
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "TORCHTITAN_RL_",  # this project's own (a test's calls file)
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "VLLM_WORKER_MULTIPROC_METHOD",  # set by vLLM's CPU platform at an engine's build, read then
    SOCKET,
)
MAX_FDS = 64  # stdio and what a launch's parent passed on
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def _send(conn: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


def _receive(conn: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One newline-ended JSON message (None at EOF) and the fds that came with its first part."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        if want_fds and not fds:
            part, fds, _, _ = socket.recv_fds(conn, 1 << 20, want_fds)
            fds = list(fds)
        else:
            part = conn.recv(1 << 20)
        if not part:
            return None, fds
        data += part
    return json.loads(data), fds


def _python_argv(argv: list[str]) -> tuple[bool, tuple[str, str], list[str]] | None:
    """`python ARGV` as (unbuffered, ("module" | "code" | "script", its name or text), the
    program's arguments); None for options the fork server does not reproduce."""
    unbuffered = False
    while argv and argv[0] in ("-u", "-B"):  # -B: multiprocessing's spawn passes it on
        unbuffered, argv = unbuffered or argv[0] == "-u", argv[1:]
    if len(argv) >= 2 and argv[0] in ("-m", "-c"):
        kind = "module" if argv[0] == "-m" else "code"
        return unbuffered, (kind, argv[1]), argv[2:]
    if argv and not argv[0].startswith("-"):
        return unbuffered, ("script", argv[0]), argv[1:]
    return None


# The server.

_base_path_of_server: list[str] = []  # set once PRELOAD is imported
_environ_of_server: dict[str, str] = {}  # as it was before (importing vLLM sets variables)
_set_by_imports: dict[str, str] = {}  # the variables importing PRELOAD set, as a rank's would


def _pythonpath(env) -> list[str]:
    """The entries of an environment's PYTHONPATH."""
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _base_path() -> list[str]:
    """This interpreter's sys.path without its first entry and its PYTHONPATH's."""
    return sys.path[1 + len(_pythonpath(os.environ)) :]


def _why_not(request: dict) -> str | None:
    """Why a launch cannot be forked from this server (None: it can)."""
    if _python_argv(request["argv"]) is None:
        return f"python options {request['argv'][:2]}"
    env, ours = request["env"], _environ_of_server
    for key in set(env) ^ set(ours) | {k for k in env if env[k] != ours.get(k)}:
        # What the imports set is in the environment of a process that was forked from here
        # (a multiprocessing child's parent), or not yet.
        if key in _set_by_imports and env.get(key) in (None, _set_by_imports[key]):
            continue
        if key.startswith(IMPORT_TIME) and not key.startswith(RUN_TIME):
            return f"{key} differs"
    ours, theirs = _pythonpath(ours), _pythonpath(env)
    extra = theirs[: len(theirs) - len(ours)]
    if theirs[len(extra) :] != ours:
        return "PYTHONPATH differs"
    loaded = {name.partition(".")[0] for name in sys.modules}
    for folder in extra:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        shadowed = loaded & {n.removesuffix(".py") for n in names}
        if shadowed:
            return f"PYTHONPATH's {folder} holds {sorted(shadowed)[0]}, already imported"
    return None


def _take_fds(conn: socket.socket, fds: list[int], numbers: list[int]) -> socket.socket:
    """In the child: the client's fds at the numbers they had there (stdio, and those its
    parent passed on: a multiprocessing child's pipes), out of the way of `conn`, which is
    returned at a number none of them takes."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    if conn.fileno() in numbers:
        conn = socket.socket(fileno=fcntl.fcntl(conn.detach(), fcntl.F_DUPFD_CLOEXEC, 1024))
    for fd, number in zip(high, numbers, strict=True):
        os.dup2(fd, number)  # inheritable, as in the client
        os.close(fd)
    return conn


def _exit_code(error: SystemExit) -> int:
    """What `python` exits with for an uncaught SystemExit."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run(request: dict, conn: socket.socket) -> int:
    """In the forked child: become the launched process, run its program, return its exit
    code (or die of the signal that killed it)."""
    import atexit
    import importlib
    import multiprocessing
    import runpy
    import threading

    unbuffered, (kind, target), args = _python_argv(request["argv"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **_set_by_imports})
    extra = _pythonpath(request["env"])
    first = "" if kind == "code" else os.getcwd()
    if kind == "script":
        first = os.path.dirname(os.path.realpath(target))
    sys.path[:] = [first, *extra, *_base_path_of_server]
    importlib.invalidate_caches()
    sys.argv = [{"module": target, "code": "-c", "script": target}[kind], *args]
    sys.orig_argv = [request["python"], *request["argv"]]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=unbuffered or stream is sys.stderr, write_through=True)

    def watch() -> None:  # the client's end closes when it exits or is killed
        while conn.recv(1 << 16):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    # multiprocessing's spawned children (a disaggregated rank's engine) come from here too:
    # its command line `-B -c "...spawn_main(...)" --multiprocessing-fork` and the pipes it
    # passes reach the child as a launch's do (_take_fds).
    multiprocessing.set_executable(os.path.join(os.path.dirname(__file__), "forked"))
    try:
        if kind == "module":
            sys.modules.pop(target, None)  # run as __main__ only, as in a fresh interpreter
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "script":
            runpy.run_path(target, run_name="__main__")
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - printed as python prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # as the interpreter ends: its threads, then the exit hooks
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def serve(path: str) -> None:
    """Listen on `path` at once (clients wait in its backlog), import PRELOAD, then fork a child
    for each launch and report its end to its client."""
    import gc
    import importlib
    import select

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _environ_of_server.update(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # Inductor's cache key hashes triton's sources once per process (0.5 s): once, here.
    from torch._inductor.codecache import torch_key
    from triton.runtime.cache import triton_key

    torch_key(), triton_key()
    threads = len(os.listdir("/proc/self/task"))  # a child gets the forking thread alone
    assert threads == 1, f"importing {PRELOAD} started {threads - 1} threads: fork is unsafe"
    _base_path_of_server[:] = _base_path()
    _set_by_imports.update({k: v for k, v in os.environ.items() if _environ_of_server.get(k) != v})
    # What the imports made, out of every child's garbage collections: a full pass over it
    # took 1-2 s in a child (750,000 objects), and its writes to each object copied the
    # server's pages into the child. The launches' runs collect several times (vLLM's build
    # and profile run, LocalGenerator, shutdown_distributed); a python process pays those
    # passes, which a forked one now skips.
    gc.collect()
    gc.freeze()
    clients: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = clients.pop(pid)
            try:
                _send(conn, {"status": status})
            except OSError:
                pass  # its client is gone
            conn.close()
        if not ready:
            continue
        conn, _ = listener.accept()
        request, fds = _receive(conn, want_fds=MAX_FDS)
        why = "no request" if request is None else _why_not(request)
        if why is not None:
            print(f"not forked ({why}): {request and request['argv'][:3]}", flush=True)
            _send(conn, {"exec": why})
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                listener.close()
                os.setsid()
                conn = _take_fds(conn, fds, [0, 1, 2, *request["fds"]])
                code = _run(request, conn)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _send(conn, {"pid": pid})
        clients[pid] = conn


# The client.


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:  # the folder's own fd, closed by the listing
        return False


def client(argv: list[str]) -> None:
    """Run `python ARGV` in a child of the fork server; exit as it does."""
    python = os.environ[PYTHON]
    # A rank dies with torchrun (platform.die_with_launcher), a multiprocessing child with
    # its parent (platform.die_with_parent); the server's child, with this client.
    if "TORCHELASTIC_RUN_ID" in os.environ or "--multiprocessing-fork" in argv:
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            sys.exit(1)
    # What the parent passed on besides stdio (multiprocessing's pipes): the server's child
    # gets them at the same numbers.
    passed = [
        fd for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")) if fd > 2 and _is_open(fd)
    ]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    request = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "python": python,
        "fds": passed,
    }
    try:
        conn.connect(os.environ.get(SOCKET, ""))
        _send(conn, request, fds=(0, 1, 2, *passed))
        reply, _ = _receive(conn)
    except OSError:  # no server (it failed: its log says why)
        reply = None
    if reply is None or "exec" in reply:
        conn.close()
        os.execv(python, [python, *argv])
    for fd in passed:  # the child holds them now: a pipe's end closes when it exits
        os.close(fd)
    pid = reply["pid"]

    def forward(number: int, _) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass  # it has ended: its status is on the way

    for sig in FORWARDED:
        signal.signal(sig, forward)
    reply, _ = _receive(conn)
    if reply is None:  # the server died
        sys.exit(1)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
