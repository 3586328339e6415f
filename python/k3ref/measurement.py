"""A measurement file for measurements/ (the schema tools/render_measurements.py reads), filled
with what the running process can see: the device, the versions, the date, the k3ref commit.

    from k3ref import measurement
    m = measurement.record("h200_layers", "title", tables={...}, commands=[...], notes=[...])
    measurement.write(m, path)

A version that cannot be read is null ("not recorded" in the docs), never guessed.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", None) or "") or None
    except Exception:  # a missing or broken package is "not recorded"
        return None


def device_name(device: str | None = None) -> str:
    """The device a measurement ran on: the GPU's name, or "CPU" where the run used the CPU
    (`device` "cpu", or no GPU), with torch's version when torch is there."""
    try:
        import torch
        if device is not None and str(device).startswith("cpu"):
            return f"CPU (torch {torch.__version__})"
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    except Exception:
        pass
    return "CPU"


def versions(**more: str | None) -> dict[str, str | None]:
    v: dict[str, str | None] = {"torch": _version("torch"), "triton": _version("triton"), "cuda": None,
                                "fla": _version("fla"), "flashkda": None}
    try:
        import torch
        v["cuda"] = torch.version.cuda
    except Exception:
        pass
    v.update(more)
    return v


def record(mid: str, title: str, tables: dict[str, Any], *, commands: list[str] | None = None,
           notes: list[str] | None = None, device: str | None = None, **version_fields: str | None) -> dict[str, Any]:
    return {"schema": 1, "id": mid, "title": title, "device": device_name(device),
            "date": datetime.date.today().isoformat(),
            "k3ref_commit": os.environ.get("K3REF_COMMIT") or _git(["rev-parse", "--short", "HEAD"], ROOT),
            "goldens_generator_version": None, "versions": versions(**version_fields),
            "commands": commands or [], "notes": notes or [], "tables": tables}


def write(m: dict[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(m, indent=1) + "\n")
