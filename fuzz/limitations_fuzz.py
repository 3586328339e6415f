"""Python fuzz target: the known-limitations registry reader
(k3ref.gpu_check.collection.load_limitations), driven by Hypothesis.

usage: limitations_fuzz.py [--seconds S] [--seed N] [--seeds-dir DIR] [--replay FILE]

Mutates seed registries (the committed known_limitations.json, and the files in
--seeds-dir) two ways for S seconds (default 60): as bytes (flips, insertions, deletions,
splices of JSON tokens, truncation, NUL, bad UTF-8, deep brackets) and as structured JSON
(entries with keys dropped, added, retyped, duplicated, case patterns with * ? [ ], huge and
escape-laden strings, deep values, NaN). Each input is written to a file and read in a child
process under 5 s and 1 GiB more address space than the reader had at the start; the reader
must either return entries that satisfy its documented rules (a list of objects with
non-empty string adapter, check and reason; only the known keys; case, case_pattern and
evidence non-empty strings when present; not both case and case_pattern; a case holds no
pattern character) or raise ValueError whose message is one line. Anything else (another
exception, a multi-line message, a hang, a crash, running out of memory) is a finding: the
input is saved to fuzz-limitations-failure-<n>.json and the line to replay it is printed
(`--seed N` replays the whole run, `--replay FILE` one input). Exit 1 on any finding.
"""
import argparse
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

# The one import of the reader: if k3ref.gpu_check is restructured, only this line changes.
from k3ref.gpu_check.collection import KNOWN_LIMITATIONS, LIMITATION_KEYS, load_limitations  # noqa: E402

TIME_LIMIT_S = 5.0
MEMORY_LIMIT_BYTES = 1 << 30


def rules_problem(entries):
    """None when `entries` satisfy the reader's documented rules, else what is wrong."""
    if not isinstance(entries, list):
        return f"returned {type(entries).__name__}, not a list"
    for n, e in enumerate(entries):
        if not isinstance(e, dict):
            return f"entry {n} is not an object"
        for k in ("adapter", "check", "reason"):
            if not isinstance(e.get(k), str) or not e[k]:
                return f"entry {n}: {k} is not a non-empty string"
        if set(e) - set(LIMITATION_KEYS):
            return f"entry {n}: unknown keys {sorted(set(e) - set(LIMITATION_KEYS))}"
        for k in ("case", "case_pattern", "evidence"):
            if k in e and (not isinstance(e[k], str) or not e[k]):
                return f"entry {n}: {k} is not a non-empty string"
        if "case" in e and "case_pattern" in e:
            return f"entry {n}: both case and case_pattern"
        if any(ch in e.get("case", "") for ch in "*?["):
            return f"entry {n}: case {e['case'][:40]!r} holds a pattern character"
    return None


