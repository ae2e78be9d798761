"""The process-aware logger: main process only, every process, rank order, levels, warning_once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lockstep.logging import MultiProcessAdapter, get_logger
from lockstep.state import PartialState
from tests.helpers.multiprocess import run_distributed

NAME = "lockstep.tests.logging"


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _capture(logger: MultiProcessAdapter) -> _ListHandler:
    handler = _ListHandler()
    logger.logger.addHandler(handler)
    logger.logger.propagate = False
    return handler


@pytest.fixture(autouse=True)
def _restore_levels() -> Iterator[None]:
    named, root = logging.getLogger(NAME), logging.getLogger()
    levels, propagate = (named.level, root.level), named.propagate
    yield
    named.setLevel(levels[0])
    root.setLevel(levels[1])
    named.propagate = propagate
    named.handlers.clear()


def _logging_worker() -> list[tuple[str, float]]:
    state = PartialState()
    logger = get_logger(NAME, log_level="INFO")
    handler = _capture(logger)
    logger.info("main only %d", 1)
    logger.info("everyone %d", state.process_index, main_process_only=False)
    logger.debug("below the level", main_process_only=False)
    # Rank 0 starts late: only in_order=True makes it log first anyway.
    if state.is_main_process:
        time.sleep(0.3)
    logger.info("in order", main_process_only=False, in_order=True)
    state.wait_for_everyone()
    if state.is_main_process:
        time.sleep(0.3)
    logger.info("any order", main_process_only=False)
    state.wait_for_everyone()
    logger.info("main only, in_order ignored", in_order=True)
    return [(record.getMessage(), record.created) for record in handler.records]


@pytest.mark.distributed
def test_main_process_only_and_in_order_in_two_processes() -> None:
    rank0, rank1 = run_distributed(_logging_worker, 2, timeout=30)
    assert [message for message, _ in rank0] == [
        "main only 1",
        "everyone 0",
        "in order",
        "any order",
        "main only, in_order ignored",
    ]
    assert [message for message, _ in rank1] == ["everyone 1", "in order", "any order"]
    created = {
        (rank, message): when for rank, records in enumerate([rank0, rank1]) for message, when in records
    }
    assert created[0, "in order"] < created[1, "in order"]
    assert created[1, "any order"] < created[0, "any order"]  # the control: without in_order rank 1 wins


def test_logging_before_the_state_exists_is_an_error() -> None:
    logger = get_logger(NAME)
    with pytest.raises(RuntimeError, match=r"Create the Accelerator\(\) or PartialState\(\) first, then log"):
        logger.info("too early")


def test_records_point_at_the_caller_and_warning_once_warns_once() -> None:
    PartialState()
    logger = get_logger(NAME, log_level="DEBUG")
    handler = _capture(logger)
    logger.debug("from the test")
    logger.warning_once("careful %s", "x")
    logger.warning_once("careful %s", "x")
    logger.warning_once("careful %s", "y")
    assert [(r.getMessage(), r.levelname) for r in handler.records] == [
        ("from the test", "DEBUG"),
        ("careful x", "WARNING"),
        ("careful y", "WARNING"),
    ]
    assert {(r.filename, r.funcName) for r in handler.records} == {
        ("test_logging.py", "test_records_point_at_the_caller_and_warning_once_warns_once")
    }


def test_level_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_LOG_LEVEL", "error")
    PartialState()
    logger = get_logger(NAME)
    handler = _capture(logger)
    logger.warning("hidden")
    logger.error("shown")
    assert logging.getLogger(NAME).level == logging.ERROR
    assert [r.getMessage() for r in handler.records] == ["shown"]


def test_explicit_level_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_LOG_LEVEL", "ERROR")
    get_logger(NAME, log_level="info")
    assert (logging.getLogger(NAME).level, logging.getLogger().level) == (logging.INFO, logging.INFO)


@pytest.mark.parametrize(
    ("kwargs", "env", "source"),
    [
        ({"log_level": "LOUD"}, None, "get_logger\\(log_level\\)='LOUD'"),
        ({}, "LOUD", "LOCKSTEP_LOG_LEVEL='LOUD'"),
    ],
)
def test_unknown_level_is_rejected(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], env: str | None, source: str
) -> None:
    if env is not None:
        monkeypatch.setenv("LOCKSTEP_LOG_LEVEL", env)
    with pytest.raises(ValueError, match=f"{source} is not a logging level: use DEBUG, INFO, WARNING"):
        get_logger(NAME, **kwargs)
