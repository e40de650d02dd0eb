"""`ds-scaling-report predict` judged on what its fit never saw: every published table left out of the fit of its
fabric's others (leave-one-table-out), every node count left out of its table's fit (leave-one-node-count-out),
each table extrapolated from its smaller node counts, and each published point of another model and schedule
(DL1 BERT-1.5B) predicted from its fabric's calibration. The test prints every case's error and fails where a
published value falls outside the range printed for it (the parameter range widened by the margin of the OTHER
cases) or where an error exceeds 2.5 points of efficiency. A case prints no range only where its table's record says
its loss is mostly not its collectives', and that claim is checked on the figures, both ways; docs/studies.md
carries the same tables."""
import re

import pytest

from ds_tools import calibration, published, validation, validation_points

FABRICS = ("dgx-a100", "dl1")
POINTS = 2.5          # the accuracy the model is held to, points of efficiency


def test_no_case_is_predicted_by_a_fit_that_saw_it():
    for fabric in FABRICS:
        unexplained = {t.key for t in published.on_fabric(fabric) if t.unexplained is not None}
        for c in validation.cases(fabric):
            if c.kind in ("leave-one-table-out", "across models and schedules"):
                fitted = c.fitted_on.split("; ")
                assert c.table not in fitted, c
                assert not unexplained & set(fitted), c      # an unexplained table fits no other table's case
            else:
                fitted = [int(n) for n in c.fitted_on.split(" at ")[1].split(" ")[0].split("/")]
                assert c.nodes not in fitted, c


@pytest.mark.parametrize("fabric", FABRICS)
def test_out_of_sample_errors_and_ranges(fabric):
    print(f"\n{fabric}: {validation.margin(fabric).text()}\n" + validation.table_md(fabric))
    outside, large, unranged = [], [], []
    for c in validation.cases(fabric):
        key = (c.kind, c.table, c.nodes, round(c.error_points, 2))
        if c.no_range:
            unranged.append(c)
            continue
        if not validation.covered(c):
            outside.append(key)
        if c.kind != "extrapolation" and abs(c.error_points) > POINTS:
            large.append(key)
    assert not outside, f"published values outside their printed range: {outside}"
    assert not large, f"errors beyond {POINTS} points: {large}"
    # a case without a range is one of a table recorded (and shown, below) to be unlike its collectives, predicted
    # from the other tables; its own node counts still predict each other, with ranges
    for c in unranged:
        assert c.kind == "leave-one-table-out" and published.BY_KEY[c.table].unexplained is not None, c
        assert c.no_range.startswith("not predictable from the others: ")
    for key in {c.table for c in unranged}:
        own = [c for c in validation.cases(fabric) if c.table == key and c.kind == "leave-one-node-count-out"]
        assert own and all(validation.covered(c) for c in own)


def test_a_table_is_unexplained_exactly_when_its_figures_say_so():
    """The `unexplained` record is checked against the figures both ways: a table carries it if and only if it loses
    per step more than UNEXPLAINED_RATIO times what its sibling of the same collectives loses, the sibling it names
    is that one, and the fabric's calibration leaves it out and says so."""
    for fabric in FABRICS:
        shown = {s.table: s for s in calibration.siblings(fabric) if s.unexplained}
        recorded = {t.key: t for t in published.on_fabric(fabric) if t.unexplained is not None}
        assert set(shown) == set(recorded), (fabric, [s.text() for s in calibration.siblings(fabric)])
        for key, t in recorded.items():
            assert t.unexplained.sibling == shown[key].sibling
            assert calibration.same_collectives(t, published.BY_KEY[t.unexplained.sibling])
            assert key not in calibration.calibration(fabric).tables
            assert key in calibration.calibration(fabric).describe()
    pairs = {(s.table, s.sibling): s.ratio for s in calibration.siblings("dgx-a100")}
    print("\n" + "\n".join(s.text() for s in calibration.siblings("dgx-a100")))
    # the two phase-2 tables against their phase-1 siblings: the fp16 one within the ratio, the TF32 one far beyond
    assert pairs["dgx-a100/bert-large-p2-fp16", "dgx-a100/bert-large-p1-fp16"] < calibration.UNEXPLAINED_RATIO
    assert pairs["dgx-a100/bert-large-p2-tf32", "dgx-a100/bert-large-p1-tf32"] > 2 * calibration.UNEXPLAINED_RATIO


