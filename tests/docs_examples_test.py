"""Every ```python block of README.md, CONTRIBUTING.md and docs/*.md runs.

Each block is a self-contained example (its own imports, tiny data) and is
executed as written, under the suite's backend (TensorFlow by default). A
block whose first lines set environment variables that must be set before
Keras starts (e.g. `KERAS_BACKEND=jax` for `keras.distribution`) is marked
with `<!-- docs-test: subprocess -->` on the line before its fence and runs
in a fresh Python process. A block that cannot run here is marked
`<!-- docs-test: skip REASON -->` and is reported as skipped with that
reason. Other fences (```console, ```text, ...) are not run.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(?:<!--\s*docs-test:\s*(?P<marker>[^>]*?)\s*-->\s*\n)?"
    r"^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


def _blocks():
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            marker = match.group("marker") or ""
            yield pytest.param(
                path,
                line,
                match.group("code"),
                marker,
                id=f"{path.relative_to(ROOT)}:{line}",
                # A fresh process is the integration tier's (setup.cfg).
                marks=[pytest.mark.integration] if marker == "subprocess" else [],
            )


BLOCKS = list(_blocks())


def test_examples_are_found():
    # The README alone holds several examples; an extraction that finds
    # none would make every other test here vacuous.
    readme = [b for b in BLOCKS if b.values[0].name == "README.md"]
    assert len(readme) >= 5, [b.id for b in BLOCKS]
    for path in FILES:
        assert path.exists(), path


@pytest.mark.parametrize("path,line,code,marker", BLOCKS)
def test_example_runs(path, line, code, marker, tmp_path, monkeypatch):
    if marker.startswith("skip"):
        reason = marker[len("skip") :].strip(" :")
        assert reason, f"{path}:{line}: a skipped example must say why"
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    if marker == "subprocess":
        script = tmp_path / "example.py"
        script.write_text(code, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"{path}:{line} failed:\n{result.stdout}\n{result.stderr}"
        return
    assert marker == "", f"{path}:{line}: unknown docs-test marker {marker!r}"
    compiled = compile(code, f"{path}:{line}", "exec")
    exec(compiled, {"__name__": "__docs_example__"})  # noqa: S102
