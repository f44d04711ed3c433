"""Record Polygraphy 0.53.6's pattern-1 output under onnx-graphsurgeon 0.5.8.

With onnx-graphsurgeon >= 0.6, Polygraphy's pattern 1 matches nothing (the new matcher counts
the second Sqrt of the scale as an outside consumer). shardcheck follows 0.5.8, where the pattern
matches; this script records that oracle once, into tests/data/polygraphy_gs058/, for the parity
test. It needs its own environment, because graphsurgeon 0.5.8 needs onnx < 1.18:

    python -m venv /tmp/gs058 && /tmp/gs058/bin/pip install polygraphy==0.53.6 \
        onnx-graphsurgeon==0.5.8 "onnx<1.18" numpy
    /tmp/gs058/bin/python tests/oracle/record_gs058.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from parity_cases import FIXTURES, OPTION_CASES, uses_pattern1  # noqa: E402


def main() -> None:
    import onnx_graphsurgeon
    from polygraphy.tools import main as polygraphy_main

    assert onnx_graphsurgeon.__version__.startswith("0.5."), onnx_graphsurgeon.__version__
    out_dir = ROOT / "tests" / "data" / "polygraphy_gs058"
    out_dir.mkdir(parents=True, exist_ok=True)
    for fixture in FIXTURES:
        for case, args in OPTION_CASES.items():
            if not uses_pattern1(args):
                continue
            target = out_dir / f"{fixture}.{case}.json"
            model = ROOT / "fixtures" / f"{fixture}.onnx"
            code = polygraphy_main(
                ["template", "shard-hints", str(model), "-o", str(target), *args]
            )
            assert code in (0, None), (fixture, case, code)
            document = json.loads(target.read_text())
            target.write_text(json.dumps(document, indent=4) + "\n")


if __name__ == "__main__":
    main()
