"""The library's log lines when embedded: stderr while the host never configured structlog,
the host's configuration once it has one (``ggufswap.logs``). Real subprocesses, since
structlog's configuration is process-global."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

WRITE_MODEL = """
from ggufswap.shards.presets import tiny_dense
from ggufswap.shards.writer import write_model
write_model(tiny_dense(), {out!r})
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_unconfigured_host_gets_log_lines_on_stderr_and_clean_stdout(tmp_path: Path) -> None:
    done = run(
        WRITE_MODEL.format(out=str(tmp_path / "m"))
        + "from ggufswap.logs import get_logger\n"
        + "get_logger('t').debug('hidden_debug_line')\n"
        + "print('DATA')\n"
    )
    assert done.stdout == "DATA\n"  # the host's own output only
    assert "model_written" in done.stderr
    assert "hidden_debug_line" not in done.stderr  # info and above while unconfigured


def test_configuration_made_after_import_is_followed(tmp_path: Path) -> None:
    """The host configures structlog after importing ggufswap (module loggers already exist):
    lines follow the host's renderer and destination, bound context included."""
    log_file = tmp_path / "host.log"
    code = f"""
    import structlog
    from ggufswap.shards.writer import write_model
    from ggufswap.shards.presets import tiny_dense
    from ggufswap.logs import get_logger
    sink = open({str(log_file)!r}, "w")
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=sink),
    )
    write_model(tiny_dense(), {str(tmp_path / "m")!r})
    get_logger("t").bind(round=3).info("bound_line", k=1)
    sink.close()
    """
    done = run(code)
    assert done.stdout == ""
    assert "model_written" not in done.stderr
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["model_written", "bound_line"]
    assert lines[1] == {"event": "bound_line", "round": 3, "k": 1}
