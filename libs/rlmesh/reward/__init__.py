"""Rewards: rule scorers, user functions by path, a reward model (torch), the scoring core and its
client. Import from the submodules: the package imports nothing, so the pre-flight (loader, scorer)
does not pay for the gRPC and Redis clients."""
