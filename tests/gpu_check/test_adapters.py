"""Adapters that misbehave on purpose, for the tests of the harness's isolation and verdicts
(test_fail_closed.py, test_harness.py). Each is a KdaAdapter around the PyTorch fp64 recurrence rounded to
bf16 (a correct kernel), with one behaviour changed."""
import ctypes
import os
import sys
import time

import torch

from k3ref.gpu_check import torch_model as reference  # the PyTorch recurrence, a kernel model
from k3ref.gpu_check.adapters import KdaAdapter


class Correct(KdaAdapter):
    name = "test.correct"
    policy = "recurrent"
    contract = "PyTorch; fp64 recurrence rounded to bf16"

    def run(self, inputs, params, out=None):
        o, final = reference.kda_forward(inputs, params)
        return o.to(torch.bfloat16), final.float()


class Crashing(Correct):
    """Aborts on golden kda_t1, segfaults on kda_t64_no_initial_state, hangs on kda_scale_half
    (each a golden with T = 1, 64 or 30); every other case is correct."""

    name = "test.crashing"
    checks = ("golden", "causality")

    def run(self, inputs, params, out=None):
        T, K = inputs["q"].shape[1], inputs["q"].shape[3]
        if params.get("T") == 1 and T == 1:
            print("copy_traits_sm90_tma.hpp:949: make_tma_copy_desc: Assertion `aligned' failed.", file=sys.stderr,
                  flush=True)
            os.abort()
        if params.get("T") == 64 and not params.get("initial_state", True):
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if params.get("T") == 30 and params.get("scale") == 0.5:
            time.sleep(3600)
        return super().run(inputs, params, out)


class Unloadable(Correct):
    name = "test.unloadable"

    def load(self):
        raise ImportError("No module named 'not_installed_kernel'")


class SupportsNothing(Correct):
    name = "test.supports_nothing"
    checks = ("golden",)

    def unsupported(self, params, shapes):
        return "this kernel takes no golden case"


class Leaky(Correct):
    """A kernel (not a mutant) that reads q one token ahead: fails golden and causality."""

    name = "test.leaky"

    def run(self, inputs, params, out=None):
        inputs = dict(inputs)
        q = inputs["q"]
        inputs["q"] = torch.cat([q[:, 1:], q[:, -1:]], dim=1)
        return super().run(inputs, params, out)


class UncaughtMutant(Correct):
    """A 'mutant' with no mistake: no check can catch it, and the verdict must say so."""

    name = "mutant.test_no_mistake"
    kind = "mutant"
    checks = ("golden",)


class UnrunnableMutant(UncaughtMutant):
    name = "mutant.test_unrunnable"

    def load(self):
        raise RuntimeError("needs a device this host lacks")


class UnknownPolicy(Correct):
    name = "test.unknown_policy"
    policy = "no-such-policy"


class CrashOnLoadMutant(UncaughtMutant):
    """A mutant whose import kills the process: it could not run, it was not caught."""

    name = "mutant.test_crash_on_load"

    def load(self):
        os.abort()


class NanEverywhere(Correct):
    """Returns NaN in every element: a wrong kernel no registry entry may turn into a pass."""

    name = "test.nan"

    def run(self, inputs, params, out=None):
        o, final = super().run(inputs, params)
        return torch.full_like(o, float("nan")), torch.full_like(final, float("nan"))
