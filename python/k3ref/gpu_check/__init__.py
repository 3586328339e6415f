"""k3ref.gpu_check: real kernels against the k3ref references (docs/gpu_check.md; docs/design.md
section 9; docs/verify-your-kernel.md for your own kernel's CI).

    python3 -m k3ref.gpu_check run [--adapter MOD:NAME ...] --out report/
    python3 -m k3ref.gpu_check prop --kernel NAME

Modules: `protocol` (the adapter protocol, CheckResult, the run configuration RunOptions),
`adapters` (the built-in KDA adapters), `upstream` (loading the upstream
projects' kernels: checkout paths, FLA's import and version line), `registry` (entry points, --adapter specs, conftest
lists; the built-ins by spec; the tiers by name), `collection` (the tests: adapter x case x check,
known limitations, verdicts), `run` (a run: the adapters and goldens it selects, its plan of
tests and warm-up, decided once, and one test executed in the worker that holds its kernel),
`checks` (golden and metamorphic KDA checks), `problems` (the
problems of the checks without a golden: configurations, inputs by seed, token slices), `attnres_check`, `qb_check`, `serving_check`
(the other families), `metrics` (error metrics, on the GPU through libk3gc when available),
`lib` (libk3gc.so through k3ref._core's binding K3gc), `references` (the one reference path: k3ref._core, libk3gc fp64 for long cases), `torch_model` (the KDA recurrence in PyTorch fp64: a kernel under test), `timing`
(import, Triton compile, autotune and check time), `report` (HTML and JSON from pytest's results), `prop`
(property tests), `backward` (gradients), `cp_check` (context parallelism over P ranks), `bench`
(comparator and reference speed), `warmup` (the cache directory and the warm-up's scheduler),
`warmup_worker` (a warm-up worker process), `warmup_command` (the `warmup` command, in a child),
`cli` (the `run` front end of the pytest plugin, `prop`, `warmup`). The runner is the pytest plugin, k3ref.pytest_plugin.
"""
__all__ = ["protocol", "adapters", "upstream", "registry", "collection", "run", "checks", "problems", "attnres_check", "qb_check", "serving_check",
           "metrics", "lib", "references", "torch_model", "timing", "report", "prop", "backward", "cp_check", "bench", "warmup", "warmup_worker",
           "warmup_command", "cli"]
