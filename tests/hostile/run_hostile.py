"""Runs the hostile corpus (corpus.py) against the k3ref command.

usage: run_hostile.py K3REF_EXE GOLDENS_DIR [--sanitized] [--only SUBSTRING] [--keep DIR]

Each case runs in its own directory under a time limit (5 s wall) and a memory limit
(1 GiB: RLIMIT_AS in a release build; under AddressSanitizer, whose shadow memory makes
RLIMIT_AS useless, ASan's own hard_rss_limit_mb and max_allocation_size_mb; and 20 s,
since -O0 instrumented code is 5-20 times slower). A case is
handled when: the exit code is one the case allows (0 a correct result that the case's
check confirms, 1 a difference reported, 2 unusable input); on exit 2 the output is exactly
one line that names what the case requires; the output holds no terminal control
characters; no sanitizer reported anything; and nothing in the case's directory was
created, changed or removed except the one output the case names. Prints one line per
case and a summary with the count per outcome; exit status 1 if any case was not handled.
"""

import argparse
import hashlib
import os
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("exe")
    parser.add_argument("goldens")
    parser.add_argument("--sanitized", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--keep", default=None, help="generate the corpus here and keep it")
    args = parser.parse_args()
    exe = os.path.abspath(args.exe)
    goldens = os.path.abspath(args.goldens)

    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "MALLOC_ARENA_MAX": "2",
           "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:exitcode={SANITIZER_EXIT}",
           "ASAN_OPTIONS": f"exitcode={SANITIZER_EXIT}:hard_rss_limit_mb={MEMORY_LIMIT_BYTES >> 20}:"
                           f"max_allocation_size_mb={MEMORY_LIMIT_BYTES >> 20}:allocator_may_return_null=0:"
                           "detect_leaks=1:abort_on_error=0",
           "LSAN_OPTIONS": f"exitcode={SANITIZER_EXIT}"}
    work = args.keep or tempfile.mkdtemp(prefix="k3ref_hostile_")
    os.makedirs(work, exist_ok=True)
    outcomes = {}
    by_class = {}
    failures = 0
    started = time.monotonic()
    try:
        generation_start = time.monotonic()
        all_cases = corpus.cases(work, goldens, scale=0.25 if args.sanitized else 1.0)
        generation_seconds = time.monotonic() - generation_start
        names = [c.name for c in all_cases]
        assert len(names) == len(set(names)), "case names must be unique"
        selected = [c for c in all_cases if args.only in c.name]
        slowest = (0.0, "")
        for case in selected:
            if case.setup_command:
                run_limited([exe] + case.setup_command, case.directory, env, args.sanitized)
            before = snapshot(case.directory)
            code, stdout, stderr, seconds, rss = run_limited([exe] + [os.fsencode(a) for a in case.args],
                                                             case.directory, env, args.sanitized)
            changes = changed_paths(before, snapshot(case.directory), case.output)
            problems = judge(case, code, stdout, stderr, seconds, rss, changes, args.sanitized)
            slowest = max(slowest, (seconds, case.name))
            outcome = "killed" if code is None else f"exit {code}"
            verdict = "handled" if not problems else "NOT HANDLED"
            outcomes[(outcome, verdict)] = outcomes.get((outcome, verdict), 0) + 1
            per_class = by_class.setdefault(case.klass.split(":")[0], {})
            per_class[outcome] = per_class.get(outcome, 0) + 1
            first_line = (stdout + stderr).decode(errors="replace").split("\n")[0][:160]
            print(f"{verdict:11} {outcome:7} {seconds:6.2f} s {rss >> 20:5} MiB  {case.name}  [{case.klass}]  {first_line}")
            for p in problems:
                print(f"            - {p}")
            failures += bool(problems)
            if not args.keep:
                shutil.rmtree(case.directory, ignore_errors=True)
        total = time.monotonic() - started
        print("\nby class: " + "; ".join(f"{k} {sum(v.values())} (" + ", ".join(f"{n} {o}" for o, n in sorted(v.items())) + ")"
                                       for k, v in sorted(by_class.items())))
        summary = ", ".join(f"{n} {verdict} with {outcome}" for (outcome, verdict), n in sorted(outcomes.items()))
        print(f"\n{len(selected)} hostile cases ({summary}); corpus generated in {generation_seconds:.1f} s, "
              f"all run in {total:.1f} s, slowest {slowest[0]:.2f} s ({slowest[1]})")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
