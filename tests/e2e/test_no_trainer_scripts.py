"""transformers' own ``run_clm_no_trainer.py`` and ``run_mlm_no_trainer.py``, with the import changed to
lockstep, train a tiny GPT-2 and a tiny BERT from scratch, offline, on 2 CPU processes.

The scripts are transformers' files, unchanged but for the lines in :data:`CHANGES` (applied here, to a
copy in a temporary folder): the imports, and ``send_example_telemetry``, which transformers 5 removed.
(The scripts call ``wait_for_everyone()`` and save after ``accelerator.end_training()``: under Accelerate,
which destroys the process group there, that fails with ``--with_tracking`` on several processes,
transformers issue #37434; lockstep keeps the group until exit.) They are read from
``tests/e2e/no_trainer/``, where they are kept verbatim (see the README there); without transformers,
datasets, tokenizers or tensorboard, the tests skip.

What runs (each script: one uninterrupted 2-process run, one 2-process resume, one 1-process run):

- clm: ``lockstep launch --num-processes 2`` trains 2 epochs (26 steps) and checkpoints every 5 steps;
  torchrun resumes from its ``step_10`` (mid-epoch 0) into a new folder.
- mlm: torchrun trains; ``lockstep launch`` resumes from its ``step_10``.

Checked: both launchers finish and write ``step_N`` checkpoints and the final model; the resumed run's
final weights are bitwise the uninterrupted run's, and so are its evaluation values (the masked-LM collator
draws its masks from torch's global generator, one batch ahead of training: the checkpoint replays them);
the TensorBoard values of the 2-process run match a 1-process run with the same global batch (see
:func:`test_tracker_values_match_one_process` for the tolerance).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import hf_examples
from tests.helpers.cli import REPO, cli_env
from tests.helpers.ports import TORCHRUN_STANDALONE

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tokenizers")
pytest.importorskip("tensorboard")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FIXTURES = REPO / "tests" / "e2e" / "no_trainer"
UPSTREAM_VERSION = "4.56.0.dev0"  # check_min_version() in both scripts; provenance in no_trainer/README.md
SHA256 = {
    "run_clm_no_trainer.py": "98c99ac8ffcf056a878855136a89749cfab2074c148b7f43c6f41af8fd837247",
    "run_mlm_no_trainer.py": "b86158466b08e9fbcd446da298eee646a241ebc10c6a8ea9e0834eb8f06a3cdb",
}

CHANGES: list[tuple[str, str, str]] = [
    # (what upstream has, what runs here, why)
    (
        "from accelerate import Accelerator, DistributedType\n",
        "from lockstep import Accelerator, DistributedType\n",
        "the import",
    ),
    (
        "from accelerate.logging import get_logger\n",
        "from lockstep.logging import get_logger\n",
        "the import",
    ),
    ("from accelerate.utils import set_seed\n", "from lockstep.utils import set_seed\n", "the import"),
    (
        "from transformers.utils import check_min_version, send_example_telemetry\n",
        "from transformers.utils import check_min_version\n",
        "transformers 5 removed send_example_telemetry",
    ),
    ('    send_example_telemetry("{script}", args)\n', "", "transformers 5 removed send_example_telemetry"),
]


def adapted_script(name: str, folder: Path) -> Path:
    """The upstream script ``name`` with :data:`CHANGES` applied, written to ``folder``."""
    script = name[:-3]
    changes = [
        (old.replace("{script}", script), new.replace("{script}", script), why) for old, new, why in CHANGES
    ]
    upstream = f"examples/pytorch/language-modeling/{name} of transformers {UPSTREAM_VERSION}"
    target = hf_examples.adapted_script(FIXTURES / name, SHA256[name], changes, folder, upstream=upstream)
    imports = [
        line for line in target.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))
    ]
    hugging_face_accelerate = [line for line in imports if "accelerate" in line.split()[1]]
    assert not hugging_face_accelerate, hugging_face_accelerate
    return target


# -- offline data, tokenizer and model configurations -------------------------------------------------
# 8 words a line: 104 and 128 blocks of 32 tokens (clm) or 40 (mlm, with [CLS] and [SEP]), both multiples
# of the global batch (8), so that no process pads its last batch. A large validation set keeps the masked
# LM's evaluation (a random 15% of the tokens) steady.
TRAIN_LINES, VALIDATION_LINES = 416, 512


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text files, a word-level tokenizer and a tiny GPT-2 and BERT configuration, made here."""
    root = tmp_path_factory.mktemp("no_trainer")
    rng = random.Random(0)
    (root / "train.txt").write_text(hf_examples.sentences(rng, TRAIN_LINES))
    (root / "validation.txt").write_text(hf_examples.sentences(rng, VALIDATION_LINES))
    words = sorted({w for name in ("train.txt", "validation.txt") for w in (root / name).read_text().split()})
    for kind in ("clm", "mlm"):
        hf_examples.save_model_folder(root / kind, kind, words)
        adapted_script(f"run_{kind}_no_trainer.py", root)
    return root