def _vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def judge(path):
    """Reads `path` in a forked child under the bounds; None when handled, else the finding."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            limit = _vm_bytes() + MEMORY_LIMIT_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            try:
                entries = load_limitations(path)
                problem = rules_problem(entries)
                verdict = "accepted" if problem is None else "accepted against the rules: " + problem
            except ValueError as e:
                message = str(e)
                verdict = "refused" if message and "\n" not in message and "\r" not in message else \
                    f"ValueError not one line: {message[:300]!r}"
            except MemoryError:
                verdict = "MemoryError (over 1 GiB)"
            except BaseException as e:  # noqa: BLE001 - any other exception is the finding
                verdict = f"{type(e).__name__}: {str(e)[:300]}"
            os.write(write_end, verdict.encode("utf-8", "backslashreplace")[:4000])
        finally:
            os._exit(0)
    os.close(write_end)
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > TIME_LIMIT_S:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return f"ran past {TIME_LIMIT_S:.0f} s"
        time.sleep(0.001)
    verdict = os.read(read_end, 8192).decode()
    os.close(read_end)
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    if verdict in ("accepted", "refused"):
        return None
    return verdict or "the child reported nothing"


# ---- inputs -------------------------------------------------------------------------------

def seeds(seeds_dir):
    out = [open(KNOWN_LIMITATIONS, "rb").read()]
    good = {"entries": [{"adapter": "fla", "check": "parity", "case": "T=1", "reason": "r", "evidence": "e"},
                        {"adapter": "flashkda", "check": "prop", "case_pattern": "T=6*", "reason": "r"},
                        {"adapter": "a[1]", "check": "c*", "reason": "literal names"}]}
    out.append(json.dumps(good).encode())
    out.append(json.dumps({"entries": []}).encode())
    if seeds_dir:
        for name in sorted(os.listdir(seeds_dir)):
            out.append(open(os.path.join(seeds_dir, name), "rb").read())
    return out


TOKENS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"\\u0000", b"\\ud800", b"null", b"true", b"NaN",
          b"-Infinity", b"1e999", b"18446744073709551616", b"\x00", b"\xff", b"\xef\xbb\xbf", b"\xc0\xaf",
          b'"entries"', b'"adapter"', b'"check"', b'"case"', b'"case_pattern"', b'"reason"', b'"evidence"',
          b'"*"', b'"?"', b'"["', b'"\\n"', b'"\x1b[2J"', b"[" * 70, b"]" * 70, b"{\"a\":" * 70]


def mutate_bytes(rnd, data):
    data = bytearray(data)
    for _ in range(rnd.randint(1, 8)):
        op = rnd.randrange(7)
        at = rnd.randint(0, len(data))
        if op == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rnd.randrange(8)
        elif op == 1:
            data[at:at] = rnd.choice(TOKENS)
        elif op == 2 and data:
            del data[at:at + rnd.randint(1, 16)]
        elif op == 3:
            data = data[:at]
        elif op == 4:
            data[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
        elif op == 5 and data:  # duplicate a slice
            b = rnd.randint(0, len(data))
            data[at:at] = data[min(at, b):max(at, b)][:4096]
        else:
            data += rnd.choice(TOKENS)
    return bytes(data)


def structured(draw_value, rnd):
    """A registry as JSON: entries built from the keys and edge values."""
    keys = list(LIMITATION_KEYS) + ["extra", "Adapter", ""]
    entries = []
    for _ in range(rnd.randint(0, 6)):
        e = {}
        for k in keys:
            if rnd.random() < (0.8 if k in ("adapter", "check", "reason") else 0.25):
                e[k] = draw_value(rnd)
        entries.append(e if rnd.random() < 0.95 else draw_value(rnd))
    top = {"entries": entries}
    if rnd.random() < 0.1:
        top = {"entries": draw_value(rnd)}
    if rnd.random() < 0.05:
        top = draw_value(rnd)
    if isinstance(top, dict) and rnd.random() < 0.1:
        top["about"] = draw_value(rnd)
    text = json.dumps(top, ensure_ascii=rnd.random() < 0.5, allow_nan=True)
    if rnd.random() < 0.1:  # a duplicate key
        text = text.replace('"adapter":', '"adapter": "x", "adapter":', 1)
    return text.encode("utf-8", "surrogatepass")


def edge_value(rnd):
    choices = [lambda: "fla", lambda: "", lambda: "T=6*", lambda: "*", lambda: "[!a]", lambda: "x" * rnd.choice([1, 200, 70000]),
               lambda: "\x1b]0;x\x07\u009b\n", lambda: "\ud800", lambda: 0, lambda: -1, lambda: 2 ** 70,
               lambda: 1.5, lambda: float("nan"), lambda: float("inf"), lambda: None, lambda: True, lambda: [],
               lambda: {}, lambda: ["a"], lambda: {"adapter": "a"}, lambda: json.loads("[" * 60 + "]" * 60)]
    return rnd.choice(choices)()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seeds-dir", default=None)
    parser.add_argument("--replay", default=None)
    args = parser.parse_args()
    if args.replay:
        finding = judge(args.replay)
        print(f"{args.replay}: {finding or 'handled'}")
        return 1 if finding else 0

    from hypothesis import HealthCheck, given, settings, strategies as st

    run_seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    corpus = seeds(args.seeds_dir)
    work = tempfile.mkdtemp(prefix="k3ref_limitations_fuzz_")
    stats = {"inputs": 0, "accepted": 0, "refused": 0, "findings": 0}
    deadline = [float("inf")]  # set when the rounds start: --seconds of fuzzing, setup aside
    outcomes = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=False, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2 ** 63), st.sampled_from(["bytes", "structured", "both"]))
    def one(value_seed, how):
        if time.monotonic() > deadline[0]:
            return
        rnd = random.Random(value_seed)
        if how == "bytes":
            data = mutate_bytes(rnd, rnd.choice(corpus))
        elif how == "structured":
            data = structured(edge_value, rnd)
        else:
            data = mutate_bytes(rnd, structured(edge_value, rnd))
        path = os.path.join(work, "known_limitations.json")
        with open(path, "wb") as f:
            f.write(data)
        finding = judge(path)
        stats["inputs"] += 1
        if finding:
            stats["findings"] += 1
            saved = f"fuzz-limitations-failure-{stats['findings']}.json"
            with open(saved, "wb") as f:
                f.write(data)
            outcomes.append(f"{finding}  (input {saved}; replay: {sys.argv[0]} --replay {saved}; "
                            f"this run: --seed {run_seed})")
            print("FINDING: " + outcomes[-1], flush=True)

    from hypothesis import seed as hypothesis_seed

    started = time.monotonic()
    deadline[0] = started + args.seconds

    rounds = 0
    while time.monotonic() < deadline[0]:
        # Hypothesis draws the inputs (200 a round); round r is seeded by run_seed + r, so
        # --seed replays the run.
        try:
            hypothesis_seed(run_seed + rounds)(one)()
        except Exception as e:  # noqa: BLE001 - a defect of this fuzzer, not of the reader: it must not pass
            print(f"limitations_fuzz: the fuzzer itself failed ({type(e).__name__}: {e}); run seed {run_seed}",
                  flush=True)
            return 2
        rounds += 1
    elapsed = time.monotonic() - started
    print(f"limitations_fuzz: {stats['inputs']} inputs in {elapsed:.0f} s ({stats['inputs'] / max(elapsed, 1e-9):.0f}/s), "
          f"{stats['findings']} finding(s); run seed {run_seed} (replay: --seed {run_seed} --seconds {args.seconds:.0f})")
    return 1 if stats["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
