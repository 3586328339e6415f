"""The hostile corpus (corpus.py) against the k3ref command: one test per case (conftest.py
generates the corpus and parametrizes `case` by its name; --exe, --golden-dir, --sanitized,
--keep DIR).

Each case runs in its own directory under a time limit (5 s wall) and a memory limit
(1 GiB: RLIMIT_AS in a release build; under AddressSanitizer, whose shadow memory makes
RLIMIT_AS useless, ASan's own hard_rss_limit_mb and max_allocation_size_mb; and 20 s,
since -O0 instrumented code is 5-20 times slower). A case is
handled when: the exit code is one the case allows (0 a correct result that the case's
check confirms, 1 a difference reported, 2 unusable input); on exit 2 the output is exactly
one line that names what the case requires; the output holds no terminal control
characters; no sanitizer reported anything; and nothing in the case's directory was
created, changed or removed except the one output the case names. A case not handled fails
its test with every problem and the command that replays it; the session ends with one line
per case and the count per class and outcome (conftest.py).
"""

import hashlib
import os
import re
import resource
import shlex
import shutil
import signal
import stat
import tempfile
import time

import pytest

import corpus

TIME_LIMIT_S = 5.0
# Under ASan/UBSan at -O0 the same work runs 5-20 times slower (nlohmann's lexer most of
# all), so the sanitizer build allows 4 times as long; the release build holds the 5 s.
SANITIZED_TIME_FACTOR = 4
MEMORY_LIMIT_BYTES = 1 << 30
SANITIZER_EXIT = 86  # any sanitizer report exits with this (set below), never 0, 1 or 2
SANITIZER_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:")
# Bytes a terminal acts on: C0 controls except newline, DEL, and C1 controls in UTF-8.
UNSAFE_OUTPUT = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")


def snapshot(directory):
    """Everything under `directory`: path -> (kind, size, mtime, digest), not following links."""
    state = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            digest = None
            if stat.S_ISREG(st.st_mode) and st.st_size <= (1 << 20):
                digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(path)
            state[os.path.relpath(path, directory)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino,
                                                       digest)
    return state


def changed_paths(before, after, output):
    def allowed(path):
        return output is not None and (path == output or path.startswith(output.rstrip("/") + "/"))
    changes = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path) and not allowed(path):
            what = "created" if path not in before else "removed" if path not in after else "changed"
            changes.append(f"{path} {what}")
    return changes


def run_limited(argv, cwd, env, sanitized):
    """(exit code or None on timeout, stdout, stderr, seconds, max RSS bytes)."""
    time_limit = TIME_LIMIT_S * (SANITIZED_TIME_FACTOR if sanitized else 1)
    def limit():
        os.setsid()
        if not sanitized:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child
            try:
                limit()
                os.chdir(cwd)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        code, rss = None, 0
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                rss = usage.ru_maxrss * 1024
                break
            if time.monotonic() - start > time_limit:
                os.killpg(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                rss = usage.ru_maxrss * 1024
                break
            time.sleep(0.005)
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read(), seconds, rss


def judge(case, code, stdout, stderr, seconds, rss, changes, sanitized):
    """A list of problems; empty when the case was handled."""
    problems = []
    text = stdout + stderr
    if code is None:
        return [f"ran past {TIME_LIMIT_S * (SANITIZED_TIME_FACTOR if sanitized else 1):.0f} s (killed)"]
    if any(marker.encode() in stderr for marker in SANITIZER_MARKERS) or code == SANITIZER_EXIT:
        problems.append("sanitizer report: " + stderr.decode(errors="replace")[-600:])
    if code < 0:
        problems.append(f"killed by signal {-code}")
    elif code not in case.expect:
        problems.append(f"exit {code}, expected one of {case.expect}")
    if b"bad_alloc" in text or b"out of memory" in text:
        problems.append("ran out of memory (an allocation bounded by nothing)")
    if not sanitized and rss > MEMORY_LIMIT_BYTES:
        problems.append(f"max RSS {rss >> 20} MiB")
    if UNSAFE_OUTPUT.search(text):
        problems.append("output holds terminal control bytes: " + repr(UNSAFE_OUTPUT.search(text).group()))
    if code == corpus.UNUSABLE:
        if text.count(b"\n") != 1 or not text.endswith(b"\n"):
            problems.append(f"exit 2 but {text.count(b'{chr(10)}')} lines of output: " + text.decode(errors="replace")[:400])
        if len(text) > 1000:
            problems.append(f"error line of {len(text)} bytes")
        for part in case.must_mention:
            if part.encode() not in text:
                problems.append(f"error line does not mention {part!r}: " + text.decode(errors="replace")[:400])
    if code == corpus.DIFFERENT:
        for part in case.must_mention_stdout:
            if part.encode() not in text:
                problems.append(f"output does not mention {part!r}: " + text.decode(errors="replace")[:400])
    if code == corpus.OK and case.check:
        problem = case.check(case.directory)
        if problem:
            problems.append(problem)
    problems += [f"file {c} (only {case.output!r} may be written)" for c in changes]
    return problems


# The corpus as docs/robustness.md counts it: a case that disappears is a deliberate change.
MINIMUM_CASES = 180

ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "MALLOC_ARENA_MAX": "2",
       "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:exitcode={SANITIZER_EXIT}",
       "ASAN_OPTIONS": f"exitcode={SANITIZER_EXIT}:hard_rss_limit_mb={MEMORY_LIMIT_BYTES >> 20}:"
                       f"max_allocation_size_mb={MEMORY_LIMIT_BYTES >> 20}:allocator_may_return_null=0:"
                       "detect_leaks=1:abort_on_error=0",
       "LSAN_OPTIONS": f"exitcode={SANITIZER_EXIT}"}


def test_the_corpus_names_each_case_once(hostile_corpus):
    names = hostile_corpus.names
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"case names must be unique: {repeated}"
    assert len(names) >= MINIMUM_CASES, f"{len(names)} hostile cases, fewer than the {MINIMUM_CASES} documented"


def test_hostile_input(case, k3ref_exe, sanitized, hostile_corpus, replay):
    if case.setup_command:
        run_limited([k3ref_exe] + case.setup_command, case.directory, ENV, sanitized)
    before = snapshot(case.directory)
    code, stdout, stderr, seconds, rss = run_limited([k3ref_exe] + [os.fsencode(a) for a in case.args],
                                                     case.directory, ENV, sanitized)
    changes = changed_paths(before, snapshot(case.directory), case.output)
    problems = judge(case, code, stdout, stderr, seconds, rss, changes, sanitized)
    outcome = "killed" if code is None else f"exit {code}"
    hostile_corpus.records.append({
        "name": case.name, "klass": case.klass, "outcome": outcome, "seconds": seconds, "rss": rss,
        "verdict": "handled" if not problems else "NOT HANDLED", "problems": problems,
        "first_line": (stdout + stderr).decode(errors="replace").split("\n")[0][:160]})
    if not hostile_corpus.keep:
        shutil.rmtree(case.directory, ignore_errors=True)
    if problems:  # the message alone (no traceback): what failed and the command that replays it
        pytest.fail(f"{case.name} [{case.klass}] not handled ({outcome}, {seconds:.2f} s, {rss >> 20} MiB):\n"
                    + "\n".join(f"  - {p}" for p in problems)
                    + f"\n  k3ref {shlex.join(os.fsencode(a).decode(errors='backslashreplace') for a in case.args)}"
                    + "  (in the case's directory)"
                    + f"\nreplay: {replay}  (--keep DIR keeps the case's files in DIR/{case.name})", pytrace=False)
