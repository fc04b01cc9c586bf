"""The docs that are generated from the code must match the code."""

import io
import os
from contextlib import redirect_stdout

import pytest

from levanter_core.config.reference import main as print_reference

from conftest import REPO


# The reference lists every installed type: keep away from the test that installs the csv
# tracker example for a while (same xdist worker, so never at the same time).
@pytest.mark.xdist_group("installs-tracker-csv")
def test_config_reference_is_up_to_date():
    out = io.StringIO()
    with redirect_stdout(out):
        print_reference()
    with open(os.path.join(REPO, "docs", "config-reference.md")) as f:
        assert f.read() == out.getvalue(), (
            "docs/config-reference.md is stale: run "
            "`python -m levanter_core.config.reference > docs/config-reference.md`"
        )
