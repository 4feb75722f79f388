"""Pure decisions, no I/O: when to save (schedules, Young/Daly interval), what to keep (retention), step naming,
preemption signals, and which steps are live (lineage).
"""
