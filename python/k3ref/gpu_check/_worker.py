"""The child process of isolation.py: loads one adapter and runs its checks, one message at a time.

Messages are length-prefixed pickles. Requests come on stdin; replies go to a duplicate of
the original stdout, and file descriptor 1 is pointed at stderr, so whatever the kernel
prints (Python or C) ends up in the stderr log the parent keeps, never in the protocol.
"""
import os
import pickle
import struct
import sys
import time
import traceback


def send(stream, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def main():
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    init = recv(requests)
    sys.path[:] = init["sys_path"]
    os.environ.update(init.get("env", {}))
    t0 = time.perf_counter()
    from . import timing

    timing_status = timing.install() if init.get("timing", True) else {}
    from .checks import CheckResult
    from .registry import import_module_of

    try:
        for spec in init.get("modules", ()):
            import_module_of(spec)
        adapter = pickle.loads(init["adapter"])
    except Exception as e:  # the adapter cannot even be rebuilt here: every check of it errs
        send(replies, {"available": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                       "import_s": time.perf_counter() - t0})
        return 0
    available = adapter.available()
    loaded = {"available": available, "reason": adapter.unavailable_reason, "import_s": time.perf_counter() - t0,
              "version": "", "timing": dict(timing_status)}
    if available:
        try:
            loaded["version"] = adapter.version()
        except Exception as e:
            loaded["version"] = f"version() raised {type(e).__name__}"
    send(replies, loaded)
    cases = {}
    device = init["device"]
    while True:
        msg = recv(requests)
        if msg is None or msg.get("op") == "exit":
            return 0
        before = timing.COUNTERS.snapshot()
        t0 = time.perf_counter()
        case = None
        try:
            if msg.get("case_path"):
                if msg["case_path"] not in cases:
                    from ..goldens import load_case

                    cases[msg["case_path"]] = load_case(msg["case_path"])
                case = cases[msg["case_path"]]
            res = adapter.run_check(msg["check"], case, device)
        except Exception as e:  # a check that raises is that check's error, with its traceback
            res = CheckResult(adapter.name, msg["check"], msg["case"], "error",
                              f"{type(e).__name__}: {e}".splitlines()[0][:300],
                              extra={"traceback": traceback.format_exc()[-2000:]})
        wall = time.perf_counter() - t0
        after = timing.COUNTERS.snapshot()
        cost = {k: after[k] - before[k] for k in after}
        cost["wall_s"] = wall
        res.seconds = res.seconds or wall
        send(replies, {"result": res, "timing": cost})


if __name__ == "__main__":
    sys.exit(main())
