from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSample(_message.Message):
    __slots__ = ("uid", "prompt_text", "prompt_ids", "response_text", "response_ids", "ground_truth", "data_source", "extra_info_json")
    UID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    uid: str
    prompt_text: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_text: str
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    ground_truth: str
    data_source: str
    extra_info_json: str
    def __init__(self, uid: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_text: _Optional[str] = ..., response_ids: _Optional[_Iterable[int]] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[RewardSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[RewardSample, _Mapping]]] = ...) -> None: ...

class RewardResult(_message.Message):
    __slots__ = ("uid", "score", "extra", "error")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    uid: str
    score: float
    extra: _containers.ScalarMap[str, float]
    error: _common_pb2.SampleError
    def __init__(self, uid: _Optional[str] = ..., score: _Optional[float] = ..., extra: _Optional[_Mapping[str, float]] = ..., error: _Optional[_Union[_common_pb2.SampleError, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RewardResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RewardResult, _Mapping]]] = ...) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("functions", "max_batch_size", "max_concurrency")
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedScalarFieldContainer[str]
    max_batch_size: int
    max_concurrency: int
    def __init__(self, functions: _Optional[_Iterable[str]] = ..., max_batch_size: _Optional[int] = ..., max_concurrency: _Optional[int] = ...) -> None: ...
