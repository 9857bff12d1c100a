"""Make TensorRT's type stubs usable by mypy (TensorRT itself cannot be installed here).

`tensorrt-stubs` ships .pyi files that mypy cannot parse as they are: parameters named `in`, one
non-default parameter after defaults (`add_scale_nd(..., channel_axis)`), and an import of the
unresolvable `tensorrt_libs`. This downloads the wheel, patches those three, and writes the stubs to
OUTPUT (default .typings/), which `make lint` puts on MYPYPATH. `tensorrt.plugin` is not in tensorrt-stubs:
scripts/stubs/tensorrt_plugin.pyi (written from its source) is added as tensorrt/plugin/__init__.pyi.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

STUBS = "tensorrt-stubs==10.13.0.35.1"
PLUGIN_STUB = Path(__file__).parent / "stubs" / "tensorrt_plugin.pyi"


def patch(text: str) -> str:
    text = re.sub(r"\bin: ", "in_: ", text)  # `in` is a keyword
    text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
    return text.replace("import tensorrt_libs as tensorrt_libs\n", "")


def main(output: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", STUBS, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.endswith(".pyi"):
                    target = output / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(patch(archive.read(name).decode("utf-8")))
    plugin = output / "tensorrt" / "plugin" / "__init__.pyi"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(PLUGIN_STUB.read_text())
    print(f"TensorRT stubs ({STUBS}) written to {output}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".typings"))
