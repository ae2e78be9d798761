"""The process-aware logger: main process only, every process, rank order, levels, warning_once."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

import lockstep.logging
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


def _find_caller_py310(
    self: logging.Logger, stack_info: bool = False, stacklevel: int = 1
) -> tuple[str, int, str, str | None]:
    """``Logger.findCaller`` as CPython 3.10 has it: ``stacklevel`` counts logging's own frames too.

    3.11 changed it to skip them (bpo-45171); lockstep supports both, and the tests run on one.
    """
    frame: FrameType | None = sys._getframe(2)  # Logger.log, below findCaller and Logger._log
    frame = frame.f_back if frame is not None else None
    start = frame
    while frame is not None and stacklevel > 1:
        frame, stacklevel = frame.f_back, stacklevel - 1
    frame = frame or start
    while frame is not None and os.path.normcase(frame.f_code.co_filename) == logging._srcfile:
        frame = frame.f_back
    assert frame is not None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None


@pytest.fixture(params=["this python", "python 3.10"])
def find_caller(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a test with this interpreter's ``findCaller`` and with Python 3.10's."""
    if request.param == "python 3.10":
        monkeypatch.setattr(logging.Logger, "findCaller", _find_caller_py310)
    monkeypatch.setattr(lockstep.logging, "_warned_once", set())


def _line() -> int:
    """The line number of the caller's current line."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def _log_from_a_helper(logger: MultiProcessAdapter, stacklevel: int) -> int:
    logger.info("from the helper, stacklevel=%d", stacklevel, stacklevel=stacklevel)
    return _line() - 1


def _where(handler: _ListHandler) -> list[tuple[str, str, int, str]]:
    return [(r.getMessage(), r.filename, r.lineno, r.funcName) for r in handler.records]


def test_records_name_the_calling_line(find_caller: None) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="DEBUG")
    handler = _capture(logger)
    first = _line() + 1
    logger.info("info")
    logger.debug("debug", stacklevel=1)
    logger.warning("warning", main_process_only=False)
    logger.error("error", main_process_only=False, in_order=True)
    logger.critical("critical")
    logger.exception("exception")
    logger.log(logging.INFO, "log")
    logger.log(logging.INFO, "log, stacklevel=1", stacklevel=1)
    here = [
        (message, "test_logging.py", first + i, "test_records_name_the_calling_line")
        for i, message in enumerate(
            ["info", "debug", "warning", "error", "critical", "exception", "log", "log, stacklevel=1"]
        )
    ]
    assert _where(handler) == here


def test_stacklevel_counts_frames_as_accelerate_does(find_caller: None) -> None:
    """Accelerate counts its logger's frame as 1: 2 (the default) is the calling line, 3 its caller."""
    PartialState()
    logger = get_logger(NAME, log_level="INFO")
    handler = _capture(logger)
    helper_line = _log_from_a_helper(logger, stacklevel=2)
    call_line = _line() + 1
    _log_from_a_helper(logger, stacklevel=3)  # the helper's caller: this line
    _log_from_a_helper(logger, stacklevel=1)  # Accelerate's own line there; here the calling line
    name = "test_stacklevel_counts_frames_as_accelerate_does"
    assert _where(handler) == [
        ("from the helper, stacklevel=2", "test_logging.py", helper_line, "_log_from_a_helper"),
        ("from the helper, stacklevel=3", "test_logging.py", call_line, name),
        ("from the helper, stacklevel=1", "test_logging.py", helper_line, "_log_from_a_helper"),
    ]


class _CustomLogger(logging.LoggerAdapter):
    """Accelerate's test_custom_stacklevel wrapper: it sets stacklevel=3 to name its own caller."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs["stacklevel"] = 3
        self.logger.log(level, msg, *args, **kwargs)


def test_a_wrapper_with_stacklevel_3_names_its_caller_as_in_accelerate() -> None:
    PartialState()
    wrapped = get_logger(NAME, log_level="INFO")
    handler = _capture(wrapped)
    line = _line() + 1
    _CustomLogger(wrapped, {}).warning("Test")
    name = "test_a_wrapper_with_stacklevel_3_names_its_caller_as_in_accelerate"
    assert _where(handler) == [("Test", "test_logging.py", line, name)]


def test_warning_once_names_the_calling_line(find_caller: None) -> None:
    PartialState()
    logger = get_logger(NAME, log_level="INFO")
    handler = _capture(logger)
    first = _line() + 1
    logger.warning_once("once")
    logger.warning_once("once")
    logger.warning_once("once with stacklevel=%d", 1, stacklevel=1)
    name = "test_warning_once_names_the_calling_line"
    assert _where(handler) == [
        ("once", "test_logging.py", first, name),
        ("once with stacklevel=1", "test_logging.py", first + 2, name),
    ]
