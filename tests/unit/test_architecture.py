"""The architecture's promises, checked on the source tree: the layer order (import-linter), small files,
and method knowledge kept in its package (a sixth method or a new router touches nothing outside it)."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from moeify.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "moeify"
MAX_LINES = 400


def source_files() -> list[Path]:
    return sorted(SOURCE.rglob("*.py"))


def code_tokens(path: Path) -> list[tokenize.TokenInfo]:
    """The file's names and string literals, without comments and docstrings (prose may cite papers)."""
    text = path.read_text()
    docstrings = {node.body[0].value.lineno for node in ast.walk(ast.parse(text))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    return [tok for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and tok.start[0] not in docstrings)]


def mentions(path: Path, names: set[str]) -> set[str]:
    """Which of ``names`` the file's code uses: as an identifier (an import path included) or as a whole
    string literal."""
    found = set()
    for tok in code_tokens(path):
        if tok.type == tokenize.NAME and tok.string in names:
            found.add(tok.string)
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # f-strings
                continue
            if isinstance(value, str):
                found |= {name for name in names if value == name or f"methods.{name}" in value}
    return found


def router_classes() -> set[str]:
    runtime = "\n".join(p.read_text() for p in (SOURCE / "runtime").glob("*.py"))
    return set(re.findall(r"^class (\w+Router)\b", runtime, re.M))


def owner(path: Path) -> str:
    """``methods/<name>/...`` -> name; the registry and every other file -> ''."""
    parts = path.relative_to(SOURCE).parts
    return parts[1] if parts[0] == "methods" and len(parts) > 2 else ""


def test_the_layer_order_and_acyclic_imports_hold():
    """The contracts in pyproject.toml: cli -> api -> methods | report -> loading -> export | training |
    evaluation -> moe -> calibration -> arch -> runtime -> base modules, and no import circle."""
    command = shutil.which("lint-imports")
    assert command, "import-linter is a dev dependency: pip install -e '.[dev]'"
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": str(Path(command).parent)}
    result = subprocess.run([command, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(SOURCE)))
def test_no_source_file_is_over_400_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_method_names_appear_only_in_their_packages_and_the_registry():
    """Core, api, export, report and cli never name a method: what they need of one (its budget
    matcher, runtime options, analyses) they get from its ``Method``. A baseline package may build on
    the method it varies (random_split on cmoe)."""
    names = {method.name for method in METHODS}
    offenders = {str(path.relative_to(SOURCE)): sorted(found) for path in source_files()
                 if path.relative_to(SOURCE).parts[0] != "methods" and (found := mentions(path, names))}
    assert offenders == {}


def test_router_classes_appear_only_in_the_runtime_and_one_method_package():
    routers = router_classes()
    assert {"RepresentativeRouter", "PrototypeRouter", "ThresholdRouter"} <= routers  # the scan sees them
    users: dict[str, set[str]] = {}
    for path in source_files():
        top = path.relative_to(SOURCE).parts[0]
        for name in mentions(path, routers):
            users.setdefault(name, set()).add("runtime" if top == "runtime" else owner(path) or str(path))
    shared = {name: sorted(where - {"runtime"}) for name, where in users.items() if len(where - {"runtime"}) > 1}
    outside = {name: sorted(w for w in where if "/" in w) for name, where in users.items() if any("/" in w for w in where)}
    assert shared == {} and outside == {}


