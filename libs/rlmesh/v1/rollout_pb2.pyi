from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateInput(_message.Message):
    __slots__ = ("uid", "prompt_ids")
    UID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "sampling_params", "return_logprob")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[GenerateInput]
    sampling_params: _common_pb2.SamplingParams
    return_logprob: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[GenerateInput, _Mapping]]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ...) -> None: ...

class GenerateOutput(_message.Message):
    __slots__ = ("uid", "sample_index", "output_ids", "output_log_probs", "finish_reason", "policy_version", "error")
    UID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    uid: str
    sample_index: int
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_log_probs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    policy_version: int
    error: _common_pb2.SampleError
    def __init__(self, uid: _Optional[str] = ..., sample_index: _Optional[int] = ..., output_ids: _Optional[_Iterable[int]] = ..., output_log_probs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.SampleError, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GenerateOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[GenerateOutput, _Mapping]]] = ...) -> None: ...

class RolloutInfo(_message.Message):
    __slots__ = ("replica_id", "engine", "engine_url", "policy_version", "state", "running_requests", "capacity", "tokens_per_s", "tasks_done")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    engine: str
    engine_url: str
    policy_version: int
    state: str
    running_requests: int
    capacity: int
    tokens_per_s: float
    tasks_done: int
    def __init__(self, replica_id: _Optional[str] = ..., engine: _Optional[str] = ..., engine_url: _Optional[str] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., running_requests: _Optional[int] = ..., capacity: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., tasks_done: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained", "unfinished", "message")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    unfinished: int
    message: str
    def __init__(self, drained: _Optional[bool] = ..., unfinished: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
