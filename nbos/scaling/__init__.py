"""Placement policies, executor choice and (later) migration, autoscaling and the simulator.

Policies are found by name through the entry point group ``nbos.placement_policies``;
see ``docs/placement.md`` for writing one.
"""

from nbos.scaling._admission import admissible, subscription_ratio
from nbos.scaling.executor import Choice, Execute, Migrate, Wait, choose_executor
from nbos.scaling.policies import BinPackingPolicy, LeastLoadedPolicy, RandomPolicy
from nbos.scaling.registry import GROUP, available_policies, load_policy

__all__ = [
    "GROUP",
    "BinPackingPolicy",
    "Choice",
    "Execute",
    "LeastLoadedPolicy",
    "Migrate",
    "RandomPolicy",
    "Wait",
    "admissible",
    "available_policies",
    "choose_executor",
    "load_policy",
    "subscription_ratio",
]
