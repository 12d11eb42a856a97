"""Typed, validated descriptions of models, devices, clusters, training and plans. No torch here."""

from fivefold.spec.cluster import Calibration, ClusterSpec, Link, NodeGroup, parse_cluster
from fivefold.spec.devices import CATALOG, DeviceSpec, device_named
from fivefold.spec.model import PRESETS, ModelSpec, parse_model
from fivefold.spec.plan import CP_METHODS, MESH_DIMS, RECOMPUTE, SCHEDULES, Plan, divisors, load_plan, plan_from_dict
from fivefold.spec.layout import layout_plan, parse_layers_per_stage
from fivefold.spec.train import TrainSpec, default_dtype

__all__ = ["CATALOG", "CP_METHODS", "Calibration", "ClusterSpec", "DeviceSpec", "Link", "MESH_DIMS", "ModelSpec",
           "NodeGroup", "PRESETS", "Plan", "RECOMPUTE", "SCHEDULES", "TrainSpec", "default_dtype", "device_named",
           "divisors", "layout_plan", "load_plan", "parse_cluster", "parse_layers_per_stage", "parse_model",
           "plan_from_dict"]
