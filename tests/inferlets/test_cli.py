"""The `pie` command, as a user runs it (subprocesses): help, build errors, run exit codes,
streaming and stdin messages."""
from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.inferlets.conftest import REPO, TEST_APPS

PIE = [sys.executable, "-m", "host.cli"]


def pie(args: list[str], env: dict, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(PIE + args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


@pytest.mark.parametrize("command", [[], ["build"], ["run"]])
def test_every_command_has_help(command, cli_env):
    done = pie(command + ["--help"], cli_env, timeout=60)
    assert done.returncode == 0 and "usage: pie" in done.stdout


def write_app(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def test_build_reports_a_syntax_error_with_its_line(tmp_path, cli_env):
    app = write_app(tmp_path, "broken", "import inferlet\n\n@inferlet.main\ndef main(:\n    pass\n")
    done = pie(["build", str(app)], cli_env)
    assert done.returncode == 1 and f"{app}:4:" in done.stderr and "syntax error" in done.stderr
    assert not app.with_suffix(".wasm").exists()


def test_build_reports_a_missing_entry_point(tmp_path, cli_env):
    app = write_app(tmp_path, "no_entry", "import inferlet\n\ndef main(args):\n    return 'x'\n")
    done = pie(["build", str(app)], cli_env)
    assert done.returncode == 1 and "no entry point" in done.stderr and "@inferlet.main" in done.stderr


def test_build_reports_an_import_that_cannot_be_bundled(tmp_path, cli_env):
    source = "import inferlet\nimport no_such_module_for_pie\n\n@inferlet.main\ndef main(args):\n    return 'x'\n"
    app = write_app(tmp_path, "bad_import", source)
    done = pie(["build", str(app), "-o", str(tmp_path / "out.wasm")], cli_env)
    assert done.returncode == 1 and "cannot be bundled" in done.stderr
    assert "no_such_module_for_pie" in done.stderr and not (tmp_path / "out.wasm").exists()


def test_build_of_a_missing_file(tmp_path, cli_env):
    done = pie(["build", str(tmp_path / "nope.py")], cli_env)
    assert done.returncode == 1 and "no such file" in done.stderr


def test_run_app_py_builds_then_runs_with_arguments(cli_env, component_path):
    component_path("probe")   # the session's build cache is the CLI's ($PIE_CACHE_DIR/builds)
    done = pie(["run", str(TEST_APPS / "probe.py"), "--", "ok", "a", "--b"], cli_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "probe ok a --b\n"


def test_run_streams_messages_before_the_end_and_forwards_stdin(cli_env, component_path):
    wasm = component_path("probe")
    process = subprocess.Popen(PIE + ["run", str(wasm), "--", "echo"], cwd=REPO, env=cli_env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    timer = threading.Timer(300, process.kill)
    timer.start()
    try:
        assert process.stdout.readline() == "ready\n"   # streamed while the instance waits
        stdout, stderr = process.communicate("hello there\n")
    finally:
        timer.cancel()
    assert process.returncode == 0, stderr
    assert stdout == "echo: hello there\n"


def test_run_exit_codes_and_causes(cli_env, component_path):
    wasm = str(component_path("probe"))
    error = pie(["run", wasm, "--", "error"], cli_env, stdin=subprocess.DEVNULL)
    assert error.returncode == 1 and "probe failed on purpose" in error.stderr
    trap = pie(["run", wasm, "--", "trap"], cli_env, stdin=subprocess.DEVNULL)
    assert trap.returncode == 3 and "trapped" in trap.stderr and "987654" in trap.stderr
    memory = pie(["run", wasm, "--memory-mb", "64", "--", "memory"], cli_env, stdin=subprocess.DEVNULL)
    assert memory.returncode == 1 and "MemoryError" in memory.stderr
    strings = pie(["run", wasm, "--memory-mb", "64", "--", "strings"], cli_env,
                  stdin=subprocess.DEVNULL)
    assert strings.returncode == 1 and "memory limit 64 MiB reached" in strings.stderr


def test_run_rejects_bad_options_and_files(cli_env, tmp_path):
    assert pie(["run", "x.wasm", "--memory-mb", "lots"], cli_env, timeout=60).returncode == 2
    missing = pie(["run", str(tmp_path / "missing.wasm")], cli_env, timeout=60)
    assert missing.returncode == 1 and "no such file" in missing.stderr
    (tmp_path / "junk.wasm").write_bytes(b"not a component")
    junk = pie(["run", str(tmp_path / "junk.wasm")], cli_env)
    assert junk.returncode == 1 and "junk.wasm" in junk.stderr


# `pie submit`: the inferlet's arguments after `--`, whatever precedes them (a real server on the
# fake engine: what is checked is the argv the instance receives).
from host.cli import main as pie_main  # noqa: E402
from tests.server.conftest import TOKENS, fake_server, probe_wasm  # noqa: E402,F401


def submit(argv: list[str], capsys) -> tuple[int, str, str]:
    status = pie_main(["submit", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_submit_passes_options_after_the_separator_with_env_vars_only(
        fake_server, component_path, monkeypatch, capsys):
    monkeypatch.setenv("PIE_SERVER", fake_server.url)
    monkeypatch.setenv("PIE_TOKEN", TOKENS["alice"])
    app = str(component_path("probe"))
    assert submit([app, "--", "ok", "--role", "b"], capsys) == (0, "probe ok --role b\n", "")
    assert submit([app, "--", "ok", "--", "--x"], capsys) == (0, "probe ok -- --x\n", "")


def test_submit_passes_arguments_with_options_before_the_separator(
        fake_server, component_path, monkeypatch, capsys):
    monkeypatch.delenv("PIE_SERVER", raising=False)
    monkeypatch.delenv("PIE_TOKEN", raising=False)
    app = str(component_path("probe"))
    after = [app, "--server", fake_server.url, "--token", TOKENS["alice"], "--", "ok", "--role", "b"]
    assert submit(after, capsys) == (0, "probe ok --role b\n", "")
    before = ["--token", TOKENS["alice"], "--server", fake_server.url, app, "--", "ok", "-r"]
    assert submit(before, capsys) == (0, "probe ok -r\n", "")


def test_submit_without_inferlet_arguments(fake_server, component_path, monkeypatch, capsys):
    monkeypatch.setenv("PIE_SERVER", fake_server.url)
    monkeypatch.setenv("PIE_TOKEN", TOKENS["alice"])
    app = str(component_path("probe"))
    assert submit([app], capsys) == (0, "probe ok \n", "")
    monkeypatch.delenv("PIE_TOKEN")
    status, _, err = submit([app, "--", "ok"], capsys)
    assert status == 2 and "no token" in err


def test_run_hands_the_engine_options_to_the_loader(monkeypatch) -> None:
    import engine.engine
    from host.cli import _load_engine, build_parser
    seen = {}
    monkeypatch.setattr(engine.engine, "load_default_engine",
                        lambda **kwargs: seen.update(kwargs) or "engine")
    namespace = build_parser().parse_args(["run", "x.wasm", "--kv-dtype", "float32",
                                           "--dtype", "float32", "--kv-memory-mb", "64",
                                           "--max-pass-tokens", "256", "--no-act8"])
    assert _load_engine(namespace) == "engine"
    assert (seen["kv_dtype"], seen["dtype"], seen["kv_memory_mb"], seen["max_pass_tokens"],
            seen["act8"]) == ("float32", "float32", 64, 256, False)
    seen.clear()
    assert _load_engine(build_parser().parse_args(["run", "x.wasm"])) == "engine"
    assert "max_pass_tokens" not in seen                  # the engine's own default
    assert seen["act8"] is True                           # 8-bit activations by default
    for bad in (["--kv-dtype", "int8"], ["--max-pass-tokens", "0"], ["--max-pass-tokens", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "x.wasm", *bad])


# `pie run`'s instance loop on a fake engine (no model): --logs, --no-stdin, and the line that
# says the instance waits for input.
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: E402,F401


def test_run_logs_show_the_instance_s_print_output(components, make_runtime,  # noqa: F811
                                                   capsys, monkeypatch) -> None:
    from host.cli import _run_instance
    from host.runtime_config import InstanceLimits
    from tests.host.fake_engine import FakeEngine

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    runtime = make_runtime(FakeEngine())
    program = runtime.load_program(components.component("hello_stdio"))
    assert _run_instance(runtime, program, [], InstanceLimits(), lines=False,
                         show_logs=True) == 0
    captured = capsys.readouterr()
    assert captured.out == "printed\n"
    assert "  stdout: hello from stdout\n  stderr: warning on stderr\n" in captured.err
    assert _run_instance(runtime, program, [], InstanceLimits(), lines=False) == 0
    assert "hello from stdout" not in capsys.readouterr().err      # not without --logs


@pytest.mark.parametrize("forward_stdin, hint", [(True, "stdin has ended"),
                                                 (False, "--no-stdin")])
def test_run_says_when_the_instance_waits_for_input(components, make_runtime,  # noqa: F811
                                                    capsys, monkeypatch, forward_stdin,
                                                    hint) -> None:
    """echo waits in receive(); stdin has nothing for it (or is not read): stderr says it
    waits, and the receive limit ends it, naming the limit."""
    from host.cli import EXIT_TRAP, _run_instance
    from host.runtime_config import InstanceLimits
    from tests.host.fake_engine import FakeEngine

    monkeypatch.setattr(sys, "stdin", io.StringIO("" if forward_stdin else "hello\n"))
    runtime = make_runtime(FakeEngine())
    program = runtime.load_program(components.component("echo"))
    status = _run_instance(runtime, program, [], InstanceLimits(max_receive_wait_s=2.5),
                           lines=False, forward_stdin=forward_stdin)
    err = capsys.readouterr().err
    assert status == EXIT_TRAP, err
    assert f"pie run: the inferlet is waiting for input ({hint}" in err
    assert "no message within 2.5 s (max_receive_wait_s)" in err


def test_every_option_of_run_and_submit_is_in_the_docs() -> None:
    """docs/cli.md names every option `pie run` and `pie submit` take (and no run option that
    does not exist)."""
    import re

    from host.cli import build_parser

    text = (REPO / "docs" / "cli.md").read_text()
    subparsers = next(action for action in build_parser()._actions
                      if action.__class__.__name__ == "_SubParsersAction")
    for command in ("run", "submit"):
        options = {option for action in subparsers.choices[command]._actions
                   for option in action.option_strings if option.startswith("--")} - {"--help"}
        missing = sorted(option for option in options if f"`{option}" not in text
                         and f"[{option}" not in text)
        assert not missing, f"pie {command}: {missing} not in docs/cli.md"
    run_section = text.split("## `pie run", 1)[1].split("\n## ", 1)[0]
    run_options = {option for action in subparsers.choices["run"]._actions
                   for option in action.option_strings}
    documented = set(re.findall(r"^\| `(--[\w-]+)", run_section, re.MULTILINE))
    assert documented <= run_options, documented - run_options


def test_a_slow_build_says_so_on_stderr_that_is_not_a_terminal(tmp_path, monkeypatch,
                                                              capsys) -> None:
    """`pie build` (and every slow step of run / serve / submit, through host/progress.py)
    writes what it does past 2 s and how long it took, with stderr captured (no terminal)."""
    import time

    import host.sandbox.programs.build as build_module
    from host.cli import _run_build, build_parser

    def slow_build(app, output):
        time.sleep(2.2)
        output.write_bytes(b"\0asm")
        return output

    monkeypatch.setattr(build_module, "build", slow_build)
    app = write_app(tmp_path, "slow", "import inferlet\n")
    assert _run_build(build_parser().parse_args(["build", str(app)]), []) == 0
    err = capsys.readouterr().err
    assert f"pie build: building {app} (componentize-py) ...\n" in err
    assert f"pie build: building {app} (componentize-py): done in 2." in err
