"""Multi-turn, message-in rollout: answer, get feedback when wrong, try again (up to `max_turns` model turns).

Rows: {"messages": [{"role": "system"|"user", "content": ...}, ...], "answer": "42"} (OpenAI-style messages).
The conversation is kept as tokens (`trajectory.ChatTrajectory`): each turn's prompt is the previous call's full
tokens plus the template's tokens for the feedback message, so the sample trains on exactly what the model saw and
produced. loss_mask is 1 on assistant tokens, 0 on the prompt and feedback. Reward: `reward.compute_reward`.

rollout_extras: max_turns (default 3), retry_discount (0.5), max_seq_len (stop before a turn would not fit).
Written against the current cookbook contract: `build_deployment_sampler(setup)` and a `RolloutRun` with one
segment per model call (each extends the last, so fleetrl trains them as one sample).
"""

from __future__ import annotations

from reward import compute_reward, feedback_message, is_correct
from trajectory import ChatTrajectory, message_delta_tokens, turn_end_tokens

from fleetrl import RolloutRun, RolloutSetup, build_deployment_sampler
from fleetrl.rollout import RolloutFn


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    max_turns = int(setup.extras.get("max_turns", 3))
    retry_discount = float(setup.extras.get("retry_discount", 0.5))
    max_seq_len = setup.extras.get("max_seq_len")
    max_tokens = int(setup.sample_kwargs.get("max_tokens", 64))
    if max_turns < 1:
        raise ValueError(f"rollout_extras.max_turns must be >= 1, got {max_turns}")
    turn_end = turn_end_tokens(setup.tokenizer)  # fails at start, not per rollout, when there is no chat template
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)
    if turn_end and turn_end[0] in set(setup.tokenizer.all_special_ids):
        # A reply ends at the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...) even when the model's
        # generation config does not list it as an eos.
        stops = {*sample_kwargs.get("stop_token_ids", ()), turn_end[0]}
        sample_kwargs["stop_token_ids"] = sorted(stops)

    async def rollout_fn(row: dict) -> RolloutRun | None:
        traj = ChatTrajectory.start(setup.tokenizer, row["messages"])
        turns, correct, reply, finish_reason = 0, False, "", "stop"
        while True:
            (completion,) = await sampler.sample_with_prompt_tokens(traj.tokens, n=1, **sample_kwargs)
            traj.add_completion(completion)
            turns += 1
            reply, finish_reason = completion.text, completion.finish_reason
            correct = is_correct(reply, row["answer"])
            if correct or turns == max_turns:
                break
            feedback = feedback_message(reply)
            if max_seq_len is not None:
                # The next turn must fit: context so far, end of turn, the feedback and a full reply.
                upcoming = len(turn_end) + len(message_delta_tokens(setup.tokenizer, feedback)) + max_tokens
                if len(traj.tokens) + upcoming > int(max_seq_len):
                    break
            traj.add_message(feedback)
        if not any(traj.loss_mask[1:]):
            return None  # the model generated nothing at all
        reward = compute_reward(correct, turns, retry_discount)
        metrics = {"correct": float(correct), "turns": float(turns), "first_try_correct": float(correct and turns == 1)}
        return traj.to_run(reward, finish_reason, reply, metrics)

    return rollout_fn
