"""The run's configuration reaches adapters as one frozen object (protocol.RunOptions), never
through the environment: a front end reads the kernel paths' variables once (kernel_paths_of),
the registry gives every adapter it makes the run's options, and a factory that takes
`run_options` gets the run's settings (--k3ref-set NAME=VALUE)."""
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from k3ref.gpu_check import registry  # noqa: E402
from k3ref.gpu_check.protocol import Adapter, RunOptions, UsageError, kernel_paths_of, settings_of  # noqa: E402


def test_an_option_wins_over_its_variable_which_fills_in_for_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("K3REF_FLA_PATH", str(tmp_path / "from_environment"))
    monkeypatch.setenv("K3GC_LIB", "relative/libk3gc.so")
    monkeypatch.delenv("K3REF_LIGER_PATH", raising=False)
    paths = dict(kernel_paths_of({"fla_path": str(tmp_path / "given"), "liger_path": None}))
    assert paths["fla_path"] == str((tmp_path / "given").resolve())
    assert paths["lib"] == str(Path("relative/libk3gc.so").resolve())  # absolute: the workers' cwd may differ
    assert "liger_path" not in paths
    assert RunOptions(kernel_paths=tuple(paths.items())).kernel_path("liger_path") is None


def test_settings_are_name_value_pairs_and_a_malformed_one_is_a_usage_error():
    assert settings_of(["cp.ranks=2,4", "x=a=b", "empty="]) == (("cp.ranks", "2,4"), ("x", "a=b"), ("empty", ""))
    opts = RunOptions(settings=settings_of(["cp.ranks=2,4"]))
    assert opts.setting("cp.ranks") == "2,4" and opts.setting("missing", "d") == "d"
    for bad in ("no_equals", "=value"):
        with pytest.raises(UsageError, match="expected NAME=VALUE"):
            settings_of([bad])


def test_the_registry_gives_each_adapter_the_run_s_options_and_a_factory_its_settings():
    opts = RunOptions(settings=(("cp.ranks", "2"),), autotune_configs="all")
    made = registry.resolve("k3ref.gpu_check.cp_check:cp_adapters", opts)
    # P = 2: the kernel and the two mutants that differ from it there (untransposed needs P >= 4)
    assert sorted(a.name for a in made) == ["mutant.cp_drop_trailing[P=2]", "mutant.cp_wrong_rank[P=2]",
                                            "torch.cp_fp64[P=2]"]
    assert all(a.run_options is opts for a in made)
    [plain] = registry.resolve("k3ref.gpu_check.adapters:FlashKdaAdapter")
    assert plain.run_options == RunOptions()  # made without a run: the defaults
    with pytest.raises(registry.AdapterSpecError, match="cp.ranks='1'"):
        registry.resolve("k3ref.gpu_check.cp_check:cp_adapters", RunOptions(settings=(("cp.ranks", "1"),)))


def test_an_adapter_s_own_path_wins_over_the_run_s():
    a = Adapter()
    a.run_options = RunOptions(kernel_paths=(("fla_path", "/run/fla"),))
    assert a.path_of("fla_path") == "/run/fla" and a.path_of("vllm_path") is None
    a.fla_path = "/own/fla"
    assert a.path_of("fla_path") == "/own/fla"


SEER = '''
import json
import os
import os

from k3ref.gpu_check.protocol import Adapter, CheckResult


class Seer(Adapter):
    """Reports, as its check's reason, what reached it in the worker that ran it."""

    name = "options.seer"
    family = "seer"
    checks = ("look",)

    def run_check(self, check, case, device):
        seen = {"fla_path": self.path_of("fla_path"), "fla_environment": os.environ.get("K3REF_FLA_PATH"),
                "who": self.run_options.setting("who"), "autotune_configs": self.run_options.autotune_configs,
                "cache_dir": self.run_options.cache_dir, "worker": os.environ.get("PYTEST_XDIST_WORKER")}
        return CheckResult(self.name, check, "-", "pass", json.dumps(seen))
'''


def test_the_options_of_the_command_line_reach_the_adapter_in_its_worker(tmp_path, gpu_check, child_env):
    (tmp_path / "seer.py").write_text(SEER)
    env = child_env()
    env.pop("K3REF_FLA_PATH", None)
    r = gpu_check("run", "--no-builtin", "--adapter", f"{tmp_path / 'seer.py'}:Seer", "--fla-path", str(tmp_path / "fla"),
                  "--set", "who=the run", "--autotune-configs", "all", "--cache-dir", str(tmp_path / "cache"),
                  "--no-warmup", "--device", "cpu", "--out", str(tmp_path / "r"), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    [res] = report["results"]
    seen = json.loads(res["reason"])
    # The report keeps the options the run was given, as its processes read them.
    given = report["summary"]["run_options"]
    assert dict(given["kernel_paths"])["fla_path"] == str((tmp_path / "fla").resolve())
    assert given["settings"] == [["who", "the run"]] and given["autotune_configs"] == "all"
    assert seen == {"fla_path": str((tmp_path / "fla").resolve()), "fla_environment": None, "who": "the run",
                    "autotune_configs": "all", "cache_dir": str((tmp_path / "cache").resolve()), "worker": "gw0"}


def test_a_malformed_setting_is_a_usage_error_in_one_line(tmp_path, gpu_check):
    (tmp_path / "seer.py").write_text(SEER)
    r = gpu_check("run", "--no-builtin", "--adapter", f"{tmp_path / 'seer.py'}:Seer", "--set", "no_value_given",
                  "--no-warmup", "--device", "cpu", "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "setting 'no_value_given'" in lines[0] and "expected NAME=VALUE" in lines[0], r.stderr
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.mark.parametrize("command", [["prop", "--kernel", "x"], ["warmup"]])
def test_prop_and_warmup_build_their_options_as_a_run_does(command, tmp_path, monkeypatch):
    from k3ref.gpu_check import cli

    monkeypatch.setenv("K3REF_FLA_PATH", str(tmp_path / "from_environment"))
    for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):  # what the command sets, put back after
        monkeypatch.setenv(name, "before")
    args = cli.parser().parse_args(command + ["--set", "who=prop", "--cache-dir", str(tmp_path / "cache"),
                                              "--lib", "relative/libk3gc.so"])
    opts = cli.command_options(args)
    assert opts.settings == (("who", "prop"),)
    assert opts.kernel_path("fla_path") == str((tmp_path / "from_environment").resolve())
    assert opts.kernel_path("lib") == str(Path("relative/libk3gc.so").resolve())
    assert opts.cache_dir == str((tmp_path / "cache").resolve())
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cache" / "triton").resolve())
