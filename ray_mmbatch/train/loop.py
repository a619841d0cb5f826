"""The per-worker train function (Ray Train V2) and the runner it calls.

Every rank iterates its shard one BATCH row at a time (one row = one planned
batch). Shards are split without dropping rows (see trainer.LosslessDataConfig),
so ranks can receive different numbers of batches; to keep DDP in lockstep each
optimizer step first agrees, by an all-reduce, whether any rank still has data,
and a rank that ran dry steps on a zero-target copy of its last batch (no loss,
no gradient, but it joins the gradient all-reduce). No batch is dropped to make
the counts equal, and every rank makes the same number of ``ray.train.report``
calls (a barrier).

Resume: a checkpoint stores the data position (data/position.py: per epoch, the
read units finished and the rows done of units in flight, all ranks; each report
gathers only the positions added since the last one). The dataset is rebuilt
without those rows (they are not even read),
and should one still arrive (the dataset builder read an older checkpoint than
the one restored), its targets are masked out of the batch. So after a restore
no sample is trained twice or missed, whatever batches Ray Data forms this time.
"""
from __future__ import annotations

import os
import resource
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray_mmbatch import schema as S
from ray_mmbatch.batching.layout import mask_samples, patch_dim
from ray_mmbatch.config import Config, apply_overrides, flatten
from ray_mmbatch.data.errors import decode_skips
from ray_mmbatch.data.position import DataPosition
from ray_mmbatch.run import datatime
from ray_mmbatch.run.rundir import RunDir
from ray_mmbatch.train import checkpoint as ckpt
from ray_mmbatch.train.events import RankEvents
from ray_mmbatch.train.step import Lockstep, all_reduce


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def all_gather_lists(items: list) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return list(items)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(items))
    return [x for part in out for x in part]


@dataclass(frozen=True)
class BatchMeta:
    """The loop's bookkeeping of one micro-batch, beside it (the batch dict holds only data)."""

    batch_id: str
    epoch: int
    padded_tokens: int      # compute the batch occupies (the budget in pack mode)
    positions: np.ndarray   # read position of each sample (data/position.py)
    unit_rows: np.ndarray   # row count of each position's read unit


