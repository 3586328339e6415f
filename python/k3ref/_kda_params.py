"""A KDA parameter object (a golden's params, a prop case, an adapter's params) as the KDA
references' keyword options: the golden schema's names mapped once onto the references' option
names. A module of its own, handed on as k3ref.kda_options, so that k3ref.goldens (Case.options)
reads it without importing the references."""
from __future__ import annotations

from typing import Any, Mapping


def kda_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """The kda / kda_contract keyword arguments of a KDA parameter object (a golden's params,
    a prop case, an adapter's params): `qk_l2norm` -> `l2norm`, ...; a key absent takes the
    option's default."""
    return dict(gate=params.get("gate", "log_decay"), gate_base=params.get("gate_base", "e"),
                lower_bound=params.get("lower_bound"), beta=params.get("beta", "as_given"),
                l2norm=bool(params.get("qk_l2norm")), scale=params.get("scale"),
                state_layout=params.get("state_layout", "k_first"))