# -- running the scripts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    output_dir: Path
    result: subprocess.CompletedProcess

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (run,) = [p for p in self.output_dir.iterdir() if p.name.endswith("_no_trainer")]
        events = EventAccumulator(str(run))
        events.Reload()
        return [(event.step, event.value) for event in events.Scalars(tag)]


def _script_args(root: Path, kind: str, batch: int, output_dir: Path) -> list[str]:
    length = ["--block_size", "32"] if kind == "clm" else ["--max_seq_length", "40"]
    return [
        *("--config_name", str(root / kind), "--tokenizer_name", str(root / kind)),
        *("--model_type", "gpt2" if kind == "clm" else "bert", *length),
        *("--train_file", str(root / "train.txt"), "--validation_file", str(root / "validation.txt")),
        *("--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", str(batch)),
        *("--learning_rate", "1e-3", "--num_train_epochs", "2", "--seed", "0", "--checkpointing_steps", "5"),
        *("--with_tracking", "--report_to", "tensorboard", "--output_dir", str(output_dir)),
    ]


def _run(root: Path, launcher: str, kind: str, name: str, *extra: str) -> Run:
    output_dir = root / name
    script = str(root / f"run_{kind}_no_trainer.py")
    batch = 8 if launcher == "python" else 4  # the same global batch of 8
    command = {
        "python": [sys.executable, script],
        "lockstep": [sys.executable, "-m", "lockstep.cli.main", "launch", "--num-processes", "2", script],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *TORCHRUN_STANDALONE,
            "--nproc-per-node",
            "2",
            script,
        ],
    }[launcher]
    hub = root / "hf_home"
    env = cli_env(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(hub),
        HF_DATASETS_CACHE=str(hub / "datasets"),
        OMP_NUM_THREADS="1",
    )
    args = [*command, *_script_args(root, kind, batch, output_dir), *extra]
    result = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return Run(output_dir, result)


@dataclass(frozen=True)
class Runs:
    kind: str
    whole: Run  # 2 processes, uninterrupted
    resumed: Run  # 2 processes, from the uninterrupted run's step_10, under the other launcher
    single: Run  # 1 process, the same global batch


RESUME_AT = "step_10"  # epoch 0 has 13 steps: the resumed run finishes epoch 0, then runs epoch 1


@pytest.fixture(scope="module", params=["clm", "mlm"])
def runs(request: pytest.FixtureRequest, offline: Path) -> Runs:
    kind = request.param
    first, second = ("lockstep", "torchrun") if kind == "clm" else ("torchrun", "lockstep")
    whole = _run(offline, first, kind, f"{kind}_whole")
    checkpoint = str(whole.output_dir / RESUME_AT)
    resumed = _run(offline, second, kind, f"{kind}_resumed", "--resume_from_checkpoint", checkpoint)
    single = _run(offline, "python", kind, f"{kind}_single")
    return Runs(kind, whole, resumed, single)


