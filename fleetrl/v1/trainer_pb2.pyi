from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineReplica(_message.Message):
    __slots__ = ("name", "address", "workers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    workers: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...

class PushEngineRequest(_message.Message):
    __slots__ = ("version", "replicas")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    version: int
    replicas: _containers.RepeatedCompositeFieldContainer[EngineReplica]
    def __init__(self, version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[EngineReplica, _Mapping]]] = ...) -> None: ...

class PushEngineResponse(_message.Message):
    __slots__ = ("version", "engine", "stream", "failed", "error", "builds", "fallbacks", "engine_name", "push_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUILDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    engine: _containers.RepeatedScalarFieldContainer[str]
    stream: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    error: str
    builds: int
    fallbacks: int
    engine_name: str
    push_s: float
    def __init__(self, version: _Optional[int] = ..., engine: _Optional[_Iterable[str]] = ..., stream: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., builds: _Optional[int] = ..., fallbacks: _Optional[int] = ..., engine_name: _Optional[str] = ..., push_s: _Optional[float] = ...) -> None: ...

class GroupRef(_message.Message):
    __slots__ = ("row_id", "attempt", "lease_tag")
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TAG_FIELD_NUMBER: _ClassVar[int]
    row_id: int
    attempt: int
    lease_tag: int
    def __init__(self, row_id: _Optional[int] = ..., attempt: _Optional[int] = ..., lease_tag: _Optional[int] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("step", "row_ids", "data_position", "wait_timeout_s", "groups", "superseded")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    step: int
    row_ids: _containers.RepeatedScalarFieldContainer[int]
    data_position: str
    wait_timeout_s: float
    groups: _containers.RepeatedCompositeFieldContainer[GroupRef]
    superseded: _containers.RepeatedCompositeFieldContainer[GroupRef]
    def __init__(self, step: _Optional[int] = ..., row_ids: _Optional[_Iterable[int]] = ..., data_position: _Optional[str] = ..., wait_timeout_s: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[GroupRef, _Mapping]]] = ..., superseded: _Optional[_Iterable[_Union[GroupRef, _Mapping]]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "version", "published", "weights_address", "metrics", "skipped_row_ids", "already_trained", "checkpoint_path", "samples", "weights_bytes")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_TRAINED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    published: bool
    weights_address: str
    metrics: _containers.ScalarMap[str, float]
    skipped_row_ids: _containers.RepeatedScalarFieldContainer[int]
    already_trained: bool
    checkpoint_path: str
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    weights_bytes: int
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., published: _Optional[bool] = ..., weights_address: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., skipped_row_ids: _Optional[_Iterable[int]] = ..., already_trained: _Optional[bool] = ..., checkpoint_path: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class TrainSample(_message.Message):
    __slots__ = ("row_id", "prompt", "completion", "reward", "version_offset", "finish_reason", "prompt_token_ids", "completion_token_ids")
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    row_id: int
    prompt: str
    completion: str
    reward: float
    version_offset: int
    finish_reason: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, row_id: _Optional[int] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reward: _Optional[float] = ..., version_offset: _Optional[int] = ..., finish_reason: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "weights_address", "checksum", "publish_s", "weights_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_address: str
    checksum: str
    publish_s: float
    weights_bytes: int
    def __init__(self, version: _Optional[int] = ..., weights_address: _Optional[str] = ..., checksum: _Optional[str] = ..., publish_s: _Optional[float] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("data_position",)
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    data_position: str
    def __init__(self, data_position: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("data_position",)
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    data_position: str
    def __init__(self, data_position: _Optional[str] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("checkpoint_path", "export_path", "version")
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    EXPORT_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    checkpoint_path: str
    export_path: str
    version: int
    def __init__(self, checkpoint_path: _Optional[str] = ..., export_path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatusResponse(_message.Message):
    __slots__ = ("model", "steps_done", "version", "published_version", "weights_address", "groups_address", "buffered_groups", "trained_rows", "samples_dropped", "last_metrics", "world_size")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    steps_done: int
    version: int
    published_version: int
    weights_address: str
    groups_address: str
    buffered_groups: int
    trained_rows: int
    samples_dropped: int
    last_metrics: _containers.ScalarMap[str, float]
    world_size: int
    def __init__(self, model: _Optional[str] = ..., steps_done: _Optional[int] = ..., version: _Optional[int] = ..., published_version: _Optional[int] = ..., weights_address: _Optional[str] = ..., groups_address: _Optional[str] = ..., buffered_groups: _Optional[int] = ..., trained_rows: _Optional[int] = ..., samples_dropped: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., world_size: _Optional[int] = ...) -> None: ...
