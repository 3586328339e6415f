"""The check phase of `run` over several adapters at once (`--check-jobs N`).

Each adapter's tests already run in a child process of their own (isolation.py), one after
the other. With N > 1 the tests are split by isolation group (an adapter, or the group its
`isolation_group` names), each part gets its own isolation.Runner in a thread, and up to N
parts run at the same time: the children share the GPU, as the warm-up's workers do. Within a
part the order is the collection's (after the shape plan's ordering), so a group's checks
still run together in one child; the rows and results come back in the collection's order,
and the merged timing and availability are those the serial run records. `--no-isolation`
runs serially (the checks would share this process).

With `ready` (warmup.Background: the warm-up running beside), a part starts once the warm-up
units of its adapters are done, and parts with nothing left to compile go first.
"""
from concurrent.futures import ThreadPoolExecutor


def _group(adapter):
    fn = getattr(adapter, "isolation_group", None)
    return fn() if callable(fn) else adapter.name


class Merged:
    """What report.summary reads of a Runner (timing, availability), over several runners."""

    def __init__(self, runners):
        self.runners = runners
        self.timing, self.loaded = {}, {}
        for r in runners:
            self.timing.update(r.timing)
            self.loaded.update(r.loaded)

    def availability(self, adapter):
        return self.loaded.get(adapter.name)


def execute(tests, make_runner, requested, jobs, execute_serial, ready=None):
    """(rows, results, merged runner) of the tests, `jobs` isolation groups at a time.
    `execute_serial(tests, runner, requested)` is cli.execute; make_runner() a new Runner."""
    parts, order = {}, []
    for n, t in enumerate(tests):
        key = _group(t.adapter)
        if key not in parts:
            parts[key] = []
            order.append(key)
        parts[key].append((n, t))
    names = {key: sorted({t.adapter.name for _, t in parts[key]}) for key in order}
    if ready is not None:  # stable: the collection's order among parts equally far from ready
        order.sort(key=lambda key: ready.waiting(names[key]) > 0)

    def one(key):
        if ready is not None:
            ready.wait(names[key])
        with make_runner() as runner:
            rows, results = execute_serial([t for _, t in parts[key]], runner, requested)
        return key, rows, runner

    with ThreadPoolExecutor(max_workers=max(1, min(int(jobs), len(order) or 1))) as pool:
        done = list(pool.map(one, order))
    indexed = []
    runners = []
    for key, rows, runner in done:
        runners.append(runner)
        for (n, _), row in zip(parts[key], rows):
            indexed.append((n, row))
    rows = [row for _, row in sorted(indexed, key=lambda x: x[0])]
    results = [r for row in rows for r in row[3]]
    return rows, results, Merged(runners)
