"""What the tools that run the model zoo share (tools/zoo-report, recompute-report, bf16-report):
the repository's paths, the zoo itself (bench/zoo.py, importable as `zoo` once this is imported)
and the re-execution of a tool under build/venv-zoo (made by tools/setup), where Hugging Face
transformers is installed; GRAFT_ZOO_VENV=DIR runs it under another venv instead (the current
PyTorch stack's, ~/.cache/graft/venv-torch-current, made by tools/setup too)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("GRAFT_ZOO_VENV") or os.path.join(ROOT, "build", "venv-zoo")
BENCH = os.path.join(ROOT, "bench")  # the model zoo (bench/zoo.py): a benchmark, not in the package
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def reexec_in_venv(script):
    """Re-executes `script` (the tool's __file__) with the venv's interpreter, same arguments,
    unless this already is it."""
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        sys.exit(f"{os.path.basename(script)}: {VENV} is missing; run tools/setup first")
    os.execv(py, [py, os.path.abspath(script), *sys.argv[1:]])