# -- checks ----------------------------------------------------------------------------------------
def test_two_processes_finish_with_checkpoints_and_the_final_model(runs: Runs):
    whole = runs.whole.output_dir
    assert sorted(p.name for p in whole.glob("step_*")) == [f"step_{n}" for n in (10, 15, 20, 25, 5)]
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        assert (whole / "step_25" / name).is_file(), name
    assert (whole / "step_25" / "random_states_1.pkl").is_file()  # one per rank
    for name in ("model.safetensors", "config.json", "tokenizer.json", "all_results.json"):
        assert (whole / name).is_file(), name
    resumed = runs.resumed.output_dir
    assert sorted(p.name for p in resumed.glob("step_*")) == ["step_15", "step_20", "step_25"]
    assert f"Resumed from checkpoint: {whole / RESUME_AT}" in runs.resumed.result.stdout
    assert [step for step, _ in runs.whole.scalars("perplexity")] == [13, 26]


def test_resuming_from_a_step_checkpoint_ends_bitwise_equal(runs: Runs):
    whole, resumed = runs.whole, runs.resumed
    weights = (whole.output_dir / "model.safetensors").read_bytes()
    assert (resumed.output_dir / "model.safetensors").read_bytes() == weights
    assert json.loads((resumed.output_dir / "all_results.json").read_text()) == json.loads(
        (whole.output_dir / "all_results.json").read_text()
    )
    # The evaluation after the resumed epoch 0 and after epoch 1 (the masked LM masks its evaluation
    # batches with the global generator too, so these equal only if every random number was replayed).
    for tag in ("perplexity", "eval_loss", "step", "epoch"):
        assert resumed.scalars(tag) == whole.scalars(tag), tag
    # The scripts' train_loss sums the batches this run saw: the resumed epoch 0 saw 3 of its 13.
    assert resumed.scalars("train_loss")[1:] == whole.scalars("train_loss")[1:]


# Relative tolerance of the 1- vs 2-process comparison: about 3x the largest gap measured (see below).
TOLERANCE = {"clm": 0.01, "mlm": 0.03}


def test_tracker_values_match_one_process(runs: Runs):
    """The 2-process run against 1 process with the same global batch (8) and initial weights.

    They cannot be equal: with several processes the shuffling sampler draws from its own generator, as in
    Accelerate, while one process draws exactly what the plain DataLoader draws (issue 15); dropout and the
    masked-LM masks are drawn on two ranks instead of one. The runs see the same samples each epoch, in
    another order and with other noise. Measured over seeds 0-3 (eval_loss and train_loss after each epoch),
    the largest gap was 0.28% for clm and 1.12% for mlm, whose loss also averages over a random 15% of the
    tokens; the tolerance is about three times that (:data:`TOLERANCE`). Dropout stays on, as the scripts'
    default configurations have it: with it off the clm gap stays about the same (0.1%), since the order
    differs anyway. Over the two epochs the evaluation loss falls from that of a uniform guess, ln(47) = 3.85
    (clm) and ln(51) = 3.93 (mlm), to about 3.39 and 3.72.
    """
    two, one = runs.whole, runs.single
    assert two.scalars("step") == one.scalars("step") == [(13, 13.0), (26, 26.0)]
    assert two.scalars("epoch") == one.scalars("epoch") == [(13, 0.0), (26, 1.0)]
    tolerance = TOLERANCE[runs.kind]
    for tag in ("eval_loss", "train_loss"):
        for (_, value_two), (_, value_one) in zip(two.scalars(tag), one.scalars(tag), strict=True):
            assert value_two == pytest.approx(value_one, rel=tolerance), (tag, value_two, value_one)
    for (_, perplexity), (_, loss) in zip(two.scalars("perplexity"), two.scalars("eval_loss"), strict=True):
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-6)
    vocabulary = json.loads((two.output_dir / "config.json").read_text())["vocab_size"]
    untrained = math.log(vocabulary)  # the loss of a uniform guess: 46 words and 1 (clm) or 5 special tokens
    losses = [value for _, value in two.scalars("eval_loss")]
    assert losses[1] < losses[0] < untrained  # it learned in both epochs
