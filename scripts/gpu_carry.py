"""Prepare .gpu-carry/ for scripts/gpu_check.sh on a GPU machine without network (the device tool's H200: Python
3.12, torch, triton and CUDA, but no pydantic, no tritonserver, no tritonclient, and NumPy 2, under which Triton
2.51's Python backend answers with empty outputs). Run here, on a machine with network and this project's .venv
(nvidia-pytriton installed):  python scripts/gpu_carry.py   It writes

  .gpu-carry/pair/               the tests' tiny pair and its CPU engine's outputs (gpu_check.py --prepare, ~3 CPU minutes)
  .gpu-carry/env-py3.12.tar.xz   wheels of what the GPU machine's Python lacks to import dflash_trt, NumPy < 2 among them
                                 (tests left out), which gpu_check.sh installs into it
  .gpu-carry/site-py3.12.tar.xz  a site-packages tree for PYTHONPATH: pytriton's tritonserver (server, Python backend, the
                                 stub for the GPU machine's Python, the bundled libraries they load, found by their
                                 ELF NEEDED entries, symbols stripped), tritonclient and its compiled dependencies

and fails if the repository's tree and .gpu-carry together pass what the device tool moves (64 MiB).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytriton

REPO = Path(__file__).resolve().parent.parent
TRANSFER_LIMIT = 64 * 2**20  # bytes the device tool moves: the working tree and the carried paths together
ENV_PACKAGES = ("numpy", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")  # the H200 image lacks
SITE_PACKAGES = ("tritonclient", "protobuf", "python-rapidjson")  # the client (grpcio: the image has it)
LEFT_OUT = ("tests", "distutils")  # directories nothing here imports (numpy's tests are 3.3 MB of 27)


def log(message: str) -> None:
    print(f"[gpu-carry] {message}", file=sys.stderr, flush=True)


def download_wheels(packages: tuple[str, ...], python: str, directory: Path) -> list[Path]:
    """The binary wheels for CPython `python` (e.g. "3.12") on x86-64 Linux of the versions this environment runs,
    without their dependencies (listed here)."""
    abi = "cp" + python.replace(".", "")
    requirements = [f"{package}=={version(package)}" for package in packages]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "none",
               "--platform", "manylinux1_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
               "--platform", "any", "-d", str(directory), *requirements]  # fmt: skip
    subprocess.run(command, check=True)
    return sorted(directory.glob("*.whl"))


def kept(name: str) -> bool:
    return not set(name.split("/")[:-1]) & set(LEFT_OUT)


def stored_wheel(wheel: Path, directory: Path) -> None:
    """`wheel` rewritten into `directory` uncompressed (the xz around it compresses far better than zip's deflate:
    NumPy 17 MiB as a wheel, 8 MiB this way) without LEFT_OUT directories, its RECORD listing what is left."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(directory / wheel.name, "w", zipfile.ZIP_STORED) as copy:
        for item in source.infolist():
            if not kept(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if kept(line.split(b",")[0].decode()))
            copy.writestr(item, data, compress_type=zipfile.ZIP_STORED)


def unpacked_wheels(packages: tuple[str, ...], python: str, tree: Path) -> None:
    """`download_wheels` unpacked into `tree` (what pip's install of these wheels writes), LEFT_OUT left out."""
    with tempfile.TemporaryDirectory() as downloads:
        for wheel in download_wheels(packages, python, Path(downloads)):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(tree, members=[name for name in archive.namelist() if kept(name)])


def needed_libraries(binaries: list[Path], bundled: Path) -> list[Path]:
    """The libraries of `bundled` that `binaries` load, directly or through each other (ELF NEEDED entries)."""
    found: dict[str, Path] = {}
    pending = list(binaries)
    while pending:
        dynamic = subprocess.run(["readelf", "-d", str(pending.pop())], capture_output=True, text=True, check=True).stdout
        for line in dynamic.splitlines():
            if "(NEEDED)" in line:
                name = line.rsplit("[", 1)[1].rstrip("]")
                if name not in found and (bundled / name).is_file():
                    found[name] = bundled / name
                    pending.append(found[name])
    return sorted(found.values())


def add_server(python: str, tree: Path) -> None:
    """pytriton/tritonserver (server, Python backend, the stub for `python`) and the libraries they need, stripped,
    under an empty pytriton package (dflash-serve finds the server through it), laid out as in site-packages."""
    site = Path(pytriton.__file__).resolve().parent.parent
    server = site / "pytriton" / "tritonserver"
    stub = server / "python_backend_stubs" / python / "triton_python_backend_stub"
    binaries = [server / "bin" / "tritonserver", *(server / "backends" / "python").glob("*.so"), stub]
    libraries = needed_libraries(binaries, site / "nvidia_pytriton.libs")
    utils = server / "backends" / "python" / "triton_python_backend_utils.py"
    for path in [*binaries, *libraries, utils]:
        copy = tree / path.relative_to(site)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, copy)
        if path != utils:
            subprocess.run(["strip", "--strip-unneeded", str(copy)], check=True)  # debug symbols: most of their size
    (tree / "pytriton" / "__init__.py").write_text("")
    log(f"tritonserver with {len(libraries)} of its libraries")


def write_tar_xz(tree: Path, output: Path) -> None:
    with tarfile.open(output, "w:xz", preset=9) as archive:
        for path in sorted(tree.iterdir()):
            archive.add(path, path.name, filter=lambda info: None if "__pycache__" in info.name else info)
    log(f"{output.name}: {output.stat().st_size / 2**20:.1f} MiB")


def tree_bytes() -> int:
    """Bytes of what the device tool copies of the repository: tracked and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout  # fmt: skip
    return sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if name and (REPO / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=REPO / ".gpu-carry")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version (default: %(default)s)")
    parser.add_argument("--keep-pair", action="store_true", help="keep an existing pair/ instead of preparing it again")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    if not (args.keep_pair and (args.output / "pair" / "expected.json").is_file()):
        log("the tiny pair and its CPU engine's outputs ...")
        prepare = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--prepare", str(args.output / "pair")]
        subprocess.run(prepare, check=True)
    with tempfile.TemporaryDirectory() as scratch:
        downloads, env, site = (Path(scratch) / name for name in ("downloads", "env", "site"))
        env.mkdir()
        for wheel in download_wheels(ENV_PACKAGES, args.python, downloads):
            stored_wheel(wheel, env)
        write_tar_xz(env, args.output / f"env-py{args.python}.tar.xz")
        unpacked_wheels(SITE_PACKAGES, args.python, site)
        add_server(args.python, site)
        write_tar_xz(site, args.output / f"site-py{args.python}.tar.xz")
    carried = sum(p.stat().st_size for p in args.output.rglob("*") if p.is_file())
    total = carried + tree_bytes()
    log(f".gpu-carry {carried / 2**20:.1f} MiB + working tree = {total / 2**20:.1f} MiB (the device tool moves 64)")
    if total > TRANSFER_LIMIT:
        log("over the limit: the device tool would refuse the call")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
