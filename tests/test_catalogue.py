"""The pages written from the kit's declarations (kvcheck.catalogue): current, and written from
the declarations alone, so that a property's row comes with the property; a property must
say the contract version it arrived in."""

from __future__ import annotations

import dataclasses

import pytest

from kvcheck import catalogue, failures
from kvcheck.kit import Property
from kvcheck.properties import ALL
from kvcheck.properties.core import CONTENTS, CoreTests
from tests.pytest_run import ROOT

DOCS = ROOT / "docs"


def test_the_generated_pages_are_current():
    assert catalogue.stale(DOCS) == [], "run: python -m kvcheck.catalogue"


def test_a_row_is_its_declaration():
    row = catalogue.rows([CONTENTS], [CoreTests]).splitlines()[-1]
    assert row == (
        f"| contents | `CoreTests` | {CONTENTS.since} | {CONTENTS.severity} | {CONTENTS.title} |"
    )
    told = dataclasses.replace(CONTENTS, holds="each layer holds exactly what was given")
    assert catalogue.rows([told], [CoreTests]).endswith(
        "| each layer holds exactly what was given |"
    )


def test_a_property_no_class_binds_is_named():
    loose = dataclasses.replace(CONTENTS, name="nowhere")
    with pytest.raises(LookupError, match="nowhere"):
        catalogue.bound_by(loose, catalogue.area_classes())


def test_every_property_is_in_its_page():
    page = (DOCS / "properties.md").read_text()
    assert all(f"| {prop.name} |" in page for prop in ALL)


def test_since_is_required_and_a_version_of_the_contract():
    fields = dict(
        name="new", title="t", check=print, strategy=None, severity=failures.WRONG_RESULTS
    )
    with pytest.raises(TypeError, match="since"):
        Property(**fields)
    with pytest.raises(ValueError, match="names no version"):
        Property(**fields, since="0.9")
    assert Property(**fields, since="1.0").since == "1.0"


def test_a_stale_page_is_named_and_rewritten(tmp_path):
    for name in ("properties.md", "reach.md", "interactions.md"):
        (tmp_path / name).write_text((DOCS / name).read_text())
    page = tmp_path / "properties.md"
    page.write_text(page.read_text().replace("| logits | `CoreTests` |", "| logits | `Nope` |"))
    assert catalogue.stale(tmp_path) == [page]
    assert catalogue.main(["--docs", str(tmp_path), "--check"]) == 1
    assert catalogue.main(["--docs", str(tmp_path)]) == 0
    assert catalogue.stale(tmp_path) == []
