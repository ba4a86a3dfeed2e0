"""`flagdeploy plan`: will it fit, and how to split it.

`ledger` (weights by family and dtype, KV per token, linear-attention state per sequence, from the
model's config), `cost` (per-device memory and a roofline + collectives estimate of one layout),
`search` (every TP x DP x EP x PP layout, rejected or ranked), `report` (the table and the JSON),
`profile` (the neutral deployment profile) and `emit` (each external engine's command line); `pd` and
`pd_emit` (`plan --pd`: a layout per role of a prefill-decode disaggregated deployment, whether it pays, and the
roles' and the router's launches); `held`
measures what a loaded model really holds, by format, for `serve`'s line after loading.
"""

from .cost import Layout
from .ledger import PlanInputError
from .profile import Profile
from .search import Plan, PlanRequest, make_plan

__all__ = ["Layout", "Plan", "PlanInputError", "PlanRequest", "Profile", "make_plan"]
