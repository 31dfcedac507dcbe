"""The package's layout rules (docs/architecture.md), checked on the source:
no import cycle, llama_cpp only behind backend/, a core without click or
llama_cpp, modules and functions short enough to read at once; and the
repository's: data apart from code, few scripts beside the commands."""
import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOT = REPO / "edgespec"
MAX_MODULE_LINES = 500      # outside kernels/
MAX_FUNCTION_LINES = 60     # outside kernels/ (numba kernels are one loop nest each)
# the bench's llama-cpp-python methods run that library's own API as the baseline
LLAMA_CPP_OUTSIDE_BACKEND = {"edgespec.bench.llamacpp", "edgespec.bench.llama_peer"}


def _modules() -> dict:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


MODULES = _modules()
TREES = {m: ast.parse(p.read_text(encoding="utf-8"), str(p)) for m, p in MODULES.items()}


def _imported(module: str) -> set:
    """Every dotted name `module` imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import (the package uses absolute imports)"
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _edges(module: str) -> set:
    """The edgespec modules `module` imports (a name resolves to its longest module prefix)."""
    out = set()
    for name in _imported(module):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def test_the_rules_see_the_package():
    assert {"edgespec.core.engine", "edgespec.backend.llama", "edgespec.app.api"} <= set(MODULES)


def test_no_import_cycle():
    graph = {m: _edges(m) for m in MODULES}
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = path[path.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_llama_cpp_only_behind_the_backend():
    users = {m for m in MODULES if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in _imported(m))}
    outside = {m for m in users if not m.startswith("edgespec.backend.")} - LLAMA_CPP_OUTSIDE_BACKEND
    assert not outside, f"modules outside edgespec.backend that import llama_cpp: {sorted(outside)}"


def test_core_imports_neither_click_nor_llama_cpp():
    for m in MODULES:
        if m.startswith("edgespec.core."):
            bad = {n for n in _imported(m) if n.split(".")[0] in ("click", "llama_cpp")}
            assert not bad, f"{m} imports {sorted(bad)}"


BASE = {"errors", "progress", "version", "paths"}
ALLOWED = {         # package -> the packages it may import (besides BASE); docs/architecture.md shows the same table
    "kernels": set(),
    "models": set(),
    "backend": {"kernels"},
    "calibration": {"backend"},
    "corpus": {"backend", "models", "kernels"},
    "memory": {"corpus", "kernels"},
    "drafters": {"corpus", "models", "kernels"},
    "core": {"drafters", "calibration", "backend", "kernels"},
    "replay": {"core", "drafters", "calibration", "backend", "kernels"},
    "run": {"core", "drafters", "memory", "calibration", "corpus", "models", "backend", "kernels"},
    "app": {"run", "core", "drafters", "memory", "calibration", "corpus", "models", "backend", "kernels"},
    "bench": {"run", "replay", "core", "drafters", "memory", "calibration", "corpus", "models", "backend", "kernels"},
    "app.cli": {"app", "bench", "run", "core", "drafters", "memory", "calibration", "corpus", "models", "backend", "kernels"},
}


def _package(module: str) -> str:
    """edgespec.app.cli.chat -> app.cli, edgespec.core.engine -> core, edgespec.errors -> errors."""
    parts = module.split(".")[1:]
    if parts[:2] == ["app", "cli"]:
        return "app.cli"
    return parts[0] if parts else ""


def test_packages_import_only_the_packages_under_them():
    """The layering of docs/architecture.md, package by package: kernels at
    the bottom, the backend over them, the drafters under the engine (they
    propose; the engine drives them), the replay simulator above the engine,
    app/ on top (the package's own __init__ and __main__ re-export it)."""
    top = {"edgespec", "edgespec.__main__"}
    assert set(ALLOWED) | BASE == {_package(m) for m in set(MODULES) - top}, "a package without a row in ALLOWED"
    bad = []
    for m in set(MODULES) - top:
        pkg = _package(m)
        if pkg in ALLOWED:
            bad += [f"{m} -> {n}" for n in sorted(_edges(m))
                    if _package(n) != pkg and _package(n) not in ALLOWED[pkg] | BASE]
        elif pkg in BASE:
            bad += [f"{m} -> {n}" for n in sorted(_edges(m)) if _package(n) not in BASE]
    assert not bad, "imports against the layering: " + "; ".join(bad)


def test_only_app_and_bench_import_app():
    """app/ is what users touch; the library under it does not reach up into it
    (the package's own __init__ re-exports the public API)."""
    up = {m for m in MODULES if not m.startswith(("edgespec.app", "edgespec.bench")) and m not in ("edgespec", "edgespec.__main__")
          and any(n.startswith("edgespec.app") for n in _edges(m))}
    assert not up, f"modules below app/ that import it: {sorted(up)}"


def test_bench_does_not_import_app():
    """The bench stands below app/ (issue 58): what it needs of a run (the
    settings, the drafter specs) is in run/, and SpecModel's public methods."""
    up = {f"{m} -> {n}" for m in MODULES if m.startswith("edgespec.bench")
          for n in _edges(m) if n.startswith("edgespec.app")}
    assert not up, sorted(up)


MAX_PRIVATE_PARAMS = 6      # self included: more travel together as one value (a Request, a ServeRequest)


@pytest.mark.parametrize("module", ["edgespec.app.compat", "edgespec.app.server"])
def test_private_functions_of_the_edges_take_few_parameters(module):
    """The server and the drop-in hand a request to their own functions whole,
    not as a list of its fields (issue 58)."""
    bad = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                and not node.name.startswith("__"):
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
            if n > MAX_PRIVATE_PARAMS:
                bad.append(f"{node.name} ({n})")
    assert not bad, f"{module}: private functions with more than {MAX_PRIVATE_PARAMS} parameters: {bad}"


def test_sources_are_registered_in_one_place():
    """Every built-in draft source is registered in drafters/tree.py, in one
    order, so its id (stored in results files, indexing the gate's counts)
    does not depend on which module a program imports first."""
    callers = {m for m, tree in TREES.items() for node in ast.walk(tree)
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_source"}
    assert callers == {"edgespec.drafters.tree"}, callers


def test_modules_and_functions_are_short():
    long_modules, long_functions = [], []
    for m, p in MODULES.items():
        if m.startswith("edgespec.kernels."):
            continue
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES:
            long_modules.append(f"{m} ({n} lines)")
        for node in ast.walk(TREES[m]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{m}.{node.name} ({length} lines)")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_tests_reach_optional_externals_only_through_conftest():
    """The browser, the RPC build and llama-server come from conftest's
    fixtures and helpers (`chromium`, `missing_external`, `server_binary`),
    which skip with the reason or, under CI's EDGESPEC_REQUIRE_*, fail: a test
    that looks for one itself turned the README's test command red on a
    machine without it, twice (the second time issue 43)."""
    tests = pathlib.Path(__file__).resolve().parent
    bad = []
    for p in sorted(tests.glob("*.py")):
        if p.name in ("conftest.py", pathlib.Path(__file__).name):
            continue
        text = p.read_text(encoding="utf-8")
        for word in ("/usr/bin/chromium", "EDGESPEC_CHROMIUM", "which(\"chromium", "EDGESPEC_REQUIRE_"):
            if word in text:
                bad.append(f"{p.name} names {word!r}")
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr == "launch"
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "chromium"):
                func = next(f for f in ast.walk(ast.parse(text)) if isinstance(f, ast.FunctionDef)
                            and f.lineno <= node.lineno <= f.end_lineno)
                if "chromium" not in [a.arg for a in func.args.args]:
                    bad.append(f"{p.name}:{node.lineno} launches chromium outside the `chromium` fixture")
    assert not bad, bad


MAX_TOOLS = 12      # scripts in tools/ outside tools/gpu: what users run is an `edgespec` command


def test_results_prompts_and_sessions_live_in_the_data_folder():
    """Data is not code (issue 63): the bench's results, prompts and session
    traces are under benchmarks/, none in a root bench/ beside the package's
    edgespec/bench/."""
    stray = sorted(str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*") if p.is_file()) \
        if (REPO / "bench").exists() else []
    assert not stray, f"files under a root bench/: {stray[:5]}"
    assert len(list((REPO / "benchmarks" / "results").glob("*.jsonl*"))) >= 40
    for folder in ("prompts", "sessions"):
        assert list((REPO / "benchmarks" / folder).glob("*.jsonl")), folder


def test_tools_holds_few_scripts():
    scripts = sorted(p.name for p in (REPO / "tools").iterdir() if p.is_file())
    assert len(scripts) <= MAX_TOOLS, f"{len(scripts)} scripts in tools/ (at most {MAX_TOOLS}): {scripts}"


def _defined(name: str) -> set:
    """The modules that define a function or class `name` (at any depth)."""
    return {m for m, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name}


def _callers(name: str) -> set:
    """The modules that call `name` (as a plain name or an attribute)."""
    return {m for m, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))}


def _code_strings(module: str) -> list[str]:
    """The string constants of `module` outside its docstrings (f-strings' pieces included)."""
    docs = {id(n.body[0].value) for n in ast.walk(TREES[module])
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(TREES[module])
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_the_hardware_is_decided_in_one_place():
    """Issue 63: the kernel setting is read from $EDGESPEC_KERNELS by
    run/kernels.py alone; "offloaded" has one rule (backend/settings.py
    is_offloaded), and the Loadout's rules per hardware (the fast options,
    exactness, the K cache's "auto") one home, Loadout.resolve: the backend
    takes a Loadout as it is and derives none of them."""
    env = {m for m in MODULES if "EDGESPEC_KERNELS" in _code_strings(m)}
    assert env == {"edgespec.run.kernels"}, env
    assert _defined("setting") >= {"edgespec.run.kernels"} and "edgespec.calibration.kernelchoice" not in _defined("setting")
    offloaded = set()
    for m, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "bool" and node.args \
                    and isinstance(node.args[0], ast.BoolOp) and isinstance(node.args[0].op, ast.Or) \
                    and any("n_gpu_layers" in ast.unparse(v) for v in node.args[0].values):
                offloaded.add(m)
    assert offloaded == {"edgespec.backend.settings"}, offloaded
    assert _defined("is_offloaded") == {"edgespec.backend.settings"}
    assert _callers("auto_cache_type_k") == {"edgespec.backend.settings"}
    assert not ({"offloaded", "_offloaded", "kernel_options"} & {n.name for tree in TREES.values() for n in ast.walk(tree)
                                                                if isinstance(n, ast.FunctionDef)})


def test_one_backend_identity_for_both_caches():
    """The calibration's key and the prompt disk's hash one backend identity
    (backend/identity.py), which also holds model_fingerprint and cpu_name:
    core/ reaches into calibration/ for neither, and no other module spells
    the identity's fields."""
    assert _defined("model_fingerprint") == _defined("cpu_name") == _defined("identity") == {"edgespec.backend.identity"}
    assert {"edgespec.core.prompt_disk", "edgespec.calibration.cache"} <= _callers("identity")
    assert not any(n.startswith("edgespec.calibration") for n in _edges("edgespec.core.prompt_disk"))
    spelled = {m for m in MODULES if any(s.startswith(("fa=", ",fa=", "repack=", ",repack=")) for s in _code_strings(m))}
    assert spelled == {"edgespec.backend.identity"}, spelled
