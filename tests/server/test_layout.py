"""The server's layout: each package imports only in the allowed direction.

cli (and its options and config file) -> app -> {http, inputs, engine} ->
shared (config and its checks, events, encoders, failures, formats,
grammars, limits, media, row_needs, speech, the kinds' registry and values). The
engine (the MLX thread) never imports HTTP libraries; the HTTP side (the
event loop) never imports MLX (nor mlx-audio); the input decoders neither.
A kind's package (``kinds/<kind>/``) is cut the same way: its ``engine``
module is engine, its door (``protocol``, ``serving``, ``route``) is http,
the rest shared. Inside the HTTP side, each API's slice imports only the
shared pieces. Every import counts, those under ``TYPE_CHECKING`` and
inside functions too, but one: a kind's entry imports its own engine and
door inside its functions, when the server is built.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_pinned.server

ROOT = Path(mlx_pinned.server.__file__).parent
SHARED = {
    "config",
    "config_checks",
    "events",
    "failures",
    "formats",
    "grammars",
    "limits",
    "resident",
    "row_needs",
    "media",
}
# The command line: the CLI, its options (the settings' projection) and its
# config file.
CLI = {"cli", "cli_options", "config_file"}
# What each part of the server may import from the server itself.
ALLOWED = {
    "shared": {"shared"},
    "engine": {"engine", "shared"},
    "http": {"http", "shared"},
    "inputs": {"inputs", "shared"},
    "app": {"app", "engine", "http", "inputs", "shared"},
    "cli": {"cli", "app", "engine", "http", "inputs", "shared"},
    "package": {"app", "shared", "cli"},
}
MLX = {"mlx", "mlx_vlm", "mlx_lm", "mlx_audio"}
WEB = {"starlette", "pydantic", "prometheus_client", "httpx", "uvicorn", "fastapi"}
# The remote image fetcher is an HTTP client (httpx), not the HTTP side.
SERVING = WEB - {"httpx"}
FORBIDDEN = {"shared": MLX | WEB, "engine": WEB, "http": MLX, "inputs": MLX | SERVING}


def part_of(module: str) -> str:
    """The part of the server a dotted module name (under the server) is in."""
    parts = module.split(".")
    if len(parts) < 3:  # mlx_pinned.server itself
        return "package"
    first = parts[2]
    if first == "kinds":
        last = parts[4] if len(parts) > 4 else "__init__"
        if last == "engine":
            return "engine"
        return "shared" if last in ("__init__", "values") else "http"
    if first in SHARED:
        return "shared"
    if first in CLI:
        return "cli"
    if first in ("__init__", "__main__"):
        return "package"
    return first


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent.parent).with_suffix("")
    return ".".join(relative.parts)


def imports(path: Path, text: str | None = None) -> list[tuple[str, int]]:
    """Every module ``path`` (or ``text`` as if it were there) imports,
    absolute, with the line."""
    name = module_name(path)
    package = name.rsplit(".", 1)[0]  # an __init__'s is its package
    found: list[tuple[str, int]] = []
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # "from . import engine" imports a submodule by name.
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


SOURCES = sorted(ROOT.rglob("*.py"))


def kind_of(module: str) -> str | None:
    """The kind a module is part of (``kinds.<kind>``, ``kinds.chat``)."""
    parts = module.split(".")
    return parts[3] if len(parts) > 3 and parts[2] == "kinds" else None


def lazy_lines(path: Path, text: str | None = None) -> set[int]:
    """The lines of ``path`` that are inside a function."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    lines.add(inner.lineno)
    return lines


def entry_may_import(module: str, target: str) -> bool:
    """Whether a kind's entry (``module``) may import ``target`` lazily: its
    own package's modules, and the engine's and the HTTP side's (not
    another kind's)."""
    kind = kind_of(module)
    if kind is None or part_of(module) != "shared":
        return False
    theirs = kind_of(target)
    return theirs == kind or (theirs is None and part_of(target) in ("engine", "http"))


def violations(path: Path, text: str | None = None) -> list[str]:
    """The imports of ``path`` that go the wrong way."""
    name = module_name(path)
    mine = part_of(name)
    lazy = lazy_lines(path, text)
    wrong = []
    for target, line in imports(path, text):
        if line in lazy and entry_may_import(name, target):
            continue
        top = target.split(".")[0]
        if top in FORBIDDEN.get(mine, set()):
            wrong.append(f"line {line}: {target} (no {top} in {mine})")
        if target.startswith("mlx_pinned.server.") and not _is_name_of(target):
            theirs = part_of(target)
            if theirs not in ALLOWED[mine]:
                wrong.append(f"line {line}: {target} ({mine} -> {theirs})")
    return wrong


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_one_way(path: Path) -> None:
    wrong = violations(path)
    assert not wrong, f"{path.relative_to(ROOT)} imports the wrong way: {wrong}"


