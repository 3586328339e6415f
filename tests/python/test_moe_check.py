"""k3ref.moe_check (python/k3ref/moe_check.py) on the committed moe.latent goldens with
torchtitan's quantile_balance.py, where a checkout is present (.thirdparty/torchtitan or
$K3REF_TORCHTITAN_PATH; skipped otherwise): the bias carried over the batches stays within
its tolerance of the golden's, routing agrees outside near-ties, MaxVio agrees where the loads
do; and a sign-flipped update is caught."""
import os
from pathlib import Path

import pytest

from conftest import GOLDENS, ROOT

torch = pytest.importorskip("torch")

CHECKOUT = Path(os.environ.get("K3REF_TORCHTITAN_PATH", ROOT / ".thirdparty" / "torchtitan"))
if not (CHECKOUT / "torchtitan" / "models" / "kimi_k3" / "quantile_balance.py").exists():
    pytest.skip(f"no torchtitan checkout at {CHECKOUT}", allow_module_level=True)


def rows(qb_transform=None):
    from k3ref import moe_check
    model, qb, _ = moe_check.load_torchtitan(str(CHECKOUT))
    if qb_transform:
        original = qb.quantile_balance_bias
        qb.quantile_balance_bias = lambda *a, **k: qb_transform(original(*a, **k))
    out = []
    for path in sorted(GOLDENS.glob("latent_moe_*.safetensors")):
        out += [r for r in moe_check.check_case(path, model, qb, "cpu") if "skipped" not in r]
    return out


def test_torchtitans_qb_update_carried_over_the_batches_matches_the_goldens():
    checked = rows()
    assert len(checked) >= 8
    for r in checked:
        where = f"{r['case']} batch {r['batch']}"
        assert r["carried_bias_error"] <= r["bias_tolerance"], where
        assert r["selection_differs_outside_ties"] == 0, where
        if r["near_ties"] == 0:
            assert r["loads_equal"] and r["max_vio"] == r["golden_max_vio"], where
        assert r["optimum_max_vio"] == 0 and r["max_vio"] >= 0, where
    assert any(r["batch"] > 0 and r["carried_bias_error"] > 0 for r in checked)  # state was carried


def test_a_sign_flipped_update_is_caught():
    flipped = rows(lambda b: -b)
    assert any(r["carried_bias_error"] > r["bias_tolerance"] for r in flipped)
