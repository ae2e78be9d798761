"""Saving, choosing and loading the Trainer's checkpoints (``output_dir/checkpoint-<step>``)."""

from __future__ import annotations

import logging
from pathlib import Path

from lockstep.accelerator import Accelerator
from lockstep.trainer import _checkpoints
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
    """

    def __init__(
        self, accelerator: Accelerator, args: TrainingArguments, state: TrainerState, losses: LossSums
    ) -> None:
        self.accelerator = accelerator
        self.args = args
        self.state = state
        self.losses = losses

    def folder(self) -> Path:
        """The folder of the current step's checkpoint."""
        return _checkpoints.checkpoint_folder(self.args.output_dir, self.state.global_step)

    def save(self) -> Path:
        """Save the whole state into ``checkpoint-<step>``; rotate older ones (never the best model's)."""
        self.losses.store(self.accelerator, self.state)
        folder = self.folder()
        best = self.state.best_global_step
        if best is not None:
            best_folder = _checkpoints.checkpoint_folder(self.args.output_dir, best)
            if best == self.state.global_step or best_folder.is_dir():
                self.state.best_model_checkpoint = str(best_folder)
        self.accelerator.save_state(str(folder))
        self.rotate(folder)
        return folder

    def rotate(self, folder: Path) -> None:
        """Delete the checkpoints ``save_total_limit`` no longer keeps (main process), then synchronise."""
        if self.accelerator.is_main_process:
            protected = self.state.best_model_checkpoint
            for removed in _checkpoints.rotate_checkpoints(
                self.args.output_dir,
                self.args.save_total_limit,
                folder,
                protected=None if protected is None else Path(protected),
            ):
                logger.info("Deleted %s (save_total_limit=%s)", removed, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()

    def save_and_exit(self) -> None:
        """A preemption signal reached some rank: every rank saves one checkpoint, then the job exits (143)."""
        self.losses.store(self.accelerator, self.state)
        self.accelerator.checkpoint_and_exit(str(self.folder()))

    def resolve(self, resume: str | bool | None) -> Path | None:
        """The folder ``resume_from_checkpoint`` names: True (or "latest") is the newest valid checkpoint of
        ``output_dir``, as the main process sees it."""
        if resume is None or resume is False:
            return None
        if isinstance(resume, str) and resume.strip().lower() in ("true", "latest"):
            resume = True
        if resume is not True:
            return Path(resume)
        choice: list[str | None] = [None]
        if self.accelerator.is_main_process:
            found = _checkpoints.newest_valid_checkpoint(self.args.output_dir)
            choice[0] = None if found is None else str(found)
        if self.accelerator.num_processes > 1:
            broadcast_object_list(choice)
        if choice[0] is None:
            raise ValueError(
                f"train(resume_from_checkpoint=True): {self.args.output_dir!r} holds no valid checkpoint-<step> "
                "folder. Train without resume_from_checkpoint to start from scratch, or pass a checkpoint path."
            )
        return Path(choice[0])

    def load_best(self) -> Path:
        """Load the best checkpoint's state; the run's TrainerState (steps, logs) stays that of the end."""
        folder, finished = Path(str(self.state.best_model_checkpoint)), self.state.state_dict()
        self.accelerator.load_state(str(folder))
        self.state.load_state_dict(finished)
        if self.args.save_total_limit == 1 and self.accelerator.is_main_process:
            # transformers' rule: with a limit of 1, the best checkpoint is the one that remains.
            _checkpoints.keep_only(self.args.output_dir, folder)
        self.accelerator.wait_for_everyone()
        return folder