def _is_name_of(target: str) -> bool:
    """Whether ``target`` is a name imported from a module (``a.b.Name``),
    not a submodule: only submodules have files."""
    relative = target.split(".")[2:]
    path = ROOT.joinpath(*relative)
    return not (path.with_suffix(".py").exists() or path.is_dir())


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("http/chat_completions/route.py", "from ...engine import BatchEngine"),
        ("http/chat_completions/route.py", "from ...engine.batch import BatchEngine"),
        ("http/chat_completions/route.py", "import mlx.core as mx"),
        ("http/wire.py", "from ..engine import BatchEngine"),
        ("engine/batch.py", "from ..http.chat_completions import protocol"),
        ("engine/batch.py", "from pydantic import BaseModel"),
        ("events.py", "from .engine import BatchEngine"),
        ("formats/hermes.py", "from pydantic import BaseModel"),
        ("formats/registry.py", "from ..http.chat_completions.messages import Tool"),
        ("inputs/images.py", "from ..http.chat_completions.messages import image_refs"),
        ("app.py", "from . import cli"),
        ("kinds/__init__.py", "from ..engine import BatchEngine"),
        ("kinds/speech/__init__.py", "from .engine import SpeechEngine"),
        ("kinds/speech/__init__.py", "def f():\n    from ..embedding import engine"),
        ("kinds/speech/route.py", "from .engine import SpeechEngine"),
        ("kinds/speech/engine.py", "from .route import SpeechEndpoint"),
        ("kinds/speech/engine.py", "from starlette.routing import Route"),
        ("kinds/speech/values.py", "import mlx.core as mx"),
        ("kinds/embedding/route.py", "import mlx.core as mx"),
    ],
)
def test_a_wrong_import_is_caught(where: str, line: str) -> None:
    path = ROOT / where
    assert not violations(path)
    assert violations(path, path.read_text() + "\n" + line + "\n")


def test_every_part_is_known() -> None:
    parts = {part_of(module_name(path)) for path in SOURCES}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


# The HTTP side is a slice per API (a folder: protocol, serving, route) over
# shared pieces (the modules of http/ itself): a shared piece imports no
# slice, and a slice imports no other slice.
HTTP = ROOT / "http"
SLICES = {path.parent.name for path in HTTP.glob("*/__init__.py")}
HTTP_SOURCES = [path for path in SOURCES if part_of(module_name(path)) == "http"]
# Every module of a kind's package, and the registry, which alone names them
# all (it registers the built-in kinds).
KIND_SOURCES = sorted((ROOT / "kinds").glob("*/*.py"))


KINDS = {path.parent.name for path in (ROOT / "kinds").glob("*/__init__.py")}


def slice_of(module: str, slices: set[str] = SLICES) -> str | None:
    """The slice a dotted module name is in (an API's, or a kind's package);
    None for a shared piece."""
    parts = module.split(".")
    if len(parts) >= 4 and parts[2] == "http" and parts[3] in slices:
        return parts[3]
    if len(parts) >= 4 and parts[2] == "kinds" and parts[3] in KINDS:
        return "kinds." + parts[3]
    return None


def slice_violations(
    path: Path, text: str | None = None, slices: set[str] = SLICES
) -> list[str]:
    """The imports of ``path`` (in http/) that reach into another slice."""
    name = module_name(path)
    mine = slice_of(name, slices)
    lazy = lazy_lines(path, text)
    wrong = []
    for target, line in imports(path, text):
        # A kind's entry mounts its doors, Ollama's among them.
        if line in lazy and entry_may_import(name, target):
            continue
        theirs = slice_of(target, slices)
        # A kind's values are what any API's doors hand its engine (Ollama's
        # /api/embed, the embedding kind's): an API may take them, a kind
        # never takes another's.
        shared = ".".join(target.split(".")[4:5]) == "values"
        if shared and not (mine or "").startswith("kinds."):
            continue
        if theirs is not None and theirs != mine:
            wrong.append(f"line {line}: {target} ({mine or 'shared'} -> {theirs})")
    return wrong


def test_the_slices_are_found() -> None:
    assert "chat_completions" in SLICES
    assert any(slice_of(module_name(path)) for path in HTTP_SOURCES)


