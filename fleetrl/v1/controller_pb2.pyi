from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_KIND_UNSPECIFIED: _ClassVar[MemberKind]
    GATEWAY: _ClassVar[MemberKind]
    INFERENCE: _ClassVar[MemberKind]
    TRAINER: _ClassVar[MemberKind]
    REFERENCE: _ClassVar[MemberKind]

class RowOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_OUTCOME_UNSPECIFIED: _ClassVar[RowOutcome]
    ACCEPTED: _ClassVar[RowOutcome]
    REJECTED: _ClassVar[RowOutcome]
    FAILED: _ClassVar[RowOutcome]
MEMBER_KIND_UNSPECIFIED: MemberKind
GATEWAY: MemberKind
INFERENCE: MemberKind
TRAINER: MemberKind
REFERENCE: MemberKind
ROW_OUTCOME_UNSPECIFIED: RowOutcome
ACCEPTED: RowOutcome
REJECTED: RowOutcome
FAILED: RowOutcome

class RegisterRequest(_message.Message):
    __slots__ = ("kind", "member_id", "address")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    member_id: str
    address: str
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "run_id", "run_finished", "run_stopped")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RUN_STOPPED_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    run_id: str
    run_finished: bool
    run_stopped: bool
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., run_id: _Optional[str] = ..., run_finished: _Optional[bool] = ..., run_stopped: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id",)
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    def __init__(self, member_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "run_finished", "evaluate_version", "run_stopped")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_STOPPED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    run_finished: bool
    evaluate_version: int
    run_stopped: bool
    def __init__(self, known: _Optional[bool] = ..., run_finished: _Optional[bool] = ..., evaluate_version: _Optional[int] = ..., run_stopped: _Optional[bool] = ...) -> None: ...

class LeaseRowsRequest(_message.Message):
    __slots__ = ("gateway_id", "max_rows", "wait_s", "max_leased")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASED_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    max_rows: int
    wait_s: float
    max_leased: int
    def __init__(self, gateway_id: _Optional[str] = ..., max_rows: _Optional[int] = ..., wait_s: _Optional[float] = ..., max_leased: _Optional[int] = ...) -> None: ...

class LeasedRow(_message.Message):
    __slots__ = ("row_id", "submit_version", "lease_deadline_unix_s", "row_json", "attempt", "lease_tag")
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ROW_JSON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TAG_FIELD_NUMBER: _ClassVar[int]
    row_id: int
    submit_version: int
    lease_deadline_unix_s: float
    row_json: str
    attempt: int
    lease_tag: int
    def __init__(self, row_id: _Optional[int] = ..., submit_version: _Optional[int] = ..., lease_deadline_unix_s: _Optional[float] = ..., row_json: _Optional[str] = ..., attempt: _Optional[int] = ..., lease_tag: _Optional[int] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("member_id", "address", "version")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    version: int
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LeaseRowsResponse(_message.Message):
    __slots__ = ("rows", "run_finished", "retry_after_s", "replicas", "groups_address", "version", "evaluate_version", "run_stopped")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_STOPPED_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[LeasedRow]
    run_finished: bool
    retry_after_s: float
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    groups_address: str
    version: int
    evaluate_version: int
    run_stopped: bool
    def __init__(self, rows: _Optional[_Iterable[_Union[LeasedRow, _Mapping]]] = ..., run_finished: _Optional[bool] = ..., retry_after_s: _Optional[float] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., groups_address: _Optional[str] = ..., version: _Optional[int] = ..., evaluate_version: _Optional[int] = ..., run_stopped: _Optional[bool] = ...) -> None: ...

class RowReport(_message.Message):
    __slots__ = ("row_id", "outcome", "min_version", "reason", "samples_dropped", "samples", "attempt", "rewards", "phase_s")
    class SamplesDroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PhaseSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROW_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    row_id: int
    outcome: RowOutcome
    min_version: int
    reason: str
    samples_dropped: _containers.ScalarMap[str, int]
    samples: int
    attempt: int
    rewards: _containers.RepeatedScalarFieldContainer[float]
    phase_s: _containers.ScalarMap[str, float]
    def __init__(self, row_id: _Optional[int] = ..., outcome: _Optional[_Union[RowOutcome, str]] = ..., min_version: _Optional[int] = ..., reason: _Optional[str] = ..., samples_dropped: _Optional[_Mapping[str, int]] = ..., samples: _Optional[int] = ..., attempt: _Optional[int] = ..., rewards: _Optional[_Iterable[float]] = ..., phase_s: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportRowsRequest(_message.Message):
    __slots__ = ("gateway_id", "reports")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    reports: _containers.RepeatedCompositeFieldContainer[RowReport]
    def __init__(self, gateway_id: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[RowReport, _Mapping]]] = ...) -> None: ...

class ReportRowsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, results: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("kind", "member_id", "address", "alive", "fenced", "version", "last_seen_s_ago")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    member_id: str
    address: str
    alive: bool
    fenced: bool
    version: int
    last_seen_s_ago: float
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., fenced: _Optional[bool] = ..., version: _Optional[int] = ..., last_seen_s_ago: _Optional[float] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "version", "trained_steps", "max_steps", "counters", "members", "finished", "error", "last_metrics")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    trained_steps: int
    max_steps: int
    counters: _containers.ScalarMap[str, int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    finished: bool
    error: str
    last_metrics: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., trained_steps: _Optional[int] = ..., max_steps: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., finished: _Optional[bool] = ..., error: _Optional[str] = ..., last_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportEvalRequest(_message.Message):
    __slots__ = ("version", "metrics", "gateway_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    metrics: _containers.ScalarMap[str, float]
    gateway_id: str
    def __init__(self, version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., gateway_id: _Optional[str] = ...) -> None: ...

class ReportEvalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