def _positions(row: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Read positions and unit row counts of a BATCH row's samples."""
    pos = np.asarray(row.get(S.BATCH_POSITIONS, []), dtype=np.int64)
    return pos, np.asarray(row.get(S.BATCH_POSITION_UNIT_ROWS, np.zeros(len(pos))), dtype=np.int64)


class Runner:
    """Owns the step loop: fetch micro-batches, agree on data, step, log, report, checkpoint."""

    def __init__(self, cfg: Config, model, optimizer, scheduler, device, shards: list, rank: int, world: int,
                 state: dict[str, Any] | None = None, progress=None, planned_samples: int = 0, listing: str = "",
                 channel=None):
        from ray_mmbatch.train.step import optimizer_step

        self.cfg, self.model, self.opt, self.sched = cfg, model, optimizer, scheduler
        self.device, self.shards, self.rank, self.world = device, shards, rank, world
        self._optimizer_step = optimizer_step
        st = state or {}
        self.step = int(st.get("step", 0))
        self.position = DataPosition.from_state(st.get("position"))
        self.position.listing = listing or self.position.listing  # what the unit indices refer to
        self.new_positions: list[tuple[int, np.ndarray, np.ndarray]] = []  # since the last report
        self.totals = dict(st.get("totals", {"samples": 0, "real_tokens": 0, "padded_tokens": 0,
                                             "target_tokens": 0, "train_s": 0.0}))
        self.initial_loss = st.get("initial_loss")
        # where the data time went (run/datatime.py): this rank's sums since the last report, the run's totals
        self.clock, self.data_time = datatime.DataClock(), dict(st.get("data_time", {}))
        # samples trained or reported skipped, all ranks, all epochs: drives the by-epoch LR schedule
        self.samples_seen = int(st.get("samples_seen", 0))
        self.progress, self.planned_samples = progress, int(planned_samples)
        self._set_progress()
        self.checkpoint_mark = self._share_mark()  # checkpoint_every below 1: the shares of the run passed
        # the run's records go to the driver through Ray (train/events.py), never to a shared disk
        self.files = RankEvents(channel, rank, cfg.train.ledger)
        self.files.trim(self.step)
        self.lockstep = Lockstep(device, patch_dim(cfg.image))  # ranks step together (train/step.py)
        from ray_mmbatch.models.trainable import param_counts

        self.param_counts = param_counts(model)  # trainable_params / total_params (--freeze, --lora-rank)
        from ray_mmbatch.data.split import has_eval

        self.has_eval = has_eval(cfg.data)
        self.eval_loss: float | None = None  # from an evaluation since the last report (train/evaluate.py)
        self.eval_ids_sent = False
        self.eval_cache = None  # train/evaluate.EvalCache, made at the first evaluation
        self.aborted = ""  # why the skip guard stopped the run ("" = it did not)
        self.window: dict[str, float] = {}
        self.started: dict[int, Any] = {}  # epoch -> its rows, pulled since before the model was built

    # -- data ----------------------------------------------------------------
    def _rows(self, shard, epoch: int = -1) -> Iterator[dict[str, Any]]:
        from ray_mmbatch.train.stall import guarded

        rows = self.started.pop(epoch, None) or shard_rows(shard)  # started before the model was built
        for row in guarded(rows, self.cfg.data.stall_timeout_s):  # DataStalled, never a silent wait
            yield {k: v[0] for k, v in row.items()}

    def _take(self, rows: Iterator[dict[str, Any]], epoch: int) -> tuple[list[tuple[dict, BatchMeta]], int]:
        """Up to grad_accum (micro-batch, meta) pairs of this rank, and how many skip records came with them."""
        from ray_mmbatch.batching.collate import decode_batch

        micro: list[tuple[dict, BatchMeta]] = []
        skipped = 0
        while len(micro) < self.cfg.train.grad_accum:
            asked = time.time()  # the clock of produced_at (dataflow/timing.py), not perf_counter
            row = next(rows, None)
            if row is None:
                break
            records = decode_skips(row[S.BATCH_SKIPPED])
            cell = row.get(S.BATCH_DATA_TIME)
            for rec in records:
                self.files.append("skipped", {"step": self.step, **rec.to_dict()})
            skipped += len(records)
            self._done(epoch, np.array([r.position for r in records], np.int64),  # reported skips are done too
                       np.array([r.unit_rows for r in records], np.int64))
            if int(row[S.BATCH_N_SAMPLES]) == 0:
                self.clock.row(cell)
                continue  # only carried skip records
            batch = decode_batch(bytes(row[S.BATCH_PAYLOAD]))
            self.clock.row(cell, asked, time.time())  # its stages' seconds, and produced (or asked) -> decoded
            pos, unit_rows = _positions(row)
            keep = ~self.position.contains(epoch, pos)
            if not any(keep):
                continue  # trained before the restore
            if not all(keep):
                batch = mask_samples(batch, np.array(keep))
            micro.append((batch, BatchMeta(str(row[S.BATCH_ID]), epoch, int(row[S.BATCH_PADDED_TOKENS]),
                                           pos, unit_rows)))
        return micro, skipped

    # -- loop ----------------------------------------------------------------
    def run(self) -> None:
        """Epoch by epoch: every rank finishes epoch e (ranks that run dry first take
        zero-target steps) before any rank opens epoch e+1, whose split waits for all."""
        tcfg = self.cfg.train
        last_report = time.perf_counter()
        guard = [0, 0]  # samples seen / skipped in this run, for the skip guard
        for epoch, shard in enumerate(self.shards):
            rows = self._rows(shard, epoch)
            first = True  # the stream's first step waits for the pools to start
            while not self._at_max_steps() and not self.aborted:
                t0 = time.perf_counter()
                micro, skipped = self._take(rows, epoch)
                t_data = time.perf_counter() - t0
                trained = sum(len(b["sample_ids"]) for b, _ in micro)
                # a rank that ran dry steps on a zero-target batch with the others (train/step.Lockstep)
                step_on, (seen, skips) = self.lockstep.join(micro[-1][0] if micro else None,
                                                            [trained + skipped, skipped])
                self.samples_seen += int(seen)
                self._set_progress()
                guard[0], guard[1] = guard[0] + int(seen), guard[1] + int(skips)
                if step_on is None or self._guard(guard, at_end=False):
                    break
                batches = [b for b, _ in micro] or [step_on]
                out = self._optimizer_step(self.model, batches, self.opt, self.sched, tcfg, self.device)
                self.step += 1
                t_step = time.perf_counter() - t0
                self._account(micro, out, t_data, t_step)
                self.clock.step(t_data, t_step, first)
                first = False
                self._fault_drill()
                ck = self._checkpoint_due()
                ev = self.has_eval and bool(tcfg.eval_every) and self.step % tcfg.eval_every == 0 \
                    and not self._at_max_steps()  # the end evaluates below
                if ev:
                    self.evaluate()
                if (ck or ev or self.step % tcfg.report_every == 0) and not self._at_max_steps():
                    self.report(time.perf_counter() - last_report, checkpoint=ck)
                    last_report = time.perf_counter()
        if not self.aborted and not self._at_max_steps():
            self._guard(guard, at_end=True)  # a dataset smaller than the guard's minimum is judged whole
        if self.has_eval and not self.aborted:
            self.evaluate()
        # a stopped run leaves no checkpoint: rerun with the fix, its skipped rows must be read again
        self.report(time.perf_counter() - last_report, checkpoint=not self.aborted, final=True)

    def evaluate(self) -> None:
        """The held-out loss now (train/evaluate.py: every rank, each eval sample once); to eval.jsonl
        and the next report's metrics."""
        from ray_mmbatch.train.evaluate import evaluate
        from ray_mmbatch.train.step import autocast_dtype

        if self.eval_cache is None:
            from ray_mmbatch.train.evaluate import EvalCache

            self.eval_cache = EvalCache(self.cfg.train.eval_cache_mb)  # the batches, after the first pass
        out = evaluate(self.model, self.cfg, self.rank, self.world, self.device,
                       autocast_dtype(self.cfg.train.precision, self.device), cache=self.eval_cache)
        self.eval_loss = out["eval_loss"]
        if not self.eval_ids_sent:  # the same ids every time: the split is a hash of the id
            self.files.append("eval_ids", {"rank": self.rank, "ids": out["ids"]})
            self.eval_ids_sent = True
        if self.rank == 0:
            self.files.append("eval", {"step": self.step, "eval_loss": out["eval_loss"],
                                       "eval_samples": out["eval_samples"],
                                       "eval_target_tokens": out["eval_target_tokens"]})

    def _guard(self, guard: list[int], at_end: bool) -> bool:
        """Stop (all ranks agree: the counts are all-reduced) when too many samples are skipped;
        the driver explains it from skipped.csv (guards.py)."""
        from ray_mmbatch.run.guards import skip_fraction_exceeded

        if skip_fraction_exceeded(guard[0], guard[1], self.cfg.data.max_skip_fraction, at_end=at_end):
            self.aborted = f"{guard[1]} of {guard[0]} samples skipped"
            if self.rank == 0:  # the driver writes it: Ray's Result only carries metrics of checkpointed reports
                self.files.stopped({"seen": guard[0], "skipped": guard[1], "step": self.step})
        return bool(self.aborted)

    def _set_progress(self) -> None:
        if self.progress is not None and self.planned_samples > 0:
            self.progress.value = self.samples_seen / self.planned_samples

    def _share_mark(self) -> int:
        """With checkpoint_every below 1: how many such shares of the run are done (steps over max_steps, else
        samples seen over those planned; the same on every rank), short of the end, which checkpoints anyway."""
        every = float(self.cfg.train.checkpoint_every or 0)
        if not 0 < every < 1:
            return 0
        if self.cfg.train.max_steps:
            done = self.step / self.cfg.train.max_steps
        else:
            done = self.samples_seen / self.planned_samples if self.planned_samples else 0.0
        return int(min(done, 1 - 1e-9) / every + 1e-9)

    def _checkpoint_due(self) -> bool:
        """train.checkpoint_every: every N optimizer steps, or (below 1) each time the run passes another share."""
        every = float(self.cfg.train.checkpoint_every or 0)
        if every >= 1:
            return self.step % int(every) == 0
        mark = self._share_mark()
        due, self.checkpoint_mark = mark > self.checkpoint_mark, max(mark, self.checkpoint_mark)
        return due

    def _at_max_steps(self) -> bool:
        return bool(self.cfg.train.max_steps) and self.step >= self.cfg.train.max_steps

    def _account(self, micro: list[tuple[dict, BatchMeta]], out: dict[str, float], t_data: float,
                 t_step: float) -> None:
        """``micro``: the (batch, meta) pairs trained this step ([] for a rank that ran dry)."""
        real = sum(int(b["real_tokens"]) for b, _ in micro)
        padded = sum(m.padded_tokens for _, m in micro)
        n = sum(len(b["sample_ids"]) for b, _ in micro)
        target = sum(int(b["target_tokens"]) for b, _ in micro)
        for b, m in micro:
            self._done(m.epoch, m.positions, m.unit_rows)
            self.files.append("batches", {
                "step": self.step, "rank": self.rank, "batch_id": m.batch_id,
                "real_tokens": int(b["real_tokens"]), "padded_tokens": m.padded_tokens,
                "target_tokens": int(b["target_tokens"]), "n_samples": len(b["sample_ids"]),
                "n_images": int(len(b["image_grid_thw"])), "patches": int(len(b["patches"])),
                "budget_tokens": int(self.cfg.budget.max_tokens),
                **({"sources": _per_source(b["sample_ids"])} if self.cfg.data.sources else {})})
            self.files.append("ledger", {"step": self.step, "epoch": m.epoch, "batch_id": m.batch_id,
                                         "sample_ids": [str(s) for s in b["sample_ids"]]})
        w = self.window
        for k, v in (("real", real), ("padded", padded), ("target", target), ("samples", n), ("data_s", t_data),
                     ("step_s", t_step), ("loss_sum", out["loss"]), ("steps", 1)):
            w[k] = w.get(k, 0.0) + v
        if self.initial_loss is None:
            self.initial_loss = float(out["loss"])

    def _done(self, epoch: int, positions: np.ndarray, unit_rows: np.ndarray) -> None:
        if len(positions):
            self.position.add(epoch, positions, unit_rows)
            self.new_positions.append((epoch, positions, unit_rows))

    def _fault_drill(self) -> None:
        """Die like an OOM-killed worker (SIGKILL, no cleanup) at the configured step, once."""
        marker = Path(self.cfg.train.output_dir) / RunDir.FAULT_DRILL
        if self.rank == 0 and self.step == self.cfg.train.fault_at_step and not marker.exists():
            marker.write_text(str(self.step))
            os.kill(os.getpid(), signal.SIGKILL)

    def report(self, elapsed: float, checkpoint: bool, final: bool = False) -> None:
        import ray.train

        w, self.window = self.window, {}
        keys = ("real", "padded", "target", "samples", "data_s", "step_s", "steps")
        reduced = all_reduce([w.get(k, 0.0) for k in keys] + self.clock.take(), self.device)  # one collective
        g = dict(zip(keys, reduced))
        self.data_time = datatime.add(self.data_time, reduced[len(keys):])
        (loss_mean,) = all_reduce([w.get("loss_sum", 0.0) / max(w.get("steps", 1.0), 1.0)], self.device)
        loss_mean /= self.world
        t = self.totals
        t["samples"] += int(g["samples"])
        t["real_tokens"] += int(g["real"])
        t["padded_tokens"] += int(g["padded"])
        t["target_tokens"] += int(g["target"])
        t["train_s"] += elapsed
        metrics = {
            "step": self.step, "loss": loss_mean if g["steps"] else float("nan"),
            "lr": float(self.sched.get_last_lr()[0]),
            "tokens_per_s": g["real"] / max(elapsed, 1e-9),
            "padded_tokens_per_s": g["padded"] / max(elapsed, 1e-9),
            "samples_per_s": g["samples"] / max(elapsed, 1e-9),
            "fill": g["real"] / g["padded"] if g["padded"] else 0.0,
            "step_time_s": g["step_s"] / max(g["steps"], 1.0),
            "data_wait_frac": g["data_s"] / max(g["step_s"], 1e-9),
            "peak_mem_mb": all_reduce([_peak_mem_mb(self.device)], self.device, op="max")[0],
            "initial_loss": self.initial_loss, "final": final,
            "progress": self.samples_seen / self.planned_samples if self.planned_samples else None,
            "aborted": self.aborted,
            **self.param_counts,
            **({"eval_loss": self.eval_loss} if self.eval_loss is not None else {}),
            **{f"total_{k}": v for k, v in t.items()},
            "data_time": dict(self.data_time),  # the run's sums so far (run/datatime.py); summary.json's data_time
        }
        self.eval_loss = None
        if g["steps"]:
            self.files.append("metrics", metrics)
        # only the delta travels: each rank's positions since the last report (8 bytes a sample)
        for epoch, pos, unit_rows in all_gather_lists(self.new_positions):
            self.position.add(epoch, pos, unit_rows)
        self.new_positions = []
        self.files.flush()  # before the checkpoint: what it covers has reached the driver
        if not checkpoint:
            ray.train.report(metrics)
            return
        state = {"step": self.step, "position": self.position.state_dict(), "totals": t,
                 "initial_loss": self.initial_loss, "samples_seen": self.samples_seen, "data_time": self.data_time}
        with tempfile.TemporaryDirectory() as tmp:
            ray_ckpt = None
            if self.cfg.train.fsdp:  # every rank writes its shards; Ray merges the rank folders
                from ray_mmbatch.train.fsdp import save_sharded

                save_sharded(tmp, self.model, self.opt, self.sched, state)
                ray_ckpt = ray.train.Checkpoint.from_directory(tmp)
            elif self.rank == 0:
                model = getattr(self.model, "module", self.model)
                ckpt.save_checkpoint(tmp, model, self.opt, self.sched, state)
                ray_ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ray_ckpt)
        if self.rank == 0:
            latest = ray.train.get_checkpoint()
            ckpt.write_latest(self.cfg.train.output_dir, latest.path if latest else "", state)