@pytest.mark.parametrize(
    "path",
    sorted({*HTTP_SOURCES, *KIND_SOURCES}),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_slices_import_only_shared_pieces(path: Path) -> None:
    wrong = slice_violations(path)
    assert not wrong, f"{path.relative_to(ROOT)} reaches into a slice: {wrong}"


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("http/wire.py", "from .chat_completions.protocol import parse_chat_request"),
        (
            "http/answer_parser.py",
            "from .chat_completions import ChatCompletionsEndpoint",
        ),
        ("http/answer_parser.py", "from . import chat_completions"),
        # A second slice (as issue 23's completions) beside chat completions.
        ("http/chat_completions/route.py", "from ..completions import protocol"),
        ("kinds/speech/route.py", "from ..embedding.values import Embeddings"),
        ("kinds/rerank/engine.py", "from ..embedding import engine"),
        ("http/ollama/embed.py", "from ...kinds.embedding.route import INLINE_VALUES"),
    ],
)
def test_an_import_into_a_slice_is_caught(where: str, line: str) -> None:
    path = ROOT / where
    slices = {*SLICES, "completions"}
    assert not slice_violations(path, slices=slices)
    text = path.read_text() + "\n" + line + "\n"
    assert slice_violations(path, text, slices=slices)


# OpenAI's error types (and Anthropic's, for the APIs to come): the server's
# edge writes them; the core (mlx_pinned/*.py) takes its answers from the app.
API_ERROR_TYPES = (
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "api_error",
    "overloaded_error",
)
CORE = sorted(ROOT.parent.glob("*.py"))


def api_error_types_in(text: str) -> list[str]:
    """The API error types ``text`` names, as whole words."""
    return [kind for kind in API_ERROR_TYPES if re.search(rf"\b{kind}\b", text)]


def test_the_core_names_no_api_error_type() -> None:
    assert len(CORE) > 10  # the glob found the core modules
    named = {
        path.name: found
        for path in CORE
        if (found := api_error_types_in(path.read_text()))
    }
    assert not named, f"core modules name API error types: {named}"
    # The check sees one planted in any form the core could write it.
    planted = 'body = {"error": {"type": "server_error"}}'
    assert api_error_types_in(planted) == ["server_error"]
    assert api_error_types_in("kind = 'rate_limit_error'") == ["rate_limit_error"]


# Below the edge: what raises there raises what went wrong, with no HTTP
# status and no wire path (``param="messages[0]..."``); each API's edge
# (``http/errors.py`` for OpenAI's) answers it.
BELOW_THE_EDGE = [
    path
    for path in SOURCES
    if part_of(module_name(path)) in ("engine", "inputs", "shared")
]
STATUS_NAMES = {"status", "status_code", "http_status"}


def http_statuses(path: Path, text: str | None = None) -> list[str]:
    """Where ``path`` (or ``text`` as if it were there) raises or defines an
    error that carries an HTTP status or a wire path."""
    found = []
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    for node in ast.walk(tree):
        # An error made (raised, returned, or a subclass's super().__init__)
        # with a status or a wire path.
        if isinstance(node, ast.Call) and _makes_an_error(node.func):
            values = [*node.args, *(k.value for k in node.keywords)]
            if any(_is_status(value) for value in values):
                found.append(f"line {node.lineno}: an error with an HTTP status")
            if any(k.arg in STATUS_NAMES | {"param"} for k in node.keywords):
                found.append(f"line {node.lineno}: an error with a wire path")
        if isinstance(node, ast.Attribute) and node.attr in STATUS_NAMES:
            if isinstance(node.ctx, ast.Store):
                found.append(f"line {node.lineno}: sets .{node.attr}")
    return found


def _makes_an_error(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.endswith("Error") or name == "__init__"


def _is_status(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Constant)
        and type(node.value) is int
        and 400 <= node.value <= 599
    )


def test_the_shared_modules_engine_and_inputs_are_found() -> None:
    parts = {part_of(module_name(path)) for path in BELOW_THE_EDGE}
    assert parts == {"engine", "inputs", "shared"}


