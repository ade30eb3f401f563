"""Session recording -> trainable samples (fleetrl.agent_session): joined turns, splits counted, mask on the model's
tokens only, the recorded tokens and logprobs kept verbatim."""

from __future__ import annotations

import pytest

from fleetrl.agent_session import AgentSession, SessionError, SessionTurn, count_splits


def session(*turns: SessionTurn) -> AgentSession:
    s = AgentSession("s1", "http://x/sessions/s1/v1", "key", "policy")
    for t in turns:
        s.record(t)
    return s


T1 = SessionTurn([1, 2, 3], [10, 11], [-0.5, -0.25], [0, 0])
T2_EXTENDS = SessionTurn([1, 2, 3, 10, 11, 4, 5], [12], [-0.125], [1])
T2_RERENDERED = SessionTurn([1, 2, 3, 9, 4, 5], [12, 13], [-0.125, -1.0], [1, 1])


def test_turns_whose_prompts_extend_join_into_one_sample_with_the_servers_tokens_and_logprobs():
    (sample,) = session(T1, T2_EXTENDS).to_rollout_run(reward=1.0).to_samples()
    assert sample.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125]
    assert sample.versions == [0, 0, 0, 0, 0, 0, 0, 1]  # the new prompt tokens carry the previous call's version
    assert sample.metrics == {"session_turns": 2.0, "session_splits": 0.0}
    assert sample.reward == 1.0
    sample.validate()


def test_a_rerendered_history_splits_the_trajectory_and_is_counted():
    run = session(T1, T2_RERENDERED).to_rollout_run(reward=0.5)
    first, second = run.to_samples()
    assert first.tokens == [1, 2, 3, 10, 11] and first.loss_mask == [0, 0, 0, 1, 1]
    assert second.tokens == [1, 2, 3, 9, 4, 5, 12, 13] and second.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1]
    assert second.logprobs[-2:] == [-0.125, -1.0]
    assert first.metrics["session_splits"] == 1.0 and second.reward == 0.5


def test_to_rollout_sample_refuses_a_split_session_naming_to_rollout_run():
    with pytest.raises(SessionError, match="to_rollout_run"):
        session(T1, T2_RERENDERED).to_rollout_sample(reward=0.0)
    assert session(T1, T2_EXTENDS).to_rollout_sample(reward=0.0).tokens[-1] == 12


def test_a_session_without_model_calls_is_refused_and_a_closed_one_records_nothing():
    with pytest.raises(SessionError, match="no model call"):
        session().to_rollout_run(reward=1.0)
    s = session(T1)
    s.to_rollout_run(reward=1.0)
    with pytest.raises(SessionError, match="closed"):
        s.record(T2_EXTENDS)


def test_count_splits_and_turn_checks():
    assert count_splits([T1, T2_EXTENDS, T2_RERENDERED]) == 1
    assert count_splits([T1, T1]) == 1  # the same prompt again (a retry) does not extend
    with pytest.raises(SessionError, match="logprobs"):
        SessionTurn([1], [2, 3], [-1.0], [0, 0])