def shard_rows(shard) -> Iterator[dict[str, np.ndarray]]:
    """A rank's BATCH rows, one at a time (each block holds a few: pipeline.MATERIALIZE_ROWS)."""
    return shard.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=2)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Thin: build config, the backend's model, optimizer, restore, hand over to Runner, export."""
    import ray.train
    import ray.train.torch

    from ray_mmbatch.models import get_backend
    from ray_mmbatch.models.trainable import configure_trainable
    from ray_mmbatch.train import fsdp
    from ray_mmbatch.train.step import Progress, autocast_dtype, build_optimizer

    cfg = apply_overrides(Config(), flatten(config["cfg"]))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg.train.seed)
    device = ray.train.torch.get_device()
    backend = get_backend(cfg)
    shards = [ray.train.get_dataset_shard(S.epoch_dataset_name(e)) for e in range(max(1, cfg.train.epochs))]
    # A fresh run starts pulling its first epoch now, so the data pools start (actors, tokenizer,
    # the first windows) while the model is built and loaded; a restored run knows its epoch
    # only once the checkpoint is read, and starts its stream in Runner.run as before.
    from ray_mmbatch.train.stall import Pump

    started = {0: Pump(shard_rows(shards[0]))} if ray.train.get_checkpoint() is None else {}
    model = backend.create_model(cfg, config)
    configure_trainable(model, cfg)  # --freeze, --lora-rank: before sharding and the optimizer
    if cfg.train.fsdp:  # shard before the optimizer is built: sharding replaces the parameters
        model = fsdp.shard_model(model, device, mixed_precision=autocast_dtype(cfg.train.precision, device),
                                 backend=backend)
    # max_steps: cosine over those steps; by epochs: cosine over the share of the planned
    # samples done (the step count is only known once the batches are planned)
    planned = 0 if cfg.train.max_steps else int(config.get("planned_samples", 0))
    progress = Progress() if planned else None
    optimizer, scheduler = build_optimizer(model, cfg.train, cfg.train.max_steps or 1000, progress)
    state = None
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            load = fsdp.load_sharded if cfg.train.fsdp else ckpt.load_checkpoint
            state = load(d, model, optimizer, scheduler)
    if not cfg.train.fsdp:
        model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs={"find_unused_parameters": False})
    runner = Runner(cfg, model, optimizer, scheduler, device, shards, rank, world, state, progress, planned,
                    listing=config.get("listing", ""), channel=config.get("channel"))
    runner.started = started
    runner.run()
    if cfg.train.export_hf:
        bare = getattr(model, "module", model)
        # under FSDP the parameters are shards: every rank takes part in gathering the full weights
        full = fsdp.full_state_dict(bare, backend.state_prefix(bare)) if cfg.train.fsdp else None
        if rank == 0:
            _export(backend, bare, cfg, full)
            # rank 0's node disk goes with the node (ray down): the export joins the checkpoints in --storage
            ckpt.publish_export(cfg.train.output_dir, cfg.train.storage, ctx.get_experiment_name())


def _export(backend, model, cfg: Config, full: dict | None) -> None:
    """OUTPUT_DIR/model in the family's format; a LoRA run: OUTPUT_DIR/adapter (PEFT), and with
    --merge-lora the adapters folded into OUTPUT_DIR/model."""
    from ray_mmbatch.models import trainable

    out = RunDir(cfg.train.output_dir)
    if not hasattr(model, "lora_config"):
        backend.export(model, cfg, out / RunDir.EXPORT, full)
        return
    trainable.export_adapter(model, out / RunDir.ADAPTER, cfg.model.path, full)
    if cfg.model.merge_lora:
        backend.export(trainable.merge_lora(model), cfg, out / RunDir.EXPORT, None)



def _per_source(sample_ids) -> dict[str, int]:
    """Samples of a batch per source name (several datasets: formats/sources.by_source)."""
    from ray_mmbatch.formats.sources import by_source

    return {name: rec["samples"] for name, rec in by_source([str(s) for s in sample_ids]).items()}
