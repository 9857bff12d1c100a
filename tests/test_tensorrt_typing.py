"""The TensorRT layer and the dflash plugin registrations type-check against TensorRT's stubs (tensorrt-stubs,
plus our stub of tensorrt.plugin), and the check catches misspelt API calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "builder" / "tensorrt_engine.py"
PLUGINS = ROOT / "plugins" / "tensorrt_plugins.py"
RUNNER = ROOT / "runtime" / "tensorrt_runner.py"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prepared = ROOT / ".typings"
    if (prepared / "tensorrt" / "__init__.pyi").is_file():
        return prepared
    output = tmp_path_factory.mktemp("typings")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_tensorrt_stubs.py"), str(output)], check=True)
    return output


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One incremental cache for this module's runs, fresh per test session: the first run checks torch and the
    stubs, the others only what they plant (about 30 s each without it)."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(path: Path, stubs: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache), str(path)]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "MYPYPATH": str(stubs)}, cwd=ROOT)


@pytest.mark.parametrize("module", [MODULE, PLUGINS, RUNNER], ids=lambda p: p.name)
def test_tensorrt_modules_type_check(module: Path, stubs: Path, mypy_cache: Path) -> None:
    result = _mypy(module, stubs, mypy_cache)
    assert result.returncode == 0, result.stdout


def test_a_planted_misspelling_fails_the_check(stubs: Path, mypy_cache: Path, tmp_path: Path) -> None:
    source = MODULE.read_text()
    assert "builder.build_serialized_network(" in source
    planted = tmp_path / "tensorrt_engine_planted.py"
    planted.write_text(source.replace("builder.build_serialized_network(", "builder.build_serialized_netwrk("))
    result = _mypy(planted, stubs, mypy_cache)
    assert result.returncode != 0
    assert '"Builder" has no attribute "build_serialized_netwrk"' in result.stdout


@pytest.mark.parametrize(
    ("module", "correct", "planted", "message"),
    [
        (PLUGINS, "launch.grid_y = ", "launch.grid_yy = ", '"KernelLaunchParams" has no attribute "grid_yy"'),
        (
            PLUGINS,
            "trtp.SymIntExprs(len(runtime_sizes))",
            "trtp.SymIntExprs(str(len(runtime_sizes)))",
            'Argument 1 to "SymIntExprs" has incompatible type "str"',
        ),
        (RUNNER, "execute_async_v3(", "execute_async_v4(", '"IExecutionContext" has no attribute "execute_async_v4"'),
        (RUNNER, "set_tensor_address(name, tensor.data_ptr())", "set_tensor_address(name, tensor)", "set_tensor_address"),
    ],
    ids=["plugin-attribute", "plugin-argument", "runner-attribute", "runner-argument"],
)
def test_planted_api_errors_fail_the_check(
    module: Path, correct: str, planted: str, message: str, stubs: Path, mypy_cache: Path, tmp_path: Path
) -> None:
    source = module.read_text()
    assert correct in source
    path = tmp_path / f"{module.stem}_planted.py"
    path.write_text(source.replace(correct, planted))
    result = _mypy(path, stubs, mypy_cache)
    assert result.returncode != 0 and message in result.stdout, result.stdout
