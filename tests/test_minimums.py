"""The integrations' declared minimums are tested, not only the newest releases (issue 28, item 11).

pyproject's ``[lightning]`` and ``[transformers]`` extras say which releases stepprof works
with. This test installs exactly those minimums beside the dev environment (``pip install
--target``, first on ``PYTHONPATH``) and runs the integration tests against them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What those minimums need older than the dev extra installs: transformers 4.48 takes
#: tokenizers < 0.22 and huggingface_hub < 1.0 (installed with their own requirements).
COMPANIONS = ("tokenizers==0.21.4", "huggingface_hub==0.36.2")
TESTS = ("tests/test_lightning.py", "tests/test_transformers.py", "tests/test_integrations_agree.py")


def _minimums() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    pins = {}
    for req in (*extras["lightning"], *extras["transformers"]):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
        assert match, f"{req!r}: an integration's requirement is 'name>=minimum', so that it can be tested"
        pins[match[1]] = match[2]
    return pins


def _release(low: str) -> str:
    """``2.5`` as a package's ``__version__`` gives it: ``2.5.0``."""
    return low + ".0" * (2 - low.count("."))


def test_the_integration_tests_pass_at_the_declared_minimums(tmp_path):
    pins = _minimums()
    assert set(pins) == {"lightning", "transformers", "accelerate"}
    site = str(tmp_path / "site")
    # The minimums alone (the rest of their requirements are the dev environment's), then their
    # older companions with what those need.
    for args in (["--no-deps", *(f"{name}=={low}" for name, low in pins.items())], list(COMPANIONS)):
        install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", site, *args],
                                 capture_output=True, text=True, timeout=600)
        assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, ROOT])}
    probe = "import lightning, transformers, accelerate; print(lightning.__version__, transformers.__version__, accelerate.__version__)"
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert got.stdout.split() == [_release(pins[n]) for n in ("lightning", "transformers", "accelerate")], got.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:]
    passed = re.search(r"(\d+) passed", run.stdout)  # every test ran: none skipped for an import
    assert passed and int(passed[1]) >= 50 and "could not import" not in run.stdout, run.stdout[-3000:]
