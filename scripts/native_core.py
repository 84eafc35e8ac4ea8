"""Compile the I/O-free core (``proxy/core``) with mypyc, or remove the compiled modules.

``python scripts/native_core.py build`` (``make native``) compiles every
module of ``proxy/core`` into an extension module next to its source; Python
then imports the compiled one (extension modules are found before sources).
The code is the same ``mypy --strict`` source; nothing else changes. It takes
about 25 s on two cores and needs a C compiler and the Python headers.

``python scripts/native_core.py clean`` (``make pure``) removes them: the pure
Python core is always there and is what a plain install runs.

``python scripts/native_core.py status`` prints which core an import gets.

``--installed`` acts on the ``proxy`` package the running interpreter imports
instead of this checkout's: after ``pip install /path/to/checkout`` into a
service venv (with ``mypy`` installed there too, for mypyc),
``/opt/omni-sidecar/venv/bin/python scripts/native_core.py build --installed``.

``proxy/native.py`` (imported by ``proxy/__init__.py``) refuses a compiled
core older than its source (edit, forget to rebuild, measure the old code: not on our watch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

__all__ = ["CORE", "compiled_modules", "main"]

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "proxy" / "core"


def core_sources() -> list[Path]:
    return sorted(p for p in CORE.glob("*.py") if p.name != "__init__.py")


def compiled_modules() -> list[Path]:
    """Extension modules in ``proxy/core`` (the modules and mypyc's runtime parts)."""
    return sorted(CORE.glob("*.so")) + sorted(CORE.glob("*.pyd"))


def build() -> int:
    import os
    import shutil

    from mypyc.build import mypycify  # the test extra's mypy ships mypyc
    from setuptools import setup

    sources = [str(p.relative_to(ROOT)) for p in core_sources()]
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="omni-sidecar-mypyc-") as tmp:
        os.chdir(ROOT)  # mypyc names modules by their path from here
        try:
            # separate=True: one self-contained extension per module (plus its
            # runtime part), so each goes next to its source.
            extensions = mypycify(
                sources, separate=True, opt_level="3", target_dir=str(Path(tmp) / "c")
            )
        finally:
            os.chdir(here)
        lib = Path(tmp) / "lib"
        os.chdir(tmp)  # not the checkout: setuptools would read its pyproject.toml
        try:
            setup(
                name="omni-sidecar-native-core",
                ext_modules=extensions,
                script_args=[
                    "-q",
                    "build_ext",
                    "--build-temp",
                    str(Path(tmp) / "temp"),
                    "--build-lib",
                    str(lib),
                ],
            )
        finally:
            os.chdir(here)
        built = sorted((lib / "proxy" / "core").glob("*.so"))
        clean(quiet=True)
        for path in built:
            shutil.copy2(path, CORE / path.name)
    print(f"compiled {len(sources)} core modules: {', '.join(Path(s).stem for s in sources)}")
    return 0


def clean(*, quiet: bool = False) -> int:
    removed = compiled_modules()
    for path in removed:
        path.unlink()
    if not quiet:
        print(f"removed {len(removed)} compiled modules; the core is pure Python")
    return 0


def status() -> int:
    import proxy.native

    print(proxy.native.CORE_BUILD)
    return 0


def main(argv: list[str] | None = None) -> int:
    global ROOT, CORE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "clean", "status"))
    parser.add_argument(
        "--installed",
        action="store_true",
        help="the proxy package this interpreter imports (e.g. a venv's site-packages after "
        "`pip install .`), not this checkout's",
    )
    ns = parser.parse_args(argv)
    if ns.installed:
        import importlib.util

        spec = importlib.util.find_spec("proxy")
        if spec is None or spec.origin is None:
            parser.error("no installed proxy package: pip install omni-sidecar first")
        ROOT = Path(spec.origin).resolve().parent.parent
        CORE = ROOT / "proxy" / "core"
    else:
        sys.path.insert(0, str(ROOT))
    return {"build": build, "clean": clean, "status": status}[ns.action]()


if __name__ == "__main__":
    sys.exit(main())
