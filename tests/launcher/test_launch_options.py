"""What each launch flag turns into, without starting workers: settings, the agent's configuration, the
workers' environment and the dynamo settings their plugin is built from."""

from __future__ import annotations

import argparse
import json

import pytest

from lockstep import _env
from lockstep.cli.launch_flags import add_launch_flags, given_flags
from lockstep.config.file import ClusterConfig
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.errors import UsageError
from lockstep.launcher._worker import cpu_share
from lockstep.launcher.elastic import prepare_worker_environment, report_failures, torch_launch_config
from lockstep.launcher.settings import LaunchSettings, parse_rdzv_conf, resolve


def _settings(*argv: str, file_config: ClusterConfig | None = None) -> LaunchSettings:
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    return resolve(given_flags(parser.parse_args(["--cpu", *argv])), file_config, "cfg.yaml")


def test_agent_configuration_carries_role_restarts_interval_and_rendezvous_options():
    settings = _settings(
        "--num-processes", "2", "--role", "trainer", "--max_restarts", "3", "--monitor_interval", "0.5",
        "--rdzv_conf", "join_timeout=900, rank=7",
    )  # fmt: skip
    config = torch_launch_config(settings)
    assert (config.role, config.max_restarts, config.monitor_interval) == ("trainer", 3, 0.5)
    # torch adds its default "timeout"; the machine rank beats --rdzv-conf's for static rendezvous.
    assert config.rdzv_configs == {"join_timeout": "900", "rank": 0, "timeout": 900}
    c10d = torch_launch_config(_settings("--rdzv-backend", "c10d", "--rdzv-conf", "read_timeout=60"))
    assert c10d.rdzv_configs == {"read_timeout": "60", "timeout": 900}


def test_tee_and_log_dir_become_the_agents_log_specs(tmp_path):
    from torch.distributed.elastic.multiprocessing import Std

    specs = torch_launch_config(_settings("-t", "0:3,1:1", "--log_dir", str(tmp_path))).logs_specs
    assert specs.root_log_dir == str(tmp_path)
    assert specs._tee == {0: Std.ALL, 1: Std.OUT}
    default = torch_launch_config(_settings()).logs_specs
    assert default._tee == Std.NONE and default.root_log_dir != str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tee", "4"], "--tee '4' is invalid: use 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--rdzv-conf", "timeout"], "--rdzv-conf 'timeout' is invalid: 'timeout' is not key=value."),
        (["--role", " "], "--role ' ' is invalid: give the workers' role a name."),
        (
            ["--num-cpu-threads-per-process", "0"],
            "--num-cpu-threads-per-process 0 is invalid: it must be >= 1.",
        ),
        (["--dynamo-mode", "fast"], "--dynamo-mode must be one of default, reduce-overhead, max-autotune"),
    ],
)
def test_bad_values_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        _settings(*argv)


def test_threads_flag_beats_the_environment_which_beats_the_default():
    environ = {"OMP_NUM_THREADS": "7"}
    prepare_worker_environment(_settings("--num_cpu_threads_per_process", "3"), environ)
    assert environ["OMP_NUM_THREADS"] == "3"
    environ = {"OMP_NUM_THREADS": "7"}
    prepare_worker_environment(_settings(), environ)
    assert environ["OMP_NUM_THREADS"] == "7"


def test_dynamo_flags_and_file_keys_reach_the_workers_plugin():
    file_config = ClusterConfig(
        dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_mode": "reduce-overhead"}
    )
    settings = _settings("--dynamo_use_fullgraph", "--dynamo-use-dynamic", file_config=file_config)
    assert settings.dynamo_backend == "inductor"
    assert settings.dynamo_config == {
        "dynamo_mode": "reduce-overhead",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": True,
    }
    assert settings.sources["dynamo_config"] == "config file cfg.yaml + flags"
    environ: dict[str, str] = {}
    prepare_worker_environment(settings, environ)
    launch = _env.launch_settings(environ)
    assert launch["dynamo_plugin"] == {"mode": "reduce-overhead", "fullgraph": True, "dynamic": True}
    # The line proposed for lockstep.accelerator.settings.resolve_dynamo builds the workers' plugin so:
    plugin = TorchDynamoPlugin(backend=launch["dynamo_backend"], **launch.get("dynamo_plugin", {}))
    assert plugin.compile_kwargs() == {
        "backend": "inductor",
        "fullgraph": True,
        "mode": "reduce-overhead",
        "dynamic": True,
    }


