"""The `pie` command: build and run inferlets locally (serve/submit come from host/server).

    pie build app.py [-o app.wasm]
    pie run app.wasm|app.py [--model PATH] [limits] [--no-stdin] [--logs] [-- inferlet args]
    pie submit app.wasm|app.py [--server URL] [--token T] [--no-stdin] [--logs] [-- inferlet args]

Exit status of `pie run`: 0 the inferlet returned a result; 1 it returned an error (or the
program could not be built or loaded); 2 bad command line; 3 it trapped; 4 it was terminated;
130 interrupted. The cause goes to stderr, and so does a line for every step that takes more
than 2 s (building, compiling, loading, warming: host/progress.py).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from pathlib import Path

from host.progress import progress

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_TRAP",
           "EXIT_TERMINATED", "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TRAP, EXIT_TERMINATED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


def _add_build_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "build", help="build an inferlet (app.py) into a WebAssembly component",
        description="Bundle app.py, the inferlet SDK and CPython into a component with "
                    "componentize-py (about 10 s, about 18 MB).")
    parser.add_argument("app", type=Path, help="the inferlet's Python file")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="output component (default: the app's name with .wasm)")
    parser.set_defaults(func=_run_build)


def _add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="run an inferlet locally on a model",
        description="Load the model, load the component (compiled once, then cached), run one "
                    "instance, stream what it sends to stdout, then print its result. An app.py "
                    "is built first (cached by content hash). Lines typed on stdin are sent to "
                    "the inferlet as client messages. Put the inferlet's own arguments after --.")
    parser.add_argument("program", type=Path, help="app.wasm, or app.py to build and run")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file or a Hugging Face checkpoint directory "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--memory-mb", type=int, default=256, help="guest memory limit (MiB)")
    parser.add_argument("--max-idle-s", type=float, default=10.0,
                        help="longest the guest may compute without calling the host")
    parser.add_argument("--max-receive-wait-s", type=float, default=300.0,
                        help="longest the guest may wait in receive() for a message before it "
                             "traps naming this limit")
    parser.add_argument("--page-quota", type=int, default=None,
                        help="most KV pages the instance may hold (default: the whole pool)")
    parser.add_argument("--kv-memory-mb", type=int, default=512, help="KV page pool size (MiB)")
    parser.add_argument("--swap-mb", type=int, default=4096,
                        help="host memory for the KV pages of instances suspended while the pool "
                             "is dry (MiB; 0: no suspension)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--kv-dtype", choices=("auto", "float32", "float16"), default="auto",
                        help="the KV cache's dtype (CPU; auto: float16 on the GGUF-block "
                             "kernels, else the activation dtype)")
    parser.add_argument("--max-pass-tokens", type=_positive_int, default=None,
                        help="a batch of more input tokens runs as consecutive passes of at most "
                             "this many (bounds a long prompt's memory; default: 256 on a CPU, "
                             "no limit on CUDA)")
    parser.add_argument("--act8", action=argparse.BooleanOptionalAction, default=True,
                        help="GGUF-block kernels: 8-bit activation blocks where measured faster "
                             "(default); --no-act8: 16-bit, slower batches, top-1 closer to "
                             "float32 (docs/performance/2026-11-29-vnni-int8.md)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                        help="where the model runs (default: cuda when available, else cpu)")
    parser.add_argument("--adapter", action="append", default=[], type=_adapter_arg,
                        metavar="NAME=PATH",
                        help="a LoRA adapter (a PEFT directory: adapter_config.json + "
                             "adapter_model.safetensors) the inferlet may open as NAME; repeatable")
    parser.add_argument("--allow-host", action="append", default=[], metavar="HOST[:PORT]",
                        help="a host the inferlet may send HTTP requests to (.SUFFIX: it and its "
                             "subdomains; no port: 80 and 443; a name resolving to a private or "
                             "loopback address is refused: give the IP, e.g. 127.0.0.1:8080); "
                             "repeatable; default none")
    parser.add_argument("--ca-bundle", default=None, metavar="FILE",
                        help="PEM CA certificates the inferlet's https requests trust besides "
                             "the default ones (a private CA's server)")
    parser.add_argument("--mcp", action="append", default=[], type=_mcp_arg,
                        metavar="NAME=COMMAND|URL",
                        help="an MCP server the inferlet may call as NAME: a command run over "
                             "stdio (split as a shell would), or an http(s) URL (streamable "
                             "HTTP); repeatable")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="compiled components and builds (default: $PIE_CACHE_DIR or ~/.cache/pie)")
    parser.add_argument("--lines", action="store_true",
                        help="end every message with a newline (for inferlets that send whole "
                             "messages rather than text deltas)")
    parser.add_argument("--no-stdin", dest="stdin", action="store_false",
                        help="do not send stdin lines to the inferlet")
    parser.add_argument("--logs", action="store_true",
                        help="print the instance's log (inferlet.log lines, print output) to "
                             "stderr once it has ended")
    parser.set_defaults(func=_run_run)


def _add_server_parsers(subparsers) -> None:
    """`serve` and `submit`, when the server package is installed and importable."""
    try:
        from host.client.submit import add_submit_parser
        from host.server.commands import add_serve_parser
    except ImportError:
        return
    add_serve_parser(subparsers)
    add_submit_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (every command has --help)."""
    parser = argparse.ArgumentParser(prog="pie", description="pie: programmable LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_build_parser(subparsers)
    _add_run_parser(subparsers)
    _add_server_parsers(subparsers)
    return parser


def _run_build(namespace: argparse.Namespace, inferlet_args: list[str]) -> int:
    from host.sandbox.programs.build import BuildError, build
    output = namespace.output or namespace.app.with_suffix(".wasm")
    try:
        with progress("pie build", f"building {namespace.app} (componentize-py)"):
            path = build(namespace.app, output)
    except BuildError as err:
        print(f"pie build: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(f"built {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return EXIT_OK


def _run_run(namespace: argparse.Namespace, inferlet_args: list[str]) -> int:
    """Build if needed, load the model and the component, run one instance to its end."""
    from host.runtime_config import (InstanceLimits, OutboundLimits, RuntimeConfig,
                                     default_cache_dir)
    try:
        outbound = OutboundLimits(
            allow_hosts=tuple(namespace.allow_host),
            mcp_servers=tuple(_mcp_server(name, target) for name, target in namespace.mcp))
        limits = InstanceLimits(memory_mb=namespace.memory_mb, max_idle_s=namespace.max_idle_s,
                                page_quota=namespace.page_quota,
                                max_receive_wait_s=namespace.max_receive_wait_s,
                                outbound=outbound)
        RuntimeConfig(swap_mb=namespace.swap_mb)          # checked before the model loads
        _check_ca_bundle(namespace.ca_bundle)
    except ValueError as err:
        print(f"pie run: {err}", file=sys.stderr)
        return EXIT_USAGE
    cache_dir = namespace.cache_dir or default_cache_dir()
    wasm_path = _program_path(namespace.program, cache_dir)
    if wasm_path is None:
        return EXIT_ERROR
    engine = _load_engine(namespace)
    if engine is None:
        return EXIT_ERROR
    print(f"pie run: engine: {engine.kernel_summary}", file=sys.stderr)
    if not _register_adapters(engine, namespace.adapter):
        return EXIT_ERROR
    from engine.warm_up import WarmUpError, needs_warm_up, warm_up
    try:
        if needs_warm_up(engine):
            with progress("pie run", "warming the engine's kernels"):
                warm_up(engine, lambda line: print(f"pie run: {line}", file=sys.stderr,
                                                   flush=True))
    except WarmUpError as err:
        print(f"pie run: {err}", file=sys.stderr)
        return EXIT_ERROR
    from engine.loaders import served_model_name
    from host.runtime import Runtime
    model_name = served_model_name(str(namespace.model or ""), engine.model_name,
                                   default_model=namespace.model is None)
    # one instance: naming its memory limit exactly is worth its slower start
    with Runtime(engine, RuntimeConfig(cache_dir=cache_dir, count_linear_memory=True,
                                       swap_mb=namespace.swap_mb, model_name=model_name,
                                       freeze_heap=True)) as runtime:
        program = _load_program(runtime, wasm_path)
        if program is None:
            return EXIT_ERROR
        runtime.set_spawn_hooks(_own_program_hooks(program, namespace.program.stem))
        runtime.outbound.set_ca_bundle(namespace.ca_bundle)
        return _run_instance(runtime, program, inferlet_args, limits, lines=namespace.lines,
                             forward_stdin=namespace.stdin, show_logs=namespace.logs)


def _check_ca_bundle(path: str | None) -> None:
    """ValueError naming --ca-bundle when `path` holds no PEM CA certificate."""
    if path is None:
        return
    import ssl
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ca-bundle {path!r}: not a readable PEM bundle of CA certificates "
                         f"({exc})") from None


def _program_path(program: Path, cache_dir: Path) -> Path | None:
    """The component to run: `program` itself, or its cached build when it is a .py file."""
    if not program.is_file():
        print(f"pie run: {program}: no such file", file=sys.stderr)
        return None
    if program.suffix != ".py":
        return program
    from host.sandbox.programs.build import BuildError, build_cached
    try:
        with progress("pie run", f"building {program} (componentize-py; cached afterwards)"):
            path, _ = build_cached(program, Path(cache_dir) / "builds")
    except BuildError as err:
        print(f"pie run: {err}", file=sys.stderr)
        return None
    return path


def _mcp_arg(text: str) -> tuple[str, str]:
    """argparse type: NAME=COMMAND or NAME=URL -> (name, command or url)."""
    name, sep, target = text.partition("=")
    if not sep or not name or not target.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND or NAME=URL, got {text!r}")
    return name, target


def _mcp_server(name: str, target: str):
    """The McpServer of `--mcp NAME=TARGET`: a URL, else a command line split as a shell would
    (ValueError when invalid)."""
    from host.runtime_config import McpServer
    if target.startswith(("http://", "https://")):
        return McpServer(name, url=target)
    return McpServer(name, command=tuple(shlex.split(target)))


def _adapter_arg(text: str) -> tuple[str, Path]:
    """argparse type: NAME=PATH -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def _register_adapters(engine, adapters: list[tuple[str, Path]]) -> bool:
    """Register `pie run --adapter` adapters with the engine; False after printing an error
    (the adapter's name, and the tensor or setting at fault)."""
    from engine.adapters import AdapterError

    for name, path in adapters:
        try:
            info = engine.adapters.register(name, path)
        except AdapterError as err:
            print(f"pie run: {err}", file=sys.stderr)
            return False
        spec = info.spec
        print(f"pie run: adapter {name}: rank {spec.rank}, {', '.join(spec.target_modules)}, "
              f"{info.resident_bytes / 2**20:.1f} MiB resident once used", file=sys.stderr)
    return True


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _load_engine(namespace: argparse.Namespace):
    """The engine on the chosen model (a progress bar on a terminal), or None after an error."""
    from engine.engine import load_default_engine, load_engine
    overrides = dict(kv_memory_mb=namespace.kv_memory_mb, dtype=namespace.dtype,
                     kv_dtype=namespace.kv_dtype, device=namespace.device, act8=namespace.act8)
    if namespace.max_pass_tokens is not None:
        overrides["max_pass_tokens"] = namespace.max_pass_tokens
    model = namespace.model or "the default model (SmolLM2-135M-Instruct)"
    try:
        with progress("pie run", f"loading {model}", quiet_while_running=sys.stderr.isatty()):
            if namespace.model is None:
                return load_default_engine(progress=True, **overrides)
            return load_engine(namespace.model, progress=True, **overrides)
    except (OSError, ValueError) as err:
        model = namespace.model or "the default model"
        print(f"pie run: cannot load {model}: {err}", file=sys.stderr)
        return None


def _own_program_hooks(program, name: str):
    """`pie run`'s SpawnHooks: children.spawn finds the running program by its name (the file's
    stem) or its hash, and no other."""
    from host.runtime import SpawnHooks

    def resolve(tenant: str, wanted: str):
        if wanted not in (name, program.hash):
            raise LookupError(f"`pie run` runs one program: {name!r} ({program.hash[:16]}...)")
        return program
    return SpawnHooks(resolve=resolve)


def _load_program(runtime, wasm_path: Path):
    """Validate + compile (spinner the first time; later runs load the cached artifact)."""
    from host.sandbox.programs import ProgramError
    try:
        with progress("pie run", f"compiling {wasm_path.name} (cached afterwards)"):
            return runtime.load_program(wasm_path.read_bytes())
    except ProgramError as err:
        print(f"pie run: {wasm_path}: {err}", file=sys.stderr)
        return None


def _run_instance(runtime, program, inferlet_args: list[str], limits, *, lines: bool,
                  forward_stdin: bool = True, show_logs: bool = False) -> int:
    """Launch, stream messages to stdout, forward stdin lines (unless not `forward_stdin`), say
    on stderr when the instance waits for input, print the outcome (and its log: `show_logs`)."""
    ends_with_newline = [True]
    follow = _Follow(forward_stdin)

    def on_event(event) -> None:
        follow.active()
        if event.kind == "message":
            text = event.data + ("\n" if lines and not event.data.endswith("\n") else "")
            sys.stdout.write(text)
            sys.stdout.flush()
            if text:
                ends_with_newline[0] = text.endswith("\n")

    instance_id = runtime.launch(program, inferlet_args, limits=limits, on_event=on_event)
    if forward_stdin:
        threading.Thread(target=_forward_stdin, args=(runtime, instance_id, follow),
                         daemon=True).start()
    threading.Thread(target=_tell_when_waiting, args=(runtime, instance_id, follow),
                     daemon=True).start()
    try:
        outcome = runtime.wait(instance_id)
    except KeyboardInterrupt:
        runtime.terminate(instance_id, "interrupted (Ctrl-C)")
        print(f"\npie run: interrupted (Ctrl-C): instance {instance_id} terminated",
              file=sys.stderr)
        if show_logs:
            _print_log(runtime, instance_id)
        return EXIT_INTERRUPTED
    finally:
        follow.ended.set()
    if not ends_with_newline[0]:
        sys.stdout.write("\n")
    if outcome.status == "ok":
        if outcome.value:
            sys.stdout.write(outcome.value + ("" if outcome.value.endswith("\n") else "\n"))
        sys.stdout.flush()
        if show_logs:
            _print_log(runtime, instance_id)
        return EXIT_OK
    sys.stdout.flush()
    label = {"error": "the inferlet failed", "trap": "the inferlet trapped",
             "terminated": "the inferlet was terminated"}[outcome.status]
    print(f"pie run: {label}: {outcome.value}", file=sys.stderr)
    if show_logs:
        _print_log(runtime, instance_id)
    return {"error": EXIT_ERROR, "trap": EXIT_TRAP}.get(outcome.status, EXIT_TERMINATED)


def _print_log(runtime, instance_id: str) -> None:
    """The instance's log (runtime.log lines, "stdout: ..." / "stderr: ..." lines) on stderr."""
    log = runtime.instance_log(instance_id)
    print(f"pie run: log of instance {instance_id} ({len(log)} lines):", file=sys.stderr)
    for line in log:
        print(f"  {line}", file=sys.stderr)
    sys.stderr.flush()


class _Follow:
    """What the threads following one `pie run` instance share."""

    QUIET_S = 1.0          # no event and no line sent for this long: look whether it waits

    def __init__(self, forward_stdin: bool) -> None:
        self.forwarding = forward_stdin
        self.stdin_open = forward_stdin
        self.last_activity = time.monotonic()
        self.told_waiting = False
        self.ended = threading.Event()

    def active(self) -> None:
        self.last_activity = time.monotonic()
        self.told_waiting = False


def _forward_stdin(runtime, instance_id: str, follow: _Follow) -> None:
    """Send each stdin line (without its newline) to the instance as a client message; stop at
    the first refused (the instance's unread messages are at client_max_chars)."""
    from host.errors import LimitError
    try:
        for line in sys.stdin:
            if not runtime.send(instance_id, line.rstrip("\n")):
                return
            follow.active()
    except LimitError as refused:
        print(f"pie run: stdin no longer forwarded: {refused}", file=sys.stderr)
    except (OSError, ValueError, KeyError):
        return
    finally:
        follow.stdin_open = False


def _tell_when_waiting(runtime, instance_id: str, follow: _Follow) -> None:
    """Once per quiet spell, say on stderr that the instance waits in receive() for input."""
    while not follow.ended.wait(0.5):
        if follow.told_waiting or time.monotonic() - follow.last_activity < follow.QUIET_S \
                or not runtime.hub.waiting_for_client(instance_id):
            continue
        follow.told_waiting = True
        if follow.stdin_open:
            how = "type a line" if sys.stdin.isatty() else "stdin is read line by line"
        elif follow.forwarding:
            how = "stdin has ended: Ctrl-C to stop it"
        else:
            how = "--no-stdin: Ctrl-C to stop it"
        print(f"pie run: the inferlet is waiting for input ({how}; it traps after "
              f"--max-receive-wait-s)", file=sys.stderr, flush=True)


def _split_inferlet_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`pie run|submit X [opts] -- a b` -> (pie's argv, the inferlet's argv).

    The split happens before argparse sees the line: argparse drops a `--` that directly follows
    the program (no option between), which would turn the inferlet's `--role b` into pie's.
    """
    if argv[:1] in (["run"], ["submit"]) and "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pie` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own_argv, inferlet_args = _split_inferlet_args(argv)
    namespace = build_parser().parse_args(own_argv)
    if namespace.command in ("build", "run"):
        return namespace.func(namespace, inferlet_args)
    if namespace.command == "submit":   # its handler splits its remainder at "--" itself
        namespace.args = [*namespace.args, "--", *inferlet_args]
    return namespace.func(namespace)


if __name__ == "__main__":
    sys.exit(main())
