"""Saving, choosing and loading the Trainer's checkpoints (``output_dir/checkpoint-<step>``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from lockstep import checkpoint
from lockstep.accelerator import Accelerator
from lockstep.checkpoint import CheckpointStorage, Location, out_of_space_error, storage_for
from lockstep.trainer import _checkpoint_folders
from lockstep.trainer._loss_sums import LossSums
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import TrainerState
from lockstep.utils import broadcast_object_list

logger = logging.getLogger("lockstep.trainer")


class TrainerCheckpoints:
    """Writes and reads the checkpoints of one Trainer run.

    Args:
        accelerator: saves and loads the state (``save_state``/``load_state``).
        args: ``output_dir`` and ``save_total_limit``.
        state: the run's TrainerState (registered for checkpointing, so every checkpoint holds it).
        losses: the running loss sums, stored in ``state`` before each save.
        save_weights: ``fn(folder)`` writes the model alone, as ``save_model`` does (``save_only_model``).
        load_weights: ``fn(folder)`` loads such a folder's weights into the model (its best model).
        write_state: ``fn(folder)`` writes ``trainer_state.json`` (main process).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        args: TrainingArguments,
        state: TrainerState,
        losses: LossSums,
        *,
        save_weights: Callable[[Path], None],
        load_weights: Callable[[Path], None],
        write_state: Callable[[Path], None],
    ) -> None:
        self.accelerator = accelerator
        self.args = args
        self.state = state
        self.losses = losses
        self.save_weights = save_weights
        self.load_weights = load_weights
        self.write_state = write_state

    @property
    def storage(self) -> CheckpointStorage:
        """Where ``output_dir`` is: a local folder, or an fsspec URL."""
        return storage_for(self.args.output_dir)

    def location(self, folder: str | Path) -> Location:
        """A checkpoint folder given as text: a URL stays one, anything else is a ``Path``."""
        return storage_for(folder).location(folder)

    def folder(self) -> Location:
        """The folder of the current step's checkpoint."""
        return _checkpoint_folders.checkpoint_folder(self.args.output_dir, self.state.global_step)

    def save(self) -> Location:
        """Save the whole state into ``checkpoint-<step>``; rotate older ones (never the best model's)."""
        self.losses.store(self.accelerator, self.state)
        folder = self.folder()
        best = self.state.best_global_step
        if best is not None:
            best_folder = _checkpoint_folders.checkpoint_folder(self.args.output_dir, best)
            if best == self.state.global_step or self.storage.exists(best_folder):
                self.state.best_model_checkpoint = str(best_folder)
        if self.args.save_only_model:
            self._save_model_only(folder)
        else:
            # committed before the Trainer's own rotation reads the folders (and a callback reads this one)
            self.accelerator.save_state(str(folder), durable="sync")
        self.rotate(folder)
        return folder

    def _save_model_only(self, folder: Location) -> None:
        """``save_only_model``: the weights (``save_model``'s layout) and ``trainer_state.json``, committed
        with a manifest written last; no optimizer, scheduler, RNG or data position, so no resuming."""
        main, storage = self.accelerator.is_main_process, self.storage
        staging = storage.prepare(folder, main=main)
        self.accelerator.wait_for_everyone()
        try:
            self.save_weights(staging)  # every rank: gathering a sharded model's weights is a collective
            if main:
                self.write_state(staging)
            # On an object store every rank uploads what it wrote (the main process: everything) and says so.
            storage.rank_writer(
                lambda: None, staging, folder, self.accelerator.process_index, background=False
            )()
            if main:
                storage.commit(
                    staging,
                    folder,
                    world_size=self.accelerator.num_processes,
                    step=self.state.global_step,
                    move_latest_pointer=False,
                    wait_seconds=None,
                )
        except Exception as error:  # nothing of a failed save remains; a full disk is said so
            failure = out_of_space_error(error, checkpoint=folder, staging=staging, needed=0)
            storage.discard(staging, main=main)
            if failure is None:
                raise
            raise failure from error
        self.accelerator.wait_for_everyone()

    def check_resumable(self, folder: Location) -> None:
        """Refuse a checkpoint written with ``save_only_model=True`` (it holds the weights only)."""
        storage = storage_for(folder)
        if storage.exists(storage.join(folder, checkpoint.MANIFEST_NAME)) and not storage.exists(
            storage.join(folder, checkpoint.ACCELERATOR_STATE)
        ):
            raise ValueError(
                f"resume_from_checkpoint={str(folder)!r} was saved with save_only_model=True: it holds the model "
                "weights only (no optimizer, scheduler, RNG or data position), so training cannot resume from it. "
                "Load the weights (from_pretrained, or lockstep.checkpoint.load_model_weights) and train without "
                "resume_from_checkpoint, or save full checkpoints (save_only_model=False)."
            )

    def rotate(self, folder: Location) -> None:
        """Delete the checkpoints ``save_total_limit`` no longer keeps (main process), then synchronise."""
        if self.accelerator.is_main_process:
            protected = self.state.best_model_checkpoint
            for removed in _checkpoint_folders.rotate_checkpoints(
                self.args.output_dir,
                self.args.save_total_limit,
                folder,
                protected=None if protected is None else self.location(protected),
            ):
                logger.info("Deleted %s (save_total_limit=%s)", removed, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()

    def save_and_exit(self) -> None:
        """A preemption signal reached some rank: every rank saves one checkpoint, then the job exits (143)."""
        self.losses.store(self.accelerator, self.state)
        self.accelerator.checkpoint_and_exit(str(self.folder()))

    def resolve(self, resume: str | bool | None) -> Location | None:
        """The folder ``resume_from_checkpoint`` names: True (or "latest") is the newest valid checkpoint of
        ``output_dir``, as the main process sees it."""
        if resume is None or resume is False:
            return None
        if isinstance(resume, str) and resume.strip().lower() in ("true", "latest"):
            resume = True
        if resume is not True:
            return self.location(resume)
        choice: list[str | None] = [None, None]
        # With save_on_each_node every node holds its own copies (node-local disks): each process looks.
        if self.accelerator.is_main_process or self.args.save_on_each_node:
            try:
                found = _checkpoint_folders.newest_valid_checkpoint(self.args.output_dir)
                choice[0] = None if found is None else str(found)
            except Exception as error:  # raised on every rank below, not left for the others to wait on
                choice[1] = f"{type(error).__name__}: {error}"
        if self.accelerator.num_processes > 1 and not self.args.save_on_each_node:
            broadcast_object_list(choice)
        if choice[1] is not None:
            raise RuntimeError(
                f"train(resume_from_checkpoint=True): looking for the newest checkpoint of "
                f"{self.args.output_dir!r} failed: {choice[1]}"
            )
        if choice[0] is None:
            raise ValueError(
                f"train(resume_from_checkpoint=True): {self.args.output_dir!r} holds no valid checkpoint-<step> "
                "folder. Train without resume_from_checkpoint to start from scratch, or pass a checkpoint path."
            )
        return self.location(choice[0])

    def load_best(self) -> Location:
        """Load the best checkpoint's state; the run's TrainerState (steps, logs) stays that of the end."""
        folder, finished = self.location(str(self.state.best_model_checkpoint)), self.state.state_dict()
        if self.args.save_only_model:
            self.load_weights(folder)
        else:
            self.accelerator.load_state(str(folder))
        self.state.load_state_dict(finished)
        if self.args.save_total_limit == 1 and self.accelerator.is_main_process:
            # transformers' rule: with a limit of 1, the best checkpoint is the one that remains.
            _checkpoint_folders.keep_only(self.args.output_dir, folder)
        self.accelerator.wait_for_everyone()
        return folder