def test_a_fixed_per_step_term_is_not_identified_by_these_tables():
    """A per-step cost that does not scale with bytes has the bytes term's (1 - 1/N) shape under strong scaling:
    only tables of different gradient bytes separate them. The one pair that differs in nothing else (phase 1, fp16
    and TF32) gives a w the links can carry and a fixed cost of milliseconds; a pair that also differs in phase
    gives a w below the line rates, which no link carries: the pairs disagree, so the model keeps one term, w."""
    pairs = calibration.fixed_term_pairs("dgx-a100")
    clean = [p for p in pairs if p["same_but_bytes"]]
    mixed = [p for p in pairs if not p["same_but_bytes"]]
    print("\n" + "\n".join(map(str, pairs)))
    assert clean and all(p["w_carried"] and 0 < p["fixed_s"] < 0.02 for p in clean)
    assert mixed and not any(p["w_carried"] for p in mixed)


def test_dl1_bert_1p5b_from_the_bert_large_calibration():
    """Another model (BERT-1.5B) and another batch schedule (384 sequences per accelerator kept: weak scaling) on
    DL1, predicted from the BERT-Large calibration, its unpublished 1-node figure over the range its compute can
    have: 82.7 % at 16 nodes lies inside the printed range, and the central error is within the accuracy."""
    p = published.DL1_BERT_1P5B
    (c,) = [c for c in validation.cases("dl1") if c.table == p.key]
    lo, hi = validation.printed_range(c)
    print(f"\n{p.key} at {c.nodes} nodes: published {100 * c.published:.1f} %, predicted {100 * c.central:.2f} % "
          f"(error {c.error_points:+.2f} points), printed range {100 * lo:.2f}-{100 * hi:.2f} %\n{c.note}")
    assert c.kind == "across models and schedules" and c.fitted_on == "dl1/bert-large-p1-bf16"
    assert c.published == 0.827 and c.doublings == 1
    assert lo <= c.published <= hi
    assert abs(c.error_points) <= POINTS
    assert c.low < c.central < c.high
    own, low_mfu, _hi = validation_points.mfus(p)
    assert low_mfu < own and "1-node figure not published" in c.note
    # the 1-node compute step spans the MFU range: from the compute table's MFU down to the lowest published one
    fast, slow = map(float, re.search(r"a 1-node compute step of ([\d.]+)-([\d.]+) s", c.note).groups())
    assert slow / fast == pytest.approx(own / low_mfu, rel=0.01)


def test_the_margin_carries_the_figures_own_reproducibility():
    """NVIDIA's README prints each 1-node configuration twice (its single-node table and the multi-node one); the
    largest difference is added to every dgx-a100 margin; DL1's source prints no figure twice, and says so."""
    pts, why = validation.reproducibility("dgx-a100")
    diffs = {t.key: abs(t.setting("one_node").value / t.table[1] - 1) for t in published.on_fabric("dgx-a100")}
    assert pts == pytest.approx(100 * max(diffs.values())) and 0 < pts < 1
    m = validation.margin("dgx-a100")
    assert m.floor == pts and m.at(2, 0) >= pts and "reproducibility" in m.text()
    assert validation.reproducibility("dl1")[0] == 0.0 and "not known" in validation.margin("dl1").text()


def test_every_table_is_validated_and_the_margin_grows_per_doubling():
    for t in published.PUBLISHED:
        kinds = {c.kind for c in validation.cases(t.fabric) if c.table == t.key}
        assert {"leave-one-node-count-out", "extrapolation"} <= kinds, t.key
        if len(published.on_fabric(t.fabric)) > 1:
            assert "leave-one-table-out" in kinds
    for p in published.POINTS:
        assert any(c.table == p.key for c in validation.cases(p.fabric))
    for fabric in FABRICS:
        m = validation.margin(fabric)
        assert m.per_doubling > 0 and m.at(64, 2) > m.at(64, 1) > m.at(64, 0)


def test_docs_carry_the_validation_tables():
    from conftest import REPO

    text = (REPO / "docs" / "studies.md").read_text(encoding="utf-8")
    for fabric in FABRICS:
        assert validation.table_md(fabric) in text, f"docs/studies.md: regenerate the {fabric} validation table " \
                                                    "(python -m ds_tools.validation)"
        assert validation.margin(fabric).text() in text
    assert validation.checks_md("dgx-a100") in text
