"""Report.has: whether a finding of a code at a field was reported, kept by add()."""

from __future__ import annotations

from shardcheck.verification.findings import ERROR, WARNING, Report


def test_has_knows_each_finding_added_by_its_code_and_field() -> None:
    report = Report(model="m.onnx", hints="h.json")
    assert not report.has("SC104", "inputs[name=x].rank")
    report.add("SC104", ERROR, "inputs[name=x].rank", "rank 2 given for 'x'; it has rank 3")
    report.add("SC110", WARNING, "attention_layers[q=q0]", "layer skipped")
    assert report.has("SC104", "inputs[name=x].rank")
    assert report.has("SC110", "attention_layers[q=q0]")
    assert not report.has("SC104", "inputs[name=y].rank")  # another field
    assert not report.has("SC101", "inputs[name=x].rank")  # another code


def test_a_judged_report_has_only_the_findings_it_kept() -> None:
    report = Report(model="m.onnx", hints="h.json")
    report.add("SC104", ERROR, "inputs[name=x].rank", "rank 2 given for 'x'; it has rank 3")
    report.add("SC110", WARNING, "attention_layers[q=q0]", "layer skipped")
    judged = report.judged(ignore=["SC110"])
    assert judged.has("SC104", "inputs[name=x].rank")
    assert not judged.has("SC110", "attention_layers[q=q0]")
    assert report.has("SC110", "attention_layers[q=q0]")  # the report judged is unchanged
