"""The one collection of tests, shared by `python3 -m k3ref.gpu_check run` and the pytest plugin.

A test is one adapter x case x check, named `ADAPTER-CASE-CHECK` (golden checks: the golden
case's name; checks that build their own inputs: the configuration they use; a check that
takes no case at all: `ADAPTER-CHECK`). A mutant is
one test, `MUTANT-zoo-caught`, that runs all of the mutant's checks and passes when at least
one of them catches it. Known limitations (known_limitations.json, or a file given) mark
tests as expected failures; they run strictly: a test so marked that passes is a failure
until its entry is removed.
"""
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

KNOWN_LIMITATIONS = Path(__file__).with_name("known_limitations.json")


class SelectorError(ValueError):
    """An unknown name in a selector (one-line message)."""


@dataclass
class Test:
    adapter: object
    check: str
    case: str
    case_path: str = None
    skip: str = None        # the adapter does not support this case: the reason
    xfail: str = None       # a known limitation: the reason

    @property
    def id(self):
        if self.case == "-":  # a check that takes no case
            return f"{self.adapter.name}-{self.check}"
        return f"{self.adapter.name}-{self.case}-{self.check}"


@dataclass
class MutantTest:
    adapter: object
    tests: list = field(default_factory=list)
    xfail: str = None

    @property
    def id(self):
        return f"{self.adapter.name}-zoo-caught"

    check = "caught"
    case = "zoo"


def load_suite(directory, ops):
    """The golden cases of `directory` whose operator is in `ops`, read by k3ref.goldens: the
    cases its MANIFEST.json lists, or every *.safetensors file of a directory without one."""
    from .. import goldens

    directory = Path(directory)
    if (directory / "MANIFEST.json").is_file():
        return goldens.load_suite(directory, ops=tuple(ops))
    cases = [goldens.load_case(p) for p in sorted(directory.glob("*.safetensors"))]
    return [c for c in cases if c.op in ops]


def load_limitations(path=None):
    """The entries of a known-limitations file: a JSON object with "entries", a list of
    {"adapter", "check", "case" (default "*"), "reason", "evidence"}; adapter and case may be
    shell patterns. Raises ValueError (one line) on a malformed file."""
    path = Path(path) if path else KNOWN_LIMITATIONS
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"known limitations {path}: {type(e).__name__}: {e}") from e
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"known limitations {path}: expected an object with a list 'entries'")
    for n, e in enumerate(entries):
        missing = [k for k in ("adapter", "check", "reason") if not isinstance(e.get(k), str) or not e.get(k)]
        extra = set(e) - {"adapter", "check", "case", "reason", "evidence"}
        if missing or extra:
            raise ValueError(f"known limitations {path}: entry {n}: "
                             + (f"missing {', '.join(missing)}" if missing else f"unknown keys {', '.join(sorted(extra))}"))
    return entries


def limitation_for(entries, adapter, check, case):
    for e in entries:
        if (fnmatch.fnmatchcase(adapter, e["adapter"]) and e["check"] == check
                and fnmatch.fnmatchcase(case, e.get("case", "*"))):
            return f"known limitation: {e['reason']}"
    return None


def known_checks(adapters):
    names = []
    for a in adapters:
        for c in a.checks:
            if c not in names:
                names.append(c)
    return names


def validate(adapters, suite, only=None, checks=None, cases=None):
    """Fails (SelectorError) on any name in a selector that names nothing."""
    names = [a.name for a in adapters]
    from . import metrics

    for a in adapters:
        if a.family == "kda":
            try:
                metrics.parse_policy(a.policy)
            except ValueError as e:
                raise SelectorError(f"adapter {a.name}: {e}") from None
    for name in only or ():
        if name not in names:
            raise SelectorError(f"--only: no kernel named '{name}' (known: {', '.join(names)})")
    known = known_checks(adapters) or ["golden"]
    for c in checks or ():
        if c not in known:
            raise SelectorError(f"--checks: no check named '{c}' (known: {', '.join(known)})")
    case_names = [c.name for c in suite]
    for c in cases or ():
        if c not in case_names:
            raise SelectorError(f"--cases: no golden case named '{c}' in the golden directory")


def collect(adapters, suite, checks=None, cases=None, limitations=()):
    """Tests for every adapter x check x case; mutants as one MutantTest each.

    checks: check names to run (None: every check of each adapter); cases: golden case names
    (None: all; checks that build their own inputs are not filtered by it)."""
    out = []
    for a in adapters:
        tests = []
        for check in a.checks:
            if checks is not None and check not in checks:
                continue
            for case_id, case, why in a.cases(check, suite):
                if case is not None and cases is not None and case.name not in cases:
                    continue
                path = str(case.path) if case is not None and getattr(case, "path", None) else None
                t = Test(a, check, case_id, case_path=path, skip=why)
                t.xfail = limitation_for(limitations, a.name, check, case_id)
                tests.append(t)
        if a.kind == "mutant":
            if tests:
                out.append(MutantTest(a, tests, limitation_for(limitations, a.name, "caught", "zoo")))
        else:
            out += tests
    return out


# --------------------------------------------------------------------------- verdicts

def outcome(test, res, requested):
    """(verdict, one-line reason) of one test's CheckResult: 'pass', 'fail', 'skip', 'xfail'.

    Fail closed: an error (a crash included) fails; a skip because the kernel is not available
    fails when that kernel was asked for (`requested` names); a known limitation that passes
    fails (strict: remove its entry)."""
    name = test.adapter.name
    if res.status == "skip":
        if res.extra.get("unavailable") and name in requested:
            why = res.reason[len("not available: "):] if res.reason.startswith("not available: ") else res.reason
            return "fail", f"{name} was asked for but is not available: {why}"
        return "skip", res.reason
    if test.xfail:
        if res.status == "pass":
            return "fail", f"{test.xfail} -- but it passed: the limitation is gone, remove its entry ({res.reason})"
        return "xfail", f"{test.xfail} ({res.status}: {res.reason})"
    if res.status == "pass":
        return "pass", res.reason
    return "fail", res.reason


def mutant_outcome(mt, results, requested):
    """(verdict, reason) of a mutant from its tests' results: caught when one check failed or
    erred; a mutant none of whose checks could run fails ('could not run'), never 'not caught'."""
    # A child that died while loading the mutant ran none of its checks: not a catch.
    ran = [r for r in results if r.status != "skip" and not r.extra.get("load_failed")]
    caught = [f"{r.check}:{r.case}" for r in ran if r.status in ("fail", "error")]
    if caught:
        verdict = ("fail", f"{mt.xfail} -- but it was caught: remove its entry") if mt.xfail else ("pass", "")
        return verdict[0], verdict[1] or ("caught by " + ", ".join(caught))
    if not ran:
        reasons = sorted({r.reason for r in results if r.extra.get("load_failed")} or {r.reason for r in results}) \
            or ["no check applies"]
        return "fail", f"mutant {mt.adapter.name} could not run: {reasons[0]}"
    if mt.xfail:
        return "xfail", f"{mt.xfail} (not caught by {len(ran)} checks)"
    return "fail", f"mutant {mt.adapter.name} NOT CAUGHT by any of the {len(ran)} checks that ran"