@pytest.mark.parametrize("path", BELOW_THE_EDGE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_http_status_below_the_edge(path: Path) -> None:
    found = http_statuses(path)
    assert not found, f"{path.relative_to(ROOT)} carries HTTP answers: {found}"


@pytest.mark.parametrize(
    "planted",
    [
        "raise APIError(400, 'no images')",
        "raise RefusedError('too long', status=413)",
        "raise ImageRefusedError('bad', param='messages[0].content[1]')",
        "class Refused(Exception):\n    def __init__(self):\n        self.status = 400",
        "class Long(APIError):\n    def __init__(self):\n        super().__init__(400)",
    ],
)
def test_a_status_below_the_edge_is_caught(planted: str) -> None:
    path = ROOT / "engine" / "rows.py"
    assert not http_statuses(path)
    assert http_statuses(path, path.read_text() + "\n" + planted + "\n")


TESTS = Path(__file__).resolve().parents[1]


def imported_test_modules(path: Path, text: str | None = None) -> list[str]:
    """The test modules (``test_*``) that ``path`` (or ``text``) imports."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            names += [f"{node.module or ''}.{a.name}" for a in node.names]
        found += [n for n in names if any(p.startswith("test_") for p in n.split("."))]
    return found


@pytest.mark.parametrize(
    "path",
    sorted(TESTS.rglob("test_*.py")),
    ids=lambda p: str(p.relative_to(TESTS)),
)
def test_no_test_module_imports_another(path: Path) -> None:
    found = imported_test_modules(path)
    assert not found, (
        f"{path.name} imports test modules {found}: use tests/server/kit.py"
    )


def test_a_test_module_imported_is_caught() -> None:
    here = Path(__file__)
    assert imported_test_modules(here, "from .test_batching import TOL\n")
    assert imported_test_modules(here, "from . import test_app\n")
    assert not imported_test_modules(here, "from .kit import TOL\n")


ENGINE = "mlx_pinned.server.engine"


def runtime_imports(path: Path, text: str | None = None) -> set[str]:
    """The engine modules ``path`` (or ``text``) imports when it runs:
    those under ``if TYPE_CHECKING:`` only name types, and are left out."""
    source = path.read_text() if text is None else text
    tree = ast.parse(source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = [ast.Pass()]
    found = set()
    for target, _ in imports(path, ast.unparse(tree)):
        parts = target.split(".")
        if target.startswith(ENGINE + ".") and len(parts) >= 4:
            found.add(".".join(parts[:4]))
    return found - {module_name(path)}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (module -> what it imports), or [] if none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return []

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return []


ENGINE_SOURCES = sorted((ROOT / "engine").glob("*.py"))


def test_no_runtime_import_cycle_in_the_engine() -> None:
    graph = {module_name(p): runtime_imports(p) for p in ENGINE_SOURCES}
    assert len(graph) > 20
    assert import_cycle(graph) == []


def test_a_runtime_import_cycle_is_caught() -> None:
    graph = {module_name(p): runtime_imports(p) for p in ENGINE_SOURCES}
    decode = ROOT / "engine" / "decode.py"
    graph[module_name(decode)] = runtime_imports(
        decode, decode.read_text() + "\nfrom .state import BatchState\n"
    )
    assert import_cycle(graph)[0] == f"{ENGINE}.decode"
    # Naming a type only is no cycle.
    planted = "\nif TYPE_CHECKING:\n    from .state import BatchState\n"
    assert f"{ENGINE}.state" not in runtime_imports(decode, planted)


def _slow(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d) == "pytest.mark.slow" for d in node.decorator_list)


def quick_tests(path: Path, text: str | None = None) -> list[str]:
    """The tests of a test module (``test_*`` functions, ``Test*`` classes'
    ``test_*`` methods) that no ``slow`` marker takes out of the inner loop."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and "pytest.mark.slow" in ast.unparse(node):
            return []  # the whole module (pytestmark)
    found = []
    tests = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, tests) and node.name.startswith("test_"):
            found += [] if _slow(node) else [node.name]
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            if not _slow(node):
                found += [
                    f"{node.name}.{method.name}"
                    for method in node.body
                    if isinstance(method, tests)
                    and method.name.startswith("test_")
                    and not _slow(method)
                ]
    return found


@pytest.mark.parametrize(
    "path",
    sorted(TESTS.rglob("test_*.py")),
    ids=lambda p: str(p.relative_to(TESTS)),
)
def test_every_test_module_runs_in_the_inner_loop(path: Path) -> None:
    # `pytest -m "not slow"` (the README's inner loop) runs each module once.
    assert quick_tests(path), f"{path.name}: every test is marked slow"


def test_a_module_all_slow_is_caught() -> None:
    here = Path(__file__)
    slow = "import pytest\n\n@pytest.mark.slow\ndef test_a() -> None: ...\n"
    assert not quick_tests(here, slow)
    assert not quick_tests(here, "import pytest\npytestmark = pytest.mark.slow\n")
    both = "class TestA:\n    @pytest.mark.slow\n    def test_a(self): ...\n"
    assert not quick_tests(here, "import pytest\n" + both)
    assert quick_tests(here, "import pytest\n" + both + "    def test_b(self): ...\n")


@pytest.mark.slow
def test_a_chat_request_with_an_image_runs_code_in_at_most_57_files() -> None:
    # docs/server.md counts them so (a fresh process, every thread).
    script = ROOT.parents[1] / "benchmarks" / "request_files.py"
    ran = subprocess.run(
        [sys.executable, str(script), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    files = json.loads(ran.stdout.splitlines()[-1])
    assert "mlx_pinned/server/engine/loop.py" in files  # it counted the engine
    assert "mlx_pinned/server/inputs/images.py" in files  # and a worker thread
    assert len(files) <= 57, files
