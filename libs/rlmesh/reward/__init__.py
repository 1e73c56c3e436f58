"""Rewards: the rule scorers (gsm8k, math, math_dapo, arithmetic), user functions by path, a reward
model, the batch scoring core ``RewardScorer`` (no gRPC needed) and ``RewardClient`` for callers.

``rlmesh.reward.model`` (the reward model, imports torch) is imported only when a model is used.
"""

from rlmesh.reward.addresses import get_reward_addresses, reward_addresses_key, set_reward_addresses
from rlmesh.reward.builtin import BUILTIN_FUNCTIONS, DATA_SOURCES, builtin_for, default_compute_score
from rlmesh.reward.client import RewardClient
from rlmesh.reward.loader import (
    RewardFunction,
    RewardFunctionLoadError,
    builtin_function,
    load_reward_function,
)
from rlmesh.reward.scorer import InvalidRequestError, RewardMetrics, RewardScorer
from rlmesh.runtime.addresses import AddressSource, RedisAddresses, StaticAddresses
from rlmesh.runtime.balancer import BalancedCaller, ServiceCallError

__all__ = [
    "BUILTIN_FUNCTIONS",
    "DATA_SOURCES",
    "AddressSource",
    "BalancedCaller",
    "InvalidRequestError",
    "RedisAddresses",
    "RewardClient",
    "RewardFunction",
    "RewardFunctionLoadError",
    "RewardMetrics",
    "RewardScorer",
    "ServiceCallError",
    "StaticAddresses",
    "builtin_for",
    "builtin_function",
    "default_compute_score",
    "get_reward_addresses",
    "load_reward_function",
    "reward_addresses_key",
    "set_reward_addresses",
]
