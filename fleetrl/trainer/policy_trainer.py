"""`PolicyTrainer`: the policy trainer's training logic, as a plain Python object (no sockets).

    trainer = PolicyTrainer(cfg, weight_sink=publisher.publish, on_version_ready=report)
    result = trainer.train_step(groups, step=1)      # -> StepResult(version=1, metrics={...})
    trainer.finish()                                  # final checkpoint + HF export to output_dir

Steps count from 1: step k trains one optimizer batch (P groups) against version k-1 and produces
version k (version = optimizer batches done, 0 = the base model). Per batch: group advantages, the
reference logprobs when kl_beta > 0 (requested first, so the reference forward overlaps ours),
`old_logprobs` from a no-grad forward when num_minibatches > 1 (else old = current, detached), then
num_minibatches optimizer steps (the PPO inner loop), each AdamW with the LR schedule and grad clipping.
Weights are handed to `weight_sink(version, state_dict)` every `weight_sync_interval` batches, then
`on_version_ready(version)` is called; checkpoints every `dcp_save_interval` batches.

LoRA (cfg.lora_rank > 0, fleetrl.trainer.lora): the policy is a PEFT model whose adapter alone trains; the weight
sink gets only the adapter's tensors and `adapter=` its config; reference logprobs are the same model's with the
adapter disabled (no `ref_logprobs_fn` needed); checkpoints hold the adapter and its optimizer state; the export is
a PEFT adapter folder (and, with export_merged, the merged model in `merged/`).

With world size > 1 (torchrun), rank 0 calls these methods and every other rank runs
`follow()`, which executes rank 0's broadcast commands (see fleetrl.trainer.distributed); a step's samples reach
each rank as its share only (`minibatches.rank_samples`), with every sample's length and trainable tokens in the
header.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fleetrl import metric_names as mn
from fleetrl.config import reference_model_path, wants_reference_logprobs
from fleetrl.losses import resolve_loss_settings
from fleetrl.rollout_group import RolloutGroup
from fleetrl.sample_log import LoggedSample, logged_samples, samples_due
from fleetrl.tokenizer_match import check_same_tokenizer
from fleetrl.trainer import distributed as fdist
from fleetrl.trainer import lora
from fleetrl.trainer.advantage_estimators import BUILT_IN as BUILT_IN_ESTIMATORS
from fleetrl.trainer.advantage_estimators import load_estimator
from fleetrl.trainer.checkpoint import (
    TrainerState,
    checkpoint_path,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from fleetrl.trainer.datum import Datum, build_datum, shift_datum
from fleetrl.trainer.inner_loop import REF_WAIT_TIMEOUT_S, InnerLoop, PendingRef, resolve_compute_dtype
from fleetrl.trainer.minibatches import SampleFigures, rank_samples
from fleetrl.trainer.model import DTYPES, load_causal_lm, load_tokenizer, model_options, pad_token_id, torch_dtype
from fleetrl.trainer.optim import build_optimizer, build_scheduler
from fleetrl.trainer.row_set import RowIdSet
from fleetrl.trainer.sharded_load import load_sharded_causal_lm
from fleetrl.trainer.step_batch import StepBatch, build_step_batch
from fleetrl.trainer.step_records import keep_recent, result_fields, step_record
from fleetrl.weights.gather import gather_shards

logger = logging.getLogger(__name__)

RefLogprobsFn = Callable[[list[list[int]], float], list[list[float]]]
"""(token sequences, temperature) -> per-sequence logprobs, N-1 per N tokens (the reference policy)."""
WeightSink = Callable[..., Any]
"""(version, full state dict) -> anything; e.g. WeightPublisher.publish (its Manifest is kept). A LoRA run calls
(version, adapter tensors, adapter=adapter config JSON). At world size > 1 it gets rank 0's own shards with
``sharded=True, float_dtype=...`` while every other rank runs `gather_shards` beside it (WeightPublisher.publish
gathers them one tensor at a time)."""


class StepError(RuntimeError):
    """A step that cannot be trained as asked (out of order, reference failure, ...)."""


@dataclass
class StepResult:
    step: int
    version: int
    metrics: dict[str, float]
    row_ids: list[int]
    skipped_row_ids: list[int] = field(default_factory=list)
    published: bool = False
    checkpoint_path: str | None = None
    already_trained: bool = False
    samples: list[LoggedSample] = field(default_factory=list)  # decoded samples to log (log_samples_interval)


@dataclass
class PublishInfo:
    version: int
    seconds: float
    checksum: str = ""


class PolicyTrainer:
    """Trains the policy from rollout groups; see the module docstring for the life of a step."""

    def __init__(
        self,
        cfg: Any,
        *,
        device: str = "cpu",
        dist_ctx: fdist.DistContext | None = None,
        ref_logprobs_fn: RefLogprobsFn | None = None,
        weight_sink: WeightSink | None = None,
        on_version_ready: Callable[[int], Any] | None = None,
        checkpoint_dir: str | Path | None = None,
        output_dir: str | Path | None = None,
        micro_batch_size: int | None = None,
        total_steps: int | None = None,
        refuse_stale: bool = True,
        colocated_reference: bool = False,
    ) -> None:
        self.cfg = cfg
        # With a controller (stale_policy "requeue") a sample beyond the off-policy bound is never trained; replaying
        # recorded groups without one (standalone) trains what it is given.
        self.refuse_stale = refuse_stale and cfg.stale_policy == "requeue"
        self.ctx = dist_ctx or fdist.DistContext()
        self.device = self.ctx.device(device)
        if cfg.lora and ref_logprobs_fn is not None:
            logger.info(
                "LoRA: reference logprobs come from the base weights (adapter disabled); the given source is unused"
            )
            ref_logprobs_fn = None
        self.ref_logprobs_fn = ref_logprobs_fn
        self.weight_sink = weight_sink
        self.on_version_ready = on_version_ready
        log_path = Path(cfg.log_path)
        self.checkpoint_dir = Path(checkpoint_dir or log_path / "checkpoints")
        self.output_dir = Path(output_dir or cfg.output_dir or log_path / "final")
        resolve_loss_settings(cfg.policy_loss, cfg)  # a bad loss setting fails here, at start
        estimator = getattr(cfg, "advantage_estimator", "grpo")
        if estimator not in BUILT_IN_ESTIMATORS:
            load_estimator(estimator)  # imported and tried now: a bad estimator fails at start, naming the field

        torch.manual_seed(cfg.seed)
        # Kernels, activation checkpointing and compile (a bad setting fails here, naming the field).
        options = model_options(cfg, self.device)
        # Sharded loading under FSDP2 (a LoRA run too: its adapter is wrapped on meta and sharded with its layers):
        # built on meta, sharded, each rank reads only its own rows.
        sharded_load = self.ctx.enabled
        if sharded_load:
            self.model = load_sharded_causal_lm(
                cfg.base_model,
                self._shard,
                dtype=cfg.dtype,
                device=self.device,
                options=options,
                wrap=partial(lora.wrap_with_lora, cfg=cfg) if cfg.lora else None,
                start_tensors=partial(lora.adapter_start_tensors, cfg=cfg) if cfg.lora else None,
            )
        else:
            self.model = load_causal_lm(cfg.base_model, dtype=cfg.dtype, device=self.device, options=options)
            if cfg.lora:
                self.model = lora.wrap_with_lora(self.model, cfg)
        self.adapter_config = lora.adapter_config_json(self.model) if cfg.lora else None
        self.tokenizer = self._load_tokenizer()
        self.pad_id = pad_token_id(self.model, self.tokenizer)
        self.model_config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)  # token ids must stay below it
        if self.ctx.enabled and not sharded_load:
            self._shard(self.model)
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        total_batches = total_steps or cfg.max_steps
        total_opt = total_batches * cfg.num_minibatches if total_batches else None
        self.scheduler = build_scheduler(self.optimizer, cfg, total_opt)
        # The colocated reference (kl_beta > 0, full fine-tuning): a frozen copy of the base model in this
        # process, on the trainer's device, in its compute dtype, sharded like the policy; its logprobs come from
        # the same micro-batches as the training forward (no service, no network, no wait).
        self.reference_model = (
            self._load_reference() if colocated_reference and wants_reference_logprobs(cfg) and not cfg.lora else None
        )
        if self.reference_model is not None and ref_logprobs_fn is not None:
            raise ValueError("reference: give either a reference service (ref_logprobs_fn) or the colocated copy")
        self.loop = InnerLoop(
            cfg,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ctx=self.ctx,
            device=self.device,
            pad_id=self.pad_id,
            micro_batch_size=micro_batch_size,
            reference_context=self.model.disable_adapter if cfg.lora else None,
            reference_model=self.reference_model,
        )
        self.state = TrainerState(base_model=cfg.base_model)
        self._trained_rows = RowIdSet()
        self._results: dict[int, StepResult] = {}
        self.last_publish: PublishInfo | None = None
        self._ref_forward_time = 0.0
        self._ref_pool = ThreadPoolExecutor(1, thread_name_prefix="fleetrl-ref") if ref_logprobs_fn else None
        self.steps_skipped_nonfinite = 0
        self._nonfinite_in_a_row = 0

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return fdist.shard_model(
            model,
            self.device,
            self.ctx.world_size,
            self.ctx.mesh_shape,
            compute_dtype=self._mixed_dtype(),
            cpu_offload=bool(getattr(self.cfg, "fsdp_cpu_offload", False)),
        )

    def _load_reference(self) -> torch.nn.Module:
        """The frozen reference: the base model in the compute dtype (bfloat16 on CUDA: half the memory of a float32
        copy, and the same numerics as the policy's mixed-precision forward), sharded like the policy. With a
        teacher_model it is the teacher (on-policy distillation), refused when its tokenizer reads ids otherwise."""
        path = reference_model_path(self.cfg)
        if getattr(self.cfg, "teacher_model", None) is not None:
            check_same_tokenizer(self.cfg.tokenizer_model or self.cfg.base_model, path, field="teacher_model")
        compute = resolve_compute_dtype(self.cfg, self.device)
        dtype = next(name for name, value in DTYPES.items() if value == compute)
        if self.ctx.enabled:
            model = load_sharded_causal_lm(
                path,
                lambda m: fdist.shard_model(m, self.device, self.ctx.world_size, self.ctx.mesh_shape),
                dtype=dtype,
                gradient_checkpointing=False,
                device=self.device,
            )
        else:
            model = load_causal_lm(path, dtype=dtype, device=self.device, trainable=False)
        model.requires_grad_(False)
        model.eval()
        return model

    def _mixed_dtype(self) -> torch.dtype | None:
        """The compute dtype when it differs from the weights' (mixed precision), else None."""
        compute = resolve_compute_dtype(self.cfg, self.device)
        return compute if compute != torch_dtype(self.cfg.dtype) else None

    # -- properties ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.state.steps_done

    @property
    def steps_done(self) -> int:
        return self.state.steps_done

    @property
    def trained_row_count(self) -> int:
        """Rows trained (or skipped) and still remembered one by one (see fleetrl.trainer.row_set)."""
        return len(self._trained_rows)

    def is_trained(self, row_id: int) -> bool:
        return row_id in self._trained_rows

    def result_of(self, step: int) -> StepResult | None:
        """The result of a recent step (the last 16 are kept), or None."""
        return self._results.get(step)

    def _load_tokenizer(self) -> Any:
        path = self.cfg.tokenizer_model or self.cfg.base_model
        try:
            return load_tokenizer(path)
        except (OSError, ValueError) as exc:
            logger.warning("no tokenizer at %s (%s); the HF export will lack one", path, exc)
            return None

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    # -- rank-0 API (each broadcasts its command when world size > 1) -------------------------

    def train_step(
        self,
        groups: Sequence[RolloutGroup],
        *,
        step: int | None = None,
        data_position: Any = None,
    ) -> StepResult:
        """Train step `step` (default: the next) from `groups`; see the module docstring."""
        self._require_main("train_step")
        step = self.steps_done + 1 if step is None else step
        if step in self._results:
            return replace(self._results[step], already_trained=True)
        if step <= self.steps_done:  # trained before a restart, or too long ago to keep its result
            return StepResult(step, step, {}, [], already_trained=True)
        if step != self.steps_done + 1:
            raise StepError(
                f"step {step} is out of order: {self.steps_done} steps are done, the next is {self.steps_done + 1}"
            )
        fresh, duplicate = [], []
        seen: set[int] = set()
        for g in groups:
            if g.row_id in self._trained_rows or g.row_id in seen:
                duplicate.append(g.row_id)
            else:
                seen.add(g.row_id)
                fresh.append(g)
        if duplicate:
            logger.warning("step %d: rows %s already trained; skipped", step, duplicate)
        # Groups arrive in whatever order the gateways finished them; in row order the same rows make the same
        # batch (micro-batches, padding, summation order), so a rerun or a resumed run computes the same update.
        fresh.sort(key=lambda g: g.row_id)
        refuse_above = self.cfg.max_head_offpolicy_versions if self.refuse_stale else None
        batch = build_step_batch(
            fresh,
            advantage_mode=self.cfg.advantage_mode,
            advantage_estimator=getattr(self.cfg, "advantage_estimator", "grpo"),
            turn_discount=getattr(self.cfg, "turn_discount", 1.0),
            train_version=self.version,
            max_offpolicy=refuse_above,
            vocab_size=self.vocab_size,
        )
        if batch.stats.get("train/samples_refused_vocab"):
            logger.warning(
                "step %d: refused %d samples with token ids >= the vocabulary (%d)",
                step,
                int(batch.stats["train/samples_refused_vocab"]),
                self.vocab_size,
            )
        if batch.stats.get("train/samples_refused_stale"):
            logger.warning(
                "step %d: refused %d samples more than %s versions behind version %d (stale_policy = requeue)",
                step,
                int(batch.stats["train/samples_refused_stale"]),
                refuse_above,
                self.version,
            )
        batch.skipped_row_ids = duplicate + batch.skipped_row_ids
        # Requested first, so the reference service computes while this step runs; under several ranks rank 0
        # scatters each rank's share when the inner loop first needs it (`_pending_ref`), not before the step.
        ref_future = self._request_ref(batch)
        header = {
            "op": "train",
            "step": step,
            "lengths": [len(s.tokens) for s in batch.samples],
            "versioned": [s.versions is not None for s in batch.samples],
            "trainable": [sum(int(m) for m in s.loss_mask[1:]) for s in batch.samples],  # Totals on every rank
            "has_ref": ref_future is not None and self.ctx.enabled,
            "data_position": data_position,
        }
        fdist.broadcast_json(header, self.ctx)
        result = self._do_train(header, batch, ref_future)
        self._results[step] = result
        for old in [k for k in self._results if k < step - 16]:
            del self._results[old]
        return result

    def publish(self) -> PublishInfo:
        """Hand the current weights to the weight sink as `version` (if not already)."""
        self._require_main("publish")
        fdist.broadcast_json({"op": "publish"}, self.ctx)
        return self._do_publish()

    def save_checkpoint(self, data_position: Any = None) -> Path:
        self._require_main("save_checkpoint")
        fdist.broadcast_json({"op": "checkpoint", "data_position": data_position}, self.ctx)
        return self._do_checkpoint(data_position)

    def export_hf(self, output_dir: str | Path | None = None, dtype: str | None = None) -> Path:
        """Save the policy in HF format (weights in `dtype`, default `export_dtype(cfg)`, config and tokenizer),
        loadable by inference."""
        self._require_main("export_hf")
        out = str(output_dir or self.output_dir)
        dtype = dtype or export_dtype(self.cfg)
        fdist.broadcast_json({"op": "export", "output_dir": out, "dtype": dtype}, self.ctx)
        return self._do_export(Path(out), dtype)

    def resume(self, path: str | Path | None = None) -> bool:
        """Restore the latest whole checkpoint (or `path`); False when there is none to resume. A damaged latest is
        passed over for the newest whole one, with a warning (`resume_checkpoint`); with none whole it raises
        CheckpointDamaged naming the damaged file."""
        self._require_main("resume")
        if path is None:
            point = resume_checkpoint(self.checkpoint_dir)
            if (note := point.note()) is not None:
                logger.warning("%s", note)
            path = str(point.path) if point.path else None
        fdist.broadcast_json({"op": "resume", "path": path}, self.ctx)
        return self._do_resume(path)

    def finish(self, data_position: Any = None) -> tuple[Path, Path]:
        """End of run: a checkpoint (unless this version has one) and the HF export."""
        ckpt = checkpoint_path(self.checkpoint_dir, self.version)
        if data_position is not None or not ckpt.exists():
            ckpt = self.save_checkpoint(data_position)
        return ckpt, self.export_hf()

    def stop_followers(self) -> None:
        """Release the other ranks from `follow()` (rank 0, at shutdown)."""
        if self.ctx.enabled and self.ctx.is_main:
            fdist.broadcast_json({"op": "stop"}, self.ctx)

    def close(self) -> None:
        if self._ref_pool is not None:
            self._ref_pool.shutdown(wait=False, cancel_futures=True)

    # -- ranks > 0 ---------------------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's commands until it says stop (every rank but 0 calls this)."""
        while True:
            cmd = fdist.broadcast_json(None, self.ctx)
            op = cmd["op"]
            if op == "stop":
                return
            if op == "train":
                self._do_train(cmd, None, None)
            elif op == "publish":
                self._do_publish()
            elif op == "checkpoint":
                self._do_checkpoint(cmd["data_position"])
            elif op == "export":
                self._do_export(Path(cmd["output_dir"]), cmd["dtype"])
            elif op == "resume":
                self._do_resume(cmd["path"])
            else:
                raise StepError(f"rank {self.ctx.rank}: unknown command {op!r} from rank 0")

    def _require_main(self, what: str) -> None:
        if not self.ctx.is_main:
            raise StepError(f"{what} is called on rank 0 only; rank {self.ctx.rank} runs follow()")

    # -- the step ----------------------------------------------------------------------------

    def _request_ref(self, batch: StepBatch) -> Future[list[list[float]]] | None:
        if self.ref_logprobs_fn is None or not wants_reference_logprobs(self.cfg) or not batch.samples:
            return None
        assert self._ref_pool is not None
        sequences = [list(s.tokens) for s in batch.samples]
        fn, temperature = self.ref_logprobs_fn, float(self.cfg.temperature)

        def call() -> list[list[float]]:
            started = time.perf_counter()
            out = fn(sequences, temperature)
            self._ref_forward_time = time.perf_counter() - started
            if len(out) != len(sequences):
                raise StepError(f"reference returned {len(out)} sequences for {len(sequences)}")
            for i, (seq, lp) in enumerate(zip(sequences, out, strict=True)):
                if len(lp) != len(seq) - 1:
                    raise StepError(
                        f"reference logprobs of sample {i}: {len(lp)} values for {len(seq)} tokens "
                        f"(expected {len(seq) - 1})"
                    )
            return out

        self._ref_forward_time = 0.0
        return self._ref_pool.submit(call)

    def _step_tensors(
        self, header: dict[str, Any], batch: StepBatch | None
    ) -> tuple[list[Datum] | dict[int, Datum], torch.Tensor]:
        """Datums and advantages of the step: on one process, of every sample; on each rank of a distributed step,
        of the samples it trains only (`rank_samples`, by index), which are all rank 0 sends it. The advantages
        tensor is indexed by sample (0 for samples another rank trains). Reference logprobs travel later
        (`_pending_ref`)."""
        if not self.ctx.enabled:  # one process: no broadcast, no flattening
            assert batch is not None
            datums = [build_datum(s) for s in batch.samples]
            return datums, torch.tensor(batch.advantages, dtype=torch.float32)
        lengths = header["lengths"]
        versioned = header["versioned"]  # which samples carry per-token policy versions
        world, num_minibatches = self.ctx.world_size, self.cfg.num_minibatches
        datum_lengths = [n - 1 for n in lengths]  # the inner loop balances ranks by these (SampleFigures.lengths)
        mine = rank_samples(datum_lengths, num_minibatches, world, self.ctx.rank)
        parts = None
        if self.ctx.is_main:
            assert batch is not None
            ranks = [rank_samples(datum_lengths, num_minibatches, world, r) for r in range(world)]
            parts = [_flat_samples(batch, share) for share in ranks]
        specs = _flat_specs(lengths, versioned, mine)
        flat = fdist.scatter_tensors(parts, specs, self.ctx)
        my_lengths = [lengths[i] for i in mine]
        tokens = flat["tokens"].split(my_lengths)
        logprobs = flat["logprobs"].split(my_lengths)
        masks = flat["mask"].split(my_lengths)
        versions: list[list[int] | None] = [None] * len(mine)
        if "versions" in flat:
            per_sample = iter(flat["versions"].split([lengths[i] for i in mine if versioned[i]]))
            versions = [next(per_sample).tolist() if versioned[i] else None for i in mine]
        datums = {
            i: shift_datum(t.tolist(), lp.tolist(), m.tolist(), v)
            for i, t, lp, m, v in zip(mine, tokens, logprobs, masks, versions, strict=True)
        }
        advantages = torch.zeros(len(lengths), dtype=torch.float32)
        advantages[mine] = flat["advantages"]
        return datums, advantages

    def _pending_ref(self, header: dict[str, Any], ref_future: Future[list[list[float]]] | None) -> PendingRef:
        """Each rank's reference logprobs, scattered by rank 0 when the inner loop first needs them (every rank
        calls `get()` at the same point: after its first micro-batch's forward)."""
        lengths = header["lengths"]
        datum_lengths = [n - 1 for n in lengths]
        world, num_minibatches = self.ctx.world_size, self.cfg.num_minibatches
        mine = rank_samples(datum_lengths, num_minibatches, world, self.ctx.rank)

        def load() -> dict[int, torch.Tensor]:
            parts = None
            if self.ctx.is_main:
                assert ref_future is not None
                ref = ref_future.result(REF_WAIT_TIMEOUT_S)
                parts = []
                for r in range(world):
                    share = rank_samples(datum_lengths, num_minibatches, world, r)
                    parts.append({"ref": torch.tensor([x for i in share for x in ref[i]], dtype=torch.float32)})
            specs = {"ref": (torch.float32, sum(datum_lengths[i] for i in mine))}
            flat = fdist.scatter_tensors(parts, specs, self.ctx)
            return dict(zip(mine, flat["ref"].split([datum_lengths[i] for i in mine]), strict=True))

        return PendingRef(load, self.loop.timers)

    def _do_train(
        self,
        header: dict[str, Any],
        batch: StepBatch | None,
        ref_future: Future[list[list[float]]] | None,
    ) -> StepResult:
        step = int(header["step"])
        started = time.perf_counter()
        self.loop.timers = {"fwd_bwd": 0.0, "optim": 0.0, "old_logprobs": 0.0, "ref_wait": 0.0}
        datums, advantages = self._step_tensors(header, batch)
        ref_by_sample: PendingRef | None = None
        figures = SampleFigures([n - 1 for n in header["lengths"]], header["trainable"]) if self.ctx.enabled else None
        num_samples = len(header["lengths"])
        metrics: dict[str, float] = {}
        local_future = ref_future
        if self.ctx.enabled and header["has_ref"]:
            ref_by_sample, local_future = self._pending_ref(header, ref_future), None
        elif self.ctx.enabled:
            local_future = None
        if num_samples:
            try:
                metrics = self.loop.train_batch(datums, advantages, ref_by_sample, local_future, figures)
                self.state.optimizer_steps += int(metrics[mn.OPTIMIZER_STEPS])
            except BaseException:
                self.optimizer.zero_grad(set_to_none=True)
                raise
            self._count_nonfinite(step, metrics)
        else:
            logger.warning("step %d has no trainable group: version advances without an update", step)
            metrics[mn.EMPTY_STEP] = 1.0
        train_time = time.perf_counter() - started
        self.state.steps_done = step
        self.state.data_position = header.get("data_position")
        result = StepResult(step, self.version, metrics, [], [])
        if self.ctx.is_main:
            assert batch is not None
            self._trained_rows.update(batch.row_ids)
            self._trained_rows.update(batch.skipped_row_ids)
            self.state.trained_rows = self._trained_rows.to_json()
            result.row_ids, result.skipped_row_ids = batch.row_ids, batch.skipped_row_ids
            metrics.update(batch.stats)
            tokens = sum(header["lengths"]) - len(header["lengths"])
            metrics.update(
                {
                    "step": float(step),
                    "version": float(self.version),
                    mn.LEARNING_RATE: float(self.scheduler.get_last_lr()[0]),
                    "perf/train_time": train_time,
                    "perf/tokens_per_s": tokens / train_time if train_time > 0 else 0.0,
                    "perf/fwd_bwd_time": self.loop.timers["fwd_bwd"],
                    "perf/optim_step_time": self.loop.timers["optim"],
                    "perf/old_logprob_time": self.loop.timers["old_logprobs"],
                    "perf/ref_wait_time": self.loop.timers["ref_wait"],
                    "perf/ref_forward_time": (
                        self._ref_forward_time if ref_future else self.loop.timers.get("ref_forward", 0.0)
                    ),
                }
            )
            if samples_due(step, self.cfg.log_samples_interval):
                result.samples = logged_samples(
                    step,
                    batch.samples,
                    batch.sample_row_ids,
                    batch.sample_offsets,
                    self.cfg.log_samples_count,
                    self._decode if self.tokenizer is not None else None,
                    token_ids=self.cfg.log_samples_token_ids,
                )
        interval = self.cfg.weight_sync_interval
        if interval and self.version % interval == 0:
            info = self._do_publish()
            result.published = True
            metrics["perf/weight_publish_time"] = info.seconds
        if self.ctx.is_main:  # in the checkpoint: a controller that never heard back gets it from a resumed trainer
            self.state.step_records = keep_recent(self.state.step_records, step_record(result))
        save_every = self.cfg.dcp_save_interval
        if save_every and self.version % save_every == 0:
            result.checkpoint_path = str(self._do_checkpoint(header.get("data_position")))
        if self.ctx.is_main:
            logger.info(
                "step %d -> version %d: loss %.4f, %d samples, %.2fs",
                step,
                self.version,
                metrics.get(mn.LOSS, float("nan")),
                num_samples,
                train_time,
            )
        return result

    def _count_nonfinite(self, step: int, metrics: dict[str, float]) -> None:
        """A step whose loss or gradient was not finite was skipped (nothing applied); too many in a row fail."""
        skipped = metrics.pop("skipped_nonfinite", 0.0)
        metrics["train/step_skipped_nonfinite"] = float(bool(skipped))
        if not skipped:
            self._nonfinite_in_a_row = 0
        else:
            self.steps_skipped_nonfinite += 1
            self._nonfinite_in_a_row += 1
            limit = self.cfg.max_nonfinite_steps
            if self.ctx.is_main:
                logger.warning(
                    "step %d: the loss or gradient is not finite; the update is skipped (%d in a row, limit %d)",
                    step,
                    self._nonfinite_in_a_row,
                    limit,
                )
            if self._nonfinite_in_a_row >= limit:
                raise StepError(
                    f"{self._nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (up to step {step}; "
                    f"max_nonfinite_steps = {limit}): check the rewards (huge values?), the learning rate and the "
                    "samples' logprobs"
                )
        metrics["train/steps_skipped_nonfinite"] = float(self.steps_skipped_nonfinite)

    # -- publish, checkpoint, export, resume (every rank) ------------------------------------

    def _do_publish(self) -> PublishInfo:
        if self.last_publish is not None and self.last_publish.version == self.version:
            staged = getattr(self, "_staged_publish", None)
            if not self.last_publish.checksum and staged is not None:  # staged beside the step: its checksum now
                checksum = staged.result(timeout=3600.0).checksum  # a local cast and checksums: minutes at most
                self.last_publish = PublishInfo(self.version, self.last_publish.seconds, checksum)
            return self.last_publish
        started = time.perf_counter()
        checksum = ""
        if self.adapter_config is not None:
            # Only the adapter travels: the replicas keep the base weights they started with.
            dtype = torch_dtype(self.cfg.inference_dtype or self.cfg.dtype)
            state_dict = lora.adapter_state_dict(self.model, self.ctx, dtype=dtype)
            sink_kwargs: dict[str, Any] = {"adapter": self.adapter_config}
        elif self.ctx.enabled:
            # World size > 1: every rank hands over its own shards; the sink on rank 0 (publish(sharded=True)) and
            # gather_shards everywhere else gather one tensor at a time, cast on the device: nobody gathers the whole
            # model (docs/weights.md, "Publishing a sharded model").
            state_dict = self.model.state_dict()
            sink_kwargs = {"sharded": True, "float_dtype": self._publish_dtype()}
            if not (self.ctx.is_main and self.weight_sink is not None):
                gather_shards(state_dict, sink_kwargs["float_dtype"])
        else:
            state_dict = fdist.full_state_dict(self.model, self.ctx)
            sink_kwargs = {}
            if self.cfg.inference_dtype not in (None, self.cfg.dtype):  # cast in the publisher's snapshot copy
                sink_kwargs["float_dtype"] = torch_dtype(self.cfg.inference_dtype)
        self._staged_publish = None
        if self.ctx.is_main and self.weight_sink is not None:
            manifest = self.weight_sink(self.version, state_dict, **sink_kwargs)
            if isinstance(manifest, Future):  # WeightPublisher.publish(background=True): cast, hashed, served later
                self._staged_publish = manifest
            else:
                checksum = str(getattr(manifest, "checksum", "") or "")
        del state_dict
        info = PublishInfo(self.version, time.perf_counter() - started, checksum)
        self.last_publish = info
        self.state.published_version = self.version
        if self.ctx.is_main and self.on_version_ready is not None:
            self.on_version_ready(self.version)
        return info

    def _publish_dtype(self) -> torch.dtype | None:
        """The dtype floating tensors are published in: inference_dtype when it differs from the training dtype."""
        if self.cfg.inference_dtype in (None, self.cfg.dtype):
            return None
        return torch_dtype(self.cfg.inference_dtype)

    def _do_checkpoint(self, data_position: Any) -> Path:
        if data_position is not None:
            self.state.data_position = data_position
        return save_checkpoint(
            self.checkpoint_dir,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            ctx=self.ctx,
            trainable_only=self.cfg.lora,
        )

    def _do_resume(self, path: str | None) -> bool:
        if path is None:
            return False
        self.state = load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ctx=self.ctx,
            trainable_only=self.cfg.lora,
        )
        self._trained_rows = RowIdSet.from_json(self.state.trained_rows)
        self._trained_rows.update(self.state.trained_row_ids)  # a checkpoint from before trained_rows
        self.state.trained_row_ids = []
        self._results = {f["step"]: StepResult(**f) for f in map(result_fields, self.state.step_records) if f}
        self.last_publish = None
        return True

    def _do_export(self, out: Path, dtype_name: str) -> Path:
        if self.adapter_config is not None:
            return self._do_export_adapter(out)
        dtype = torch_dtype(dtype_name)
        if self.ctx.enabled:
            # Every rank writes its own shards (no rank gathers the model); rank 0 adds the config.
            out.mkdir(parents=True, exist_ok=True)
            fdist.export_sharded_hf(self.model, out, dtype, self.ctx)
        if self.ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if self.ctx.enabled:
                config = copy.deepcopy(self.model_config)
                config.dtype = dtype
                config.save_pretrained(out)
                if getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(out)
            else:
                state = {k: v.to(dtype) for k, v in self.model.state_dict().items()}
                self.model.save_pretrained(out, state_dict=state)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out)
            logger.info("exported version %d in HF format to %s", self.version, out)
        fdist.barrier(self.ctx)
        return out

    def _do_export_adapter(self, out: Path) -> Path:
        """LoRA: `out` is a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) plus the tokenizer;
        with export_merged, `out/merged` holds base + adapter merged, in HF format."""
        tensors = lora.adapter_state_dict(self.model, self.ctx)
        if self.ctx.is_main:
            assert self.adapter_config is not None
            lora.save_adapter(out, tensors, {**self.adapter_config, "base_model_name_or_path": self.cfg.base_model})
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(out)
            if self.cfg.export_merged:
                lora.merge_adapter(out, out / "merged", base_model=self.cfg.base_model, dtype=self.cfg.dtype)
            logger.info("exported version %d as a LoRA adapter to %s", self.version, out)
        fdist.barrier(self.ctx)
        return out


