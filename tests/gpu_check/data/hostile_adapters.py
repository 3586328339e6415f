"""Kernels that leave their check in every way but returning, for test_isolation.py: the
example PyTorch kernel with one misdeed each (`adapters()`: abort, segfault, exit0 =
os._exit(0) inside the kernel, sysexit = SystemExit inside the kernel, hang, alloc50g = a 50 GB
allocation, nonfinite = an o of +inf), committed on the golden case kda_t100 only (T = 100, K = 64). K3REF_HOSTILE_IMPORT
= exit | kill | hang makes the module itself exit (status 0), die (SIGKILL) or hang while it is
imported."""
import ctypes
import os
import signal
import time

if os.environ.get("K3REF_HOSTILE_IMPORT") == "exit":
    os._exit(0)
if os.environ.get("K3REF_HOSTILE_IMPORT") == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("K3REF_HOSTILE_IMPORT") == "hang":
    time.sleep(3600)

import torch  # noqa: E402

from k3ref.gpu_check.adapters import TorchKernelAdapter  # noqa: E402

MISDEEDS = ("abort", "segfault", "exit0", "sysexit", "hang", "alloc50g", "nonfinite")


class Hostile(TorchKernelAdapter):
    def __init__(self, misdeed=None):
        super().__init__()
        self.misdeed = misdeed
        self.name = f"hostile.{misdeed or 'none'}"

    def run(self, inputs, params, out=None):
        if tuple(inputs["q"].shape) == (1, 100, 1, 64):
            if self.misdeed == "abort":
                os.abort()
            if self.misdeed == "segfault":
                ctypes.string_at(0)
            if self.misdeed == "exit0":
                os._exit(0)
            if self.misdeed == "sysexit":
                raise SystemExit(0)
            if self.misdeed == "hang":
                time.sleep(3600)
            if self.misdeed == "alloc50g":
                torch.empty(50 * 2**30, dtype=torch.uint8).fill_(1)
            if self.misdeed == "nonfinite":
                o, final = super().run(inputs, params, out)
                return torch.full_like(o, float("inf")), final
        return super().run(inputs, params, out)


def adapters():
    return [Hostile(m) for m in MISDEEDS] + [Hostile()]


class ExitAlways(TorchKernelAdapter):
    """os._exit(0) on its first call: for `prop`, which runs the kernel on drawn cases."""

    def __init__(self):
        super().__init__()
        self.name = "hostile.exit_always"

    def run(self, inputs, params, out=None):
        os._exit(0)
