"""Multi-turn, message-in rollout: answer, get feedback when wrong, try again (up to `max_turns` model turns).

Rows: {"messages": [{"role": "system"|"user", "content": ...}, ...], "answer": "42"} (OpenAI-style messages).
Written in the cookbook's structure (`training/examples/rl/multi_turn_message_in/rollout.py`): the conversation is
kept as messages, and a `MessageTrajectoryAssembler` turns it into exactly the tokens the model saw and produced
(each turn's prompt extends the last call's tokens; nothing the model generated is re-tokenized). The whole
trajectory is one `RolloutSample` in a `RolloutRun`: loss_mask 1 on the assistant tokens of every turn, 0 on the
prompt and the feedback. Reward: `reward.compute_reward` (a correct answer on turn t earns retry_discount**(t-1)).

rollout_extras: max_turns (default 3), retry_discount (0.5), max_seq_len (stop before a turn would not fit).
"""

from __future__ import annotations

from reward import compute_reward, feedback_message, is_correct

from fleetrl import (
    MessageTrajectoryAssembler,
    RolloutRun,
    RolloutSample,
    RolloutSetup,
    TITOTokenizer,
    build_deployment_sampler,
)
from fleetrl.rollout import RolloutFn


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)
    tokenizer = setup.tokenizer
    max_turns = int(setup.extras.get("max_turns", 3))
    retry_discount = float(setup.extras.get("retry_discount", 0.5))
    max_seq_len = setup.extras.get("max_seq_len")
    max_tokens = int(sample_kwargs.get("max_tokens", 64))
    if max_turns < 1:
        raise ValueError(f"rollout_extras.max_turns must be >= 1, got {max_turns}")
    turn_end = TITOTokenizer(tokenizer).turn_end_tokens()  # fails here, not per rollout, without a chat template
    if turn_end and turn_end[0] in set(tokenizer.all_special_ids):
        # A reply ends at the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...) even when the model's
        # generation config does not list it as an eos.
        sample_kwargs["stop_token_ids"] = sorted({*sample_kwargs.get("stop_token_ids", ()), turn_end[0]})

    async def rollout_fn(sample_prompt: dict) -> RolloutRun | None:
        messages = list(sample_prompt.get("messages") or [])
        answer = sample_prompt.get("answer")
        if not messages or answer is None:
            return None

        assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
        current_messages = messages
        turns, correct, assistant_text, finish_reason = 0, False, "", "stop"

        for turn in range(max_turns):
            prompt_tokens = assembler.prepare_next_input(current_messages)
            if turn > 0 and max_seq_len is not None and len(prompt_tokens) + max_tokens > int(max_seq_len):
                break  # the next turn (its prompt and a full reply) would not fit
            completions = await sampler.sample_with_prompt_tokens(prompt_tokens, n=1, **sample_kwargs)
            if not completions:
                return None
            completion = completions[0]

            output_tokens = list(completion.full_tokens[completion.prompt_len :])
            output_logprobs = list(completion.inference_logprobs or [])
            if not output_tokens or len(output_logprobs) != len(output_tokens):
                return None

            assistant_text = completion.text or tokenizer.decode(output_tokens)
            finish_reason = completion.finish_reason
            assistant_message = {"role": "assistant", "content": assistant_text}
            assembler.add_assistant_response(
                request_messages=current_messages,
                assistant_message=assistant_message,
                prompt_token_ids=prompt_tokens,
                completion_token_ids=output_tokens,
                completion_logprobs=output_logprobs,
                finish_reason=finish_reason,
            )
            turns += 1

            correct = is_correct(assistant_text, answer)
            if correct:
                break
            if turn + 1 < max_turns:
                current_messages = [*current_messages, assistant_message, feedback_message(assistant_text)]

        tokens, logprobs, loss_mask = assembler.trajectory.to_flat()
        sample = RolloutSample(
            tokens=tokens,
            logprobs=logprobs,
            loss_mask=loss_mask,
            reward=compute_reward(correct, turns, retry_discount),
            finish_reason=finish_reason,
            text=assistant_text,
            metrics={
                "correct": float(correct),
                "turns": float(turns),
                "first_try_correct": float(correct and turns == 1),
            },
        )
        return RolloutRun(segments=[sample])

    return rollout_fn
