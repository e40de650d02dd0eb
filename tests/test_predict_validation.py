"""`ds-scaling-report predict` judged on what its fit never saw: every published table left out of the fit of its
fabric's others (leave-one-table-out), every node count left out of its table's fit (leave-one-node-count-out),
and each table extrapolated from its smaller node counts. The test prints every case's error and fails where a
published value falls outside the range printed for it (the parameter range widened by the margin of the OTHER
cases), or where an error exceeds 2.5 points of efficiency, but for the cases named below, each with its reason;
docs/studies.md carries the same tables."""
import pytest

from ds_tools import published, validation

# NVIDIA's phase-2 TF32 table loses 0.23-0.36 s per step at every node count from 2 to 32 (the other three tables
# from the same README and code: 0.01-0.10 s), with the same one all-reduce per step as the others: not the shape of
# any collective, so no fit on the other tables predicts it. Its own node counts predict each other (its
# leave-one-node-count-out cases pass).
P2_TF32 = "dgx-a100/bert-large-p2-tf32"
OUTSIDE_RANGE = {("leave-one-table-out", P2_TF32, n) for n in (4, 16, 32)}
# errors beyond 2.5 points: P2_TF32 above, and the 32-node rows of the two phase-1 tables predicted from the others
# (the fp16 and TF32 tables lose the same seconds at twice the gradient bytes: the bytes-proportional term, fitted on
# tables of the other precision and sequence length, over-predicts at 32 nodes)
LARGE_ERROR = {("leave-one-table-out", P2_TF32, n) for n in (4, 8, 16, 32)} | {
    ("leave-one-table-out", f"dgx-a100/bert-large-p1-{p}", 32) for p in ("fp16", "tf32")}
FABRICS = ("dgx-a100", "dl1")


def test_no_case_is_predicted_by_a_fit_that_saw_it():
    for fabric in FABRICS:
        for c in validation.cases(fabric):
            if c.kind == "leave-one-table-out":
                assert c.table not in c.fitted_on, c
            else:
                fitted = [int(n) for n in c.fitted_on.split(" at ")[1].split(" ")[0].split("/")]
                assert c.nodes not in fitted, c


@pytest.mark.parametrize("fabric", FABRICS)
def test_out_of_sample_errors_and_ranges(fabric, capsys):
    print(f"\n{fabric}:\n" + validation.table_md(fabric))
    outside, large = set(), set()
    for c in validation.cases(fabric):
        key = (c.kind, c.table, c.nodes)
        if not validation.covered(c):
            outside.add(key)
        if c.kind != "extrapolation" and abs(c.error_points) > 2.5:
            large.add(key)
    want_out = {k for k in OUTSIDE_RANGE if k[1].startswith(fabric + "/")}
    want_large = {k for k in LARGE_ERROR if k[1].startswith(fabric + "/")}
    assert outside == want_out, f"published values outside their printed range: {sorted(outside - want_out)}; " \
                                f"named but now inside: {sorted(want_out - outside)}"
    assert large == want_large, f"errors beyond 2.5 points: {sorted(large - want_large)}; named but now within: " \
                                f"{sorted(want_large - large)}"


def test_every_table_is_validated_and_the_margin_grows_per_doubling():
    for t in published.PUBLISHED:
        kinds = {c.kind for c in validation.cases(t.fabric) if c.table == t.key}
        assert {"leave-one-node-count-out", "extrapolation"} <= kinds, t.key
        if len(published.on_fabric(t.fabric)) > 1:
            assert "leave-one-table-out" in kinds
    for fabric in FABRICS:
        m = validation.margin(fabric)
        assert m.per_doubling > 0 and m.at(64, 2) > m.at(64, 1) > m.at(64, 0)


def test_docs_carry_the_validation_tables():
    from conftest import REPO

    text = (REPO / "docs" / "studies.md").read_text(encoding="utf-8")
    for fabric in FABRICS:
        assert validation.table_md(fabric) in text, f"docs/studies.md: regenerate the {fabric} validation table " \
                                                    "(python -m ds_tools.validation)"
