"""fleetrl.trainer: the policy trainer's training logic, free of sockets.

- `model`: load any HF causal LM by path; the logprob forward shared with the reference service.
- `step_batch`: a step's groups -> its samples, their advantages (`advantages`) and the step's statistics.
- `minibatches`: how the inner loop splits a step's samples: minibatches, ranks, micro-batches.
- `datum`: a sample as a training datum (the one-token shift and padding).
- `optim`: AdamW and the LR schedule (warmup, constant / linear / cosine).
- `checkpoint`: torch.distributed.checkpoint save and resume.
- `distributed`: FSDP2 sharding and rank-0 broadcasts under torchrun.
- `inner_loop`: the PPO inner loop (micro-batches, ranks, optimizer steps).
- `policy_trainer`: `PolicyTrainer`, which ties them together (steps, versions, publishing, checkpoints).

The service around it (ZeroMQ groups in, gRPC control, weight stream out) is services/trainer.
"""

from fleetrl.trainer.checkpoint import TrainerState
from fleetrl.trainer.distributed import DistContext
from fleetrl.trainer.inner_loop import InnerLoop
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs, target_logprobs
from fleetrl.trainer.policy_trainer import PolicyTrainer, PublishInfo, StepError, StepResult

__all__ = [
    "DistContext",
    "InnerLoop",
    "PolicyTrainer",
    "PublishInfo",
    "StepError",
    "StepResult",
    "TrainerState",
    "load_causal_lm",
    "sequence_logprobs",
    "target_logprobs",
]
