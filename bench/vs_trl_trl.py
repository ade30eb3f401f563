"""The TRL arm of bench/vs_trl.py: TRL's `GRPOTrainer` on the arithmetic task, one process (synchronous).

    python bench/vs_trl_trl.py --init DIR --out DIR [--steps 100] [--tool-latency 0]

The warm-started model and train rows under `--init` (examples/arithmetic/warm_start.py), P = 16 prompts x G = 8
completions, 5 new tokens, T = 1, lr 3e-4 (5 warm-up steps, then constant, as examples/arithmetic/run.toml), grad
clip 1.0, no KL (beta = 0, so no reference model), TRL's default token-level loss (fleetrl's `token-mean`). The reward
is the example's exact-match `score`; with `--tool-latency S > 0` it is an async function that first awaits S seconds
per completion (TRL gathers async rewards concurrently). Writes OUT/steps.json (wall time of every optimizer step's
end, and of the process start) and OUT/final (the trained model).
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic"))
import torch  # noqa: E402
from arithmetic_task import score  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


class StepClock(TrainerCallback):
    """Wall time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())


def make_reward(eos_ids: set[int], tool_latency: float):
    """The example's exact-match reward over TRL's completions (finished = the ids end with end of text)."""

    def exact(completions, completion_ids, answer, **kwargs) -> list[float]:
        return [
            score(c, a, finished=bool(ids) and ids[-1] in eos_ids)
            for c, ids, a in zip(completions, completion_ids, answer, strict=True)
        ]

    if tool_latency <= 0:
        return exact

    async def exact_after_tool(completions, completion_ids, answer, **kwargs) -> list[float]:
        await asyncio.gather(*(asyncio.sleep(tool_latency) for _ in completions))  # one tool call per completion
        return exact(completions, completion_ids, answer)

    return exact_after_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", required=True, help="warm start folder (model/, train.jsonl)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tool-latency", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    init, out = Path(args.init), Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(init / "model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(init / "model", dtype=torch.float32)
    train = load_dataset("json", data_files=str(init / "train.jsonl"), split="train")
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=16 * 8,
        num_generations=8,
        max_completion_length=5,
        temperature=1.0,
        learning_rate=3e-4,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=5,
        max_grad_norm=1.0,
        beta=0.0,
        max_steps=args.steps,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    clock = StepClock()
    eos_ids = {tokenizer.eos_token_id}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(eos_ids, args.tool_latency),
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    (out / "steps.json").write_text(json.dumps({"start": START, "steps": clock.times, "end": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
