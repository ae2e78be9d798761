"""examples/ray_torch_trainer.py on a local Ray cluster (2 CPUs, 2 workers) whose worker 1 is killed (SIGKILL)
at step KILL_AT on its first attempt; Ray restarts the group once and lockstep resumes.

Usage: ray_resume.py STORAGE_DIR RAY_TEMP_DIR KILL_AT
Prints `RESULT <json>`: rank 0's summary of the last attempt. An attempt that finds checkpoints (the
restarted one) seeds torch with 1 instead of 0 (other initial weights, dropout and data order), so only a
real resume reaches an uninterrupted run's weights. Ray is shut down on every exit path; its processes run
under RAY_TEMP_DIR, so the caller can check that none is left.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
sys.path.insert(0, EXAMPLES)
# Ray's workers inherit the environment of the cluster that ray.init starts here.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")]))

import ray  # noqa: E402
from ray_torch_trainer import fit  # noqa: E402


def seeded_by_attempt(config: dict[str, Any]) -> dict[str, Any]:
    from ray_torch_trainer import train_loop

    attempt = 1 if os.path.isdir(os.path.join(config["project_dir"], "checkpoints")) else 0
    return train_loop({**config, "seed": config["seed"] + attempt})


def main() -> None:
    storage, temp_dir, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        summary = fit(
            storage_path=storage, name="killed", kill_worker_at=kill_at, train_function=seeded_by_attempt
        )
        print(f"RESULT {json.dumps(summary)}", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
