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
from pathlib import Path

from .protocol import MutantTest, Test

KNOWN_LIMITATIONS = Path(__file__).with_name("known_limitations.json")
# The gradient goldens of the default tier's backward check (`--k3ref-backward all`: every
# one). FLA's backward kernels autotune on (H, HV, K, V, varlen) (warmup.AUTOTUNE_DIMS), each
# new key minutes of benchmarking on a cold cache, and the 13 gradient goldens hold 11 keys:
# these four hold two (H = HV = 2, K = V = 32, without and with varlen) and cover batch 2 with
# an initial state, both gate forms FLA's backward takes besides log-decay (softplus with
# A_log and dt_bias, the lower-bound gate), and varlen with empty and one-token sequences.
DEFAULT_BACKWARD_GOLDENS = ("kda_backward_b2_t37", "kda_backward_gate_softplus", "kda_backward_gate_lower_bound",
                            "kda_backward_varlen")


class SelectorError(ValueError):
    """An unknown name in a selector (one-line message)."""


LIMITATION_KEYS = ("adapter", "check", "case", "case_pattern", "reason", "evidence", "ends_process")
MAX_LIMITATIONS_BYTES = 1024 * 1024


def load_limitations(path=None):
    """The entries of a known-limitations file: a JSON object with "entries", a list of
    {"adapter", "check", "case" or "case_pattern" or neither, "reason", "evidence",
    "ends_process": true for a limitation that ends the process running it (an abort): its
    test runs in a scope of its own, so that its worker's replacement holds up no other test}.

    Names are literal: "adapter" and "check" name one adapter and one check exactly (brackets
    and stars are characters of the name). "case" names one case exactly; "case_pattern" is a
    shell pattern over the check's cases, which must match fewer than all of them (checked at
    collection); neither: the check's only case (a check with several cases must name them).
    No entry can waive a whole kernel. The file is read under the package's bounded rules
    (k3ref._bounded). Raises ValueError (one line) on a malformed file."""
    from .._bounded import load_json

    path = Path(path) if path else KNOWN_LIMITATIONS
    data = load_json(path, "known limitations", limit=MAX_LIMITATIONS_BYTES)
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"known limitations {path}: expected an object with a list 'entries'")
    for n, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ValueError(f"known limitations {path}: entry {n}: expected an object")
        missing = [k for k in ("adapter", "check", "reason") if not isinstance(e.get(k), str) or not e.get(k)]
        extra = set(e) - set(LIMITATION_KEYS)
        if missing or extra:
            raise ValueError(f"known limitations {path}: entry {n}: "
                             + (f"missing {', '.join(missing)}" if missing else f"unknown keys {', '.join(sorted(extra))}"))
        for key in ("case", "case_pattern", "evidence"):
            if key in e and (not isinstance(e[key], str) or not e[key]):
                raise ValueError(f"known limitations {path}: entry {n}: '{key}' must be a non-empty string")
        if "ends_process" in e and not isinstance(e["ends_process"], bool):
            raise ValueError(f"known limitations {path}: entry {n}: 'ends_process' must be true or false")
        if "case" in e and "case_pattern" in e:
            raise ValueError(f"known limitations {path}: entry {n}: give 'case' or 'case_pattern', not both")
        if e.get("case") == "*" or any(ch in e.get("case", "") for ch in "*?["):
            raise ValueError(f"known limitations {path}: entry {n}: 'case' is a literal case name; write a pattern "
                             f"as 'case_pattern' (it must match fewer than all cases), or omit it for a one-case check")
    return entries


def limitation_for(entries, adapter, check, case, check_cases):
    """The known-limitation reason of test (adapter, check, case), or None (limitation_entry)."""
    found = limitation_entry(entries, adapter, check, case, check_cases)
    return found[1] if found else None


def limitation_entry(entries, adapter, check, case, check_cases):
    """(entry, reason) of the known limitation of test (adapter, check, case), or None.
    `check_cases`: every case id of that adapter's check, so that a pattern matching all of
    them, or an entry naming no case for a check of several, is refused (ValueError, one line)."""
    for n, e in enumerate(entries):
        if e["adapter"] != adapter or e["check"] != check:
            continue
        if "case" in e:
            if e["case"] == case:
                return e, f"known limitation: {e['reason']}"
        elif "case_pattern" in e:
            matched = [c for c in check_cases if fnmatch.fnmatchcase(c, e["case_pattern"])]
            if len(matched) >= len(check_cases):
                raise ValueError(f"known limitations: entry {n} ({adapter} {check}): case_pattern "
                                 f"'{e['case_pattern']}' matches all {len(check_cases)} cases; a known limitation may "
                                 f"not waive a whole check: name the cases")
            if case in matched:
                return e, (f"known limitation (case_pattern '{e['case_pattern']}', {len(matched)} of "
                           f"{len(check_cases)} cases): {e['reason']}")
        else:
            if len(check_cases) != 1:
                raise ValueError(f"known limitations: entry {n} ({adapter} {check}) names no case, but the check "
                                 f"has {len(check_cases)} cases: name them ('case' or 'case_pattern')")
            return e, f"known limitation: {e['reason']}"
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
    from .. import policy

    for a in adapters:
        if a.family == "kda":
            try:
                policy.load_table().rules(a.policy, "kda.recurrent")
            except KeyError as e:
                raise SelectorError(f"adapter {a.name}: {e.args[0]}") from None
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


def collect(adapters, suite, checks=None, cases=None, limitations=(), backward="default"):
    """Tests for every adapter x check x case; mutants as one MutantTest each.

    checks: check names to run (None: every check of each adapter); cases: golden case names
    (None: all; checks that build their own inputs are not filtered by it); backward: "default"
    (the backward check on DEFAULT_BACKWARD_GOLDENS, or on the gradient goldens `cases` names)
    or "all" (on every gradient golden)."""
    out = []
    for a in adapters:
        tests = []
        for check in a.checks:
            if checks is not None and check not in checks:
                continue
            check_cases = list(a.cases(check, suite))
            case_ids = [case_id for case_id, _, _ in check_cases]
            for case_id, case, why in check_cases:
                if case is not None and cases is not None and case.name not in cases:
                    continue
                if (check == "backward" and backward == "default" and cases is None
                        and case_id not in DEFAULT_BACKWARD_GOLDENS):
                    continue
                path = str(case.path) if case is not None and getattr(case, "path", None) else None
                t = Test(a, check, case_id, case_path=path, skip=why)
                found = limitation_entry(limitations, a.name, check, case_id, case_ids)
                if found:
                    t.xfail, t.ends_process = found[1], bool(found[0].get("ends_process"))
                tests.append(t)
        if a.kind == "mutant":
            if tests:
                out.append(MutantTest(a, tests, limitation_for(limitations, a.name, "caught", "zoo", ["zoo"])))
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
