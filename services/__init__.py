"""rlmesh services: one folder each, thin shells over ``rlmesh`` (libs/). Services never import
each other; they talk over gRPC and Redis."""
