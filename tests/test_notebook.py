"""The example notebook (docs/examples/compare_policies.ipynb) runs top to bottom in a fresh kernel, from an
empty folder, and draws its figure: the docs' example is a tested program, not a transcript.
Not in the `quick` subset (tests/conftest.py QUICK): nine simulations and a kernel start, about a minute."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "docs" / "examples" / "compare_policies.ipynb"


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_the_example_notebook_runs_and_draws_its_figure(tmp_path, monkeypatch):
    # the kernel imports this checkout's testbed, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [base64.b64decode(o.data["image/png"]) for o in outputs
            if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(pngs) == 1 and pngs[0].startswith(b"\x89PNG")
    saved = tmp_path / "compare_policies.png"
    assert saved.read_bytes().startswith(b"\x89PNG")

    # the figure has one line per policy in each panel, and the sweep's table one row per job
    import matplotlib.image as mpimg

    assert mpimg.imread(saved).std() > 0.01  # not a blank canvas
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    for policy in ("vllm", "sarathi", "orca"):
        assert text.count(policy) >= 3, policy  # a row per load in the table
    assert "scheduler.max_num_seq: unknown key (did you mean scheduler.max_num_seqs?)" in text
    assert list(tmp_path.iterdir()) == [saved]  # the API wrote nothing of its own (no output_dir given)
