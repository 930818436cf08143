"""docs/architecture.md's rooms table against the code: every file of host/ lies in a room the
table names, and every import of the host, the engine or the SDK (lazy and type-only imports
too) goes to the room itself or to a module its "may import" column lists."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO_DIR / "docs" / "architecture.md"
WATCHED = ("host", "engine", "inferlets")          # the imports the rule speaks of


def _rooms() -> dict[str, tuple[set[str], set[str]]]:
    """room -> (its files' paths relative to the repo, the modules it may import), read from the
    table under "The rooms of `host/`"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The rooms of `host/`", 1)[1].split("\n## ", 1)[0]
    rooms = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`host/"):
            continue
        room = cells[0].split("`")[1]
        folder = room if room.endswith("/") else room.rsplit("/", 1)[0] + "/"
        files = {folder + name for name in re.findall(r"`([\w.]+\.(?:py|c|h))`", cells[1])}
        allowed = set(re.findall(r"`([\w.]+)`", cells[3]))
        rooms[room] = (files, allowed)
    return rooms


def _module_of(path: str) -> str:
    module = path.removesuffix(".py").replace("/", ".")
    return module.removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports from the watched packages (`from a import b`: a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in WATCHED}


def _within(module: str, prefixes: set[str]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


ROOMS = _rooms()
ROOM_OF = {file: room for room, (files, _) in ROOMS.items() for file in files}


def test_the_table_names_the_rooms() -> None:
    assert {"host/scheduling/", "host/kv/", "host/sandbox/", "host/bindings/", "host/server/",
            "host/client/", "host/cli.py"} <= set(ROOMS)


def test_every_host_file_lies_in_a_named_room() -> None:
    files = {str(path.relative_to(REPO_DIR)) for path in (REPO_DIR / "host").rglob("*")
             if path.suffix in (".py", ".c", ".h")}
    unnamed = sorted(file for file in files - set(ROOM_OF)
                     if not file.endswith("/__init__.py"))
    assert not unnamed, f"files in no room of docs/architecture.md: {unnamed}"
    missing = sorted(set(ROOM_OF) - files)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def _room_modules(room: str) -> set[str]:
    """The modules of a room's own files (a package's __init__ among them)."""
    files = ROOMS[room][0]
    modules = {_module_of(file) for file in files if file.endswith(".py")}
    if room.endswith("/"):
        modules.add(_module_of(room.rstrip("/")))
    return modules


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_imports_only_what_it_may(room: str) -> None:
    files, allowed = ROOMS[room]
    own = _room_modules(room)
    wrong = []
    for file in sorted(file for file in files if file.endswith(".py")):
        for module in sorted(_imports(REPO_DIR / file)):
            if not (_within(module, own) or _within(module, allowed)):
                wrong.append(f"{file} imports {module}")
    assert not wrong, (f"imports that docs/architecture.md's row of {room} does not allow "
                       f"(change the code, or the row): {wrong}")


def test_the_rule_catches_an_import_it_does_not_list(tmp_path: Path) -> None:
    """The check itself: a module outside a room's list is caught, its own and listed are not."""
    allowed = ROOMS["host/kv/"][1]
    own = _room_modules("host/kv/")
    assert _within("host.kv.masks", own) and _within("host.scheduling.work.PreparedForward",
                                                     allowed)
    assert not _within("host.sandbox.instance", own | allowed)
    assert not _within("host.scheduling.scheduler", own | allowed)
