"""The weight-sync format learner and engine share: bucket layout, group init (imports neither side)."""
