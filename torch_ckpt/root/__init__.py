"""A run root: step directories, temporaries and reservations, the root lock, committed-step scanning and node-
local roots.
"""
