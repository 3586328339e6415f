"""gpu_check: runs real KDA kernels against the k3ref references (DESIGN.md section 10).

Modules: `golden` (reads k3ref golden files), `metrics` (error metrics and tolerance
policies, on the GPU through libk3gc when available, else in PyTorch fp64), `lib` (ctypes
binding of libk3gc.so), `reference` (fp64 KDA recurrences), `adapters` (one per kernel),
`checks` (golden and metamorphic checks), `report` (JUnit XML, JSON, HTML), `cli`.
"""
__all__ = ["golden", "metrics", "lib", "reference", "adapters", "checks", "report", "cli"]
