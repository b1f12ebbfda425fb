"""The checkout's ``kernels/`` folder (installed as ``gdn_kcp.kernels``) never
shadows the PyPI package ``kernels`` that transformers imports, however the
project runs from the repository root (``python -c``, ``python -m``, pytest,
a script saved there). Each case is a fresh interpreter whose working
directory is the root, so the root is on ``sys.path`` as it is for a user."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "kernels"


def pypi_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def run_from_root(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


# What the child prints: where `kernels` came from, or the import error (then, with
# `with_package`, where `gdn_kcp.kernels` came from: 5 s of imports, so in one case only).
PROBE = """
import sys
print("root on path", any(p in ("", {root!r}) for p in sys.path))
try:
    import kernels
    print("kernels", kernels.__file__)
except ModuleNotFoundError as error:
    print("missing", error)
if {with_package}:
    import gdn_kcp.kernels
    print("gdn_kcp.kernels", gdn_kcp.kernels.__file__)
"""


def check_probe(result: subprocess.CompletedProcess, with_package: bool) -> None:
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["root"] == "on path True", result.stdout  # the case is the shadowing one
    if with_package:
        assert lines["gdn_kcp.kernels"] == str(FOLDER / "__init__.py")
    if pypi_kernels_installed():
        assert "kernels" in lines, result.stdout
        assert not Path(lines["kernels"]).resolve().is_relative_to(FOLDER), lines["kernels"]
    else:
        assert "missing" in lines and "gdn_kcp.kernels" in lines["missing"], result.stdout


@pytest.mark.parametrize("how", ["-c", "-m", "script"])
def test_top_level_kernels_is_not_the_checkout(how, tmp_path):
    """``import kernels`` from the root gets PyPI's package (or, with none
    installed, a ModuleNotFoundError that names ``gdn_kcp.kernels``), and
    ``gdn_kcp.kernels`` stays this project's folder in the same process."""
    with_package = how == "-c"
    code = PROBE.format(root=str(ROOT), with_package=with_package)
    if how == "-c":
        result = run_from_root("-c", code)
    elif how == "-m":  # as `python -m gdn_kcp demo` and `python -m pytest` put the root first
        module = ROOT / "_probe_kernels_name.py"
        module.write_text(code)
        try:
            result = run_from_root("-m", module.stem)
        finally:
            module.unlink()
    else:  # a user's script saved in the checkout: its folder, the root, is sys.path[0]
        script = ROOT / "_probe_kernels_script.py"
        script.write_text(code)
        try:
            result = run_from_root(str(script))
        finally:
            script.unlink()
    check_probe(result, with_package)


def test_pytest_process_imports_the_right_kernels():
    """This pytest process (``python -m pytest`` puts the root on sys.path)."""
    import gdn_kcp.kernels

    assert Path(gdn_kcp.kernels.__file__) == FOLDER / "__init__.py"
    if not pypi_kernels_installed():
        with pytest.raises(ModuleNotFoundError, match="gdn_kcp.kernels"):
            import kernels  # noqa: F401
        return
    import kernels

    assert not Path(kernels.__file__).resolve().is_relative_to(FOLDER), kernels.__file__


def test_transformers_hub_kernels_import_from_root():
    """The reported failure: transformers' hub-kernel module imports names
    from ``kernels`` (``CUDAProperties`` and others) when a model module loads."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    result = run_from_root("-c", "import transformers.integrations.hub_kernels as h, kernels; "
                                 "print(kernels.__file__); print(h.is_kernels_available())")
    assert result.returncode == 0, result.stderr
    path, available = result.stdout.split()
    assert not Path(path).resolve().is_relative_to(FOLDER), path
    assert available == "True"
