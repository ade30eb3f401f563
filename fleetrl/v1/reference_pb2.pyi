from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSequence(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("sequences", "temperature")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    temperature: float
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., temperature: _Optional[float] = ...) -> None: ...

class SequenceLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceLogprobs]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceLogprobs, _Mapping]]] = ...) -> None: ...

class ReferenceStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReferenceStatusResponse(_message.Message):
    __slots__ = ("model", "requests", "sequences", "tokens", "batches", "tokens_per_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests: int
    sequences: int
    tokens: int
    batches: int
    tokens_per_s: float
    def __init__(self, model: _Optional[str] = ..., requests: _Optional[int] = ..., sequences: _Optional[int] = ..., tokens: _Optional[int] = ..., batches: _Optional[int] = ..., tokens_per_s: _Optional[float] = ...) -> None: ...