def test_regional_compilation_reaches_the_workers_plugin():
    launch = _settings("--dynamo-backend", "eager", "--dynamo_use_regional_compilation").worker_settings()
    assert launch["dynamo_plugin"] == {"use_regional_compilation": True}
    plugin = TorchDynamoPlugin(backend="eager", **launch["dynamo_plugin"])  # no warning: it is built
    assert plugin.use_regional_compilation is True and plugin.enabled


def test_settings_without_effect_are_named():
    assert _settings("--downcast_bf16").notes() == [
        "downcast_bf16 is a TPU setting (XLA_DOWNCAST_BF16) and changes nothing on CPUs and GPUs: "
        "mixed_precision bf16 already computes in bf16 and keeps float32 weights."
    ]
    assert _settings("--dynamo-mode", "default", "--dynamo-use-dynamic").notes() == [
        "--dynamo-mode, --dynamo-use-dynamic have no effect without --dynamo-backend."
    ]
    assert _settings("--dynamo-backend", "eager", "--dynamo-mode", "default").notes() == []


def test_cpu_affinity_is_a_setting_of_flag_or_file_and_reaches_the_workers():
    assert _settings("--enable_cpu_affinity").worker_settings()["enable_cpu_affinity"] is True
    from_file = _settings(file_config=ClusterConfig(enable_cpu_affinity=True, downcast_bf16=True))
    assert (from_file.enable_cpu_affinity, from_file.downcast_bf16) == (True, True)
    assert _settings().worker_settings()["enable_cpu_affinity"] is False


@pytest.mark.parametrize(
    ("cpus", "workers", "shares"),
    [
        (range(8), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (range(7), 3, [[0, 1], [2, 3], [4, 5]]),
        ([4, 6], 3, [[4], [6], [4]]),
    ],
)
def test_each_worker_gets_an_equal_contiguous_share_of_the_cores(cpus, workers, shares):
    assert [cpu_share(list(cpus), rank, workers) for rank in range(workers)] == shares


def test_rdzv_conf_is_read_as_torchrun_reads_it():
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf("a=1,b = x=y ,") == {"a": "1", "b": "x=y"}
    with pytest.raises(UsageError, match=r"'=3' is not key=value"):
        parse_rdzv_conf("a=1,=3")


def test_quiet_reports_only_the_root_cause(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {"timestamp": "1"}}})
    )
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none.json")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(error_file)),
    }
    assert report_failures(failures, quiet=True) == 1
    assert capsys.readouterr().err.splitlines() == [
        "lockstep launch: rank 1 (local rank 1, pid 11) failed with exit code 1: ValueError: boom"
    ]
    assert report_failures(failures) == 1
    assert capsys.readouterr().err.splitlines()[1:] == [
        "lockstep launch: rank 0 (local rank 0, pid 10) was killed by SIGTERM (exit code -15)",
        "lockstep launch: the other workers were stopped.",
    ]


def test_worker_settings_are_json():
    settings = _settings("--dynamo-backend", "eager", "--dynamo-mode", "max-autotune")
    assert json.loads(json.dumps(settings.worker_settings()))["dynamo_plugin"] == {"mode": "max-autotune"}


def _agent_stopped_before_its_timer() -> None:
    """The shape torch's agent fails with when SIGTERM lands between a metrics wrapper's entry and its
    ``start = time.time()``: the wrapper's ``finally`` reads ``start`` while the signal's exception unwinds."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def timer() -> float:
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    try:
        start = timer()
    finally:
        print(start)  # unbound here, as in torch


@pytest.mark.parametrize("raised_as", ["SignalException", "UnboundLocalError"])
def test_a_stop_signal_exits_128_plus_the_signal_however_the_agent_raised_it(raised_as, monkeypatch, capsys):
    import os

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from lockstep.launcher.elastic import launch

    def stopped(*args: object) -> None:
        if raised_as == "SignalException":
            raise SignalException("Process 1 got signal: 15", sigval=15)
        _agent_stopped_before_its_timer()

    monkeypatch.setattr(os, "environ", os.environ.copy())  # launch sets the workers' environment here
    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, entry: stopped)
    assert launch(_settings("--num-processes", "2"), "train.sh", [], no_python=True) == 143
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lockstep launch: received SIGTERM; the workers were stopped."
    )


def test_an_agent_error_without_a_stop_signal_is_raised_as_it_is(monkeypatch):
    import os

    import torch.distributed.launcher.api as launcher_api

    from lockstep.launcher.elastic import launch

    def broken(*args: object) -> None:
        raise RuntimeError("rendezvous closed")

    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, entry: broken)
    with pytest.raises(RuntimeError, match="rendezvous closed"):
        launch(_settings("--num-processes", "2"), "train.sh", [], no_python=True)
