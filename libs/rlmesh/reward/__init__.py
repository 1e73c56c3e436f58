"""Rewards: rule scorers, user functions by path, a reward model (``rlmesh.reward.model`` imports torch
and is imported only when a model is used), the scoring core ``RewardScorer`` and ``RewardClient``."""

from rlmesh.reward.addresses import get_reward_addresses, reward_addresses_key, set_reward_addresses
from rlmesh.reward.builtin import (
    BUILTIN_FUNCTIONS,
    DATA_SOURCE_PREFIXES,
    DATA_SOURCES,
    builtin_for,
    data_source_rules,
    default_compute_score,
)
from rlmesh.reward.client import RewardClient
from rlmesh.reward.loader import (
    RewardFunction,
    RewardFunctionLoadError,
    builtin_function,
    load_reward_function,
)
from rlmesh.reward.metrics import RewardMetrics
from rlmesh.reward.samples import InvalidRequestError
from rlmesh.reward.scorer import RewardScorer
from rlmesh.runtime.addresses import AddressSource, RedisAddresses, StaticAddresses
from rlmesh.runtime.balancer import BalancedCaller, ServiceCallError

__all__ = [
    "BUILTIN_FUNCTIONS",
    "DATA_SOURCES",
    "DATA_SOURCE_PREFIXES",
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
    "data_source_rules",
    "default_compute_score",
    "get_reward_addresses",
    "load_reward_function",
    "reward_addresses_key",
    "set_reward_addresses",
]
