"""The docs that are generated from the code must match the code."""

import io
import os
from contextlib import redirect_stdout

import pytest

from conftest import REPO
from levanter_core.config.reference import main as print_reference


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


def _code_block_after(text: str, marker: str) -> str:
    start = text.index("```python", text.index(marker)) + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_guides_family_in_sixty_lines_is_the_code():
    """`docs/adding-an-architecture.md` shows the whole of llama.py but its docstring; and its
    Mistral and Phi-3 excerpts are lines of those files."""
    with open(os.path.join(REPO, "docs", "adding-an-architecture.md")) as f:
        guide = f.read()
    plugin = os.path.join(REPO, "plugins", "models-llama", "levanter_model_llama")
    with open(os.path.join(plugin, "llama.py")) as f:
        llama = f.read()
    shown = _code_block_after(guide, "This is the whole of `llama.py` but its module docstring:")
    body = llama[llama.index('"""', 3) + 3 :].split("\n\nLlamaLMHeadModel")[0].strip()
    assert body.replace("from __future__ import annotations\n\n", "") == shown.strip()
    excerpts = (("### A variant in the same plugin: Mistral", "mistral.py"), ("## 6. Fused layouts", "phi3.py"))
    for marker, file in excerpts:
        with open(os.path.join(plugin, file)) as f:
            source = f.read()
        for line in _code_block_after(guide, marker).splitlines():
            assert line.strip() in source, f"{file}: {line!r} is in the guide but not in the code"
