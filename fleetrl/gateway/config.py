"""`GatewayConfig`: the rollout gateway's settings around the run `Config` (pure pydantic).

Read by `fleetrl serve gateway` (services/gateway) and by `fleetrl.main()`'s in-process gateways alike; the flags
that fill it are in `fleetrl.gateway.flags`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleetrl.config import Config, ConfigError, build_service_config

MAX_COMPLETIONS_PER_PROMPT = 65536
"""The largest group a gateway runs: its G rollouts, results and samples are held in memory together (a value
like 1e11 would crash the gateway at its first row, and a supervisor would restart it again and again)."""


class GatewayConfig(BaseModel):
    """One rollout gateway's settings: the run `Config` plus the gateway's own (user code specs, timeouts, breaker)."""

    # allow_inf_nan=False: temperature = inf (or any non-finite float) fails at start, naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    run: Config = Field(..., description="The run config (G, sampling settings, max_concurrency, extras).")
    rollout: str = Field(..., description="The rollout factory: 'module:make_rollout_fn' or 'file.py:attr'.")
    dynamic_filter: str | None = Field(
        None,
        description="Group filter 'module:fn' (fn(PromptGroup) -> keep?, fleetrl.gateway.dynamic_filter); "
        "'uniform' drops equal-reward groups.",
    )
    evaluation: str | None = Field(
        None, description="Evaluator hook 'module:fn' (async fn(setup, rows) -> dict); this gateway then evaluates."
    )
    controller_address: str = Field("127.0.0.1:50050", description="HOST:PORT of the version controller.")
    controller_ready_file: str | None = Field(
        None,
        description="Read the controller's address from its ready file instead, waiting up to "
        "controller_ready_timeout_s for it (so a gateway starts while the controller does).",
    )
    controller_ready_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for controller_ready_file to appear."
    )
    gateway_id: str | None = Field(None, description="Unique id; None = gateway-<host>-<pid>.")
    judge: list[str] = Field(
        default_factory=list,
        description="HOST:PORT of each judge replica (fleetrl up's judge pool): the rollout's setup.judge_sampler.",
    )
    judge_base_url: str | None = Field(None, description="The judge's OpenAI base URL (setup.judge_base_url).")
    judge_model: str | None = Field(None, description="The judge's model (its tokenizer; setup.judge_model).")
    judge_resolve_s: float | None = Field(
        None,
        gt=0,
        description="Each judge HOST:PORT names a DNS name whose every address is a judge replica (compose's "
        "scaled `judge` service), looked up again every this many seconds; None = the addresses as given.",
    )
    max_rows_in_flight: int | None = Field(
        None,
        ge=1,
        description="Rows processed at once; None = ceil(max_concurrency / G) + 1, or without max_concurrency "
        "as many as the off-policy gate can admit at once, P x (O + 1), at least 16.",
    )
    min_samples: int = Field(
        2, ge=2, description="A group with fewer valid samples is rejected; unset = the run's min_group_size."
    )
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="A whole rollout (with its tools) is cancelled, dropped and counted after this."
    )
    generate_timeout_s: float = Field(
        120.0, gt=0, description="One Generate call fails after this and is retried on another replica."
    )
    replica_wait_s: float = Field(
        300.0,
        gt=0,
        description="A Generate call with no routable replica (the only one restarting or catching up) waits this "
        "long for one before it fails; such a failure is an outage, not counted by the circuit breaker.",
    )
    eval_timeout_s: float = Field(
        1800.0, gt=0, description="The evaluation hook is cancelled (and reported failed) after this."
    )
    breaker_window: int = Field(100, ge=1, description="Circuit breaker: rollouts judged (in start order).")
    breaker_min_attempts: int = Field(20, ge=1, description="Circuit breaker: judge only with this many outcomes.")
    breaker_max_failure_rate: float = Field(
        0.5, gt=0, le=1, description="Circuit breaker: stop the gateway when this share of the window failed."
    )
    rollout_retries: int = Field(3, ge=1, description="Attempts for a rollout failing with a recoverable error.")
    send_timeout_s: float = Field(60.0, gt=0, description="Pushing a group to the trainer fails after this.")
    max_group_mb: int = Field(
        32,
        ge=1,
        description="The trainer's max_group_mb: a group whose message is larger is rejected here, loudly, before "
        "sending (the trainer's socket would drop it silently and its step would wait for it).",
    )
    rpc_timeout_s: float = Field(30.0, gt=0, description="Controller calls fail after this.")
    lease_wait_s: float = Field(
        0.5,
        ge=0,
        le=5,
        description="With rows to spare and none leasable, the LeaseRows call is held up to this long until some "
        "are (the controller wakes it when the gate opens), instead of polling every 0.2 s; 0 = poll.",
    )
    controller_lost_s: float = Field(120.0, gt=0, description="Give up when the controller is unreachable this long.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="/metrics port (0 = pick, None = off).")
    metrics_linger_s: float = Field(
        0.0, ge=0, description="Keep /metrics up this long after the run so Prometheus scrapes the final values."
    )
    host: str = Field("127.0.0.1", description="Address the metrics endpoint binds to.")
    auth_token: str | None = Field(None, description="Shared token; None = $FLEETRL_AUTH_TOKEN.")
    ready_file: str | None = Field(None, description="Write the metrics port here once running.")
    log_level: str = Field("INFO", description="Python log level name.")

    @model_validator(mode="after")
    def _check_group_size(self) -> GatewayConfig:
        g = self.run.completions_per_prompt
        if g > MAX_COMPLETIONS_PER_PROMPT:
            raise ValueError(
                f"run.completions_per_prompt = {g}: at most {MAX_COMPLETIONS_PER_PROMPT} (a row's samples are held "
                "and sent together as one group)"
            )
        return self

    @field_validator("judge", mode="before")
    @classmethod
    def _no_empty_judges(cls, value: Any) -> Any:
        """An empty --judge (compose's unset FLEETRL_JUDGE) means none."""
        return [v for v in value if v] if isinstance(value, list) else value

    @field_validator("judge_base_url", "judge_model", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return value or None

    @model_validator(mode="after")
    def _check_judge(self) -> GatewayConfig:
        for name in ("judge_base_url", "judge_model"):
            if getattr(self, name) is not None and not self.judge:
                raise ValueError(f"{name}: a judge setting needs the judge replicas' addresses (--judge HOST:PORT)")
        return self

    @model_validator(mode="after")
    def _check_breaker(self) -> GatewayConfig:
        if self.breaker_min_attempts > self.breaker_window:
            raise ValueError(
                f"breaker_min_attempts ({self.breaker_min_attempts}) must be <= breaker_window ({self.breaker_window})"
            )
        return self

    @property
    def rows_in_flight(self) -> int:
        """Rows leased and processed at once (`max_rows_in_flight`, else from max_concurrency and G, else enough
        for every row the gate admits at once, P x (O + 1), so an async run's O versions overlap)."""
        if self.max_rows_in_flight is not None:
            return self.max_rows_in_flight
        c, g = self.run.max_concurrency, self.run.completions_per_prompt
        if c is not None:
            return -(-c // g) + 1
        return max(16, self.run.prompt_groups_per_step * (self.run.max_head_offpolicy_versions + 1))

    @classmethod
    def build(cls, data: dict[str, Any]) -> GatewayConfig:
        return build_service_config(cls, data, "gateway", ConfigError)
