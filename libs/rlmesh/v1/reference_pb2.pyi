from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogProbsSample(_message.Message):
    __slots__ = ("uid", "prompt_ids", "response_ids")
    UID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[LogProbsSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[LogProbsSample, _Mapping]]] = ...) -> None: ...

class LogProbsResult(_message.Message):
    __slots__ = ("uid", "log_probs", "error")
    UID_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    uid: str
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    error: _common_pb2.SampleError
    def __init__(self, uid: _Optional[str] = ..., log_probs: _Optional[_Iterable[float]] = ..., error: _Optional[_Union[_common_pb2.SampleError, _Mapping]] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LogProbsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LogProbsResult, _Mapping]]] = ...) -> None: ...

class ReferenceInfo(_message.Message):
    __slots__ = ("model_path", "dtype", "vocab_size", "max_tokens_per_batch", "max_batch_size", "busy_s", "busy_intervals")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_INTERVALS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    dtype: str
    vocab_size: int
    max_tokens_per_batch: int
    max_batch_size: int
    busy_s: float
    busy_intervals: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_tokens_per_batch: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., busy_s: _Optional[float] = ..., busy_intervals: _Optional[_Iterable[float]] = ...) -> None: ...
