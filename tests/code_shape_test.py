"""The shipped package stays small and readable: limits checked on its source."""

import ast
import pathlib

from absl.testing import absltest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_bn"
MAX_LAYER_LINES = 586  # keras/src/layers/normalization/batch_normalization.py (Keras 3.15).
MAX_FUNCTION_LINES = 60  # Body lines, the docstring aside.


def _shipped_modules():
    return [p for p in sorted(PACKAGE.glob("*.py")) if not p.name.endswith("_test.py")]


def _body_lines(function):
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # The docstring.
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


class CodeShapeTest(absltest.TestCase):
    def test_layer_file_is_no_longer_than_keras_own(self):
        lines = (PACKAGE / "batch_normalization.py").read_text().count("\n")
        self.assertLessEqual(lines, MAX_LAYER_LINES)

    def test_layer_constructor_signature_and_body_fit_the_limit(self):
        tree = ast.parse((PACKAGE / "batch_normalization.py").read_text())
        (init,) = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name == "__init__"
        ]
        self.assertLessEqual(init.end_lineno - init.lineno + 1, MAX_FUNCTION_LINES)

    def test_no_shipped_function_body_exceeds_the_limit(self):
        long = []
        for path in _shipped_modules():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if _body_lines(node) > MAX_FUNCTION_LINES:
                        long.append(f"{path.name}:{node.lineno} {node.name} {_body_lines(node)}")
        self.assertEqual(long, [])

    def test_shipped_modules_import_no_test_code(self):
        for path in _shipped_modules():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                    self.assertFalse(
                        any(n == "tests" or n.startswith("tests.") for n in names), path.name
                    )


if __name__ == "__main__":
    absltest.main()
