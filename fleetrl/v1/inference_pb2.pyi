from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "n", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "ignore_eos", "request_id", "seeds", "stop")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    request_id: str
    seeds: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., seeds: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "prompt_len", "versions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prompt_len: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prompt_len: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("model", "engine", "loaded_version", "loaded_checksum", "queue_depth", "tokens_per_s", "generated_tokens", "requests", "relay_address", "relay_version", "workers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine: str
    loaded_version: int
    loaded_checksum: str
    queue_depth: int
    tokens_per_s: float
    generated_tokens: int
    requests: int
    relay_address: str
    relay_version: int
    workers: int
    def __init__(self, model: _Optional[str] = ..., engine: _Optional[str] = ..., loaded_version: _Optional[int] = ..., loaded_checksum: _Optional[str] = ..., queue_depth: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., requests: _Optional[int] = ..., relay_address: _Optional[str] = ..., relay_version: _Optional[int] = ..., workers: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "source", "timeout_s", "relay", "transport", "group_replicas")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    timeout_s: float
    relay: bool
    transport: str
    group_replicas: int
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ..., timeout_s: _Optional[float] = ..., relay: _Optional[bool] = ..., transport: _Optional[str] = ..., group_replicas: _Optional[int] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version", "checksum", "transfer_s", "pause_s", "transport")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: str
    transfer_s: float
    pause_s: float
    transport: str
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[str] = ..., transfer_s: _Optional[float] = ..., pause_s: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class JoinEngineGroupRequest(_message.Message):
    __slots__ = ("engine", "engine_init_json", "timeout_s")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INIT_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    engine: str
    engine_init_json: str
    timeout_s: float
    def __init__(self, engine: _Optional[str] = ..., engine_init_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StartEngineUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineUpdateRequest(_message.Message):
    __slots__ = ("version", "update_info_json", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    update_info_json: str
    timeout_s: float
    def __init__(self, version: _Optional[int] = ..., update_info_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FinishEngineUpdateRequest(_message.Message):
    __slots__ = ("version", "abort")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    abort: bool
    def __init__(self, version: _Optional[int] = ..., abort: _Optional[bool] = ...) -> None: ...

class EngineCallResponse(_message.Message):
    __slots__ = ("loaded_version",)
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    loaded_version: int
    def __init__(self, loaded_version: _Optional[int] = ...) -> None: ...
