"""Processes: the KV-A worker pool (parent side), its protocol and child, the fork server,
the deployments that host production's worker side, lifetimes, budgets, devices and
temporary directories."""
