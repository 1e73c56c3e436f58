"""The run loop: one PPO step at a time (collect, train, push, checkpoint), what it is wired to and
reports, the rank protocol, starting the follower ranks, and the ``Learner`` servicer."""
