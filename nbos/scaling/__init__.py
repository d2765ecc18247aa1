"""Placement policies, executor choice, migration, autoscaling and the trace-driven simulator.

:class:`ClusterDecisions` makes every scheduling decision of one cluster, for the
gateway and the simulator alike; :class:`ClusterModel` is the cluster both
keep up to date event by event; :class:`FairShare` decides which waiting cell may take
GPUs under users' quotas, for both as well.

Policies are found by name through the entry point group ``nbos.placement_policies``;
see ``docs/placement.md`` for writing one.
"""

from nbos.scaling._admission import admissible, subscription_ratio
from nbos.scaling.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    Hold,
    ScaleDecision,
    ScaleIn,
    ScaleOut,
    smoothed_demand_ratio,
)
from nbos.scaling.decisions import CellDecision, ClusterDecisions, ScaleStep
from nbos.scaling.executor import Execute, Wait, check_cell_gpus
from nbos.scaling.fair_share import FairDecision, FairShare, Take, UserGpus, Waiter, Yield
from nbos.scaling.fairness import UserCell, UserFigures, jain_index
from nbos.scaling.ledger import Ledger, Totals
from nbos.scaling.limits import HostLimits
from nbos.scaling.migration import MigrationPlan, plan_migration
from nbos.scaling.model import ClusterModel
from nbos.scaling.policies import BinPackingPolicy, LeastLoadedPolicy, RandomPolicy
from nbos.scaling.registry import GROUP, available_policies, load_policy
from nbos.scaling.results import Run, Sample, SimResult, metrics_table, sim_result
from nbos.scaling.simulator import SimConfig, simulate
from nbos.scaling.trace import Cell, Session, Trace, first_hours, load_trace, synthetic_trace

__all__ = [
    "GROUP",
    "Autoscaler",
    "AutoscalerConfig",
    "BinPackingPolicy",
    "Cell",
    "CellDecision",
    "ClusterDecisions",
    "ClusterModel",
    "Execute",
    "FairDecision",
    "FairShare",
    "Hold",
    "HostLimits",
    "LeastLoadedPolicy",
    "Ledger",
    "MigrationPlan",
    "RandomPolicy",
    "Run",
    "Sample",
    "ScaleDecision",
    "ScaleIn",
    "ScaleOut",
    "ScaleStep",
    "Session",
    "SimConfig",
    "SimResult",
    "Take",
    "Totals",
    "Trace",
    "UserCell",
    "UserFigures",
    "UserGpus",
    "Wait",
    "Waiter",
    "Yield",
    "admissible",
    "available_policies",
    "check_cell_gpus",
    "first_hours",
    "jain_index",
    "load_policy",
    "load_trace",
    "metrics_table",
    "plan_migration",
    "sim_result",
    "simulate",
    "smoothed_demand_ratio",
    "subscription_ratio",
    "synthetic_trace",
]
