"""Pure decisions, no I/O: when to save (schedules, the Young/Daly interval), what to keep (retention),
step naming, preemption signals, and which steps are live (lineage)."""

from torch_ckpt.policy._naming import Naming, PatternNaming, StepNaming
from torch_ckpt.policy._retention import KeepAny, KeepEveryNSteps, KeepLatest, RetentionPolicy
from torch_ckpt.policy._schedule import (
    AnyOf,
    Cadence,
    EveryNSeconds,
    EveryNSteps,
    Interval,
    SavePolicy,
    YoungDaly,
    checkpoint_interval,
    daly_interval,
    expected_lost_work,
    expected_overhead,
    young_interval,
)

__all__ = ["SavePolicy", "EveryNSteps", "EveryNSeconds", "YoungDaly", "AnyOf", "Cadence", "RetentionPolicy",
           "KeepLatest", "KeepEveryNSteps", "KeepAny", "Naming", "StepNaming", "PatternNaming", "young_interval",
           "daly_interval", "expected_overhead", "expected_lost_work", "checkpoint_interval", "Interval"]
