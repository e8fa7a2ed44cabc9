"""docs/troubleshooting.md covers every error omni_accel raises: each ``raise`` whose message a user can
see has its longest literal piece on the page (at least its first 48 characters, quoted up to a word
boundary, never cut inside a word), with what it means and the fix."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Caught inside the package (an Unsupported reason becomes a counted fallback, an Unkeyable step runs
# eagerly: not errors) or Python's own protocol (a missing attribute).
INTERNAL = {"Unsupported", "Unkeyable", "AttributeError"}


def _signature(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = [node.value]
    elif isinstance(node, ast.JoinedStr):
        parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
    elif isinstance(node, ast.BinOp):
        return _signature(node.left) or _signature(node.right)
    else:
        return None
    longest = max(parts, key=len, default="").strip()
    return longest if len(longest) >= 12 else None


def raised_messages() -> dict[str, str]:
    """Longest literal piece -> where it is raised, for every user-visible raise with a message."""
    found = {}
    for folder in ("omni_accel", "patches"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                    continue
                func = node.exc.func
                if getattr(func, "id", getattr(func, "attr", None)) in INTERNAL:
                    continue
                signature = _signature(node.exc.args[0])
                if signature:
                    found[signature] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return found


def _quoted_at_a_boundary(page: str, literal: str) -> bool:
    """``literal``'s first 48 characters are on the page, in a quote that ends where a word does."""
    start = page.find(literal[:48])
    if start < 0:
        return False
    end = page.find('"', start)
    quoted = page[start:end] if end >= 0 else ""
    if not literal.startswith(quoted):  # quoted with other text (several messages in one quote)
        return True
    cut = len(quoted)
    return cut == len(literal) or literal[cut] in " ,;:.)" or literal[cut - 1] in " ,;:.("


def test_every_error_message_is_on_the_troubleshooting_page():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = {
        lit[:48]: where for lit, where in raised_messages().items() if not _quoted_at_a_boundary(page, lit)
    }
    assert not missing, "add these to docs/troubleshooting.md (quoted to a word boundary):\n" + "\n".join(
        f"  {where}: {sig!r}" for sig, where in missing.items()
    )
