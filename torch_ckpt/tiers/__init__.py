"""The durable tier (an fsspec store), the background replicator and the cleanup of tiers."""
