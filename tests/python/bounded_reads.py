"""Reads and commands under bounds, for the parity of the readers (test_reader_parity.py).

in_child(fn, *args)      fn(*args) in a forked child under TIME_LIMIT_S and MEMORY_LIMIT_BYTES
                         more address space than it had at the fork
run_command(args, cwd)   the k3ref command under TIME_LIMIT_S (4x sanitized) and an address
                         space of MEMORY_LIMIT_BYTES

A fork of the test process costs 30-60 ms (torch is loaded there, and its pages are mapped
into each child and torn down again), the same fork of a process without torch about 10 ms,
and the parity forks some 1,100 children. Server runs this file as a script: a process with
only the safetensors readers imported (NumPy and k3ref._core), which forks the safetensors
reads (both sides) and starts the commands it is sent, one at a time, under the same bounds.
The Python readers that import torch (k3ref.goldens, k3ref.policy) are still forked from the
test process.
"""
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

# A guard against a reader that hangs, not a speed bound: the control files at the readers'
# tensor-count limit (131,072 entries) ran past 5 s in the Python reader while the 2-core
# machine also compiled (a sanitizer build beside the tests).
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_BYTES = 1 << 30
EXE = os.path.abspath(os.environ.get("K3REF_EXE", str(Path(__file__).resolve().parents[2] / "build" / "k3ref")))


def _vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def in_child(fn, *args):
    """fn(*args) in a forked child under TIME_LIMIT_S and 1 GiB more address space: ("ok", summary),
    ("refused", message) for a ValueError (or KeyError, the policy lookup's), or
    ("failed", what) for anything else (another exception, a timeout, a signal)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            limit = _vm_bytes() + MEMORY_LIMIT_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            try:
                result = ["ok", fn(*args)]
            except (ValueError, KeyError) as e:
                message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                message = str(message)
                result = ["refused", message if len(message) <= 4000 else message[:4000] + f"... ({len(message)})"]
            except BaseException as e:  # noqa: BLE001 - the finding
                result = ["failed", f"{type(e).__name__}: {str(e)[:300]}"]
            os.write(write_end, json.dumps(result).encode()[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    start, chunks = time.monotonic(), []
    os.set_blocking(read_end, False)
    while True:
        try:
            chunk = os.read(read_end, 65536)
            if chunk:
                chunks.append(chunk)
        except BlockingIOError:
            pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > TIME_LIMIT_S:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return ("failed", f"ran past {TIME_LIMIT_S:.0f} s")
        time.sleep(0.0005)
    os.set_blocking(read_end, True)
    while True:
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    if os.WIFSIGNALED(status):
        return ("failed", f"killed by signal {os.WTERMSIG(status)}")
    try:
        return tuple(json.loads(b"".join(chunks)))
    except ValueError:
        return ("failed", "the child reported nothing (out of memory?)")


def run_command(args, cwd):
    """(exit code or None, output) of the k3ref command under TIME_LIMIT_S (4x sanitized) and RLIMIT_AS 1 GiB."""
    def limit():
        # An AddressSanitizer build reserves terabytes of shadow address space at start-up, so
        # an address-space limit stops it before main: there the memory bound is ASan's own
        # (its allocator refuses what the machine cannot give), the time bound stays.
        if os.environ.get("K3REF_SANITIZED") != "1":
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        # An instrumented command runs a few times slower (the hostile runner allows it 4x).
        seconds = TIME_LIMIT_S * (4 if os.environ.get("K3REF_SANITIZED") == "1" else 1)
        p = subprocess.run([EXE] + args, cwd=cwd, capture_output=True, timeout=seconds, preexec_fn=limit,
                           env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, b""
    return p.returncode, p.stdout + p.stderr


# ---- the safetensors readers, each in a child ----------------------------------------------

def _summary(tensors, metadata):
    text = json.dumps([[list(t) for t in tensors], sorted(metadata.items())], ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cpp_safetensors(p):
    import k3ref
    r = k3ref._compiled().read_safetensors(str(p))
    return _summary([(n, d, list(s)) for n, d, s in r["tensors"]], r["metadata"])


def _read_py_safetensors(p):
    from k3ref import _safetensors
    f = _safetensors.read(p)
    return _summary([(n, t.dtype, list(t.shape)) for n, t in f.tensors.items()], f.metadata)


def read_cpp_safetensors(path):
    """C++ io::read_safetensors (k3ref._core.read_safetensors) in a child."""
    return in_child(_read_cpp_safetensors, path)


def read_py_safetensors(path):
    """k3ref._safetensors.read in a child."""
    return in_child(_read_py_safetensors, path)


def _run_command_as_text(args, cwd):
    code, output = run_command(args, cwd)
    return code, output.decode("latin-1")  # every byte as one character: JSON carries it back unchanged


SERVED = {"read_cpp_safetensors": read_cpp_safetensors, "read_py_safetensors": read_py_safetensors,
          "run_command": _run_command_as_text}


class Server:
    """This file as a script, started with this process's import path and environment:
    call(name, *args) is SERVED[name](*args) there."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)

    def call(self, name, *args):
        self.proc.stdin.write(json.dumps([name, args]) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the read server ended (exit {self.proc.wait()}) before answering {name}{args}")
        return tuple(json.loads(answer))

    def read_cpp_safetensors(self, path):
        return self.call("read_cpp_safetensors", str(path))

    def read_py_safetensors(self, path):
        return self.call("read_py_safetensors", str(path))

    def run_command(self, args, cwd):
        code, output = self.call("run_command", [str(a) for a in args], str(cwd))
        return code, output.encode("latin-1")

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve():
    # The readers imported once here, so that each forked read does not import them again
    # (_safetensors imports its JSON rules, k3ref._bounded, at its first read).
    import k3ref
    from k3ref import _bounded, _safetensors  # noqa: F401
    try:
        k3ref._compiled()
    except ImportError:
        pass
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what a reader or a child prints goes to stderr, never into the answers
    while True:
        request = sys.stdin.readline()
        if not request:
            return
        name, args = json.loads(request)
        answers.write(json.dumps(SERVED[name](*args)) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
