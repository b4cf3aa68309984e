"""Our kernels/ package shares its import name with Hugging Face's `kernels` distribution, which
transformers 5.25+ requires and imports at model load: with both installed, the one first on
sys.path shadows the other (pyproject.toml pins transformers below 5.25; the Makefile removes a
stray `kernels` from the venv). Checked from the repository root, where ours comes first, as it
does for `make test` and `python -m`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_loads_a_llama_beside_our_kernels_package():
    probe = (
        "import kernels, transformers\n"
        "from transformers.models.llama import configuration_llama\n"  # imports its hub kernels
        "print(kernels.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=120)
    assert done.returncode == 0, (
        "transformers failed to import beside specloop's kernels package (is Hugging Face's "
        f"`kernels` installed? pip uninstall kernels):\n{done.stderr[-2000:]}"
    )
    assert Path(done.stdout.strip()).resolve() == ROOT / "kernels" / "__init__.py"
