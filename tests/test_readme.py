"""README.md stays true: its embed snippet runs on the CPU and decodes what target-only greedy
decoding does, its prose fits 120 columns, and its relative links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```python block"
    return match[1]


def test_embed_snippet_runs_on_the_cpu_and_is_lossless(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from specdec.baseline import GreedyDecoder

    snippet = first_python_block(README)
    code = [line.split("#")[0] for line in snippet.splitlines()]
    assert not any("capture_graphs(" in line for line in code), "graphs need CUDA: keep them in a comment"
    monkeypatch.chdir(ROOT)  # the snippet names examples/tiny_model from the repository root
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    worker, requests = scope["worker"], scope["requests"]
    assert not worker.requests
    assert requests and all(r.finished and len(r.output) == r.max_new_tokens for r in requests)
    assert str([bytes(r.output) for r in requests]) in capsys.readouterr().out
    # Lossless: the same tokens as target-only greedy decoding.
    max_new = requests[0].max_new_tokens
    decoder = GreedyDecoder(scope["target"], [r.prompt for r in requests], max_new, backend="torch_ref")
    for _ in range(max_new - 1):
        decoder.step()
    assert decoder.outputs() == [r.output for r in requests]


def test_prose_lines_fit_120_columns() -> None:
    long = [(n, len(line)) for n, line in enumerate(README.splitlines(), 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def test_relative_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "README.md links to no docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
