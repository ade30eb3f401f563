"""Each trainer rank receives only the rows it trains: 2 gloo ranks train a step of 7 samples (not divisible by the
ranks, in 2 minibatches, with reference logprobs) to the same metrics as 1 rank, and the bytes rank 1 receives of
the step's rows are exactly those of its share (`rank_samples`), not the whole batch."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from fleetrl import metric_names as mn
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import read_groups_jsonl, write_groups_jsonl
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer import distributed as fdist
from fleetrl.trainer.minibatches import rank_samples
from tests.integration.trainer.rank_env import end_rank, rank_context
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTINGS = {
    "num_minibatches": 2,
    "policy_loss": "grpo",
    "loss_agg_mode": "seq-mean-token-sum-norm",  # needs the minibatch's padded width on every rank
    "kl_beta": 0.1,
}


def _ref_logprobs(sequences: list[list[int]], temperature: float) -> list[list[float]]:
    return [[-1.0 - 0.01 * (t % 7) for t in seq[1:]] for seq in sequences]


def _worker(rank: int, world: int, port: int, model_dir: str, workdir: str) -> None:
    ctx = rank_context(rank, world, port)
    cfg = make_cfg(model_dir, f"{workdir}/dist", **SETTINGS)
    trainer = PolicyTrainer(cfg, dist_ctx=ctx, micro_batch_size=1, ref_logprobs_fn=_ref_logprobs)
    fdist.RECEIVED.reset()
    try:
        if rank == 0:
            groups = list(read_groups_jsonl(f"{workdir}/groups.jsonl"))
            metrics = trainer.train_step(groups).metrics
            trainer.stop_followers()
            with open(f"{workdir}/metrics.json", "w") as f:
                json.dump(metrics, f)
        else:
            trainer.follow()
        with open(f"{workdir}/received_{rank}.json", "w") as f:
            json.dump({"scatter": fdist.RECEIVED.scatter, "broadcast": fdist.RECEIVED.broadcast}, f)
    finally:
        fdist.destroy(ctx)
    end_rank()


def _row_bytes(sample: RolloutSample) -> int:
    """A row's bytes on the wire: tokens, mask, versions (int64), logprobs (float32) per token; reference logprobs
    (float32) per token but the first; its advantage (float32)."""
    n = len(sample.tokens)
    versions = 8 * n if sample.versions is not None else 0
    return 8 * n + 8 * n + versions + 4 * n + 4 * (n - 1) + 4


def test_each_rank_receives_its_share_and_an_uneven_split_matches_one_rank(tiny_model_dir, tmp_path, free_port):
    groups = tiny_groups(tiny_model_dir, num_groups=2)
    groups[1].samples.pop()  # 4 + 3 samples: minibatches of 4 and 3 rows, split 2/2 and 2/1 over the ranks
    write_groups_jsonl(tmp_path / "groups.jsonl", groups)
    mp.spawn(_worker, args=(2, free_port, tiny_model_dir, str(tmp_path)), nprocs=2, join=True)

    single = PolicyTrainer(
        make_cfg(tiny_model_dir, tmp_path / "single", **SETTINGS), micro_batch_size=1, ref_logprobs_fn=_ref_logprobs
    )
    ours = single.train_step(groups).metrics
    theirs = json.loads((tmp_path / "metrics.json").read_text())
    assert ours[mn.KL_REFERENCE] > 0  # the reference logprobs reached the loss
    for key in (mn.LOSS, mn.GRAD_NORM, mn.ENTROPY, mn.KL_REFERENCE, "train/clip_frac", "optim/ppo_kl"):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-4, abs=1e-6), key

    samples = sorted(((g.row_id, s) for g in groups for s in g.samples), key=lambda x: x[0])
    samples_in_order = [s for _, s in samples]
    assert len(samples_in_order) == 7
    share = rank_samples([len(s.tokens) - 1 for s in samples_in_order], SETTINGS["num_minibatches"], 2, 1)
    assert share and len(share) < 7
    expected = sum(_row_bytes(samples_in_order[i]) for i in share)
    whole = sum(_row_bytes(s) for s in samples_in_order)
    received = json.loads((tmp_path / "received_1.json").read_text())
    assert received["scatter"] == expected < whole
    assert json.loads((tmp_path / "received_0.json").read_text()) == {"scatter": 0, "broadcast": 0}
    print(f"rank 1 received {expected} bytes of rows (whole batch {whole}) + {received['broadcast']} of headers")
