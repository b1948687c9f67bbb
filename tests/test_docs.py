"""docs/benchmarks.md is what scripts/benchmarks_doc.py makes of benchmarks/results/*.json."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmarks_doc", ROOT / "scripts" / "benchmarks_doc.py")
doc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doc)


def test_committed_doc_is_rendered_from_committed_results():
    assert (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8") == doc.render()


def test_unknown_and_changed_shapes_render_generically(tmp_path):
    # A new benchmark's file, and a known name whose shape its renderer does not know.
    (tmp_path / "new_bench.json").write_text(json.dumps(
        {"command": "python benchmarks/new_bench.py", "ratio": 1.2345, "work": "/somewhere",
         "rows": [{"mode": "dora", "tok_s": 12345.6}, {"mode": "sync", "ok": True}],
         "skipped_sweep": {"a": {}, "b": {}}}))
    (tmp_path / "sim_modes.json").write_text(json.dumps({"seed": 3, "presets": {"x": {"rows": [{"mode": "m"}]}}}))
    text = doc.render(tmp_path)
    assert "## new_bench\n\nFrom `benchmarks/results/new_bench.json`, written by `python benchmarks/new_bench.py`." in text
    assert "- ratio: 1.23" in text and "/somewhere" not in text and "skipped_sweep" not in text  # nothing in it
    assert "| mode | tok_s | ok |\n|---|---|---|\n| dora | 12,346 | - |\n| sync | - | yes |" in text
    assert "## sim_modes\n\nFrom `benchmarks/results/sim_modes.json`.\n\n- seed: 3" in text


def test_numbers_round_once_to_three_significant_digits_and_four_decimals():
    # 0.83847 rounded first to 4 places (0.8385) and then to 3 digits read 0.839; 999.6 read 1e+03
    values = (0.83847, -0.83847, 0.99996, 0.01234, -0.0247, 0.00641, -0.00848, -0.0, 1e-6, 999.6, -999.6, 1234.5, 1.0)
    assert [doc.cell(v) for v in values] == \
        ["0.838", "-0.838", "1", "0.0123", "-0.0247", "0.0064", "-0.0085", "0", "0", "1,000", "-1,000", "1,234", "1"]