def test_import_moeify_stays_light():
    """``import moeify`` loads none of the heavy or optional dependencies; the API imports them when used."""
    heavy = ("torch", "transformers", "lm_eval", "matplotlib", "scipy", "ortools", "peft")
    script = f"import sys, moeify; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(ROOT / "src")},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_base_install_has_every_package_moeify_imports():
    """``pip install moeify`` (no extras) must run every command: each third-party package the source imports
    is a base dependency in pyproject.toml, except lm-eval (the ``eval`` extra), imported only by the
    harness bridge, which names the extra when it is missing, vLLM, imported only by the serving
    check's child process, which runs in vLLM's own environment (benchmarks/make_vllm_venv.sh),
    llama-cpp-python, one of the two quantisers a k-quant GGUF export may use, named when both are missing,
    and triton, which CUDA builds of torch bring: without it a decoding step takes the grouped path."""
    from importlib.metadata import packages_distributions

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    distributions = packages_distributions()
    imported: dict[str, set[str]] = {}
    for path in (ROOT / "src" / "moeify").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "moeify":
                    imported.setdefault(top, set()).add(path.relative_to(ROOT / "src").as_posix())
    missing = {top: sorted(paths) for top, paths in imported.items()
               if not {d.lower() for d in distributions.get(top, [top])} & base}
    assert missing == {"lm_eval": ["moeify/evaluation/harness.py"], "vllm": ["moeify/evaluation/serving.py"],
                       "llama_cpp": ["moeify/export/gguf/quantize.py"], "triton": ["moeify/runtime/few_pairs.py"]}
    assert "lm-eval" in " ".join(project["optional-dependencies"]["eval"])


def test_the_command_line_parses_without_torch():
    """``moeify --version`` and every ``--help`` build the parser only: no heavy import (torch takes seconds),
    so they answer at once; the commands import what they use when they run."""
    heavy = ("torch", "transformers", "numpy", "safetensors", "lm_eval", "matplotlib", "peft")
    script = ("import sys, time; start = time.perf_counter(); from moeify.cli.main import build_parser; "
              f"build_parser(); print(time.perf_counter() - start, [m for m in {heavy!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(ROOT / "src")},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    seconds, loaded = result.stdout.split(" ", 1)
    assert loaded.strip() == "[]" and float(seconds) < 1.0


@pytest.mark.parametrize("argv,message", [
    (["convert", "--method", "cmoe", "--set", "spec=S1A1", "--out", "{tmp}/o"], "spec='S1A1' must look like"),
    (["convert", "--method", "tomoe", "--set", "stpes=3", "--out", "{tmp}/o"], "unknown option"),
    (["convert", "--method", "more", "--set", "recover_lr=0", "--out", "{tmp}/o"], "recover_lr=0"),
    (["plan", "--method", "dsmoe", "--set", "tau=2"], "tau=2"),
    (["recover", "{tmp}", "--tokens", "100", "--set", "recover_top_k=-1", "--out", "{tmp}/r"], "recover_top_k=-1"),
    (["compare", "--methods", "cmoe", "--recover-tokens", "100", "--set", "recover_parts=heads", "--out", "{tmp}/c"],
     "recover_parts='heads'"),
])
def test_a_bad_option_is_refused_before_torch_is_imported(argv, message, tmp_path):
    """A command validates its options against the method's config and the recovery's before it imports
    torch and transformers' models (seconds): the method registry and every config import neither."""
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    script = ("import sys; from moeify.cli.main import main; code = main(sys.argv[1:]); "
              "print(code, [m for m in ('torch', 'transformers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", script, *argv], env={"PYTHONPATH": str(ROOT / "src")},
                            capture_output=True, text=True)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
    assert message in result.stderr, result.stderr


def test_the_help_names_every_supported_family():
    from moeify.arch.families import FAMILIES
    from moeify.cli.main import FAMILY_NAMES

    spelled = [name.lower().replace("-", "").replace("/llama3", "") for name in FAMILY_NAMES.split(", ")]
    assert spelled == [family.name.replace("_", "") for family in FAMILIES]


def test_the_runtime_copied_beside_converted_models_imports_only_torch_transformers_and_itself():
    """A converted folder loads with trust_remote_code and without moeify installed: the runtime files
    copied into it may import the standard library, torch, transformers and each other only, and triton
    where its absence is caught (few_pairs: the grouped path then runs)."""
    from moeify.export.native import RUNTIME_FILES

    allowed = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
    optional = {"few_pairs.py": {"triton"}}
    for name in RUNTIME_FILES:
        tree = ast.parse((SOURCE / "runtime" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed | optional.get(name, set()), f"runtime/{name}:{node.lineno} imports {roots}"
