"""Parallel layout over vendor islands, group classification and back-end choice."""

from bimetal.parallel.context import HierarchicalGroups, ParallelContext, init_parallel
from bimetal.parallel.groups import GroupSpec, format_group_table, plan_groups
from bimetal.parallel.layout import Layout, LayoutError, ParallelDims, plan_layout

__all__ = [
    "GroupSpec",
    "HierarchicalGroups",
    "Layout",
    "LayoutError",
    "ParallelContext",
    "ParallelDims",
    "format_group_table",
    "init_parallel",
    "plan_groups",
    "plan_layout",
]
