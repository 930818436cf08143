"""host/progress.py: a slow step says what it does and how long it took, on a terminal or not;
a quick one says nothing."""
from __future__ import annotations

import re
import time

import pytest

from host.progress import progress


def test_a_quick_step_says_nothing() -> None:
    lines: list[str] = []
    with progress("pie run", "compiling app.wasm", after_s=1.0, write=lines.append):
        pass
    assert lines == []


def test_a_slow_step_says_what_it_does_while_it_runs_and_how_long_it_took() -> None:
    lines: list[str] = []
    with progress("pie run", "compiling app.wasm", after_s=0.05, every_s=0.1,
                  write=lines.append):
        time.sleep(0.32)
    assert lines[0] == "pie run: compiling app.wasm ..."
    assert all(re.fullmatch(r"pie run: still compiling app\.wasm \(\d+ s\)", line)
               for line in lines[1:-1]) and len(lines) >= 4
    assert re.fullmatch(r"pie run: compiling app\.wasm: done in \d+\.\d s", lines[-1]), lines


def test_a_failed_step_says_so_and_a_quiet_one_speaks_only_at_its_end() -> None:
    lines: list[str] = []
    with pytest.raises(RuntimeError):
        with progress("", "loading model.gguf", after_s=0.0, write=lines.append,
                      quiet_while_running=True):
            time.sleep(0.05)
            raise RuntimeError("no")
    assert len(lines) == 1 and lines[0].startswith("loading model.gguf: failed after 0.")


def test_lines_go_to_stderr_when_it_is_not_a_terminal(capsys) -> None:
    with progress("pie build", "building app.py", after_s=0.0, every_s=60):
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert "pie build: building app.py ...\n" in err
    assert "pie build: building app.py: done in" in err
