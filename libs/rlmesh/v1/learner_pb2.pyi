from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LearnerPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEARNER_PHASE_UNSPECIFIED: _ClassVar[LearnerPhase]
    LEARNER_PHASE_STARTING: _ClassVar[LearnerPhase]
    LEARNER_PHASE_VALIDATING: _ClassVar[LearnerPhase]
    LEARNER_PHASE_WAITING_FOR_ROLLOUTS: _ClassVar[LearnerPhase]
    LEARNER_PHASE_TRAINING: _ClassVar[LearnerPhase]
    LEARNER_PHASE_PUSHING_WEIGHTS: _ClassVar[LearnerPhase]
    LEARNER_PHASE_CHECKPOINTING: _ClassVar[LearnerPhase]
    LEARNER_PHASE_PAUSED: _ClassVar[LearnerPhase]
    LEARNER_PHASE_STOPPING: _ClassVar[LearnerPhase]
    LEARNER_PHASE_FINISHED: _ClassVar[LearnerPhase]
    LEARNER_PHASE_FAILED: _ClassVar[LearnerPhase]
LEARNER_PHASE_UNSPECIFIED: LearnerPhase
LEARNER_PHASE_STARTING: LearnerPhase
LEARNER_PHASE_VALIDATING: LearnerPhase
LEARNER_PHASE_WAITING_FOR_ROLLOUTS: LearnerPhase
LEARNER_PHASE_TRAINING: LearnerPhase
LEARNER_PHASE_PUSHING_WEIGHTS: LearnerPhase
LEARNER_PHASE_CHECKPOINTING: LearnerPhase
LEARNER_PHASE_PAUSED: LearnerPhase
LEARNER_PHASE_STOPPING: LearnerPhase
LEARNER_PHASE_FINISHED: LearnerPhase
LEARNER_PHASE_FAILED: LearnerPhase

class LearnerStatus(_message.Message):
    __slots__ = ("run_id", "step", "total_steps", "policy_version", "phase", "paused", "metrics", "live_replicas", "last_checkpoint", "message", "hyperparams")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class HyperparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    total_steps: int
    policy_version: int
    phase: LearnerPhase
    paused: bool
    metrics: _containers.ScalarMap[str, float]
    live_replicas: int
    last_checkpoint: str
    message: str
    hyperparams: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., phase: _Optional[_Union[LearnerPhase, str]] = ..., paused: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., live_replicas: _Optional[int] = ..., last_checkpoint: _Optional[str] = ..., message: _Optional[str] = ..., hyperparams: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class UpdateHyperparamsRequest(_message.Message):
    __slots__ = ("kl_coef", "actor_lr", "entropy_coeff", "temperature", "critic_lr", "kl_loss_coef", "clip_ratio", "top_p")
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    ACTOR_LR_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEFF_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CRITIC_LR_FIELD_NUMBER: _ClassVar[int]
    KL_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    CLIP_RATIO_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    kl_coef: float
    actor_lr: float
    entropy_coeff: float
    temperature: float
    critic_lr: float
    kl_loss_coef: float
    clip_ratio: float
    top_p: float
    def __init__(self, kl_coef: _Optional[float] = ..., actor_lr: _Optional[float] = ..., entropy_coeff: _Optional[float] = ..., temperature: _Optional[float] = ..., critic_lr: _Optional[float] = ..., kl_loss_coef: _Optional[float] = ..., clip_ratio: _Optional[float] = ..., top_p: _Optional[float] = ...) -> None: ...

class UpdateHyperparamsResponse(_message.Message):
    __slots__ = ("applies_from_step", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    APPLIES_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    applies_from_step: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, applies_from_step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    def __init__(self, checkpoint: _Optional[bool] = ...) -> None: ...
