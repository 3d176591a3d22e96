"""The scheduler simulator: replay a job trace on a simulated cluster (with spot
interruptions from real spot traces) under a policy, and measure what the policy did."""

from visionloop.sched.sim.cluster import (
    DEFAULT_SPOT_TRACES,
    ClusterSpec,
    NodeSpec,
    default_cluster,
    default_spot_traces,
    entitlement_teams,
)
from visionloop.sched.sim.config import Scheduler, SimConfig, SimError
from visionloop.sched.sim.engine import Simulation, simulate
from visionloop.sched.sim.metrics import SIZE_BUCKETS, size_bucket, summarize
from visionloop.sched.sim.result import JobRecord, SimResult
from visionloop.sched.sim.trace import SpotTrace, TraceJob, load_spot_trace, load_trace, spot_trace

__all__ = [
    "DEFAULT_SPOT_TRACES",
    "SIZE_BUCKETS",
    "ClusterSpec",
    "JobRecord",
    "NodeSpec",
    "Scheduler",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulation",
    "SpotTrace",
    "TraceJob",
    "default_cluster",
    "default_spot_traces",
    "entitlement_teams",
    "load_spot_trace",
    "load_trace",
    "simulate",
    "size_bucket",
    "spot_trace",
    "summarize",
]
