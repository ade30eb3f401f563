from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutSample(_message.Message):
    __slots__ = ("tokens", "logprobs", "loss_mask", "reward", "finish_reason", "text", "versions", "metrics", "member", "turn_rewards", "turn_ends")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TURN_ENDS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    finish_reason: str
    text: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    metrics: _containers.ScalarMap[str, float]
    member: int
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    turn_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., member: _Optional[int] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., turn_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("row_id", "submit_version", "samples", "auth_token", "source", "attempt", "lease_tag")
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TAG_FIELD_NUMBER: _ClassVar[int]
    row_id: int
    submit_version: int
    samples: _containers.RepeatedCompositeFieldContainer[RolloutSample]
    auth_token: str
    source: str
    attempt: int
    lease_tag: int
    def __init__(self, row_id: _Optional[int] = ..., submit_version: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[RolloutSample, _Mapping]]] = ..., auth_token: _Optional[str] = ..., source: _Optional[str] = ..., attempt: _Optional[int] = ..., lease_tag: _Optional[int] = ...) -> None: ...
