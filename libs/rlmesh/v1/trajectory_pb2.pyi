from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptTask(_message.Message):
    __slots__ = ("uid", "group_uid", "sample_offset", "n", "prompt_ids", "prompt_text", "ground_truth", "data_source", "extra_info_json", "policy_version", "sampling_params", "step", "validation", "enqueued_unix_ms", "greedy_baseline")
    UID_FIELD_NUMBER: _ClassVar[int]
    GROUP_UID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_BASELINE_FIELD_NUMBER: _ClassVar[int]
    uid: str
    group_uid: str
    sample_offset: int
    n: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    ground_truth: str
    data_source: str
    extra_info_json: str
    policy_version: int
    sampling_params: _common_pb2.SamplingParams
    step: int
    validation: bool
    enqueued_unix_ms: int
    greedy_baseline: bool
    def __init__(self, uid: _Optional[str] = ..., group_uid: _Optional[str] = ..., sample_offset: _Optional[int] = ..., n: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., extra_info_json: _Optional[str] = ..., policy_version: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., step: _Optional[int] = ..., validation: _Optional[bool] = ..., enqueued_unix_ms: _Optional[int] = ..., greedy_baseline: _Optional[bool] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queue_wait_s", "generate_s", "reward_s", "reference_s", "total_s")
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_S_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_wait_s: float
    generate_s: float
    reward_s: float
    reference_s: float
    total_s: float
    def __init__(self, queue_wait_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., reward_s: _Optional[float] = ..., reference_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("uid", "group_uid", "task_uid", "sample_index", "prompt_ids", "response_ids", "rollout_log_probs", "ref_log_probs", "score", "reward_extra", "finish_reason", "policy_version", "replica_id", "timings", "response_text", "ground_truth", "data_source", "step", "validation", "error", "baseline_score", "token_policy_versions", "resumed_tokens")
    class RewardExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UID_FIELD_NUMBER: _ClassVar[int]
    GROUP_UID_FIELD_NUMBER: _ClassVar[int]
    TASK_UID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    REWARD_EXTRA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BASELINE_SCORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    group_uid: str
    task_uid: str
    sample_index: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_log_probs: _containers.RepeatedScalarFieldContainer[float]
    ref_log_probs: _containers.RepeatedScalarFieldContainer[float]
    score: float
    reward_extra: _containers.ScalarMap[str, float]
    finish_reason: str
    policy_version: int
    replica_id: str
    timings: StageTimings
    response_text: str
    ground_truth: str
    data_source: str
    step: int
    validation: bool
    error: _common_pb2.SampleError
    baseline_score: float
    token_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    resumed_tokens: int
    def __init__(self, uid: _Optional[str] = ..., group_uid: _Optional[str] = ..., task_uid: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., rollout_log_probs: _Optional[_Iterable[float]] = ..., ref_log_probs: _Optional[_Iterable[float]] = ..., score: _Optional[float] = ..., reward_extra: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., response_text: _Optional[str] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., step: _Optional[int] = ..., validation: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.SampleError, _Mapping]] = ..., baseline_score: _Optional[float] = ..., token_policy_versions: _Optional[_Iterable[int]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PartialSample(_message.Message):
    __slots__ = ("output_ids", "log_probs", "token_policy_versions", "finish_reason", "resumed_tokens")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    token_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    resumed_tokens: int
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., log_probs: _Optional[_Iterable[float]] = ..., token_policy_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class TrajectoryBatch(_message.Message):
    __slots__ = ("trajectories", "step")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    step: int
    def __init__(self, trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class ReplicaRegistration(_message.Message):
    __slots__ = ("replica_id", "grpc_address", "engine_url", "engine", "policy_version", "capacity", "weight_sync_ranks", "heartbeat_unix_ms", "state", "engine_device")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_RANKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    grpc_address: str
    engine_url: str
    engine: str
    policy_version: int
    capacity: int
    weight_sync_ranks: int
    heartbeat_unix_ms: int
    state: str
    engine_device: str
    def __init__(self, replica_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., engine_url: _Optional[str] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., capacity: _Optional[int] = ..., weight_sync_ranks: _Optional[int] = ..., heartbeat_unix_ms: _Optional[int] = ..., state: _Optional[str] = ..., engine_device: _Optional[str] = ...) -> None: ...