def export_dtype(cfg: Any) -> str:
    """The dtype the HF export is written in: `export_dtype`, or with "auto" the dtype the replicas serve
    (`inference_dtype`), else the master weights' (`dtype`)."""
    chosen = getattr(cfg, "export_dtype", "auto")
    return cfg.inference_dtype or cfg.dtype if chosen == "auto" else chosen


def _flat_samples(batch: StepBatch, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """The step's samples `indices` as flat 1-D tensors (the fields of `_flat_specs`), end to end in that order."""
    samples = [batch.samples[i] for i in indices]
    flat = {
        "tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
        "logprobs": torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float32),
        "mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.long),
        "advantages": torch.tensor([batch.advantages[i] for i in indices], dtype=torch.float32),
    }
    if any(s.versions is not None for s in batch.samples):
        flat["versions"] = torch.tensor(
            [v for s in samples if s.versions is not None for v in s.versions], dtype=torch.long
        )
    return flat


def _flat_specs(
    lengths: Sequence[int], versioned: Sequence[bool], indices: Sequence[int]
) -> dict[str, tuple[torch.dtype, int]]:
    """Dtype and length of each flat tensor of `_flat_samples` for the samples `indices`, from the header alone."""
    total = sum(lengths[i] for i in indices)
    specs = {
        "tokens": (torch.long, total),
        "logprobs": (torch.float32, total),
        "mask": (torch.long, total),
        "advantages": (torch.float32, len(indices)),
    }
    if any(versioned):
        specs["versions"] = (torch.long, sum(lengths[i] for i in indices if versioned[i]))
    return specs
